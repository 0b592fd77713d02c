"""The library reads top-down: no import circle among the modules of src/eaglepatch, counting
every import (also those inside functions), parsed with ast."""

import ast

from conftest import REPO

SRC = REPO / "src"
PKG = "eaglepatch"


def _modules() -> dict:
    """module name -> file, for every .py under src/eaglepatch."""
    out = {}
    for f in sorted((SRC / PKG).rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict:
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
                # `from . import x` / `from .pkg import sub`: x is a module when one exists by that name
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import eaglepatch.port.merge` -> that module
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith(PKG):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_library():
    graph = import_graph()
    assert "eaglepatch.port.merge" in graph and "eaglepatch.tree" in graph  # the walk found the modules
    assert not cycles(graph), cycles(graph)


# docs/design.md, Conventions: a module imports only from its layer or below
LAYERS = [["errors", "interrupts", "anchors", "static_check"],
          ["series", "lock", "outputs", "gitcmd"],
          ["tree", "txn", "verdicts", "fetch", "overlay"],
          ["commit", "applier", "export"],
          ["report"],
          ["port", "drift"]]


def layer_of(mod: str) -> int | None:
    name = mod.split(".")[1] if "." in mod else None
    return next((i for i, names in enumerate(LAYERS) if name in names), None)


def test_the_layers_point_down():
    g = import_graph()
    for mod, deps in g.items():
        mine = layer_of(mod)
        if mine is None:
            continue
        for d in deps:
            theirs = layer_of(d)
            assert theirs is None or theirs <= mine or d.startswith(mod + ".") or \
                mod.split(".")[:2] == d.split(".")[:2], f"{mod} (layer {mine}) imports {d} (layer {theirs})"
    assert "eaglepatch.port" not in g["eaglepatch.tree"] and "eaglepatch.port" not in g["eaglepatch.applier"]


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    old = {"eaglepatch.tree": {"eaglepatch.port"}, "eaglepatch.port": {"eaglepatch.applier"},
           "eaglepatch.applier": {"eaglepatch.tree"}}
    assert cycles(old) == [["eaglepatch.applier", "eaglepatch.port", "eaglepatch.tree"]]
