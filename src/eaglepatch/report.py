"""verify: per-hunk verdict table, series footprint, smoke on a patched temporary copy; human + JSON."""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .applier import edit_causes, git_apply, plan_series
from .errors import EaglepatchError, RefusedError
from .interrupts import stop_point
from .lock import tree_lock
from .outputs import owner_writable, scratch_dir, write_atomic
from .series import Series
from .static_check import SmokeResult, static_check
from .tree import UpstreamTree
from .txn import refuse_if_pending
from .verdicts import SeriesCheck, check_series

LEVELS = ("none", "static", "import", "functional")


def footprint(series: Series) -> dict:
    """Lines added/removed in upstream files; files the series creates are counted apart."""
    created: set[str] = set()
    up_files: dict[str, list[int]] = {}
    new_lines = 0
    for p in series.patches:
        for fp in p.files:
            if fp.is_new:
                created.add(fp.path)
            if fp.path in created:
                new_lines += fp.added - fp.removed
            else:
                c = up_files.setdefault(fp.path, [0, 0])
                c[0] += fp.added
                c[1] += fp.removed
    return {"upstream_files": len(up_files), "upstream_lines_added": sum(c[0] for c in up_files.values()),
            "upstream_lines_removed": sum(c[1] for c in up_files.values()),
            "per_upstream_file": {f: {"added": c[0], "removed": c[1]} for f, c in sorted(up_files.items())},
            "new_files": len(created), "new_file_lines": new_lines}


def table(rows: list[list[str]], head: list[str]) -> str:
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{x}}}" for x in w)
    out = [fmt.format(*head), fmt.format(*("-" * x for x in w))]
    out += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(ln.rstrip() for ln in out)


def verdict_table(chk: SeriesCheck) -> str:
    rows = [[v.patch, v.file, f"{v.hunk} @{v.source_start}", v.anchor, v.label] for v in chk.verdicts]
    return table(rows, ["patch", "file", "hunk", "anchor", "verdict"])


def load_run_smoke():
    """(run_smoke, None) or (None, why it is not available)."""
    try:
        from . import smoke as smoke_mod
    except Exception as exc:  # the smoke package is optional and may need extra deps
        return None, f"eaglepatch.smoke is not importable ({exc.__class__.__name__}: {exc})"
    fn = getattr(smoke_mod, "run_smoke", None)
    if not callable(fn):
        return None, "eaglepatch.smoke has no run_smoke()"
    return fn, None


@dataclass
class VerifyReport:
    tree: UpstreamTree
    series: Series
    check: SeriesCheck
    level: str
    notes: list = field(default_factory=list)
    smoke: list = field(default_factory=list)
    smoke_patches: list = field(default_factory=list)
    smoke_ran: bool = False

    @property
    def hunks_ok(self) -> bool:
        return bool(self.check.verdicts) and self.check.all_ok

    @property
    def smoke_ok(self) -> bool:
        return self.level == "none" or (self.smoke_ran and all(r.passed for r in self.smoke))

    @property
    def exit_code(self) -> int:
        return 0 if self.hunks_ok and self.smoke_ok else 1

    def as_dict(self) -> dict:
        counts: dict[str, int] = {}
        for v in self.check.verdicts:
            counts[v.verdict] = counts.get(v.verdict, 0) + 1
        return {"tree": {"root": str(self.tree.root), "kind": self.tree.kind,
                         "package_parent": str(self.tree.package_parent), "release": self.tree.release,
                         "release_source": self.tree.release_source},
                "series": {"dir": str(self.series.dir), "release": self.series.release,
                           "series_version": self.series.series_version,
                           "patches": [p.name for p in self.series.patches]},
                "notes": self.notes, "verdicts": [v.as_dict() for v in self.check.verdicts],
                "verdict_counts": dict(sorted(counts.items())), "footprint": footprint(self.series),
                "smoke": {"level": self.level, "ran": self.smoke_ran, "passed": self.smoke_ok,
                          "smoke_patches_applied": self.smoke_patches,
                          "results": [r.as_dict() if hasattr(r, "as_dict") else
                                      {"name": r.name, "passed": bool(r.passed), "figure": str(r.figure),
                                       "detail": str(r.detail)} for r in self.smoke]},
                "ok": self.exit_code == 0, "exit_code": self.exit_code}

    def human(self) -> str:
        fp = footprint(self.series)
        out = [f"tree:   {self.tree.describe()}",
               f"series: {self.series.dir} ({len(self.series.patches)} patches"
               + (f", series version {self.series.series_version}" if self.series.series_version else "") + ")"]
        out += [f"note:   {n}" for n in self.notes]
        out += ["", verdict_table(self.check), ""]
        bad = [v for v in self.check.verdicts if not v.ok]
        for v in bad:
            out.append(f"  {v.patch} {v.file} hunk {v.hunk}: {v.label}" + (f" - {v.detail}" if v.detail else ""))
        out.append(f"footprint: {fp['upstream_lines_added']} line(s) added, {fp['upstream_lines_removed']} removed "
                   f"in {fp['upstream_files']} upstream file(s); {fp['new_files']} new file(s) "
                   f"({fp['new_file_lines']} lines) counted apart")
        ok = len(self.check.verdicts) - len(bad)
        out.append(f"hunks: {ok}/{len(self.check.verdicts)} exact or offset")
        if self.level != "none":
            if self.smoke_patches:
                out.append("smoke: applied the test-only smoke patches to the temporary copy: "
                           + ", ".join(self.smoke_patches))
            for r in self.smoke:
                out.append(f"smoke {self.level}: {'PASS' if r.passed else 'FAIL'} {r.name}: {r.figure}"
                           + (f" - {r.detail}" if r.detail and not r.passed else ""))
        out.append(f"verify: {'CLEAN' if self.exit_code == 0 else 'DRIFT/FAIL'} (exit {self.exit_code})")
        return "\n".join(out)


