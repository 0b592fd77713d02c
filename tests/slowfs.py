"""A real slow or hung dump filesystem for the stop and back-pressure tests: a FUSE passthrough
(mfusepy over Debian's libfuse3, both installed by tools/test.py) of a backing directory.

  python tests/slowfs.py BACKING MOUNT [--fsync-delay S] [--hang-while PATH]

``--fsync-delay S``: every fsync of a file or of a directory takes S seconds (a slow disk).
``--hang-while PATH``: writes and fsyncs block while PATH exists (a hung disk; remove PATH and
they go on). ``mounted()`` runs it for a test and unmounts it after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path


def _serve(backing: str, mount: str, fsync_delay: float, hang_while: str | None) -> None:
    import mfusepy as fuse

    def held():
        while hang_while and os.path.exists(hang_while):
            time.sleep(0.05)

    class Passthrough(fuse.Operations):
        use_ns = True

        def _p(self, path):
            return os.path.join(backing, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._p(path))
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            keys = ("st_atime_ns", "st_ctime_ns", "st_mtime_ns", "st_gid", "st_mode", "st_nlink", "st_size", "st_uid")
            out = {k: getattr(st, k) for k in keys}
            for k in ("st_atime", "st_ctime", "st_mtime"):
                out[k] = out.pop(k + "_ns")
            return out

        def _call(self, fn, *args):
            try:
                return fn(*args)
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None

        def readdir(self, path, fh):
            return [".", ".."] + self._call(os.listdir, self._p(path))

        def open(self, path, flags):
            return self._call(os.open, self._p(path), flags)

        def create(self, path, mode, fi=None):
            return self._call(os.open, self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            return self._call(os.pread, fh, size, offset)

        def write(self, path, data, offset, fh):
            held()
            return self._call(os.pwrite, fh, data, offset)

        def truncate(self, path, length, fh=None):
            self._call(os.truncate, self._p(path), length)

        def fsync(self, path, datasync, fh):
            held()
            time.sleep(fsync_delay)
            return 0

        def fsyncdir(self, path, datasync, fh):
            held()
            time.sleep(fsync_delay)
            return 0

        def opendir(self, path):
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

        def flush(self, path, fh):
            return 0

        def rename(self, old, new):
            self._call(os.replace, self._p(old), self._p(new))

        def unlink(self, path):
            self._call(os.unlink, self._p(path))

        def mknod(self, path, mode, dev):
            self._call(os.mknod, self._p(path), mode, dev)

        def chmod(self, path, mode):
            self._call(os.chmod, self._p(path), mode)

        def utimens(self, path, times=None):
            self._call(os.utime, self._p(path), None, ns=times) if times else self._call(os.utime, self._p(path))

        def mkdir(self, path, mode):
            self._call(os.mkdir, self._p(path), mode)

        def statfs(self, path):
            st = os.statvfs(self._p(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                    "f_frsize", "f_namemax")
            return {k: getattr(st, k) for k in keys}

    fuse.FUSE(Passthrough(), mount, foreground=True, nothreads=False)


@contextlib.contextmanager
def mounted(root: Path, fsync_delay: float = 0.0, hang_while: Path | None = None):
    """A mounted slow filesystem under ``root`` (its mount point is yielded); unmounted after."""
    backing, mount = root / "backing", root / "mnt"
    backing.mkdir(parents=True)
    mount.mkdir()
    log = root / "slowfs.log"
    cmd = [sys.executable, __file__, str(backing), str(mount), "--fsync-delay", str(fsync_delay)]
    if hang_while is not None:
        cmd += ["--hang-while", str(hang_while)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mount):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the FUSE test filesystem did not mount: %s" % log.read_text()[-2000:])
            time.sleep(0.05)
        yield mount
    finally:
        if hang_while is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(hang_while)
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], capture_output=True)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backing")
    ap.add_argument("mount")
    ap.add_argument("--fsync-delay", type=float, default=0.0)
    ap.add_argument("--hang-while")
    a = ap.parse_args()
    _serve(a.backing, a.mount, a.fsync_delay, a.hang_while)
