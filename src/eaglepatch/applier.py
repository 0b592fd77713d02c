"""Zero-fuzz apply of a series (`git apply` is the ground truth), all or nothing.

Every result is computed first, in memory and by `git apply` in a scratch directory outside any
git repository, and the two must agree on every offset. The tree is then changed as one
transaction (`eaglepatch.txn`: preflight, staging beside each target, a commit point, renames),
under the tree's lock (`eaglepatch.lock`); `--commit` is part of the same transaction
(`eaglepatch.commit`). Write runs first finish or undo a transaction an interrupted run left;
`--check` writes nothing and refuses while one is pending.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .commit import after_reverse_hint, branch_exists, committed, fetched_checkout, prepare_commit, uncommitted
from .errors import RefusedError, UsageError
from . import gitcmd
from .gitcmd import clean_env, require_git
from .fetch import make_git_checkout
from .interrupts import stop_point
from .lock import tree_lock
from .outputs import can_write, move_new_checkout, scratch_dir
from .series import Patch, Series, sha256_bytes
from .tree import UpstreamTree
from .txn import Transaction, describe_pending, recover, refuse_if_pending
from .verdicts import ANCHOR_DRIFT, SeriesCheck, check_series

HUNK_RE = re.compile(r"^Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))?\.", re.M)
CHECKING_RE = re.compile(r"^Checking patch (.+?)\.\.\.$", re.M)


# ------------------------------------------------------------------------------------------
# git apply, the ground truth

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
    require_git()
    res = GitApplyResult()
    tmp = scratch_dir("eaglepatch-apply-")
    try:
        pp = tmp / "pp"
        pp.mkdir()
        for rel, data in originals.items():
            if data is not None:
                (pp / rel).parent.mkdir(parents=True, exist_ok=True)
                (pp / rel).write_bytes(data)
        env = clean_env(ceiling=tmp.parent)
        order = list(reversed(patches)) if reverse else list(patches)
        for i, p in enumerate(order):
            pf = tmp / f"{i:04d}.diff"
            pf.write_bytes(p.body)
            r = gitcmd.run(["apply", "-v", "--whitespace=nowarn"] + (["-R"] if reverse else []) + [str(pf)], pp,
                           env=env, check=False)
            out = (r.stdout + r.stderr).decode("utf-8", "replace")
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
    except OSError as exc:
        raise RefusedError(f"cannot write the scratch copy for git apply: {exc.strerror}",
                           "free space in the temp dir (TMPDIR) and run again; nothing was changed") from None
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
                force: bool = False, strict_hashes: bool = True,
                chk: SeriesCheck | None = None) -> tuple[SeriesCheck, GitApplyResult]:
    """Check (unless `chk` is that check) and compute the result of `patches` on `tree`; raise
    RefusedError when it cannot apply."""
    chk = chk or check_series(tree.read, patches, series, reverse=reverse)
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


def edit_causes(tree: UpstreamTree, series: Series, reverse: bool) -> dict:
    """Target files that are not what the series expects before it runs: rel -> cause
    ('missing' | 'crlf' | 'edited' | 'other side', the last = already in the state it leads to)."""
    key, other = ("patched_sha256", "upstream_sha256") if reverse else ("upstream_sha256", "patched_sha256")
    out = {}
    for rel, h in series.manifest_files().items():
        data = tree.read(rel)
        cur = sha256_bytes(data)
        if cur == h.get(key):
            continue
        if cur == h.get(other):
            out[rel] = "other side"
        elif data is None:
            out[rel] = "missing"
        elif b"\r\n" in data and sha256_bytes(data.replace(b"\r\n", b"\n")) in (h.get(key), h.get(other)):
            out[rel] = "crlf"
        else:
            out[rel] = "edited"
    return out


def _refuse_other_release(tree: UpstreamTree, series: Series) -> None:
    """A series made for another release than the tree's (a wrong --series) is said as such, not
    as local edits or missing files. The tree's release: its version source, else the series whose
    manifest its files match (patched or not)."""
    from .series import available_series, load_series

    have = available_series()
    release, source = tree.release, tree.release_source
    if release is None:
        for rel, d in have.items():
            if rel == series.release:
                continue
            try:
                other = load_series(d)
            except UsageError:
                continue
            if other.manifest and tree.state(other) in ("upstream", "patched"):
                release, source = rel, f"the hashes in {d.name}/manifest.json"
                break
    if release is None or not series.release or release == series.release:
        return
    own = have.get(release)
    fix = (f"use --series {_shown(own)} (or drop --series)" if own is not None
           else f"drop --series to be told the nearest series and how to port it (no series for sglang {release})")
    raise UsageError(f"this tree is sglang {release} (from {source}) but --series {_shown(series.dir)} "
                     f"is the series for sglang {series.release}", fix)


def _shown(path: Path) -> str:
    """`path` relative to the current directory when it is under it."""
    try:
        return os.path.relpath(path) if not os.path.relpath(path).startswith("..") else str(path)
    except ValueError:
        return str(path)


def _refuse_edits(tree: UpstreamTree, series: Series, reverse: bool, force: bool) -> None:
    causes = edit_causes(tree, series, reverse)
    if not causes:
        return
    if not force:
        _refuse_other_release(tree, series)
    side = "patched" if reverse else "upstream"
    broken = {r: c for r, c in causes.items() if c in ("missing", "crlf")}
    if broken:  # no --force can help: zero fuzz never matches a missing or CRLF file
        what = {"missing": "is missing", "crlf": "has CRLF (Windows) line endings"}
        fixes = []
        if "missing" in broken.values():
            fixes.append("restore missing files (git checkout -- FILE, or reinstall sglang)")
        if "crlf" in broken.values():
            fixes.append("convert CRLF files back to LF (dos2unix FILE, or git config core.autocrlf false and "
                         "check them out again)")
        raise RefusedError(", ".join(f"{tree.path(r)} {what[c]}" for r, c in broken.items())
                           + f" (the series expects the {side} sglang {series.release} file)",
                           " and ".join(fixes) + ", then run again")
    if force:
        return
    if all(c == "other side" for c in causes.values()):
        partial = list(causes)
        raise RefusedError(f"the tree is partly patched: {', '.join(partial)} "
                           f"{'are' if len(partial) > 1 else 'is'} {'upstream' if reverse else 'patched'}"
                           " but other target files are not",
                           "restore the upstream files (git checkout / reinstall sglang) and apply again")
    edited = list(causes)
    raise RefusedError("local edits: " + ", ".join(str(tree.path(r)) for r in edited)
                       + f" differ{'s' if len(edited) == 1 else ''} from the {side} sglang {series.release} "
                       f"recorded in {series.dir.name}/manifest.json",
                       "restore the file(s) or pass --force to apply anyway (still zero fuzz)")


def _reverse_hint(tree: UpstreamTree, series: Series) -> str | None:
    """What to do after --reverse in a git checkout that has the series committed (None: nothing);
    a git problem here only loses the hint, never the reverse's success."""
    if tree.kind != "git":
        return None
    try:
        return after_reverse_hint(tree, series)
    except (RefusedError, UsageError):
        return None


