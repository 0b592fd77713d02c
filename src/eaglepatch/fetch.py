"""Fetch sglang releases from the package index, cache and unpack them, make git checkouts.

The cache (`${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}/releases/<release>/`) is filled under a lock
on that directory, each piece built in a temporary directory and renamed into place, so a killed
run leaves nothing half-made that a later run would use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from .errors import UsageError
from . import gitcmd
from .gitcmd import GIT_ID
from .lock import tree_lock
from .outputs import filled_dir, swap_in
from .series import PACKAGE, check_release

FIXED_DATE = "2000-01-01T00:00:00+0000"
CACHE_FIX = "set EAGLEPATCH_CACHE to a writable directory (the releases are cached there)"


def cache_root() -> Path:
    base = os.environ.get("EAGLEPATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eaglepatch")
    return Path(base).expanduser() / "releases"


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _release_dir(release: str) -> Path:
    check_release(release, "release")
    d = cache_root() / release
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write the release cache {d}: {exc.strerror}", CACHE_FIX) from None
    return d


@contextmanager
def _locked_release_dir(release: str):
    """The cache directory of `release`, created and locked; a failure inside (a release the index
    does not have, say) leaves no empty directory behind."""
    d = _release_dir(release)
    try:
        with tree_lock(d):
            yield d
    except BaseException:
        try:
            d.rmdir()  # only when empty
        except OSError:
            pass
        raise


def _mkdtemp(prefix: str, where: Path) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=where))
    except OSError as exc:
        raise UsageError(f"cannot write in {where}: {exc.strerror}", CACHE_FIX) from None


def fetch_release(release: str, quiet: bool = False) -> Path:
    """Path of the cached `sglang-<release>-*.whl`, downloading it with pip the first time."""
    d = cache_root() / release
    found = sorted(d.glob(f"{PACKAGE}-{release}-*.whl"))
    if found:
        return found[0]
    with _locked_release_dir(release) as d:
        found = sorted(d.glob(f"{PACKAGE}-{release}-*.whl"))
        if found:
            return found[0]
        tmp = _mkdtemp(".download-", d)
        try:
            _say(f"downloading sglang=={release} from the package index into {d} ...", quiet)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"{PACKAGE}=={release}", "-d", str(tmp)]
            if quiet:
                cmd.insert(4, "-q")
            r = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                               stderr=None if not quiet else subprocess.PIPE)
            wheels = sorted(tmp.glob(f"{PACKAGE}-*.whl"))
            if r.returncode != 0 or not wheels:
                raise UsageError(f"could not download sglang=={release} from the package index",
                                 "check the release number (pip index versions sglang) and the network")
            target = d / wheels[0].name
            os.replace(wheels[0], target)
            _say(f"cached {target}", quiet)
            return target
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def unpacked_release(release: str, quiet: bool = False) -> Path:
    """A cached unpacked wheel (package parent: holds sglang/ and the dist-info). Treat as read-only."""
    d = cache_root() / release / "unpacked"
    if (d / PACKAGE / "__init__.py").is_file():
        return d
    with _locked_release_dir(release):
        if (d / PACKAGE / "__init__.py").is_file():
            return d
        whl = fetch_release(release, quiet)
        with filled_dir(_mkdtemp(".unpack-", d.parent), d) as tmp:
            _say(f"unpacking {whl.name} ...", quiet)
            try:
                with zipfile.ZipFile(whl) as z:
                    z.extractall(tmp)
            except zipfile.BadZipFile:
                raise UsageError(f"the cached wheel {whl} is damaged", "delete it and run again") from None
            except OSError as exc:
                raise UsageError(f"cannot unpack {whl.name} into {d.parent}: {exc.strerror}", CACHE_FIX) from None
    return d


def _git(args: list[str], cwd: Path, env: dict | None = None) -> None:
    gitcmd.run(args, cwd, env=gitcmd.clean_env(extra={**GIT_ID, **(env or {})}))


def _template(release: str, quiet: bool) -> Path:
    """A cached git work tree holding the release as one commit tagged v<release> (cloned, never used)."""
    tpl = cache_root() / release / "checkout"
    done = cache_root() / release / "checkout.ok"
    if done.is_file() and (tpl / ".git").is_dir():
        return tpl
    src = unpacked_release(release, quiet)
    with _locked_release_dir(release):
        if done.is_file() and (tpl / ".git").is_dir():
            return tpl
        tmp = _mkdtemp(".git-", tpl.parent)
        try:
            _say(f"building a git checkout of sglang {release} ...", quiet)
            work = tmp / "work"
            try:
                shutil.copytree(src / PACKAGE, work / "python" / PACKAGE,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            except (OSError, shutil.Error):
                raise UsageError(f"cannot write the release cache {tpl.parent}", CACHE_FIX) from None
            (work / "python" / PACKAGE / "_version.py").unlink(missing_ok=True)
            env = {"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE}
            _git(["init", "-q", "-b", "main"], work)
            _git(["add", "-A", "."], work)
            _git(["-c", "commit.gpgsign=false", "-c", "gc.auto=0", "commit", "-q", "-m",
                  f"sglang {release} (from the released wheel)"], work, env=env)
            _git(["tag", f"v{release}"], work)
            _git(["gc", "-q"], work)
            done.unlink(missing_ok=True)
            swap_in(work, tpl)
            done.write_text(f"v{release}\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tpl


def make_git_checkout(release: str, dest: Path | str, quiet: bool = False) -> Path:
    """A new git repo at `dest` laid out like an upstream clone: python/sglang/..., no _version.py,
    no dist-info, one commit tagged v<release>, branch main."""
    dest = Path(dest).expanduser().resolve()
    if dest.is_file():
        raise UsageError(f"{dest} is a file", "pass a new directory as DEST")
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} already exists and is not empty", "pass a new directory as DEST")
    tpl = _template(release, quiet)
    _say(f"checking out sglang {release} into {dest} ...", quiet)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {dest.parent}: {exc.strerror}", "pass a DEST in a writable directory") \
            from None
    _git(["clone", "-q", str(tpl), str(dest)], dest.parent)
    _git(["remote", "remove", "origin"], dest)
    return dest
