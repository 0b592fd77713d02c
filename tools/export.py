#!/usr/bin/env python3
"""Export the edit branch of a patched SGLang git tree to a series dir, deterministically.

  python tools/export.py REPO [--base v0.5.9] [--branch B] [--out patches/sglang-0.5.9]
                         [--series-version 0.5.9-1] [--check]
  python tools/export.py --overlay [--out SERIES_DIR] [--check]

One patch per commit base..branch (NNNN-<slug of Subject>.patch, header = commit message); the
base defaults to the nearest release tag v<release> behind the branch (the tag `apply --fetch`
puts on the upstream commit; an upstream clone's release tag);
commits whose Subject starts with 'smoke:' go to smoke.series (a branch without any, e.g. one
made by apply --commit, keeps the smoke patches already in the series dir). Writes series,
smoke.series and manifest.json, all or nothing. --check writes nothing and exits 1 if anything
on disk differs by one byte.

--overlay regenerates the first patch of every series (or of --out), the one that adds the
package in sglang-overlay/, and its manifest entries; with --check it only compares.

--plugin DIR builds the eaglepatch-capture wheel (the capture as an SGLang plugin for the
releases sglang-plugin/targets.py covers: the overlay's package + sglang-plugin/, its release
facts from the series' manifests) into DIR, by one rename; it needs setuptools>=70.1 in this
Python. Install it with pip install DIR/eaglepatch_capture-*.whl beside an unmodified sglang.

Exit: 0 exported (with --check: byte-identical), 1 --check found a difference (or refused),
2 usage or input error.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("export.py", __doc__)
    ap.add_argument("repo", nargs="?", metavar="REPO", help="git checkout holding the edit branch (upstream release tagged v<release>)")
    ap.add_argument("--base", help="upstream base revision, e.g. v0.5.9 (default: the nearest v<release> tag "
                                   "behind --branch)")
    ap.add_argument("--overlay", action="store_true",
                    help="regenerate each series' new-file patch from sglang-overlay/ (no REPO)")
    ap.add_argument("--branch", help="edit branch (default: HEAD)")
    ap.add_argument("--out", type=Path, help="series dir (default: patches/sglang-<release of --base>)")
    ap.add_argument("--series-version", help="series version for manifest.json (default: kept, else <release>-1)")
    ap.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    ap.add_argument("--plugin", type=Path, metavar="DIR",
                    help="build the eaglepatch-capture plugin wheel into DIR (no REPO)")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch.errors import UsageError
        from eaglepatch.export import export_series
        from eaglepatch.lock import lock_timeout
        from eaglepatch.series import check_release, default_patches_root

        lock_timeout()  # a bad EAGLEPATCH_LOCK_TIMEOUT: one line, exit 2, before anything is read or written
        if a.plugin is not None:
            if a.repo or a.base or a.branch or a.series_version or a.overlay or a.out or a.check:
                raise UsageError("--plugin takes no REPO, --base, --branch, --series-version, --overlay, --out "
                                 "or --check", "run: export.py --plugin DIR")
            from eaglepatch.plugin import build_wheel

            print(f"built {build_wheel(a.plugin)}")
            return 0
        if a.overlay:
            if a.repo or a.base or a.branch or a.series_version:
                raise UsageError("--overlay takes no REPO, --base, --branch or --series-version",
                                 "run: export.py --overlay [--out SERIES_DIR] [--check]")
            return overlay_body(a.out, a.check)
        if not a.repo:
            raise UsageError("REPO is required (or pass --overlay)", "run: export.py REPO [--base v<release>] [--out DIR]")
        if a.base is None:
            from eaglepatch.export import default_base

            a.base = default_base(a.repo, a.branch)
            print(f"export: base {a.base} (the nearest release tag behind {a.branch or 'HEAD'}; --base picks another)",
                  file=sys.stderr)
        out = a.out
        if out is None:
            rel = a.base[1:] if a.base.startswith("v") else None
            if not rel:
                raise UsageError(f"cannot name the series dir from --base {a.base}", "pass --out DIR")
            out = default_patches_root() / f"sglang-{check_release(rel, '--base v')}"
        res = export_series(a.repo, a.base, out, a.branch, a.series_version, check=a.check)
        if a.check:
            for d in res.changes:
                print(d)
            if res.changes:
                print(f"export --check: {res.out} differs from a fresh export of {a.branch or 'HEAD'} "
                      f"({len(res.changes)} file(s))")
                return 1
            print(f"export --check: {res.out} is byte-identical to a fresh export ({len(res.exp.files)} files)")
            return 0
        if res.kept_smoke:
            print(f"the branch has no smoke: commits; kept the smoke patch(es) in {res.out}: "
                  + ", ".join(res.kept_smoke))
        print(f"exported {len(res.exp.product)} patch(es) + {len(res.exp.smoke)} smoke patch(es) to {res.out}; "
              + (f"changed: {', '.join(res.changes)}" if res.changes else "nothing changed"))
        return 0

    return run_main(body)


def overlay_body(out, check: bool) -> int:
    from eaglepatch.overlay import sync_series
    from eaglepatch.series import available_series

    dirs = [out] if out else list(available_series().values())
    bad = 0
    for d in dirs:
        diffs = sync_series(d, check=check)
        bad += bool(diffs)
        verb = "differs" if check else "regenerated"
        print(f"{d}: " + (f"{verb}: {', '.join(diffs)}" if diffs else "matches sglang-overlay/"))
    if check and bad:
        print(f"export --overlay --check: {bad} series differ from sglang-overlay/; run tools/export.py --overlay "
              "(edit the package in sglang-overlay/, never in a series)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
