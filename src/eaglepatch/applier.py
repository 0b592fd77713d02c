"""Transactional, zero-fuzz apply of a series (git apply is the ground truth).

Every result is computed first (in memory, and by `git apply` in a temp dir outside any git
repository). The tree is then changed through a redo log in `<package parent>/.eaglepatch-txn/`:
new contents + plan.json, fsync, an atomic READY marker, os.replace of each target, removal of the
txn dir. Any later run completes a txn that has READY and deletes one that has not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import RefusedError, UsageError
from .series import Patch, Series, sha256_bytes
from .tree import UpstreamTree
from .verdicts import ANCHOR_DRIFT, SeriesCheck, check_series

TXN = ".eaglepatch-txn"
HUNK_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?\.", re.M)
CHECKING_RE = re.compile(r"^Checking patch (.+?)\.\.\.$", re.M)


# ------------------------------------------------------------------------------------------
# redo log

def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes, mode: int = 0o644) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, mode)


def prepare_txn(pp: Path, changes: dict, ready: bool = True) -> Path:
    """Write the redo log for `changes` (rel path -> bytes, or None to delete). With ready=True the
    READY marker is created atomically: from then on the change is committed."""
    txn = pp / TXN
    txn.mkdir()
    ops = []
    rmdirs = set()
    for i, (rel, data) in enumerate(sorted(changes.items())):
        target = pp / rel
        if data is None:
            ops.append({"path": rel, "blob": None})
            parent = Path(rel).parent
            while parent.parts and parent.parts[0] == "sglang" and len(parent.parts) > 1:
                rmdirs.add(str(parent))
                parent = parent.parent
            continue
        mode = (target.stat().st_mode & 0o7777) if target.exists() else 0o644
        blob = f"{i:04d}.new"
        _write_synced(txn / blob, data, mode)
        ops.append({"path": rel, "blob": blob, "sha256": sha256_bytes(data)})
    plan = {"ops": ops, "rmdirs": sorted(rmdirs, key=lambda p: -len(Path(p).parts))}
    _write_synced(txn / "plan.json", json.dumps(plan, indent=1, sort_keys=True).encode())
    _fsync_dir(txn)
    if ready:
        _write_synced(txn / "READY.tmp", b"ready\n")
        os.replace(txn / "READY.tmp", txn / "READY")
        _fsync_dir(txn)
    _fsync_dir(pp)
    return txn


def _redo(pp: Path, txn: Path) -> int:
    plan = json.loads((txn / "plan.json").read_text())
    touched = set()
    n = 0
    for op in plan["ops"]:
        target = pp / op["path"]
        if op["blob"] is None:
            if target.exists() or target.is_symlink():
                target.unlink()
                n += 1
        else:
            src = txn / op["blob"]
            if src.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, target)
                n += 1
        touched.add(target.parent)
    for d in plan.get("rmdirs", []):
        p = pp / d
        try:
            if p.is_dir() and not any(x for x in p.iterdir() if x.name != "__pycache__"):
                shutil.rmtree(p)
                touched.add(p.parent)
        except OSError:
            pass
    for d in touched:
        _fsync_dir(d)
    return n


def finish_txn(pp: Path) -> int:
    txn = pp / TXN
    n = _redo(pp, txn)
    shutil.rmtree(txn)
    _fsync_dir(pp)
    return n


def recover(pp: Path) -> str | None:
    """Complete (READY present) or discard (no READY) a txn left by an interrupted run."""
    txn = Path(pp) / TXN
    if not txn.exists():
        return None
    if (txn / "READY").exists() and (txn / "plan.json").exists():
        n = finish_txn(Path(pp))
        return f"recovered: completed an interrupted eaglepatch transaction in {txn} ({n} file operations redone)"
    shutil.rmtree(txn)
    _fsync_dir(Path(pp))
    return f"recovered: discarded an unfinished eaglepatch transaction in {txn} (it had not changed any file)"


def commit_changes(pp: Path, changes: dict) -> None:
    if not changes:
        return
    pp = Path(pp)
    try:
        prepare_txn(pp, changes, ready=True)
    except OSError as exc:  # e.g. ENOSPC before READY: nothing was changed yet
        shutil.rmtree(pp / TXN, ignore_errors=True)
        raise RefusedError(f"could not write the transaction log in {pp / TXN}: {exc.strerror or exc}",
                           "free disk space or fix permissions and run again (no file was changed)") from None
    finish_txn(pp)


# ------------------------------------------------------------------------------------------
# git apply, the ground truth

def _clean_git_env(ceiling: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(ceiling)
    env["LC_ALL"] = "C"
    return env


@dataclass
class GitApplyResult:
    snapshots: list = field(default_factory=list)  # after each patch: {rel: bytes|None}
    offsets: dict = field(default_factory=dict)  # (patch, file, hunk#0-based) -> offset
    error: str | None = None
    failed_patch: str | None = None

    @property
    def final(self) -> dict:
        return self.snapshots[-1] if self.snapshots else {}


def git_apply(originals: dict, patches: list[Patch], reverse: bool = False) -> GitApplyResult:
    """Apply `patches` with `git apply` to a temp copy of `originals` (rel -> bytes|None),
    outside any git repository; the snapshot after each patch and git's reported offsets."""
    res = GitApplyResult()
    tmp = Path(tempfile.mkdtemp(prefix="eaglepatch-apply-"))
    try:
        pp = tmp / "pp"
        pp.mkdir()
        for rel, data in originals.items():
            if data is not None:
                (pp / rel).parent.mkdir(parents=True, exist_ok=True)
                (pp / rel).write_bytes(data)
        env = _clean_git_env(tmp.parent)
        order = list(reversed(patches)) if reverse else list(patches)
        for i, p in enumerate(order):
            pf = tmp / f"{i:04d}.diff"
            pf.write_bytes(p.body)
            cmd = ["git", "apply", "-v", "--whitespace=nowarn"] + (["-R"] if reverse else []) + [str(pf)]
            r = subprocess.run(cmd, cwd=pp, env=env, capture_output=True, text=True)
            out = r.stdout + r.stderr
            if r.returncode != 0:
                res.error = "\n".join(ln for ln in out.splitlines() if ln.startswith(("error", "fatal")))[:2000] \
                    or out.strip()[:2000]
                res.failed_patch = p.name
                return res
            current = None
            for ln in out.splitlines():
                m = CHECKING_RE.match(ln)
                if m:
                    current = m.group(1)
                    continue
                m = HUNK_RE.match(ln)
                if m and current:
                    res.offsets[(p.name, current, int(m.group(1)) - 1)] = int(m.group(3) or 0)
            snap = {}
            for rel in originals:
                f = pp / rel
                snap[rel] = f.read_bytes() if f.exists() else None
            res.snapshots.append(snap)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# apply

