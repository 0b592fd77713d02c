"""Anchors: the innermost def/class enclosing a line, and a hash of that def/class's source."""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache

MODULE = "<module>"


@lru_cache(maxsize=64)
def _scopes(source: bytes):
    """[(start, end, qualname)] for every def/class, outer before inner; None if unparsable."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{prefix}.{child.name}" if prefix else child.name
                out.append((child.lineno, child.end_lineno, q))
                walk(child, q)
            else:
                walk(child, prefix)

    walk(tree, "")
    return tuple(out)


def anchor_at(source: bytes, lineno: int) -> tuple[str, str | None]:
    """(qualified name, sha256 of its source lines) of the innermost def/class holding `lineno`
    (1-based); ("<module>", None) at top level or when the file does not parse."""
    scopes = _scopes(source)
    best = None
    for start, end, q in scopes or ():
        if start <= lineno <= end and (best is None or start >= best[0]):
            best = (start, end, q)
    if best is None:
        return MODULE, None
    lines = source.split(b"\n")
    seg = b"\n".join(lines[best[0] - 1: best[1]])
    return best[2], hashlib.sha256(seg).hexdigest()


def hunk_anchor_line(match_pos: int, first_change: int, is_insert: bool) -> int:
    """1-based line in the file before the patch that a hunk anchors to.

    match_pos: 0-based index where the hunk's old side starts. For an insertion the line just
    before the insertion point counts (the first line when inserting at the top)."""
    line = match_pos + first_change + 1
    if is_insert:
        line -= 1
    return max(line, 1)
