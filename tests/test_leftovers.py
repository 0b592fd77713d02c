"""A run leaves nothing behind (issue 17): semaphores that killed SGLang processes leave in
/dev/shm are removed (eaglepatch.shm, the smoke harness), and a failing download leaves no empty
release directory in the cache. (Every test is also checked for eaglepatch-* entries left in the
temp dir: conftest's `_leaves_nothing_in_the_temp_dir`.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import one_line_error, run_tool

from eaglepatch import shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc"),
                                reason="Linux /dev/shm and /proc")

# A process that creates a named semaphore the way SGLang's spawned workers do (multiprocessing,
# spawn context: the name stays until the resource tracker unlinks it), prints its file name, and
# then (LEAK) SIGKILLs its children, the resource tracker among them, as Engine.shutdown() does,
# and dies; or (HOLD) waits for stdin to close, the semaphore still in use.
SEMAPHORE = textwrap.dedent("""
    import multiprocessing, os, signal, sys
    lock = multiprocessing.get_context("spawn").Lock()
    print("sem." + lock._semlock.name.lstrip("/"), flush=True)
    if sys.argv[1] == "LEAK":
        for pid in os.listdir("/proc"):
            try:
                ppid = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if ppid == str(os.getpid()):
                os.kill(int(pid), signal.SIGKILL)
        print('@@RESULT {"name": "x", "passed": true, "figure": "ok"}', flush=True)
        os._exit(0)
    sys.stdin.read()
""")


def test_sweep_removes_the_semaphores_of_dead_processes_and_keeps_those_in_use(tmp_path):
    """A dead process's semaphore is removed, one in use is kept. Other sweepers may run at the same
    time (tests in other pytest-xdist workers, their smoke harnesses): one may remove a dead
    process's semaphore first, which is their right, so a leak this sweep did not see is made again
    (at most 5 times); a sweep that removes no dead semaphore fails every time."""
    script = tmp_path / "sem.py"
    script.write_text(SEMAPHORE)
    before = shm.snapshot()
    hold = subprocess.Popen([sys.executable, str(script), "HOLD"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        held = hold.stdout.readline().strip()
        assert (shm.SHM / held).exists()
        seen = []
        for _ in range(5):
            leak = subprocess.run([sys.executable, str(script), "LEAK"], capture_output=True, text=True, timeout=60)
            leaked = leak.stdout.split()[0]
            if not (shm.SHM / leaked).exists():  # another sweeper was first
                seen.append((leaked, "gone before the sweep"))
                continue
            gone = shm.sweep(before)
            assert held not in gone and (shm.SHM / held).exists(), "a semaphore in use was removed"
            if leaked in gone:
                assert not (shm.SHM / leaked).exists()
                break
            seen.append((leaked, "exists" if (shm.SHM / leaked).exists() else "gone, by another sweeper"))
        else:
            pytest.fail(f"no sweep removed a dead process's semaphore: {seen}")
    finally:
        hold.stdin.close()
        hold.wait(timeout=60)
        shm.sweep(before)


def test_smoke_worker_leaves_no_semaphore(tmp_path):
    """The smoke harness runs a worker whose SGLang engine is shut down (children SIGKILLed): the
    semaphores those processes made are gone once the worker's results are in."""
    from eaglepatch.smoke import _run_worker
    script = tmp_path / "worker.py"
    script.write_text(SEMAPHORE)
    results = _run_worker(Path(sys.executable), str(script), ["LEAK"], dict(os.environ), tmp_path / "w.log", 60,
                          expected=["x"])
    assert [r.name for r in results] == ["x"] and results[0].passed
    log = (tmp_path / "w.log").read_text()
    name = next(ln for ln in log.splitlines() if ln.startswith("sem."))
    assert not (shm.SHM / name).exists(), f"{name} left in /dev/shm:\n{log}"
    # the sweep names what it removed (other tests' dead processes may have left more meanwhile)
    said = next((ln for ln in log.splitlines() if ln.startswith("# removed ")), "")
    assert name in said, log


def test_a_release_that_cannot_be_downloaded_leaves_no_cache_directory(tmp_path):
    """drift --releases with a release the index does not have: one line, and no empty
    releases/<release> directory in the cache."""
    cache = tmp_path / "cache"
    r = run_tool("drift", "--releases", "0.5.99", "--out", tmp_path / "d.md", env={"EAGLEPATCH_CACHE": str(cache)})
    assert r.returncode == 2 and "sglang==0.5.99" in one_line_error(r), r.stdout + r.stderr
    assert (cache / "releases").is_dir() and not any((cache / "releases").iterdir())
    assert not (tmp_path / "d.md").exists()
