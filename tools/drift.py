#!/usr/bin/env python3
"""Drift matrix: verify the nearest older series against every SGLang release and write docs/drift.md.

  python tools/drift.py [--releases R1,R2,...] [--out docs/drift.md] [--strict]
  python tools/drift.py --pinned        # CI gate: every series all-exact on its own release

Releases default to every release on the package index from the oldest series on (wheels are
downloaded once and cached). Exit: 0 written (with --strict: and every release applies),
1 drift (--strict / --pinned), 2 usage or input error.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("drift.py", __doc__)
    ap.add_argument("--releases", help="comma list of releases (default: every release on the index)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "drift.md",
                    help="Markdown file to write (default: docs/drift.md of this repository)")
    ap.add_argument("--strict", action="store_true", help="exit 1 unless every release applies (exact/offset)")
    ap.add_argument("--pinned", action="store_true",
                    help="only each series' own release; exit 1 unless all-exact; writes nothing")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch import drift
        from eaglepatch.errors import UsageError
        from eaglepatch.outputs import check_output_file, write_atomic
        from eaglepatch.series import available_series, check_release

        if a.pinned:
            if a.releases:
                raise UsageError("--pinned takes the releases from patches/", "drop --releases")
            rc = drift.pinned_gate()
            print(f"drift --pinned: {'all series all-exact' if rc == 0 else 'DRIFT'} (exit {rc})")
            return rc
        check_output_file(a.out, "--out")
        have = available_series()
        if not have:
            raise UsageError("there is no series under patches/", "run from the repository")
        if a.releases is not None:
            releases = [check_release(r.strip(), "--releases") for r in a.releases.split(",") if r.strip()]
            if not releases:
                raise UsageError("--releases names no release", "pass --releases R1,R2,... e.g. 0.5.9,0.5.10")
            cmd = f"python3 tools/drift.py --releases {','.join(releases)}"
        else:
            releases = drift.index_releases(next(iter(have)))
            cmd = "python3 tools/drift.py"
        rows, loaded = drift.matrix(releases, say=lambda m: print(m, file=sys.stderr, flush=True))
        write_atomic(a.out, drift.render(rows, loaded, cmd), "--out")
        drifting = [r for r in rows if not r.applies]
        print(f"drift: {len(rows)} release(s), {len(drifting)} with drift "
              + (f"({', '.join(r.release for r in drifting)})" if drifting else "")
              + f"; wrote {a.out}")
        return 1 if (a.strict and drifting) else 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
