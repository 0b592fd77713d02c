"""`apply --commit`: one commit per patch on branch `eaglepatch/sglang-<release>` (message = the
patch header), made inside the apply transaction (`txn`):

- before the commit point: the commits are created as objects (no ref, index or file is
  touched), the new index is computed (the current index with the series' paths updated), and
  the branch ref is created; the transaction stages the new index beside `.git/index`;
- after it: the files and the index are renamed into place, then HEAD is switched to the branch.

An interrupted `--commit` is finished (or undone, before the commit point) by running it again.
A repository in the middle of a merge, rebase, cherry-pick, revert or bisect is refused.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import RefusedError
from .gitcmd import GIT_ID, open_repo, run
from .interrupts import held_interrupts, stop_point
from .outputs import scratch_dir
from .series import Series, header_to_message, tool_command

BUSY = (("MERGE_HEAD", "a merge", "git merge --continue, or git merge --abort"),
        ("rebase-merge", "a rebase", "git rebase --continue, or git rebase --abort"),
        ("rebase-apply", "a rebase or git am", "git rebase --continue / --abort, or git am --continue / --abort"),
        ("CHERRY_PICK_HEAD", "a cherry-pick", "git cherry-pick --continue, or git cherry-pick --abort"),
        ("REVERT_HEAD", "a revert", "git revert --continue, or git revert --abort"),
        ("BISECT_LOG", "a bisect", "git bisect reset"),
        ("sequencer", "a cherry-pick or revert sequence", "git cherry-pick --quit, or git revert --quit"))


def branch_name(series: Series) -> str:
    return f"eaglepatch/sglang-{series.release}"


@dataclass
class CommitPlan:
    root: Path  # work tree
    ref: str  # refs/heads/eaglepatch/sglang-<release>
    new: str  # the last commit
    old: str | None  # what the branch pointed at before (with --force), else None
    head: str  # HEAD before: a ref name, or a commit when detached
    index_path: Path
    index: bytes

    @property
    def branch(self) -> str:
        return self.ref[len("refs/heads/"):]

    def txn_info(self) -> dict:
        return {"cwd": str(self.root), "ref": self.ref, "new": self.new, "old": self.old, "head": self.head}

    def create_branch(self) -> None:
        """Before the commit point: the branch ref (the transaction deletes it again on undo)."""
        run(["update-ref", self.ref, self.new, self.old or "0" * 40], self.root)


class _Git:
    """GitPython's `git` with Ctrl-C held back and failures turned into one-line refusals."""

    def __init__(self, repo):
        self.repo = repo

    def __call__(self, *args, env=None, strip=True) -> str:
        import git
        try:
            with held_interrupts():
                out = self.repo.git.execute(["git", *args], env=env, strip_newline_in_stdout=strip)
        except git.GitCommandError as exc:
            msg = (exc.stderr or "").strip().strip("'").strip().splitlines()
            raise RefusedError(f"git {args[0]} failed in {self.repo.working_tree_dir}: "
                               f"{msg[-1].strip() if msg else f'exit {exc.status}'}",
                               "fix what git says (e.g. free disk space) and run again; nothing was changed") \
                from None
        return out


def _git_paths(g: _Git, root: Path, *names: str) -> list[Path]:
    """Where git keeps each of `names` (one `git rev-parse` prints them one per line)."""
    out = g("rev-parse", *(a for name in names for a in ("--git-path", name))).splitlines()
    return [p if p.is_absolute() else root / p for p in map(Path, out)]


def check_idle(g: _Git, root: Path, *refs: str) -> None:
    """Refuse a repository in the middle of a git operation, or one another git process is
    writing (its index, HEAD or one of ``refs`` locked): both would be overwritten by, or overwrite,
    the commit."""
    locks = ("index.lock", "HEAD.lock", *(f"{r}.lock" for r in refs))
    paths = _git_paths(g, root, *(b[0] for b in BUSY), *locks)
    for (name, what, how), path in zip(BUSY, paths):
        if path.exists():
            raise RefusedError(f"{what} is in progress in {root}",
                               f"finish or abort it first ({how}), then run apply --commit again; nothing was changed")
    for path in paths[len(BUSY):]:
        if os.path.lexists(path):
            raise RefusedError(f"another git process is using {root} ({path} exists)",
                               f"wait for it to finish (if no git process is running, remove {path}), then run "
                               "apply --commit again; nothing was changed")


