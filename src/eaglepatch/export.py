"""Export a git branch of the patched tree to series files + manifest.json, deterministically."""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from .anchors import anchor_at, hunk_anchor_line
from .errors import RefusedError, UsageError
from .gitcmd import open_repo
from .interrupts import held_interrupts
from .lock import tree_lock
from .portstate import export_defaults
from .series import (DIFF_ARGS, PACKAGE, SEPARATOR, dump_manifest, load_manifest, message_to_header, parse_patch,
                     read_series_list, sha256_bytes, slug)
from .tree import locate

CAPTURE_SEMANTICS = {"eagle_id_to_capture_index": "plus_one", "capture_index_to_hf_index": "identity"}


@dataclass
class Exported:
    files: dict  # file name -> bytes (series, smoke.series, manifest.json, *.patch)
    product: list
    smoke: list


def _git(repo, *args) -> bytes:
    return repo.git.execute(["git", *args], stdout_as_string=False, strip_newline_in_stdout=False)


def _raw_message(repo, sha: str) -> str:
    try:
        raw = _git(repo, "cat-file", "commit", sha).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"commit {sha[:12]} has a message that is not UTF-8", "reword it (git rebase -i)") from None
    return raw.split("\n\n", 1)[1] if "\n\n" in raw else ""


def _show(repo, rev: str, path: str) -> bytes | None:
    try:
        return _git(repo, "cat-file", "blob", f"{rev}:{path}")
    except Exception:
        return None


def default_base(repo_path: Path | str, branch: str | None = None) -> str:
    """The nearest tag v<release> behind `branch` (HEAD): the release commit `apply --fetch` tags
    (an upstream clone's release tag), where the edit branch starts."""
    from .series import RELEASE_RE

    head = branch or "HEAD"
    repo = open_repo(repo_path, "pass the git checkout that holds the edit branch")
    try:
        tag = repo.git.describe("--tags", "--abbrev=0", "--match", "v[0-9]*", head).strip()
    except Exception:
        tag = ""
    finally:
        repo.close()
    if not tag or not RELEASE_RE.match(tag[1:]):
        raise UsageError(f"no release tag (v<release>) is behind {head} in {repo_path}",
                         "pass --base, the upstream revision the edit branch starts from (e.g. --base v0.5.9)")
    return tag


def build_export(repo_path: Path | str, base: str, branch: str | None = None, release: str | None = None,
                 series_version: str | None = None, previous_manifest: dict | None = None) -> Exported:
    """The series files of base..branch (HEAD) in `repo_path`, in memory."""
    repo = open_repo(repo_path, "pass the git checkout that holds the edit branch")
    import git
    try:
        with held_interrupts():
            return _build(repo, repo_path, base, branch, release, series_version, previous_manifest)
    except git.GitCommandError as exc:
        msg = (exc.stderr or "").strip().strip("'").strip().splitlines()
        raise UsageError(f"git failed in {repo_path}: {msg[-1].strip() if msg else exc.status}",
                         "fix the edit branch and run again") from None
    finally:
        repo.close()


def _build(repo, repo_path, base, branch, release, series_version, previous_manifest) -> Exported:
    head = branch or "HEAD"
    try:
        base_sha = repo.git.rev_parse("--verify", f"{base}^{{commit}}")
        head_sha = repo.git.rev_parse("--verify", f"{head}^{{commit}}")
    except Exception:
        raise UsageError(f"unknown revision {base!r} or {head!r} in {repo_path}",
                         "pass --base v<release> (a tag of the upstream release) and an existing --branch") from None
    ls = repo.git.ls_tree("--name-only", base_sha, "python/sglang")
    prefix = "python/" if ls.strip() else ""
    shas = repo.git.rev_list("--reverse", "--topo-order", f"{base_sha}..{head_sha}").split()
    if not shas:
        raise UsageError(f"no commits between {base} and {head}", "commit the patches on the branch first")
    if release is None:
        m = re.match(r"^v?(\d[\w.\-+]*)$", base)
        release = m.group(1) if m else None
    if release is None:
        raise UsageError(f"cannot tell the release from --base {base}", "pass --base v<release>")
    prev_m = previous_manifest or {}
    series_version = series_version or prev_m.get("series_version") or f"{release}-1"
    files: dict = {}
    product, smoke, entries = [], [], []
    product_done = False
    last_product = base_sha
    for n, sha in enumerate(shas, 1):
        c = repo.commit(sha)
        if len(c.parents) != 1:
            raise UsageError(f"commit {sha[:12]} is a merge", "rebase the edit branch to a linear history")
        msg = _raw_message(repo, sha)
        header = message_to_header(msg)
        subject = header.splitlines()[0][len("Subject:"):].strip()
        is_smoke = subject.startswith("smoke:")
        if not is_smoke and product_done:
            raise UsageError(f"product commit {sha[:12]} ({subject}) comes after a smoke: commit",
                             "reorder the branch so that every smoke: commit comes last")
        product_done = product_done or is_smoke
        args = ["diff", *DIFF_ARGS]
        if prefix:
            args.append(f"--relative={prefix.rstrip('/')}")
        parent = c.parents[0].hexsha
        body = _git(repo, *args, parent, sha)
        outside = [p for p in repo.git.diff("--name-only", "--no-renames", parent, sha).split("\n")
                   if p and not p.startswith(prefix + PACKAGE + "/")]
        if outside:
            raise UsageError(f"commit {sha[:12]} ({subject}) changes files outside {prefix}{PACKAGE}/: "
                             + ", ".join(outside[:5]), "move those changes out of the edit branch")
        if not body:
            raise UsageError(f"commit {sha[:12]} ({subject}) changes nothing", "drop it from the edit branch")
        name = f"{n:04d}-{slug(subject)}.patch"
        data = header.encode("utf-8") + SEPARATOR + body
        patch = parse_patch(data, name)
        files[name] = data
        (smoke if is_smoke else product).append(name)
        if not is_smoke:
            last_product = sha
            hunks = []
            for fp in patch.files:
                before = _show(repo, parent, prefix + fp.path)
                for h in fp.hunks:
                    if fp.is_new or before is None:
                        a, asha = "<module>", None
                    else:
                        k, ins = h.first_change()
                        start = h.source_start - 1 if h.source_length else h.source_start
                        a, asha = anchor_at(before, hunk_anchor_line(start, k, ins))
                    hunks.append({"file": fp.path, "index": h.index, "source_start": h.source_start,
                                  "anchor": a, "anchor_sha256": asha})
            entries.append({"name": name, "sha256": sha256_bytes(data), "hunks": hunks})
    mfiles = {}
    for name in product:
        for fp in parse_patch(files[name], name).files:
            if fp.path not in mfiles:
                mfiles[fp.path] = {"upstream_sha256": sha256_bytes(_show(repo, base_sha, prefix + fp.path)),
                                   "patched_sha256": sha256_bytes(_show(repo, last_product, prefix + fp.path))}
    manifest = {"format": 1, "release": release, "series_version": series_version,
                "capture_semantics": prev_m.get("capture_semantics", CAPTURE_SEMANTICS),
                "files": mfiles, "patches": entries}
    files["series"] = "".join(f"{x}\n" for x in product).encode()
    files["smoke.series"] = "".join(f"{x}\n" for x in smoke).encode()
    files["manifest.json"] = dump_manifest(manifest).encode()
    return Exported(files, product, smoke)


