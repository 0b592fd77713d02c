"""python -m eaglepatch.smoke --level import|functional --package-parent DIR [--series DIR] [--checks ...]"""

import argparse
import sys
import time
from pathlib import Path

from . import GROUPS, LEVELS, run_smoke


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglepatch.smoke", description=__doc__)
    ap.add_argument("--level", choices=LEVELS, required=True)
    ap.add_argument("--package-parent", type=Path, required=True,
                    help="directory holding the patched sglang/ (smoke patches applied too)")
    ap.add_argument("--series", type=Path, default=None,
                    help="series directory (only used to name the test-only smoke patches)")
    ap.add_argument("--checks", default=None,
                    help="functional groups, comma separated: %s (default all)" % ",".join(GROUPS))
    ap.add_argument("--work-dir", type=Path, default=None, help="keep logs and dumps here")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        results = run_smoke(a.level, a.package_parent, a.series,
                            checks=a.checks.split(",") if a.checks else None, work_dir=a.work_dir)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(str(exc).splitlines()[0] if str(exc).startswith("error:") else "error: %s" % exc, file=sys.stderr)
        return 2
    for r in results:
        print("%s %s: %s" % ("PASS" if r.passed else "FAIL", r.name, r.figure))
        if not r.passed and r.detail:
            print("    " + r.detail.replace("\n", "\n    "))
    ok = all(r.passed for r in results) and bool(results)
    print("smoke %s: %s (%d checks, %.0f s)" % (a.level, "PASS" if ok else "FAIL", len(results), time.monotonic() - t0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
