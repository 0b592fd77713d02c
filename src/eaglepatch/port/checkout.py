"""`tools/port.py --checkout DIR` and `--continue DIR`: the port done in a git checkout of the new
release, one patch at a time, the way `git rebase` replays commits.

The checkout is the release as `apply --fetch` makes it (one commit tagged v<release>), on
branch `eaglepatch/sglang-<release>`. Each patch of the old series, in order, is merged onto the
checkout's files by the port's own stages (Drop-When, the 3-way merge per hunk, relocation, the
package generated for the new release). A patch that merges is committed, its header the commit
message (Last-Update: the port's date). At the first patch that conflicts the port stops: its
hunks that merge are applied, each conflicting hunk is marked in place with the three sides of
its `git merge-file` (`<<<<<<< old patched`, `||||||| old upstream`, `=======`,
`>>>>>>> new upstream`), or, where no merge can mark it, the file's diff is left beside it as
`FILE.rej`; all of it uncommitted. `--continue` refuses while a marker or `.rej` is left,
commits the resolution with the patch's header and ports the rest onto the resolved files. When
every patch is committed, `tools/export.py DIR --base v<release>` writes the new series; the
capture semantics it records come from the port (`eaglepatch.portstate`).
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import gitcmd
from ..commit import BUSY
from ..errors import RefusedError, UsageError
from ..fetch import make_git_checkout, unpacked_release
from ..gitcmd import GIT_ID
from ..outputs import move_new_checkout
from ..lock import tree_lock
from .. import portstate
from ..series import Series, header_to_message, load_series, tool_command
from ..tree import UpstreamTree, read_target
from .drop import drop_by_drop_when, patch_outcome
from .fetch import check_base
from .merge import Trees, apply_file, merge_patch
from .result import CONFLICT, LABELS, PortResult
from .semantics import DEEPSEEK, declared_semantics, detect_capture_semantics, record_semantics
from .write import ported_header

MARKERS = (b"<<<<<<< " + LABELS[0].encode(), b"||||||| " + LABELS[1].encode(), b">>>>>>> " + LABELS[2].encode())
TMP = ".eaglepatch-port-"
EXCLUDE = b"# eaglepatch port: what running the tree leaves is no part of the series\n__pycache__/\n*.pyc\n*.orig\n"


@dataclass
class Stop:
    """Where a checkout port stands after a step."""
    root: Path
    state: dict
    conflicts: list = field(default_factory=list)  # (path shown, [marker lines], [what conflicts there])

    @property
    def done(self) -> bool:
        return bool(self.state.get("done"))


def branch_for(release: str) -> str:
    return f"eaglepatch/sglang-{release}"


@functools.lru_cache(maxsize=8)
def _env(root: Path) -> dict:
    """git's environment in the checkout: the user's identity where git has one, else eaglepatch's."""
    env = gitcmd.clean_env(ceiling=root.parent)
    for var, key in (("NAME", "user.name"), ("EMAIL", "user.email")):
        if gitcmd.run(["config", key], root, env=env, check=False).returncode != 0:
            env[f"GIT_AUTHOR_{var}"] = env[f"GIT_COMMITTER_{var}"] = GIT_ID[f"GIT_AUTHOR_{var}"]
    return env


def _git(root: Path, *args, input: bytes | None = None, check: bool = True):
    return gitcmd.run(list(args), root, env=dict(_env(root)), check=check, input=input)


def _out(root: Path, *args) -> str:
    return _git(root, *args).stdout.decode("utf-8", "replace").strip()


def _series_sums(old: Series) -> dict:
    return {p.name: p.sha256 for p in old.patches + old.smoke}


def _old_reader(st: dict):
    if st.get("from_tree"):
        return UpstreamTree.open(st["from_tree"]).read, Path(st["from_tree"])
    pp = unpacked_release(st["from"])
    return UpstreamTree("installed", pp, pp, st["from"], "dist-info").read, pp


