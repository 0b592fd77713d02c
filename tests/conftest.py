"""Shared fixtures: the real sglang 0.5.9 / 0.5.10 wheels (fetched once through eaglepatch.fetch
and cached), trees laid out as a git checkout or an installed package, and tool runners.

git: the whole session runs without the user's git configuration (GIT_CONFIG_GLOBAL = a session
file that only sets `user.useConfigOnly`, GIT_CONFIG_NOSYSTEM=1), so no git identity exists and
none is guessed from the host name. A test that commits passes its identity (`git()` below, as the
tools do with theirs); a failed git call shows git's own stderr.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.fetch import make_git_checkout, unpacked_release  # noqa: E402
from eaglepatch.series import load_series  # noqa: E402
from eaglepatch.tree import tree_hashes  # noqa: E402

# who commits in the tests' own git calls (the tools bring their own: eaglepatch.gitcmd.GIT_ID)
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "eaglepatch tests", "GIT_AUTHOR_EMAIL": "tests@eaglepatch.invalid",
                "GIT_COMMITTER_NAME": "eaglepatch tests", "GIT_COMMITTER_EMAIL": "tests@eaglepatch.invalid"}
# the session's git configuration: no identity, and git may not guess one (on any host)
SESSION_GITCONFIG = "[user]\n\tuseConfigOnly = true\n"

FIXTURES = REPO / "tests" / "fixtures"
BASIC_ROOT = FIXTURES / "series-basic"
BASIC = BASIC_ROOT / "sglang-0.5.9"
REAL = REPO / "patches" / "sglang-0.5.9"


def pytest_configure(config):
    """Before anything runs: the session's own directory in the system temp dir, holding
    - `gitconfig`, the session's (empty) git configuration, for every git the tests and the tools
      they start run;
    - `tmp/`, the temp dir (TMPDIR) of the session and of every process it starts, removed at the
      end: what killed processes leave there goes with it. pytest's own tmp_path stays where it
      always is (PYTEST_DEBUG_TEMPROOT), and so does torch's compile cache."""
    import getpass
    import tempfile
    from eaglepatch import shm
    system_tmp = tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="eaglepatch-tests-", dir=system_tmp))
    root.chmod(0o755)  # tools run as another user (setpriv) read it too
    cfg = root / "gitconfig"
    cfg.write_text(SESSION_GITCONFIG)
    cfg.chmod(0o644)
    tmp = root / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp: tools run as another user write there too
    # the user's GIT_* (an identity, GIT_DIR from a hook, ...) are not the session's either
    old = {k: v for k, v in os.environ.items() if k.startswith("GIT_")}
    for k in ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM", "TMPDIR", "PYTEST_DEBUG_TEMPROOT",
              "TORCHINDUCTOR_CACHE_DIR"):
        old[k] = os.environ.get(k)
    config._eaglepatch_session = (root, old, tempfile.tempdir, shm.snapshot())
    for k in old:
        if k.startswith("GIT_"):
            os.environ.pop(k, None)
    os.environ["GIT_CONFIG_GLOBAL"] = str(cfg)
    os.environ["GIT_CONFIG_NOSYSTEM"] = "1"
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system_tmp)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(system_tmp, "torchinductor_" + getpass.getuser()))
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)


# tools/test.py runs the whole suite in N pytest-xdist workers (2 by default where the machine allows; -n N
# --dist loadscope --no-loadscope-reorder), dealt out in units by ``pytest_xdist_make_scheduler``: each module is
# one unit, so its fixtures are made once, and the modules of one SHARED_UNITS entry are one unit, in
# collection order: they share a session's costly work (the smoke runs of ``series_smoke`` and
# ``plugin_cli_smoke``; test_check_draft starts from the inputs test_acceptance publishes in the cache:
# apart, each would make them again, or race to). A module that uses one of SHARED_FIXTURES outside
# the unit of their other users is refused at collection.
SHARED_UNITS = {"test_functional": ("test_functional", "test_plugin", "test_plugin_targets"),
                "test_acceptance": ("test_acceptance", "test_check_draft")}
SHARED_FIXTURES = ("series_smoke", "plugin_cli_smoke")
UNIT_OF = {m: unit for unit, mods in SHARED_UNITS.items() for m in mods}
# the units measured longest on the 2-core CI machine (stop 55's durations), given out first so that
# no long one starts last; the others follow in collection order
LONGEST_FIRST = ("test_acceptance", "test_functional", "test_acceptance_dflash", "test_dump_stops",
                 "test_extract", "test_peers", "test_draft_capture", "test_mooncake_online_bench")


