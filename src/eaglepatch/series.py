"""Series directories: `series`, `smoke.series`, patch files with a DEP-3-like header, manifest.json."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import unidiff

from .errors import UsageError

HEADER_FIELDS = ("Subject", "Description", "Why", "Origin", "Forwarded", "Last-Update", "Drop-When")
SEPARATOR = b"---\n"
PACKAGE = "sglang"
# How the project writes every diff body (export and the overlay's new-file patch alike).
DIFF_ARGS = ["--full-index", "--no-renames", "--no-color", "--no-ext-diff", "--no-textconv", "-U3",
             "--src-prefix=a/", "--dst-prefix=b/", "--diff-algorithm=myers", "--indent-heuristic"]


def slug(subject: str, limit: int = 52) -> str:
    """File-name part of a patch from its subject: NNNN-<slug>.patch."""
    s = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return (s[:limit].rstrip("-")) or "patch"


def sha256_bytes(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def split_lines(data: bytes) -> list[bytes]:
    """Split on b'\\n' only (as git does), keeping line endings; a last line may lack one."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


@dataclass
class Hunk:
    file: str
    index: int
    source_start: int
    source_length: int
    target_start: int
    target_length: int
    ops: list  # [(' '|'-'|'+', bytes line with its ending)]
    section: str = ""

    @property
    def old(self) -> list[bytes]:
        return [v for t, v in self.ops if t in " -"]

    @property
    def new(self) -> list[bytes]:
        return [v for t, v in self.ops if t in " +"]

    @property
    def added(self) -> int:
        return sum(1 for t, _ in self.ops if t == "+")

    @property
    def removed(self) -> int:
        return sum(1 for t, _ in self.ops if t == "-")

    def first_change(self) -> tuple[int, bool]:
        """(index into `old` of the first changed line, True if it is a pure insertion point)."""
        k = 0
        for t, _ in self.ops:
            if t == "-":
                return k, False
            if t == "+":
                return k, True
            k += 1
        return 0, True

    def core(self) -> tuple[int, list[bytes]]:
        """The old-side lines the hunk actually changes (start index into `old`, lines).

        For a pure insertion: the old lines right before and after the insertion point."""
        old = self.old
        idx = [i for i, (t, _) in enumerate(self._old_types()) if t == "-"]
        if idx:
            return idx[0], old[idx[0]: idx[-1] + 1]
        k, _ = self.first_change()
        lo, hi = max(0, k - 1), min(len(old), k + 1)
        return lo, old[lo:hi]

    def _old_types(self):
        return [(t, v) for t, v in self.ops if t in " -"]

    def reversed(self) -> "Hunk":
        swap = {"+": "-", "-": "+", " ": " "}
        return Hunk(self.file, self.index, self.target_start, self.target_length,
                    self.source_start, self.source_length,
                    [(swap[t], v) for t, v in self.ops], self.section)


@dataclass
class FilePatch:
    path: str
    is_new: bool
    is_deleted: bool
    hunks: list[Hunk]

    @property
    def added(self) -> int:
        return sum(h.added for h in self.hunks)

    @property
    def removed(self) -> int:
        return sum(h.removed for h in self.hunks)

    def reversed(self) -> "FilePatch":
        return FilePatch(self.path, self.is_deleted, self.is_new, [h.reversed() for h in self.hunks])


@dataclass
class Patch:
    name: str
    path: Path
    data: bytes
    header: str
    fields: dict
    body: bytes
    files: list[FilePatch]

    @property
    def subject(self) -> str:
        return self.fields.get("Subject", "")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def hunks(self) -> list[Hunk]:
        return [h for f in self.files for h in f.hunks]


def parse_header(text: str, where: str) -> dict:
    fields: dict[str, str] = {}
    last = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[:1] in " \t" and last:
            fields[last] += "\n" + line.strip()
            continue
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$", line)
        if not m:
            raise UsageError(f"malformed patch header in {where}: line {line!r} is not 'Field: value'",
                             "regenerate the series with tools/export.py")
        last = m.group(1)
        fields[last] = m.group(2)
    if not fields.get("Subject"):
        raise UsageError(f"malformed patch {where}: no 'Subject:' in its header",
                         "regenerate the series with tools/export.py")
    return fields


def _strip_prefix(p: str) -> str:
    return p[2:] if p[:2] in ("a/", "b/") else p


