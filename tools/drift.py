#!/usr/bin/env python3
"""Drift matrix: verify the nearest older series against every SGLang release and write docs/drift.md.

  python tools/drift.py [--releases R1,R2,...] [--out docs/drift.md] [--strict]
  python tools/drift.py --releases 0.5.9 --strict --out drift-report.md   # gate: your pinned sglang
  python tools/drift.py --pinned        # gate: every series all-exact on its own release

Releases default to every release on the package index from the oldest series on (wheels are
downloaded once and cached). Without --strict the matrix is a report: it is written and the
tool exits 0 whatever drifts (the last line says how many releases drift and how to gate).
--strict makes it a gate: exit 1 unless every release has a series of its own whose every hunk
is exact or offset (what tools/apply.py needs; a release only an older series covers fails, as
apply refuses it, and so does one older than every series).

Exit: 0 written (with --strict: every release passes; --pinned: every series all-exact),
1 a release fails (--strict) or a series is not all-exact on its release (--pinned),
2 usage or input error (also an unknown release).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("drift.py", __doc__, whole_doc=True)
    ap.add_argument("--releases", help="comma list of releases (default: every release on the index)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "drift.md",
                    help="Markdown file to write (default: docs/drift.md of this clone)")
    ap.add_argument("--strict", action="store_true",
                    help="gate: exit 1 unless every release has its own series and every hunk is exact or offset")
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
        failing = drift.gate_failures(rows, releases)
        print(f"drift: {drift.summary(rows, releases)}; wrote {a.out}")
        if a.strict:
            for _, why in failing:
                print("\n".join(why))
            print(f"drift --strict: {'FAIL: ' + ', '.join(x for x, _ in failing) if failing else 'every release passes'}"
                  f" (exit {1 if failing else 0})")
            return 1 if failing else 0
        print("drift: a report, exit 0 whatever drifts; to gate a CI: --releases <your sglang> --strict "
              "(exit 1 unless apply.py applies its own series there), or --pinned")
        return 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
