"""A series applied here, carried to the GPU machine as the files it changes (no git needed there).

``make_patched_files(series_dir, release, out_dir)`` applies the series (product patches only, no smoke
patches) to the released wheel of ``release`` and writes the patched versions of the files the
series touches under ``out_dir/sglang/...``, with ``patched-files.json`` (release, series, and for each
file the upstream and patched sha256). ``lay_patched_files(files_dir, site, dest)`` copies
``site/sglang`` to ``dest/sglang`` and lays them over it after checking that every
upstream file it replaces is byte for byte the one the patched files were made from.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..outputs import swap_in
from ..tree import file_sha256 as _sha


def series_files(series_dir: Path) -> list[str]:
    from ..series import read_series_list

    files = set()
    for name in read_series_list(Path(series_dir) / "series"):
        text = (Path(series_dir) / name).read_text(errors="replace")
        files.update(re.findall(r"^diff --git a/(\S+) b/\S+$", text, flags=re.M))
    return sorted(files)


def make_patched_files(series_dir: Path, release: str, out_dir: Path) -> dict:
    from ..fetch import unpacked_release
    from ..smoke.tree import patched_tree

    series_dir, out_dir = Path(series_dir), Path(out_dir)
    if not (series_dir / "series").is_file():
        raise UsageError("%s is not a series directory (no 'series' file)" % series_dir, "pass patches/sglang-<release>")
    upstream = unpacked_release(release, quiet=True)
    files = series_files(series_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".patched-files-", dir=out_dir.parent))
    try:
        try:
            patched = patched_tree(upstream, series_dir, work / "tree", smoke=False)
        except RuntimeError as exc:
            raise UsageError("the series does not apply to sglang %s (%s)" % (release, str(exc)[:200]),
                             "pass the series made for that release") from None
        stage = work / "patched_files"
        manifest = {"format": 1, "release": release, "series": series_dir.name, "files": {}}
        for rel in files:
            src = patched / rel
            if not src.is_file():
                continue
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, stage / rel)
            manifest["files"][rel] = {"upstream_sha256": _sha(upstream / rel), "patched_sha256": _sha(src)}
        (stage / "patched-files.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        swap_in(stage, out_dir)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def lay_patched_files(files_dir: Path, site: Path, dest: Path) -> Path:
    files_dir, site, dest = Path(files_dir), Path(site), Path(dest)
    mf = files_dir / "patched-files.json"
    if not mf.is_file():
        raise UsageError("%s has no patched-files.json" % files_dir,
                         "make it here: python3 tools/gpucheck.py --make-patched-files --series patches/sglang-<release>")
    manifest = json.loads(mf.read_text())
    stale = [rel for rel, h in manifest["files"].items() if _sha(site / rel) != h["upstream_sha256"]]
    if stale:
        raise UsageError("the patched files were made for sglang %s but %s differs in %s" % (
            manifest["release"], site, ", ".join(stale[:3])), "unpack the bundle of that release or remake them with --make-patched-files")
    if (dest / "sglang").exists():
        shutil.rmtree(dest / "sglang")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(site / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    for rel in manifest["files"]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(files_dir / rel, dest / rel)
    return dest


__all__ = ["make_patched_files", "lay_patched_files", "series_files"]
