#!/usr/bin/env python3
"""The project's test command: build (or reuse) the CPU SGLang environments the selected tests need, then run pytest.

  python3 tools/test.py [PYTEST ARGS...]     e.g. tests/test_export.py -x -q
  python3 tools/test.py -h | --help          this help (builds nothing, waits for nothing)
  python3 tools/test.py --pytest-help        pytest's own help (from the test environment)
  python3 tools/test.py -- ARGS...           ARGS go to pytest as they are

The environments are virtual environments under ${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}
(cpu-env-<key>, key = the requirement list and the Python version; eaglepatch.cpuenv), built
before pytest starts, all at once, each step logged as it goes with its environment's key: the test environment
(src/eaglepatch/cpu-requirements.txt) always; when the run includes tests/test_functional.py or
tests/test_dump_stops.py or tests/test_draft_capture.py or tests/test_plugin.py (every run without test paths does), also the environment of every
series' release and its tiny smoke checkpoints. Before them, the Debian packages the tests need
(eaglepatch.sysdeps: libfuse3 and fusermount3 for the slow and hung dump disks, libibverbs1 for Mooncake) are installed with
apt-get when missing (as root; otherwise the command to run is printed and the run stops). Tests never build one themselves: inside pytest a missing environment is an
error (EAGLEPATCH_NO_ENV_BUILD). The first full run, measured once on a fresh 2-core machine
(2026-12-01, a smaller suite), took 17 min (the environments 4 min) and left 12 GB in ~/.cache;
with the caches in place a whole run took 25 min (2026-12-02, 617 tests, once, the machine busy).

pytest runs as `<env python> -m pytest tests --durations=40 ARGS` with PYTHONPATH=src (the whole
suite lists its 40 slowest tests). The whole suite runs in N pytest-xdist workers
(`-n N --dist loadscope --no-loadscope-reorder`): N = EAGLEPATCH_TEST_WORKERS, else 2 on a machine
of 2 or more cores and 16 GiB or more, else 1 (one process). Each module is a unit of work given out
longest first, modules that share costly work one unit (tests/conftest.py: SHARED_UNITS, unit_of).
With N > 1 every process of the run gets cores/N torch threads (OMP_NUM_THREADS and MKL_NUM_THREADS,
unless set): two workers of two threads each on the 2-core CI machine (2026-12-06) had done 208 of
1,093 tests after 56 minutes, where one process runs the whole suite in about 62; two workers of one
thread each ran it in 39 and 35 (2026-12-07). Test paths among the arguments replace all of that (one
process), and -n or -p no:xdist among them replace the workers.

Exit: 0 every selected test passed; 1 a test failed, no test was collected (pytest's 5), or an
environment could not be built; other codes are pytest's (2 interrupted, 3 internal error,
4 pytest usage error).
"""

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli, cpuenv, sysdeps  # noqa: E402

WORKERS_ENV = "EAGLEPATCH_TEST_WORKERS"  # pytest-xdist workers for the whole suite (workers())
# the tests that run every series' environment
FUNCTIONAL = (REPO / "tests" / "test_functional.py", REPO / "tests" / "test_dump_stops.py",
              REPO / "tests" / "test_draft_capture.py", REPO / "tests" / "test_plugin.py",
              REPO / "tests" / "test_plugin_targets.py")


def _parser():
    ap = cli.parser("test.py", __doc__, whole_doc=True,
                    usage="%(prog)s [-h] [--pytest-help] [PYTEST ARGS ...] [-- ARGS ...]")
    ap.add_argument("pytest_args", nargs="*", metavar="PYTEST ARGS", help="passed to pytest (test paths, -k, -x, ...)")
    ap.add_argument("--pytest-help", action="store_true", help="print pytest's own help (builds the test environment)")
    return ap


def test_paths(args: list[str]) -> list[str]:
    """The arguments that name test paths (tests/x.py, tests/x.py::test_y, a directory)."""
    return [a for a in args if not a.startswith("-") and _exists(REPO / a.split("::")[0])]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a -k expression longer than a file name can be
        return False


def needed(paths: list[str]) -> list[tuple[Path, str, bool]]:
    """(requirement list, what it runs, whether the smoke checkpoints are needed) of every
    environment a run of `paths` (none = the whole suite) needs, the test environment first."""
    out = {cpuenv.REQUIREMENTS: ["the tests"]}
    functional = not paths
    for p in paths:
        target = (REPO / p.split("::")[0]).resolve()
        functional |= any(target == f or (target.is_dir() and f.is_relative_to(target)) for f in FUNCTIONAL)
    if functional:
        from eaglepatch.series import available_series

        for release in available_series():
            out.setdefault(cpuenv.requirements_for(release), []).append(f"sglang {release} smoke")
    return [(req, ", ".join(what), functional) for req, what in out.items()]