def _already(tree: UpstreamTree, series: Series, reverse: bool, commit: bool, say, chk=None) -> ApplyOutcome:
    if reverse:
        say(f"{series.name}: not applied; nothing to reverse ({tree.describe()})")
        hint = _reverse_hint(tree, series)
        if hint:
            say(hint)
        return ApplyOutcome("not applied", chk)
    if commit:
        branch = committed(tree, series)
        if branch is None:
            raise RefusedError(f"{series.name} is already applied in {tree.root} but not committed",
                               f"reverse it (tools/apply.py {tree.root} --reverse), then run apply --commit again")
        say(f"{series.name}: already applied and committed on {branch} ({tree.describe()})")
        return ApplyOutcome("already applied", chk, branch=branch)
    say(f"{series.name}: already applied ({tree.describe()})")
    return ApplyOutcome("already applied", chk)


def apply_series(tree: UpstreamTree, series: Series, *, check: bool = False, reverse: bool = False,
                 force: bool = False, commit: bool = False, say: Callable[[str], None] = print,
                 command: str | None = None) -> ApplyOutcome:
    """Apply (or with reverse=True remove) `series` on `tree` under the tree's lock.
    `command` is what a later run names to finish an interrupted transaction."""
    if commit and reverse:
        raise UsageError("--commit cannot be combined with --reverse (the patched branch is left as it is; "
                         "--reverse restores the files)", "drop --commit, or --reverse")
    if commit and tree.kind != "git":
        top = tree.root.parent
        inside = tree.root.name == "python" and (top / ".git").exists()  # ROOT/python of a checkout
        raise UsageError(f"--commit needs a git checkout, and {tree.root} holds sglang/ as a site-packages "
                         f"directory does{f' (it is the python/ directory of the checkout {top})' if inside else ''}",
                         f"run it on the checkout's root: python3 tools/apply.py {shlex.quote(str(top))} --commit"
                         if inside else "drop --commit, or run it on an SGLang git checkout")
    series.require_patches()
    require_git()
    with tree_lock(tree.package_parent):
        return _apply_locked(tree, series, check, reverse, force, commit, say,
                             command or f"python3 tools/apply.py {tree.root}" + (" --reverse" if reverse else "")
                             + (" --commit" if commit else "") + (" --force" if force else ""))


