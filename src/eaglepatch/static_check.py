"""Smoke level `static`: byte-compile every patched file, and fail on undefined names (pyflakes)
that the patch introduces compared with the unpatched file."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SmokeResult:
    name: str
    passed: bool
    figure: str = ""
    detail: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "figure": self.figure, "detail": self.detail}


def undefined_names(source: bytes, filename: str) -> set[str] | None:
    """Names pyflakes reports as undefined (None when the source does not parse)."""
    from pyflakes import checker, messages

    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError):
        return None
    w = checker.Checker(tree, filename=filename)
    kinds = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    return {str(m.message_args[0]) for m in w.messages if isinstance(m, kinds)}


def static_check(package_parent: Path, files: list[str], originals: dict) -> list[SmokeResult]:
    """`files`: package-parent-relative paths the series touched; `originals`: rel -> bytes|None."""
    pyfiles = [f for f in files if f.endswith(".py") and (Path(package_parent) / f).is_file()]
    compile_errors, new_undefined = [], []
    for rel in pyfiles:
        data = (Path(package_parent) / rel).read_bytes()
        try:
            compile(data, rel, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            compile_errors.append(f"{rel}:{getattr(exc, 'lineno', '?')}: {exc.__class__.__name__}: "
                                  f"{getattr(exc, 'msg', exc)}")
            continue
        after = undefined_names(data, rel) or set()
        orig = originals.get(rel)
        before = (undefined_names(orig, rel) or set()) if orig is not None else set()
        for name in sorted(after - before):
            new_undefined.append(f"{rel}: {name}")
    return [
        SmokeResult("py_compile", not compile_errors, f"{len(pyfiles) - len(compile_errors)}/{len(pyfiles)} files",
                    "; ".join(compile_errors)),
        SmokeResult("pyflakes undefined names", not new_undefined,
                    f"{len(new_undefined)} new undefined name(s)", "; ".join(new_undefined)),
    ]