def unit_of(nodeid: str) -> str:
    """The unit of work of a test id (``tests/test_x.py::test_y[z]``): its module's SHARED_UNITS
    entry, else its module."""
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return UNIT_OF.get(module, module)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist installed knows no such hook
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope``: xdist's scope scheduler with ``unit_of`` as the scope (a unit's
    tests go to one worker, in order; a free worker takes the next unit in collection order).
    pytest-xdist 3.8's own ``loadgroup`` cannot do this here: it sets each test's ``_nodeid``, which
    pytest 9 ignores (its ``Node.nodeid`` is made from ``_id``), so every test became a unit of its own."""
    if config.getoption("dist", "no") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def split_shared_work(items) -> dict:
    """SHARED_FIXTURES -> the units of the tests that use it, where that is more than one."""
    users = {}
    for it in items:
        for f in SHARED_FIXTURES:
            if f in getattr(it, "fixturenames", ()):
                users.setdefault(f, set()).add(unit_of(it.nodeid))
    return {f: sorted(u) for f, u in users.items() if len(u) > 1}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Every run: a module using one of SHARED_FIXTURES outside their other users' unit is refused.
    In pytest-xdist workers (and their controller): the units in LONGEST_FIRST's order, then in
    collection order, each unit's tests contiguous and in collection order."""
    split = split_shared_work(items)
    if split:
        raise pytest.UsageError(f"tests/conftest.py: modules of different units share {split}: put them in one "
                                f"SHARED_UNITS entry (else each pytest-xdist worker makes that work again)")
    if not (hasattr(config, "workerinput") or config.getoption("dist", "no") != "no"):
        return
    order = {u: i for i, u in enumerate(LONGEST_FIRST)}
    first_seen = {}
    for i, it in enumerate(items):
        first_seen.setdefault(unit_of(it.nodeid), i)
    items.sort(key=lambda it: (order.get(unit_of(it.nodeid), len(order)), first_seen[unit_of(it.nodeid)]))


# the controller of a pytest-xdist run: (worker, unit) -> [start, end], seconds since the session started
_UNIT_SPANS: dict = {}
_T0 = [None]


def pytest_sessionstart(session):
    _T0[0] = time.monotonic()


def pytest_runtest_logreport(report):
    """In the controller of a pytest-xdist run (``report.node``: the worker): when each unit's tests
    ran on which worker, for the timeline at the end."""
    node = getattr(report, "node", None)
    if node is None or _T0[0] is None or report.when not in ("setup", "teardown"):
        return
    now = time.monotonic() - _T0[0]
    span = _UNIT_SPANS.setdefault((node.gateway.id, unit_of(report.nodeid)), [now, now])
    if report.when == "setup":
        span[0] = min(span[0], now - report.duration)
    span[1] = max(span[1], now)


def pytest_terminal_summary(terminalreporter):
    """The units each worker ran, in order, with their seconds, and how long each worker had nothing
    left to do before the run ended: what to move when the suite's wall time grows."""
    if not _UNIT_SPANS:
        return
    end = time.monotonic() - _T0[0]
    tr = terminalreporter
    tr.section("units per worker (seconds from the session's start)")
    for w in sorted({w for w, _ in _UNIT_SPANS}):
        spans = sorted((v[0], v[1], u) for (x, u), v in _UNIT_SPANS.items() if x == w)
        busy = sum(b - a for a, b, _ in spans)
        tr.write_line(f"{w}: " + ", ".join(f"{u} {a:.0f}-{b:.0f}" for a, b, u in spans)
                      + f"; {busy:.0f} s in units, idle for the last {end - spans[-1][1]:.0f} s of {end:.0f}")


