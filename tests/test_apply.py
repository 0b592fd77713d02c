"""tools/apply.py on the real sglang 0.5.9: installed layout and git checkout."""

import json
import shutil
import subprocess

import pytest
from conftest import BASIC, BASIC_ROOT, REAL, REPO, git, hashes, one_line_error, run_tool
from txnkit import kill, start_stopped

from eaglepatch.txn import TXN
from eaglepatch.series import sha256_bytes

DS = "sglang/srt/models/deepseek_v2.py"
MR = "sglang/srt/model_executor/model_runner.py"
NEW = "sglang/srt/eagle3_capture/__init__.py"


def manifest_state(pp, series_dir=BASIC):
    m = json.loads((series_dir / "manifest.json").read_text())
    out = {}
    for rel, h in m["files"].items():
        p = pp / rel
        cur = sha256_bytes(p.read_bytes()) if p.exists() else None
        out[rel] = "patched" if cur == h["patched_sha256"] else "upstream" if cur == h["upstream_sha256"] else "other"
    return out


def test_installed_apply_reapply_reverse(installed_059):
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", BASIC)
    assert r.returncode == 0, r.stderr
    assert "applied sglang-0.5.9: 2 patch(es)" in r.stdout
    assert set(manifest_state(installed_059).values()) == {"patched"}
    assert not (installed_059 / TXN).exists()
    patched = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", BASIC)
    assert r.returncode == 0 and "already applied" in r.stdout
    assert hashes(installed_059) == patched
    r = run_tool("apply", installed_059, "--series", BASIC, "--reverse")
    assert r.returncode == 0, r.stderr
    assert hashes(installed_059) == before  # byte-identical, the added package is gone
    assert not (installed_059 / "sglang/srt/eagle3_capture").exists()


def test_release_picks_the_series_and_missing_series_exits_1(installed_059, tmp_path):
    r = run_tool("apply", installed_059, "--check", env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
    assert r.returncode == 0, r.stderr
    assert "applies cleanly" in r.stdout and "exact" in r.stdout
    other = tmp_path / "patches"
    shutil.copytree(BASIC, other / "sglang-0.5.8")
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, env={"EAGLEPATCH_PATCHES": str(other)})
    assert r.returncode == 1
    err = one_line_error(r)
    assert "no series for sglang 0.5.9" in err and "sglang-0.5.8" in err and "verify.py" in err
    assert "tools/port.py --from 0.5.8 --to 0.5.9" in err
    assert hashes(installed_059) == before


def test_git_checkout_check_writes_nothing_then_apply_and_reverse(checkout_059):
    before = hashes(checkout_059)
    r = run_tool("apply", checkout_059, "--series", BASIC, "--check")
    assert r.returncode == 0, r.stderr
    assert "nothing written" in r.stdout
    assert "0002-record-the-capture-layers-in-deepseekv2model.patch: ok" in r.stdout
    assert hashes(checkout_059) == before
    r = run_tool("apply", checkout_059, "--series", BASIC)
    assert r.returncode == 0, r.stderr
    assert set(manifest_state(checkout_059 / "python").values()) == {"patched"}
    assert run_tool("apply", checkout_059, "--series", BASIC).stdout.count("already applied") == 1
    r = run_tool("apply", checkout_059, "--series", BASIC, "--reverse")
    assert r.returncode == 0, r.stderr
    assert hashes(checkout_059) == before
    assert git(checkout_059, "status", "--porcelain") == ""


def test_local_edit_refused_unless_force(installed_059):
    target = installed_059 / MR
    target.write_bytes(target.read_bytes() + b"# my local change\n")
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", BASIC)
    assert r.returncode == 1
    err = one_line_error(r)
    assert "local edits" in err and str(target) in err and "--force" in err
    assert hashes(installed_059) == before
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 0, r.stderr
    assert target.read_bytes().endswith(b"# my local change\n")
    assert b"eagle3_capture.on_model_runner_init(self)" in target.read_bytes()


