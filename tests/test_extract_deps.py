"""What the extraction tools need installed: the extras in pyproject.toml, per format, and the
one-line refusal (before anything is read or written) naming how to install what is missing.

- each format's extra resolves (self-references included) to requirements that parse, and names
  exactly the packages that format imports (``eaglepatch.extract.NEEDS``, what tools/extract.py
  checks before it starts);
- transformers is pinned to the version of the server the tests run (cpu-requirements.txt);
- ``guard`` pulls no torch; torch is never pinned (the README installs its CPU build first);
- without torch, tools/extract.py exits 2 with one line naming the CPU torch install and the
  format's extra, and writes nothing; ``--help`` works without it.

The README's claims that the guard and a SpecForge extraction run without torch / datasets are
proven against the real server in tests/test_extract.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.extract import CPU_TORCH, NEEDS  # noqa: E402

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")
EXTRACT = REPO / "tools" / "extract.py"
# python -c WITHOUT MODULES SCRIPT ARGS...: SCRIPT run as __main__ with the comma list MODULES unimportable
WITHOUT = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',')]; sys.argv = sys.argv[2:]; "
           "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")


def extras() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def resolve(name: str, table: dict, seen=()) -> list:
    """The requirements of extra ``name``, ``eaglepatch[...]`` references expanded."""
    assert name in table, f"extra {name!r} is referenced but not defined"
    assert name not in seen, f"extra {name!r} refers to itself"
    out = []
    for line in table[name]:
        req = requirements.Requirement(line)
        if req.name == "eaglepatch":
            for sub in sorted(req.extras):
                out += resolve(sub, table, seen + (name,))
        else:
            out.append(req)
    return out


def names(reqs) -> set:
    return {r.name.lower() for r in reqs}


def test_each_format_has_an_extra_naming_what_it_imports():
    table = extras()
    for fmt in ("specforge", "speculators", "compact"):
        reqs = resolve(f"extract-{fmt}", table)
        assert names(reqs) == set(NEEDS[fmt].values()), fmt
    assert names(resolve("extract", table)) == set(NEEDS["speculators"].values()) | names(resolve("guard", table))
    assert names(resolve("guard", table)) == {"safetensors", "numpy"}  # no torch for the guard
    assert "datasets" not in names(resolve("extract-specforge", table))


def test_transformers_is_pinned_to_the_servers_and_torch_is_not():
    pin = [ln.split("==", 1)[1].strip() for ln in (REPO / "src" / "eaglepatch" / "cpu-requirements.txt").read_text()
           .splitlines() if ln.startswith("transformers==")]
    assert pin == ["4.57.1"]
    for name in extras():
        for r in resolve(name, extras()):
            if r.name == "transformers":
                assert str(r.specifier) == f"=={pin[0]}", (name, str(r))
            if r.name == "torch":
                assert not r.specifier, (name, str(r))  # any build: the README installs the CPU one first


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "compact"])
def test_extract_without_torch_names_the_cpu_install(tmp_path, fmt):
    """No torch: one line, exit 2, before the server is asked or anything is written (the server
    named here does not exist; OUT is not created)."""
    out = tmp_path / "a" / "out"
    p = subprocess.run([sys.executable, "-c", WITHOUT, "torch", str(EXTRACT), "--server", "http://127.0.0.1:9",
                        "--model", str(tmp_path), "--data", str(tmp_path / "none.jsonl"), "--dump-dir", str(tmp_path),
                        "--out", str(out), "--format", fmt], capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: extract.py --format {fmt} needs the Python package(s) torch"), lines[0]
    assert f"; {CPU_TORCH} (the CPU build" in lines[0] and f"pip install -e '.[extract-{fmt}]'" in lines[0], lines[0]
    assert not (tmp_path / "a").exists()
    p = subprocess.run([sys.executable, "-c", WITHOUT, "torch", str(EXTRACT), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "--format" in p.stdout