def _checked_out_elsewhere(g: _Git, root: Path, ref: str) -> Path | None:
    """The other worktree that has `ref` checked out, if any."""
    wt = None
    for ln in g("worktree", "list", "--porcelain").splitlines():
        if ln.startswith("worktree "):
            wt = Path(ln[len("worktree "):])
        elif ln == f"branch {ref}" and wt is not None and os.path.realpath(wt) != os.path.realpath(root):
            return wt
    return None


def _prefix(repo, pp: Path) -> str:
    wt = Path(repo.working_tree_dir).resolve()
    prefix = os.path.relpath(pp, wt).replace(os.sep, "/")
    return "" if prefix == "." else prefix + "/"


def committed(tree, series: Series) -> str | None:
    """For a patched tree: the branch HEAD is on when the series' files are committed there, else None."""
    repo = open_repo(tree.root, work_tree=True)
    try:
        g = _Git(repo)
        prefix = _prefix(repo, tree.package_parent)
        paths = [prefix + rel for rel in series.files()]
        if g("status", "--porcelain", "--untracked-files=all", "--", *paths).strip():
            return None
        return g("rev-parse", "--abbrev-ref", "HEAD")
    finally:
        repo.close()


def prepare_commit(tree, series: Series, originals: dict, snapshots: list, changes: dict,
                   force: bool = False) -> CommitPlan:
    """The commits (objects only), the new index and what the branch will point at, from the
    target files as read under the lock (`originals`, rel -> bytes|None) and their state after each
    patch; raises a refusal (nothing changed) for a busy repository, uncommitted target files or
    an existing branch."""
    repo = open_repo(tree.root, work_tree=True)
    try:
        return _prepare(repo, tree, series, originals, snapshots, changes, force)
    finally:
        repo.close()


