"""Stage 4, write: commit the ported patches in a scratch git repository, export them exactly as
tools/export.py would, and write the new series directory in one rename (a complete new
directory, or nothing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from .. import gitcmd
from ..errors import RefusedError, UsageError
from ..export import build_export
from ..fetch import FIXED_DATE
from ..gitcmd import GIT_ID
from ..outputs import filled_dir, scratch_dir, write_atomic
from ..series import Patch, header_to_message
from .result import PortResult


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


def ported_header(patch: Patch, date: str, created: dict | None) -> str:
    """The header of a ported patch: its own with Last-Update set to the port's date; for the patch
    that adds the package (every file it makes is one of `created`, the overlay's files), the
    overlay's own header, so that the new series matches `tools/export.py --overlay --check`."""
    if created and patch.files and all(fp.is_new and fp.path in created for fp in patch.files):
        from ..overlay import header
        return header()
    return _header_with(patch, {"Last-Update": date})


def export_ported(snapshots, new_upstream, to_release, series_version, semantics, date, res,
                  created: dict | None = None) -> dict:
    """The ported series' files (name -> bytes): the kept patches committed in a scratch git
    repository and exported with `eaglepatch.export`, the same bytes tools/export.py writes."""
    tmp = scratch_dir("eaglepatch-port-", "run again; nothing was written")
    try:
        env = gitcmd.clean_env(ceiling=tmp, extra={**GIT_ID, "GIT_AUTHOR_DATE": FIXED_DATE,
                                                   "GIT_COMMITTER_DATE": FIXED_DATE})

        def git(*args):
            return gitcmd.run(list(args), tmp, env=env).stdout

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
            msg = header_to_message(ported_header(patch, date, created))
            mf = tmp / ".git" / "PORT_MSG"
            mf.write_bytes(msg.encode("utf-8"))
            git("-c", "commit.gpgsign=false", "commit", "-q", "--cleanup=verbatim", "-F", str(mf))
        exp = build_export(tmp, f"v{to_release}", release=to_release, series_version=series_version,
                           previous_manifest={"capture_semantics": semantics, "series_version": series_version})
        names = exp.product + exp.smoke
        for pp, (patch, _) in zip([p for p in res.patches if p.status == "ported"], snapshots):
            pp.new_name = names[[q for q, _ in snapshots].index(patch)]
        return exp.files
    except OSError as exc:
        raise RefusedError(f"cannot write the scratch repository for the port: {exc.strerror}",
                           "free space in the temp dir (TMPDIR) and run again; nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_series(out: Path, files: dict, force: bool = False) -> None:
    """Write the series dir in one rename: a complete new dir, or nothing."""
    out = Path(os.path.expanduser(str(out)))
    if out.is_symlink():  # write the directory the link names; the link itself stays a link
        out = Path(os.path.realpath(out))
    if out.exists() and not force:
        raise RefusedError(f"{out} already exists", "pass --force to replace it, or --out DIR")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file", "pass --out a directory")
    fix = "pass --out a writable directory (or free space); nothing was written"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.port-", dir=out.parent))
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror}", fix) from None
    try:
        with filled_dir(tmp, out):
            for name, data in sorted(files.items()):
                (tmp / name).write_bytes(data)
            os.chmod(tmp, 0o755)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror}", fix) from None


def write_json(path: Path, res: PortResult, flag: str = "--json") -> None:
    write_atomic(path, json.dumps(res.as_dict(), indent=2, sort_keys=True) + "\n", flag)
