"""Every tool's --help (issue 17): exit 0, no traceback, the exit codes and the defaults shown;
tools/test.py prints its own help without building or locking anything, and decides before
pytest starts which CPU environments a run needs (pytest never builds one)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, run_tool

from eaglepatch import cpuenv
from eaglepatch.series import available_series

TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py"))

@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("tool", TOOLS)
def test_help_exits_0_with_exit_codes_and_no_traceback(tool, flag, tmp_path):
    t0 = time.monotonic()
    r = run_tool(tool, flag, env={"EAGLEPATCH_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout.startswith("usage: "), r.stdout + r.stderr
    assert time.monotonic() - t0 < 60
    epilog = " ".join(r.stdout.split()).split("exit codes: ", 1)
    assert len(epilog) == 2, f"{tool} --help states no exit codes:\n{r.stdout}"
    assert all(f"{c} " in epilog[1] for c in "012"), epilog[1]
    # --help builds nothing and downloads nothing (test.py's environments above all)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))


def _help(tool: str) -> str:
    return " ".join(run_tool(tool, "--help").stdout.split())


def test_help_shows_the_defaults_and_a_readable_fetch():
    out = _help("apply")
    assert "--fetch [RELEASE [DEST]]" in out and "..." not in out
    assert "(default: the pinned release" in out and "(default: ./sglang-RELEASE)" in out
    assert "(default: 60.0)" in _help("gpu_bundle")
    assert "(default: static)" in _help("verify")
    assert "(default: docs/drift.md" in _help("drift")
    assert "(default: None)" not in out and "(default: False)" not in out


def test_test_py_help_is_its_own(tmp_path):
    """Not pytest's 600 lines: what it does, where the environments are, how long the first run
    takes, how to reach pytest's help; with an empty cache it starts no build (no lock either)."""
    r = run_tool("test", "--help", env={"EAGLEPATCH_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    for want in ("EAGLEPATCH_CACHE", "17 min", "12 GB", "--pytest-help", "exit codes: 0"):
        assert want in r.stdout, want
    assert "--basetemp" not in r.stdout and r.stderr == ""
    assert list(tmp_path.iterdir()) == []


def _test_py():
    spec = importlib.util.spec_from_file_location("eaglepatch_test_tool", REPO / "tools" / "test.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_test_py_builds_the_release_environments_when_the_functional_tests_run():
    t = _test_py()
    main = [(cpuenv.REQUIREMENTS, "the tests", False)]
    assert t.needed(["tests/test_export.py"]) == main
    assert t.needed(["tests/test_export.py::test_slug", "-x"]) == main
    every = {cpuenv.REQUIREMENTS} | {cpuenv.requirements_for(r) for r in available_series()}
    assert len(every) > 1
    for paths in ([], ["tests"], ["tests/test_functional.py"], ["tests/test_functional.py::test_x"],
                  ["tests/test_export.py", "tests/"]):
        plan = t.needed(t.test_paths(paths) if paths else [])
        assert {req for req, _, _ in plan} == every, paths
        assert plan[0][0] == cpuenv.REQUIREMENTS and all(ck for _, _, ck in plan)


def test_test_py_builds_the_environments_at_once_and_reports_the_first_failure(tmp_path, monkeypatch, capsys):
    """tools/test.py's build(): every environment of the plan is built at the same time through
    cpuenv.ensure_env (its lock, its marker), each log line names its environment, a failing build
    lets the others finish and is the error raised. ``_build`` is replaced by one that logs, waits
    1 s and marks the environment complete (the real one downloads torch)."""
    t = _test_py()
    reqs = []
    for i in range(3):
        reqs.append(tmp_path / f"req-{i}.txt")
        reqs[-1].write_text(f"torch==0.0.{i}\n")
    monkeypatch.setenv("EAGLEPATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(cpuenv.NO_BUILD_ENV, raising=False)
    spans, broken = {}, {reqs[1].name}

    def fake_build(d, requirements):
        t0 = time.monotonic()
        cpuenv._log("step 1/4: pip install %s ..." % requirements.name)
        time.sleep(1.0)
        if requirements.name in broken:
            raise RuntimeError("error: %s does not build" % requirements.name)
        (d / "bin").mkdir(parents=True)
        (d / "bin" / "python").symlink_to(sys.executable)
        (d / cpuenv.COMPLETE_MARKER).write_text("test\n")
        spans[requirements.name] = (t0, time.monotonic(), threading.current_thread().name)

    monkeypatch.setattr(cpuenv, "_build", fake_build)
    monkeypatch.setattr(t, "needed", lambda paths: [(r, r.stem, False) for r in reqs])
    with pytest.raises(RuntimeError, match="req-1.txt does not build"):
        t.build(["tests/test_export.py"])  # (a path: no Mooncake site beside the test env)
    assert set(spans) == {reqs[0].name, reqs[2].name}  # the others ran to their end
    (a0, a1, _), (b0, b1, _) = spans[reqs[0].name], spans[reqs[2].name]
    assert max(a0, b0) < min(a1, b1), spans  # at the same time, not one after the other
    err = capsys.readouterr().err
    for r in reqs:
        assert f"[cpuenv {cpuenv.env_key(r)}] step 1/4: pip install {r.name}" in err, err
    assert not (cpuenv.env_dir(reqs[1]) / cpuenv.COMPLETE_MARKER).exists()

    # mended: the failed one builds, the built ones are reused, and build() returns the test env's python
    broken.clear()
    spans.clear()
    monkeypatch.setattr(t, "needed", lambda paths: [(cpuenv.REQUIREMENTS, "the tests", False)]
                        + [(r, r.stem, False) for r in reqs])
    py = t.build(["tests/test_export.py"])
    assert py == cpuenv.env_dir(cpuenv.REQUIREMENTS) / "bin" / "python"
    assert set(spans) == {reqs[1].name, cpuenv.REQUIREMENTS.name}, spans
    assert "ready (" in capsys.readouterr().err


def test_inside_pytest_under_test_py_no_environment_is_built(tmp_path):
    """EAGLEPATCH_NO_ENV_BUILD (tools/test.py sets it for pytest): ensure_env refuses a missing
    environment with an error naming tools/test.py, and creates nothing."""
    code = "from eaglepatch import cpuenv; cpuenv.ensure_env()"
    env = dict(os.environ, EAGLEPATCH_CACHE=str(tmp_path), EAGLEPATCH_NO_ENV_BUILD="1",
               PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "tools/test.py" in r.stderr and "is not built" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
