#!/usr/bin/env python3
"""Verify the EAGLE-3 capture series against an SGLang tree: a verdict per hunk, the series
footprint, then smoke tests on a patched temporary copy (the tree itself is never written).

  python tools/verify.py ROOT [--series DIR] [--json FILE] [--smoke none|static|import|functional]

Exit: 0 every hunk exact/offset and smoke passed, 1 drift or smoke failure, 2 usage or input error.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="verify.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="SGLang git checkout or site-packages dir holding sglang/")
    ap.add_argument("--series", type=Path,
                    help="series dir (default: patches/sglang-<detected release>, else the newest series)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    ap.add_argument("--smoke", choices=["none", "static", "import", "functional"], default="static",
                    help="smoke level run on a patched temporary copy (default: static)")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch.errors import RefusedError
        from eaglepatch.report import verify_tree, write_json
        from eaglepatch.series import available_series, load_series
        from eaglepatch.tree import UpstreamTree, pick_series

        try:
            series, tree = pick_series(a.root, a.series)
        except RefusedError:  # no series for this release: verify the pinned (newest) one
            have = available_series()
            series = load_series(list(have.values())[-1])
            tree = UpstreamTree.open(a.root)
            print(f"no series for sglang {tree.release}; verifying the pinned series {series.dir}")
        rep = verify_tree(tree, series, a.smoke, say=lambda m: print(m, file=sys.stderr))
        print(rep.human())
        if a.json:
            write_json(a.json, rep)
        return rep.exit_code

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