@dataclass
class ApplyOutcome:
    status: str  # 'applied' | 'already applied' | 'not applied' | 'checked'
    check: SeriesCheck | None = None
    changes: dict = field(default_factory=dict)
    messages: list = field(default_factory=list)
    branch: str | None = None


def _fmt_verdicts(chk: SeriesCheck, patches: list[Patch], reverse: bool) -> list[str]:
    lines = []
    for p in (reversed(patches) if reverse else patches):
        vs = chk.for_patch(p.name)
        ok = all(v.applies for v in vs)
        lines.append(f"{'reverse ' if reverse else ''}{p.name}: {'ok' if ok else 'FAILS'}")
        for v in vs:
            lines.append(f"  {v.file} hunk {v.hunk} (@@ -{v.source_start}) [{v.anchor}]: {v.label}"
                         + (f" - {v.detail}" if v.detail and not v.ok else ""))
    return lines


def plan_series(tree: UpstreamTree, series: Series, patches: list[Patch], reverse: bool = False,
                force: bool = False, strict_hashes: bool = True) -> tuple[SeriesCheck, GitApplyResult]:
    """Check and compute the result of `patches` on `tree`; raise RefusedError when it cannot apply."""
    chk = check_series(tree.read, patches, series, reverse=reverse)
    bad = [v for v in chk.verdicts if not (v.ok or (force and v.verdict == ANCHOR_DRIFT))]
    if bad:
        v = bad[0]
        fix = "run tools/verify.py for the full per-hunk report"
        if v.verdict == ANCHOR_DRIFT:
            fix = "the enclosing code changed upstream; review it, then pass --force, or run tools/verify.py"
        raise RefusedError(f"{v.patch} does not apply: {v.file} hunk {v.hunk} is '{v.label}'"
                           + (f" ({v.detail})" if v.detail else "") + f"; {len(bad)} hunk(s) fail in all", fix)
    ga = git_apply(chk.originals, patches, reverse)
    if ga.error:
        raise RefusedError(f"git apply refused {ga.failed_patch}: {ga.error.splitlines()[0] if ga.error else ''}",
                           "run tools/verify.py for the per-hunk report")
    for rel, data in ga.final.items():
        if data != chk.results.get(rel):
            raise RefusedError(f"git apply and the hunk matcher disagree on {rel}",
                               "report this; nothing was written")
    by_file: dict = {}
    for v in chk.verdicts:
        by_file.setdefault((v.patch, v.file), []).append(v)
    for (pname, rel, k), off in ga.offsets.items():
        vs = by_file.get((pname, rel), [])
        if k < len(vs) and vs[k].offset != off:
            raise RefusedError(f"git apply placed {pname} {rel} hunk {k} at offset {off}, the matcher at "
                               f"{vs[k].offset}", "report this; nothing was written")
    if strict_hashes and series.manifest and not force:
        key = "upstream_sha256" if reverse else "patched_sha256"
        for rel, h in series.manifest_files().items():
            if rel in ga.final and sha256_bytes(ga.final[rel]) != h.get(key):
                raise RefusedError(f"the result for {rel} does not match the hash in {series.dir}/manifest.json",
                                   "regenerate the series with tools/export.py")
    return chk, ga