def start(old: Series, old_tree: UpstreamTree, from_rel: str, to_rel: str, dest: Path, out: Path,
          from_tree: Path | None = None, date: str | None = None, restart: str = "",
          say: Callable[[str], None] = print, series_version: str | None = None) -> Stop:
    """A new checkout of sglang `to_rel` at `dest` with `old` (made for `old_tree`, sglang
    `from_rel`; `from_tree`: that tree when it is a local one) ported as far as it merges. The
    checkout is made in a directory beside `dest` and renamed into place: a failed run leaves no
    `dest`."""
    dest = Path(os.path.expanduser(str(dest))).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists" + ("" if dest.is_dir() else " and is a file"),
                         "pass --checkout a new directory (or continue a port there: --continue DIR)")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {dest.parent}: {exc.strerror}", "pass --checkout a writable place") \
            from None
    check_base(old, old_tree.read, from_rel)  # before any download or checkout
    unpacked_release(to_rel)  # the download, with its progress, before the checkout
    tmp = dest.parent / f".{dest.name}{TMP}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"port: making a git checkout of sglang {to_rel} in {dest} (branch {branch_for(to_rel)} on tag v{to_rel})")
    try:
        make_git_checkout(to_rel, tmp)  # progress on stderr (the first build of a release takes a while)
        _git(tmp, "checkout", "-q", "-b", branch_for(to_rel))
        info = Path(_out(tmp, "rev-parse", "--git-path", "info"))
        info = info if info.is_absolute() else tmp / info
        info.mkdir(parents=True, exist_ok=True)
        with open(info / "exclude", "ab") as f:
            f.write(EXCLUDE)
        st = {"format": portstate.FORMAT, "from": from_rel, "to": to_rel, "series": str(old.dir.resolve()),
              "series_sha256": _series_sums(old),
              "from_tree": str(Path(from_tree).resolve()) if from_tree is not None else None,
              "date": date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
              "series_version": series_version or f"{to_rel}-1", "out": str(Path(os.path.expanduser(str(out))).absolute()),
              "branch": branch_for(to_rel), "next": 0, "stopped": None, "done": False,
              "restart": restart}
        portstate.save(tmp, st)
        with tree_lock(old_tree.package_parent):
            stop = _advance(tmp, st, old, old_tree.read, say, shown=dest)
        move_new_checkout(tmp, dest, "pass --checkout a new directory")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stop.root = dest
    return stop


