"""Stage 2, merge per hunk. For every file a patch touches:

  base   = the old upstream file with the earlier old patches applied
  ours   = base with this patch applied (the old patched file)
  theirs = the new upstream file with the earlier *ported* patches applied

`git merge-file` merges ours and theirs over base once per hunk (to tell which hunk conflicts,
and which one upstream already has) and once for the whole file (the result).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from ..anchors import anchor_at, hunk_anchor_line
from ..errors import UsageError
from .. import gitcmd
from ..series import FilePatch, Hunk, Patch, split_lines
from ..verdicts import check_hunk
from .drop import upstream_has
from .relocate import relocate
from .result import CONFLICT, LABELS, MERGED, RELOCATED, UPSTREAM, HunkPort, PortResult
from .review import locate
from .stamp import new_file_content


def merge_file(ours: bytes, base: bytes, theirs: bytes) -> tuple[int, bytes]:
    """(number of conflicts, merged bytes with diff3 conflict markers) from `git merge-file`."""
    with tempfile.TemporaryDirectory(prefix="eaglepatch-merge-") as td:
        paths = []
        for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = Path(td) / name
            p.write_bytes(data)
            paths.append(str(p))
        args = ["merge-file", "-p", "--diff3"]
        for lab in LABELS:
            args += ["-L", lab]
        r = gitcmd.run(args + paths, Path(td), env=gitcmd.clean_env(ceiling=Path(td)), check=False)
    if r.returncode < 0 or r.returncode > 127:
        raise UsageError(f"git merge-file failed: {r.stderr.decode(errors='replace').strip()}",
                         "install git 2.x and check the input files")
    return r.returncode, r.stdout


def conflict_regions(merged: bytes) -> list[dict]:
    """[{line (1-based in the merged output), label -> text}] of each diff3 conflict region."""
    out, cur, key = [], None, None
    for n, ln in enumerate(split_lines(merged), 1):
        s = ln.decode("utf-8", errors="replace")
        if s.startswith("<<<<<<< " + LABELS[0]):
            cur, key = {"line": n, LABELS[0]: "", LABELS[1]: "", LABELS[2]: ""}, LABELS[0]
        elif cur is not None and s.startswith("||||||| " + LABELS[1]):
            key = LABELS[1]
        elif cur is not None and s.rstrip("\n") == "=======":
            key = LABELS[2]
        elif cur is not None and s.startswith(">>>>>>> " + LABELS[2]):
            out.append(cur)
            cur = None
        elif cur is not None:
            cur[key] += s
    return out


def _first_sides(merged: bytes) -> tuple[int | None, dict]:
    regions = conflict_regions(merged)
    if not regions:
        return None, {}
    return regions[0]["line"], {k: v for k, v in regions[0].items() if k != "line"}


def apply_hunk(lines: list[bytes], h: Hunk) -> tuple[list[bytes], int]:
    """`lines` with hunk `h` applied at its exact (zero-fuzz) place; (new lines, 0-based position)."""
    expected = h.source_start - 1 if h.source_length else h.source_start
    v, pos, detail = check_hunk(lines, h, max(expected, 0))
    if pos is None or v not in ("exact", "offset"):
        raise UsageError(f"hunk {h.index} of {h.file} does not apply to its own base ({v}: {detail})",
                         "verify the old series against its release first (tools/verify.py)")
    return lines[:pos] + h.new + lines[pos + len(h.old):], pos


def apply_file(data: bytes | None, fp: FilePatch) -> bytes | None:
    if fp.is_new:
        return b"".join(b"".join(h.new) for h in fp.hunks)
    if fp.is_deleted:
        return None
    lines = split_lines(data)
    for h in reversed(fp.hunks):  # from the bottom: earlier positions stay valid
        lines, _ = apply_hunk(lines, h)
    return b"".join(lines)


def hunk_anchor(source: bytes, h: Hunk, pos: int | None = None) -> str:
    if pos is None:
        pos = h.source_start - 1 if h.source_length else h.source_start
    k, ins = h.first_change()
    return anchor_at(source, hunk_anchor_line(pos, k, ins))[0]


def file_diff(patch: Patch, path: str) -> bytes:
    """The part of `patch`'s diff that changes `path` (what a .rej file holds)."""
    parts = re.split(rb"(?m)^(?=diff --git )", patch.body)
    for part in parts:
        first = part.split(b"\n", 1)[0]
        if first.startswith(b"diff --git ") and first.endswith(b" b/" + path.encode()):
            return part
    return patch.body


def _text(lines) -> str:
    return "".join(x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in lines)


class Trees:
    """The file contents a port walks through: the old release as the old patches change it, the
    new release as it comes (`new_upstream`) and as the ported patches change it (`new_state`)."""

    def __init__(self, old_read, new_read):
        self.old_read, self.new_read = old_read, new_read
        self.old_state: dict[str, bytes | None] = {}
        self.new_state: dict[str, bytes | None] = {}
        self.new_upstream: dict[str, bytes | None] = {}
        self.created: dict[str, bytes] | None = None  # what the new series creates (the overlay)
        # a conflicting file as `port.py --checkout` leaves it: every hunk that merges applied, each
        # conflicting one marked in place (diff3 markers); `rejects`: the file's diff where no merge
        # can mark it (the new release has no such file, or changed the file to delete)
        self.marked: dict[str, bytes] = {}
        self.rejects: dict[str, bytes] = {}

    def old(self, path: str) -> bytes | None:
        if path not in self.old_state:
            self.old_state[path] = self.old_read(path)
        return self.old_state[path]

    def new(self, path: str) -> bytes | None:
        if path not in self.new_state:
            if path not in self.new_upstream:
                self.new_upstream[path] = self.new_read(path)
            self.new_state[path] = self.new_upstream[path]
        return self.new_state[path]

    def upstream(self, path: str) -> bytes | None:
        """The new release's own file (never changed by the port)."""
        return self.new_upstream[path] if path in self.new_upstream else self.new_read(path)


