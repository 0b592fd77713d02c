"""Crash-safe changes to a tree: a redo log, with the new bytes staged beside each target.

Before the commit point everything that can fail is done or checked:
  1. preflight: the real path of each target (a symlinked file is written through, the link
     stays a link), its directory writable, the target itself replaceable (not immutable or
     append-only, not another user's file in a sticky directory), space and inodes on each
     filesystem;
  2. `<package parent>/.eaglepatch-txn/plan.json` (`home`: the real parent of the package, the
     same for every path naming it): every operation, written and synced first, so whatever a
     crash leaves is known. Its paths are relative to that directory (the git part: to the work
     tree git finds from it), so the plan is bound to the tree it lies in: recovery on a tree that
     was moved acts on the moved tree, on a copy on the copy only, and an entry that would leave
     the tree (an absolute path, `..`, a symbolic link on the way) is refused before anything is
     done;
  3. staging, beside each target (same directory, so same filesystem): the new bytes as
     `.<name>.eaglepatch-new`, a hard link to the original as `.<name>.eaglepatch-old`, new
     directories; for `apply --commit` also the new git index and the branch ref;
  4. READY, an atomic marker: the commit point.
After READY only renames and unlinks in directories proven writable remain:
  5. redo: each staged file renamed over its target, deleted targets unlinked, then git's HEAD
     switched to the branch; DONE marker;
  6. cleanup: the links to the originals, emptied directories and the log removed.

Recovery, by the next run that writes the tree: DONE -> cleanup; READY -> redo (idempotent);
neither -> undo (staged files, links, new directories and the branch removed). Recovery touches
only files inside the tree it runs on: a plan entry outside it (an absolute path, `..`, a link on
the way, as a change that wrote through a link out of the tree has) is refused in one line before
anything is done, the log kept (`bind_plan`). A redo that
cannot proceed (say an immutable file) is undone from the links to the originals, so the tree is
left original or changed, never between, and the failure is one line. Tools that promise to
write nothing (apply --check, verify) do not recover: `refuse_if_pending` says what is pending
and which command finishes it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import RefusedError
from .gitcmd import run as git_run
from .interrupts import completing, held_interrupts, stop_point
from .outputs import can_write
from .series import sha256_bytes

TXN = ".eaglepatch-txn"
FORMAT = 3  # 3: paths relative to the tree (2: absolute paths, still read where they lie inside the tree)
GIT_INDEX = ":git index"
NEW_SUFFIX = ".eaglepatch-new"
OLD_SUFFIX = ".eaglepatch-old"
SLACK_BYTES = 64 * 1024


@dataclass
class Op:
    """In memory every path is absolute; in plan.json `real`, `new` and `old` are relative to the
    tree (`to_disk` / `bind_plan`)."""
    path: str  # what the series names (package-parent relative), or a label such as ':git index'
    real: str  # path renamed over or unlinked (a symlinked file: the file it points to)
    new: str | None  # staged new content; None = delete `real`
    old: str | None  # link to the original; None = `real` did not exist
    sha256: str | None = None  # of the new content
    mode: int = 0o644


def _sha(path: str) -> str | None:
    """sha256 of the file at `path`; None when it cannot be read, for whatever reason."""
    try:
        return sha256_bytes(Path(path).read_bytes())
    except OSError:
        return None


def _fsync_dir(d) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_synced(path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, mode)


def _lexists(p) -> bool:
    return os.path.lexists(p)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    return str(exc)


# ------------------------------------------------------------------------------------------
# planning and preflight

def home(pp: Path | str) -> Path:
    """Where the transaction log of the tree at `pp` lives: the real parent of its package, so
    that every path naming the same package (`site/sglang` a link to `checkout/python/sglang`)
    finds the same pending change."""
    pp = Path(pp)
    real_pkg = Path(os.path.realpath(pp / "sglang"))
    return real_pkg.parent if real_pkg.is_dir() else Path(os.path.realpath(pp))


def _real_target(pp: Path, rel: str, delete: bool) -> Path:
    p = pp / rel
    fix = "replace it with a regular file (or remove it) and run again; nothing was changed"
    if p.is_symlink() and not delete:
        real = Path(os.path.realpath(p))
        if not real.exists():
            raise RefusedError(f"{p} is a symbolic link to {real}, which does not exist", fix)
    elif p.parent.exists():
        real = Path(os.path.realpath(p.parent)) / p.name
    else:
        real = Path(os.path.realpath(p))
    if real.exists() and not real.is_symlink() and not real.is_file():
        raise RefusedError(f"{p} is not a regular file", fix)
    return real


def _replaceable(real: Path, d: Path, fix: str) -> None:
    """Refuse a target the redo could not rename over or unlink although its directory is
    writable: an immutable or append-only file (chattr +i / +a), or another user's file in a
    sticky directory (such as /tmp)."""
    try:
        fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EROFS):
            raise RefusedError(f"{real} cannot be replaced: {exc.strerror} (an immutable or append-only file, "
                               "see lsattr, or a read-only filesystem)",
                               "clear the flag (chattr -i / -a) or remount it writable and run again; "
                               "nothing was changed") from None
    euid = os.geteuid()
    if euid != 0:
        st, sd = os.lstat(real), os.stat(d)
        if sd.st_mode & stat.S_ISVTX and euid not in (st.st_uid, sd.st_uid):
            raise RefusedError(f"{real} belongs to uid {st.st_uid} in the sticky directory {d}, so only its owner "
                               "may replace it", fix)


def _missing_dirs(d: Path) -> list[Path]:
    out = []
    while not d.exists():
        out.append(d)
        d = d.parent
    return list(reversed(out))


def _existing(d: Path) -> Path:
    while not d.exists():
        d = d.parent
    return d


class Transaction:
    """`changes` (package-parent relative path -> bytes, or None to delete) for the tree at `pp`."""

    def __init__(self, pp: Path | str, changes: dict, command: str):
        self.pp = home(pp)
        self.dir = self.pp / TXN
        self.command = command
        self.ops: list[Op] = []
        self.mkdirs: list[str] = []
        self.rmdirs: list[str] = []
        self.git: dict | None = None
        self.data: dict[str, bytes] = {}  # staged path -> bytes
        for rel, data in sorted(changes.items()):
            self.add(rel, data, _real_target(self.pp, rel, data is None))

    def add(self, label: str, data: bytes | None, real: Path) -> None:
        exists = _lexists(real)
        if data is None:
            if exists:
                self.ops.append(Op(label, str(real), None, str(real.parent / f".{real.name}{OLD_SUFFIX}")))
                self._rmdirs_for(label)
            return
        mode = (real.stat().st_mode & 0o7777) if exists else 0o644
        for d in _missing_dirs(real.parent):
            if str(d) not in self.mkdirs:
                self.mkdirs.append(str(d))
        new = str(real.parent / f".{real.name}{NEW_SUFFIX}")
        self.ops.append(Op(label, str(real), new, str(real.parent / f".{real.name}{OLD_SUFFIX}") if exists else None,
                           sha256_bytes(data), mode))
        self.data[new] = data

    def _rmdirs_for(self, rel: str) -> None:
        parent = Path(rel).parent
        while len(parent.parts) > 1:  # never the package dir itself
            p = str(self.pp / parent)
            if p not in self.rmdirs:
                self.rmdirs.append(p)
            parent = parent.parent

    def preflight(self) -> None:
        """Refuse, before anything is written, what would fail later: unwritable directories,
        too little space or too few inodes on a filesystem."""
        fix = "fix its permissions (or run as the tree's owner) and run again; nothing was changed"
        if not can_write(self.pp):
            raise RefusedError(f"{self.pp} is not writable (the transaction log goes there)", fix)
        need: dict = {}  # st_dev -> [dir, bytes, inodes]
        pp_dev = os.stat(self.pp).st_dev
        need[pp_dev] = [self.pp, 8192, 4]
        for op in self.ops:
            d = _existing(Path(op.real).parent)
            if not can_write(d):
                raise RefusedError(f"{d} is not writable, so {op.path} cannot be "
                                   f"{'changed' if op.new else 'removed'}", fix)
            if _lexists(op.real):
                _replaceable(Path(op.real), d, fix)
            if op.new is None:
                continue
            st = os.stat(d)
            n = need.setdefault(st.st_dev, [d, 0, 0])
            n[1] += len(self.data[op.new]) + 4096
            n[2] += 1
        for d in self.mkdirs:
            n = need.setdefault(os.stat(_existing(Path(d))).st_dev, [_existing(Path(d)), 0, 0])
            n[2] += 1
        for d, nbytes, inodes in need.values():
            vfs = os.statvfs(d)
            free = vfs.f_bavail * vfs.f_frsize
            if free < nbytes + SLACK_BYTES:
                raise RefusedError(f"not enough free space on the filesystem of {d} ({free // 1024} KiB free, "
                                   f"{(nbytes + SLACK_BYTES) // 1024} KiB needed)",
                                   "free some space and run again; nothing was changed")
            if vfs.f_files and vfs.f_favail < inodes + 2:
                raise RefusedError(f"no free inodes on the filesystem of {d} ({vfs.f_favail} free, {inodes + 2} "
                                   "needed)", "delete some files there and run again; nothing was changed")

    # --------------------------------------------------------------------------------------
    def plan(self) -> dict:
        """The plan in memory: absolute paths (what redo / undo / cleanup act on)."""
        return {"format": FORMAT, "command": self.command, "ops": [asdict(o) for o in self.ops],
                "mkdirs": self.mkdirs, "rmdirs": sorted(self.rmdirs, key=lambda p: -len(Path(p).parts)),
                "git": self.git}

    def disk_plan(self) -> dict:
        """The plan as plan.json holds it: every path relative to the tree (see `to_disk`)."""
        return to_disk(self.plan(), self.pp)

    def run(self, git_stage=None) -> None:
        """Preflight, stage, commit (READY), redo, clean up. `git_stage()` runs last before READY.
        Before READY any failure or Ctrl-C undoes what was staged (the tree stays original)."""
        self.preflight()
        try:
            self.dir.mkdir()
        except OSError as exc:
            raise RefusedError(f"cannot create the transaction log {self.dir}: {_why(exc)}",
                               "free space or fix permissions and run again; nothing was changed") from None
        try:
            _write_synced(self.dir / "plan.json", json.dumps(self.disk_plan(), indent=1, sort_keys=True).encode())
            _fsync_dir(self.dir)
            _fsync_dir(self.pp)
            self._stage()
            if git_stage is not None:
                git_stage()
            stop_point("staged")
            _write_synced(self.dir / "READY.tmp", b"ready\n")
            os.replace(self.dir / "READY.tmp", self.dir / "READY")
            _fsync_dir(self.dir)
        except BaseException as exc:
            with held_interrupts():
                try:
                    undo(self.plan(), self.dir)
                except Exception as exc2:
                    raise RefusedError(f"staging failed ({_why(exc)}) and could not be undone: {_why(exc2)}",
                                       f"fix that and run {self.command} again (it cleans up {self.dir})") from None
            if isinstance(exc, (OSError, RefusedError)):
                raise RefusedError(f"could not stage the change: {_why(exc)}",
                                   "free space or fix permissions and run again; nothing was changed") from None
            raise
        with completing():  # from here to the end a Ctrl-C waits, and then the completed change is reported
            finish(self.plan(), self.dir)

    def _stage(self) -> None:
        for d in self.mkdirs:
            os.mkdir(d)
        for op in self.ops:
            if op.old is not None:
                _link_or_copy(op.real, op.old)
            if op.new is not None:
                _write_synced(op.new, self.data[op.new], op.mode)
                if op.old is not None and os.geteuid() == 0:
                    st = os.stat(op.real)
                    try:
                        os.chown(op.new, st.st_uid, st.st_gid)
                    except OSError:
                        pass
        for d in {str(Path(op.real).parent) for op in self.ops}:
            _fsync_dir(d)


def _link_or_copy(src: str, dst: str) -> None:
    if _lexists(dst):
        os.unlink(dst)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst, follow_symlinks=False)


# ------------------------------------------------------------------------------------------
# redo / undo (shared by the run that made the log and by recovery)

def _git(g: dict, *args: str) -> None:
    git_run(list(args), Path(g["cwd"]))


def redo(plan: dict, txn: Path) -> None:
    stop_point("ready")
    first = True
    for o in plan["ops"]:
        op = Op(**o)
        if op.new is not None:
            if _lexists(op.new):
                os.replace(op.new, op.real)
        elif _lexists(op.real) and (op.old is None or _lexists(op.old)):
            os.unlink(op.real)
        if first:
            stop_point("replacing")
            first = False
    for d in {str(Path(o["real"]).parent) for o in plan["ops"]}:
        _fsync_dir(d)
    stop_point("replaced")
    g = plan.get("git")
    if g:
        _git(g, "symbolic-ref", "HEAD", g["ref"])
        stop_point("committed")


def cleanup(plan: dict, txn: Path) -> None:
    for o in plan["ops"]:
        if o["old"] and _lexists(o["old"]):
            os.unlink(o["old"])
    for d in plan.get("rmdirs", []):
        p = Path(d)
        try:
            if p.is_dir() and not p.is_symlink() and not any(x.name != "__pycache__" for x in p.iterdir()):
                shutil.rmtree(p)
        except OSError:
            pass  # an empty directory left behind holds no file; not worth failing for
    shutil.rmtree(txn)
    _fsync_dir(txn.parent)


def finish(plan: dict, txn: Path) -> None:
    """Redo and clean up; a redo that fails is undone (then one line says what failed)."""
    if not (txn / "DONE").exists():
        try:
            redo(plan, txn)
        except (OSError, RefusedError) as exc:
            try:
                undo(plan, txn)
            except (OSError, RefusedError) as exc2:
                raise RefusedError(f"could not complete the change ({_why(exc)}) nor put every file back "
                                   f"({_why(exc2)}); the transaction stays in {txn}",
                                   f"fix that and run {plan.get('command') or 'the same command'} again: it puts "
                                   "the files back first") from None
            raise RefusedError(f"could not complete the change ({_why(exc)}); every file was put back as it was",
                               "fix that and run again") from None
        _write_synced(txn / "DONE", b"done\n")
    cleanup(plan, txn)


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _undo_git(g: dict) -> None:
    cwd = Path(g["cwd"])
    cur = git_run(["rev-parse", "-q", "--verify", g["ref"]], cwd, check=False).stdout.decode().strip()
    head = git_run(["symbolic-ref", "-q", "HEAD"], cwd, check=False).stdout.decode().strip()
    if head == g["ref"] and g["head"] != g["ref"]:
        if g["head"].startswith("refs/"):
            _git(g, "symbolic-ref", "HEAD", g["head"])
        else:
            _git(g, "update-ref", "--no-deref", "HEAD", g["head"])
    if cur == g["new"]:
        if g.get("old"):
            _git(g, "update-ref", g["ref"], g["old"], g["new"])
        else:
            _git(g, "update-ref", "-d", g["ref"], g["new"])


def undo(plan: dict, txn: Path) -> None:
    """Put every target back as it was, also after a redo that stopped halfway (idempotent). The
    commit point is withdrawn first, so a run that dies in here is undone again, never redone.
    Every operation is tried; the first failure is raised at the end, the log kept for a rerun."""
    if (txn / "READY").exists():
        os.unlink(txn / "READY")
        _fsync_dir(txn)
    failed: list = []
    if plan.get("git"):
        try:
            _undo_git(plan["git"])
        except RefusedError as exc:
            failed.append(exc)
    for o in reversed(plan["ops"]):
        op = Op(**o)
        try:
            if op.old is not None and _lexists(op.old):
                if not _same_file(op.old, op.real):
                    os.replace(op.old, op.real)  # the original back over the new content
                if _lexists(op.old):
                    os.unlink(op.old)
            elif op.old is None and op.new is not None and _lexists(op.real) and _sha(op.real) == op.sha256:
                os.unlink(op.real)  # a file this change created
            if op.new is not None and _lexists(op.new):
                os.unlink(op.new)
        except OSError as exc:
            failed.append(exc)
    for d in reversed(plan.get("mkdirs", [])):
        p = Path(d)
        try:
            if p.is_dir() and not any(x.name != "__pycache__" for x in p.iterdir()):
                shutil.rmtree(p)
        except OSError:
            pass
    if failed:
        raise failed[0]
    if txn.exists():
        shutil.rmtree(txn)
    _fsync_dir(txn.parent)


# ------------------------------------------------------------------------------------------
# what a later run finds

def _read_plan(txn: Path) -> dict | None:
    try:
        plan = json.loads((txn / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(plan, dict) or plan.get("format") not in (2, FORMAT) or not isinstance(plan.get("ops"), list) \
            or not all(isinstance(o, dict) and isinstance(o.get("path"), str) for o in plan["ops"]):
        return None
    return plan


# ------------------------------------------------------------------------------------------
# the plan on disk: bound to the tree it lies in

def _rel(path: str, base: Path | str) -> str:
    """`path` relative to `base`, POSIX (a path outside it keeps its `..`: recovery refuses it)."""
    return Path(os.path.relpath(path, base)).as_posix()


def to_disk(plan: dict, home_dir: Path | str) -> dict:
    """`plan` (absolute paths) as plan.json holds it: each file path relative to `home_dir`, the
    git index by its name beside the index git finds from the tree, the git work tree as the path
    from it down to `home_dir` (`pkg`), and `home` (where it was made, for messages only)."""
    home_dir = Path(home_dir)
    ops = []
    for o in plan["ops"]:
        o = dict(o)
        for k in ("real", "new", "old"):
            if o[k] is not None:
                o[k] = os.path.basename(o[k]) if o["path"] == GIT_INDEX else _rel(o[k], home_dir)
        ops.append(o)
    out = dict(plan, format=FORMAT, home=str(home_dir), ops=ops,
               mkdirs=[_rel(d, home_dir) for d in plan.get("mkdirs", [])],
               rmdirs=[_rel(d, home_dir) for d in plan.get("rmdirs", [])])
    g = plan.get("git")
    if g:
        out["git"] = {k: v for k, v in g.items() if k != "cwd"}
        out["git"]["pkg"] = _rel(home_dir, os.path.realpath(g["cwd"]))
    return out


_SHA = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")
_REF = re.compile(r"^refs/heads/(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9._/-]*$")


def bind_plan(plan: dict, home_dir: Path | str) -> dict:
    """The plan read from `<home_dir>/.eaglepatch-txn` with every path resolved against
    `home_dir` (the tree recovery runs on, wherever the plan was made), or a one-line refusal,
    before anything is done, when an entry would reach outside it: an absolute path, `..`, a
    symbolic link on the way to it, a staged file not beside its target, a git work tree other
    than the one holding the tree. Format 2 plans (absolute paths) are read where their paths lie
    inside `home_dir`."""
    home_dir = Path(os.path.realpath(home_dir))
    txn = home_dir / TXN
    made = plan.get("home") if isinstance(plan.get("home"), str) else None
    fix = (f"recovery changes only files inside {home_dir}, so nothing was changed; restore the tree (git checkout / "
           "reinstall sglang), put back any file that change reached through a link out of the tree (its "
           f"original is beside it as .NAME{OLD_SUFFIX}), then remove {txn}")
    if made and made != str(home_dir):
        fix += f" (the log was made in {made})"

    def refuse(what: str):
        raise RefusedError(f"the interrupted transaction in {txn} names {what}", fix)

    def inside(rel, is_dir: bool = False, label: str | None = None) -> Path:
        if not isinstance(rel, str) or not rel or "\0" in rel:
            refuse(f"{rel!r}, which is not a path")
        shown = f"{label} at {rel}" if label and label != rel else rel
        if plan.get("format") == 2:  # absolute paths: those inside this tree only
            if not os.path.isabs(rel):
                refuse(f"{rel!r}, which is not an absolute path (format 2)")
            rel = _rel(os.path.normpath(rel), home_dir)
        if os.path.isabs(rel):
            refuse(f"the absolute path {shown}, outside the tree")
        parts = rel.split("/")
        if any(x in ("", ".", "..") for x in parts) or parts[0] == TXN:
            refuse(f"{shown}, which leaves the tree (..)" if ".." in parts else f"{shown!r}, which is not a path "
                   "inside the tree")
        full = home_dir.joinpath(*parts)
        d = full if is_dir else full.parent
        real = os.path.realpath(d)
        if real != str(d):  # a symbolic link on the way (never the last component of a file: that is replaced)
            link = next((str(a) for a in reversed([d, *d.parents]) if a.is_symlink()), str(d))
            where = "outside the tree" if os.path.commonpath([real, str(home_dir)]) != str(home_dir) else "elsewhere"
            refuse(f"{shown}, reached through the symbolic link {link} (to {real}, {where})")
        return full

    def beside(real: Path, stored, suffix: str, name: str) -> str | None:
        if stored is None:
            return None
        want = real.parent / f".{real.name}{suffix}"
        if not isinstance(stored, str):
            refuse(f"{stored!r} for {name}, which is not a path")
        if name == GIT_INDEX:
            got, exp = os.path.basename(stored), want.name
        elif plan.get("format") == 2:
            got, exp = _rel(os.path.normpath(stored), home_dir) if os.path.isabs(stored) else None, _rel(want, home_dir)
        else:
            got, exp = stored, _rel(want, home_dir)
        if got != exp:
            refuse(f"{stored!r} for {name}, which is not the file staged beside it")
        return str(want)

    g_in = plan.get("git")
    git = index = None
    if g_in is not None:
        if not isinstance(g_in, dict):
            refuse("a git part that is not an object")
        ref, new, old, head = g_in.get("ref"), g_in.get("new"), g_in.get("old"), g_in.get("head")
        if not (isinstance(ref, str) and _REF.match(ref)):
            refuse(f"the git ref {ref!r}, which is not a branch")
        if not (isinstance(new, str) and _SHA.match(new)) or not (old is None or isinstance(old, str) and _SHA.match(old)):
            refuse(f"the commits {new!r} / {old!r}, which are not commit ids")
        if not (isinstance(head, str) and (_SHA.match(head) or _REF.match(head))):
            refuse(f"HEAD {head!r}, which is neither a branch nor a commit id")
        if plan.get("format") == 2:
            cwd = g_in.get("cwd")
            pkg = _rel(home_dir, os.path.realpath(cwd)) if isinstance(cwd, str) and os.path.isabs(cwd) else None
        else:
            pkg = g_in.get("pkg")
        parts = [] if pkg in (".", "") else pkg.split("/") if isinstance(pkg, str) else None
        if parts is None or any(x in ("", ".", "..") for x in parts) or len(parts) >= len(home_dir.parts) \
                or list(home_dir.parts[len(home_dir.parts) - len(parts):]) != parts:
            refuse(f"the git work tree {g_in.get('cwd') or pkg!r}, which does not hold this tree")
        root = home_dir.parents[len(parts) - 1] if parts else home_dir
        r = git_run(["rev-parse", "--show-toplevel", "--git-path", "index"], root, check=False)
        out = r.stdout.decode("utf-8", "replace").splitlines()
        if r.returncode != 0 or len(out) != 2 or os.path.realpath(out[0]) != str(root):
            refuse(f"the git work tree {root}, which is not one")
        index = Path(out[1]) if os.path.isabs(out[1]) else root / out[1]
        git = {"cwd": str(root), "ref": ref, "new": new, "old": old, "head": head}

    ops = []
    for o in plan["ops"]:
        name = o.get("path")
        if name == GIT_INDEX:
            if index is None:
                refuse(f"{GIT_INDEX} without a git part")
            real = index
        elif not isinstance(name, str) or name.startswith(":"):
            refuse(f"the operation {name!r}, which eaglepatch does not make")
        else:
            real = inside(o.get("real"), label=name)
        sha, mode = o.get("sha256"), o.get("mode", 0o644)
        if not (sha is None or isinstance(sha, str)) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            refuse(f"{name}'s hash or mode, which is malformed")
        new = beside(real, o.get("new"), NEW_SUFFIX, name)
        old = beside(real, o.get("old"), OLD_SUFFIX, name)
        if new is None and old is None:
            refuse(f"{name} to be deleted without a link to its original")
        ops.append(asdict(Op(name, str(real), new, old, sha, mode)))
    return {"format": FORMAT, "command": plan.get("command") if isinstance(plan.get("command"), str) else None,
            "home": made, "ops": ops,
            "mkdirs": [str(inside(d, is_dir=True)) for d in plan.get("mkdirs") or []],
            "rmdirs": [str(inside(d, is_dir=True)) for d in plan.get("rmdirs") or []],
            "git": git}


def _command(plan: dict | None, home_dir: Path | str) -> str | None:
    """The command that finishes `plan`, its paths moved along with the tree (a log made in /a/T
    found in /b/T2 names /b/T2)."""
    cmd = (plan or {}).get("command")
    made = (plan or {}).get("home")
    if not isinstance(cmd, str) or not isinstance(made, str):
        return cmd if isinstance(cmd, str) else None
    old, new = Path(made), Path(os.path.realpath(home_dir))
    pairs = []
    while True:  # the tree and the directories above it whose names did not change
        pairs.append((str(old), str(new)))
        if old.name != new.name or old.parent == old or new.parent == new or len(pairs) > 3:
            break
        old, new = old.parent, new.parent
    for a, b in pairs:
        if a != b and a in cmd:
            return cmd.replace(a, b)
    return cmd


def describe_pending(pp: Path | str) -> tuple[str, dict | None] | None:
    """(what the transaction pending in `pp` is, its plan or None if unreadable), or None when none is."""
    txn = home(pp) / TXN
    if not _lexists(txn):
        return None
    plan = _read_plan(txn)
    cmd = f"`{plan['command']}`" if plan and plan.get("command") else "an eaglepatch run"
    n = len([o for o in (plan or {}).get("ops", []) if not o["path"].startswith(":")])
    if plan and (txn / "DONE").exists():
        return f"{cmd} finished its change but was stopped while cleaning up", plan
    if plan and (txn / "READY").exists():
        return f"{cmd} was stopped after its commit point, with {n} file(s) to change", plan
    return f"{cmd} was stopped before its commit point (no file was changed yet)", plan


def refuse_if_pending(pp: Path | str, what: str) -> None:
    pending = describe_pending(pp)
    if pending is None:
        return
    desc, plan = pending
    cmd = _command(plan, home(pp))
    raise RefusedError(f"an interrupted transaction is pending in {home(pp) / TXN}: {desc}",
                       f"run {cmd + ' ' if cmd else 'tools/apply.py on this tree '}again to finish it, then "
                       f"rerun this; {what} writes nothing, so it does not recover it")


def recover(pp: Path | str) -> str | None:
    """Finish (READY) or undo (no READY) a transaction an interrupted run left; a message or None."""
    txn = home(pp) / TXN
    if not _lexists(txn):
        return None
    plan = _read_plan(txn)
    with held_interrupts():
        if plan is None and (txn / "READY").exists():
            raise RefusedError(f"{txn} holds a committed transaction this version of eaglepatch cannot read",
                               "finish it with the eaglepatch that made it, or restore the tree (git checkout / "
                               f"reinstall sglang) and remove {txn}")
        if plan is None:  # stopped before plan.json was complete: nothing else was written yet
            try:
                shutil.rmtree(txn)
            except OSError as exc:
                raise RefusedError(f"cannot remove the unfinished transaction log {txn}: {_why(exc)}",
                                   "fix its permissions and run again") from None
            return f"recovered: removed an unfinished eaglepatch transaction log in {txn} (no file had changed)"
        bound = bind_plan(plan, txn.parent)  # refused here, before anything is done, if it reaches out of the tree
        cmd = _command(plan, txn.parent) or "an eaglepatch run"
        n = len([o for o in plan["ops"] if not o["path"].startswith(":")])
        made = bound.get("home")
        moved = f" (made in {made}, before the tree was moved or copied here)" if made and made != str(txn.parent) else ""
        if (txn / "READY").exists():
            try:
                finish(bound, txn)
            except RefusedError as exc:
                raise RefusedError(f"recovering the transaction of `{cmd}`: {exc.problem}", exc.fix) from None
            return f"recovered: completed the interrupted `{cmd}` from {txn}{moved} ({n} file(s))"
        try:
            undo(bound, txn)
        except (OSError, RefusedError) as exc:
            raise RefusedError(f"cannot undo the unfinished transaction of `{cmd}` in {txn}: {_why(exc)}",
                               "fix that and run again") from None
        return f"recovered: undid the unfinished `{cmd}` from {txn}{moved} (it had not changed any file)"