def apply_series(tree: UpstreamTree, series: Series, *, check: bool = False, reverse: bool = False,
                 force: bool = False, commit: bool = False, say: Callable[[str], None] = print) -> ApplyOutcome:
    msg = recover(tree.package_parent)
    if msg:
        say(msg)
    if commit and (reverse or tree.kind != "git"):
        raise UsageError("--commit needs a git checkout and cannot be combined with --reverse",
                         "drop --commit, or run it on an SGLang git checkout")
    if not series.patches:
        raise UsageError(f"{series.dir}/series lists no patches", "regenerate the series with tools/export.py")
    state = tree.state(series)
    if state == ("upstream" if reverse else "patched"):
        what = "not applied; nothing to reverse" if reverse else "already applied"
        say(f"{series.name}: {what} ({tree.describe()})")
        return ApplyOutcome("not applied" if reverse else "already applied")
    if series.manifest:
        key = "patched_sha256" if reverse else "upstream_sha256"
        edited = [rel for rel, h in series.manifest_files().items() if tree.sha256(rel) != h.get(key)]
        if edited and not force:
            other = "upstream_sha256" if reverse else "patched_sha256"
            partial = [r for r in edited if tree.sha256(r) == series.manifest_files()[r].get(other)]
            if partial and len(partial) == len(edited):
                raise RefusedError(f"the tree is partly patched: {', '.join(partial)} "
                                   f"{'are' if len(partial) > 1 else 'is'} {'upstream' if reverse else 'patched'}"
                                   " but other target files are not",
                                   "restore the upstream files (git checkout / reinstall sglang) and apply again")
            raise RefusedError("local edits: " + ", ".join(str(tree.path(r)) for r in edited)
                               + f" differ{'s' if len(edited) == 1 else ''} from the "
                               + ("patched" if reverse else "upstream") + f" sglang {series.release} recorded in "
                               f"{series.dir.name}/manifest.json",
                               "restore the file(s) or pass --force to apply anyway (still zero fuzz)")
    try:
        chk, ga = plan_series(tree, series, series.patches, reverse, force)
    except RefusedError:
        chk = check_series(tree.read, series.patches, series, reverse=reverse)
        if chk.all_already_applied:
            say(f"{series.name}: {'not applied; nothing to reverse' if reverse else 'already applied'}")
            return ApplyOutcome("not applied" if reverse else "already applied", chk)
        for ln in _fmt_verdicts(chk, series.patches, reverse):
            say(ln)
        raise
    changes = chk.changed()
    if check:
        for ln in _fmt_verdicts(chk, series.patches, reverse):
            say(ln)
        say(f"check: {series.name} {'reverses' if reverse else 'applies'} cleanly to {tree.describe()}; "
            f"{len(changes)} file(s) would change; nothing written")
        return ApplyOutcome("checked", chk, changes)
    branch = None
    if commit:
        commits = prepare_commits(tree, series, ga, force=force)
    commit_changes(tree.package_parent, changes)
    if commit:
        branch = publish_commits(tree, series, commits, changes)
    offs = [v for v in chk.verdicts if v.offset]
    say(f"{'reversed' if reverse else 'applied'} {series.name}: {len(series.patches)} patch(es), "
        f"{len(chk.verdicts)} hunk(s)" + (f", {len(offs)} at an offset" if offs else "")
        + f", {len(changes)} file(s) changed in {tree.package_parent}")
    if branch:
        say(f"committed {len(series.patches)} patch(es) on branch {branch}")
    return ApplyOutcome("applied", chk, changes, branch=branch)


# ------------------------------------------------------------------------------------------
# --commit: one commit per patch on eaglepatch/sglang-<release>, message = the patch header

