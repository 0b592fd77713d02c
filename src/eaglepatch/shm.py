"""POSIX semaphores and shared memory that dead processes left in /dev/shm.

SGLang's `Engine.shutdown()` (and a SIGKILL of a server's process group) kills every child
process, Python's multiprocessing resource tracker included; the named semaphores
(`sem.mp-*`) its spawned workers created are then never unlinked. `sweep(before)` removes the
entries that appeared since `before` (a `snapshot()`), are owned by this user and are no longer
mapped or open by any process: nobody can use them any more (a live process that uses a
semaphore or a shared-memory block keeps it mapped). Anything still in use, or another user's, is
left alone. Linux only (/proc); elsewhere both functions do nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")


def snapshot(shm: Path = SHM) -> set[str]:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(shm))
    except OSError:
        return set()


def in_use(shm: Path = SHM) -> set[int]:
    """Inodes under /dev/shm that a live process (one this user may inspect) maps or holds open.
    By inode, not name: glibc's sem_open maps a temporary file and then links it to the
    semaphore's name, so the mapping shows the temporary name (deleted)."""
    prefix = str(shm) + "/"
    used: set[int] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(prefix.encode()):
                        used.add(int(parts[4]))
        except (OSError, ValueError):
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                continue
    return used


def orphans(before: set[str], shm: Path = SHM) -> list[Path]:
    """Entries new since `before`, owned by this user, plain files, used by no live process."""
    new = snapshot(shm) - before
    if not new:
        return []
    used = in_use(shm)
    out = []
    for name in sorted(new):
        p = shm / name
        try:
            st = p.lstat()
        except OSError:
            continue
        if st.st_uid == os.getuid() and p.is_file() and not p.is_symlink() and st.st_ino not in used:
            out.append(p)
    return out


def sweep(before: set[str], shm: Path = SHM) -> list[str]:
    """Unlink `orphans(before)`; the names removed."""
    gone = []
    for p in orphans(before, shm):
        try:
            p.unlink()
            gone.append(p.name)
        except OSError:
            pass
    return gone