def parse_patch(data: bytes, name: str, path: Path | None = None) -> Patch:
    where = str(path or name)
    fix = "regenerate the series with tools/export.py"
    if data.startswith(SEPARATOR):
        head, body = b"", data[len(SEPARATOR):]
    else:
        pos = data.find(b"\n" + SEPARATOR)
        if pos < 0:
            raise UsageError(f"malformed patch {where}: no '---' line between header and diff", fix)
        head, body = data[: pos + 1], data[pos + 1 + len(SEPARATOR):]
    try:
        header = head.decode("utf-8")
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"malformed patch {where}: not UTF-8 text", fix) from None
    fields = parse_header(header, where)
    if not text.startswith("diff --git "):
        raise UsageError(f"malformed patch {where}: the diff does not start with 'diff --git'", fix)
    try:
        ps = unidiff.PatchSet(text)
    except Exception as exc:  # unidiff.UnidiffParseError and friends
        raise UsageError(f"malformed patch {where}: {exc}", fix) from None
    if len(ps) == 0 or text.count("\ndiff --git ") + 1 != len(ps):
        raise UsageError(f"malformed patch {where}: could not parse every file diff", fix)
    files = []
    for pf in ps:
        rel = _strip_prefix(pf.target_file if not pf.is_removed_file else pf.source_file)
        if rel.startswith("/") or ".." in rel.split("/") or not rel.startswith(PACKAGE + "/"):
            raise UsageError(f"malformed patch {where}: path {rel!r} is not inside the {PACKAGE}/ package",
                             "paths must be relative to the package parent, e.g. a/sglang/srt/...")
        hunks = []
        for i, h in enumerate(pf):
            ops: list = []
            for ln in h:
                t = ln.line_type
                if t == "\\":
                    if not ops:
                        raise UsageError(f"malformed patch {where}: stray 'No newline' marker", fix)
                    pt, pv = ops[-1]
                    ops[-1] = (pt, pv[:-1] if pv.endswith(b"\n") else pv)
                    continue
                if t not in " +-":
                    continue
                ops.append((t, ln.value.encode("utf-8")))
            hk = Hunk(rel, i, h.source_start, h.source_length, h.target_start, h.target_length, ops,
                      h.section_header or "")
            if len(hk.old) != h.source_length or len(hk.new) != h.target_length:
                raise UsageError(f"malformed patch {where}: hunk {i} of {rel} has wrong line counts", fix)
            hunks.append(hk)
        files.append(FilePatch(rel, pf.is_added_file, pf.is_removed_file, hunks))
    return Patch(name, path or Path(name), data, header, fields, body, files)


def read_series_list(path: Path) -> list[str]:
    names = []
    if not path.exists():
        return names
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


@dataclass
class Series:
    dir: Path
    release: str | None
    patches: list[Patch]
    smoke: list[Patch]
    manifest: dict | None = None
    _mhunks: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def series_version(self) -> str | None:
        return (self.manifest or {}).get("series_version")

    def files(self, smoke: bool = False) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.patches + (self.smoke if smoke else []):
            for f in p.files:
                seen.setdefault(f.path, None)
        return list(seen)

    def manifest_files(self) -> dict:
        return (self.manifest or {}).get("files", {})

    def manifest_hunk(self, patch: str, file: str, index: int) -> dict | None:
        if not self._mhunks and self.manifest:
            for p in self.manifest.get("patches", []):
                for h in p.get("hunks", []):
                    self._mhunks[(p.get("name"), h.get("file"), h.get("index"))] = h
        return self._mhunks.get((patch, file, index))


def load_manifest(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"malformed {path}: {exc}", "regenerate it with tools/export.py") from None
    if not isinstance(m, dict) or m.get("format") != 1 or not isinstance(m.get("files", {}), dict):
        raise UsageError(f"malformed {path}: not a format-1 manifest", "regenerate it with tools/export.py")
    return m


def dump_manifest(m: dict) -> str:
    return json.dumps(m, sort_keys=True, indent=2) + "\n"


def release_of_dir(d: Path) -> str | None:
    m = re.match(r"^sglang-(.+)$", d.name)
    return m.group(1) if m else None


def load_series(d: Path | str) -> Series:
    d = Path(d)
    if not d.is_dir():
        raise UsageError(f"series directory {d} does not exist", "pass --series patches/sglang-<release>")
    if not (d / "series").is_file():
        raise UsageError(f"{d} has no 'series' file", "pass a series directory such as patches/sglang-0.5.9")

    def load(names: list[str], listfile: str) -> list[Patch]:
        out = []
        for n in names:
            p = d / n
            if not p.is_file():
                raise UsageError(f"{d / listfile} names {n}, which does not exist",
                                 "fix the series file or regenerate it with tools/export.py")
            out.append(parse_patch(p.read_bytes(), n, p))
        return out

    patches = load(read_series_list(d / "series"), "series")
    smoke = load(read_series_list(d / "smoke.series"), "smoke.series")
    manifest = load_manifest(d / "manifest.json")
    release = (manifest or {}).get("release") or release_of_dir(d)
    return Series(d, release, patches, smoke, manifest)


def version_key(v: str):
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.\-+]", v))


def default_patches_root() -> Path:
    env = os.environ.get("EAGLEPATCH_PATCHES")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[2] / "patches"
    if here.is_dir():
        return here
    return Path.cwd() / "patches"


def available_series(root: Path | None = None) -> dict[str, Path]:
    """release -> series dir, oldest first; only dirs that hold a `series` file."""
    root = root or default_patches_root()
    found = {}
    if root.is_dir():
        for d in root.iterdir():
            r = release_of_dir(d)
            if r and (d / "series").is_file():
                found[r] = d
    return dict(sorted(found.items(), key=lambda kv: version_key(kv[0])))
