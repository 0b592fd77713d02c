"""The record a `tools/port.py --checkout` keeps in its checkout (`.git/eaglepatch-port.json`):
where the port stands (the next patch, the patch it stopped at) and, once every patch is
committed, the capture semantics and series version of the new series, which `tools/export.py`
writes into the manifest of a series directory that has none yet."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import UsageError

NAME = "eaglepatch-port.json"
FORMAT = 1


def state_path(root: Path) -> Path | None:
    """The record's path in the checkout `root` (None: `root` is no git work tree)."""
    git = Path(root) / ".git"
    if git.is_dir():
        return git / NAME
    if git.is_file():  # a worktree: `gitdir: <path>`
        try:
            text = git.read_text(encoding="utf-8").strip()
        except OSError:
            return None
        if text.startswith("gitdir:"):
            d = Path(text[len("gitdir:"):].strip())
            return (d if d.is_absolute() else Path(root) / d) / NAME
    return None


def load(root: Path) -> dict | None:
    p = state_path(root)
    if p is None or not p.is_file():
        return None
    try:
        st = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the port record {p}: {getattr(exc, 'strerror', None) or exc}",
                         "delete the checkout and run the tools/port.py --checkout command again") from None
    if not isinstance(st, dict) or st.get("format") != FORMAT:
        raise UsageError(f"{p} is not a port record this eaglepatch writes",
                         "delete the checkout and run the tools/port.py --checkout command again")
    return st


def save(root: Path, st: dict) -> None:
    p = state_path(root)
    if p is None:
        raise UsageError(f"{root} is not a git checkout", "pass the checkout that tools/port.py --checkout made")
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, p)
    except OSError as exc:
        raise UsageError(f"cannot write the port record {p}: {exc.strerror}", "free space and run again") from None


def export_defaults(root: Path | str, release: str | None) -> dict | None:
    """{capture_semantics, series_version} of a finished port in `root` to sglang `release`, for
    the manifest of a series exported from it; None when `root` holds no such port."""
    try:
        st = load(Path(root))
    except UsageError:
        return None
    if not st or not st.get("done") or (release is not None and st.get("to") != release):
        return None
    out = {k: st[k] for k in ("capture_semantics", "series_version") if st.get(k)}
    return out or None
