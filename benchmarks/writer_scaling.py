#!/usr/bin/env python3
"""Benchmark 4: dump-writer scaling with 1, 4, 16, 64 concurrent requests.

Each level runs in a fresh process. N requests of different lengths (uniform in
[min_tokens, max_tokens], 4 states x hidden 7168, bf16) arrive at once; the forward thread
submits one prefill per request back to back (it blocks at the pending-bytes cap) and the time
runs until flush() returns. Reported per level: throughput (GB/s, files/s), the writer's peak
pending bytes, the peak resident memory above the baseline measured before the first submit
(peak RSS is reset through /proc/self/clear_refs, sampled too), and what stays resident after
flush (host buffers kept for reuse). Several repetitions per level, each in its own process;
median and spread. The pending cap is a flag (default 256 MiB, the requests total up to ~2 GB
at 64).

  python3 benchmarks/writer_scaling.py [--quick] [--reps N] [--levels 1,4,16,64]
                                       [--cap-mb MB] [--dir DIR] [--min-tokens T] [--max-tokens T]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

LAYERS = [-1, 2, 30]
HIDDEN = 7168


def child(n: int, cap: int, directory: str, tmin: int, tmax: int, seed: int) -> dict:
    import torch

    from sglang.srt.eagle3_capture.dump import DumpWriter

    rng = random.Random(seed)
    lengths = [rng.randint(tmin, tmax) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(tmax, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(len(LAYERS) + 1)]
    ids = [torch.randint(2, 100000, (t,), generator=g, dtype=torch.int64) for t in lengths]
    d = Path(tempfile.mkdtemp(prefix="eaglepatch-scale-", dir=directory))
    writer = DumpWriter(str(d), LAYERS, True, cap, _bench.metadata())
    try:  # give the float32 temporaries back, so new host buffers show up in RSS
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    baseline = _bench.rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter (VmHWM)
    except OSError:
        pass
    peak = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _bench.rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    nbytes = 0
    error = None
    t0 = time.perf_counter()
    for k, (t, i) in enumerate(zip(lengths, ids)):
        captured = {k + 1: base[j][:t] for j, k in enumerate(LAYERS)}
        try:
            writer.submit(_bench.Batch(i, [t]), captured, base[-1][:t])
        except Exception as exc:  # reported, not hidden: the level then has no figures
            error = "request %d of %d: submit() raised %s: %s" % (k + 1, n, type(exc).__name__, exc)
            break
        nbytes += t * 8 + (len(LAYERS) + 1) * t * HIDDEN * 2
    if error:
        stop.set()
        return {"n": n, "error": error}
    writer.flush()
    dt = time.perf_counter() - t0
    stop.set()
    sampler.join()
    hwm = 0
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    after = _bench.rss_bytes()
    files = len(list(d.glob("*.safetensors")))
    writer.close()
    shutil.rmtree(d, ignore_errors=True)
    return {"n": n, "seconds": dt, "bytes": nbytes, "files": files, "failed": writer.failed,
            "peak_pending": writer.peak_pending_bytes, "peak_rss_over_base": max(peak[0], hwm) - baseline,
            "resident_after_flush": after - baseline, "largest_request": max(lengths) * (len(LAYERS) + 1) * HIDDEN * 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="levels 1,4,16,64 with 1 repetition and shorter requests")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--cap-mb", type=float, default=256)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--min-tokens", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    _bench.enter_env(patched=True)
    tmin = a.min_tokens or (128 if a.quick else 256)
    tmax = a.max_tokens or (512 if a.quick else 1024)
    cap = int(a.cap_mb * (1 << 20))
    if a.child:
        n, seed = map(int, a.child.split(":"))
        print(json.dumps(child(n, cap, a.dir, tmin, tmax, seed)))
        return 0
    reps = a.reps or (1 if a.quick else 3)
    levels = [int(x) for x in a.levels.split(",")]
    print("# writer scaling: requests of %d..%d tokens x 4 states x hidden %d bf16, pending cap %.0f MiB, "
          "dump dir %s; %s" % (tmin, tmax, HIDDEN, a.cap_mb, a.dir, _bench.machine()))
    results = {n: [] for n in levels}
    errors = {}
    for rep in range(reps):
        for n in levels:  # levels interleaved across repetitions
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", "%d:%d" % (n, rep)],
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if r.get("error"):
                _bench.log("rep %d level %d: %s" % (rep, n, r["error"]))
                errors.setdefault(n, r["error"])
                continue
            if r["files"] != n or r["failed"]:
                raise SystemExit("level %d: %d files written, %d failed" % (n, r["files"], r["failed"]))
            results[n].append(r)
            _bench.log("rep %d level %d: %.2f s, peak pending %.0f MiB, peak RSS +%.0f MiB"
                       % (rep, n, r["seconds"], r["peak_pending"] / 2**20, r["peak_rss_over_base"] / 2**20))
    rows = []
    ok = [r["bytes"] / r["seconds"] for r in results[levels[0]]]
    one = _bench.median(ok) if ok else float("nan")
    for n in levels:
        rs = results[n]
        if not rs:
            rows.append([n, "FAILED: " + errors.get(n, "no result")] + [""] * 7)
            continue
        mib = lambda k: _bench.summary([r[k] / 2**20 for r in rs])  # noqa: E731
        gbs = [r["bytes"] / r["seconds"] / 1e9 for r in rs]
        rows.append([n, "%.2f GB" % (_bench.median([r["bytes"] for r in rs]) / 1e9), _bench.summary(gbs),
                     _bench.summary([r["files"] / r["seconds"] for r in rs]),
                     "%.2f" % (_bench.median(gbs) * 1e9 / one),
                     mib("peak_pending"), mib("peak_rss_over_base"),
                     "%.2f" % (_bench.median([r["peak_rss_over_base"] for r in rs]) / cap),
                     mib("resident_after_flush")])
    print(_bench.table(["requests", "bytes", "GB/s", "files/s", "GB/s vs 1 request", "peak pending MiB",
                        "peak RSS over baseline MiB", "peak RSS / cap", "resident after flush MiB"], rows))
    print("cap %.0f MiB; median (min..max, n=repetitions)" % a.cap_mb)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
