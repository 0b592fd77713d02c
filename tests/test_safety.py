"""Tools never write what they do not own (issue 20), on the real sglang 0.5.9 files:

- verify's smoke copy holds real files: a symlinked directory or target file in the tree is
  never written through;
- one package reachable through two paths has one lock and one transaction log;
- a killed apply / --reverse on a tree whose release is known only from its files' hashes is
  found and finished by the next run, and named by --check and verify;
- --commit refuses a held index.lock and a branch another worktree has checked out, and a work
  tree whose .git points at a bare repository;
- --json / --out never replace a symlink, FIFO, socket or device;
- export --overlay refuses editor files in sglang-overlay/;
- an immutable target, a root-owned file in a sticky directory and special files at target paths
  are refused before anything is written; non-canonical release strings are refused; Ctrl-C after
  the commit point reports the completed change; the fallback lock leaves nothing in the temp dir.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import BASIC, BASIC_ROOT, REPO, hashes, one_line_error, run_tool
from txnkit import apply, git, interrupt, kill, state, start_stopped

from eaglepatch.txn import TXN

MODELS = "sglang/srt/models"
TARGET = "sglang/srt/models/deepseek_v2.py"
BRANCH = "eaglepatch/sglang-0.5.9"


def leftovers(*roots: Path) -> list:
    return [str(p) for r in roots for p in Path(r).rglob("*") if ".eaglepatch-" in p.name or p.name == TXN]


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (chattr, other users, device nodes); CI runs as root")


def run_with_timeout(tool: str, *args, timeout: float = 60, env: dict | None = None):
    try:
        return subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), *map(str, args)],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tool} {args} still running after {timeout} s (it hangs)")


# ------------------------------------------------------------------------------------------
# 1. verify writes nothing through a symlink

@pytest.mark.parametrize("linked", ["directory", "file"])
def test_verify_smoke_never_writes_through_a_symlink(small, fast_tmp, linked):
    elsewhere = fast_tmp / "elsewhere"
    elsewhere.mkdir()
    if linked == "directory":
        shutil.move(small / MODELS, elsewhere / "models")
        (small / MODELS).symlink_to(elsewhere / "models")
    else:
        shutil.move(small / TARGET, elsewhere / "deepseek_v2.py")
        (small / TARGET).symlink_to(elsewhere / "deepseek_v2.py")
    before, before_elsewhere = hashes(small), hashes(elsewhere)
    r = run_tool("verify", small, "--series", BASIC)  # the default smoke level (static)
    assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr
    assert hashes(elsewhere) == before_elsewhere, "verify wrote through the symlink"
    assert hashes(small) == before and state(small) == "upstream"
    r = apply(small, "--check")
    assert r.returncode == 0 and "applies cleanly" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------
# 2. one package, two paths, one lock

def _aliased(small: Path, fast_tmp: Path) -> Path:
    """`site/sglang` a symlink to the package of `small`."""
    site = fast_tmp / "site"
    site.mkdir()
    for d in small.glob("sglang-*.dist-info"):
        shutil.copytree(d, site / d.name)
    (site / "sglang").symlink_to(small / "sglang")
    return site


def test_verify_copies_a_link_to_an_ancestor_once(small):
    """The smoke copy follows links to directories, but never one that leads back up the tree."""
    (small / MODELS / "loop").symlink_to("../..")
    before = hashes(small)
    r = run_with_timeout("verify", small, "--series", BASIC, timeout=120)
    assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr
    assert hashes(small) == before


@pytest.mark.parametrize("target", ["/", "the tree's parent", "a loop through a link out of the tree"])
def test_verify_never_copies_a_link_to_the_root_or_an_ancestor(small, fast_tmp, target):
    """A link in the tree to `/` (the ancestor check compared against `//`), to a directory above
    the tree, or back to a directory the copy came through by way of a link out of the tree, is
    skipped by the smoke copy (not followed, not copied); verify runs as usual."""
    if target == "/":
        (small / MODELS / "root").symlink_to("/")
    elif target == "the tree's parent":
        (small / MODELS / "up").symlink_to(small.parent)
    else:
        out = fast_tmp / "out-of-tree"
        out.mkdir()
        (out / "back").symlink_to(small / "sglang" / "srt")
        (small / MODELS / "out").symlink_to(out)
    before = hashes(small)
    r = run_with_timeout("verify", small, "--series", BASIC, timeout=90)
    assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr
    assert hashes(small) == before


def test_one_package_through_two_paths_has_one_lock(small, fast_tmp):
    site = _aliased(small, fast_tmp)
    before = hashes(small)
    a = start_stopped("apply", site, "--series", BASIC, stage="staged")  # holds the lock, before its commit point
    try:
        r = apply(small, env={"EAGLEPATCH_LOCK_TIMEOUT": "1"})
        assert r.returncode == 1, r.stdout + r.stderr
        assert "another eaglepatch run still holds the lock" in one_line_error(r)
    finally:
        rc, out, err = interrupt(a)
    assert rc == 2 and "Traceback" not in err, err
    assert hashes(small) == before and not leftovers(small, site)
    assert apply(small).returncode == 0 and state(small) == "patched"


def test_a_pending_change_made_through_one_path_is_found_through_the_other(small, fast_tmp):
    site = _aliased(small, fast_tmp)
    kill(start_stopped("apply", site, "--series", BASIC, stage="replacing"))  # after the commit point
    assert state(small) == "mixed"
    r = apply(small, "--check")
    assert r.returncode == 1 and "interrupted transaction is pending" in one_line_error(r), r.stdout + r.stderr
    r = apply(small)
    assert r.returncode == 0 and "completed the interrupted" in r.stdout, r.stdout + r.stderr
    assert state(small) == "patched" and not leftovers(small, site)


# ------------------------------------------------------------------------------------------
# 3. a pending change on a tree known only by its hashes

HASH_ONLY = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}


@pytest.mark.parametrize("how", ["reverse on a committed checkout", "apply on an installed tree"])
def test_a_killed_change_on_a_tree_known_by_hashes_is_finished(small, small_git, how):
    if how.startswith("reverse"):
        tree, pp = small_git, small_git / "python"
        assert apply(tree, "--commit").returncode == 0  # HEAD leaves the v0.5.9 tag: only hashes tell the release
        args, end = ["--reverse"], "upstream"
    else:
        tree = pp = small
        for d in small.glob("sglang-*.dist-info"):
            shutil.rmtree(d)
        (small / "sglang" / "_version.py").unlink(missing_ok=True)
        args, end = [], "patched"
    kill(start_stopped("apply", tree, *args, stage="replacing", env=HASH_ONLY))
    assert state(pp) == "mixed"
    for tool, extra in (("apply", ["--check"]), ("verify", ["--smoke", "none"])):
        r = run_tool(tool, tree, *args * (tool == "apply"), *extra, env=HASH_ONLY)
        err = one_line_error(r)
        assert r.returncode == 1 and "interrupted transaction is pending" in err, (tool, r.stdout + r.stderr)
        assert "cannot tell the sglang release" not in err
    r = run_tool("apply", tree, *args, env=HASH_ONLY)
    assert r.returncode == 0 and "completed the interrupted" in r.stdout, r.stdout + r.stderr
    assert state(pp) == end and not leftovers(tree)


# ------------------------------------------------------------------------------------------
# 4. --commit and other git processes / worktrees / bare repositories

def test_commit_refuses_a_held_index_lock(small_git):
    lock = small_git / ".git" / "index.lock"
    lock.write_bytes(b"")
    before, head = hashes(small_git), git(small_git, "rev-parse", "HEAD")
    r = apply(small_git, "--commit")
    assert r.returncode == 1, r.stdout + r.stderr
    assert str(lock) in one_line_error(r)
    assert hashes(small_git) == before and git(small_git, "rev-parse", "HEAD") == head
    assert git(small_git, "branch", "--list", BRANCH) == "" and lock.exists() and not leftovers(small_git)
    lock.unlink()
    assert apply(small_git, "--commit").returncode == 0
    assert git(small_git, "status", "--porcelain") == ""


def test_commit_force_refuses_a_branch_checked_out_in_another_worktree(small_git, fast_tmp):
    git(small_git, "branch", BRANCH)
    other = fast_tmp / "other-wt"
    git(small_git, "worktree", "add", "-q", str(other), BRANCH)
    before, tip = hashes(small_git), git(small_git, "rev-parse", BRANCH)
    r = apply(small_git, "--commit", "--force")
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert BRANCH in err and str(other) in err
    assert git(small_git, "rev-parse", BRANCH) == tip and hashes(small_git) == before and not leftovers(small_git)


def test_commit_on_a_work_tree_of_a_bare_repository_is_one_line(small_git, fast_tmp):
    bare = fast_tmp / "bare.git"
    git(fast_tmp, "clone", "-q", "--bare", str(small_git), str(bare))
    wt = fast_tmp / "wt"
    shutil.copytree(small_git / "python", wt / "python")
    (wt / ".git").write_text(f"gitdir: {bare}\n")
    before = hashes(wt)
    r = apply(wt, "--commit")
    assert r.returncode in (1, 2), r.stdout + r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    assert "bare" in one_line_error(r)
    assert hashes(wt) == before and not leftovers(wt)


# ------------------------------------------------------------------------------------------
# 5. --json / --out never replace what is not a regular file

def _special(path: Path, kind: str, target: Path):
    if kind == "symlink":
        target.write_text("someone's file\n")
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        return s
    else:
        needs_root()
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # what /dev/full is
    return None


@pytest.mark.parametrize("kind", ["symlink", "fifo", "socket", "device"])
def test_json_output_onto_a_special_file_is_refused(small, fast_tmp, kind):
    out = fast_tmp / "report.json"
    keep = _special(out, kind, fast_tmp / "theirs.txt")
    try:
        st_before = os.lstat(out)
        r = run_with_timeout("verify", small, "--series", BASIC, "--smoke", "none", "--json", out)
        assert r.returncode == 2, r.stdout + r.stderr
        err = one_line_error(r)
        assert str(out) in err and "regular file" in err, err
        st = os.lstat(out)
        assert stat.S_IFMT(st.st_mode) == stat.S_IFMT(st_before.st_mode) and st.st_ino == st_before.st_ino
        if kind == "symlink":
            assert (fast_tmp / "theirs.txt").read_text() == "someone's file\n"
        assert not [p for p in fast_tmp.iterdir() if p.name.startswith(".report.json.")]
    finally:
        if keep is not None:
            keep.close()


# ------------------------------------------------------------------------------------------
# 6. export --overlay packages only the overlay's own files

@pytest.mark.parametrize("stray", [".dump.py.swp", "dump.py~", ".#dump.py", "dump.py.orig", "dump.py.rej"])
def test_overlay_export_refuses_editor_files(tmp_path, stray):
    from eaglepatch import overlay
    from eaglepatch.series import available_series
    series = tmp_path / "patches" / "sglang-0.5.9"
    shutil.copytree(available_series()["0.5.9"], series)
    ov = tmp_path / "overlay"
    shutil.copytree(overlay.overlay_root(), ov, ignore=shutil.ignore_patterns("__pycache__"))
    f = ov / overlay.PACKAGE_DIR / stray
    f.write_bytes(b"b0VIM 9.0\x00\x00\x10\x00\xff\xfe" + os.urandom(64))  # a binary vim swap file
    before = {p.name: p.read_bytes() for p in series.iterdir()}
    r = run_tool("export", "--overlay", "--out", series, env={"EAGLEPATCH_OVERLAY": str(ov)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(f) in one_line_error(r)
    assert {p.name: p.read_bytes() for p in series.iterdir()} == before
    f.unlink()
    (ov / overlay.PACKAGE_DIR / "__pycache__").mkdir()  # made by importing the overlay: not a stray file
    (ov / overlay.PACKAGE_DIR / "__pycache__" / "dump.cpython-311.pyc").write_bytes(b"\x00" * 16)
    r = run_tool("export", "--overlay", "--check", "--out", series, env={"EAGLEPATCH_OVERLAY": str(ov)})
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------
# 7. targets that cannot be written, special targets, releases, Ctrl-C, the fallback lock

def test_immutable_target_is_refused_by_the_preflight(small):
    needs_root()
    if shutil.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) is not installed")
    t = small / TARGET
    if subprocess.run(["chattr", "+i", str(t)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag")
    try:
        before = hashes(small)
        r = apply(small)
        assert r.returncode == 1, r.stdout + r.stderr
        err = one_line_error(r)
        assert str(t) in err and "nothing was changed" in err, err
        assert hashes(small) == before and not leftovers(small)
        r = apply(small, "--check")  # nothing pending blocks the other tools: --check says what apply refuses
        assert r.returncode == 1 and "but apply would refuse" in one_line_error(r), r.stdout + r.stderr
        assert str(t) in one_line_error(r) and "pending" not in r.stderr, r.stderr
    finally:
        subprocess.run(["chattr", "-i", str(t)], capture_output=True)
    assert apply(small).returncode == 0 and state(small) == "patched"


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
          "--ambient-caps=+dac_read_search"]


def test_root_owned_file_in_a_sticky_directory_is_refused_by_the_preflight(small):
    needs_root()
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    subprocess.run(["chown", "-R", "65534:65534", str(small)], check=True)
    models = small / MODELS
    os.chown(models, 0, 0)
    models.chmod(0o1777)  # anyone may create files here, but only owners rename or remove theirs
    os.chown(small / TARGET, 0, 0)
    before = hashes(small)
    r = subprocess.run([*NOBODY, sys.executable, str(REPO / "tools" / "apply.py"), str(small), "--series",
                        str(BASIC)], capture_output=True, text=True, env=dict(os.environ, HOME="/tmp"), cwd="/")
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert str(small / TARGET) in err and "nothing was changed" in err, err
    assert hashes(small) == before and not leftovers(small)


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_special_file_at_a_target_path_is_refused_without_reading(small, kind):
    t = small / TARGET
    t.unlink()
    keep = None
    if kind == "fifo":
        os.mkfifo(t)
    elif kind == "socket":
        keep = socket.socket(socket.AF_UNIX)
        keep.bind(str(t))
    else:
        needs_root()
        os.mknod(t, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    try:
        before = hashes(small)
        for tool, args in (("apply", []), ("apply", ["--check"]), ("verify", [])):
            r = run_with_timeout(tool, small, "--series", BASIC, *args)
            assert r.returncode == 2, (tool, args, r.stdout + r.stderr)
            err = one_line_error(r)
            assert str(t) in err and "not a regular file" in err, err
        assert hashes(small) == before and not leftovers(small)
    finally:
        if keep is not None:
            keep.close()


@pytest.mark.parametrize("release", ["0.5.9.0", "0.5.09", "00.5.9", "0.5.9.post01"])
def test_non_canonical_release_strings_are_refused(release):
    from eaglepatch.errors import UsageError
    from eaglepatch.series import check_release
    with pytest.raises(UsageError):
        check_release(release, "--fetch")
    r = run_tool("apply", "--fetch", release)
    assert r.returncode == 2 and "canonical" in one_line_error(r), r.stdout + r.stderr
    for ok in ("0.5.9", "0.5.10", "0.5.9.1", "0.5.15.post1", "0.5.0", "0.5.0rc1", "1.0.0"):
        assert check_release(ok, "--fetch") == ok


def test_fallback_lock_leaves_nothing_in_the_temp_dir(small, tmp_path, monkeypatch):
    """Where flock on a directory is refused, the lock file lives in the cache, not the temp dir."""
    from eaglepatch import lock
    real_flock = fcntl.flock

    def flock(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EOPNOTSUPP, "not supported")
        return real_flock(fd, op)

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(lock.fcntl, "flock", flock)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    monkeypatch.setenv("EAGLEPATCH_CACHE", str(tmp_path / "cache"))
    with lock.tree_lock(small):
        held = list(tmpdir.iterdir())
        # the lock excludes another holder (a second open file description of the same lock file)
        files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert len(files) == 1, files
        fd = os.open(files[0], os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                real_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert held == [] and list(tmpdir.iterdir()) == []
