"""UpstreamTree: an SGLang git checkout (`python/sglang`) or a dir that holds the installed `sglang/`."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .series import PACKAGE, Series

VERSION_RE = re.compile(r"""^\s*(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)


def file_sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def version_from_version_py(pp: Path) -> str | None:
    p = pp / PACKAGE / "_version.py"
    if not p.is_file():
        return None
    m = VERSION_RE.search(p.read_text(encoding="utf-8", errors="replace"))
    if not m:
        m = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", p.read_text(encoding="utf-8", errors="replace"))
    return m.group(1) if m else None


def version_from_dist_info(pp: Path) -> str | None:
    for d in sorted(pp.glob(f"{PACKAGE}-*.dist-info")):
        meta = d / "METADATA"
        if meta.is_file():
            m = re.search(r"^Version:\s*(\S+)", meta.read_text(encoding="utf-8", errors="replace"), re.M)
            if m:
                return m.group(1)
        m = re.match(rf"^{PACKAGE}-(.+)\.dist-info$", d.name)
        if m:
            return m.group(1)
    return None


def version_from_git_tag(root: Path) -> str | None:
    try:
        import git
        repo = git.Repo(root)
        tag = repo.git.describe("--tags", "--exact-match", "HEAD")
    except Exception:
        return None
    m = re.match(r"^v?(\d[\w.\-+]*)$", tag.strip())
    return m.group(1) if m else None


@dataclass
class UpstreamTree:
    kind: str  # 'git' | 'installed'
    root: Path
    package_parent: Path
    release: str | None
    release_source: str | None  # '_version.py' | 'dist-info' | 'git tag' | 'hashes'
    declared_release: str | None = None  # what the version source said, before the hash check

    @classmethod
    def open(cls, root: Path | str, candidates: dict[str, Series] | None = None) -> "UpstreamTree":
        """Open ROOT. `candidates` (release -> Series with manifest) lets the hashes decide the
        release when no version source exists, and override a version source they contradict."""
        root = Path(root).expanduser()
        if not root.exists():
            raise UsageError(f"{root} does not exist", "pass an SGLang checkout or the dir holding the sglang package")
        root = root.resolve()
        if (root / "python" / PACKAGE / "__init__.py").is_file():
            kind, pp = "git", root / "python"
        elif (root / PACKAGE / "__init__.py").is_file():
            kind, pp = "installed", root
        elif root.name == PACKAGE and (root / "__init__.py").is_file():
            kind, pp = "installed", root.parent
            root = pp
        else:
            raise UsageError(f"not an sglang tree: {root} holds neither python/sglang/ nor sglang/",
                             "pass an SGLang git checkout or the site-packages dir that holds sglang/")
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
        try:
            return self.path(rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def sha256(self, rel: str) -> str | None:
        return file_sha256(self.path(rel))

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

    def modified_files(self, series: Series, reverse: bool = False) -> list[str]:
        """Target files whose hash is neither what the series expects before it runs."""
        key = "patched_sha256" if reverse else "upstream_sha256"
        bad = []
        for rel, h in series.manifest_files().items():
            cur = self.sha256(rel)
            if cur != h.get(key) and cur != h.get("patched_sha256" if not reverse else "upstream_sha256"):
                bad.append(rel)
        return bad

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
            if p.is_symlink():
                out[str(p.relative_to(root))] = "link:" + os.readlink(p)
            else:
                out[str(p.relative_to(root))] = file_sha256(p)
    return out


def tree_hashes(root: Path | str) -> dict[str, str]:
    """sha256 of every file under root (skipping .git): used by tests and crash checks."""
    return _walk_hash(Path(root))


def pick_series(root, series_dir=None, patches_root=None):
    """(Series, UpstreamTree) for ROOT: --series DIR, or patches/sglang-<detected release>."""
    from .errors import RefusedError
    from .series import available_series, load_series

    if series_dir is not None:
        series = load_series(series_dir)
        tree = UpstreamTree.open(root, {series.release: series} if series.release else None)
        return series, tree
    have = available_series(patches_root)
    cands = {}
    for rel, d in have.items():
        try:
            cands[rel] = load_series(d)
        except UsageError:
            continue
    tree = UpstreamTree.open(root, cands)
    if tree.release is None:
        raise UsageError(f"cannot tell the sglang release of {tree.root} (no _version.py, dist-info or v* tag, "
                         "and no series manifest matches its files)", "pass --series patches/sglang-<release>")
    if tree.release not in have:
        from .port import nearest_older_series

        names = ", ".join(d.name for d in have.values()) or "none"
        near = nearest_older_series(tree.release, patches_root)
        raise RefusedError(f"no series for sglang {tree.release} (series that exist: {names})",
                           (f"the nearest older series is {near[1].name}: see its drift with tools/verify.py {root} "
                            f"--series {near[1]}, then port it with python3 tools/port.py --from {near[0]} "
                            f"--to {tree.release}" if near else "write a series under patches/"))
    series = cands.get(tree.release) or load_series(have[tree.release])
    return series, tree
