"""Smoke checks of every series on CPU with real SGLang code (one harness for all releases).

For each series under patches/ the patched tree is the unpacked release wheel + its series +
smoke.series, built once per session; the checks run through eaglepatch.smoke.run_smoke in the
cached CPU environment of that release, each worker group once per session (the tests of a
group share its results). Every reference check also reports the nearest wrong reference (ids
shifted by one, the final state without its norm, the last layer after the norm) and fails when
that one is not far off: the checks can tell a wrong layer from the right one.
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

from eaglepatch import PINNED_RELEASE, cpuenv  # noqa: E402
from eaglepatch.fetch import unpacked_release  # noqa: E402
from eaglepatch.series import available_series  # noqa: E402
from eaglepatch.smoke import STUBS, _common, run_smoke  # noqa: E402
from eaglepatch.smoke.tree import patched_tree  # noqa: E402

SERIES = available_series()
TOL = 1e-4


def _figure(r) -> float:
    m = re.search(r"max abs diff ([0-9.eE+-]+)", r.figure)
    assert m, "no max abs diff in %r" % r.figure
    return float(m.group(1))


def _explain(results) -> str:
    return "\n".join("%s %s: %s\n    %s" % ("PASS" if r.passed else "FAIL", r.name, r.figure, r.detail)
                     for r in results)


@pytest.fixture(scope="session", params=sorted(SERIES), ids=lambda r: "sglang-" + r)
def release(request) -> str:
    return request.param


@pytest.fixture
def smoke_groups(release, series_smoke):
    """group -> results, each worker group of each release run at most once per session (conftest's
    series_smoke: tests/test_plugin.py reuses the engine group's dumps)."""

    def get(group: str):
        return series_smoke(release, group)[0]

    return get


def _select(results, prefix: str):
    sel = [r for r in results if r.name.startswith(prefix)]
    assert sel, "no result named %r in:\n%s" % (prefix, _explain(results))
    return sel


def _passed_and_discriminating(r):
    """Passed, within TOL, and the nearest wrong reference is at least WRONG_MARGIN x TOL off."""
    assert r.passed, _explain([r])
    assert _figure(r) <= TOL
    m = re.search(r"nearest wrong reference ([0-9.eE+-]+)", r.detail)
    assert m and float(m.group(1)) >= _common.WRONG_MARGIN * TOL, _explain([r])


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


def test_patched_tree_inside_a_git_repository_is_patched(tmp_path, release_059):
    """git apply run inside a repository skips the paths it thinks are outside the current
    directory and still succeeds; the smoke tree must be patched wherever it is built."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    pp = patched_tree(release_059, SERIES[PINNED_RELEASE], tmp_path / "inside" / "pp", smoke=False)
    assert (pp / "sglang" / "srt" / "eagle3_capture" / "dump.py").is_file()
    assert "eagle3_capture" in (pp / "sglang" / "srt" / "models" / "deepseek_v2.py").read_text()


# ---- import level -----------------------------------------------------------------------------

def test_import_level(smoke_groups):
    results = smoke_groups("import")
    assert len(results) >= 6
    assert all(r.passed for r in results), _explain(results)


def test_import_level_fails_on_the_unpatched_release(release, tmp_path):
    """The import level must be able to fail: the upstream release lacks the series. (A failing smoke
    keeps its logs: they go to this test's tmp_path.)"""
    results = run_smoke("import", unpacked_release(release, quiet=True), SERIES[release], work_dir=tmp_path / "w")
    failed = {r.name for r in results if not r.passed}
    assert "import sglang.srt.eagle3_capture" in failed, _explain(results)
    assert "import: series symbols and hooks present" in failed, _explain(results)


# ---- functional level: checks a-e, g -----------------------------------------------------------

def test_a_eagle3_capture_matches_hf(smoke_groups):
    (r,) = _select(smoke_groups("runner"), "a.")
    _passed_and_discriminating(r)
    assert re.search(r"layers_to_capture before init_(device|cuda)_graphs=\[0, 2\] \(\+ final-norm hook\)", r.detail)


def test_a_fails_without_the_smoke_patch(release_059, tmp_path):
    """Check a can fail: without the test-only smoke patch the torch_native MHA prefill is wrong."""
    pp = patched_tree(release_059, SERIES[PINNED_RELEASE], tmp_path / "no-smoke", smoke=False)
    results = run_smoke("functional", pp, None, checks=["runner:a"], work_dir=tmp_path / "work")
    (r,) = _select(results, "a.")
    assert not r.passed and _figure(r) > 100 * TOL, _explain([r])


def test_b_dump_through_engine_matches_hf(smoke_groups):
    (r,) = _select(smoke_groups("engine"), "b.")
    _passed_and_discriminating(r)


def test_c_dump_through_kimi_k25_wrapper_under_chunked_prefill_matches_hf(smoke_groups):
    (r,) = _select(smoke_groups("engine"), "c.")
    _passed_and_discriminating(r)
    # one chunk exactly, several, mixed; the last prompt sent twice; 3 new tokens each
    assert "lengths [64, 3, 17, 129, 200, 311, 45, 45]" in r.detail and "of 3 new tokens" in r.detail


def test_d_outputs_identical_with_dump_on_and_off(smoke_groups):
    (r,) = _select(smoke_groups("runner"), _common.D_NAME)
    assert r.passed, _explain([r])
    assert _figure(r) == 0.0
    assert "dump-on run wrote 4 files" in r.detail


def test_d_decode_captures_only_what_a_draft_needs(smoke_groups):
    """A dump-only runner captures the dump's layers in prefill and nothing in decode (so its
    decode CUDA graphs hold no capture); with a draft, decode captures the draft's layers."""
    (r,) = _select(smoke_groups("runner"), _common.DECODE_NAME)
    assert r.passed, _explain([r])
    assert "'dump only': {'EXTEND': [((0, 2), 2, True)], 'DECODE': [((), 0, False)]}" in r.detail, r.detail
    assert "'DECODE': [((2,), 1, False)]" in r.detail, r.detail


def test_e_refused_before_any_worker_starts(smoke_groups):
    engine = _select(smoke_groups("engine"), "e.")
    assert {r.name for r in engine} == {_common.E_ENGINE_NAME, _common.E_LAUNCH_NAME}
    assert all(r.passed for r in engine), _explain(engine)


def test_e_every_rule_refused_at_launch_and_in_the_runner(smoke_groups):
    """Every rule is exercised or declared absent on the release (and confirmed absent): a rule
    the run cannot set fails the smoke, it is never skipped. A draft algorithm the release lacks
    (DFLASH, DSPARK on 0.5.9) is confirmed missing from its SpeculativeAlgorithm: nothing to
    refuse there, and no setting the release has goes unchecked."""
    results = _select(smoke_groups("runner"), "e.")
    launch = [r for r in results if r.name.startswith("e. refused at launch")]
    absent = [r for r in results if r.name.startswith("e. not on sglang")]
    assert len(launch) >= 11 and len(absent) <= 3, _explain(results)
    for label in ("moe dense tp 1 at tp 2", "dflash target", "dspark target"):  # each fact-decided case reports
        assert sum(r.name.endswith(": " + label) for r in results) == 1, _explain(results)
    assert any(r.name == _common.E_RUNNER_NAME for r in results)
    assert any(r.name == "e. accepted at launch: lora" for r in results), _explain(results)
    assert all(r.passed for r in results), _explain(results)


def test_g_image_prompt_ids_and_rows(smoke_groups):
    (r,) = _select(smoke_groups("runner"), "g.")
    _passed_and_discriminating(r)
    assert "clamped to 1023" in r.detail and "placeholder 1000" in r.detail and "files 3" in r.detail


def test_h_launch_server_dump_over_http(smoke_groups):
    """Warm-up and health probes write nothing, one file per request id (the client's own and
    SGLang's), the flush endpoint, and the flush at a server stop."""
    (r,) = _select(smoke_groups("engine"), "h.")
    _passed_and_discriminating(r)
    assert "warm-up + probes: 0 files" in r.detail and "-> 3 files" in r.detail


# ---- the reference check itself --------------------------------------------------------------

def test_stop_check_reads_the_series_own_stop_lines_and_fails_on_a_loss():
    """check h's verdict on a stopped server (``_engine.stop_flush``) takes the two ways the series
    logs a clean stop (the launcher's stop call; the writer's own drain when it stopped first), and
    refuses a log with a request not written, another count of files, or no stop line."""
    sys.path.insert(0, str(REPO / "src" / "eaglepatch" / "smoke"))
    from _engine import stop_flush

    drained = ("[t] EAGLE3_DUMP_DIR: SIGTERM to the launching process; drained in 0.0 s: 3 written, 0 failed, "
               "0 dropped, 0 skipped, 3 probes; nothing left unwritten\n")
    launcher = ("[t] eagle3 dump: stopped before SIGTERM to the launching process: every request handed to the "
                "writer is written (3 written, 0 failed, 0 dropped, 0 after_stop)\n")
    own = "[t] eagle3 dump: the writer stopped on its own before SIGTERM to the launching process; it drains\n"
    assert stop_flush(drained + launcher, 3) == "stopped by the launcher, every file written"
    assert stop_flush(drained + own, 3) == "drained by the writer as it stopped on its own"
    for wrong in [drained + launcher.replace("(3 written", "(2 written"),  # another count
                  drained.replace("nothing left unwritten", "1 not written, named in /d/l.json") + own,  # a loss
                  launcher.replace("0 dropped", "1 dropped"), drained,  # a drop; a drain nobody called a stop
                  "[t] EAGLE3_DUMP_DIR: 3 written, 0 failed\n"]:  # no stop line at all
        assert stop_flush(wrong, 3) is None, wrong


def test_row_check_fails_on_a_wrong_layer_and_a_skipped_norm():
    """RowCheck (the comparison every check above uses) flags a state read one layer off, a
    final state without its norm and a last-layer state after the norm."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "src" / "eaglepatch" / "smoke"))
    import _common as worker_common  # the module the workers import by path
    from _hf import Ref

    g = torch.Generator().manual_seed(0)
    stream = tuple(torch.randn(5, 8, generator=g) for _ in range(5))  # embed, 3 layers, last pre-norm
    final = stream[-1] / stream[-1].pow(2).mean(-1, keepdim=True).sqrt()
    ref = Ref(stream, final, None)
    ok = worker_common.RowCheck(TOL)
    for k in (-1, 1, 3):
        ok.layer(stream[k + 1].clone(), ref, k)
    ok.final(final.clone(), ref)
    assert ok.problems() == [] and ok.wrong > 0.1
    for wrong in [lambda c: c.layer(stream[2], ref, 0),  # id 0 read as HF index 2
                  lambda c: c.layer(stream[1], ref, 1),  # id 1 read as HF index 1
                  lambda c: c.final(stream[-1], ref),  # final without its norm
                  lambda c: c.layer(final, ref, 3)]:  # the last layer after the norm
        c = worker_common.RowCheck(TOL)
        wrong(c)
        assert any("max abs diff" in p for p in c.problems())