def verify_tree(tree: UpstreamTree, series: Series, level: str = "static", say=print,
                notes: list | None = None) -> VerifyReport:
    """Verdicts per hunk (and smoke tests on a patched temporary copy). The tree is only read,
    under its lock; a pending transaction is refused (verify never writes the tree)."""
    series.require_patches()
    with tree_lock(tree.package_parent):
        refuse_if_pending(tree.package_parent, "verify")
        with tree.reads_once():
            rep, tmp = _read_phase(tree, series, level, list(notes or []), say)
    if tmp is None:
        return rep
    try:
        return _smoke_phase(rep, tmp, level)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_phase(tree: UpstreamTree, series: Series, level: str, notes: list, say):
    """Everything that reads the tree: the verdicts, and the copy the smoke tests run on."""
    if series.release and tree.release and series.release != tree.release:
        notes.append(f"series {series.name} was made for sglang {series.release}; the tree is {tree.release}")
    if series.manifest and series.release == tree.release:
        why = {"missing": "is missing", "crlf": "has CRLF (Windows) line endings; the series expects LF"}
        notes += [f"{tree.path(rel)} {why[c]}" for rel, c in edit_causes(tree, series, False).items() if c in why]
    read = tree.read
    if series.manifest and tree.state(series) == "patched":
        _, ga = plan_series(tree, series, series.patches, reverse=True, strict_hashes=False)
        base = ga.final
        read = lambda rel: base[rel] if rel in base else tree.read(rel)  # noqa: E731
        notes.append("the tree has the series applied; verified against its unpatched form (reversed in memory)")
    chk = check_series(read, series.patches, series)
    rep = VerifyReport(tree, series, chk, level, notes)
    if level == "none":
        return rep, None
    if not chk.all_ok:
        rep.smoke.append(SmokeResult("apply series to a temporary copy", False, "skipped",
                                     "the series does not apply cleanly; smoke tests not run"))
        return rep, None
    tmp = scratch_dir("eaglepatch-verify-", "run again, or pass --smoke none")
    try:
        say(f"copying {tree.package_parent / 'sglang'} to a temporary dir for smoke tests ...")
        pp = tmp / "pp"
        # real files only (symlinks=False copies what a link points to): the smoke patches are
        # written to this copy, and a link kept as a link would write through into the user's tree
        shutil.copytree(tree.package_parent / "sglang", pp / "sglang", symlinks=False,
                        ignore=_copy_ignore, ignore_dangling_symlinks=True)
        stop_point("verify-copying")
        for d in tree.package_parent.glob("sglang-*.dist-info"):
            shutil.copytree(d, pp / d.name, symlinks=False, ignore=_copy_ignore, ignore_dangling_symlinks=True)
        owner_writable(pp)  # the copy is ours: a read-only directory of the tree must not stay one
    except BaseException as exc:  # an interrupt (Ctrl-C, SIGTERM: tools/verify.py) too: the copy goes
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, (OSError, shutil.Error)):
            raise
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "some files could not be copied"
        raise RefusedError(f"cannot copy the tree for the smoke tests: {why}",
                           "free space in the temp dir (TMPDIR) or fix the tree's permissions, or pass --smoke none") \
            from None
    return rep, tmp


