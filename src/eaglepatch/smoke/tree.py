"""A temporary patched tree for the smoke tests and the GPU check.

``patched_tree(release_dir, series_dir, dest, smoke=True)`` copies ``release_dir/sglang`` to
``dest/sglang`` and applies every patch named in ``series`` (and then in ``smoke.series``) with
``git apply`` through ``eaglepatch.applier.git_apply``, in a scratch directory outside any git
repository: ``git apply`` run inside a repository silently skips the paths it thinks lie outside
the current directory, which would leave an unpatched tree that looks patched. Every product
file is then checked against the series manifest's ``patched_sha256``. ``product=False`` takes
``release_dir`` as a tree the series is already applied to and applies only ``smoke.series``.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def patched_tree(release_dir: Path, series_dir: Path, dest: Path, smoke: bool = True, product: bool = True) -> Path:
    """Build ``dest/sglang`` = upstream + series (+ smoke.series); returns ``dest`` (the package parent).
    ``product=False``: ``release_dir`` is patched already; only smoke.series is applied."""
    from ..applier import git_apply
    from ..series import load_series, sha256_bytes

    release_dir, series_dir, dest = Path(release_dir), Path(series_dir), Path(dest)
    src = release_dir / "sglang"
    if not src.is_dir():
        raise FileNotFoundError("error: %s has no sglang/ package; point at an unpacked release" % release_dir)
    series = load_series(series_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / "sglang").exists():
        shutil.rmtree(dest / "sglang")
    shutil.copytree(src, dest / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for patches in (series.patches if product else [], series.smoke if smoke else []):
        if not patches:
            continue
        files = sorted({fp.path for p in patches for fp in p.files})
        originals = {rel: (dest / rel).read_bytes() if (dest / rel).is_file() else None for rel in files}
        res = git_apply(originals, patches)
        if res.error:
            raise RuntimeError("error: git apply %s failed: %s; fix the patch" % (res.failed_patch, res.error))
        for rel, data in res.final.items():
            if data is None:
                (dest / rel).unlink(missing_ok=True)
            else:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(data)
        if patches is series.patches:
            for rel, h in series.manifest_files().items():
                if sha256_bytes(res.final.get(rel)) != h.get("patched_sha256"):
                    raise RuntimeError("error: %s after the series differs from its manifest; regenerate the "
                                       "series (tools/export.py --overlay)" % rel)
    return dest
