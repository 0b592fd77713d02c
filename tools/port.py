#!/usr/bin/env python3
"""Port the series to another SGLang release with a 3-way merge per patched file.

  python tools/port.py --from 0.5.9 --to 0.5.23 [--out DIR] [--force] [--dry-run] [--json FILE]
  python tools/port.py --from-tree OLD_ROOT --to-tree NEW_ROOT [--series DIR] [--to RELEASE]

Releases are fetched from the package index and cached; --from-tree/--to-tree take local trees
(git checkouts or dirs holding sglang/). Writes patches/sglang-<new>/ (series, smoke.series,
patches, manifest.json) in one step only when every hunk merges; otherwise prints a per-hunk
conflict report with both sides and writes nothing. Always prints a range-diff-like review.
Exit: 0 ported (or --dry-run clean), 1 conflicts or refused (nothing written), 2 usage error.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="port.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="from_release", metavar="RELEASE", help="release of the series to port")
    ap.add_argument("--to", dest="to_release", metavar="RELEASE", help="release to port to")
    ap.add_argument("--from-tree", type=Path, metavar="ROOT", help="local tree of the old release")
    ap.add_argument("--to-tree", type=Path, metavar="ROOT", help="local tree of the new release")
    ap.add_argument("--series", type=Path, help="series to port (default: patches/sglang-<from>)")
    ap.add_argument("--out", type=Path, help="new series dir (default: patches/sglang-<to>)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out dir")
    ap.add_argument("--dry-run", action="store_true", help="merge and review; write nothing")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON to FILE")
    ap.add_argument("--date", help="Last-Update of the ported patches (default: today, UTC)")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch import port
        from eaglepatch.errors import RefusedError, UsageError
        from eaglepatch.lock import tree_locks
        from eaglepatch.outputs import check_output_file
        from eaglepatch.series import default_patches_root, load_series

        if a.json is not None:
            check_output_file(a.json, "--json")
        given = None  # --series alone names the release it was made for
        if a.series is not None and a.from_release is None and a.from_tree is None:
            given = load_series(a.series)
            a.from_release = given.release
        old_tree, from_rel = port.open_release_tree(a.from_tree, a.from_release, "from")
        new_tree, to_rel = port.open_release_tree(a.to_tree, a.to_release, "to")
        old = given or port.load_old_series(from_rel, a.series)
        if old.release and old.release != from_rel:
            raise UsageError(f"{old.dir} was made for sglang {old.release}, not {from_rel}",
                             f"pass --from {old.release}")
        if from_rel == to_rel:
            raise UsageError(f"--from and --to are both {to_rel}", "pass the release to port to as --to")
        out = a.out or default_patches_root() / f"sglang-{to_rel}"
        if out.exists() and not (a.force or a.dry_run):
            raise RefusedError(f"{out} already exists", "pass --force to replace it, --out DIR, or --dry-run")
        with tree_locks(old_tree.package_parent, new_tree.package_parent):
            res = port.port_series(old, old_tree.read, new_tree.read, from_rel, to_rel, date=a.date)
        if a.json:
            port.write_json(a.json, res)
        print(port.hunk_table(res))
        print()
        print(port.review(res))
        if not res.clean:
            print()
            print(port.conflict_report(res))
            print(f"port: CONFLICT ({res.conflict_count} hunk(s)); nothing written (exit 1)")
            return 1
        if a.dry_run:
            print(f"port: clean; --dry-run, nothing written (would write {out})")
            return 0
        port.write_series(out, res.files, force=a.force)
        kept = [p for p in res.patches if p.status == "ported"]
        print(f"port: wrote {out} ({len(kept)} patch(es), {len(res.files)} files); "
              f"check it with: python3 tools/verify.py <sglang {to_rel} tree> --series {out}")
        return 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
