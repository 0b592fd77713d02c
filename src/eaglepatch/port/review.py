"""Stage 5, review: where each merged hunk landed (and whether its enclosing code changed
upstream), a range-diff-like view of old against ported patches, the per-hunk table and the
conflict report with all three sides."""

from __future__ import annotations

import ast
import difflib
import re

from ..anchors import anchor_at
from ..report import table
from ..series import split_lines
from .result import CONFLICT, LABELS, MERGED, RELOCATED, UPSTREAM, PortResult


def locate(res: PortResult, patch: str, path: str, theirs: bytes, merged: bytes, base: bytes) -> None:
    """Fill in where each merged hunk of (patch, path) landed, and flag changed enclosing code."""
    sm = difflib.SequenceMatcher(a=split_lines(theirs), b=split_lines(merged), autojunk=False)
    starts = [j1 + 1 for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]
    landed = [h for h in res.hunks if h.patch == patch and h.file == path and h.status in (MERGED, RELOCATED)]
    modules: dict = {}  # the source -> its parse (None: not Python), each parsed at most once

    def def_line(source: bytes, qualname: str) -> int | None:
        side = "base" if source is base else "theirs"
        if side not in modules:
            modules[side] = _parse(source)
        return _def_line(modules[side], qualname)

    for h, line in zip(landed, starts):
        h.line = line
        if h.anchor in ("<module>", "-") or h.status == RELOCATED:
            continue
        before_line = def_line(base, h.anchor)
        before = anchor_at(base, before_line)[1] if before_line else None
        after_line = def_line(theirs, h.anchor)
        after = anchor_at(theirs, after_line)[1] if after_line else None
        if after_line is None:
            h.review = f"{h.anchor} no longer exists upstream"
        elif before != after:
            h.review = f"the body of {h.anchor} changed upstream; review what the hook now does"


def _parse(source: bytes) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _def_line(tree: ast.Module | None, qualname: str) -> int | None:
    if tree is None:
        return None
    parts = qualname.split(".")

    def find(nodes, i):
        for node in nodes:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[i]:
                return node.lineno if i == len(parts) - 1 else find(node.body, i + 1)
        return None

    return find(tree.body, 0)


def _normalized(patch_bytes: bytes) -> list[str]:
    """A patch without its header, index lines and hunk line numbers (what range-diff compares)."""
    body = patch_bytes.split(b"\n---\n", 1)[-1].decode("utf-8", errors="replace")
    out = []
    for ln in body.splitlines():
        if ln.startswith("index "):
            continue
        if ln.startswith("@@"):
            m = re.match(r"^@@ [^@]* @@ ?(.*)$", ln)
            ln = "@@ " + (m.group(1) if m else "")
        out.append(ln)
    return out


def review(res: PortResult, new_dir_files: dict | None = None) -> str:
    """Range-diff-like view: each old patch against its ported form (or why it is gone)."""
    files = new_dir_files if new_dir_files is not None else res.files
    out = [f"review: {res.old.dir.name} (sglang {res.from_release}) -> sglang-{res.to_release}"
           f" (range-diff style: '=' same change, '!' changed, '<' dropped, 'x' conflict)"]
    for i, pp in enumerate(res.patches, 1):
        old_patch = next(p for p in res.old.patches + res.old.smoke if p.name == pp.name)
        if pp.status == "dropped":
            out.append(f"  {i}: {pp.name} < -: dropped: {pp.reason}")
            continue
        if pp.status == "conflict":
            out.append(f"  {i}: {pp.name} x -: does not merge (see the conflict report)")
            continue
        if not files:  # not exported: the port has conflicts elsewhere
            out.append(f"  {i}: {pp.name} ~ -: merges (not exported: other patches conflict)")
            continue
        new = files.get(pp.new_name) if pp.new_name else None
        a = _normalized(old_patch.data)
        b = _normalized(new) if new is not None else []
        same = a == b
        j = (pp.new_name or "-").split("-", 1)[0].lstrip("0") or "-"
        out.append(f"  {i}: {pp.name} {'=' if same else '!'} {j}: {pp.new_name}   {pp.subject}")
        if not same:
            for ln in list(difflib.unified_diff(a, b, lineterm="", n=1))[2:]:
                out.append("      " + ln)
    for h in res.hunks:
        if h.status == UPSTREAM:
            out.append(f"  dropped hunk: {h.patch} {h.file} hunk {h.index} [{h.anchor}]: {h.detail}")
    for h in res.hunks:
        if h.review:
            out.append(f"  review: {h.patch} {h.file} hunk {h.index}: {h.review}")
    for n in res.notes:
        out.append(f"  note: {n}")
    return "\n".join(out)


def hunk_table(res: PortResult) -> str:
    rows = [[h.patch, h.file, str(h.index), h.anchor, h.status + (f" @{h.line}" if h.line and h.status in (MERGED, RELOCATED)
                                                                    else ""), h.detail]
            for h in res.hunks]
    return table(rows, ["patch", "file", "hunk", "anchor", "result", "detail"])


def conflict_report(res: PortResult) -> str:
    out = [f"conflicts porting {res.old.dir.name} to sglang {res.to_release} (nothing was written):"]

    def sides(d):
        for lab in LABELS:
            txt = d.get(lab, "")
            out.append(f"    --- {lab} ({len(txt.splitlines())} line(s)):")
            out.extend("    | " + ln for ln in txt.splitlines())

    for h in res.hunks:
        if h.status != CONFLICT:
            continue
        where = f" near line {h.line} of the merge" if h.line else ""
        out.append(f"  CONFLICT {h.patch} {h.file} hunk {h.index} [{h.anchor}]{where}: {h.detail}")
        if h.sides:
            sides(h.sides)
    for p, f, d, s in res.file_conflicts:
        out.append(f"  CONFLICT {p} {f}: {d}")
        sides(s)
    return "\n".join(out)