def pytest_sessionfinish(session, exitstatus):
    """Semaphores and shared memory that processes which died during the session left in /dev/shm
    (SGLang servers killed by a test) are removed, and said so."""
    from eaglepatch import shm
    state = getattr(session.config, "_eaglepatch_session", None)
    if state is None:
        return
    gone = shm.sweep(state[3])
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if gone and tr is not None:
        tr.write_line(f"removed {len(gone)} semaphore/shared-memory file(s) that dead processes left in /dev/shm: "
                      + " ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))


def pytest_unconfigure(config):
    import tempfile
    state = getattr(config, "_eaglepatch_session", None)
    if state is None:
        return
    root, old, tempdir, _ = state
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = tempdir
    shutil.rmtree(root, ignore_errors=True)


def _ours_in_tmp() -> set:
    """eaglepatch's entries in the session temp dir, less this process's bytecode dir (removed at exit)."""
    import tempfile
    from eaglepatch.smoke import _PYCACHE
    keep = {Path(p).name for p in _PYCACHE}
    try:
        names = os.listdir(tempfile.gettempdir())
    except OSError:
        return set()
    return {n for n in names if n.lstrip(".").startswith("eaglepatch-") and n not in keep}


@pytest.fixture(autouse=True)
def _leaves_nothing_in_the_temp_dir():
    """Every test: the tools and the library leave no eaglepatch-* file or directory in the temp dir
    (a test that kills a tool gives it a temp dir of its own, see txnkit)."""
    import tempfile
    before = _ours_in_tmp()
    yield
    left = sorted(_ours_in_tmp() - before)
    for n in left:
        p = Path(tempfile.gettempdir()) / n
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if left:
        pytest.fail(f"left in the temp dir: {', '.join(left)}", pytrace=False)


def git(repo: Path, *args, input: str | None = None, check: bool = True, env: dict | None = None) -> str:
    """`git ARGS` in `repo` with the tests' identity; a failure is an AssertionError holding git's stderr."""
    e = dict(os.environ, **GIT_IDENTITY, **(env or {}))
    r = subprocess.run(["git", *map(str, args)], cwd=repo, capture_output=True, text=True, input=input, env=e)
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(map(str, args))} in {repo} exited {r.returncode}:\n"
                             f"{r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


@pytest.fixture(scope="session")
def release_059() -> Path:
    """Read-only unpacked sglang 0.5.9 wheel (package parent)."""
    return unpacked_release("0.5.9", quiet=True)


@pytest.fixture(scope="session")
def release_0510() -> Path:
    return unpacked_release("0.5.10", quiet=True)


@pytest.fixture(scope="session")
def releases(release_059, release_0510) -> dict:
    return {"0.5.9": release_059, "0.5.10": release_0510}


def copy_installed(src: Path, dest: Path, files: list[str] | None = None) -> Path:
    """Lay out an installed package at dest (site-packages style): the dist-info, the package's
    top-level files, and either the whole package or just `files` (package-parent-relative)."""
    dest.mkdir(parents=True)
    for d in src.glob("sglang-*.dist-info"):
        shutil.copytree(d, dest / d.name)
    if files is None:
        shutil.copytree(src / "sglang", dest / "sglang")
        return dest
    (dest / "sglang").mkdir()
    for p in (src / "sglang").iterdir():
        if p.is_file():
            shutil.copy2(p, dest / "sglang" / p.name)
    for rel in files:
        if (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dest / rel)
    return dest


def series_files(*dirs: Path) -> list[str]:
    out: list[str] = []
    for d in dirs:
        if (d / "series").is_file():
            s = load_series(d)
            out += s.files(smoke=True)
    return sorted(set(out))


@pytest.fixture(scope="session")
def _fast_root():
    """Trees of 26 MB per test go to RAM (/dev/shm) when it is there: much faster on a busy disk."""
    import tempfile
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="eaglepatch-tests-", dir="/dev/shm"))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield None


@pytest.fixture
def fast_tmp(_fast_root, tmp_path) -> Path:
    if _fast_root is None:
        return tmp_path
    import tempfile
    return Path(tempfile.mkdtemp(dir=_fast_root))


@pytest.fixture
def installed_059(fast_tmp, release_059) -> Path:
    """sglang 0.5.9 laid out as an installed package, holding the files the series touch."""
    return copy_installed(release_059, fast_tmp / "site-packages", series_files(BASIC, REAL))


@pytest.fixture
def installed_0510(fast_tmp, release_0510) -> Path:
    return copy_installed(release_0510, fast_tmp / "site-packages-0.5.10", series_files(BASIC, REAL))


@pytest.fixture
def checkout_059(fast_tmp) -> Path:
    """A fresh git checkout of sglang 0.5.9 (python/sglang/..., tagged v0.5.9, no _version.py)."""
    return make_git_checkout("0.5.9", fast_tmp / "sglang", quiet=True)


