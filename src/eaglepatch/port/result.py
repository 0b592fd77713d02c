"""What a port produces: a status per hunk and per patch, conflicts, the new series' files."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..series import Series

MERGED = "merged"
RELOCATED = "relocated"  # merged by statement neighbours after a context-only conflict (review it)
UPSTREAM = "already upstream"
CONFLICT = "conflict"
DROPPED = "dropped"

LABELS = ("old patched", "old upstream", "new upstream")  # the three sides of every merge


@dataclass
class HunkPort:
    patch: str
    file: str
    index: int
    anchor: str
    status: str  # MERGED | RELOCATED | UPSTREAM | CONFLICT | DROPPED
    detail: str = ""
    line: int | None = None  # 1-based line in the new file (merged) or near the conflict
    sides: dict = field(default_factory=dict)  # conflict: label -> text
    review: str = ""  # a note for a clean hunk whose enclosing code changed upstream

    def as_dict(self) -> dict:
        return {"patch": self.patch, "file": self.file, "hunk": self.index, "anchor": self.anchor,
                "status": self.status, "detail": self.detail, "line": self.line, "sides": self.sides,
                "review": self.review}


@dataclass
class PatchPort:
    name: str
    subject: str
    status: str  # 'ported' | 'dropped' | 'conflict'
    reason: str = ""
    new_name: str | None = None


@dataclass
class PortResult:
    old: Series
    from_release: str
    to_release: str
    hunks: list = field(default_factory=list)
    patches: list = field(default_factory=list)
    file_conflicts: list = field(default_factory=list)  # (patch, file, detail, sides)
    files: dict = field(default_factory=dict)  # exported series: name -> bytes (clean only)
    semantics: dict = field(default_factory=dict)
    upstream_semantics: dict = field(default_factory=dict)  # release -> detected upstream semantics
    notes: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.file_conflicts and all(h.status != CONFLICT for h in self.hunks)

    @property
    def conflict_count(self) -> int:
        return sum(1 for h in self.hunks if h.status == CONFLICT) + len(self.file_conflicts)

    def as_dict(self) -> dict:
        return {"from": self.from_release, "to": self.to_release, "clean": self.clean,
                "patches": [p.__dict__ for p in self.patches], "hunks": [h.as_dict() for h in self.hunks],
                "file_conflicts": [{"patch": p, "file": f, "detail": d, "sides": s}
                                   for p, f, d, s in self.file_conflicts],
                "capture_semantics": self.semantics, "upstream_capture_semantics": self.upstream_semantics,
                "notes": self.notes}