def compare(out: Path, exp: Exported) -> list[str]:
    """Differences between `exp` and the series dir on disk (empty list = byte-identical)."""
    diffs = []
    for name, data in sorted(exp.files.items()):
        p = out / name
        if not p.is_file():
            diffs.append(f"missing {p}")
        elif p.read_bytes() != data:
            diffs.append(f"differs {p}")
    if out.is_dir():
        for p in sorted(out.glob("*.patch")):
            if p.name not in exp.files:
                diffs.append(f"stale {p}")
    return diffs


def write_export(out: Path, exp: Exported) -> list[str]:
    """Write the changed files and remove stale *.patch files, all or nothing: every new file is
    written beside its target first (any failure removes them and changes nothing), then renamed.
    Returns the names changed."""
    fix = "pass --out a writable directory (or free space); nothing was changed"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the series dir {out}: {exc.strerror}", fix) from None
    todo = {name: data for name, data in sorted(exp.files.items())
            if not ((out / name).is_file() and (out / name).read_bytes() == data)}
    stale = [p for p in sorted(out.glob("*.patch")) if p.name not in exp.files]
    staged = []
    try:
        for name, data in todo.items():
            tmp = out / f".{name}.tmp"
            staged.append(tmp)
            tmp.write_bytes(data)
        for tmp, name in zip(staged, todo):
            os.replace(tmp, out / name)
        for p in stale:
            p.unlink()
    except OSError as exc:
        for tmp in staged:
            try:
                tmp.unlink()
            except OSError:
                pass
        raise UsageError(f"cannot write the series to {out}: {exc.strerror}", fix) from None
    return list(todo) + [f"removed {p.name}" for p in stale]


def keep_smoke(out: Path, exp: Exported) -> list[str]:
    """A branch without smoke: commits (apply --commit makes only product commits) keeps the
    smoke patches listed in out/smoke.series: they go into `exp` as they are on disk."""
    if exp.smoke or not (out / "smoke.series").is_file():
        return []
    names = read_series_list(out / "smoke.series")
    if not names or not all((out / n).is_file() for n in names) or any(n in exp.files for n in names):
        return []
    for n in names:
        exp.files[n] = (out / n).read_bytes()
    exp.files["smoke.series"] = (out / "smoke.series").read_bytes()
    exp.smoke = list(names)
    return names


@dataclass
class ExportResult:
    exp: Exported
    out: Path
    changes: list  # --check: the differences; else the names written or removed
    kept_smoke: list


def export_series(repo: Path | str, base: str, out: Path | str, branch: str | None = None,
                  series_version: str | None = None, check: bool = False) -> ExportResult:
    out = Path(os.path.expanduser(str(out)))
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file", "pass --out a series directory")
    prev = None
    if (out / "manifest.json").is_file():
        try:
            prev = load_manifest(out / "manifest.json")
        except UsageError:
            prev = None
    if prev is None:  # a new series dir: what a finished `port.py --checkout` there recorded
        m = re.match(r"^v?(\d[\w.\-+]*)$", base)
        prev = export_defaults(repo, m.group(1) if m else None)
    try:
        _, _, pp = locate(repo)
    except UsageError:
        pp = None
    with tree_lock(pp) if pp is not None else nullcontext():
        exp = build_export(repo, base, branch, series_version=series_version, previous_manifest=prev)
    kept = keep_smoke(out, exp)
    if check:
        return ExportResult(exp, out, compare(out, exp), kept)
    return ExportResult(exp, out, write_export(out, exp), kept)


__all__ = ["build_export", "compare", "write_export", "export_series", "keep_smoke", "slug", "message_to_header",
           "read_series_list", "RefusedError"]
