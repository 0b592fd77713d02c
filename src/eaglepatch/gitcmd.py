"""git itself: found on PATH or a one-line error, GitPython opened only after that, and the
plain `git` runner the library uses outside a repository (no user GIT_* variables but the ones
that say where the user's configuration is, C locale)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .errors import RefusedError, UsageError
from .interrupts import held_interrupts

NO_GIT = ("git is not on PATH (eaglepatch runs `git apply`, `git merge-file` and git commits)",
          "install git 2.x (e.g. apt-get install git) and run again")
# who commits where git has no user.name / user.email (scratch repositories, the release checkout)
GIT_ID = {"GIT_AUTHOR_NAME": "eaglepatch", "GIT_AUTHOR_EMAIL": "eaglepatch@localhost",
          "GIT_COMMITTER_NAME": "eaglepatch", "GIT_COMMITTER_EMAIL": "eaglepatch@localhost"}


def require_git() -> str:
    path = shutil.which("git")
    if path is None:
        raise UsageError(*NO_GIT)
    return path


# where git's configuration is: kept, as HOME is (GitPython's calls see them too)
CONFIG_VARS = ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM")


def clean_env(ceiling: Path | None = None, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in CONFIG_VARS}
    if ceiling is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(ceiling)
    env["LC_ALL"] = "C"
    env.update(extra or {})
    return env


def run(args: list[str], cwd: Path, env: dict | None = None, check: bool = True,
        input: bytes | None = None) -> subprocess.CompletedProcess:
    """`git ARGS` in `cwd` with Ctrl-C held back; bytes out. check=True: a failure is a refusal
    naming git's own message."""
    require_git()
    with held_interrupts():
        r = subprocess.run(["git", *args], cwd=cwd, env=clean_env() if env is None else env, capture_output=True,
                           input=input)
    if check and r.returncode != 0:
        msg = (r.stderr or r.stdout).decode("utf-8", "replace").strip().splitlines()
        raise RefusedError(f"git {args[0]} failed in {cwd}: {msg[-1] if msg else f'exit {r.returncode}'}",
                           "fix what git says and run again")
    return r


def open_repo(path: Path | str, why: str = "drop --commit or run git init there", work_tree: bool = False):
    """A GitPython Repo for `path` (git must be on PATH; GitPython refuses to import without it).
    work_tree=True: a repository git treats as bare (also a work tree whose .git points at a bare
    repository) is refused in one line, since nothing can be checked out or committed there."""
    require_git()
    try:
        import git
    except ImportError as exc:
        raise UsageError(f"GitPython cannot start: {str(exc).splitlines()[0]}", NO_GIT[1]) from None
    try:
        repo = git.Repo(path)
    except Exception:
        raise UsageError(f"{path} is not a git repository", why) from None
    if work_tree and (repo.bare or repo.working_tree_dir is None):
        git_dir = repo.git_dir
        repo.close()
        raise UsageError(f"{path} uses the bare repository {git_dir} (core.bare is true), which has no work tree "
                         "to commit in", f"clone a checkout (git clone {git_dir}) and run there, or {why}")
    return repo
