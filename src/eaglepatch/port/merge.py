"""Stage 2, merge per hunk. For every file a patch touches:

  base   = the old upstream file with the earlier old patches applied
  ours   = base with this patch applied (the old patched file)
  theirs = the new upstream file with the earlier *ported* patches applied

`git merge-file` merges ours and theirs over base once per hunk (to tell which hunk conflicts,
and which one upstream already has) and once for the whole file (the result).
"""

from __future__ import annotations

import ast
import re
import tempfile
from collections import Counter
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


def _key(region: dict) -> tuple:
    return tuple(region[lab] for lab in LABELS)


def marker_anchor(marked: bytes, line: int) -> str | None:
    """The def/class (qualified name) that encloses the conflict region whose `<<<<<<<` marker is
    at `line` (1-based) of `marked`, the file as written, markers and all: the file is read with
    every region replaced by its new-upstream side (else, when that does not parse, its
    old-patched side) and the region's first line looked up there (an empty side: the line
    before it, as for an insertion). None when the marker is not there or neither reading parses."""
    src = split_lines(marked)
    for side in (LABELS[2], LABELS[0]):
        out, at, key, start, empty = [], None, None, 0, False
        for n, ln in enumerate(src, 1):
            s = ln.decode("utf-8", errors="replace")
            if key is None and s.startswith("<<<<<<< " + LABELS[0]):
                key, start = LABELS[0], len(out)
                if n == line:
                    at = start + 1
                continue
            if key is not None and s.startswith("||||||| " + LABELS[1]):
                key = LABELS[1]
                continue
            if key is not None and s.rstrip("\r\n") == "=======":
                key = LABELS[2]
                continue
            if key is not None and s.startswith(">>>>>>> " + LABELS[2]):
                if at == start + 1 and len(out) == start:
                    empty = True
                key = None
                continue
            if key is None or key == side:
                out.append(ln)
        if at is None:
            return None
        source = b"".join(out)
        try:
            ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        return anchor_at(source, max(at - 1, 1) if empty else at)[0]
    return None


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
            line, sides = _first_sides(merged)
            hp = HunkPort(self.patch.name, self.fp.path, h.index, anchor, CONFLICT,
                          f"{n} conflict region(s) in the 3-way merge", line, sides)
            self.res.hunks.append(hp)
            unmerged.append((hp, b"".join(one)))
        if conflicted:
            marked = state  # the hunks that merged, then each conflicting one merged with its markers
            made = []
            for hp, one in unmerged:
                had = Counter(_key(r) for r in conflict_regions(marked))
                marked = merge_file(one, base, marked)[1]
                made.append((hp, Counter(_key(r) for r in conflict_regions(marked)) - had))
            self.trees.marked[self.fp.path] = marked
            self._place(marked, made)
            return True, False
        self.trees.new_state[self.fp.path] = state
        locate(self.res, self.patch.name, self.fp.path, theirs, state, base)
        return False, not upstream_has(state, theirs)


    def _place(self, marked: bytes, made: list) -> None:
        """Each conflicting hunk as the file is written (`marked`, what `--checkout` leaves):
        the line of its `<<<<<<<` marker, the sides of that region, and the def/class enclosing
        the markers there, which is where upstream moved the code (the old release's enclosing
        def/class, when another, is named in the detail)."""
        regions = conflict_regions(marked)
        for hp, keys in made:
            region = next((r for r in regions if _key(r) in keys), None)
            if region is None:  # merged into another hunk's region: nothing of its own to point at
                continue
            hp.line = region["line"]
            hp.sides = {lab: region[lab] for lab in LABELS}
            where = marker_anchor(marked, region["line"])
            if where is not None and where != hp.anchor:
                hp.detail += f" (in sglang {self.res.from_release} it was in {hp.anchor})"
                hp.anchor = where


def merge_patch(res: PortResult, trees: Trees, patch: Patch, to_release: str, series_version: str) -> tuple[bool, bool]:
    """Merge every file of `patch`; (some hunk conflicted, the new release changed)."""
    conflicted = changed_any = False
    for fp in patch.files:
        c, changed = FileMerge(res, trees, patch, fp, to_release, series_version).run()
        conflicted |= c
        changed_any |= changed
    return conflicted, changed_any