def test_failure_in_second_patch_leaves_tree_byte_identical(installed_059):
    ds = installed_059 / DS
    ds.write_bytes(ds.read_bytes().replace(b"        self.layers_to_capture = []\n",
                                           b"        self.layers_to_capture = list()\n", 1))
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 1
    err = one_line_error(r)
    assert "0002-record-the-capture-layers-in-deepseekv2model.patch does not apply" in err
    assert "0001-add-the-eagle3-capture-hook-module.patch: ok" in r.stdout
    assert "conflict" in r.stdout
    assert hashes(installed_059) == before
    assert not (installed_059 / TXN).exists()


def test_malformed_patch_is_exit_2_and_touches_nothing(installed_059, tmp_path):
    bad = tmp_path / "sglang-0.5.9"
    shutil.copytree(BASIC, bad)
    p = bad / "0002-record-the-capture-layers-in-deepseekv2model.patch"
    p.write_bytes(p.read_bytes().replace(b"@@ -2629,6 +2629,7 @@", b"@@ -2629,6 +2629,9 @@"))
    before = hashes(installed_059)
    for tool in ("apply", "verify"):
        r = run_tool(tool, installed_059, "--series", bad)
        assert r.returncode == 2, (tool, r.stdout, r.stderr)
        assert "malformed patch" in one_line_error(r)
    p.write_bytes(p.read_bytes().replace(b"\n---\n", b"\n", 1))
    r = run_tool("apply", installed_059, "--series", bad)
    assert r.returncode == 2 and "no '---' line" in one_line_error(r)
    assert hashes(installed_059) == before


def _pending(tree, stage, *args):
    """Leave a real transaction of `apply` killed at `stage`."""
    kill(start_stopped("apply", tree, "--series", BASIC, *args, stage=stage))
    assert (tree / TXN).is_dir()
    return hashes(tree)


def test_txn_killed_before_its_commit_point_is_undone(installed_059):
    before = hashes(installed_059)
    pending = _pending(installed_059, "staged")
    staged = [k for k in pending if k.endswith(".eaglepatch-new")]
    assert staged and all(pending[k] == before[k] for k in before if k in pending)  # targets untouched
    for args, what in ((["--check"], "apply --check"), (["--reverse", "--check"], "apply --check")):
        r = run_tool("apply", installed_059, "--series", BASIC, *args)
        assert r.returncode == 1, r.stdout + r.stderr
        err = one_line_error(r)
        assert "interrupted transaction is pending" in err and "before its commit point" in err
        assert f"tools/apply.py {installed_059} --series {BASIC}" in err and what in err
        assert hashes(installed_059) == pending  # --check writes nothing, not even a recovery
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 1 and "verify writes nothing" in one_line_error(r)
    assert hashes(installed_059) == pending
    r = run_tool("apply", installed_059, "--series", BASIC, "--reverse")  # a write run: undo, then act
    assert r.returncode == 0, r.stderr
    assert "undid the unfinished" in r.stdout and "nothing to reverse" in r.stdout
    assert hashes(installed_059) == before


def test_txn_killed_after_its_commit_point_is_completed(installed_059):
    pending = _pending(installed_059, "replacing")
    assert set(manifest_state(installed_059).values()) == {"upstream", "patched"}  # one file replaced
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 1 and "after its commit point" in one_line_error(r)
    assert hashes(installed_059) == pending
    r = run_tool("apply", installed_059, "--series", BASIC)
    assert r.returncode == 0, r.stderr
    assert "completed the interrupted" in r.stdout and "already applied" in r.stdout
    assert not (installed_059 / TXN).exists()
    assert set(manifest_state(installed_059).values()) == {"patched"}
    assert not [k for k in hashes(installed_059) if "eaglepatch-" in k]