class FileMerge:
    """The merge of one file of one patch; `run()` -> (conflicted, changed the new file)."""

    def __init__(self, res: PortResult, trees: Trees, patch: Patch, fp: FilePatch, to_release: str,
                 series_version: str):
        self.res, self.trees, self.patch, self.fp = res, trees, patch, fp
        self.to_release, self.series_version = to_release, series_version
        self.base = trees.old(fp.path)
        self.ours = apply_file(self.base, fp)
        self.theirs = trees.new(fp.path)
        trees.old_state[fp.path] = self.ours

    def _all(self, status: str, detail: str, anchor: str = "<module>", line=None, sides=None) -> None:
        for h in self.fp.hunks:
            self.res.hunks.append(HunkPort(self.patch.name, self.fp.path, h.index, anchor, status, detail, line,
                                           dict(sides or {})))

    def run(self) -> tuple[bool, bool]:
        if self.fp.is_new:
            return self._new_file()
        if self.fp.is_deleted:
            return self._deleted_file()
        if self.theirs is None:
            for h in self.fp.hunks:
                self.res.hunks.append(HunkPort(self.patch.name, self.fp.path, h.index, hunk_anchor(self.base, h),
                                               CONFLICT, "the new release has no such file"))
            self.trees.rejects[self.fp.path] = file_diff(self.patch, self.fp.path)
            return True, False
        return self._modified_file()

    def _new_file(self) -> tuple[bool, bool]:
        content = new_file_content(self.ours, self.fp.path, self.to_release, self.series_version,
                                   self.trees.created)
        if self.theirs is None:
            self.trees.new_state[self.fp.path] = content
            self._all(MERGED, "new file", line=1)
            return False, True
        if upstream_has(content, self.theirs):
            self._all(UPSTREAM, "the new release has this file with the same content")
            return False, False
        self._all(CONFLICT, "the new release has a file of this name with other content", line=1,
                  sides={LABELS[0]: _text([content]), LABELS[1]: "", LABELS[2]: _text([self.theirs])})
        self.trees.marked[self.fp.path] = merge_file(content, b"", self.theirs)[1]
        return True, False

    def _deleted_file(self) -> tuple[bool, bool]:
        if self.theirs is None:
            self._all(UPSTREAM, "the new release no longer has this file")
            return False, False
        if self.theirs == self.base:
            self.trees.new_state[self.fp.path] = None
            self._all(MERGED, "file deleted")
            return False, True
        self._all(CONFLICT, "the file to delete changed upstream")
        self.trees.rejects[self.fp.path] = file_diff(self.patch, self.fp.path)
        return True, False

    def _modified_file(self) -> tuple[bool, bool]:
        """Hunk by hunk onto the new file: a 3-way merge each (which one conflicts, which one
        upstream already has); a hunk that conflicts only because its context changed is
        relocated by its neighbouring statements (``port.relocate``) and marked for review."""
        base, theirs = self.base, self.theirs
        base_lines = split_lines(base)
        state, conflicted, unmerged = theirs, False, []
        for h in self.fp.hunks:
            one, pos = apply_hunk(base_lines, h)
            anchor = hunk_anchor(base, h, pos)
            n, merged = merge_file(b"".join(one), base, state)
            if not n:
                status = UPSTREAM if upstream_has(merged, state) else MERGED
                detail = "the new upstream file already has this change" if status == UPSTREAM else ""
                self.res.hunks.append(HunkPort(self.patch.name, self.fp.path, h.index, anchor, status, detail))
                state = merged
                continue
            moved = relocate(base, h, pos, state)
            if moved is not None:
                self.res.hunks.append(HunkPort(self.patch.name, self.fp.path, h.index, anchor, RELOCATED,
                                               moved.note, moved.line, review=moved.note))
                state = moved.data
                continue
            conflicted = True
            unmerged.append(b"".join(one))
            line, sides = _first_sides(merged)
            self.res.hunks.append(HunkPort(self.patch.name, self.fp.path, h.index, anchor, CONFLICT,
                                           f"{n} conflict region(s) in the 3-way merge", line, sides))
        if conflicted:
            marked = state  # the hunks that merged, then each conflicting one merged with its markers
            for one in unmerged:
                marked = merge_file(one, base, marked)[1]
            self.trees.marked[self.fp.path] = marked
            return True, False
        self.trees.new_state[self.fp.path] = state
        locate(self.res, self.patch.name, self.fp.path, theirs, state, base)
        return False, not upstream_has(state, theirs)


def merge_patch(res: PortResult, trees: Trees, patch: Patch, to_release: str, series_version: str) -> tuple[bool, bool]:
    """Merge every file of `patch`; (some hunk conflicted, the new release changed)."""
    conflicted = changed_any = False
    for fp in patch.files:
        c, changed = FileMerge(res, trees, patch, fp, to_release, series_version).run()
        conflicted |= c
        changed_any |= changed
    return conflicted, changed_any
