"""Stage 3, drop what upstream has: a patch whose `Drop-When: sglang >= X` is met, a hunk whose
3-way merge equals the new upstream file, a created file the new release ships as is, and a
patch left with no change."""

from __future__ import annotations

import re

from ..series import Patch, version_key
from .result import DROPPED, HunkPort, PatchPort, PortResult

DROP_WHEN_RE = re.compile(r"sglang\s*>=\s*(\d[\w.\-+]*)")


def drop_when_release(patch: Patch) -> str | None:
    m = DROP_WHEN_RE.search(patch.fields.get("Drop-When", ""))
    return m.group(1) if m else None


def drop_by_drop_when(res: PortResult, patch: Patch, is_smoke: bool, to_release: str) -> bool:
    """Record `patch` as dropped when its Drop-When is met by `to_release` (product patches only)."""
    drop_at = drop_when_release(patch)
    if not drop_at or is_smoke or version_key(to_release) < version_key(drop_at):
        return False
    for fp in patch.files:
        for h in fp.hunks:
            res.hunks.append(HunkPort(patch.name, fp.path, h.index, "-", DROPPED, f"Drop-When: sglang >= {drop_at}"))
    res.patches.append(PatchPort(patch.name, patch.subject, "dropped",
                                 f"its Drop-When says sglang >= {drop_at}; the target is {to_release}"))
    return True


def upstream_has(merged: bytes, theirs: bytes | None) -> bool:
    """A clean merge that changes nothing in the new upstream file: upstream already has it."""
    return merged == theirs


def patch_outcome(patch: Patch, conflicted: bool, changed_any: bool) -> PatchPort:
    if conflicted:
        return PatchPort(patch.name, patch.subject, "conflict")
    if not changed_any:
        return PatchPort(patch.name, patch.subject, "dropped", "every hunk is already in the new release")
    return PatchPort(patch.name, patch.subject, "ported")
