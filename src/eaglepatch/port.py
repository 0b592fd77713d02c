"""3-way port of a series to another sglang release (`tools/port.py`).

For every patch of the old series, in order, and every file it touches:

  base   = the old upstream file with the earlier old patches applied
  ours   = base with this patch applied (the old patched file)
  theirs = the new upstream file with the earlier *ported* patches applied

`git merge-file` merges ours and theirs over base, once per hunk (to tell which hunk conflicts,
and which hunk upstream now contains) and once for the whole patch (the result). A hunk whose
merge equals theirs is already upstream and is dropped; a patch whose `Drop-When:` says
`sglang >= X` is dropped when the new release is X or later; a patch left with no change is
dropped. The ported series is committed in a scratch git repository and exported with
`eaglepatch.export` (same bytes as tools/export.py would write), then written to
`patches/sglang-<new>/` in one rename, only when every hunk merged. Otherwise nothing is written
and a per-hunk conflict report shows the old patched side, the old upstream side and the new
upstream side.
"""

from __future__ import annotations

import ast
import datetime as _dt
import difflib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .anchors import anchor_at, hunk_anchor_line
from .errors import RefusedError, UsageError
from .series import Hunk, Patch, Series, available_series, default_patches_root, load_series, split_lines, version_key
from .verdicts import check_hunk, check_series

MERGED = "merged"
UPSTREAM = "already upstream"
CONFLICT = "conflict"
DROPPED = "dropped"

LABELS = ("old patched", "old upstream", "new upstream")
STAMP_RE = re.compile(rb'^(SERIES_RELEASE|SERIES_VERSION) = "([^"\n]*)"$', re.M)
DROP_WHEN_RE = re.compile(r"sglang\s*>=\s*(\d[\w.\-+]*)")
DEEPSEEK = "sglang/srt/models/deepseek_v2.py"


# ------------------------------------------------------------------------------------------
# results

@dataclass
class HunkPort:
    patch: str
    file: str
    index: int
    anchor: str
    status: str  # MERGED | UPSTREAM | CONFLICT | DROPPED
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

    def as_dict(self) -> dict:
        return {"from": self.from_release, "to": self.to_release, "clean": self.clean,
                "patches": [p.__dict__ for p in self.patches], "hunks": [h.as_dict() for h in self.hunks],
                "file_conflicts": [{"patch": p, "file": f, "detail": d, "sides": s}
                                   for p, f, d, s in self.file_conflicts],
                "capture_semantics": self.semantics, "upstream_capture_semantics": self.upstream_semantics,
                "notes": self.notes}


# ------------------------------------------------------------------------------------------
# git merge-file

def merge_file(ours: bytes, base: bytes, theirs: bytes) -> tuple[int, bytes]:
    """(number of conflicts, merged bytes with diff3 conflict markers) from `git merge-file`."""
    with tempfile.TemporaryDirectory(prefix="eaglepatch-merge-") as td:
        paths = []
        for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = Path(td) / name
            p.write_bytes(data)
            paths.append(str(p))
        cmd = ["git", "merge-file", "-p", "--diff3"]
        for lab in LABELS:
            cmd += ["-L", lab]
        r = subprocess.run(cmd + paths, capture_output=True)
    if r.returncode < 0 or r.returncode > 127:
        raise UsageError(f"git merge-file failed: {r.stderr.decode(errors='replace').strip()}",
                         "install git 2.x and check the input files")
    return r.returncode, r.stdout


def conflict_regions(merged: bytes) -> list[dict]:
    """[{line (1-based in the merged output), label -> text}] of each diff3 conflict region."""
    out, cur, key = [], None, None
    for n, ln in enumerate(split_lines(merged), 1):
        s = ln.decode("utf-8", errors="replace")
        if s.startswith("<<<<<<< " + LABELS[0]):
            cur, key = {"line": n, LABELS[0]: "", LABELS[1]: "", LABELS[2]: ""}, LABELS[0]
        elif cur is not None and s.startswith("||||||| " + LABELS[1]):
            key = LABELS[1]
        elif cur is not None and s.rstrip("\n") == "=======":
            key = LABELS[2]
        elif cur is not None and s.startswith(">>>>>>> " + LABELS[2]):
            out.append(cur)
            cur = None
        elif cur is not None:
            cur[key] += s
    return out


# ------------------------------------------------------------------------------------------
# capture semantics (how a draft-config id maps to a captured layer)

