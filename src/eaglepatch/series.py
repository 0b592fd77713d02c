"""Series directories: `series`, `smoke.series`, patch files with a DEP-3-like header, manifest.json."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

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
            if b"\r\n" in data:
                raise UsageError(f"malformed patch {where}: it has CRLF (Windows) line endings",
                                 "convert it back to LF (dos2unix FILE, or git config core.autocrlf false and "
                                 "check it out again)")
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
    import unidiff  # here, not at the top: tools/test.py lists the series before any install

    try:
        ps = unidiff.PatchSet(text)
    except Exception as exc:  # unidiff.UnidiffParseError and friends
        why = " ".join(str(exc).split()) or exc.__class__.__name__
        raise UsageError(f"malformed patch {where}: {why}", fix) from None
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


def header_to_message(header: str) -> str:
    """Patch header -> commit message: the Subject value as first line, the other fields as body."""
    lines = header.splitlines(keepends=True)
    subj = next((i for i, ln in enumerate(lines) if ln.startswith("Subject:")), None)
    if subj is None:
        return header
    first = lines[subj][len("Subject:"):].strip()
    rest = "".join(lines[:subj] + lines[subj + 1:])
    return first + "\n" + ("\n" + rest if rest else "")


def message_to_header(message: str) -> str:
    """Commit message -> patch header (the inverse of header_to_message)."""
    if not message.endswith("\n"):
        message += "\n"
    if message.startswith("Subject:"):
        return message
    first, _, rest = message.partition("\n")
    if rest.startswith("\n"):
        rest = rest[1:]
    return f"Subject: {first.strip()}\n" + rest


def require_regular(path: Path, fix: str = "regenerate the series with tools/export.py") -> bool:
    """Whether `path` exists (following links); a FIFO, socket or device there is a one-line usage
    error, before anything opens it (reading a FIFO blocks forever)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", fix) from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise UsageError(f"{path} is not a regular file (a FIFO, socket or device)", fix)
    return True


def read_series_list(path: Path) -> list[str]:
    names = []
    if not require_regular(path):
        return names
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {getattr(exc, 'strerror', None) or 'not UTF-8 text'}",
                         "regenerate the series with tools/export.py") from None
    for line in text.splitlines():
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

    def require_patches(self) -> None:
        """Usage error for a series whose `series` file lists no patch (nothing to apply or verify)."""
        if not self.patches:
            raise UsageError(f"{self.dir}/series lists no patches, so there is nothing to apply or verify",
                             "list the patch files in it, or regenerate the series with tools/export.py")

    def manifest_files(self) -> dict:
        return (self.manifest or {}).get("files", {})

    def manifest_hunk(self, patch: str, file: str, index: int) -> dict | None:
        if not self._mhunks and self.manifest:
            for p in self.manifest.get("patches", []):
                for h in p.get("hunks", []):
                    self._mhunks[(p.get("name"), h.get("file"), h.get("index"))] = h
        return self._mhunks.get((patch, file, index))


def _manifest_problem(m) -> str | None:
    """What is wrong with a parsed manifest.json (None: a well-formed format-1 manifest)."""
    if not isinstance(m, dict) or m.get("format") != 1:
        return "not a format-1 manifest"
    for key in ("release", "series_version"):
        if key in m and not isinstance(m[key], str):
            return f"'{key}' is not a string"
    if not isinstance(m.get("capture_semantics", {}), dict):
        return "'capture_semantics' is not an object"
    files = m.get("files", {})
    if not isinstance(files, dict):
        return "'files' is not an object"
    for rel, h in files.items():
        if not isinstance(h, dict):
            return f"files[{rel!r}] is not an object"
        for key in ("upstream_sha256", "patched_sha256"):
            if not (h.get(key) is None or isinstance(h.get(key), str)):
                return f"files[{rel!r}].{key} is not a string or null"
    patches = m.get("patches", [])
    if not isinstance(patches, list):
        return "'patches' is not a list"
    for i, p in enumerate(patches):
        if not isinstance(p, dict) or not isinstance(p.get("hunks", []), list):
            return f"patches[{i}] is not an object with a 'hunks' list"
        for h in p.get("hunks", []):
            if not isinstance(h, dict):
                return f"patches[{i}] has a hunk that is not an object"
    return None


def load_manifest(path: Path) -> dict | None:
    if not require_regular(path):
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"malformed {path}: {' '.join(str(exc).split())}", "regenerate it with tools/export.py") \
            from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}", "fix its permissions") from None
    why = _manifest_problem(m)
    if why:
        raise UsageError(f"malformed {path}: {why}", "regenerate it with tools/export.py")
    return m


def dump_manifest(m: dict) -> str:
    return json.dumps(m, sort_keys=True, indent=2) + "\n"


def release_of_dir(d: Path) -> str | None:
    m = re.match(r"^sglang-(.+)$", d.name)
    return m.group(1) if m else None