def build(paths: list[str]) -> Path:
    """Build (or reuse) every environment the run needs, all at once (each is mostly downloads and
    unpacking, 70-130 s from nothing; in sequence they were the sum), each log line naming its
    environment; the test environment's python. Every build runs to its end, and the first failure is
    the one reported."""
    plan = needed(paths)

    def one(i: int, req: Path, what: str, checkpoints: bool) -> None:
        d = cpuenv.env_dir(req)
        ready = (d / cpuenv.COMPLETE_MARKER).is_file()
        sys.stderr.write(f"[test.py] environment {i}/{len(plan)} ({what}; {req.name}): "  # one write: a whole line
                         + (f"ready ({d})" if ready else f"building {d} (log lines: [cpuenv {cpuenv.env_key(req)}])")
                         + "\n")
        sys.stderr.flush()
        py = cpuenv.ensure_env(req)
        if checkpoints:
            from eaglepatch.smoke import ensure_checkpoints, stubs_for

            with tempfile.TemporaryDirectory(prefix="eaglepatch-checkpoints-") as work:
                ensure_checkpoints(py, Path(work), req, stubs_for(req, Path(work)))

    with ThreadPoolExecutor(max_workers=len(plan), thread_name_prefix="env") as pool:
        futures = [pool.submit(one, i, *p) for i, p in enumerate(plan, 1)]
        failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        raise failed[0]
    py = cpuenv.ensure_env()
    if not paths or any("mooncake" in Path(p).name for p in paths):  # the store's package beside the test env
        # (test_mooncake*, test_serve_mooncake, test_extract_mooncake)
        from eaglepatch import mooncake

        print("[test.py] mooncake: " + str(mooncake.ensure_site(py)), file=sys.stderr, flush=True)
    return py


def workers() -> int:
    """How many pytest-xdist workers run the whole suite: EAGLEPATCH_TEST_WORKERS, else DEFAULT_WORKERS
    where the machine has the cores and the memory for them (``default_workers``), else 1."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if not given:
        return default_workers()
    if not given.isdigit() or int(given) < 1:
        raise RuntimeError(f"error: {WORKERS_ENV}={given!r} is not a count of workers; set it to 1 or more (1: no workers)")
    return int(given)


DEFAULT_WORKERS = 2
WORKER_MEMORY = 8 << 30  # what one worker's heaviest units (a smoke run beside the acceptance toy) need, with room


def default_workers(cores: int | None = None, memory: int | None = None) -> int:
    """DEFAULT_WORKERS where the machine has a core and WORKER_MEMORY of memory for each, else 1."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if memory is None:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = 0
    return DEFAULT_WORKERS if cores >= DEFAULT_WORKERS and memory >= DEFAULT_WORKERS * WORKER_MEMORY else 1


def thread_env(n: int, cores: int | None = None) -> dict:
    """The torch thread settings of a run in ``n`` workers: cores/n each (at least 1), so the workers'
    torch pools (and their servers') do not outnumber the cores; none for one process."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if n <= 1:
        return {}
    per = str(max(1, cores // n))
    return {"OMP_NUM_THREADS": per, "MKL_NUM_THREADS": per}


def xdist_args(args: list[str], n: int) -> list[str]:
    """pytest-xdist's arguments for a whole-suite run in ``n`` workers, none where ARGS choose workers
    themselves (-n, --numprocesses, -p no:xdist) or one worker is asked for."""
    if any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses=")) for a in args):
        return []
    return [] if n == 1 else ["-n", str(n), "--dist", "loadscope", "--no-loadscope-reorder"]


def with_threads(env: dict, pytest_args: list[str], n: int) -> dict:
    """``env`` with ``thread_env(n)`` added where the run is in workers (``-n`` among its arguments);
    a thread setting already in ``env`` stays."""
    return dict(thread_env(n), **env) if "-n" in pytest_args else env


def main(argv: list[str]) -> int:
    head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if "-h" in head or "--help" in head:
        _parser().print_help()
        return 0
    pytest_help = "--pytest-help" in head
    args = [a for a in head if a != "--pytest-help"] + tail
    try:
        n = workers()
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        if not pytest_help:
            sysdeps.ensure()
        py = cpuenv.ensure_env() if pytest_help else build(test_paths(args))
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[cpuenv.NO_BUILD_ENV] = "1"  # every environment the run needs is built: none is built inside pytest
    if pytest_help:
        return subprocess.call([str(py), "-m", "pytest", "--help"], cwd=REPO, env=env)
    # the whole suite also lists its 40 slowest tests, so every CI log shows where the time goes, and
    # runs in workers() pytest-xdist workers (2 by default), a module (or modules sharing costly work) a
    # unit (tests/conftest.py), each process with cores/N torch threads (thread_env)
    whole = [] if test_paths(args) else ["tests", "--durations=40"] + xdist_args(args, n)
    env = with_threads(env, whole, n)
    cmd = [str(py), "-m", "pytest"] + whole + args
    print("$ PYTHONPATH=src %s" % " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    if rc == 5:
        print("error: pytest collected no tests; that is a failure here", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