def _apply_locked(tree, series, check, reverse, force, commit, say, command) -> ApplyOutcome:
    pp = tree.package_parent
    if check:
        refuse_if_pending(pp, "apply --check")
    else:
        msg = recover(pp)
        if msg:
            say(msg)
    with tree.reads_once():  # the state, the edit check and the hunk check share one read of each file
        if tree.state(series) == ("upstream" if reverse else "patched"):
            return _already(tree, series, reverse, commit, say)
        if series.manifest:
            _refuse_edits(tree, series, reverse, force)
        chk = check_series(tree.read, series.patches, series, reverse=reverse)
        try:
            chk, ga = plan_series(tree, series, series.patches, reverse, force, chk=chk)
        except RefusedError:
            if chk.all_already_applied:
                return _already(tree, series, reverse, commit, say, chk)
            for ln in _fmt_verdicts(chk, series.patches, reverse):
                say(ln)
            raise
    changes = chk.changed()
    if check:
        for ln in _fmt_verdicts(chk, series.patches, reverse):
            say(ln)
        try:  # what apply would refuse before writing (unwritable directories, space, inodes), without writing
            Transaction(pp, changes, command).preflight()
        except RefusedError as exc:
            raise RefusedError(f"{series.name} {'reverses' if reverse else 'applies'} cleanly to {tree.describe()}, "
                               f"but apply would refuse: {exc.problem}", exc.fix) from None
        say(f"check: {series.name} {'reverses' if reverse else 'applies'} cleanly to {tree.describe()}; "
            f"{len(changes)} file(s) would change; nothing written")
        return ApplyOutcome("checked", chk, changes)
    txn = Transaction(pp, changes, command)
    cp = None
    if commit:
        cp = prepare_commit(tree, series, chk.originals, ga.snapshots, changes, force=force)
        txn.git = cp.txn_info()
        txn.add(":git index", cp.index, cp.index_path)
    txn.run(cp.create_branch if cp else None)
    offs = [v for v in chk.verdicts if v.offset]
    say(f"{'reversed' if reverse else 'applied'} {series.name}: {len(series.patches)} patch(es), "
        f"{len(chk.verdicts)} hunk(s)" + (f", {len(offs)} at an offset" if offs else "")
        + f", {len(changes)} file(s) changed in {tree.package_parent}")
    if cp:
        say(f"committed {len(series.patches)} patch(es) on branch {cp.branch}")
        if cp.old and cp.old != cp.new:
            print(f"note: replaced branch {cp.branch}, which was at {cp.old} (get it back with: "
                  f"git -C {shlex.quote(str(cp.root))} branch {cp.branch}-old {cp.old})", file=sys.stderr, flush=True)
    hint = _reverse_hint(tree, series) if reverse else None
    if hint:
        say(hint)
    return ApplyOutcome("applied", chk, changes, branch=cp.branch if cp else None)


# ------------------------------------------------------------------------------------------
# apply --fetch: a new patched checkout, made in a temporary directory and renamed into place