def header_to_message(header: str) -> str:
    """Patch header -> commit message: the Subject value as first line, the other fields as body."""
    lines = header.splitlines(keepends=True)
    subj = next((i for i, ln in enumerate(lines) if ln.startswith("Subject:")), None)
    if subj is None:
        return header
    first = lines[subj][len("Subject:"):].strip()
    rest = "".join(lines[:subj] + lines[subj + 1:])
    return first + "\n" + ("\n" + rest if rest else "")


def _repo(tree: UpstreamTree):
    import git
    try:
        return git.Repo(tree.root)
    except Exception:
        raise UsageError(f"{tree.root} is not a git repository", "drop --commit or run git init there") from None


def _identity_env(repo) -> dict:
    env = {}
    for var, key, dflt in (("NAME", "user.name", "eaglepatch"), ("EMAIL", "user.email", "eaglepatch@localhost")):
        try:
            repo.git.config(key)
        except Exception:
            env[f"GIT_AUTHOR_{var}"] = env[f"GIT_COMMITTER_{var}"] = dflt
    return env


@dataclass
class PreparedCommits:
    branch: str
    shas: list
    prefix: str
    env: dict


def prepare_commits(tree: UpstreamTree, series: Series, ga: GitApplyResult, force: bool = False) -> PreparedCommits:
    """Create the commits (objects only; no ref, index or working file is touched)."""
    repo = _repo(tree)
    wt = Path(repo.working_tree_dir).resolve()
    prefix = os.path.relpath(tree.package_parent, wt).replace(os.sep, "/")
    prefix = "" if prefix == "." else prefix + "/"
    paths = [prefix + rel for rel in ga.final]
    dirty = repo.git.status("--porcelain", "--untracked-files=no", "--", *paths)
    if dirty.strip():
        raise RefusedError("uncommitted changes in " + ", ".join(ln[3:] for ln in dirty.splitlines()),
                           "commit or stash them before apply --commit")
    branch = f"eaglepatch/sglang-{series.release}"
    if branch in [h.name for h in repo.heads] and not force:
        raise RefusedError(f"branch {branch} already exists", "delete it (git branch -D) or pass --force")
    env = _identity_env(repo)
    shas = []
    with tempfile.TemporaryDirectory(prefix="eaglepatch-index-") as td:
        ienv = dict(env, GIT_INDEX_FILE=str(Path(td) / "index"))
        g = repo.git
        g.execute(["git", "read-tree", "HEAD"], env=ienv)
        parent = repo.head.commit.hexsha
        prev = {rel: None for rel in ga.final}
        base = dict(ga.final)
        for rel in base:
            prev[rel] = (tree.package_parent / rel).read_bytes() if (tree.package_parent / rel).exists() else None
        for p, snap in zip(series.patches, ga.snapshots):
            for rel, data in snap.items():
                if data == prev.get(rel):
                    continue
                if data is None:
                    g.execute(["git", "update-index", "--force-remove", "--", prefix + rel], env=ienv)
                else:
                    f = Path(td) / "blob"
                    f.write_bytes(data)
                    sha = g.execute(["git", "hash-object", "-w", "--no-filters", str(f)], env=ienv).strip()
                    mode = "100755" if (tree.package_parent / rel).exists() and \
                        os.access(tree.package_parent / rel, os.X_OK) else "100644"
                    g.execute(["git", "update-index", "--add", "--cacheinfo", f"{mode},{sha},{prefix + rel}"],
                              env=ienv)
            prev = snap
            treesha = g.execute(["git", "write-tree"], env=ienv).strip()
            mf = Path(td) / "msg"
            mf.write_bytes(header_to_message(p.header).encode("utf-8"))
            parent = g.execute(["git", "commit-tree", treesha, "-p", parent, "-F", str(mf)], env=ienv).strip()
            shas.append(parent)
    return PreparedCommits(branch, shas, prefix, env)


def publish_commits(tree: UpstreamTree, series: Series, pc: PreparedCommits, changes: dict) -> str:
    """Point the branch at the last commit, check it out (HEAD + index of the changed paths)."""
    repo = _repo(tree)
    g = repo.git
    g.execute(["git", "update-ref", f"refs/heads/{pc.branch}", pc.shas[-1]])
    g.execute(["git", "symbolic-ref", "HEAD", f"refs/heads/{pc.branch}"])
    if changes:
        g.execute(["git", "update-index", "--add", "--remove", "--"] + [pc.prefix + r for r in sorted(changes)])
    return pc.branch
