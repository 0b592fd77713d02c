#!/usr/bin/env python3
"""Issue 30: does a draft trained on the compact dump's data (fp8 states, embedding and final
rebuilt) accept what one trained on states stored as computed accepts? Compares two results of
tools/acceptance.py from one --work (same target, same conversations): the reference (default
storage) and the variant (--set dump_dtype=fp8 --set rebuildable=omit), each with its correct
drafts per draft seed (--set controls=correct --set draft_seeds=N).

  python3 benchmarks/fp8_accept.py BF16.json FP8.json [--out COMPARE.json]

Prints, per draft seed, both accept lengths (served on the GPU, replayed on CPU) and their
difference, the means and the mean difference (goal |d| <= 0.03), the dump's state and file
bytes on the train set, and the row error per state of the fp8 dump's states (as the reader
yields them) against the reference's (measured by the variant's run, in its storage section).
Pure Python (no torch): it reads the two JSON files only.
Exit: 0 the mean difference is within the goal, 1 it is not (or no common seed), 2 usage error
(unreadable file; runs of different targets or conversations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main(argv=None) -> int:
    from eaglepatch.acceptance import storage_check
    from eaglepatch.outputs import write_atomic

    ap = argparse.ArgumentParser(prog="fp8_accept.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", type=Path, help="tools/acceptance.py's result with the default storage (bf16, store)")
    ap.add_argument("variant", type=Path, help="its result with --set dump_dtype=fp8 --set rebuildable=omit")
    ap.add_argument("--out", type=Path, help="write the comparison as JSON here")
    ap.add_argument("--goal", type=float, default=storage_check.ACCEPT_GOAL,
                    help="the largest |mean difference| that meets the goal (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        ref, var = (json.loads(p.read_text()) for p in (a.reference, a.variant))
        c = storage_check.compare(ref, var, a.goal)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c["inputs"] = {"reference": str(a.reference), "variant": str(a.variant)}
    print("\n".join(storage_check.summary_lines(c)))
    if a.out:
        write_atomic(a.out, json.dumps(c, indent=2) + "\n", "--out")
    return 0 if c.get("within_goal") else 1


if __name__ == "__main__":
    sys.exit(main())
