"""Drift matrix: verify the nearest older series against every sglang release (`tools/drift.py`).

For each release (by default every release on the package index from the oldest series on), the
series made for that release or the newest older one is verified exactly as `tools/verify.py
--smoke none` does (per-hunk verdicts, zero fuzz, anchors from the series manifest). The result is
a table release x hunk per series, written as Markdown (`docs/drift.md`), plus the footprint of
each series. `pinned_gate` checks that every series is all-exact on its own release (CI).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .fetch import unpacked_release
from .report import footprint, verify_tree
from .series import Series, available_series, load_series, nearest_older, version_key
from .tree import UpstreamTree
from .verdicts import ALREADY, AMBIGUOUS, ANCHOR_DRIFT, CONFLICT, CONTEXT_CHANGED, EXACT, OFFSET

SHORT = {EXACT: "exact", CONTEXT_CHANGED: "ctx", CONFLICT: "CONFLICT", ALREADY: "applied",
         AMBIGUOUS: "ambig", ANCHOR_DRIFT: "anchor"}
LEGEND = ("`exact` old side matches at the recorded line; `+N`/`-N` matches N lines away (offset); "
          "`anchor` applies but the enclosing def/class changed since the series was exported; "
          "`ctx` the changed lines exist but their context differs; `CONFLICT` the changed lines are "
          "gone; `applied` the new side is already there; `ambig` the old side matches more than once.")


@dataclass
class Row:
    release: str
    series: Series
    verdicts: list = field(default_factory=list)

    @property
    def all_exact(self) -> bool:
        return bool(self.verdicts) and all(v.verdict == EXACT for v in self.verdicts)

    @property
    def applies(self) -> bool:
        return bool(self.verdicts) and all(v.ok for v in self.verdicts)

    @property
    def own(self) -> bool:
        """The series is the release's own (apply.py refuses a release that has none)."""
        return self.series.release == self.release

    @property
    def gate_ok(self) -> bool:
        """What `tools/apply.py` needs on this release: its own series, every hunk exact or offset."""
        return self.own and self.applies

    @property
    def status(self) -> str:
        if self.all_exact:
            return "all exact"
        if self.applies:
            return "applies (offsets)"
        bad = sum(1 for v in self.verdicts if not v.ok)
        return f"drift: {bad} hunk(s)"


def cell(v) -> str:
    if v.verdict == OFFSET:
        return f"{v.offset:+d}"
    if v.verdict == ANCHOR_DRIFT and v.offset:
        return f"anchor {v.offset:+d}"
    return SHORT.get(v.verdict, v.verdict)


def index_releases(oldest: str, package: str = "sglang") -> list[str]:
    """Every release of `package` on the package index that is `oldest` or newer, oldest first."""
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"],
                       capture_output=True, text=True)
    m = re.search(r"^Available versions:\s*(.+)$", r.stdout, re.M)
    if r.returncode != 0 or not m:
        raise UsageError(f"could not list the {package} releases on the package index",
                         "check the network, or pass --releases R1,R2,...")
    rels = [v.strip() for v in m.group(1).split(",") if v.strip()]
    rels = [v for v in rels if re.fullmatch(r"\d+(\.\d+)*(\.post\d+)?", v)]  # no pre-releases
    return sorted((v for v in rels if version_key(v) >= version_key(oldest)), key=version_key)


def matrix(releases: list[str], patches_root: Path | None = None, say=None) -> tuple[list[Row], dict]:
    """Rows (one per release with an older-or-equal series) and the loaded series by release."""
    have = available_series(patches_root)
    if not have:
        raise UsageError("there is no series under patches/", "run from the repository or set EAGLEPATCH_PATCHES")
    loaded = {rel: load_series(d) for rel, d in have.items()}
    rows = []
    for release in sorted(set(releases), key=version_key):
        srel = nearest_older(release, have)
        if srel is None:
            if say:
                say(f"sglang {release}: older than every series; skipped")
            continue
        pp = unpacked_release(release, quiet=True)
        tree = UpstreamTree("installed", pp, pp, release, "dist-info")
        rep = verify_tree(tree, loaded[srel], "none", say=lambda m: None)
        row = Row(release, loaded[srel], rep.check.verdicts)
        rows.append(row)
        if say:
            say(f"sglang {release}: {loaded[srel].dir.name} {row.status}")
    return rows, loaded


def _columns(series: Series) -> list[tuple[str, str, int, str]]:
    """(label, file, hunk index, patch name) for each hunk of the series' product patches."""
    cols = []
    for p in series.patches:
        num = p.name.split("-", 1)[0].lstrip("0") or "0"
        for fp in p.files:
            for h in fp.hunks:
                short = fp.path.rsplit("/", 1)[-1]
                cols.append((f"{num}.{short}#{h.index}", fp.path, h.index, p.name))
    return cols