def _func(tree: ast.AST, cls: str, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    return None


def detect_capture_semantics(deepseek_source: bytes | None) -> dict:
    """What `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture` of this file does with draft ids.

    eagle_id_to_capture_index: 'plus_one' (capture index = id + 1, id -1 = embedding output),
    'plus_one_if_first_is_one' (+1 only when the first id is 1, else the ids are capture indices),
    'identity', 'eagle3_capture' (delegated to the series' package), or 'unknown'.
    capture_site: 'model_loop' (DeepseekV2Model.forward appends hidden + residual) or
    'decoder_layer' (the layer's boundary captures into captured_last_layer_outputs)."""
    if deepseek_source is None:
        return {"eagle_id_to_capture_index": "unknown", "capture_site": "unknown"}
    try:
        tree = ast.parse(deepseek_source)
    except SyntaxError:
        return {"eagle_id_to_capture_index": "unknown", "capture_site": "unknown"}
    fn = _func(tree, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture")
    mapping = "unknown"
    if fn is not None:
        # only the statements before an unconditional `return <call>` can run
        body_nodes = []
        for stmt in fn.body:
            body_nodes.append(stmt)
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                break
        delegated = plus_one = first_is_one = identity = False
        for stmt in body_nodes:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "set_eagle3_layers" and "eagle3_capture" in ast.unparse(node.func):
                    delegated = True
                if isinstance(node, ast.ListComp) and isinstance(node.elt, ast.BinOp) and \
                        isinstance(node.elt.op, ast.Add) and isinstance(node.elt.right, ast.Constant) and \
                        node.elt.right.value == 1:
                    plus_one = True
                if isinstance(node, ast.Compare) and "layer_ids[0]" in ast.unparse(node) and \
                        any(isinstance(c, ast.Constant) and c.value == 1 for c in node.comparators):
                    first_is_one = True
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list" \
                        and node.args and ast.unparse(node.args[0]) == "layer_ids":
                    identity = True
        if delegated:
            mapping = "eagle3_capture"
        elif plus_one and first_is_one:
            mapping = "plus_one_if_first_is_one"
        elif plus_one:
            mapping = "plus_one"
        elif identity:
            mapping = "identity"
    site = "unknown"
    fwd = _func(tree, "DeepseekV2Model", "forward")
    if fwd is not None:
        src = ast.unparse(fwd)
        if "captured_last_layer_outputs" in src:
            site = "decoder_layer"
        elif "aux_hidden_states.append" in src:
            site = "model_loop"
    return {"eagle_id_to_capture_index": mapping, "capture_site": site}


def series_semantics(upstream: dict, patched: dict, old_semantics: dict | None) -> dict:
    """capture_semantics of a ported series: the patched mapping (what users get), the mapping of
    the unpatched release, where capture happens, and capture index -> HF index (identity: both
    count the residual stream entering layer i, index 0 = embedding output)."""
    old = dict(old_semantics or {})
    mapping = patched.get("eagle_id_to_capture_index")
    if mapping == "eagle3_capture":  # the package keeps the series' convention
        mapping = old.get("eagle_id_to_capture_index", "plus_one")
    return {"eagle_id_to_capture_index": mapping or "unknown",
            "capture_index_to_hf_index": old.get("capture_index_to_hf_index", "identity"),
            "upstream_eagle_id_to_capture_index": upstream.get("eagle_id_to_capture_index", "unknown"),
            "capture_site": upstream.get("capture_site", "unknown")}


# ------------------------------------------------------------------------------------------
# helpers

def drop_when_release(patch: Patch) -> str | None:
    m = DROP_WHEN_RE.search(patch.fields.get("Drop-When", ""))
    return m.group(1) if m else None


def stamp(data: bytes, release: str, series_version: str) -> bytes:
    """Set SERIES_RELEASE / SERIES_VERSION string constants in a file the series creates."""
    def sub(m):
        val = release if m.group(1) == b"SERIES_RELEASE" else series_version
        return m.group(1) + b' = "' + val.encode() + b'"'
    return STAMP_RE.sub(sub, data)


def apply_hunk(lines: list[bytes], h: Hunk) -> tuple[list[bytes], int]:
    """`lines` with hunk `h` applied at its exact (zero-fuzz) place; (new lines, 0-based position)."""
    expected = h.source_start - 1 if h.source_length else h.source_start
    v, pos, detail = check_hunk(lines, h, max(expected, 0))
    if pos is None or v not in ("exact", "offset"):
        raise UsageError(f"hunk {h.index} of {h.file} does not apply to its own base ({v}: {detail})",
                         "verify the old series against its release first (tools/verify.py)")
    return lines[:pos] + h.new + lines[pos + len(h.old):], pos


def _text(lines) -> str:
    return "".join(x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in lines)


def _header_with(patch: Patch, updates: dict) -> str:
    out, seen = [], set()
    lines = patch.header.splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):", ln)
        if m and m.group(1) in updates:
            seen.add(m.group(1))
            out.append(f"{m.group(1)}: {updates[m.group(1)]}")
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "\t"):
                i += 1
            continue
        out.append(ln)
        i += 1
    for k, v in updates.items():
        if k not in seen:
            out.append(f"{k}: {v}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------
# the port

def port_series(old: Series, old_read, new_read, from_release: str, to_release: str,
                date: str | None = None, series_version: str | None = None) -> PortResult:
    """Port `old` (made for `old_read`, the old upstream) to `new_read` (the new upstream)."""
    from .export import build_export  # noqa: F401  (imported here: it needs GitPython)

    res = PortResult(old, from_release, to_release)
    series_version = series_version or f"{to_release}-1"
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    chk = check_series(old_read, old.patches + old.smoke, None)
    bad = [v for v in chk.verdicts if not v.ok]
    if bad:
        v = bad[0]
        raise UsageError(f"series {old.dir.name} does not apply to its own base sglang {from_release}: "
                         f"{v.patch} {v.file} hunk {v.hunk} is '{v.label}'",
                         "port from the release the series was made for (pass --from-tree with that release)")
    old_state: dict[str, bytes | None] = {}
    new_state: dict[str, bytes | None] = {}
    new_upstream: dict[str, bytes | None] = {}

    def old_cur(path):
        if path not in old_state:
            old_state[path] = old_read(path)
        return old_state[path]

    def new_cur(path):
        if path not in new_state:
            new_state[path] = new_upstream.setdefault(path, new_read(path))
        return new_state[path]

    snapshots: list[tuple[Patch, dict]] = []  # kept patch -> new_state after it
    for patch in old.patches + old.smoke:
        is_smoke = patch in old.smoke
        drop_at = drop_when_release(patch)
        if drop_at and not is_smoke and version_key(to_release) >= version_key(drop_at):
            for fp in patch.files:
                old_after = _apply_file(old_cur(fp.path), fp)
                old_state[fp.path] = old_after
                for h in fp.hunks:
                    res.hunks.append(HunkPort(patch.name, fp.path, h.index, "-", DROPPED,
                                              f"Drop-When: sglang >= {drop_at}"))
            res.patches.append(PatchPort(patch.name, patch.subject, "dropped",
                                         f"its Drop-When says sglang >= {drop_at}; the target is {to_release}"))
            continue
        conflicted = False
        changed_any = False
        for fp in patch.files:
            base = old_cur(fp.path)
            ours = _apply_file(base, fp)
            theirs = new_cur(fp.path)
            old_state[fp.path] = ours
            if fp.is_new:
                content = stamp(ours, to_release, series_version)
                if theirs is None:
                    new_state[fp.path] = content
                    changed_any = True
                    for h in fp.hunks:
                        res.hunks.append(HunkPort(patch.name, fp.path, h.index, "<module>", MERGED,
                                                  "new file", 1))
                elif theirs == content:
                    for h in fp.hunks:
                        res.hunks.append(HunkPort(patch.name, fp.path, h.index, "<module>", UPSTREAM,
                                                  "the new release has this file with the same content"))
                else:
                    conflicted = True
                    for h in fp.hunks:
                        res.hunks.append(HunkPort(patch.name, fp.path, h.index, "<module>", CONFLICT,
                                                  "the new release has a file of this name with other content",
                                                  1, {LABELS[0]: _text([content]), LABELS[1]: "",
                                                      LABELS[2]: _text([theirs])}))
                continue
            if fp.is_deleted:
                if theirs is None:
                    res.hunks += [HunkPort(patch.name, fp.path, h.index, "<module>", UPSTREAM,
                                           "the new release no longer has this file") for h in fp.hunks]
                elif theirs == base:
                    new_state[fp.path] = None
                    changed_any = True
                    res.hunks += [HunkPort(patch.name, fp.path, h.index, "<module>", MERGED, "file deleted")
                                  for h in fp.hunks]
                else:
                    conflicted = True
                    res.hunks += [HunkPort(patch.name, fp.path, h.index, "<module>", CONFLICT,
                                           "the file to delete changed upstream") for h in fp.hunks]
                continue
            if theirs is None:
                conflicted = True
                for h in fp.hunks:
                    res.hunks.append(HunkPort(patch.name, fp.path, h.index, _anchor(base, h), CONFLICT,
                                              "the new release has no such file"))
                continue
            base_lines = split_lines(base)
            hunk_ok = True
            for h in fp.hunks:
                one, pos = apply_hunk(base_lines, h)
                anchor = _anchor(base, h, pos)
                n, merged = merge_file(b"".join(one), base, theirs)
                if n:
                    hunk_ok = False
                    regions = conflict_regions(merged)
                    sides = {k: v for k, v in regions[0].items() if k != "line"} if regions else {}
                    res.hunks.append(HunkPort(patch.name, fp.path, h.index, anchor, CONFLICT,
                                              f"{n} conflict region(s) in the 3-way merge",
                                              regions[0]["line"] if regions else None, sides))
                elif merged == theirs:
                    res.hunks.append(HunkPort(patch.name, fp.path, h.index, anchor, UPSTREAM,
                                              "the new upstream file already has this change"))
                else:
                    res.hunks.append(HunkPort(patch.name, fp.path, h.index, anchor, MERGED))
            if not hunk_ok:
                conflicted = True
                continue
            n, merged = merge_file(ours, base, theirs)
            if n:
                conflicted = True
                regions = conflict_regions(merged)
                res.file_conflicts.append((patch.name, fp.path,
                                           f"each hunk merges alone but together they conflict ({n} region(s))",
                                           {k: v for k, v in regions[0].items() if k != "line"} if regions else {}))
                continue
            if merged != theirs:
                changed_any = True
            new_state[fp.path] = merged
            _locate(res, patch.name, fp.path, theirs, merged, base)
        if conflicted:
            res.patches.append(PatchPort(patch.name, patch.subject, "conflict"))
        elif not changed_any:
            res.patches.append(PatchPort(patch.name, patch.subject, "dropped",
                                         "every hunk is already in the new release"))
        else:
            res.patches.append(PatchPort(patch.name, patch.subject, "ported"))
            snapshots.append((patch, dict(new_state)))

    up_old = detect_capture_semantics(old_read(DEEPSEEK))
    up_new = detect_capture_semantics(new_upstream.get(DEEPSEEK, new_read(DEEPSEEK)))
    res.upstream_semantics = {from_release: up_old, to_release: up_new}
    old_sem = (old.manifest or {}).get("capture_semantics")
    if res.clean:
        patched_new = detect_capture_semantics(new_state.get(DEEPSEEK, new_upstream.get(DEEPSEEK)))
    else:
        patched_new = {"eagle_id_to_capture_index": "unknown"}
    res.semantics = series_semantics(up_new, patched_new, old_sem)
    if up_old.get("eagle_id_to_capture_index") != up_new.get("eagle_id_to_capture_index"):
        mine = (f"the ported series maps them '{res.semantics['eagle_id_to_capture_index']}' (recorded in "
                f"manifest.json capture_semantics)" if res.clean else
                "decide the mapping of the new series when resolving the conflicts, and record it in its "
                "manifest.json capture_semantics")
        res.notes.append(
            f"upstream changed how draft-config ids map to captured layers: sglang {from_release} "
            f"'{up_old.get('eagle_id_to_capture_index')}', sglang {to_release} "
            f"'{up_new.get('eagle_id_to_capture_index')}'; {mine}")
    if up_old.get("capture_site") != up_new.get("capture_site"):
        res.notes.append(f"upstream moved the capture: '{up_old.get('capture_site')}' in sglang {from_release}, "
                         f"'{up_new.get('capture_site')}' in sglang {to_release}; review the capture hooks")
    if not res.clean:
        return res
    if not snapshots:
        raise RefusedError(f"nothing of {old.dir.name} is left for sglang {to_release} (every patch was dropped)",
                           "no series is needed for that release")
    res.files = _export(snapshots, new_upstream, to_release, series_version, res.semantics, date, res)
    return res


def _apply_file(data: bytes | None, fp) -> bytes | None:
    if fp.is_new:
        return b"".join(b"".join(h.new) for h in fp.hunks)
    if fp.is_deleted:
        return None
    lines = split_lines(data)
    for h in reversed(fp.hunks):  # from the bottom: earlier positions stay valid
        lines, _ = apply_hunk(lines, h)
    return b"".join(lines)


def _anchor(source: bytes, h: Hunk, pos: int | None = None) -> str:
    if pos is None:
        pos = h.source_start - 1 if h.source_length else h.source_start
    k, ins = h.first_change()
    return anchor_at(source, hunk_anchor_line(pos, k, ins))[0]


def _locate(res: PortResult, patch: str, path: str, theirs: bytes, merged: bytes, base: bytes) -> None:
    """Fill in where each merged hunk of (patch, path) landed, and flag changed enclosing code."""
    sm = difflib.SequenceMatcher(a=split_lines(theirs), b=split_lines(merged), autojunk=False)
    starts = [j1 + 1 for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]
    merged_hunks = [h for h in res.hunks if h.patch == patch and h.file == path and h.status == MERGED]
    for h, line in zip(merged_hunks, starts):
        h.line = line
        if h.anchor in ("<module>", "-"):
            continue
        before = anchor_at(base, _def_line(base, h.anchor))[1] if _def_line(base, h.anchor) else None
        after_line = _def_line(theirs, h.anchor)
        after = anchor_at(theirs, after_line)[1] if after_line else None
        if after_line is None:
            h.review = f"{h.anchor} no longer exists upstream"
        elif before != after:
            h.review = f"the body of {h.anchor} changed upstream; review what the hook now does"


def _def_line(source: bytes, qualname: str) -> int | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    parts = qualname.split(".")

    def find(nodes, i):
        for node in nodes:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == parts[i]:
                return node.lineno if i == len(parts) - 1 else find(node.body, i + 1)
        return None

    return find(tree.body, 0)


def _export(snapshots, new_upstream, to_release, series_version, semantics, date, res) -> dict:
    from .applier import header_to_message
    from .export import build_export
    from .fetch import FIXED_DATE, git_env

    tmp = Path(tempfile.mkdtemp(prefix="eaglepatch-port-"))
    try:
        env = git_env({"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE,
                       "GIT_CEILING_DIRECTORIES": str(tmp)})

        def git(*args):
            r = subprocess.run(["git", *args], cwd=tmp, env=env, capture_output=True)
            if r.returncode != 0:
                raise RuntimeError(f"git {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
            return r.stdout

        def write(state):
            for rel, data in state.items():
                p = tmp / rel
                if data is None:
                    if p.exists():
                        p.unlink()
                        git("rm", "-q", "--cached", "--", rel)
                    continue
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
                git("add", "--", rel)

        git("init", "-q", "-b", "port")
        write({k: v for k, v in new_upstream.items() if v is not None})
        git("-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", f"sglang {to_release}")
        git("tag", f"v{to_release}")
        for patch, state in snapshots:
            write(state)
            msg = header_to_message(_header_with(patch, {"Last-Update": date}))
            mf = tmp / ".git" / "PORT_MSG"
            mf.write_bytes(msg.encode("utf-8"))
            git("-c", "commit.gpgsign=false", "commit", "-q", "--cleanup=verbatim", "-F", str(mf))
        exp = build_export(tmp, f"v{to_release}", release=to_release, series_version=series_version,
                           previous_manifest={"capture_semantics": semantics, "series_version": series_version})
        names = exp.product + exp.smoke
        for pp, (patch, _) in zip([p for p in res.patches if p.status == "ported"], snapshots):
            pp.new_name = names[[q for q, _ in snapshots].index(patch)]
        return exp.files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# writing

def write_series(out: Path, files: dict, force: bool = False) -> None:
    """Write the series dir in one rename: a complete new dir, or nothing."""
    out = Path(out)
    if out.exists() and not force:
        raise RefusedError(f"{out} already exists", "pass --force to replace it, or --out DIR")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.port-", dir=out.parent))
    old = None
    try:
        for name, data in sorted(files.items()):
            (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old, out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# reports

def _normalized(patch_bytes: bytes) -> list[str]:
    """A patch without its header, index lines and hunk line numbers (what range-diff compares)."""
    body = patch_bytes.split(b"\n---\n", 1)[-1].decode("utf-8", errors="replace")
    out = []
    for ln in body.splitlines():
        if ln.startswith("index "):
            continue
        if ln.startswith("@@"):
            m = re.match(r"^@@ [^@]* @@ ?(.*)$", ln)
            ln = "@@ " + (m.group(1) if m else "")
        out.append(ln)
    return out


def review(res: PortResult, new_dir_files: dict | None = None) -> str:
    """Range-diff-like view: each old patch against its ported form (or why it is gone)."""
    files = new_dir_files if new_dir_files is not None else res.files
    out = [f"review: {res.old.dir.name} (sglang {res.from_release}) -> sglang-{res.to_release}"
           f" (range-diff style: '=' same change, '!' changed, '<' dropped, 'x' conflict)"]
    for i, pp in enumerate(res.patches, 1):
        old_patch = next(p for p in res.old.patches + res.old.smoke if p.name == pp.name)
        if pp.status == "dropped":
            out.append(f"  {i}: {pp.name} < -: dropped: {pp.reason}")
            continue
        if pp.status == "conflict":
            out.append(f"  {i}: {pp.name} x -: does not merge (see the conflict report)")
            continue
        if not files:  # not exported: the port has conflicts elsewhere
            out.append(f"  {i}: {pp.name} ~ -: merges (not exported: other patches conflict)")
            continue
        new = files.get(pp.new_name) if pp.new_name else None
        a = _normalized(old_patch.data)
        b = _normalized(new) if new is not None else []
        same = a == b
        j = (pp.new_name or "-").split("-", 1)[0].lstrip("0") or "-"
        out.append(f"  {i}: {pp.name} {'=' if same else '!'} {j}: {pp.new_name}   {pp.subject}")
        if not same:
            for ln in list(difflib.unified_diff(a, b, lineterm="", n=1))[2:]:
                out.append("      " + ln)
    for h in res.hunks:
        if h.status == UPSTREAM:
            out.append(f"  dropped hunk: {h.patch} {h.file} hunk {h.index} [{h.anchor}]: {h.detail}")
    for h in res.hunks:
        if h.review:
            out.append(f"  review: {h.patch} {h.file} hunk {h.index}: {h.review}")
    for n in res.notes:
        out.append(f"  note: {n}")
    return "\n".join(out)


def hunk_table(res: PortResult) -> str:
    from .report import table

    rows = [[h.patch, h.file, str(h.index), h.anchor, h.status + (f" @{h.line}" if h.line and h.status == MERGED
                                                                    else ""), h.detail]
            for h in res.hunks]
    return table(rows, ["patch", "file", "hunk", "anchor", "result", "detail"])


def conflict_report(res: PortResult) -> str:
    out = [f"conflicts porting {res.old.dir.name} to sglang {res.to_release} (nothing was written):"]

    def sides(d):
        for lab in LABELS:
            txt = d.get(lab, "")
            out.append(f"    --- {lab} ({len(txt.splitlines())} line(s)):")
            out.extend("    | " + ln for ln in txt.splitlines())

    for h in res.hunks:
        if h.status != CONFLICT:
            continue
        where = f" near line {h.line} of the merge" if h.line else ""
        out.append(f"  CONFLICT {h.patch} {h.file} hunk {h.index} [{h.anchor}]{where}: {h.detail}")
        if h.sides:
            sides(h.sides)
    for p, f, d, s in res.file_conflicts:
        out.append(f"  CONFLICT {p} {f}: {d}")
        sides(s)
    return "\n".join(out)


# ------------------------------------------------------------------------------------------
# series lookup

def nearest_older_series(release: str, root: Path | None = None) -> tuple[str, Path] | None:
    """(release, dir) of the newest series made for `release` or an older release."""
    best = None
    for rel, d in available_series(root).items():
        if version_key(rel) <= version_key(release):
            best = (rel, d)
    return best


def port_hint(release: str, root: Path | None = None) -> str:
    """The message for a release that has no series of its own."""
    near = nearest_older_series(release, root)
    if near is None:
        return f"no series is older than sglang {release}"
    return (f"the nearest series is {near[1].name}; port it with: "
            f"python3 tools/port.py --from {near[0]} --to {release}")


def load_old_series(from_release: str | None, series_dir: Path | None) -> Series:
    if series_dir is not None:
        return load_series(series_dir)
    d = default_patches_root() / f"sglang-{from_release}"
    if not (d / "series").is_file():
        have = ", ".join(p.name for p in available_series().values()) or "none"
        raise UsageError(f"there is no series for sglang {from_release} (series that exist: {have})",
                         "pass --from with a release that has a series, or --series DIR")
    return load_series(d)


def write_json(path: Path, res: PortResult) -> None:
    Path(path).write_text(json.dumps(res.as_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