def resume(root: Path, say: Callable[[str], None] = print) -> Stop:
    """`--continue`: commit the resolution of the patch the port stopped at, then port the rest."""
    root = Path(os.path.expanduser(str(root))).absolute()
    if not root.is_dir():
        raise UsageError(f"{root} does not exist", "pass --continue the checkout that port.py --checkout made")
    st = portstate.load(root)
    if st is None:
        raise UsageError(f"{root} holds no port made by tools/port.py --checkout",
                         "pass --continue the checkout that port.py --checkout made")
    if st.get("done"):
        say(f"port: nothing to continue in {root}: every patch is committed")
        return Stop(root, st)
    old = load_series(st["series"])
    if _series_sums(old) != st.get("series_sha256"):
        raise RefusedError(f"the series {st['series']} changed since the port in {root} started",
                           "restore it (git checkout patches/), or delete the checkout and port again")
    old_read, old_pp = _old_reader(st)
    with tree_lock(root / "python"), tree_lock(old_pp):
        _check_idle(root)
        on = _git(root, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.decode().strip()
        if on != st["branch"]:
            raise RefusedError(f"{root} is on {on or 'a detached HEAD'}, not on the port's branch {st['branch']}",
                               f"switch back (git -C {shlex.quote(str(root))} checkout {st['branch']}) and run "
                               "--continue again")
        stopped = st.get("stopped")
        if stopped:
            _finish_stopped(root, st, old, stopped, say)
        elif _dirty(root):  # a port killed while it wrote a patch: its files are half written
            raise RefusedError(f"uncommitted changes in {root}, and the port did not stop at a conflict there",
                               f"discard them (git -C {shlex.quote(str(root))} reset -q --hard) and run --continue "
                               "again")
        return _advance(root, st, old, old_read, say, shown=root)


def _check_idle(root: Path) -> None:
    for name, what, how in BUSY:
        p = Path(_out(root, "rev-parse", "--git-path", name))
        if (p if p.is_absolute() else root / p).exists():
            raise RefusedError(f"{what} is in progress in {root}", f"finish or abort it first ({how})")


def _dirty(root: Path) -> list[str]:
    """Paths (relative to the work tree) with uncommitted changes, untracked files included."""
    text = _git(root, "status", "--porcelain", "-z", "--untracked-files=all").stdout.decode("utf-8", "replace")
    out, items = [], text.split("\0")
    i = 0
    while i < len(items):
        it = items[i]
        if it:
            out.append(it[3:])
            if it[0] in "RC":  # a rename names its source next
                i += 1
        i += 1
    return out


def _marker_lines(root: Path, paths) -> list[tuple[str, int, bytes]]:
    found = []
    for rel in paths:
        p = root / rel
        try:
            data = p.read_bytes() if p.is_file() else b""
        except OSError:
            continue
        for n, ln in enumerate(data.split(b"\n"), 1):
            if ln.startswith(MARKERS):
                found.append((rel, n, ln))
    return found


def markers_in(root: Path, paths) -> list[tuple[str, int]]:
    """(path, line) of each conflict marker the port writes that is still in one of `paths`."""
    return [(rel, n) for rel, n, _ in _marker_lines(root, paths)]


def _finish_stopped(root: Path, st: dict, old: Series, stopped: dict, say) -> None:
    dirty = _dirty(root)
    left = markers_in(root, dirty)
    if left:
        by: dict = {}
        for rel, n in left:
            by.setdefault(rel, []).append(str(n))
        where = "; ".join(f"{root / rel} line{'s' if len(ns) > 1 else ''} {', '.join(ns)}" for rel, ns in by.items())
        raise RefusedError(f"conflict markers are left: {where}",
                           "resolve each conflict (keep what the new upstream side does and make the change the "
                           "old patched side makes to the old upstream side), delete the markers, and run "
                           "--continue again")
    rej = [r for r in stopped.get("rejects", []) if (root / r).exists()]
    if rej:
        raise RefusedError(f"{', '.join(str(root / r) for r in rej)} still there",
                           "make the change it holds by hand, delete it, and run --continue again")
    head = _out(root, "rev-parse", "HEAD")
    patch = next(p for p in old.patches + old.smoke if p.name == stopped["patch"])
    if head != stopped["head"]:
        if dirty:
            raise RefusedError(f"HEAD moved in {root} since the port stopped at {patch.name}, and there are "
                               "uncommitted changes", "commit them too (git commit -a), then run --continue again")
        say(f"port: {patch.name}: kept the commit(s) you made as its resolution (their message is its header)")
    elif not dirty:
        say(f"port: {patch.name}: dropped (the resolution leaves nothing of it)")
    else:
        _commit(root, patch, st["date"], None)
        say(f"port: committed {patch.name} (resolved)")
    st["next"] = stopped["index"] + 1
    st["stopped"] = None
    portstate.save(root, st)


def _commit(root: Path, patch, date: str, created: dict | None) -> None:
    _git(root, "add", "-A", "--", "python")
    msg = header_to_message(ported_header(patch, date, created))
    _git(root, "commit", "-q", "--no-verify", "--no-gpg-sign", "--cleanup=verbatim", "-F", "-",
         input=msg.encode("utf-8"))


def _write(pp: Path, rel: str, data: bytes | None) -> None:
    p = pp / rel
    try:
        if data is None:
            if p.exists():
                p.unlink()
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    except OSError as exc:
        raise RefusedError(f"cannot write {p}: {exc.strerror}", "free space and run --continue again") from None


def _advance(root: Path, st: dict, old: Series, old_read, say, shown: Path) -> Stop:
    """Port the patches from st['next'] on onto the files in `root`; commit each one that merges,
    stop at the first one that conflicts."""
    from . import created_files

    pp = root / "python"
    to_rel, version = st["to"], st["series_version"]
    stop = Stop(shown, st)
    res = PortResult(old, st["from"], to_rel)
    trees = Trees(old_read, lambda rel: read_target(pp / rel))
    tag = gitcmd.run(["cat-file", "blob", f"v{to_rel}:python/{DEEPSEEK}"], root, env=_env(root), check=False)
    up_new = detect_capture_semantics(tag.stdout if tag.returncode == 0 else None)
    trees.created = created_files(res, up_new, to_rel, version)
    smoke = set(p.name for p in old.smoke)
    for i, patch in enumerate(old.patches + old.smoke):
        if i < st["next"] or drop_by_drop_when(res, patch, patch.name in smoke, to_rel):
            for fp in patch.files:  # the old side moves on as the old series did
                trees.old_state[fp.path] = apply_file(trees.old(fp.path), fp)
            if i >= st["next"]:
                say(f"port: dropped {patch.name}: {res.patches[-1].reason}")
            continue
        before = len(res.hunks)
        conflicted, changed = merge_patch(res, trees, patch, to_rel, version)
        outcome = patch_outcome(patch, conflicted, changed)
        hunks = res.hunks[before:]
        if outcome.status == "dropped":
            say(f"port: dropped {patch.name}: {outcome.reason}")
        elif outcome.status == "ported":
            for fp in patch.files:
                _write(pp, fp.path, trees.new_state[fp.path])
            _commit(root, patch, st["date"], trees.created)
            say(f"port: committed {patch.name}" + _counts(hunks))
            for h in hunks:
                if h.review:
                    say(f"  review: {h.file} hunk {h.index}: {h.review}")
        else:
            _stop_at(root, st, patch, i, trees, hunks, stop, say)
            return stop
        st["next"] = i + 1
        portstate.save(root, st)
    trees.new(DEEPSEEK)  # the ported file as committed, for the semantics of the new series
    record_semantics(res, (old.manifest or {}).get("capture_semantics"), old_read, trees, up_new,
                     declared_semantics(old, to_rel))
    st.update(done=True, capture_semantics=res.semantics, notes=res.notes)
    portstate.save(root, st)
    for n in res.notes:
        say(f"  note: {n}")
    return stop


def _counts(hunks) -> str:
    kinds = {}
    for h in hunks:
        kinds[h.status] = kinds.get(h.status, 0) + 1
    return f" ({', '.join(f'{n} {k}' for k, n in kinds.items())})" if kinds else ""


def _stop_at(root: Path, st: dict, patch, i: int, trees: Trees, hunks, stop: Stop, say) -> None:
    pp = root / "python"
    rejects = []
    for fp in patch.files:
        if fp.path in trees.marked:
            _write(pp, fp.path, trees.marked[fp.path])
        elif fp.path in trees.rejects:
            rel = f"python/{fp.path}.rej"
            _write(root, rel, trees.rejects[fp.path])
            rejects.append(rel)
        elif fp.path in trees.new_state:
            _write(pp, fp.path, trees.new_state[fp.path])
    st["stopped"] = {"patch": patch.name, "index": i, "head": _out(root, "rev-parse", "HEAD"), "rejects": rejects}
    portstate.save(root, st)
    for fp in patch.files:
        what = [f"hunk {h.index} [{h.anchor}] {h.detail}" for h in hunks if h.file == fp.path and h.status == CONFLICT]
        if not what:
            continue
        rel = f"python/{fp.path}"
        if f"{rel}.rej" in rejects:
            stop.conflicts.append((stop.root / f"{rel}.rej", [], what))
        else:
            starts = [n for r, n, ln in _marker_lines(root, [rel]) if ln.startswith(MARKERS[0])]
            stop.conflicts.append((stop.root / rel, starts, what))
    merged = [h for h in hunks if h.status != CONFLICT]
    say(f"port: stopped at {patch.name}: {len(hunks) - len(merged)} hunk(s) conflict"
        + (f"; its other {len(merged)} hunk(s) are applied" + _counts(merged) if merged else "")
        + ", uncommitted")


def next_steps(stop: Stop) -> list[str]:
    """What the user runs next, as lines to print (every command works from any directory)."""
    st, root = stop.state, stop.root
    if not stop.done:
        lines = []
        for path, starts, what in stop.conflicts:
            at = (f" line{'s' if len(starts) > 1 else ''} {', '.join(map(str, starts))}" if starts else "")
            lines.append(f"  {path}{at}: {'; '.join(what)}")
        return ["conflicts to resolve (uncommitted, with the hunks of the patch that merged):", *lines,
                "next:",
                f"  1. in each file above, between '<<<<<<< {LABELS[0]}' and '>>>>>>> {LABELS[2]}': keep what the "
                f"'{LABELS[2]}' side does and make the change the '{LABELS[0]}' side makes to the '{LABELS[1]}' "
                "side; delete the markers (a .rej file: make its change by hand, then delete it)",
                f"  2. {tool_command('port', '--continue', root)}",
                "     (commits the resolution with the patch's header, then ports the remaining patches)",
                f"  to start over: rm -rf {_q(root)} && {st.get('restart') or 'run the --checkout command again'}"]
    out = Path(st["out"])
    base = f"v{st['to']}"
    wt = root.parent / f"{root.name}-{base}"
    return ["next:",
            f"  1. {tool_command('export', root, '--base', base, '--out', out)}",
            f"  2. check it on an unpatched sglang {st['to']} tree (here: a worktree of the tag):",
            f"     git -C {_q(root)} worktree add --detach {_q(wt)} {base}",
            f"     {tool_command('verify', wt, '--series', out)}"]


def _q(p) -> str:
    return shlex.quote(str(p))


def commit_count(root: Path, st: dict) -> int:
    """The commits on the port's branch after the release tag."""
    return int(_out(root, "rev-list", "--count", f"v{st['to']}..HEAD") or 0)