def load_series(d: Path | str) -> Series:
    d = Path(os.path.expanduser(str(d)))
    if not str(d):
        raise UsageError("the series directory is empty", "pass --series patches/sglang-<release>")
    if d.is_file():
        raise UsageError(f"{d} is a file, not a series directory",
                         f"pass the directory that holds it: --series {d.parent}")
    if not d.is_dir():
        raise UsageError(f"series directory {d} does not exist", "pass --series patches/sglang-<release>")
    if not require_regular(d / "series") or not (d / "series").is_file():
        raise UsageError(f"{d} has no 'series' file", "pass a series directory such as patches/sglang-0.5.9")

    def load(names: list[str], listfile: str) -> list[Patch]:
        out = []
        for n in names:
            p = d / n
            if not require_regular(p) or not p.is_file():
                raise UsageError(f"{d / listfile} names {n}, which does not exist",
                                 "fix the series file or regenerate it with tools/export.py")
            try:
                data = p.read_bytes()
            except OSError as exc:
                raise UsageError(f"cannot read {p}: {exc.strerror}", "fix its permissions") from None
            out.append(parse_patch(data, n, p))
        return out

    patches = load(read_series_list(d / "series"), "series")
    smoke = load(read_series_list(d / "smoke.series"), "smoke.series")
    manifest = load_manifest(d / "manifest.json")
    release = (manifest or {}).get("release") or release_of_dir(d)
    return Series(d, release, patches, smoke, manifest)


RELEASE_RE = re.compile(r"^\d+(\.\d+)+((\.|-)?(post|rc|a|b|dev)\d+)*$")


def check_release(release: str, flag: str) -> str:
    """`release` if it looks like an sglang release number (e.g. 0.5.9, 0.5.15.post1), else a usage error."""
    if not isinstance(release, str) or not RELEASE_RE.match(release):
        raise UsageError(f"{flag} {release!r} is not a release number", f"pass {flag} like 0.5.9 or 0.5.15.post1")
    canon = canonical_release(release)
    if canon != release:
        raise UsageError(f"{flag} {release!r} is not a canonical release number (it names sglang {canon})",
                         f"pass {flag} {canon}")
    return release


def canonical_release(release: str) -> str:
    """`release` as the package index names it: no leading zeros in a number, and no trailing
    `.0` beyond three components (0.5.09 and 0.5.9.0 are both 0.5.9)."""
    m = re.match(r"^\d+(?:\.\d+)+", release)
    nums = [str(int(x)) for x in m.group(0).split(".")]
    while len(nums) > 3 and nums[-1] == "0":
        nums.pop()
    rest = re.sub(r"\d+", lambda d: str(int(d.group(0))), release[m.end():])
    return ".".join(nums) + rest


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


# ------------------------------------------------------------------------------------------
# the series catalogue: which series exist, which one serves a release

def available_series(root: Path | None = None) -> dict[str, Path]:
    """release -> series dir, oldest first; only dirs that hold a `series` file."""
    root = root or default_patches_root()
    found = {}
    try:
        entries = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        entries = []
    for d in entries:
        r = release_of_dir(d)
        if r and (d / "series").is_file():
            found[r] = d
    return dict(sorted(found.items(), key=lambda kv: version_key(kv[0])))


def nearest_older(release: str, releases) -> str | None:
    """The newest of `releases` that is `release` or older."""
    older = [r for r in releases if version_key(r) <= version_key(release)]
    return max(older, key=version_key) if older else None


def nearest_older_series(release: str, root: Path | None = None) -> tuple[str, Path] | None:
    """(release, dir) of the newest series made for `release` or an older release."""
    have = available_series(root)
    best = nearest_older(release, have)
    return (best, have[best]) if best else None


TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"


def tool_command(tool: str, *args) -> str:
    """`python3 <absolute path>/tools/<tool>.py ARGS`, quoted for a POSIX shell: a command to print
    as a next step that works from any current directory."""
    import shlex

    script = TOOLS_DIR / f"{tool}.py"
    if not script.is_file():  # the library without its clone: the tools' usual place
        script = Path("tools") / f"{tool}.py"
    return " ".join(shlex.quote(str(x)) for x in ["python3", script, *args])


def nearest_series_to(release: str, root: Path | None = None) -> tuple[str, str] | None:
    """(release, 'older' | 'newer') of the series to port to `release` when none is named: the
    newest series older than `release`, else the oldest one (a backwards port); None: no series."""
    have = [r for r in available_series(root) if r != release]
    older = [r for r in have if version_key(r) < version_key(release)]
    if older:
        return older[-1], "older"
    return (have[0], "newer") if have else None


def port_command(from_release: str, to_release: str) -> str:
    return tool_command("port", "--from", from_release, "--to", to_release)


def port_hint(release: str, root: Path | None = None) -> str:
    """The message for a release that has no series of its own."""
    near = nearest_older_series(release, root)
    if near is None:
        return f"no series is older than sglang {release}"
    return f"the nearest series is {near[1].name}; port it with: {port_command(near[0], release)}"
