"""Stage 1, fetch: the two upstream trees, the old series, and the proof that the old series
applies to the release it was made for (a port from a wrong base would merge garbage)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..fetch import unpacked_release
from ..series import Series, available_series, check_release, default_patches_root, load_series
from ..tree import UpstreamTree
from ..verdicts import check_series


def open_release_tree(root: Path | None, release: str | None, which: str) -> tuple[UpstreamTree, str]:
    """(tree, release) for `--{which}` RELEASE (fetched from the package index and cached) or
    `--{which}-tree` ROOT (a local tree; RELEASE, when given too, must match it)."""
    if release is not None:
        check_release(release, f"--{which}")
    if root is not None:
        t = UpstreamTree.open(root)
        rel = release or t.release
        if rel is None:
            raise UsageError(f"cannot tell the sglang release of {t.root}", f"pass --{which} RELEASE")
        if release and t.release and release != t.release:
            raise UsageError(f"--{which} {release} but {t.root} holds sglang {t.release}",
                             f"drop --{which} or pass the matching tree")
        return t, rel
    if not release:
        raise UsageError(f"--{which} is missing", f"pass --{which} RELEASE or --{which}-tree ROOT")
    pp = unpacked_release(release)
    return UpstreamTree("installed", pp, pp, release, "dist-info"), release


def load_old_series(from_release: str | None, series_dir: Path | None) -> Series:
    if series_dir is not None:
        return load_series(series_dir)
    d = default_patches_root() / f"sglang-{from_release}"
    if not (d / "series").is_file():
        have = ", ".join(p.name for p in available_series().values()) or "none"
        raise UsageError(f"there is no series for sglang {from_release} (series that exist: {have})",
                         "pass --from with a release that has a series, or --series DIR")
    return load_series(d)


def check_base(old: Series, old_read, from_release: str) -> None:
    """Every hunk of the old series (product and smoke) lands exactly on its own release."""
    chk = check_series(old_read, old.patches + old.smoke, None)
    bad = [v for v in chk.verdicts if not v.ok]
    if bad:
        v = bad[0]
        raise UsageError(f"series {old.dir.name} does not apply to its own base sglang {from_release}: "
                         f"{v.patch} {v.file} hunk {v.hunk} is '{v.label}'",
                         "port from the release the series was made for (pass --from-tree with that release)")
