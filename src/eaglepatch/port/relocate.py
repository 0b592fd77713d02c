"""Stage 2b, relocate an insertion whose context changed upstream around an unchanged anchor.

A hook hunk inserts lines between two statements. When upstream rewrote those statements'
text (an import grew names, a call grew arguments) the 3-way merge conflicts although the place
is still plain to see. ``relocate`` finds it by statements, not text: in the same enclosing
def/class (the anchor), the statement right before the insertion point and the one right after
it are each reduced to a signature (what a call calls, what an import imports from, what an
assignment assigns to); the new upstream file must hold exactly one statement of that
signature in the same scope, and where both neighbours are found they must still be
neighbours. The lines go there, re-indented to the new statement's indentation, and the result
must parse. Anything else (a hunk that removes lines, no or several matches, neighbours that
moved apart) stays a conflict. Every relocated hunk is listed for review.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..series import Hunk, split_lines


@dataclass
class _Stmt:
    lineno: int  # 1-based first line
    end_lineno: int
    col: int
    scope: str  # qualified name of the enclosing def/class, "<module>" at top level
    sig: str
    text: str  # first line, for the review note


def signature(node: ast.stmt) -> str:
    """What identifies a statement when its text changes around it."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return "call " + ast.unparse(node.value.func)
    if isinstance(node, ast.ImportFrom):
        return "from %s%s import" % ("." * node.level, node.module or "")
    if isinstance(node, ast.Import):
        return "import " + ", ".join(a.name for a in node.names)
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return "assign " + ", ".join(ast.unparse(t) for t in targets)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return "def " + node.name
    if isinstance(node, (ast.If, ast.While)):
        return "%s %s" % (type(node).__name__.lower(), ast.unparse(node.test))
    return ast.unparse(node)


def statements(source: bytes) -> list[_Stmt] | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines = split_lines(source)
    out: list[_Stmt] = []

    def walk(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                first = lines[child.lineno - 1].decode("utf-8", errors="replace").strip()
                out.append(_Stmt(child.lineno, child.end_lineno, child.col_offset, scope, signature(child), first))
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            walk(child, inner)

    walk(tree, "<module>")
    return out


def _neighbours(stmts: list[_Stmt], lines: list[bytes], at: int):
    """The statements right before and right after an insertion before 0-based line ``at``."""
    def code(i):
        text = lines[i].strip()
        return bool(text) and not text.startswith(b"#")

    prev_line = next((i + 1 for i in range(at - 1, -1, -1) if code(i)), None)
    next_line = next((i + 1 for i in range(at, len(lines)) if code(i)), None)
    before = [s for s in stmts if prev_line is not None and s.end_lineno == prev_line]
    after = [s for s in stmts if next_line is not None and s.lineno == next_line]
    # innermost before (the latest start), outermost after (a compound statement, not its body)
    return (max(before, key=lambda s: s.lineno) if before else None,
            min(after, key=lambda s: -s.end_lineno) if after else None)


def _unique(stmts: list[_Stmt], want: _Stmt | None) -> _Stmt | None:
    if want is None:
        return None
    found = [s for s in stmts if s.scope == want.scope and s.sig == want.sig]
    return found[0] if len(found) == 1 else None


def _reindent(lines: list[bytes], delta: int) -> list[bytes] | None:
    out = []
    for ln in lines:
        if not ln.strip():
            out.append(ln)
        elif delta >= 0:
            out.append(b" " * delta + ln)
        elif ln[:-delta].strip():
            return None  # less indented than the shift: not a plain block
        else:
            out.append(ln[-delta:])
    return out


@dataclass
class Relocated:
    data: bytes
    line: int  # 1-based first inserted line in the new file
    note: str


def relocate(base: bytes, hunk: Hunk, pos: int, theirs: bytes) -> Relocated | None:
    """``theirs`` with the insertion of ``hunk`` (matched at 0-based ``pos`` in ``base``) placed
    by its neighbouring statements, or None when that is not safe."""
    if hunk.removed or not hunk.added:
        return None
    k, _ = hunk.first_change()
    at = pos + k  # 0-based line of base the added lines go before
    added = [v for t, v in hunk.ops if t == "+"]
    types = "".join(t for t, _ in hunk.ops).strip(" ")
    if set(types) != {"+"}:
        return None  # not one contiguous block of added lines
    old_stmts, new_stmts = statements(base), statements(theirs)
    if old_stmts is None or new_stmts is None:
        return None
    base_lines, new_lines = split_lines(base), split_lines(theirs)
    before, after = _neighbours(old_stmts, base_lines, at)
    nb, na = _unique(new_stmts, before), _unique(new_stmts, after)
    if nb and na:
        prev = _neighbours(new_stmts, new_lines, na.lineno - 1)[0]
        if prev is None or prev.end_lineno != nb.end_lineno:
            return None  # both found but no longer side by side
    if nb:
        where, ref, old_ref = nb.end_lineno, nb, before  # after the statement before
    elif na:
        where, ref, old_ref = na.lineno - 1, na, after  # before the statement after
    elif after is None and before is not None and before.scope == "<module>":
        where, ref, old_ref = len(new_lines), None, before  # the end of the module, as before
    else:
        return None
    moved = _reindent(added, (ref.col - old_ref.col) if ref else 0)
    if moved is None:
        return None
    if where == len(new_lines) and new_lines and not new_lines[-1].endswith(b"\n"):
        new_lines[-1] += b"\n"
    data = b"".join(new_lines[:where] + moved + new_lines[where:])
    if statements(data) is None:
        return None
    place = (f"after `{ref.text}`" if ref is nb else f"before `{ref.text}`") if ref else "at the end of the module"
    scope = (ref or old_ref).scope
    return Relocated(data, where + 1, f"context changed upstream; relocated {place} in {scope}, line {where + 1}")
