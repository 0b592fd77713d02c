"""Per-hunk matcher with zero fuzz.

Verdicts: exact | offset N | context changed | conflict | already applied | ambiguous | anchor drift.
A hunk's old side (context + removed lines) must match line for line; hunks of later patches are
checked against the in-memory result of the earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .anchors import MODULE, anchor_at, hunk_anchor_line
from .series import Hunk, Patch, Series, split_lines

EXACT = "exact"
OFFSET = "offset"
CONTEXT_CHANGED = "context changed"
CONFLICT = "conflict"
ALREADY = "already applied"
AMBIGUOUS = "ambiguous"
ANCHOR_DRIFT = "anchor drift"
OK = (EXACT, OFFSET)


@dataclass
class Verdict:
    patch: str
    file: str
    hunk: int
    source_start: int
    anchor: str
    verdict: str
    offset: int = 0
    line: int | None = None
    detail: str = ""
    added: int = 0
    removed: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict in OK

    @property
    def applies(self) -> bool:
        """The hunk lands uniquely (ok, or anchor drift which still applies)."""
        return self.verdict in OK or self.verdict == ANCHOR_DRIFT

    @property
    def label(self) -> str:
        if self.verdict == OFFSET:
            return f"offset {self.offset:+d}"
        return self.verdict

    def as_dict(self) -> dict:
        return {"patch": self.patch, "file": self.file, "hunk": self.hunk, "source_start": self.source_start,
                "anchor": self.anchor, "verdict": self.verdict, "offset": self.offset, "line": self.line,
                "detail": self.detail, "label": self.label}


@dataclass
class SeriesCheck:
    verdicts: list[Verdict] = field(default_factory=list)
    originals: dict = field(default_factory=dict)  # path -> bytes | None, before the series
    results: dict = field(default_factory=dict)  # path -> bytes | None, after the hunks that apply

    @property
    def all_ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    @property
    def all_already_applied(self) -> bool:
        return bool(self.verdicts) and all(v.verdict == ALREADY for v in self.verdicts)

    def for_patch(self, name: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.patch == name]

    def changed(self) -> dict:
        return {p: d for p, d in self.results.items() if d != self.originals.get(p)}


def find_all(lines: list[bytes], needle: list[bytes]) -> list[int]:
    n = len(needle)
    if n == 0:
        return []
    first = needle[0]
    return [i for i in range(len(lines) - n + 1) if lines[i] == first and lines[i: i + n] == needle]


def _ahead(src: bytes, pos: int, hunk: Hunk) -> tuple[str, str | None]:
    k, ins = hunk.first_change()
    return anchor_at(src, hunk_anchor_line(pos, k, ins))


def check_hunk(lines: list[bytes], hunk: Hunk, expected: int) -> tuple[str, int | None, str]:
    """(verdict, 0-based match position or None, detail) for one hunk on `lines` (no anchors)."""
    old, new = hunk.old, hunk.new
    if not old:
        if 0 <= expected <= len(lines):
            return EXACT, expected, ""
        return CONFLICT, None, "insertion point past the end of the file"
    found = find_all(lines, old)
    if len(found) == 1:
        pos = found[0]
        if pos == expected:
            return EXACT, pos, ""
        return OFFSET, pos, f"matched at line {pos + 1}, expected {expected + 1}"
    if len(found) > 1:
        return AMBIGUOUS, None, "old side matches at lines " + ", ".join(str(p + 1) for p in found[:8])
    done = find_all(lines, new) if new else []
    if done:
        return ALREADY, done[0], f"new side present at line {done[0] + 1}"
    k, core = hunk.core()
    at = find_all(lines, core) if core else []
    if at:
        near = min(at, key=lambda p: abs(p - k - expected))
        return CONTEXT_CHANGED, None, f"changed lines found at line {near + 1} but the context around them differs"
    return CONFLICT, None, "the lines this hunk changes are not in the file"


def check_series(read: Callable[[str], bytes | None], patches: list[Patch], series: Series | None = None,
                 reverse: bool = False, use_anchors: bool = True) -> SeriesCheck:
    """Check every hunk of `patches` in order against the files `read(path)` returns, applying
    the hunks that land to an in-memory copy so that later patches see earlier ones."""
    out = SeriesCheck()
    state = out.results

    def cur(path):
        if path not in state:
            data = read(path)
            state[path] = data
            out.originals[path] = data
        return state[path]

    for patch in (reversed(patches) if reverse else patches):
        fps = [f.reversed() for f in reversed(patch.files)] if reverse else patch.files
        for fp in fps:
            data = cur(fp.path)
            hunks = fp.hunks

            def verdict(h, v, off=0, line=None, detail="", anchor=MODULE):
                out.verdicts.append(Verdict(patch.name, fp.path, h.index, h.source_start, anchor, v, off, line,
                                            detail, h.added, h.removed))

            if fp.is_new:
                content = b"".join(b"".join(h.new) for h in hunks)
                v = EXACT if data is None else (ALREADY if data == content else CONFLICT)
                why = "" if v != CONFLICT else "the file the patch creates already exists with other content"
                for h in hunks or []:
                    verdict(h, v, 0, 1, why)
                if v == EXACT:
                    state[fp.path] = content
                continue
            if fp.is_deleted:
                content = b"".join(b"".join(h.old) for h in hunks)
                v = ALREADY if data is None else (EXACT if data == content else CONFLICT)
                for h in hunks:
                    verdict(h, v, 0, 1, "" if v != CONFLICT else "the file to delete has other content")
                if v == EXACT:
                    state[fp.path] = None
                continue
            if data is None:
                for h in hunks:
                    verdict(h, CONFLICT, detail="the file is missing")
                continue
            before = data
            lines = split_lines(data)
            applied_delta = 0  # sum(len(new)-len(old)) of hunks applied so far in this file
            missed_delta = 0  # same for hunks of this file that did not apply
            for h in hunks:
                expected = max(h.target_start - 1, 0) - missed_delta  # as git apply does
                v, pos, detail = check_hunk(lines, h, expected)
                off = 0 if pos is None else pos - expected
                rec0 = series.manifest_hunk(patch.name, fp.path, h.index) if series else None
                anchor = (rec0 or {}).get("anchor") or "?"
                if pos is not None and v != ALREADY:
                    orig_pos = pos - applied_delta
                    anchor, asha = _ahead(before, orig_pos, h)
                    rec = series.manifest_hunk(patch.name, fp.path, h.index) if (series and use_anchors
                                                                                and not reverse) else None
                    if rec is not None and v in OK and (rec.get("anchor") != anchor
                                                         or rec.get("anchor_sha256") != asha):
                        if rec.get("anchor") != anchor:
                            detail = f"enclosing scope is {anchor}, the manifest recorded {rec.get('anchor')}"
                        else:
                            detail = f"the body of {anchor} changed since the series was exported"
                        v = ANCHOR_DRIFT
                verdict(h, v, off if v in (OFFSET, ANCHOR_DRIFT) else 0,
                        None if pos is None else pos + 1, detail, anchor)
                d = len(h.new) - len(h.old)
                if v in OK or v == ANCHOR_DRIFT:
                    lines[pos: pos + len(h.old)] = h.new
                    applied_delta += d
                else:
                    missed_delta += d
            state[fp.path] = b"".join(lines)
    return out
