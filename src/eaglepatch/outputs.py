"""Files the tools write outside the tree (reports, docs/drift.md, cached directories): checked
before any work, and written whole (a temporary file or directory beside the target, then a
rename) or not at all."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import RefusedError, UsageError

_EFFECTIVE = os.access in os.supports_effective_ids


def can_write(path: Path | str, directory: bool = True) -> bool:
    """Whether this process (its effective ids and capabilities, as for a real write) may write
    `path`: create entries in it when `directory`, else rewrite it."""
    return os.access(path, (os.W_OK | os.X_OK) if directory else os.W_OK, effective_ids=_EFFECTIVE)


def scratch_dir(prefix: str, then: str = "run again; nothing was changed") -> Path:
    """A new temporary directory (the caller removes it), or a one-line refusal saying why not."""
    try:
        return Path(tempfile.mkdtemp(prefix=prefix))
    except OSError as exc:
        raise RefusedError(f"cannot create a temporary directory: {exc.strerror}",
                           f"free space in the temp dir (TMPDIR) and {then}") from None


def owner_writable(root: Path) -> None:
    """Give the owner write access to every directory under `root` (a copy this process made, which
    copied the modes of a read-only tree): files can be added to it and it can be removed."""
    for dirpath, _dirs, _files in os.walk(root):
        mode = os.stat(dirpath).st_mode & 0o7777
        if mode & 0o700 != 0o700:
            os.chmod(dirpath, mode | 0o700)


def swap_in(tmp: Path, dest: Path) -> None:
    """Put the finished directory ``tmp`` (beside ``dest``) at ``dest``. An older ``dest`` is
    renamed aside first and removed only once ``tmp`` is in place (put back if that rename fails),
    so ``dest`` is at every moment the old directory, the new one, or absent; never half of one."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if old is not None and not dest.exists():
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def move_new_checkout(tmp: Path, dest: Path, fix: str) -> None:
    """Rename a checkout made beside ``dest`` into place; a failure is one usage line."""
    try:
        os.rename(tmp, dest)
    except OSError as exc:
        raise UsageError(f"cannot move the new checkout to {dest}: {exc.strerror}", fix) from None


@contextmanager
def filled_dir(tmp: Path, dest: Path):
    """Yield ``tmp``, a new directory beside ``dest``, to fill: when the block ends normally it
    becomes ``dest`` (``swap_in``); either way nothing of ``tmp`` is left behind."""
    try:
        yield tmp
        swap_in(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_beside(dest: Path | str, make, prefix: str = ".build-") -> bool:
    """A directory built once (a cache): ``make(tmp)`` fills ``tmp``, a new directory beside
    ``dest`` (its name starts with ``prefix``; ``dest``'s parent is created), which is then renamed
    to ``dest``. Unlike ``filled_dir`` an existing ``dest`` is never replaced: where another process
    renamed its own in first, the rename fails and theirs is kept (no lock: both may build, the
    first rename wins, and a reader of ``dest`` never sees it change). ``tmp`` is removed whatever
    happens; an exception of ``make`` goes on to the caller. Returns whether ours was renamed in.
    Standard library only: the smoke workers, run by file path in the CPU environment, use it too."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
    try:
        make(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another run made it first: keep theirs
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a special file")


def check_output_file(path: Path | str, flag: str) -> Path:
    """`path` (with ~ expanded) if a file can be written there, else a one-line usage error. An
    existing `path` must be a regular file: a symbolic link, FIFO, socket or device is refused
    (the atomic rename would replace it with a regular file)."""
    p = Path(os.path.expanduser(str(path)))
    fix = f"pass {flag} a file in a writable directory"
    if not str(path):
        raise UsageError(f"{flag} is empty", fix)
    try:
        mode = os.lstat(p).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{flag} {p} is a directory", fix)
    if mode is not None and not stat.S_ISREG(mode):  # the rename would replace the link, FIFO or device itself
        raise UsageError(f"{flag} {p} is {_kind(mode)}, not a regular file",
                         f"pass {flag} a regular file or a new path (the tool replaces the file it writes)")
    if p.is_dir():
        raise UsageError(f"{flag} {p} is a directory", fix)
    parent = p.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"cannot write {flag} {p}: {parent} {what}", fix)
    if not can_write(parent) or (p.exists() and not can_write(p, directory=False)):
        raise UsageError(f"cannot write {flag} {p}: permission denied", fix)
    # the permission bits can say yes where the filesystem says no (/proc, a read-only mount)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"cannot write {flag} {p}: {parent} does not take new files ({exc.strerror})", fix) from None
    return p


def write_atomic(path: Path | str, data: bytes | str, flag: str) -> None:
    """Write `data` to `path` in one rename; any OS error is a one-line usage error, the old file stays."""
    p = check_output_file(path, flag)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = None
    try:
        mode = (p.stat().st_mode & 0o777) if p.exists() else 0o644
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, p)
        tmp = None
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise UsageError(f"cannot write {flag} {p}: {exc.strerror or exc}",
                         f"{'free space or ' if full else ''}pass {flag} a writable file; "
                         "the old file, if any, is unchanged") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
