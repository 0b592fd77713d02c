"""Smoke checks of the 0.5.9 series on CPU with real SGLang code (issue 3, Proof a-e).

The patched tree is the unpacked sglang 0.5.9 wheel + patches/sglang-0.5.9/series + smoke.series,
built once per session; the checks run through eaglepatch.smoke.run_smoke in the cached CPU
environment, each worker group once per session (the tests of a group share its results).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cpuenv  # noqa: E402
from eaglepatch.smoke import STUBS, run_smoke  # noqa: E402
from eaglepatch.smoke.tree import patched_tree  # noqa: E402

SERIES = REPO / "patches" / "sglang-0.5.9"
TOL = 1e-4


def _figure(r) -> float:
    m = re.search(r"max abs diff ([0-9.eE+-]+)", r.figure)
    assert m, "no max abs diff in %r" % r.figure
    return float(m.group(1))


def _explain(results) -> str:
    return "\n".join("%s %s: %s\n    %s" % ("PASS" if r.passed else "FAIL", r.name, r.figure, r.detail)
                     for r in results)


@pytest.fixture(scope="session")
def smoke_tree(tmp_path_factory, release_059) -> Path:
    """Package parent of the patched tree under test (series + test-only smoke series)."""
    if not (SERIES / "series").is_file():
        pytest.fail("no series at %s" % SERIES)
    return patched_tree(release_059, SERIES, tmp_path_factory.mktemp("smoke-tree"))


@pytest.fixture(scope="session")
def smoke_groups(smoke_tree, tmp_path_factory):
    """group -> results, each worker group run at most once per session."""
    cache: dict = {}

    def get(group: str):
        if group not in cache:
            level = "import" if group == "import" else "functional"
            checks = None if level == "import" else [group]
            cache[group] = run_smoke(level, smoke_tree, SERIES, checks=checks,
                                     work_dir=tmp_path_factory.mktemp("smoke-%s" % group.replace(":", "-")))
        return cache[group]

    return get


def _select(results, prefix: str):
    sel = [r for r in results if r.name.startswith(prefix)]
    assert sel, "no result named %r in:\n%s" % (prefix, _explain(results))
    return sel


# ---- cheap checks of the harness itself ------------------------------------------------------

@pytest.mark.parametrize("pkg", ["sgl_kernel", "torchvision"])
def test_stub_imports_and_fails_loudly_when_called(pkg):
    code = (
        "import importlib, importlib.metadata as md\n"
        "m = importlib.import_module('%s.some.sub')\n"
        "f = m.anything\n"
        "try:\n    f(1)\nexcept NotImplementedError as e:\n    print('RAISED', e)\n"
        "try:\n    md.version('%s'); print('META')\nexcept md.PackageNotFoundError:\n    print('NOMETA')\n"
    ) % (pkg, pkg)
    env = dict(os.environ, PYTHONPATH=str(STUBS))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "RAISED stub called: %s.some.sub.anything" % pkg in out.stdout
    assert "NOMETA" in out.stdout


def test_cpuenv_key_follows_requirements_and_python(tmp_path, monkeypatch):
    base = cpuenv.env_key()
    req = tmp_path / "req.txt"
    req.write_bytes(cpuenv.REQUIREMENTS.read_bytes() + b"\nextra-package==1.0\n")
    monkeypatch.setattr(cpuenv, "REQUIREMENTS", req)
    assert cpuenv.env_key() != base
    monkeypatch.setattr(cpuenv, "_py_version", lambda: "0.0.0")
    monkeypatch.setenv("EAGLEPATCH_CACHE", str(tmp_path / "c"))
    assert cpuenv.env_dir().parent == tmp_path / "c"


def test_cpu_requirements_are_all_pinned_and_env_matches():
    torch_pin, rest = cpuenv._requirements()
    assert torch_pin.startswith("torch==")
    unpinned = [r for r in rest if "==" not in r]
    assert not unpinned, unpinned
    names = {r.split("==")[0].lower().replace("_", "-") for r in rest}
    for need in ["unidiff", "gitpython", "pyflakes", "tqdm", "pytest", "safetensors", "requests",
                 "tokenizers", "transformers"]:
        assert need in names, need
    assert "sglang" not in names and "sgl-kernel" not in names and "torchvision" not in names
    # the tests run in that environment: its versions are the pinned ones
    for r in rest + [torch_pin]:
        name, ver = r.split("==")
        try:
            got = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert got.split("+")[0] == ver, "%s: env has %s, pinned %s" % (name, got, ver)


# ---- import level -----------------------------------------------------------------------------

def test_import_level(smoke_groups):
    results = smoke_groups("import")
    assert len(results) >= 6
    assert all(r.passed for r in results), _explain(results)


def test_import_level_fails_on_the_unpatched_release(release_059):
    """The import level must be able to fail: upstream 0.5.9 lacks the series."""
    results = run_smoke("import", release_059, None)
    failed = {r.name for r in results if not r.passed}
    assert "import sglang.srt.eagle3_capture" in failed, _explain(results)
    assert "import: series symbols and hooks present" in failed, _explain(results)


# ---- functional level: issue 3 checks a-e ------------------------------------------------------

def test_a_eagle3_capture_matches_hf(smoke_groups):
    results = smoke_groups("runner")
    (r,) = _select(results, "a.")
    assert r.passed, _explain([r])
    assert _figure(r) <= TOL
    assert "layers_to_capture before init_device_graphs=[0, 2, 3]" in r.detail


def test_a_fails_without_the_smoke_patch(release_059, tmp_path):
    """Check a can fail: without the test-only smoke patch the torch_native MHA prefill is wrong."""
    pp = patched_tree(release_059, SERIES, tmp_path / "no-smoke", smoke=False)
    results = run_smoke("functional", pp, None, checks=["runner:a"], work_dir=tmp_path / "work")
    (r,) = _select(results, "a.")
    assert not r.passed and _figure(r) > 100 * TOL, _explain([r])


def test_b_dump_through_engine_matches_hf(smoke_groups):
    (r,) = _select(smoke_groups("engine"), "b.")
    assert r.passed, _explain([r])
    assert _figure(r) <= TOL


def test_c_dump_through_kimi_k25_wrapper_matches_hf(smoke_groups):
    (r,) = _select(smoke_groups("engine"), "c.")
    assert r.passed, _explain([r])
    assert _figure(r) <= TOL


def test_d_outputs_identical_with_dump_on_and_off(smoke_groups):
    (r,) = _select(smoke_groups("runner"), "d.")
    assert r.passed, _explain([r])
    assert _figure(r) == 0.0


def test_e_refused_at_engine_start(smoke_groups):
    (r,) = _select(smoke_groups("engine"), "e.")
    assert r.passed, _explain([r])
    assert "--disable-radix-cache" in r.detail


def test_e_refused_in_model_runner_init(smoke_groups):
    results = _select(smoke_groups("runner"), "e.")
    refused = [r for r in results if r.name.startswith("e. refused")]
    assert len(refused) >= 9, _explain(results)
    assert all(r.passed for r in results), _explain(results)
    # the control: the same ModelRunner init without a refused setting starts and dumps (check d)
    (d,) = _select(smoke_groups("runner"), "d.")
    assert d.passed and "dump-on run wrote 4 files" in d.detail, _explain([d])

