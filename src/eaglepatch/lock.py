"""One exclusive lock per tree, taken by every tool that reads or writes it.

The lock is `flock(2)` on the package parent directory itself (the directory that holds
`sglang/`): nothing is created, so an installed tree's file set, its hashes and `git status` are
the same before, during and after a run, and the kernel drops the lock when the holder dies
(even by SIGKILL). The real package is what is locked, whatever path names it: the real path of
the package parent, and where `sglang/` is a symbolic link also the real parent of the package
it points to (`site/sglang -> checkout/python/sglang` and `checkout/python` share a lock).
Where a filesystem refuses flock on a directory, the lock is a file named after the directory's
device and inode under the eaglepatch cache (`<cache>/locks/`, EAGLEPATCH_CACHE or
~/.cache/eaglepatch) instead, never in the system temp dir.

A second run waits, saying so on stderr, up to EAGLEPATCH_LOCK_TIMEOUT seconds (default 300; a
finite number >= 0, anything else is a one-line usage error, exit 2), then refuses in one line. The lock is reentrant within a process.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .errors import RefusedError, UsageError

PACKAGE = "sglang"
TIMEOUT_ENV = "EAGLEPATCH_LOCK_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
_held: dict = {}  # (st_dev, st_ino) -> [fd, depth]


def lock_timeout(timeout: float | None = None) -> float:
    """The lock wait, checked (see `_timeout`): tools call it first, so that a bad
    EAGLEPATCH_LOCK_TIMEOUT is refused before they read or write anything."""
    return _timeout(timeout)


def _timeout(timeout: float | None) -> float:
    """The lock wait in seconds: `timeout`, else EAGLEPATCH_LOCK_TIMEOUT, else 300. A finite
    number >= 0 (0: do not wait); anything else (`inf`, `nan`, `-1`, `soon`) is a usage error."""
    if timeout is not None:
        raw, what = timeout, "the lock timeout"
    else:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        what = f"{TIMEOUT_ENV}={raw!r}"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{what} is not a finite number of seconds >= 0 (inf, nan and negative numbers are refused)",
                         f"set {TIMEOUT_ENV} to a number of seconds, e.g. 300 (0: do not wait); nothing was changed")
    return value


def _open(pp: Path) -> tuple[int, tuple]:
    try:
        st = os.stat(pp)
    except OSError as exc:
        raise UsageError(f"cannot open {pp} to lock it: {exc.strerror}", "pass a readable sglang tree") from None
    key = (st.st_dev, st.st_ino)
    try:
        fd = os.open(pp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # probe: does this filesystem do flock on a dir?
        fcntl.flock(fd, fcntl.LOCK_UN)
        return fd, key
    except BlockingIOError:
        return fd, key  # someone holds it exclusively: flock works here
    except OSError as exc:
        if "fd" in locals():
            os.close(fd)
        if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EACCES,
                             errno.EPERM):
            raise UsageError(f"cannot lock {pp}: {exc.strerror}", "check the path and its permissions") from None
    locks = _cache_base() / "locks"
    path = locks / f"lock-{key[0]}-{key[1]}"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise UsageError(f"cannot lock {pp} (flock on the directory is refused and {path} cannot be "
                         f"created: {exc.strerror})", f"make {locks} writable (or set EAGLEPATCH_CACHE)") from None
    return fd, key


def _cache_base() -> Path:
    base = os.environ.get("EAGLEPATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eaglepatch")
    return Path(base).expanduser()


def lock_dirs(pp: Path | str) -> list[Path]:
    """The directories whose locks guard the tree whose package parent is `pp`: its real path,
    and the real parent of the package `pp/sglang` when that is a link to another place."""
    pp = Path(pp)
    out = [Path(os.path.realpath(pp))]
    real_pkg = Path(os.path.realpath(pp / PACKAGE))
    if real_pkg.is_dir() and real_pkg.parent != out[0]:
        out.append(real_pkg.parent)
    return out


@contextmanager
def tree_lock(pp: Path | str, say=None, timeout: float | None = None):
    """Hold the exclusive lock of the tree whose package parent is `pp` (of the real package,
    whatever path names it)."""
    with tree_locks(pp, say=say, timeout=timeout):
        yield


@contextmanager
def _lock_one(pp: Path, say=None, timeout: float | None = None):
    pp = Path(pp)
    fd, key = _open(pp)
    if key in _held:
        os.close(fd)
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    limit = _timeout(timeout)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (say or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"waiting for another eaglepatch run on {pp} to finish (giving up after {limit:.0f} s; "
                f"{TIMEOUT_ENV})")
            deadline = time.monotonic() + limit
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise RefusedError(f"another eaglepatch run still holds the lock on {pp} after {limit:.0f} s",
                                           "wait for it to finish (or raise EAGLEPATCH_LOCK_TIMEOUT) and run "
                                           "again; nothing was changed") from None
                    time.sleep(0.05)
        _held[key] = [fd, 1]
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # closing drops the flock


@contextmanager
def tree_locks(*pps, say=None, timeout: float | None = None):
    """Lock several trees (each its real package, see `lock_dirs`), always in the same order (no
    deadlock between two such runs)."""
    limit = _timeout(timeout)  # a bad timeout is refused before anything is opened or created
    seen = {}
    for given in pps:
        for p in lock_dirs(given):
            try:
                st = os.stat(p)
                seen.setdefault((st.st_dev, st.st_ino), Path(p))
            except OSError:
                seen.setdefault((0, len(seen)), Path(given))  # _lock_one refuses it in one line
    with ExitStack() as stack:
        for _, p in sorted(seen.items()):
            stack.enter_context(_lock_one(p, say, limit))
        yield
