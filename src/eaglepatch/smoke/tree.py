"""A temporary patched tree for the smoke tests (until eaglepatch.applier takes over).

``patched_tree(release_dir, series_dir, dest)`` copies ``release_dir/sglang`` to ``dest/sglang``
and ``git apply``s every patch named in ``series`` and then in ``smoke.series`` (paths in the
patches are relative to the package parent, so ``dest`` is the package parent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def read_series(path: Path) -> list[str]:
    if not path.is_file():
        return []
    names = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def patched_tree(release_dir: Path, series_dir: Path, dest: Path, smoke: bool = True) -> Path:
    """Build ``dest/sglang`` = upstream + series (+ smoke.series); returns ``dest`` (the package parent)."""
    release_dir, series_dir, dest = Path(release_dir), Path(series_dir), Path(dest)
    src = release_dir / "sglang"
    if not src.is_dir():
        raise FileNotFoundError("error: %s has no sglang/ package; point at an unpacked release" % release_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / "sglang").exists():
        shutil.rmtree(dest / "sglang")
    shutil.copytree(src, dest / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    names = read_series(series_dir / "series")
    if smoke:
        names += read_series(series_dir / "smoke.series")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(dest.parent))
    for name in names:
        patch = series_dir / name
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch.resolve())],
            cwd=dest, env=env, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError("error: git apply %s failed: %s; fix the patch" % (name, proc.stderr.strip()))
    return dest
