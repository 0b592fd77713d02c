"""Export a git branch of the patched tree to series files + manifest.json, deterministically."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .anchors import anchor_at, hunk_anchor_line
from .errors import RefusedError, UsageError
from .series import (DIFF_ARGS, PACKAGE, SEPARATOR, dump_manifest, load_manifest, parse_patch, read_series_list,
                     sha256_bytes, slug)

CAPTURE_SEMANTICS = {"eagle_id_to_capture_index": "plus_one", "capture_index_to_hf_index": "identity"}


def message_to_header(message: str) -> str:
    """Commit message -> patch header (inverse of applier.header_to_message)."""
    if not message.endswith("\n"):
        message += "\n"
    if message.startswith("Subject:"):
        return message
    first, _, rest = message.partition("\n")
    if rest.startswith("\n"):
        rest = rest[1:]
    return f"Subject: {first.strip()}\n" + rest


@dataclass
class Exported:
    files: dict  # file name -> bytes (series, smoke.series, manifest.json, *.patch)
    product: list
    smoke: list


def _git(repo, *args) -> bytes:
    return repo.git.execute(["git", *args], stdout_as_string=False, strip_newline_in_stdout=False)


def _raw_message(repo, sha: str) -> str:
    raw = _git(repo, "cat-file", "commit", sha).decode("utf-8")
    return raw.split("\n\n", 1)[1] if "\n\n" in raw else ""


def _show(repo, rev: str, path: str) -> bytes | None:
    try:
        return _git(repo, "cat-file", "blob", f"{rev}:{path}")
    except Exception:
        return None


def build_export(repo_path: Path | str, base: str, branch: str | None = None, release: str | None = None,
                 series_version: str | None = None, previous_manifest: dict | None = None) -> Exported:
    import git
    try:
        repo = git.Repo(repo_path)
    except Exception:
        raise UsageError(f"{repo_path} is not a git repository", "pass the git checkout that holds the edit branch") \
            from None
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
    """Write the files atomically, remove stale *.patch files; returns the names changed."""
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, data in sorted(exp.files.items()):
        p = out / name
        if p.is_file() and p.read_bytes() == data:
            continue
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, p)
        changed.append(name)
    for p in sorted(out.glob("*.patch")):
        if p.name not in exp.files:
            p.unlink()
            changed.append(f"removed {p.name}")
    return changed


def export_series(repo: Path | str, base: str, out: Path | str, branch: str | None = None,
                  series_version: str | None = None, check: bool = False) -> tuple[Exported, list[str]]:
    out = Path(out)
    prev = None
    if (out / "manifest.json").is_file():
        try:
            prev = load_manifest(out / "manifest.json")
        except UsageError:
            prev = None
    exp = build_export(repo, base, branch, series_version=series_version, previous_manifest=prev)
    if check:
        diffs = compare(out, exp)
        return exp, diffs
    return exp, write_export(out, exp)


__all__ = ["build_export", "compare", "write_export", "export_series", "slug", "message_to_header",
           "read_series_list", "RefusedError"]