@pytest.fixture(scope="session")
def series_smoke(tmp_path_factory):
    """run(release, group) -> (results, work dir): one smoke worker group ("import", "runner" or
    "engine") on the series-patched tree of a release (upstream + series + smoke.series), each tree
    built and each group run at most once per session; tests/test_functional.py checks the results,
    tests/test_plugin.py compares its plugin runs with the dumps in the work dir."""
    from eaglepatch.series import available_series
    from eaglepatch.smoke import run_smoke
    from eaglepatch.smoke.tree import patched_tree

    series = available_series()
    trees, runs = {}, {}

    def tree(release: str) -> Path:
        """The package parent of the release's patched tree (read only)."""
        if release not in trees:
            trees[release] = patched_tree(unpacked_release(release, quiet=True), series[release],
                                          tmp_path_factory.mktemp("smoke-tree-" + release))
        return trees[release]

    def run(release: str, group: str):
        key = (release, group)
        if key not in runs:
            level = "import" if group == "import" else "functional"
            checks = None if level == "import" else [group]
            work = tmp_path_factory.mktemp("smoke-%s-%s" % (release, group))
            runs[key] = (run_smoke(level, tree(release), series[release], checks=checks, work_dir=work), work)
        return runs[key]

    run.tree = tree
    return run


@pytest.fixture(scope="session")
def plugin_cli_smoke(tmp_path_factory):
    """``tools/verify.py --plugin ROOT --smoke functional --json --smoke-work`` on the unmodified newest
    release the plugin covers, run once per session in an empty working directory:
    tests/test_plugin_targets.py checks the command, tests/test_plugin.py compares the dump files of
    its engine checks with the series' (the run's work directory is kept for that)."""
    from types import SimpleNamespace

    from eaglepatch.plugin import plugin_releases

    release = plugin_releases()[-1]
    root = unpacked_release(release, quiet=True)
    base = tmp_path_factory.mktemp("plugin-cli-smoke")
    cwd = base / "cwd"
    cwd.mkdir()
    before = hashes(root)
    r = run_tool("verify", "--plugin", root, "--smoke", "functional", "--json", base / "r.json",
                 "--smoke-work", base / "work", cwd=cwd)
    return SimpleNamespace(release=release, proc=r, json=base / "r.json", work=base / "work",
                           made=sorted(x.name for x in cwd.iterdir()), tree_unchanged=hashes(root) == before)


def process_table() -> dict:
    """{pid: (state, parent pid)} of every process /proc lists now (state "Z": a zombie)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(d.name)] = (fields[0], int(fields[1]))
            except (OSError, ValueError, IndexError):
                pass
    return out


def run_suite_in_cpu_env(test_file: str, timeout: int) -> None:
    """Run one test module again inside the cached CPU SGLang environment (built if absent); a
    failure there fails the caller (its output is above)."""
    from eaglepatch.cpuenv import ensure_env

    py = ensure_env()
    p = subprocess.run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test_file)],
                       cwd=REPO, timeout=timeout)
    assert p.returncode == 0, f"{Path(test_file).name} failed inside the CPU env (output above)"


def run_tool(tool: str, *args, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), *map(str, args)],
                          capture_output=True, text=True, env=e, cwd=cwd or REPO)


def hashes(root: Path) -> dict:
    return tree_hashes(root)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, r.stderr
    assert "; " in errs[0]
    return errs[0]



@pytest.fixture
def small(fast_tmp, release_059) -> Path:
    """An installed-layout sglang 0.5.9 holding the fixture series' files (real bytes): the fault
    and safety tests' tree."""
    return copy_installed(release_059, fast_tmp / "sp", series_files(BASIC))


@pytest.fixture
def small_git(fast_tmp, release_059) -> Path:
    """A git checkout (tag v0.5.9) holding the fixture series' files."""
    from txnkit import small_checkout

    return small_checkout(release_059, fast_tmp / "co", series_files(BASIC))


def python3_in(bindir: Path) -> Path:
    """``bindir/python3`` running this interpreter as a user's ``python3`` would be run: a script
    that execs it (a symlink to a virtual environment's python outside the environment loses the
    environment's packages)."""
    exe = bindir / "python3"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    return exe