def _prepare(repo, tree, series, originals, snapshots, changes, force) -> CommitPlan:
    g = _Git(repo)
    root = Path(repo.working_tree_dir).resolve()
    check_idle(g, root, f"refs/heads/{branch_name(series)}")  # the branch ref git update-ref locks
    prefix = _prefix(repo, tree.package_parent)
    final = snapshots[-1]
    paths = [prefix + rel for rel in final]
    dirty = g("status", "--porcelain", "--untracked-files=no", "--", *paths)
    if dirty.strip():
        raise RefusedError("uncommitted changes in " + ", ".join(ln[3:] for ln in dirty.splitlines()),
                           "commit or stash them before apply --commit")
    try:
        parent = g("rev-parse", "--verify", "HEAD^{commit}")
    except RefusedError:
        raise RefusedError(f"{root} has no commit yet", "commit the upstream release first, then apply --commit") \
            from None
    branch = branch_name(series)
    ref = f"refs/heads/{branch}"
    old = None
    try:
        old = g("rev-parse", "--verify", "-q", ref)
    except RefusedError:
        pass
    if old and not force:
        raise RefusedError(f"branch {branch} already exists", "delete it (git branch -D) or pass --force")
    other = _checked_out_elsewhere(g, root, ref) if old else None
    if other is not None:  # git itself never moves a branch another worktree has checked out
        raise RefusedError(f"branch {branch} is checked out in the worktree {other}, so --force cannot move it",
                           f"switch that worktree to another branch (git -C {other} switch --detach) or remove it "
                           "(git worktree remove), then run apply --commit --force again; nothing was changed")
    try:
        head = g("symbolic-ref", "-q", "HEAD")
    except RefusedError:
        head = parent  # detached
    env = _identity_env(g)
    blobs: dict = {}  # rel -> (mode, sha) | None, after the last patch
    td = scratch_dir("eaglepatch-index-")
    try:
        ienv = dict(os.environ, **env, GIT_INDEX_FILE=str(Path(td) / "index"))
        g("read-tree", "HEAD", env=ienv)
        prev = originals
        for p, snap in zip(series.patches, snapshots):
            for rel, data in snap.items():
                if data == prev.get(rel):
                    continue
                if data is None:
                    g("update-index", "--force-remove", "--", prefix + rel, env=ienv)
                    blobs[rel] = None
                    continue
                f = Path(td) / "blob"
                f.write_bytes(data)
                sha = g("hash-object", "-w", "--no-filters", str(f), env=ienv)
                mode = "100755" if os.access(tree.package_parent / rel, os.X_OK) and \
                    (tree.package_parent / rel).is_file() else "100644"
                g("update-index", "--add", "--cacheinfo", f"{mode},{sha},{prefix + rel}", env=ienv)
                blobs[rel] = (mode, sha)
            prev = snap
            treesha = g("write-tree", env=ienv)
            mf = Path(td) / "msg"
            mf.write_bytes(header_to_message(p.header).encode("utf-8"))
            parent = g("commit-tree", treesha, "-p", parent, "-F", str(mf), env=ienv)
        stop_point("commit-objects")
        index_path = _git_paths(g, root, "index")[0]
        work = Path(td) / "work-index"
        if index_path.is_file():
            shutil.copyfile(index_path, work)
        wenv = dict(os.environ, **env, GIT_INDEX_FILE=str(work))
        if not index_path.is_file():
            g("read-tree", "HEAD", env=wenv)
        for rel in sorted(r for r in changes if r in blobs):
            b = blobs[rel]
            if b is None:
                g("update-index", "--force-remove", "--", prefix + rel, env=wenv)
            else:
                g("update-index", "--add", "--cacheinfo", f"{b[0]},{b[1]},{prefix + rel}", env=wenv)
        index = work.read_bytes()
    except OSError as exc:
        raise RefusedError(f"cannot prepare the commits: {exc.strerror}",
                           "free space and run again; nothing was changed") from None
    finally:
        shutil.rmtree(td, ignore_errors=True)
    return CommitPlan(root, ref, parent, old, head, index_path, index)


def _identity_env(g: _Git) -> dict:
    """GIT_ID's author and committer for whichever of user.name / user.email git has no value for."""
    env = {}
    for var, key in (("NAME", "user.name"), ("EMAIL", "user.email")):
        try:
            g("config", key)
        except RefusedError:
            env.update({k: v for k, v in GIT_ID.items() if k.endswith(var)})
    return env


def after_reverse_hint(tree, series: Series) -> str | None:
    """After `--reverse` in a git checkout whose HEAD has the series committed (what `--commit` and
    `--fetch` make): the removal is uncommitted changes, which the next `apply --commit` refuses.
    The next step, or None when the work tree matches HEAD. Every printed command names the tree
    (`git -C ROOT`: it works from any directory and never acts on another repository), the commit
    brings an identity where git has none (`-c user.name=... -c user.email=...`, as `--commit`
    does), and the last line names the command that patches the tree again (README step 1's
    `apply.py --fetch` for a checkout it made)."""
    repo = open_repo(tree.root)
    try:
        g = _Git(repo)
        root = Path(repo.working_tree_dir).resolve()
        prefix = _prefix(repo, tree.package_parent)
        paths = [prefix + rel for rel in series.files()]
        dirty = [ln[3:] for ln in g("status", "--porcelain", "--untracked-files=no", "--", *paths).splitlines()
                 if ln.strip()]
        if not dirty:
            return None
        others = g("status", "--porcelain", "--untracked-files=no").splitlines()
        only_series = all(ln[3:] in paths for ln in others)
        head = g("rev-parse", "--abbrev-ref", "HEAD")
        base = _upstream_ref(g, paths, len(series.patches))
        identity = _identity_flags(g)
        fetched = made_by_fetch(g, series.release)
    finally:
        repo.close()
    git = f"git -C {shlex.quote(str(root))}"
    lines = [f"the series is removed from the work tree only: {head} still has it committed, so these are "
             "uncommitted changes (apply --commit refuses them). Next, either:"]
    if base and only_series:
        lines.append(f"  {git} checkout -q -f {shlex.quote(base)}    # back to sglang {series.release} as "
                     "committed there (only the series' files change)")
    what = "-a " if only_series else ""
    tail = "" if only_series else " -- " + " ".join(shlex.quote(x) for x in dirty)
    lines.append(f"  {git}{identity} commit -q {what}-m {shlex.quote('Remove ' + series.name)}{tail}    "
                 f"# record the removal on {head}" + ("" if only_series else " (the series' files only)"))
    again = (tool_command("apply", "--fetch", series.release, root) if fetched
             else tool_command("apply", root, "--commit", "--force"))
    lines.append(f"Either way, to patch it again later: {again}")
    return "\n".join(lines)


