#!/usr/bin/env python3
"""Views of a forward's rows made beside a busy Python thread: what one torch call that returns views
costs a thread sharing the GIL with a thread that runs Python all the time (the dump's gather thread
beside SGLang's scheduler thread).

  python3 benchmarks/views_gil.py [--reps 3] [--out views-gil.json]

One forward's tensor (32 requests of 100 rows, bf16, hidden 7168) cut into each request's rows, 6
times (a dump's 6 tensors), three ways: ``tensor_split`` at the 64 bounds (one call returning 65
views), 32 slices, ``split(100)``; with the main thread idle (``alone``) and running pure Python
(``busy``). Milliseconds for the 6, min and median over repetitions. Exit 0; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

REQUESTS, ROWS, HIDDEN, TENSORS = 32, 100, 7168, 6


def timed(fn, busy: bool) -> float:
    out, done = [0.0], [False]

    def work() -> None:
        t0 = time.perf_counter()
        for _ in range(TENSORS):
            fn()
        out[0] = (time.perf_counter() - t0) * 1000
        done[0] = True

    t = threading.Thread(target=work)
    t.start()
    if busy:
        _bench.busy(lambda: done[0])
    t.join()
    return round(out[0], 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args()
    if a.reps < 1:
        print("error: --reps must be >= 1; fix: e.g. --reps 3", file=sys.stderr)
        return 2
    _bench.in_torch_env()
    import torch

    t = torch.randn(REQUESTS * ROWS, HIDDEN).to(torch.bfloat16)
    bounds = [b for i in range(REQUESTS) for b in (i * ROWS, (i + 1) * ROWS)]
    ways = {"tensor_split": lambda: t.tensor_split(bounds),
            "32 slices": lambda: [t[i * ROWS:(i + 1) * ROWS] for i in range(REQUESTS)],
            "split": lambda: t.split(ROWS)}
    runs = {f"{w} {c}": [] for w in ways for c in ("alone", "busy")}
    for _ in range(a.reps):
        for w, fn in ways.items():
            for c in ("alone", "busy"):
                runs[f"{w} {c}"].append(timed(fn, c == "busy"))
    res = {"ms_for_6_tensors": {k: _bench.min_median(v) for k, v in runs.items()}, "reps": a.reps,
           "requests": REQUESTS, "rows": ROWS}
    _bench.emit(res, a.out)
    for w in ways:
        b, al = res["ms_for_6_tensors"][f"{w} busy"], res["ms_for_6_tensors"][f"{w} alone"]
        print(f"[views_gil] {w}: alone {al['median']} ms, beside a busy thread min {b['min']} median {b['median']} ms",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
