"""Debian packages the test suite needs beside its Python environments, installed when missing.

FUSE (Debian's ``fuse3``: libfuse3 and fusermount3) mounts the real slow and hung dump
filesystems of tests/slowfs.py; the Python side (mfusepy) is in the test environment.
``libibverbs1``: Mooncake's native code (the store the online sink writes to, tests/test_mooncake.py)
links it even for TCP.
``ensure()`` installs what is missing with apt-get (as root) or raises RuntimeError naming the
command to run."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
import sys

# Debian package -> how to tell it is there
PACKAGES = {"fuse3": lambda: bool(ctypes.util.find_library("fuse3")) and shutil.which("fusermount3") is not None,
            "libibverbs1": lambda: bool(ctypes.util.find_library("ibverbs"))}


def missing() -> list:
    return [name for name, present in PACKAGES.items() if not present()]


def ensure() -> None:
    need = missing()
    if not need:
        return
    command = ["apt-get", "install", "-y", "-q", *need]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("error: the tests need the Debian package(s) %s; install them (sudo %s) and rerun"
                           % (", ".join(need), " ".join(command)))
    print("[test.py] installing Debian package(s) %s ..." % ", ".join(need), file=sys.stderr, flush=True)
    for step in (["apt-get", "update", "-q"], command):
        p = subprocess.run(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        if p.returncode != 0:
            raise RuntimeError("error: %s failed (exit %d): %s; run it by hand and rerun"
                               % (" ".join(step), p.returncode, p.stdout.strip().splitlines()[-1:] or ""))
    if missing():
        raise RuntimeError("error: %s installed but still not found; check ldconfig -p | grep fuse3" % need)