_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".eaglepatch-txn")


def _within(path: str, top: str) -> bool:
    """`path` is `top` or lies below it (both real paths; `/` holds everything)."""
    return os.path.commonpath([path, top]) == top


def _copy_ignore(d, names):
    """What the smoke copy leaves out: caches, a transaction log, whatever is neither a directory
    nor a regular file once links are followed (a FIFO would block the copy), and, skipped
    without a word, a link to a directory that holds the one being copied (`/`, the tree, any
    directory above it, or one the copy came through on its way here): copying it never ends."""
    skip = set(_SKIP(d, names))
    chain = None
    for n in names:
        full = os.path.join(d, n)
        try:
            mode = os.stat(full).st_mode
        except OSError:
            continue  # a dangling link: ignore_dangling_symlinks leaves it out
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            skip.add(n)
        elif stat.S_ISDIR(mode) and os.path.islink(full):
            if chain is None:  # the real directory behind each step of the way to `d`, links followed
                p = os.path.abspath(d)
                chain = {os.path.realpath(p)}
                while os.path.dirname(p) != p:
                    p = os.path.dirname(p)
                    chain.add(os.path.realpath(p))
            real = os.path.realpath(full)
            if any(_within(c, real) for c in chain):
                skip.add(n)
    return skip


def _smoke_phase(rep: VerifyReport, tmp: Path, level: str) -> VerifyReport:
    """Apply the series (and smoke.series) to the copy, then run the smoke level on it."""
    series, chk = rep.series, rep.check
    pp = tmp / "pp"
    run_smoke = None
    if level in ("import", "functional"):
        run_smoke, why = load_run_smoke()
        if run_smoke is None:
            rep.smoke.append(SmokeResult(f"smoke level {level}", False, "not available", why))
    ga = git_apply(chk.originals, series.patches)
    if ga.error:
        rep.smoke.append(SmokeResult("apply series to a temporary copy", False, "git apply failed", ga.error))
        return rep
    _write(pp, ga.final)
    originals = dict(chk.originals)
    if series.smoke:
        tmp_tree = UpstreamTree("installed", pp, pp, rep.tree.release, rep.tree.release_source)
        schk = check_series(tmp_tree.read, series.smoke, None)
        sga = git_apply(schk.originals, series.smoke)
        if not schk.all_ok or sga.error:
            bad = [v for v in schk.verdicts if not v.ok]
            rep.smoke.append(SmokeResult("apply smoke.series", False, "failed",
                                         sga.error or "; ".join(f"{v.patch} {v.file} hunk {v.hunk}: {v.label}"
                                                                for v in bad)))
            return rep
        _write(pp, sga.final)
        for rel, data in schk.originals.items():
            originals.setdefault(rel, data)
        rep.smoke_patches = [p.name for p in series.smoke]
    rep.smoke_ran = True
    rep.smoke += static_check(pp, series.files(smoke=True), originals)
    if run_smoke is not None:
        try:
            rep.smoke += list(run_smoke(level, pp, series))
        except EaglepatchError:
            raise
        except Exception as exc:
            rep.smoke.append(SmokeResult(f"smoke level {level}", False, "crashed",
                                         f"{exc.__class__.__name__}: {exc}"))
    return rep


def _write(pp: Path, contents: dict) -> None:
    try:
        for rel, data in contents.items():
            p = pp / rel
            if p.is_symlink():  # never write through a link, even one the copy should not hold
                p.unlink()
            if data is None:
                p.unlink(missing_ok=True)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
    except OSError as exc:
        raise RefusedError(f"cannot write the temporary copy for the smoke tests: {exc.strerror}",
                           "free space in the temp dir (TMPDIR), or pass --smoke none") from None


def write_json(path: Path, rep: VerifyReport, flag: str = "--json") -> None:
    write_atomic(path, json.dumps(rep.as_dict(), indent=2, sort_keys=True) + "\n", flag)
