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
from pathlib import Path

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


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_test_py_refuses_a_workers_count_that_is_not_one(value, tmp_path):
    """EAGLEPATCH_TEST_WORKERS must be a count of 1 or more: otherwise one line, exit 2, before any
    build (the cache stays empty)."""
    r = run_tool("test", env={"EAGLEPATCH_CACHE": str(tmp_path), "EAGLEPATCH_TEST_WORKERS": value})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: EAGLEPATCH_TEST_WORKERS="), r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


def test_test_py_runs_the_whole_suite_in_workers_and_test_paths_in_one_process(monkeypatch):
    t = _test_py()
    monkeypatch.setenv("EAGLEPATCH_TEST_WORKERS", "3")
    assert t.workers() == 3
    assert t.xdist_args([], 3) == ["-n", "3", "--dist", "loadscope", "--no-loadscope-reorder"]
    assert t.xdist_args(["-x", "-k", "peers"], 2)[:2] == ["-n", "2"]
    for own in (["-n", "4"], ["-n4"], ["--numprocesses=4"], ["-p", "no:xdist"]):
        assert t.xdist_args(own, 2) == [], own
    assert t.xdist_args([], 1) == []
    monkeypatch.delenv("EAGLEPATCH_TEST_WORKERS")
    assert t.workers() == t.default_workers()
    # unless asked: 2 workers where there are 2 cores and 16 GiB, else one process
    assert t.default_workers(2, 16 << 30) == 2 and t.default_workers(64, 1 << 40) == 2
    assert t.default_workers(1, 1 << 40) == 1 and t.default_workers(2, 15 << 30) == 1
    # the workers' torch threads share the cores; one process keeps torch's own default
    assert t.thread_env(2, 2) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert t.thread_env(2, 16) == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert t.thread_env(3, 2)["OMP_NUM_THREADS"] == "1" and t.thread_env(1, 2) == {}
    # given to the run's processes only with workers, and never over what the user set
    assert t.with_threads({"A": "1"}, t.xdist_args([], 2), 2)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert t.with_threads({"OMP_NUM_THREADS": "7"}, t.xdist_args([], 2), 2)["OMP_NUM_THREADS"] == "7"
    assert t.with_threads({"A": "1"}, t.xdist_args([], 1), 1) == {"A": "1"}
    assert t.with_threads({"A": "1"}, t.xdist_args(["-p", "no:xdist"], 2), 2) == {"A": "1"}


# a plugin that records which worker was given each test, in the order given, and skips it before
# any fixture is made
DEALT_PLUGIN = '''
import os, time
import pytest
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    with open(os.environ["DEALT_OUT"], "a") as f:
        f.write("%d %s %s\\n" % (time.monotonic_ns(), os.environ.get("PYTEST_XDIST_WORKER", "main"), item.nodeid))
    pytest.skip("dealt")
'''


def test_the_whole_suite_is_dealt_in_units_that_keep_shared_work_together(tmp_path):
    """The whole suite as tools/test.py runs it (2 pytest-xdist workers, ``--dist loadscope
    --no-loadscope-reorder``), each test skipped as it starts: every test is given out once; every
    unit's tests (conftest.unit_of: a module, or the modules of a SHARED_UNITS entry) go to one worker,
    contiguous and in collection order (test_acceptance before test_check_draft, which starts from what
    the former publishes); the two workers start with the two longest units, and the units are given
    out in conftest.LONGEST_FIRST's order, each worker's in that order; the summary's timeline names
    each worker's units in the order it ran them. Without workers nothing is moved."""
    import conftest

    (tmp_path / "dealt_plugin.py").write_text(DEALT_PLUGIN)
    out = tmp_path / "dealt.txt"
    env = dict(os.environ, DEALT_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))

    def deal(*extra):
        out.unlink(missing_ok=True)
        # --assert=plain: every test is skipped before it runs, so no assert of theirs is rewritten for nothing
        # (with PYTHONDONTWRITEBYTECODE each collecting process rewrote all modules again: 15 s each)
        r = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "dealt_plugin", "-p", "no:cacheprovider",
                            "--assert=plain", *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        rows = sorted((ln.split(" ", 2) for ln in out.read_text().splitlines()), key=lambda r: int(r[0]))
        return [(w, n) for _, w, n in rows], r.stdout

    plain, _ = deal()
    dealt, shown = deal(*_test_py().xdist_args([], 2))
    assert sorted(n for _, n in dealt) == sorted(n for _, n in plain) and len(dealt) == len(set(dealt)) > 1000
    unit = conftest.unit_of
    workers = {}
    for w, n in dealt:
        workers.setdefault(unit(n), set()).add(w)
    assert all(len(ws) == 1 for ws in workers.values()), {u: ws for u, ws in workers.items() if len(ws) > 1}
    assert len({w for ws in workers.values() for w in ws}) == 2
    for w in ("gw0", "gw1"):
        mine = [n for x, n in dealt if x == w]
        seq = [unit(n) for i, n in enumerate(mine) if i == 0 or unit(mine[i - 1]) != unit(n)]
        assert len(seq) == len(set(seq)), f"{w}: a unit's tests are not contiguous: {seq}"
        for u in set(seq):  # each unit's tests in collection order
            assert [n for n in mine if unit(n) == u] == [n for _, n in plain if unit(n) == u], (w, u)
    mods = [n.split("::")[0] for _, n in dealt]
    assert max(i for i, m in enumerate(mods) if m.endswith("test_acceptance.py")) < mods.index("tests/test_check_draft.py")
    starts = {}
    for w, n in dealt:
        starts.setdefault(unit(n), w)
    assert {starts[u] for u in conftest.LONGEST_FIRST[:2]} == {"gw0", "gw1"}  # the first deal: one each
    for w in ("gw0", "gw1"):  # a worker is given its units in turn
        mine = [u for u in dict.fromkeys(unit(n) for x, n in dealt if x == w)]
        assert [u for u in mine if u in conftest.LONGEST_FIRST] == [u for u in conftest.LONGEST_FIRST
                                                                    if starts[u] == w], (w, mine)
        assert mine[0] in conftest.LONGEST_FIRST[:2], (w, mine[:3])
        # the timeline at the end names each unit on the worker that ran it, in the order it ran them
        line = next((ln for ln in shown.splitlines() if ln.startswith(w + ": ")), "")
        assert [part.rsplit(" ", 1)[0] for part in line[len(w) + 2:].split("; ")[0].split(", ")] == mine, (w, line)
    assert [n.split("::")[0] for _, n in plain] == sorted(n.split("::")[0] for _, n in plain)