def test_commit_creates_one_commit_per_patch(checkout_059):
    r = run_tool("apply", checkout_059, "--series", BASIC, "--commit")
    assert r.returncode == 0, r.stderr
    assert "eaglepatch/sglang-0.5.9" in r.stdout
    assert git(checkout_059, "symbolic-ref", "HEAD").strip() == "refs/heads/eaglepatch/sglang-0.5.9"
    assert git(checkout_059, "status", "--porcelain") == ""
    subjects = git(checkout_059, "log", "--format=%s", "v0.5.9..HEAD").splitlines()
    assert subjects == ["Record the capture layers in DeepseekV2Model", "Add the eagle3_capture hook module"]
    assert "Drop-When: upstream ships a hidden-state dump hook" in git(checkout_059, "log", "-1", "--format=%B",
                                                                       "HEAD~1")
    # a second --commit: already applied, nothing new
    r = run_tool("apply", checkout_059, "--series", BASIC, "--commit")
    assert r.returncode == 0 and "already applied" in r.stdout


def test_fetch_makes_a_patched_checkout(tmp_path):
    dest = tmp_path / "fresh"
    r = run_tool("apply", "--fetch", "0.5.9", dest, env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
    assert r.returncode == 0, r.stderr
    assert str(dest) in r.stdout
    assert set(manifest_state(dest / "python").values()) == {"patched"}
    tag = git(dest, "tag").split()
    assert tag == ["v0.5.9"]
    before = hashes(dest)
    r = run_tool("apply", "--fetch", "0.5.9", dest, env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
    assert r.returncode == 0 and "already fetched" in r.stdout, r.stdout + r.stderr  # the same command again
    assert hashes(dest) == before
    other = tmp_path / "other"
    (other / "x").mkdir(parents=True)
    r = run_tool("apply", "--fetch", "0.5.9", other, env={"EAGLEPATCH_PATCHES": str(BASIC_ROOT)})
    assert r.returncode == 2 and "not empty" in one_line_error(r)


@pytest.mark.skipif(not (REAL / "series").is_file(), reason="the product series is not committed yet")
def test_real_series_apply_and_reverse(installed_059):
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", REAL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (installed_059 / "sglang/srt/eagle3_capture/__init__.py").is_file()
    assert "already applied" in run_tool("apply", installed_059, "--series", REAL).stdout
    r = run_tool("apply", installed_059, "--series", REAL, "--reverse")
    assert r.returncode == 0, r.stdout + r.stderr
    assert hashes(installed_059) == before


def test_the_fetch_checkout_made_in_the_clone_is_ignored_by_git():
    """README step 1 runs `apply.py --fetch` in the clone: its checkout (./sglang-<release>/) must
    not show up as an untracked directory there; the series directories stay tracked."""
    from eaglepatch.series import available_series
    for release, d in available_series().items():
        r = subprocess.run(["git", "check-ignore", "--no-index", "-q", f"sglang-{release}/python/sglang/__init__.py"],
                           cwd=REPO)
        assert r.returncode == 0, f"sglang-{release}/ is not ignored"
        r = subprocess.run(["git", "check-ignore", "--no-index", "-q", str((d / "series").relative_to(REPO))],
                           cwd=REPO)
        assert r.returncode == 1, f"{d}/series is ignored"


def test_commit_force_says_which_branch_it_replaced_and_where_it_was(checkout_059):
    """--commit --force over an existing branch (here with a commit of the user's on it) says so in
    one stderr line naming the branch and its old commit, which stays recoverable."""
    assert run_tool("apply", checkout_059, "--series", BASIC, "--commit").returncode == 0
    (checkout_059 / "NOTES").write_text("my work\n")
    git(checkout_059, "add", "NOTES")
    git(checkout_059, "commit", "-q", "-m", "my work on the series branch")
    old = git(checkout_059, "rev-parse", "HEAD").strip()
    git(checkout_059, "checkout", "-q", "main")
    r = run_tool("apply", checkout_059, "--series", BASIC, "--commit")
    assert r.returncode == 1 and "already exists" in one_line_error(r) and "--force" in r.stderr
    r = run_tool("apply", checkout_059, "--series", BASIC, "--commit", "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(notes) == 1 and "replaced branch eaglepatch/sglang-0.5.9" in notes[0] and old in notes[0], r.stderr
    assert git(checkout_059, "rev-parse", "HEAD").strip() != old
    git(checkout_059, "branch", "recovered", old)  # the command the note names
    assert git(checkout_059, "log", "-1", "--format=%s", "recovered").strip() == "my work on the series branch"


@pytest.mark.parametrize("layout", ["installed", "git"])
def test_a_series_for_another_release_is_named_as_such(layout, installed_059, checkout_059):
    """--series patches/sglang-0.5.17 on a 0.5.9 tree: not 'local edits' or missing files, but the
    tree's release and the series to use; nothing is written."""
    other = REPO / "patches" / "sglang-0.5.17"
    if not other.is_dir():
        pytest.skip("no 0.5.17 series")
    tree = installed_059 if layout == "installed" else checkout_059
    before = hashes(tree)
    for extra in ([], ["--check"]):
        r = run_tool("apply", tree, "--series", other, *extra)
        assert r.returncode == 2, r.stdout + r.stderr
        err = one_line_error(r)
        assert "this tree is sglang 0.5.9" in err and "series for sglang 0.5.17" in err, err
        assert "use --series patches/sglang-0.5.9" in err and "local edits" not in err
    assert hashes(tree) == before


def test_a_patched_and_committed_tree_is_told_by_its_hashes(checkout_059):
    """HEAD on the series branch (no release tag, no _version.py): the manifests tell the release."""
    assert run_tool("apply", checkout_059, "--series", REAL, "--commit").returncode == 0
    r = run_tool("apply", checkout_059, "--check", "--series", REPO / "patches" / "sglang-0.5.23")
    assert r.returncode == 2
    assert "this tree is sglang 0.5.9 (from the hashes in sglang-0.5.9/manifest.json)" in one_line_error(r)


def _reverse_steps(out: str) -> dict:
    """{"checkout"|"commit": the shell command} of the steps `--reverse` prints (comments cut off)."""
    steps = {}
    for ln in out.splitlines():
        cmd = ln.split("    #")[0].strip()
        if cmd.startswith("git ") and " checkout " in cmd:
            steps["checkout"] = cmd
        elif cmd.startswith("git ") and " commit " in cmd:
            steps["commit"] = cmd
    return steps


def test_reverse_of_a_fetched_checkout_names_the_next_step(tmp_path):
    """After --fetch the series is committed: --reverse leaves uncommitted changes that the next
    --commit refuses. It says so and what to do; doing it leads to a clean upstream tree that
    --commit --force patches again."""
    dest = tmp_path / "co"
    env = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}
    assert run_tool("apply", "--fetch", "0.5.9", dest, env=env).returncode == 0
    r = run_tool("apply", dest, "--reverse", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "eaglepatch/sglang-0.5.9 still has it committed" in r.stdout
    step = _reverse_steps(r.stdout)["checkout"]
    assert step == f"git -C {dest.resolve()} checkout -q -f main" and "commit -q -a -m" in r.stdout
    # the same hint when the reverse is run again
    assert step in run_tool("apply", dest, "--reverse", env=env).stdout
    subprocess.run(step, shell=True, check=True, cwd=tmp_path)
    assert git(dest, "status", "--porcelain") == "" and set(manifest_state(dest / "python").values()) == {"upstream"}
    r = run_tool("apply", dest, "--commit", "--force", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(manifest_state(dest / "python").values()) == {"patched"}
    # a reverse whose result is committed (or a tree never committed) says nothing more
    assert run_tool("apply", dest, "--reverse", env=env).returncode == 0
    git(dest, "commit", "-q", "-a", "-m", "Remove the series")
    r = run_tool("apply", dest, "--reverse", env=env)
    assert r.returncode == 0 and "nothing to reverse" in r.stdout and "git checkout" not in r.stdout


@pytest.mark.parametrize("step", ["checkout", "commit", "none"])
def test_reverse_steps_then_readme_step_1_again(step, tmp_path):
    """Issue 29, item 14: README step 1 (`apply.py --fetch`, from some directory), `--reverse`, one
    of the steps it prints, run as printed from another git repository, in this session without a
    git identity, then README step 1 again: each step acts on the fetched tree only (`git -C`), the
    commit needs no identity of the user's, and step 1 succeeds, the series applied and committed
    again. ("none": step 1 right after the reverse undoes it.)"""
    env = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}
    work = tmp_path / "work"
    work.mkdir()
    dest = work / "sglang-0.5.9"
    assert run_tool("apply", "--fetch", cwd=work, env=env).returncode == 0
    assert subprocess.run(["git", "config", "user.name"], cwd=dest, capture_output=True).returncode != 0  # no identity
    other = tmp_path / "other"  # the directory the user runs the steps from: a repository of its own
    other.mkdir()
    git(other, "init", "-q", "-b", "main")
    (other / "f").write_text("mine\n")
    git(other, "add", "f")
    git(other, "commit", "-q", "-m", "other work")
    (other / "f").write_text("mine, edited\n")
    other_before = (git(other, "rev-parse", "HEAD"), git(other, "status", "--porcelain"))
    r = run_tool("apply", dest, "--reverse", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = _reverse_steps(r.stdout)
    assert set(steps) == {"checkout", "commit"}, r.stdout
    assert all(c.startswith(f"git -C {dest.resolve()} ") for c in steps.values()), steps
    assert f"to patch it again later: python3 {REPO / 'tools' / 'apply.py'} --fetch 0.5.9 {dest.resolve()}" in r.stdout
    if step != "none":
        done = subprocess.run(steps[step], shell=True, cwd=other, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (git(other, "rev-parse", "HEAD"), git(other, "status", "--porcelain")) == other_before
        assert git(dest, "status", "--porcelain") == ""
        assert set(manifest_state(dest / "python").values()) == {"upstream"}
        if step == "commit":
            assert git(dest, "log", "-1", "--format=%s %an").strip() == "Remove sglang-0.5.9 eaglepatch"
    r = run_tool("apply", "--fetch", cwd=work, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(manifest_state(dest / "python").values()) == {"patched"}
    assert git(dest, "status", "--porcelain") == ""
    assert git(dest, "rev-parse", "--abbrev-ref", "HEAD").strip() == "eaglepatch/sglang-0.5.9"
    assert git(dest, "log", "-1", "--format=%s").strip() == git(dest, "log", "-1", "--format=%s",
                                                                "eaglepatch/sglang-0.5.9").strip()
    r = run_tool("apply", "--fetch", cwd=work, env=env)  # and once more: already there
    assert r.returncode == 0 and "already fetched, applied and committed" in r.stdout


def test_reverse_steps_commit_only_the_series_beside_other_changes(tmp_path):
    """A reversed checkout with another tracked file edited: no checkout step (it would discard the
    edit), and the commit step records the series' files only, leaving the edit uncommitted."""
    env = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}
    dest = tmp_path / "co"
    assert run_tool("apply", "--fetch", "0.5.9", dest, env=env).returncode == 0
    mine = dest / "python" / "sglang" / "version.py"
    mine.write_text(mine.read_text() + "# mine\n")
    r = run_tool("apply", dest, "--reverse", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = _reverse_steps(r.stdout)
    assert set(steps) == {"commit"} and " -a " not in steps["commit"], r.stdout
    subprocess.run(steps["commit"], shell=True, check=True, cwd=tmp_path)
    assert git(dest, "status", "--porcelain") == " M python/sglang/version.py\n"
    assert set(manifest_state(dest / "python").values()) == {"upstream"}

@pytest.mark.parametrize("stage", ["commit-objects", "replacing"])
def test_killed_fetch_over_a_reversed_checkout_is_finished_by_the_same_command(stage, tmp_path):
    """README step 1 again over its reversed checkout, killed before or after the commit point:
    the same command finishes or undoes it, then leaves the series applied and committed."""
    env = {"EAGLEPATCH_PATCHES": str(BASIC_ROOT)}
    dest = tmp_path / "sglang-0.5.9"
    assert run_tool("apply", "--fetch", cwd=tmp_path, env=env).returncode == 0
    r = run_tool("apply", dest, "--reverse", env=env)
    subprocess.run(_reverse_steps(r.stdout)["checkout"], shell=True, check=True, cwd=tmp_path)
    kill(start_stopped("apply", "--fetch", "0.5.9", dest, stage=stage, env=env))
    r = run_tool("apply", "--fetch", "0.5.9", dest, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(manifest_state(dest / "python").values()) == {"patched"}
    assert git(dest, "status", "--porcelain") == ""
    assert git(dest, "rev-parse", "--abbrev-ref", "HEAD").strip() == "eaglepatch/sglang-0.5.9"
    assert not (dest / "python" / TXN).exists()


# ---- issue 43 item 17, older lows: --commit on ROOT/python, two --fetch into one DEST, a branch-ref lock,
# SIGTERM during verify's copy ---------------------------------------------------------------------------

def test_commit_on_the_python_directory_names_the_checkout(small_git):
    """--commit on ROOT/python of a checkout (an installed layout to the tools): one line naming the
    checkout's root to pass (was: "cannot be combined with --reverse", never given); --commit
    --reverse says that combination alone."""
    before = hashes(small_git / "python")
    r = run_tool("apply", small_git / "python", "--series", BASIC, "--commit")
    err = one_line_error(r)
    assert r.returncode == 2 and "--reverse" not in err, err
    assert f"it is the python/ directory of the checkout {small_git}" in err, err
    assert f"run it on the checkout's root: python3 tools/apply.py {small_git} --commit" in err, err
    r = run_tool("apply", small_git, "--series", BASIC, "--commit", "--reverse")
    assert r.returncode == 2 and "--commit cannot be combined with --reverse" in one_line_error(r), r.stderr
    assert hashes(small_git / "python") == before


def test_a_locked_branch_ref_is_named(small_git):
    """A stale lock of the series branch's ref (what a git process killed while updating it leaves):
    refused before anything is written, naming the lock file to remove (was: git's last line only,
    "remove the file manually to continue.")."""
    lock = small_git / ".git" / "refs" / "heads" / "eaglepatch" / "sglang-0.5.9.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    before = hashes(small_git / "python")
    r = run_tool("apply", small_git, "--series", BASIC, "--commit")
    err = one_line_error(r)
    assert r.returncode == 1 and f"({lock} exists)" in err and f"remove {lock}" in err, err
    assert hashes(small_git / "python") == before
    lock.unlink()
    assert run_tool("apply", small_git, "--series", BASIC, "--commit").returncode == 0


def test_two_fetches_into_one_dest(tmp_path):
    """Two --fetch runs into one DEST at once: the one that renames its checkout second finds the
    checkout the first made, says so and exits 0, leaving nothing of its own (was: "cannot move the
    new checkout ...: Directory not empty", exit 2)."""
    import signal

    dest = tmp_path / "sglang"
    first = start_stopped("apply", "--fetch", "0.5.9", dest, stage="fetch-patched")
    try:
        r = run_tool("apply", "--fetch", "0.5.9", dest)
        assert r.returncode == 0 and dest.is_dir(), r.stderr
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            kill(first)
    assert first.returncode == 0, err
    assert f"another --fetch made {dest} while this one ran: already fetched, applied and committed" in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang"], list(tmp_path.iterdir())
    shutil.rmtree(first.tmp, ignore_errors=True)


def test_sigterm_during_verifys_copy_leaves_no_temp_dir(small):
    """SIGTERM while verify copies the tree for its smoke tests: verify stops as on Ctrl-C (one line,
    exit 2) and its temporary copy is gone (was: killed by the signal, the copy left in TMPDIR)."""
    import signal

    proc = start_stopped("verify", small, "--series", BASIC, stage="verify-copying")
    copies = [p for p in proc.tmp.iterdir() if p.name.startswith("eaglepatch-verify-")]
    assert len(copies) == 1 and (copies[0] / "pp" / "sglang").is_dir(), list(proc.tmp.iterdir())
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    left = sorted(p.name for p in proc.tmp.iterdir())
    shutil.rmtree(proc.tmp, ignore_errors=True)
    assert proc.returncode == 2 and err.strip().splitlines()[-1].startswith("error: interrupted"), err
    assert left == [], left
