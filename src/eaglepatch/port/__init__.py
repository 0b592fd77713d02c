"""3-way port of a series to another sglang release (`tools/port.py`), in five stages:

1. fetch (`port.fetch`): both upstream trees, the old series, and the proof that the old series
   applies exactly to its own release;
2. merge per hunk (`port.merge`): for every patch in order and every file it touches,
   `git merge-file` of the old patched file and the new upstream file over the old upstream file,
   once per hunk (which hunk conflicts) and once per file (the result);
3. drop what upstream has (`port.drop`): patches whose `Drop-When: sglang >= X` is met, hunks
   whose merge equals the new upstream file, patches left with no change;
4. write (`port.write`): the kept patches committed in a scratch git repository and exported
   with `eaglepatch.export`, then `patches/sglang-<new>/` written in one rename, only when
   every hunk merged;
5. review (`port.review`): a per-hunk table, a range-diff-like view of each old patch against
   its ported form, and a conflict report with the old patched, old upstream and new upstream
   sides.

The files the series creates are the package in `sglang-overlay/`, generated for the new release
(`port.stamp.new_file_content`). A hunk that conflicts only because upstream rewrote the
statements around it is placed by those statements (`port.relocate`) and listed for review.
"""

from __future__ import annotations

import datetime as _dt

from ..errors import RefusedError
from ..series import Series, nearest_older_series, port_hint
from .drop import drop_by_drop_when, drop_when_release, patch_outcome
from .fetch import check_base, load_old_series, open_release_tree
from .merge import Trees, apply_file, conflict_regions, merge_file, merge_patch
from .result import CONFLICT, DROPPED, LABELS, MERGED, UPSTREAM, HunkPort, PatchPort, PortResult
from .review import conflict_report, hunk_table, review
from .semantics import DEEPSEEK, declared_semantics, detect_capture_semantics, record_semantics, series_semantics
from .stamp import new_file_content, stamp
from .write import export_ported, write_json, write_series

__all__ = ["port_series", "PortResult", "HunkPort", "PatchPort", "MERGED", "UPSTREAM", "CONFLICT", "DROPPED",
           "LABELS", "merge_file", "conflict_regions", "apply_file", "drop_when_release", "stamp",
           "new_file_content", "detect_capture_semantics", "series_semantics", "review", "hunk_table",
           "conflict_report", "write_series", "write_json", "load_old_series", "open_release_tree",
           "nearest_older_series", "port_hint"]


def created_files(res: PortResult, upstream_semantics: dict, to_release: str, series_version: str) -> dict:
    """The package the ported series adds: sglang-overlay/ for the new release, whose
    release.py records how unpatched sglang of that release (`upstream_semantics`) reads draft ids."""
    from ..overlay import DEFAULT_UPSTREAM_MAPPING, release_files

    mapping = upstream_semantics.get("eagle_id_to_capture_index")
    if mapping not in ("plus_one", "plus_one_if_first_is_one"):
        res.notes.append(f"cannot tell how unpatched sglang {to_release} maps draft ids ({mapping}); the "
                         f"package's warning assumes '{DEFAULT_UPSTREAM_MAPPING}'")
        mapping = DEFAULT_UPSTREAM_MAPPING
    return release_files(to_release, series_version, mapping)


def port_series(old: Series, old_read, new_read, from_release: str, to_release: str,
                date: str | None = None, series_version: str | None = None) -> PortResult:
    """Port `old` (made for `old_read`, the old upstream) to `new_read` (the new upstream)."""
    res = PortResult(old, from_release, to_release)
    series_version = series_version or f"{to_release}-1"
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    check_base(old, old_read, from_release)                                   # 1. fetch
    trees = Trees(old_read, new_read)
    up_new = detect_capture_semantics(trees.upstream(DEEPSEEK))
    trees.created = created_files(res, up_new, to_release, series_version)
    kept: list[tuple] = []  # (patch, the new files after it)
    for patch in old.patches + old.smoke:
        if drop_by_drop_when(res, patch, patch in old.smoke, to_release):     # 3. drop (Drop-When)
            for fp in patch.files:
                trees.old_state[fp.path] = apply_file(trees.old(fp.path), fp)
            continue
        conflicted, changed = merge_patch(res, trees, patch, to_release, series_version)  # 2. merge (+ 3.)
        outcome = patch_outcome(patch, conflicted, changed)
        res.patches.append(outcome)
        if outcome.status == "ported":
            kept.append((patch, dict(trees.new_state)))
    record_semantics(res, (old.manifest or {}).get("capture_semantics"), old_read, trees, up_new,
                     declared_semantics(old, to_release))
    if not res.clean:
        return res
    if not kept:
        raise RefusedError(f"nothing of {old.dir.name} is left for sglang {to_release} (every patch was dropped)",
                           "no series is needed for that release")
    res.files = export_ported(kept, trees.new_upstream, to_release, series_version, res.semantics, date, res,
                              trees.created)  # 4.
    return res
