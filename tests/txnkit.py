"""Helpers for the fault tests: run a tool until a named stop point (EAGLEPATCH_STOP_AT, see
eaglepatch.interrupts), then kill or interrupt it there; small real trees."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import BASIC, REPO, copy_installed, run_tool
from conftest import git as _git


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def start_stopped(tool: str, *args, stage: str, env: dict | None = None, timeout: float = 120,
                  prefix: list | None = None) -> subprocess.Popen:
    """Start tools/<tool>.py (after `prefix`, e.g. a setpriv command) and return once it stopped
    itself at `stage` (fails if it never does). The tool gets a temp dir of its own (`proc.tmp`):
    what a SIGKILLed tool leaves there is removed by `kill`."""
    tmp = own_tmp()
    e = dict(os.environ, EAGLEPATCH_STOP_AT=stage, TMPDIR=str(tmp), **(env or {}))
    # SIGINT at its default, as in a terminal: a suite started in the background of a
    # non-interactive shell (or under nohup) inherits SIGINT ignored, and Python then keeps it
    # ignored, so `interrupt` would not interrupt
    proc = subprocess.Popen([*(prefix or []), sys.executable, str(REPO / "tools" / f"{tool}.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                            preexec_fn=_default_sigint)
    proc.tmp = tmp
    t0 = time.monotonic()
    while _state(proc.pid) != "T":
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{tool} {args} exited {proc.returncode} before stop point {stage}:\n{out}\n{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"{tool} never reached stop point {stage}")
        time.sleep(0.01)
    return proc


def own_tmp() -> Path:
    """A temp dir for one tool run that may be killed (writable by any user, as /tmp is)."""
    d = Path(tempfile.mkdtemp(prefix="killed-tool-"))
    d.chmod(0o1777)
    return d


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL: the tool cannot clean up, so its temp dir goes here."""
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    shutil.rmtree(getattr(proc, "tmp", None) or "/nonexistent", ignore_errors=True)


def interrupt(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Ctrl-C a stopped process (SIGINT, then let it run on): (exit code, stdout, stderr). The tool
    must have removed its temp files on the way out."""
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    tmp = getattr(proc, "tmp", None)
    if tmp is not None:
        left = sorted(p.name for p in tmp.iterdir())
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"the interrupted tool left {left} in its temp dir:\n{err}"
    return proc.returncode, out, err


def small_installed(src: Path, dest: Path, files: list[str]) -> Path:
    """An installed-layout tree holding only the package's top-level files and `files`."""
    return copy_installed(src, dest, files)


def git(repo: Path, *args, check: bool = True) -> str:
    return _git(repo, *args, check=check, env={"GIT_CEILING_DIRECTORIES": str(repo.parent)})


def small_checkout(src: Path, dest: Path, files: list[str], release: str = "0.5.9") -> Path:
    """A git checkout laid out like upstream's (python/sglang/..., tagged v<release>) that holds only
    the package's top-level files and `files`: the real bytes, a fraction of the size."""
    copy_installed(src, dest / "python", files)
    for d in (dest / "python").glob("sglang-*.dist-info"):
        shutil.rmtree(d)
    (dest / "python" / "sglang" / "_version.py").unlink(missing_ok=True)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"sglang {release}")
    git(dest, "tag", f"v{release}")
    return dest



def apply(tree, *args, env=None):
    """tools/apply.py with the fixture series."""
    return run_tool("apply", tree, "--series", BASIC, *args, env=env)


def state(pp: Path, series_dir: Path = BASIC) -> str:
    """'upstream' | 'patched' | 'mixed' of the series' target files."""
    from eaglepatch.series import load_series, sha256_bytes

    seen = set()
    for rel, h in load_series(series_dir).manifest_files().items():
        p = pp / rel
        cur = sha256_bytes(p.read_bytes()) if p.exists() else None
        seen.add("patched" if cur == h["patched_sha256"] else "upstream" if cur == h["upstream_sha256"] else "other")
    return seen.pop() if len(seen) == 1 else "mixed"
