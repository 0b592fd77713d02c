"""N >= 20 concurrent tools/apply.py runs (and apply against --reverse, with verify runs among
them) on one real sglang 0.5.9 tree: the tree lock serialises them, so every run's exit 0 means
what it printed, and after each trial the whole tree's hash is exactly upstream or exactly
patched (no half-patched tree, no transaction or staging file left)."""

import os
import subprocess
import sys
from collections import Counter

import pytest
from conftest import BASIC, REPO, copy_installed, hashes, series_files

N = 24


def _launch(tree, kinds):
    """Start one process per kind at once ('apply' | 'reverse' | 'verify'); their results."""
    env = dict(os.environ, EAGLEPATCH_LOCK_TIMEOUT="600")
    cmd = {"apply": ["apply.py", tree, "--series", BASIC],
           "reverse": ["apply.py", tree, "--series", BASIC, "--reverse"],
           "verify": ["verify.py", tree, "--series", BASIC, "--smoke", "none"]}
    procs = [(k, subprocess.Popen([sys.executable, str(REPO / "tools" / cmd[k][0]), *map(str, cmd[k][1:])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
             for k in kinds]
    out = []
    for k, p in procs:
        so, se = p.communicate(timeout=600)
        out.append((k, p.returncode, so, se))
    return out


def _claim(kind, rc, so, se):
    """What a run says it did: 'applied' | 'reversed' | 'noop' | 'saw upstream' | 'saw patched'."""
    assert "Traceback" not in se and "error:" not in se, (kind, rc, so, se)
    assert all(ln.startswith("waiting for another eaglepatch run") for ln in se.splitlines()), se
    assert rc == 0, (kind, rc, so, se)
    if kind == "verify":
        assert "verify: CLEAN (exit 0)" in so, so
        return "saw patched" if "has the series applied" in so else "saw upstream"
    if so.startswith("applied "):
        return "applied"
    if so.startswith("reversed "):
        return "reversed"
    assert ("already applied" in so) if kind == "apply" else ("nothing to reverse" in so), so
    return "noop"


@pytest.fixture(scope="module")
def tree_and_states(tmp_path_factory, release_059):
    root = tmp_path_factory.mktemp("concurrency")
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):  # in RAM: the lock is what is tested
        import tempfile
        from pathlib import Path
        root = Path(tempfile.mkdtemp(prefix="eaglepatch-concurrency-", dir="/dev/shm"))
    tree = copy_installed(release_059, root / "sp", series_files(BASIC))
    up = hashes(tree)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "apply.py"), tree, "--series", BASIC],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    patched = hashes(tree)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "apply.py"), tree, "--series", BASIC, "--reverse"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and hashes(tree) == up, r.stderr
    assert up != patched and set(up) < set(patched)
    yield tree, up, patched
    import shutil
    shutil.rmtree(root, ignore_errors=True)


def _check_trial(tree, up, patched, start, results):
    claims = Counter(_claim(*r) for r in results)
    final = hashes(tree)
    assert final in (up, patched), "the tree is neither upstream nor patched: %s" % sorted(
        k for k in set(final) | set(up) | set(patched) if final.get(k) not in (up.get(k), patched.get(k)))
    # runs were serialised: real changes alternate, so the final state is the start plus the changes
    delta = claims["applied"] - claims["reversed"]
    if start == "upstream":
        assert delta in (0, 1), claims
        assert final == (patched if delta == 1 else up), claims
    else:
        assert delta in (0, -1), claims
        assert final == (up if delta == -1 else patched), claims
    return claims


def test_concurrent_applies_one_applies_the_rest_see_it_applied(tree_and_states):
    tree, up, patched = tree_and_states
    assert hashes(tree) == up
    claims = _check_trial(tree, up, patched, "upstream", _launch(tree, ["apply"] * N))
    assert claims == Counter({"applied": 1, "noop": N - 1}), claims
    assert hashes(tree) == patched
    claims = _check_trial(tree, up, patched, "patched", _launch(tree, ["reverse"] * N))
    assert claims == Counter({"reversed": 1, "noop": N - 1}), claims


@pytest.mark.parametrize("trial", range(3))
def test_concurrent_apply_against_reverse_and_verify(tree_and_states, trial):
    tree, up, patched = tree_and_states
    start = "upstream" if hashes(tree) == up else "patched"
    kinds = (["apply", "reverse"] * (N // 2))
    kinds[trial::6] = ["verify"] * len(kinds[trial::6])  # a verify among every six runs
    claims = _check_trial(tree, up, patched, start, _launch(tree, kinds))
    assert claims["applied"] + claims["reversed"] >= 1, claims  # the runs did act, not only refuse
    assert claims["saw upstream"] + claims["saw patched"] == kinds.count("verify"), claims
    print(f"trial {trial}: {len(kinds)} runs from {start}: {dict(claims)}; final "
          f"{'patched' if hashes(tree) == patched else 'upstream'}")


# ------------------------------------------------------------------------------------------
# EAGLEPATCH_LOCK_TIMEOUT (issue 29, item 24): a finite number of seconds >= 0; `inf` waited
# forever behind a held lock and `nan` meant 0

BAD_TIMEOUTS = ["inf", "nan", "-1", "1e999", "soon", "-inf"]


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_a_lock_timeout_that_is_not_a_finite_number_is_a_usage_error(small, tmp_path, value):
    from conftest import one_line_error, run_tool
    before = hashes(small)
    env = {"EAGLEPATCH_LOCK_TIMEOUT": value}
    for tool, args in (("apply", [small, "--series", BASIC]), ("verify", [small, "--series", BASIC, "--smoke", "none",
                                                                         "--json", tmp_path / "v.json"]),
                       ("export", ["--overlay", "--check"])):
        r = run_tool(tool, *args, env=env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (tool, r.stdout, r.stderr)
        err = one_line_error(r)
        assert f"EAGLEPATCH_LOCK_TIMEOUT={value!r} is not a finite number of seconds >= 0" in err, err
        assert r.stdout == "", (tool, r.stdout)
    assert hashes(small) == before and not (tmp_path / "v.json").exists()


def test_a_bad_lock_timeout_behind_a_held_lock_is_refused_at_once(small):
    from conftest import one_line_error
    from txnkit import interrupt, start_stopped
    before = hashes(small)
    holder = start_stopped("apply", small, "--series", BASIC, stage="staged")  # holds the lock
    try:
        for value in ("inf", "nan"):
            try:
                r = subprocess.run([sys.executable, str(REPO / "tools" / "apply.py"), small, "--series", BASIC],
                                   capture_output=True, text=True, timeout=30,
                                   env=dict(os.environ, EAGLEPATCH_LOCK_TIMEOUT=value))
            except subprocess.TimeoutExpired:
                pytest.fail(f"EAGLEPATCH_LOCK_TIMEOUT={value}: still waiting for the lock after 30 s")
            assert r.returncode == 2 and "is not a finite number" in one_line_error(r), (value, r.stdout, r.stderr)
    finally:
        rc, _, err = interrupt(holder)
    assert rc == 2 and "Traceback" not in err
    assert hashes(small) == before
