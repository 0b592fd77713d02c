"""tools/apply.py (and the other tools) against a hostile but realistic world, on the real sglang
0.5.9 files: a read-only directory for a non-root user, a target directory on another
filesystem, exhausted inodes, a full disk under --commit, --commit killed at each stage of its
transaction, a repository in the middle of a merge/rebase/cherry-pick/revert/bisect, a killed
--fetch, Ctrl-C inside git, no git on PATH, unwritable output paths. Each ends in one line and an
exit code, with the tree exactly as it was or exactly patched.

Mounting and switching users need root (tests run as root in CI); without it those are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BASIC, BASIC_ROOT, REAL, REPO, copy_installed, hashes, one_line_error, run_tool, series_files
from txnkit import apply, git, interrupt, kill, state, own_tmp, small_checkout, start_stopped

from eaglepatch.txn import TXN

MODELS = "sglang/srt/models"
BRANCH = "eaglepatch/sglang-0.5.9"
SUBJECTS = ["Record the capture layers in DeepseekV2Model", "Add the eagle3_capture hook module"]


def leftovers(root: Path) -> list:
    return [str(p) for p in root.rglob("*") if ".eaglepatch-" in p.name or p.name == TXN]


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts, other users); CI runs as root")


def mount_tmpfs(path: Path, opts: str) -> None:
    needs_root()
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def mounts():
    done = []

    def mount(path: Path, opts: str) -> Path:
        mount_tmpfs(path, opts)
        done.append(path)
        return path

    yield mount
    for p in reversed(done):
        umount(p)


# ------------------------------------------------------------------------------------------
# permissions, filesystems, space

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+dac_read_search",
          "--ambient-caps=+dac_read_search"]


def as_nobody(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """A tool run as uid/gid 65534 (not root). It may read everything (CAP_DAC_READ_SEARCH, so it
    can reach the interpreter under /root) but writes only where a normal user may."""
    needs_root()
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    cmd = [*NOBODY, sys.executable, str(REPO / "tools" / args[0]), *map(str, args[1:])]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HOME="/tmp", **(env or {})),
                          cwd="/")


def test_read_only_directory_for_a_non_root_user(small):
    subprocess.run(["chown", "-R", "65534:65534", str(small)], check=True)
    models = small / MODELS
    os.chown(models, 0, 0)
    models.chmod(0o555)  # the user cannot write there; every other directory is theirs
    r = as_nobody("apply.py", small, "--series", BASIC)
    assert "uid" not in r.stderr and r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = one_line_error(r)
    assert f"{models} is not writable" in err and "nothing was changed" in err
    before = hashes(small)
    assert state(small) == "upstream" and not leftovers(small)
    r = as_nobody("apply.py", small, "--series", BASIC, "--reverse")  # nothing to reverse: nothing to write
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    # --check refuses what apply refuses (issue 43; was: "applies cleanly", exit 0)
    r = as_nobody("apply.py", small, "--series", BASIC, "--check")
    err = one_line_error(r)
    assert r.returncode == 1 and f"{models} is not writable" in err and "but apply would refuse" in err, r.stderr
    assert "check: " not in r.stdout + r.stderr, r.stdout + r.stderr
    r = as_nobody("verify.py", small, "--series", BASIC, "--smoke", "static")
    assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr
    assert hashes(small) == before
    # writable again: the same user applies; read-only again: --reverse refuses, the tree stays patched
    models.chmod(0o777)
    assert as_nobody("apply.py", small, "--series", BASIC).returncode == 0
    assert state(small) == "patched"
    patched = hashes(small)
    models.chmod(0o555)
    r = as_nobody("apply.py", small, "--series", BASIC, "--reverse")
    assert r.returncode == 1 and "is not writable" in one_line_error(r)
    assert hashes(small) == patched and not leftovers(small)


def test_verify_of_a_read_only_tree_adds_to_its_copy_and_removes_it(small):
    """A user's read-only directories (here sglang/srt, where the series adds its package, and the
    models directory): verify's smoke copy takes their modes; it must still get the series' new
    files and be removed afterwards, leaving nothing in the temp dir."""
    subprocess.run(["chown", "-R", "65534:65534", str(small)], check=True)
    for rel in ("sglang/srt", MODELS):
        (small / rel).chmod(0o555)
    tmp = own_tmp()
    try:
        r = as_nobody("verify.py", small, "--series", BASIC, "--smoke", "static", env={"TMPDIR": str(tmp)})
        assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr
        assert sorted(p.name for p in tmp.iterdir()) == []
    finally:
        for rel in ("sglang/srt", MODELS):
            (small / rel).chmod(0o755)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_redo_that_cannot_proceed_is_undone(small):
    """A run dies after its commit point, then a directory becomes read-only for the user: the next
    run cannot finish the change, so it puts every file back (one line says so); once the directory
    is writable again the run after that cleans up and applies."""
    subprocess.run(["chown", "-R", "65534:65534", str(small)], check=True)
    before = hashes(small)
    kill(start_stopped("apply", small, "--series", BASIC, stage="ready", prefix=NOBODY, env={"HOME": "/tmp"}))
    models = small / MODELS
    os.chown(models, 0, 0)
    models.chmod(0o555)
    r = as_nobody("apply.py", small, "--series", BASIC)
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert "could not complete the change" in err and "Permission denied" in err, err
    assert state(small) == "upstream"  # every target has its original bytes
    assert not (small / TXN / "READY").exists()  # the next run undoes, never redoes
    models.chmod(0o777)
    r = as_nobody("apply.py", small, "--series", BASIC, "--reverse")
    assert r.returncode == 0 and "undid the unfinished" in r.stdout, r.stdout + r.stderr
    assert hashes(small) == before
    assert as_nobody("apply.py", small, "--series", BASIC).returncode == 0 and state(small) == "patched"


def test_target_directory_on_another_filesystem(small, fast_tmp, mounts):
    """sglang/srt/models is a symlink to a directory on another filesystem: staged there, renamed
    there; the link stays a link."""
    other = mounts(fast_tmp / "other-fs", "size=16m")
    models = small / MODELS
    shutil.copytree(models, other / "models")
    shutil.rmtree(models)
    models.symlink_to(other / "models")
    assert os.stat(other).st_dev != os.stat(small).st_dev
    before, before_other = hashes(small), hashes(other)
    r = apply(small)
    assert r.returncode == 0, r.stdout + r.stderr
    assert state(small) == "patched" and models.is_symlink() and not leftovers(small) and not leftovers(other)
    assert hashes(other) != before_other
    r = apply(small, "--reverse")
    assert r.returncode == 0, r.stderr
    assert hashes(small) == before and hashes(other) == before_other


def test_symlinked_target_file_is_written_through_and_stays_a_link(small, fast_tmp):
    ds = small / MODELS / "deepseek_v2.py"
    real = fast_tmp / "elsewhere" / "deepseek_v2.py"
    real.parent.mkdir()
    shutil.move(ds, real)
    ds.symlink_to(real)
    before, real_before = hashes(small), real.read_bytes()
    assert apply(small).returncode == 0
    assert ds.is_symlink() and state(small) == "patched" and real.read_bytes() != real_before
    assert apply(small, "--reverse").returncode == 0
    assert ds.is_symlink() and real.read_bytes() == real_before and hashes(small) == before


@pytest.mark.parametrize("short_of", ["inodes", "space"])
def test_exhausted_filesystem_is_refused_before_anything_is_written(short_of, fast_tmp, release_059, mounts):
    fs = mounts(fast_tmp / "small-fs", "size=8m,nr_inodes=400")
    tree = copy_installed(release_059, fs / "sp", series_files(BASIC))
    vfs = os.statvfs(fs)
    used_inodes = vfs.f_files - vfs.f_ffree
    used_kib = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize // 1024
    opts = f"remount,nr_inodes={used_inodes + 3}" if short_of == "inodes" else f"remount,size={used_kib + 48}k"
    subprocess.run(["mount", "-o", opts, str(fs)], check=True)
    before = hashes(tree)
    r = apply(tree)
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert ("no free inodes" if short_of == "inodes" else "not enough free space") in err, err
    assert hashes(tree) == before and not leftovers(fs)
    subprocess.run(["mount", "-o", "remount,nr_inodes=4000,size=16m", str(fs)], check=True)
    assert apply(tree).returncode == 0 and state(tree) == "patched"


def test_commit_on_a_full_disk(fast_tmp, release_059, mounts):
    fs = mounts(fast_tmp / "full-fs", "size=16m")
    co = small_checkout(release_059, fs / "co", series_files(BASIC))
    before = hashes(co)
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the filesystem to the last byte
        for n in (65536, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * n)
            except OSError:
                pass
    r = apply(co, "--commit")
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert "space" in err.lower(), err
    assert hashes(co) == before and not leftovers(co)
    assert git(co, "status", "--porcelain") == "" and git(co, "branch", "--list", BRANCH) == ""
    assert git(co, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    filler.unlink()
    r = apply(co, "--commit")
    assert r.returncode == 0, r.stderr
    assert git(co, "status", "--porcelain") == "" and state(co / "python") == "patched"


# ------------------------------------------------------------------------------------------
# --commit: interrupted at every stage, refused in the middle of another git operation

COMMIT_STAGES = ["commit-objects", "staged", "ready", "replacing", "replaced", "committed"]


def assert_committed(co: Path) -> None:
    assert git(co, "symbolic-ref", "HEAD").strip() == f"refs/heads/{BRANCH}"
    assert git(co, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(co, "log", "--format=%s", "v0.5.9..HEAD").splitlines() == SUBJECTS
    assert state(co / "python") == "patched"
    assert not leftovers(co), leftovers(co)


@pytest.mark.parametrize("stage", COMMIT_STAGES)
def test_commit_killed_at_each_stage_is_finished_by_running_it_again(small_git, stage):
    before = hashes(small_git)
    kill(start_stopped("apply", small_git, "--series", BASIC, "--commit", stage=stage))
    after_ready = COMMIT_STAGES.index(stage) >= COMMIT_STAGES.index("ready")
    if not after_ready:
        assert {k: v for k, v in hashes(small_git).items() if ".eaglepatch-" not in k and TXN not in k} == before
    if stage != "commit-objects":
        r = apply(small_git, "--check")  # writes nothing and says what is pending
        assert r.returncode == 1 and "--commit" in one_line_error(r), r.stdout + r.stderr
    r = apply(small_git, "--commit")
    assert r.returncode == 0, r.stdout + r.stderr
    if stage == "commit-objects":
        assert "committed 2 patch(es) on branch" in r.stdout
    else:
        assert ("completed the interrupted" if after_ready else "undid the unfinished") in r.stdout, r.stdout
    assert_committed(small_git)
    r = apply(small_git, "--commit")
    assert r.returncode == 0 and "already applied and committed" in r.stdout


def test_commit_on_an_applied_but_uncommitted_tree_is_refused(small_git):
    assert apply(small_git).returncode == 0
    before = hashes(small_git)
    r = apply(small_git, "--commit")
    assert r.returncode == 1 and "already applied" in one_line_error(r) and "--reverse" in one_line_error(r)
    assert hashes(small_git) == before


def _busy(co: Path, what: str) -> str:
    """Leave the checkout in the middle of `what`; returns the git dir entry that marks it."""
    notes = co / "NOTES"

    def commit(text, msg):
        notes.write_text(text)
        git(co, "add", "NOTES")
        git(co, "commit", "-q", "-m", msg)

    commit("base\n", "notes")
    if what == "bisect":
        git(co, "bisect", "start")
        return "BISECT_LOG"
    git(co, "checkout", "-q", "-b", "topic")
    commit("topic\n", "topic notes")
    git(co, "checkout", "-q", "main")
    commit("main\n", "main notes")
    if what == "merge":
        git(co, "merge", "topic", check=False)
        return "MERGE_HEAD"
    if what == "cherry-pick":
        git(co, "cherry-pick", "topic", check=False)
        return "CHERRY_PICK_HEAD"
    if what == "revert":
        commit("main again\n", "more main notes")
        git(co, "revert", "--no-edit", "HEAD~1", check=False)
        return "REVERT_HEAD"
    git(co, "checkout", "-q", "topic")
    git(co, "rebase", "main", check=False)
    return "rebase-merge"


@pytest.mark.parametrize("what", ["merge", "rebase", "cherry-pick", "revert", "bisect"])
def test_commit_during_an_unfinished_git_operation_is_refused(small_git, what):
    marker = _busy(small_git, what)
    assert (small_git / ".git" / marker).exists(), what
    before = hashes(small_git)
    head = git(small_git, "rev-parse", "HEAD")
    r = apply(small_git, "--commit")
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert f"a {what.replace('cherry-pick', 'cherry-pick')}" in err and "in progress" in err, err
    assert hashes(small_git) == before and git(small_git, "rev-parse", "HEAD") == head
    assert git(small_git, "branch", "--list", BRANCH) == "" and (small_git / ".git" / marker).exists()


# ------------------------------------------------------------------------------------------
# Ctrl-C

def test_ctrl_c_inside_git_before_the_commit_point_leaves_the_tree_original(small_git):
    before = hashes(small_git)
    rc, out, err = interrupt(start_stopped("apply", small_git, "--series", BASIC, "--commit",
                                           stage="commit-objects"))
    assert rc == 2 and "Traceback" not in err and err.strip().startswith("error: interrupted"), (rc, out, err)
    assert hashes(small_git) == before and git(small_git, "branch", "--list", BRANCH) == ""
    rc, out, err = interrupt(start_stopped("apply", small_git, "--series", BASIC, "--commit", stage="staged"))
    assert rc == 2 and "Traceback" not in err, err
    assert hashes(small_git) == before and git(small_git, "branch", "--list", BRANCH) == ""
    assert not leftovers(small_git)


def test_ctrl_c_after_the_commit_point_waits_for_the_end(small_git):
    """Ctrl-C once the change is committed: the run finishes it and reports success (exit 0)."""
    rc, out, err = interrupt(start_stopped("apply", small_git, "--series", BASIC, "--commit", stage="replacing"))
    assert rc == 0 and "Traceback" not in err and "error:" not in err, (rc, out, err)
    assert "committed 2 patch(es) on branch" in out and "interrupted after the commit point" in err, (out, err)
    assert_committed(small_git)  # the change was committed before the Ctrl-C could land
    r = apply(small_git, "--commit")
    assert r.returncode == 0 and "already applied and committed" in r.stdout


# ------------------------------------------------------------------------------------------
# --fetch

@pytest.mark.parametrize("stage", ["fetch-cloned", "fetch-patched", "fetch-renamed"])
def test_killed_fetch_leaves_nothing_the_same_command_refuses(fast_tmp, stage):
    dest = fast_tmp / "fresh"
    env = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}
    kill(start_stopped("apply", "--fetch", "0.5.9", dest, stage=stage, env=env))
    assert dest.exists() == (stage == "fetch-renamed")
    r = run_tool("apply", "--fetch", "0.5.9", dest, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    if stage == "fetch-renamed":
        assert "already fetched" in r.stdout
    assert_committed(dest)
    assert [p.name for p in fast_tmp.iterdir()] == ["fresh"]  # the killed run's temporary checkout is gone


def test_fetch_dest_that_is_a_file_and_an_unwritable_cache(fast_tmp, mounts):
    f = fast_tmp / "afile"
    f.write_text("x")
    r = run_tool("apply", "--fetch", "0.5.9", f, env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
    assert r.returncode == 2 and "is a file" in one_line_error(r) and f.read_text() == "x"
    for cache in (f / "cache", mounts(fast_tmp / "ro-cache", "size=1m,ro")):
        r = run_tool("apply", "--fetch", "0.5.9", fast_tmp / "dest",
                     env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT), "EAGLEPATCH_CACHE": str(cache)})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "EAGLEPATCH_CACHE" in one_line_error(r) and not (fast_tmp / "dest").exists()


# ------------------------------------------------------------------------------------------
# no git, unwritable outputs

def test_git_not_on_path(small, small_git, fast_tmp, release_059):
    newer = copy_installed(release_059, fast_tmp / "newer", series_files(BASIC))
    v = newer / "sglang" / "_version.py"
    v.write_text(v.read_text().replace("0.5.9", "0.5.9.1"))
    env = {"PATH": str(fast_tmp / "empty-bin")}
    for tool, args in (("apply", [small, "--series", BASIC]), ("apply", [small_git, "--series", BASIC]),
                       ("verify", [small, "--series", BASIC, "--smoke", "static"]),
                       ("export", [small_git, "--base", "v0.5.9", "--out", fast_tmp / "o"]),
                       ("port", ["--series", BASIC, "--from-tree", small, "--to-tree", newer, "--dry-run"])):
        r = run_tool(tool, *args, env=env)
        assert r.returncode == 2, (tool, r.stdout, r.stderr)
        assert "git is not on PATH" in one_line_error(r), (tool, r.stderr)
    assert state(small) == "upstream" and not (fast_tmp / "o").exists()


def test_unwritable_output_paths_are_refused_before_any_work(small, small_git, fast_tmp, mounts):
    ro = mounts(fast_tmp / "ro", "size=1m,ro")
    afile = fast_tmp / "afile"
    afile.write_text("x")
    for bad in (ro / "out.json", afile / "out.json", fast_tmp):
        r = run_tool("verify", small, "--series", BASIC, "--json", bad)
        assert r.returncode == 2 and "--json" in one_line_error(r) and "CLEAN" not in r.stdout, r.stdout + r.stderr
        r = run_tool("port", "--series", BASIC, "--from-tree", small, "--to-tree", small, "--to", "0.5.9.1",
                     "--dry-run", "--json", bad)
        assert r.returncode == 2 and "--json" in one_line_error(r) and "review" not in r.stdout
        r = run_tool("drift", "--releases", "0.5.9", "--out", bad, env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
        assert r.returncode == 2 and "--out" in one_line_error(r), r.stdout + r.stderr
    assert apply(small_git, "--commit").returncode == 0
    for bad in (ro / "series", afile):
        r = run_tool("export", small_git, "--base", "v0.5.9", "--out", bad)
        assert r.returncode == 2, r.stdout + r.stderr
        one_line_error(r)
    assert afile.read_text() == "x"


# ------------------------------------------------------------------------------------------
# messages that name the cause; export after apply --commit

def test_messages_name_the_cause(small, fast_tmp):
    ds = small / MODELS / "deepseek_v2.py"
    orig = ds.read_bytes()
    ds.write_bytes(orig.replace(b"\n", b"\r\n"))
    r = apply(small, "--force")
    assert r.returncode == 1 and "CRLF" in one_line_error(r) and "local edits" not in r.stderr
    r = run_tool("verify", small, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 1 and f"{ds} has CRLF (Windows) line endings" in r.stdout, r.stdout
    ds.unlink()
    r = apply(small, "--force")
    assert r.returncode == 1 and f"{ds} is missing" in one_line_error(r)
    r = run_tool("verify", small, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 1 and f"{ds} is missing" in r.stdout, r.stdout
    ds.write_bytes(orig)
    series = fast_tmp / "sglang-0.5.9"
    shutil.copytree(BASIC, series)
    p2 = next(series.glob("0002-*.patch"))
    p2.write_bytes(p2.read_bytes().replace(b"\n", b"\r\n"))
    r = run_tool("apply", small, "--series", series)
    assert r.returncode == 2 and "CRLF" in one_line_error(r)
    shutil.copy(BASIC / p2.name, p2)
    lines = p2.read_bytes().split(b"\n")
    k = next(n for n, ln in enumerate(lines) if ln.startswith(b"@@ "))
    lines.insert(k + 1, b" a context line the hunk header does not count")
    p2.write_bytes(b"\n".join(lines))
    r = run_tool("apply", small, "--series", series)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "malformed patch" in r.stderr
    r = run_tool("apply", small, "--series", BASIC / "series")
    assert r.returncode == 2 and f"--series {BASIC}" in one_line_error(r) and "is a file" in one_line_error(r)
    home = fast_tmp / "home"
    shutil.copytree(BASIC, home / "s")
    r = run_tool("apply", small, "--check", "--series", "~/s", env={"HOME": str(home)})
    assert r.returncode == 0 and "applies cleanly" in r.stdout, r.stderr
    (series / "series").write_text("# nothing listed\n")
    for tool in ("apply", "verify"):
        r = run_tool(tool, small, "--series", series)
        assert r.returncode == 2 and "lists no patches" in one_line_error(r), (tool, r.stdout, r.stderr)
    shutil.copy(BASIC / p2.name, p2)
    shutil.copy(BASIC / "series", series / "series")
    m = json.loads((series / "manifest.json").read_text())
    m["files"][next(iter(m["files"]))] = ["not", "an", "object"]
    (series / "manifest.json").write_text(json.dumps(m))
    r = run_tool("apply", small, "--series", series)
    assert r.returncode == 2 and "is not an object" in one_line_error(r)
    assert state(small) == "upstream" and not leftovers(small)


def test_verify_and_apply_agree_on_a_release_without_a_series(installed_0510, small, tmp_path):
    port = f"python3 {REPO}/tools/port.py --from 0.5.9 --to 0.5.10"  # a path that works from any directory
    r = run_tool("apply", installed_0510, "--check")
    assert r.returncode == 1 and "nearest older series is sglang-0.5.9" in one_line_error(r) and port in r.stderr
    r = run_tool("verify", installed_0510, "--smoke", "none", "--json", tmp_path / "v.json")
    assert r.returncode == 1, r.stdout + r.stderr  # 0.5.9's series drifts on 0.5.10
    assert "verifying the nearest older series sglang-0.5.9" in r.stdout and port in r.stdout
    assert "pinned" not in r.stdout + r.stderr and "sglang-0.5.23" not in r.stdout
    rep = json.loads((tmp_path / "v.json").read_text())
    assert rep["series"]["release"] == "0.5.9" and rep["tree"]["release"] == "0.5.10"
    v = small / "sglang" / "_version.py"
    v.write_text(v.read_text().replace("0.5.9", "0.5.8"))  # older than every series
    for tool in ("apply", "verify"):
        r = run_tool(tool, small)
        assert r.returncode == 1 and "no series for sglang 0.5.8 and none older" in one_line_error(r)


def test_apply_commit_then_export_keeps_the_smoke_patches(fast_tmp, release_059):
    series = fast_tmp / "sglang-0.5.9"
    shutil.copytree(REAL, series)
    co = small_checkout(release_059, fast_tmp / "co", series_files(REAL))
    r = run_tool("apply", co, "--series", series, "--commit")
    assert r.returncode == 0, r.stdout + r.stderr
    before = hashes(series)
    r = run_tool("export", co, "--base", "v0.5.9", "--out", series)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kept the smoke patch(es)" in r.stdout and "nothing changed" in r.stdout
    assert hashes(series) == before  # the smoke patch and smoke.series are still there, byte for byte
    r = run_tool("export", co, "--base", "v0.5.9", "--out", series, "--check")
    assert r.returncode == 0 and "byte-identical" in r.stdout


# ------------------------------------------------------------------------------------------
# a transaction's plan is bound to the tree it lies in (issue 29, item 20): a killed change on a
# tree that was then moved is finished there; on a copy, only the copy changes; a planted plan
# reaches nothing outside the tree

def _killed(tree: Path, commit: bool) -> None:
    kill(start_stopped("apply", tree, "--series", BASIC, *(["--commit"] if commit else []), stage="replacing"))


def _pp(tree: Path, commit: bool) -> Path:
    return tree / "python" if commit else tree


@pytest.mark.parametrize("commit", [False, True], ids=["installed", "commit"])
def test_a_killed_change_on_a_moved_tree_is_finished_there(small, small_git, commit):
    tree = small_git if commit else small
    _killed(tree, commit)
    assert state(_pp(tree, commit)) == "mixed"
    moved = tree.parent / f"{tree.name}-moved"
    shutil.move(tree, moved)  # `mv T T2`
    r = apply(moved, "--check")  # names the command on the moved tree
    assert r.returncode == 1 and f"tools/apply.py {moved}" in one_line_error(r), r.stdout + r.stderr
    r = apply(moved, *(["--commit"] if commit else []))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "completed the interrupted" in r.stdout and f"made in {_pp(tree, commit)}" in r.stdout, r.stdout
    if commit:
        assert_committed(moved)
    else:
        assert state(moved) == "patched" and not leftovers(moved), leftovers(moved)
    assert not tree.exists()


@pytest.mark.parametrize("commit", [False, True], ids=["installed", "commit"])
def test_a_killed_change_on_a_copied_tree_changes_the_copy_only(small, small_git, commit):
    tree = small_git if commit else small
    _killed(tree, commit)
    copy = tree.parent / f"{tree.name}-copy"
    shutil.copytree(tree, copy, symlinks=True)  # `cp -r T T3`: the log, the staged files, .git
    before = hashes(tree)
    head = git(tree, "symbolic-ref", "HEAD") if commit else None
    r = apply(copy, *(["--commit"] if commit else []))
    assert r.returncode == 0 and "completed the interrupted" in r.stdout, r.stdout + r.stderr
    if commit:
        assert_committed(copy)
        assert git(tree, "symbolic-ref", "HEAD") == head  # the original's HEAD was not switched
    else:
        assert state(copy) == "patched" and not leftovers(copy)
    assert hashes(tree) == before, "recovering the copy changed the original"
    assert state(_pp(tree, commit)) == "mixed" and (_pp(tree, commit) / TXN).is_dir()
    r = apply(tree, *(["--commit"] if commit else []))  # the original is still finished by its own run
    assert r.returncode == 0 and "completed the interrupted" in r.stdout, r.stdout + r.stderr
    if commit:
        assert_committed(tree)
    else:
        assert state(tree) == "patched" and not leftovers(tree)


def _plant(pp: Path, ops: list, ready: bool, fmt: int = 3, git_part: dict | None = None) -> Path:
    txn = pp / TXN
    txn.mkdir()
    (txn / "plan.json").write_text(json.dumps({"format": fmt, "command": "python3 tools/apply.py x", "ops": ops,
                                               "mkdirs": [], "rmdirs": [], "git": git_part}))
    if ready:
        (txn / "READY").write_text("ready\n")
    return txn


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
@pytest.mark.parametrize("op", ["replace", "delete", "undo a created file"])
def test_a_planted_plan_reaches_nothing_outside_the_tree(small, fast_tmp, how, op):
    """A plan.json put into the tree (or left by a tree it was copied from) that names a file
    outside: with READY the redo would replace or delete it, without READY the undo would delete
    it as a file the change created. Each is refused in one line; nothing anywhere changes."""
    from eaglepatch.series import sha256_bytes
    outside = fast_tmp / "outside"
    outside.mkdir()
    victim = outside / "victim.py"
    victim.write_bytes(b"precious = 1\n")
    new, old = outside / ".victim.py.eaglepatch-new", outside / ".victim.py.eaglepatch-old"
    if op == "replace":
        new.write_bytes(b"replaced = 1\n")
    if op == "delete":
        os.link(victim, old)
    if how == "absolute":  # the format 2 of eaglepatch 0.x: absolute paths
        fmt, real = 2, str(victim)
        rel = lambda p: str(p)  # noqa: E731
    elif how == "dotdot":
        fmt, real = 3, os.path.relpath(victim, small)
        rel = lambda p: os.path.relpath(p, small)  # noqa: E731
    else:  # a directory link inside the tree that leads out of it
        (small / "sglang" / "srt" / "out").symlink_to(outside)
        fmt, real = 3, "sglang/srt/out/victim.py"
        rel = lambda p: f"sglang/srt/out/{p.name}"  # noqa: E731
    o = {"path": "sglang/srt/out/victim.py", "real": real, "sha256": sha256_bytes(b"replaced = 1\n"), "mode": 0o644,
         "new": rel(new) if op != "delete" else None, "old": rel(old) if op == "delete" else None}
    if op == "undo a created file":
        o["sha256"] = sha256_bytes(victim.read_bytes())
    txn = _plant(small, [o], ready=op != "undo a created file", fmt=fmt)
    before, before_out = hashes(small), hashes(outside)
    r = apply(small)
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert f"the interrupted transaction in {txn} names" in err and "nothing was changed" in err, err
    assert victim.read_bytes() == b"precious = 1\n" and hashes(outside) == before_out
    assert hashes(small) == before and txn.is_dir() and state(small) == "upstream"
    r = apply(small, "--check")  # still named as pending
    assert r.returncode == 1 and "interrupted transaction is pending" in one_line_error(r)


def test_a_planted_plan_with_a_foreign_git_part_is_refused(small_git, fast_tmp):
    """The git part of a plan names the work tree as the path from it down to the tree: one that
    does not hold the tree, a ref that is no branch, or an index that is not beside git's own is
    refused before anything runs."""
    pp = small_git / "python"
    good = {"ref": f"refs/heads/{BRANCH}", "new": "a" * 40, "old": None, "head": "refs/heads/main", "pkg": "python"}
    idx = {"path": ":git index", "real": "index", "new": ".index.eaglepatch-new", "old": ".index.eaglepatch-old",
           "sha256": None, "mode": 0o644}
    before = hashes(small_git)
    for git_part, ops, what in [
        (dict(good, pkg="elsewhere"), [idx], "git work tree"),
        (dict(good, ref="HEAD --upload-pack=x"), [idx], "not a branch"),
        (dict(good), [dict(idx, new="../../../victim")], "not the file staged beside it"),
        (None, [idx], "without a git part"),
    ]:
        txn = _plant(pp, ops, ready=True, git_part=git_part)
        r = apply(small_git, "--commit")
        assert r.returncode == 1 and what in one_line_error(r), (what, r.stdout, r.stderr)
        shutil.rmtree(txn)
        assert hashes(small_git) == before and git(small_git, "symbolic-ref", "HEAD").strip() == "refs/heads/main"


def test_recovery_refuses_a_change_that_wrote_out_of_the_tree_through_a_link(small, fast_tmp):
    """A change that wrote through a directory link to outside the tree (allowed while it runs)
    is not finished by recovery, which changes only files inside the tree: one line, nothing
    changed, the log kept."""
    other = fast_tmp / "other"
    other.mkdir()
    models = small / MODELS
    shutil.move(models, other / "models")
    models.symlink_to(other / "models")
    _killed(small, False)
    before, before_other = hashes(small), hashes(other)
    r = apply(small)
    assert r.returncode == 1, r.stdout + r.stderr
    err = one_line_error(r)
    assert f"names {MODELS}/deepseek_v2.py at ../other/models/deepseek_v2.py, which leaves the tree" in err, err
    assert hashes(small) == before and hashes(other) == before_other and (small / TXN).is_dir()