FETCH_TMP = ".eaglepatch-fetch-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _remove_stale_fetches(parent: Path, name: str) -> None:
    """Temporary checkouts that killed `--fetch` runs left beside DEST."""
    for p in parent.glob(f".{glob.escape(name)}{FETCH_TMP}*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _fetched_already(dest: Path, series: Series) -> UpstreamTree | None:
    try:
        tree = UpstreamTree.open(dest, {series.release: series})
        if tree.kind == "git" and tree.release == series.release and tree.state(series) == "patched" \
                and committed(tree, series):
            return tree
    except (UsageError, RefusedError):
        pass
    return None


def _fetched_then_reversed(dest: Path, series: Series) -> UpstreamTree | None:
    """`dest` when it is a checkout `--fetch` made for the series' release that holds that release
    without the series now (reversed, then put back at the release or the removal committed, as
    `--reverse` says), or that an interrupted run of this left a transaction in (the apply finishes
    or undoes it first); None otherwise."""
    try:
        tree = UpstreamTree.open(dest, {series.release: series})
        if tree.kind != "git" or tree.release != series.release or not fetched_checkout(tree, series):
            return None
        if describe_pending(tree.package_parent) is not None or tree.state(series) == "upstream":
            return tree
    except (UsageError, RefusedError):
        pass
    return None


def fetch_and_apply(release: str, dest: Path | str, series: Series, say: Callable[[str], None] = print,
                    command: str | None = None) -> UpstreamTree:
    """Fetch `release` into a new git checkout at `dest` and apply `series` there with --commit.
    The checkout is made and patched in `.<dest>.eaglepatch-fetch-<pid>` beside `dest`, then
    renamed: a killed run leaves no `dest` (and its leftover is removed by the next run); a
    `dest` that a finished run made is accepted as already fetched, and one whose series was
    reversed since is patched again there: in the work tree only when HEAD still has the series
    committed (the reverse undone), else with `--commit` (replacing the series branch it left)."""
    dest = Path(os.path.expanduser(str(dest))).absolute()
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"DEST {dest} is a file", "pass a new directory as DEST")
    if dest.is_dir() and any(dest.iterdir()):
        tree = _fetched_already(dest, series)
        if tree is not None:
            say(f"{series.name}: already fetched, applied and committed ({tree.describe()})")
            return tree
        tree = _fetched_then_reversed(dest, series)
        if tree is None:
            raise UsageError(f"{dest} already exists and is not empty", "pass a new directory as DEST")
        say(f"{dest} is the checkout --fetch made, without {series.name} now: applying it again there")
        if describe_pending(tree.package_parent) is not None:  # this, interrupted: finished or undone first
            require_git()
            with tree_lock(tree.package_parent):
                msg = recover(tree.package_parent)
            if msg:
                say(msg)
            done = _fetched_already(dest, series)
            if done is not None:
                return done
        if uncommitted(tree, series):  # reversed in the work tree only: HEAD has the series committed
            apply_series(tree, series, say=say, command=command)
        else:  # put back at the release, or the removal committed
            apply_series(tree, series, commit=True, force=branch_exists(tree, series), say=say, command=command)
        return UpstreamTree.open(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {dest.parent}: {exc.strerror}", "pass a DEST in a writable directory") \
            from None
    if not can_write(dest.parent):
        raise UsageError(f"cannot write in {dest.parent}", "pass a DEST in a writable directory")
    _remove_stale_fetches(dest.parent, dest.name)
    tmp = dest.parent / f".{dest.name}{FETCH_TMP}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    messages: list = []
    try:
        make_git_checkout(release, tmp)
        stop_point("fetch-cloned")
        apply_series(UpstreamTree.open(tmp), series, commit=True, say=messages.append, command=command)
        stop_point("fetch-patched")
        try:
            move_new_checkout(tmp, dest, "pass a new directory as DEST")
        except UsageError:
            if not dest.is_dir():
                raise
            # another run (a second --fetch into this DEST) renamed its checkout in first
            done = _fetched_already(dest, series)
            if done is None:
                raise UsageError(f"{dest} was made by another process while this run fetched sglang {release} (it "
                                 f"is not the patched checkout --fetch makes)", "pass a new directory as DEST") \
                    from None
            shutil.rmtree(tmp, ignore_errors=True)
            say(f"{series.name}: another --fetch made {dest} while this one ran: already fetched, applied and "
                f"committed ({done.describe()}); this run's copy is removed")
            return done
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stop_point("fetch-renamed")
    for m in messages:
        say(m.replace(str(tmp), str(dest)))
    return UpstreamTree.open(dest)