def render(rows: list[Row], loaded: dict, command: str = "python3 tools/drift.py") -> str:
    out = ["# Drift matrix", "",
           f"Generated by `{command}`: the nearest older series verified (as `tools/verify.py --smoke none`",
           "does) against every sglang release on the package index. Do not edit by hand.", "",
           LEGEND, ""]
    out += ["## Summary", "", "| release | series | hunks | status |", "|---|---|---|---|"]
    for r in rows:
        n_ok = sum(1 for v in r.verdicts if v.verdict == EXACT)
        status = r.status
        if r.applies and not r.own:
            status += " with an older series; apply.py refuses a release without its own"
        if not r.own:
            status += f"; port: `python3 tools/port.py --from {r.series.release} --to {r.release}`"
        out.append(f"| {r.release} | {r.series.dir.name} | {n_ok}/{len(r.verdicts)} exact | {status} |")
    out.append("")
    for srel, series in loaded.items():
        srows = [r for r in rows if r.series is series]
        fp = footprint(series)
        out += [f"## Series {series.dir.name}", ""]
        out.append(f"Footprint: {fp['upstream_lines_added']} line(s) added and {fp['upstream_lines_removed']} "
                   f"removed in {fp['upstream_files']} upstream file(s) "
                   + ", ".join(f"`{f.rsplit('/', 1)[-1]}` +{c['added']}/-{c['removed']}"
                               for f, c in fp["per_upstream_file"].items())
                   + f"; {fp['new_files']} new file(s), {fp['new_file_lines']} lines. "
                   f"Product patches: {len(series.patches)}, test-only smoke patches: {len(series.smoke)}.")
        out.append("")
        if not srows:
            out += ["No release in this run uses this series.", ""]
            continue
        cols = _columns(series)
        out.append("| release | " + " | ".join(c[0] for c in cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for r in srows:
            by = {(v.patch, v.file, v.hunk): v for v in r.verdicts}
            cells = [cell(by[(c[3], c[1], c[2])]) if (c[3], c[1], c[2]) in by else "?" for c in cols]
            out.append(f"| {r.release} | " + " | ".join(cells) + " |")
        out.append("")
        out.append("Hunks: " + "; ".join(
            f"`{c[0]}` = {c[3]} {c[1]} hunk {c[2]}"
            + (f" [{a}]" if (a := (series.manifest_hunk(c[3], c[1], c[2]) or {}).get("anchor")) else "")
            for c in cols) + ".")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def summary(rows: list[Row], releases: list[str]) -> str:
    """One line: how many releases were checked and which fail the gate, by cause."""
    checked = {r.release for r in rows}
    groups = [("apply with their own series", [r.release for r in rows if r.gate_ok]),
              ("with drift", [r.release for r in rows if not r.applies]),
              ("apply only with an older series (port them)", [r.release for r in rows if r.applies and not r.own]),
              ("older than every series", [x for x in sorted(set(releases), key=version_key) if x not in checked])]
    parts = [f"{len(names)} {what}" + (f" ({', '.join(names)})" if names and what != groups[0][0] else "")
             for what, names in groups if names or what == "with drift"]
    return f"{len(set(releases))} release(s): " + ", ".join(parts)


def gate_failures(rows: list[Row], releases: list[str]) -> list[tuple[str, list[str]]]:
    """(release, lines saying why) for each release `--strict` fails on: those apply.py would
    refuse (drift, no series of their own) and those older than every series."""
    from .series import port_command

    out = []
    checked = {r.release for r in rows}
    for r in rows:
        if r.gate_ok:
            continue
        why = [f"sglang {r.release}: {r.series.dir.name} {r.status}"
               + ("" if r.own else f" (no series of its own); port it: {port_command(r.series.release, r.release)}")]
        why += [f"  {v.patch} {v.file} hunk {v.hunk} [{v.anchor}]: {v.label}" + (f" - {v.detail}" if v.detail else "")
                for v in r.verdicts if not v.ok]
        out.append((r.release, why))
    for x in sorted(set(releases), key=version_key):
        if x not in checked:
            out.append((x, [f"sglang {x}: older than every series; no series covers it"]))
    return out


def pinned_gate(patches_root: Path | None = None, say=print) -> int:
    """0 when every series is all-exact on its own release, else 1 (per-hunk lines for the rest)."""
    have = available_series(patches_root)
    if not have:
        raise UsageError("there is no series under patches/", "run from the repository or set EAGLEPATCH_PATCHES")
    rows, _ = matrix(list(have), patches_root)
    bad = 0
    for r in rows:
        say(f"{r.series.dir.name} on sglang {r.release}: {r.status} "
            f"({sum(1 for v in r.verdicts if v.verdict == EXACT)}/{len(r.verdicts)} hunks exact)")
        for v in r.verdicts:
            if v.verdict != EXACT:
                say(f"  {v.patch} {v.file} hunk {v.hunk} [{v.anchor}]: {v.label}"
                    + (f" - {v.detail}" if v.detail else ""))
        bad += not r.all_exact
    return 1 if bad else 0
