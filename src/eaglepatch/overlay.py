"""The SGLang-side package of the series, kept once as real files in ``sglang-overlay/``.

``sglang-overlay/`` is laid out like a package parent: every file under its ``sglang/`` is a
file the series adds to SGLang. The first patch of every series (``0001-<slug>.patch``, header
``sglang-overlay/patch-header.txt``) is generated from it here, for that series' release:

- ``release_files(release, series_version, upstream_mapping)``: the overlay's files with
  ``sglang/srt/eagle3_capture/release.py`` written for that release (its three constants);
- ``new_file_patch(files)``: the patch adding those files, written by ``git diff`` with the
  project's ``DIFF_ARGS`` (the same bytes ``tools/export.py`` writes from a branch);
- ``sync_series(series_dir, check)``: regenerate (or, with ``check``, compare) the series'
  new-file patch, its ``series`` line and its ``manifest.json`` entries.

``import_package()`` imports the overlay's package without SGLang (its modules import each
other relatively), for unit tests.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import keyword
import os
import re
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import gitcmd
from .errors import UsageError
from .series import (DIFF_ARGS, PACKAGE, SEPARATOR, dump_manifest, load_manifest, parse_header, read_series_list,
                     sha256_bytes, slug)

OVERLAY = Path(__file__).resolve().parents[2] / "sglang-overlay"
HEADER = "patch-header.txt"
PACKAGE_DIR = f"{PACKAGE}/srt/eagle3_capture"
RELEASE_FILE = f"{PACKAGE_DIR}/release.py"
DEFAULT_UPSTREAM_MAPPING = "plus_one"
_CONSTANT = r'^{name} = "[^"\n]*"$'


# names no overlay file has: editor swap and lock files, backups, merge leftovers, byte code
STRAY = ("*.swp", "*.swo", "*.swn", "*.swx", ".*.sw?", "*~", ".#*", "#*#", "*.orig", "*.rej", "*.bak", "*.tmp",
         "*.pyc", "*.pyo", ".DS_Store", "*.save", "*.save.*")
# what the package holds besides its modules (`<name>.py`, name a valid module name, in folders
# whose names are valid package names): package-parent-relative glob patterns; none yet
DATA: tuple[str, ...] = ()


def _module_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _not_packed(rel: Path) -> str | None:
    """Why the file at package-parent-relative `rel` is no part of the package, or None: only
    modules and declared data are (an editor's `dump.py.save`, a file manager's `dump (copy).py`
    and the like never are)."""
    if any(fnmatch.fnmatchcase(rel.as_posix(), pat) for pat in DATA):
        return None
    if any(fnmatch.fnmatchcase(rel.name, pat) for pat in STRAY):
        return "looks like an editor swap file, backup or merge leftover, not part of the package"
    bad_dir = next((d for d in rel.parts[:-1] if not _module_name(d)), None)
    if bad_dir is not None:
        return f"is in the folder {bad_dir!r}, which is not a valid package name, so not part of the package"
    if rel.suffix != ".py" or not _module_name(rel.name[:-3]):
        return ("is not a module of the package (a module is NAME.py, NAME a valid Python name; other files go in "
                "eaglepatch.overlay.DATA)")
    return None


def overlay_root() -> Path:
    env = os.environ.get("EAGLEPATCH_OVERLAY")
    return Path(env) if env else OVERLAY


def source_files(root: Path | None = None) -> dict[str, bytes]:
    """Package-parent-relative path -> bytes of every file of the package under the overlay's
    sglang/: its modules and declared `DATA`. Anything else there (an editor's leftover, a copy
    named `dump (copy).py`, a symbolic link) is refused in one line, exit 2, nothing written."""
    root = root or overlay_root()
    if not (root / PACKAGE).is_dir():
        raise UsageError(f"{root} holds no {PACKAGE}/ folder", "run from a checkout of the project (sglang-overlay/)")
    out = {}
    for path in sorted((root / PACKAGE).rglob("*")):
        if "__pycache__" in path.relative_to(root).parts:
            continue  # made by importing the package (tests do), never part of it
        mode = path.lstat().st_mode
        if stat.S_ISDIR(mode):
            continue
        why = None
        if not stat.S_ISREG(mode):
            why = "is a symbolic link or special file, not a regular file"
        else:
            why = _not_packed(path.relative_to(root))
        if why:
            raise UsageError(f"{path} {why} (the package in {root / PACKAGE} goes into each series' 0001 patch, "
                             "and nothing else may sit there)",
                             "remove it (or rename it, if it is a real module) and run export --overlay again; "
                             "nothing was written")
        out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def render_release(template: bytes, release: str, series_version: str, upstream_mapping: str) -> bytes:
    """``release.py`` with its three constants set; each must appear exactly once."""
    values = {"SERIES_RELEASE": release, "SERIES_VERSION": series_version,
              "UPSTREAM_EAGLE_ID_MAPPING": upstream_mapping}
    text = template.decode("utf-8")
    for name, value in values.items():
        pattern = re.compile(_CONSTANT.format(name=name), re.M)
        if len(pattern.findall(text)) != 1:
            raise UsageError(f"{RELEASE_FILE} in the overlay must assign {name} = \"...\" exactly once",
                             "restore the constant in sglang-overlay/")
        text = pattern.sub(f'{name} = "{value}"', text)
    return text.encode("utf-8")


def release_files(release: str, series_version: str, upstream_mapping: str = DEFAULT_UPSTREAM_MAPPING,
                  root: Path | None = None) -> dict[str, bytes]:
    files = source_files(root)
    if RELEASE_FILE not in files:
        raise UsageError(f"the overlay has no {RELEASE_FILE}", "restore it in sglang-overlay/")
    files[RELEASE_FILE] = render_release(files[RELEASE_FILE], release, series_version, upstream_mapping)
    return files


def header(root: Path | None = None) -> str:
    path = (root or overlay_root()) / HEADER
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path} ({exc})", "restore sglang-overlay/patch-header.txt") from None
    parse_header(text, str(path))
    return text if text.endswith("\n") else text + "\n"


def patch_name(header_text: str) -> str:
    subject = parse_header(header_text, HEADER)["Subject"]
    return f"0001-{slug(subject)}.patch"


def diff_body(files: dict[str, bytes]) -> bytes:
    """``git diff`` (the project's DIFF_ARGS) adding ``files`` to an empty tree."""
    with tempfile.TemporaryDirectory(prefix="eaglepatch-overlay-") as td:
        work = Path(td) / "w"
        work.mkdir()
        # no user or system config can change the diff
        env = gitcmd.clean_env(ceiling=Path(td), extra={"GIT_CONFIG_NOSYSTEM": "1", "HOME": td,
                                                         "GIT_CONFIG_GLOBAL": os.devnull})
        gitcmd.run(["init", "-q"], work, env=env)
        for rel, data in files.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
        gitcmd.run(["add", "-A", "--", "."], work, env=env)
        return gitcmd.run(["diff", "--cached", *DIFF_ARGS], work, env=env).stdout


def new_file_patch(files: dict[str, bytes], header_text: str) -> bytes:
    return header_text.encode("utf-8") + SEPARATOR + diff_body(files)


# ------------------------------------------------------------------------------------------
# a series' new-file patch and manifest entries

@dataclass
class Generated:
    name: str  # patch file name
    data: bytes  # patch file bytes
    files: dict  # rel -> bytes (rendered)


def generate_for(release: str, series_version: str, upstream_mapping: str = DEFAULT_UPSTREAM_MAPPING,
                 root: Path | None = None) -> Generated:
    files = release_files(release, series_version, upstream_mapping, root)
    head = header(root)
    return Generated(patch_name(head), new_file_patch(files, head), files)


def manifest_with(manifest: dict, gen: Generated) -> dict:
    """``manifest`` with its new-file patch entry and new-file hashes set from ``gen``."""
    m = dict(manifest)
    files = {rel: h for rel, h in m.get("files", {}).items() if not (isinstance(h, dict)
                                                                      and h.get("upstream_sha256") is None)}
    for rel, data in gen.files.items():
        files[rel] = {"upstream_sha256": None, "patched_sha256": sha256_bytes(data)}
    m["files"] = dict(sorted(files.items()))
    entry = {"name": gen.name, "sha256": sha256_bytes(gen.data),
             "hunks": [{"file": rel, "index": 0, "source_start": 0, "anchor": "<module>", "anchor_sha256": None}
                       for rel in sorted(gen.files)]}
    rest = [p for p in m.get("patches", []) if not str(p.get("name", "")).startswith("0001-")]
    m["patches"] = [entry] + rest
    return m


def series_params(manifest: dict, series_dir: Path) -> tuple[str, str, str]:
    release = manifest.get("release")
    version = manifest.get("series_version")
    if not release or not version:
        raise UsageError(f"{series_dir}/manifest.json has no release or series_version",
                         "regenerate the series with tools/export.py")
    mapping = (manifest.get("capture_semantics") or {}).get("upstream_eagle_id_to_capture_index",
                                                            DEFAULT_UPSTREAM_MAPPING)
    return release, version, mapping


def sync_series(series_dir: Path | str, check: bool = False, root: Path | None = None) -> list[str]:
    """Regenerate the new-file patch of ``series_dir`` from the overlay. Returns what differs
    (``check``) or what was rewritten; an empty list means the series already matches."""
    d = Path(series_dir)
    manifest = load_manifest(d / "manifest.json")
    if manifest is None:
        raise UsageError(f"{d} has no manifest.json", "export the series first (tools/export.py)")
    gen = generate_for(*series_params(manifest, d), root=root)
    names = read_series_list(d / "series")
    old_first = names[0] if names and names[0].startswith("0001-") else None
    want = {gen.name: gen.data, "manifest.json": dump_manifest(manifest_with(manifest, gen)).encode()}
    series_text = "".join(f"{n}\n" for n in [gen.name] + [n for n in names if n != old_first]).encode()
    if (d / "series").read_bytes() != series_text:
        want["series"] = series_text
    diffs = [name for name, data in want.items() if not (d / name).is_file() or (d / name).read_bytes() != data]
    stale = [old_first] if old_first and old_first != gen.name and (d / old_first).exists() else []
    diffs += [f"stale {n}" for n in stale]
    if check or not diffs:
        return diffs
    for name, data in want.items():
        tmp = d / f".{name}.overlay-tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / name)
    for n in stale:
        (d / n).unlink()
    return diffs


# ------------------------------------------------------------------------------------------
# the package itself, for unit tests

def import_package(name: str = "eagle3_capture", root: Path | None = None):
    """Import the overlay's package under ``name`` without SGLang (a fresh module each call)."""
    pkg = (root or overlay_root()) / PACKAGE_DIR
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
