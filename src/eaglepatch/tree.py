"""UpstreamTree: an SGLang git checkout (`python/sglang`) or a dir that holds the installed `sglang/`."""

from __future__ import annotations

import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import gitcmd
from .errors import RefusedError, UsageError
from .series import (PACKAGE, Series, available_series, load_series, nearest_older, port_command, sha256_bytes,
                     tool_command)

VERSION_RE = re.compile(r"""^\s*(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)


def file_sha256(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_target(path: Path) -> bytes | None:
    """The bytes of a file the series touches; None when it does not exist; any other problem
    (a directory, no permission, a link loop) is a one-line usage error."""
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # never opened: reading a FIFO blocks forever
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            return _unreadable(path, f"is not a regular file ({kind})")
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return _unreadable(path, "is a symbolic link to a missing file") if path.is_symlink() else None
    except IsADirectoryError:
        return _unreadable(path, "is a directory, not a file")
    except OSError as exc:
        return _unreadable(path, f"cannot be read: {exc.strerror}")


def _unreadable(path: Path, why: str):
    raise UsageError(f"{path} {why}", "restore the file as the sglang release has it (git checkout / reinstall "
                     "sglang) and run again")


def version_from_version_py(pp: Path) -> str | None:
    text = _text(pp / PACKAGE / "_version.py")
    m = VERSION_RE.search(text) or re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
    return m.group(1) if m else None


def _text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else ""
    except OSError:
        return ""


def version_from_dist_info(pp: Path) -> str | None:
    for d in sorted(pp.glob(f"{PACKAGE}-*.dist-info")):
        m = re.search(r"^Version:\s*(\S+)", _text(d / "METADATA"), re.M)
        if m:
            return m.group(1)
        m = re.match(rf"^{PACKAGE}-(.+)\.dist-info$", d.name)
        if m:
            return m.group(1)
    return None


def version_from_git_tag(root: Path) -> str | None:
    r = gitcmd.run(["describe", "--tags", "--exact-match", "HEAD"], root, check=False,
                   env=gitcmd.clean_env(ceiling=root.parent))
    if r.returncode != 0:
        return None
    m = re.match(r"^v?(\d[\w.\-+]*)$", r.stdout.decode("utf-8", "replace").strip())
    return m.group(1) if m else None


def locate(root: Path | str) -> tuple[str, Path, Path]:
    """(kind, root, package parent) of ROOT from its layout alone (reads no file)."""
    root = Path(os.path.expanduser(str(root)))
    if not str(root) or not root.exists():
        raise UsageError(f"{root} does not exist", "pass an SGLang checkout or the dir holding the sglang package")
    root = root.resolve()
    if (root / "python" / PACKAGE / "__init__.py").is_file():
        return "git", root, root / "python"
    if (root / PACKAGE / "__init__.py").is_file():
        return "installed", root, root
    if root.name == PACKAGE and (root / "__init__.py").is_file():
        return "installed", root.parent, root.parent
    raise UsageError(f"not an sglang tree: {root} holds neither python/sglang/ nor sglang/",
                     "pass an SGLang git checkout or the site-packages dir that holds sglang/")


@dataclass
class UpstreamTree:
    kind: str  # 'git' | 'installed'
    root: Path
    package_parent: Path
    release: str | None
    release_source: str | None  # '_version.py' | 'dist-info' | 'git tag' | 'hashes'
    declared_release: str | None = None  # what the version source said, before the hash check
    _reads: dict | None = field(default=None, init=False, repr=False, compare=False)  # see reads_once

    @classmethod
    def open(cls, root: Path | str, candidates: dict[str, Series] | None = None) -> "UpstreamTree":
        """Open ROOT. `candidates` (release -> Series with manifest) lets the hashes decide the
        release when no version source exists, and override a version source they contradict."""
        kind, root, pp = locate(root)
        release, source = version_from_version_py(pp), "_version.py"
        if release is None:
            release, source = version_from_dist_info(pp), "dist-info"
        if release is None and kind == "git":
            release, source = version_from_git_tag(root), "git tag"
        if release is None:
            source = None
        tree = cls(kind, root, pp, release, source, release)
        if candidates:
            tree._cross_check(candidates)
        return tree

    def _cross_check(self, candidates: dict[str, Series]) -> None:
        if self.release is not None:  # a version source wins; the hash check then reports edits
            return
        for rel, s in candidates.items():
            if s.manifest and self.state(s) in ("upstream", "patched"):
                self.release, self.release_source = rel, "hashes"
                return

    # files -------------------------------------------------------------------------------
    def path(self, rel: str) -> Path:
        return self.package_parent / rel

    def read(self, rel: str) -> bytes | None:
        if self._reads is None:
            return read_target(self.path(rel))
        if rel not in self._reads:
            self._reads[rel] = read_target(self.path(rel))
        return self._reads[rel]

    @contextmanager
    def reads_once(self):
        """Inside the block each file is read from disk once and then served from memory: for a
        caller that holds the tree's lock and writes nothing while the block runs."""
        self._reads = {}
        try:
            yield self
        finally:
            self._reads = None

    def sha256(self, rel: str) -> str | None:
        return sha256_bytes(self.read(rel))

    def state(self, series: Series) -> str:
        """'upstream' | 'patched' | 'partial' | 'modified' | 'unknown' against the manifest hashes."""
        files = series.manifest_files()
        if not files:
            return "unknown"
        up = pat = 0
        for rel, h in files.items():
            cur = self.sha256(rel)
            is_up, is_pat = cur == h.get("upstream_sha256"), cur == h.get("patched_sha256")
            if not (is_up or is_pat):
                return "modified"
            up += is_up
            pat += is_pat
        if up == len(files):
            return "upstream"
        if pat == len(files):
            return "patched"
        return "partial"

    def describe(self) -> str:
        rel = self.release or "unknown release"
        src = f" (from {self.release_source})" if self.release_source else ""
        return f"{self.kind} tree {self.root}, sglang {rel}{src}"


def _walk_hash(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for fn in filenames:
            p = Path(dirpath) / fn
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                out[str(p.relative_to(root))] = "link:" + os.readlink(p)
            elif not stat.S_ISREG(mode):  # a FIFO, socket or device: never opened (a FIFO would block)
                out[str(p.relative_to(root))] = f"special:{stat.S_IFMT(mode):o}"
            else:
                out[str(p.relative_to(root))] = file_sha256(p)
    return out


def tree_hashes(root: Path | str) -> dict[str, str]:
    """sha256 of every file under root (skipping .git): used by tests and crash checks."""
    return _walk_hash(Path(root))


@dataclass
class Pick:
    series: Series
    tree: UpstreamTree
    note: str | None = None  # set when the series is not the release's own (verify's nearest older)


def resolve_series(root, series_dir=None, patches_root=None, nearest: bool = False, recover: bool = False,
                   what: str = "verify", say=print) -> Pick:
    """The series for ROOT: --series DIR, else patches/sglang-<detected release>. A release without
    a series is refused naming the nearest older series and the port command; with nearest=True
    (verify) that nearest older series is picked instead, with a note saying so.

    A transaction an interrupted run left is dealt with first, before the release is detected (a
    half-done change can hide the release a tree's hashes tell): with recover=True (a tool that
    writes the tree) it is finished or undone under the tree's lock, else it is refused naming
    the command that finishes it (`what` is the read-only tool, for that message)."""
    _pending_first(root, recover, what, say)
    if series_dir is not None:
        series = load_series(series_dir)
        tree = UpstreamTree.open(root, {series.release: series} if series.release else None)
        return Pick(series, tree)
    have = available_series(patches_root)
    tree = UpstreamTree.open(root)
    cands = {}
    if tree.release is None:  # no version source: the series' manifests tell the release by its files' hashes
        for rel, d in have.items():
            try:
                cands[rel] = load_series(d)
            except UsageError:
                continue
        tree._cross_check(cands)
    if tree.release is None:
        raise UsageError(f"cannot tell the sglang release of {tree.root} (no _version.py, dist-info or v* tag, "
                         "and no series manifest matches its files)", "pass --series patches/sglang-<release>")
    if tree.release in have:
        return Pick(cands.get(tree.release) or load_series(have[tree.release]), tree)
    names = ", ".join(d.name for d in have.values()) or "none"
    near = nearest_older(tree.release, have)
    if near is None:
        raise RefusedError(f"no series for sglang {tree.release} and none older (series that exist: {names})",
                           "write a series under patches/ (tools/export.py)")
    port = port_command(near, tree.release)
    if nearest:
        return Pick(load_series(have[near]), tree,
                    f"no series for sglang {tree.release}; verifying the nearest older series {have[near].name} "
                    f"(port it with: {port})")
    raise RefusedError(f"no series for sglang {tree.release} (series that exist: {names})",
                       f"the nearest older series is {have[near].name}: see its drift with "
                       f"{tool_command('verify', tree.root)}, then port it with {port}")


def _pending_first(root, recover: bool, what: str, say) -> None:
    from .lock import tree_lock
    from .txn import describe_pending, recover as recover_txn, refuse_if_pending
    _, _, pp = locate(root)
    if describe_pending(pp) is None:
        return
    with tree_lock(pp):
        if not recover:
            refuse_if_pending(pp, what)
            return
        msg = recover_txn(pp)
        if msg:
            say(msg)