def _identity_flags(g: _Git) -> str:
    """` -c user.name=... -c user.email=...` (GIT_ID's) for whichever of the two git has no value
    for here, as `--commit` brings its own (`_identity_env`); "" when git has both."""
    out = ""
    for var, key in (("NAME", "user.name"), ("EMAIL", "user.email")):
        try:
            g("config", key)
        except RefusedError:
            out += f" -c {shlex.quote(key + '=' + GIT_ID['GIT_AUTHOR_' + var])}"
    return out


# the subject of the one commit `--fetch` makes (eaglepatch.fetch: the release's files, tagged v<release>)
FETCH_SUBJECT = "sglang {release} (from the released wheel)"


def made_by_fetch(g: _Git, release: str) -> bool:
    """Whether the repository is one `apply --fetch` made for `release`: its tag v<release> is on the
    commit `--fetch` makes."""
    try:
        return g("log", "-1", "--format=%s", f"refs/tags/v{release}") == FETCH_SUBJECT.format(release=release)
    except RefusedError:
        return False


def fetched_checkout(tree, series: Series) -> bool:
    """Whether `tree` (a git checkout) is one `apply --fetch` made for the series' release."""
    repo = open_repo(tree.root)
    try:
        return made_by_fetch(_Git(repo), series.release)
    finally:
        repo.close()


def uncommitted(tree, series: Series) -> bool:
    """Whether the series' files in the work tree differ from HEAD's (e.g. reversed, not committed)."""
    repo = open_repo(tree.root)
    try:
        g = _Git(repo)
        prefix = _prefix(repo, tree.package_parent)
        return bool(g("status", "--porcelain", "--untracked-files=no", "--",
                      *(prefix + rel for rel in series.files())).strip())
    finally:
        repo.close()


def branch_exists(tree, series: Series) -> bool:
    """Whether the repository has the branch `--commit` makes for the series."""
    repo = open_repo(tree.root)
    try:
        _Git(repo)("rev-parse", "--verify", "-q", f"refs/heads/{branch_name(series)}")
        return True
    except RefusedError:
        return False
    finally:
        repo.close()


def _upstream_ref(g: _Git, paths: list, n: int) -> str | None:
    """A branch (else a tag) at the commit `n` commits below HEAD when its copy of `paths` is what the
    work tree now holds: where `--commit` started."""
    try:
        base = g("rev-parse", "--verify", "-q", f"HEAD~{n}^{{commit}}")
        g("diff", "--quiet", base, "--", *paths)
    except RefusedError:
        return None
    for kind in ("branch", "tag"):
        names = [x.strip().lstrip("* ") for x in g(kind, "--points-at", base).splitlines() if x.strip()]
        names = [x for x in names if not x.startswith(("eaglepatch/", "("))]
        if names:
            return names[0]
    return base[:12]