def test_a_module_that_shares_costly_work_outside_its_unit_is_refused():
    """conftest.split_shared_work: the users of a SHARED_FIXTURES fixture in two units are named
    (the collection then stops with a usage error); in one unit, nothing."""
    from types import SimpleNamespace as T

    import conftest

    ok = [T(nodeid="tests/test_functional.py::a", fixturenames=["series_smoke"]),
          T(nodeid="tests/test_plugin.py::b[0.5.17]", fixturenames=["series_smoke", "tmp_path"]),
          T(nodeid="tests/test_export.py::c", fixturenames=["tmp_path"])]
    assert conftest.split_shared_work(ok) == {}
    bad = ok + [T(nodeid="tests/test_new.py::d", fixturenames=["series_smoke"])]
    assert conftest.split_shared_work(bad) == {"series_smoke": ["test_functional", "test_new"]}


def test_smoke_workers_load_no_nccl(tmp_path):
    """A smoke worker's SGLang finds no NCCL library: ``SGLANG_NCCL_SO_PATH`` names one that loads
    nothing (SGLang's ``NCCLLibrary`` opens it with ctypes first, and disables pynccl when that fails).
    With a CUDA build of torch on a CPU machine (a fresh machine's torch from the package index), a
    TP 2 launch otherwise fails in pynccl on the CPU device (test_dump_stops' TP 2 test, seen so)."""
    import ctypes

    from eaglepatch.smoke import worker_env

    env = worker_env(tmp_path)
    assert env["SGLANG_NCCL_SO_PATH"] == os.devnull
    with pytest.raises(OSError):
        ctypes.CDLL(env["SGLANG_NCCL_SO_PATH"])


@pytest.mark.parametrize("dont_write", [True, False])
def test_smoke_workers_read_the_installed_bytecode(dont_write, tmp_path, monkeypatch):
    """A smoke worker (``eaglepatch.smoke.worker_env``) loads the installed packages' own bytecode:
    under PYTHONDONTWRITEBYTECODE it gets no PYTHONPYCACHEPREFIX (a prefix where nothing is written
    hid torch's ``__pycache__`` from every worker, Engine and server process, each compiling torch,
    transformers and sglang from source: an Engine start took 83 s against 40 s); where bytecode is
    written, it goes to a directory of the runner's, outside the tree (the tree stays unwritten)."""
    from eaglepatch.smoke import worker_env

    if dont_write:
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    else:
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    env = worker_env(tmp_path)
    # where this interpreter looks for torch's bytecode, torch not imported
    probe = ("import importlib.util, os; print(os.path.exists(importlib.util.cache_from_source("
             "importlib.util.find_spec('torch').origin)))")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if dont_write:
        assert "PYTHONPYCACHEPREFIX" not in env and r.stdout.strip() == "True", (r.stdout, env.get("PYTHONPYCACHEPREFIX"))
    else:
        prefix = env["PYTHONPYCACHEPREFIX"]
        assert Path(prefix).is_dir() and not Path(prefix).is_relative_to(tmp_path), prefix
