"""The suite does not depend on the user's git configuration (issue 17): a machine with no git
identity, no ~/.gitconfig and no /etc/gitconfig runs the tests that commit, and so do the tools."""

import os
import subprocess
import sys

from conftest import REPO, SESSION_GITCONFIG

from eaglepatch.fetch import cache_root

# every test that runs `git commit` itself, or a tool that commits (apply --commit, --fetch)
GIT_TESTS = ["tests/test_export.py", "tests/test_verify.py::test_static_smoke_catches_an_undefined_name",
             "tests/test_apply.py::test_commit_creates_one_commit_per_patch",
             "tests/test_apply.py::test_fetch_makes_a_patched_checkout"]


def test_the_session_has_no_git_identity(tmp_path):
    """conftest's session config: git neither has nor guesses an identity, whatever the user has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))}
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=env)
    r = subprocess.run(["git", "var", "GIT_COMMITTER_IDENT"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "identity" in r.stderr.lower(), (r.stdout, r.stderr)


def test_git_touching_tests_pass_with_an_empty_home_and_no_git_config(tmp_path):
    """The tests that commit, run in a fresh pytest with HOME an empty directory, GIT_CONFIG_GLOBAL a
    file that only forbids guessing an identity (so the host name cannot supply one), no system
    config and no GIT_* identity variables; the release cache stays the real one (nothing is rebuilt)."""
    home = tmp_path / "home"
    home.mkdir()
    cfg = tmp_path / "gitconfig"
    cfg.write_text(SESSION_GITCONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(home), GIT_CONFIG_GLOBAL=str(cfg), GIT_CONFIG_NOSYSTEM="1",
               EAGLEPATCH_CACHE=str(cache_root().parent), XDG_CONFIG_HOME=str(home / ".config"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                        str(tmp_path / "basetemp"), *GIT_TESTS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " failed" not in r.stdout and " passed" in r.stdout
    assert not any(home.iterdir()), "the tests wrote into HOME: %s" % sorted(p.name for p in home.iterdir())
