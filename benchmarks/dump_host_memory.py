#!/usr/bin/env python3
"""Host memory, forward-thread waits and prefill cost of the dump, with the package's real DumpWriter.

Imports the overlay's ``eagle3_capture`` package directly (torch and safetensors only; no sglang
needed), so it runs inside the GPU bundle as it is:

  PYTHONPATH=/tmp/site:src python3 benchmarks/dump_host_memory.py --out $OUT/dump-host-memory.json
  PYTHONPATH=src python3 benchmarks/dump_host_memory.py --smoke --out /tmp/x.json   # CPU, seconds

1. memory: ``--prefills`` prefills of random sizes (``--min-tokens``..``--max-tokens``) at
   ``--hidden`` (bf16, ``--layers`` layers + final, ids int64) plus one ``--chunked-tokens``
   request prefilled in ``--chunk`` chunks, submitted at ``--pace`` tokens/s of prefill (so the
   disk can keep up); a reaper deletes written files so the disk does not fill. Reports the
   process's resident memory (VmRSS/VmHWM) and PyTorch's caching host allocator before start,
   after start (the arena), at peak, after the work drained and after close; each submit's wall
   time on the forward thread (p50/p99/max) and the staging's own wait counters.
2. ratio: a synthetic prefill loop (``--gflop-per-token`` of bf16 matmuls per token, the captured
   states its matmul outputs) with the writer on vs off, ``--reps`` repetitions alternating the
   order; prefill tokens/s on/off per repetition, min AND median, verdict by the worst.

Verdicts (GPU runs; --smoke only reports): no caching-host-allocator growth; peak RSS growth <=
cap + the chunked request's rows + 1 GiB; after drain <= cap + 1 GiB; forward wait p99 <= 5 ms;
worst-repetition ratio >= 0.95. Exit 0 all verdicts pass (or --smoke), 1 a verdict failed,
2 usage error.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

GIB = 1 << 30
SLACK = GIB  # the documented constant beside the arena and the chunked rows


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _host_alloc(torch) -> int:
    """Bytes PyTorch's caching host (pinned) allocator holds, where this torch reports it."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return 0
    stats = fn()
    for key in ("reserved_bytes.current", "allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return 0


def _mem(torch) -> dict:
    return {"rss": _status("VmRSS"), "hwm": _status("VmHWM"), "locked": _status("VmLck"),
            "pinned_vm": _status("VmPin"), "caching_host_alloc": _host_alloc(torch)}


def _pct(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class _Mode:
    name = "EXTEND"


class _Batch:
    """The ForwardBatch fields DumpWriter.submit reads, and the requests the package's identity
    hook attaches to a prefill's ForwardBatch (one request id per slot)."""

    def __init__(self, ids, lens, prefixes, slots, totals, device, tag="r"):
        import torch

        identity = _module("identity")
        self._eagle3_requests = [identity.RequestInfo("%s-%d" % (tag, s), int(t)) for s, t in zip(slots, totals)]
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = list(prefixes)
        self.req_pool_indices = torch.tensor(slots, device=device)
        self.orig_seq_lens = torch.tensor(totals, dtype=torch.int32, device=device)


class _Reaper(threading.Thread):
    """Deletes written dump files so that a long run does not fill the disk."""

    def __init__(self, directory: Path):
        super().__init__(daemon=True)
        self.directory, self.stop, self.deleted = directory, threading.Event(), 0

    def run(self):
        while not self.stop.wait(0.05):
            self.sweep()

    def sweep(self):
        for p in self.directory.glob("*.safetensors"):
            try:
                p.unlink()
                self.deleted += 1
            except OSError:
                pass


_PKG = []


def _module(name: str):
    """A module of the overlay's eagle3_capture package (imported once, without sglang)."""
    if not _PKG:
        from eaglepatch.overlay import import_package

        _PKG.append(import_package("eagle3_capture_bench"))
    import importlib

    return importlib.import_module("eagle3_capture_bench." + name)


def memory_run(a, torch, device) -> dict:
    dump_mod = _module("dump")
    rng = random.Random(0)
    H, L = a.hidden, a.layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    biggest = max(a.max_tokens, a.chunk)
    pool = torch.randn(L + 1, biggest, H, device=device, dtype=dtype)  # each state's rows: slices of its buffer
    indices = list(range(1, L + 1))
    out_dir = Path(tempfile.mkdtemp(prefix="dump-host-memory-", dir=a.dir))
    reaper = _Reaper(out_dir)
    reaper.start()
    before = _mem(torch)
    writer = dump_mod.DumpWriter(str(out_dir), indices, True, a.cap_mb << 20, {"format": "eagle3-dump/1"},
                                 chunked=True)
    started = _mem(torch)
    peak = dict(started)
    waits = []
    plan = [("whole", rng.randint(a.min_tokens, a.max_tokens)) for _ in range(a.prefills)]
    plan.insert(len(plan) // 2, ("chunked", a.chunked_tokens))
    slot = 0
    t0 = time.perf_counter()

    def submit(n, prefix, total, s):
        ids = torch.randint(2, 150000, (n,), device=device)
        captured = {i: pool[j, :n] for j, i in enumerate(indices)}
        batch = _Batch(ids, [n], [prefix], [s], [total], device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        w0 = time.perf_counter()
        writer.submit(batch, captured, pool[L, :n])
        waits.append(time.perf_counter() - w0)
        time.sleep(n / a.pace)  # the prefill this many tokens would take
        m = _mem(torch)
        for k, v in m.items():
            peak[k] = max(peak[k], v)

    for kind, n in plan:
        slot += 1
        if kind == "whole":
            submit(n, 0, n, slot)
        else:
            for start in range(0, n, a.chunk):
                submit(min(a.chunk, n - start), start, n, slot)
    writer.flush()
    drained = _mem(torch)
    st = writer.staging
    counters = {"waits": st.waits, "wait_s_total": st.wait_s_total, "wait_s_max": st.wait_s_max,
                "oversized": st.oversized, "peak_in_use": st.peak_in_use, "peak_chunk_bytes": st.peak_chunk_bytes,
                "arena_pinned": st.pinned}
    writer.close()
    import gc

    gc.collect()
    closed = _mem(torch)
    reaper.stop.set()
    reaper.join()
    reaper.sweep()
    seconds = time.perf_counter() - t0
    try:
        out_dir.rmdir()
    except OSError:
        pass
    per_token = 8 + H * pool.element_size() * (L + 1)
    chunked_rows = a.chunked_tokens * per_token
    cap = a.cap_mb << 20
    grow = {"after_start": started["rss"] - before["rss"], "peak": peak["hwm"] - before["rss"],
            "after_drain": drained["rss"] - before["rss"], "after_close": closed["rss"] - before["rss"]}
    return {
        "seconds": seconds, "prefills": len(plan), "chunked_tokens": a.chunked_tokens, "written": writer.written,
        "dropped": writer.dropped, "failed": writer.failed, "cap_bytes": cap, "chunked_rows_bytes": chunked_rows,
        "mem": {"before": before, "after_start": started, "peak": peak, "after_drain": drained, "after_close": closed},
        "rss_growth": grow,
        "caching_host_alloc_growth": peak["caching_host_alloc"] - before["caching_host_alloc"],
        "submit_ms": {"p50": 1e3 * _pct(waits, 0.5), "p99": 1e3 * _pct(waits, 0.99), "max": 1e3 * max(waits),
                      "n": len(waits)},
        "staging": counters,
        "bounds": {"peak_rss_max": cap + chunked_rows + SLACK, "after_drain_rss_max": cap + SLACK},
    }


def _forward(x, weight, k, capture_at):
    """k matmuls; the outputs at ``capture_at`` are the captured states."""
    captured = {}
    h = x
    for i in range(k):
        h = h @ weight
        if i in capture_at:
            captured[capture_at[i]] = h
    return captured, h


def ratio_run(a, torch, device) -> dict:
    dump_mod = _module("dump")
    H = a.hidden
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k = max(a.layers + 1, int(round(a.gflop_per_token * 1e9 / (2 * H * H))))
    weight = (torch.randn(H, H, device=device, dtype=dtype) / H ** 0.5)
    capture_at = {int(j * (k - 1) / max(a.layers, 1)): j + 1 for j in range(a.layers)}
    rng = random.Random(1)
    sizes = [rng.randint(a.min_tokens, a.max_tokens) for _ in range(a.ratio_prefills)]
    xs = torch.randn(max(sizes), H, device=device, dtype=dtype)
    out_dir = Path(tempfile.mkdtemp(prefix="dump-ratio-", dir=a.dir))
    reaper = _Reaper(out_dir)
    reaper.start()

    def loop(on: bool) -> float:
        writer = dump_mod.DumpWriter(str(out_dir), list(capture_at.values()), True, a.cap_mb << 20, {},
                                     chunked=True) if on else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for slot, n in enumerate(sizes):
            x = xs[:n]
            captured, final = _forward(x, weight, k, capture_at)
            if writer is not None:
                ids = torch.randint(2, 150000, (n,), device=device)
                writer.submit(_Batch(ids, [n], [0], [slot], [n], device, tag="ratio-%x" % id(writer)), captured, final)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if writer is not None:
            writer.close()  # the drain is not prefill time; the copies it waits for are counted above
        return sum(sizes) / seconds

    loop(True)  # warm-up: kernels, the first arena
    reps = []
    for r in range(a.reps):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        got = {m: loop(m == "on") for m in order}
        reps.append({"on_tokens_s": got["on"], "off_tokens_s": got["off"], "ratio": got["on"] / got["off"]})
    reaper.stop.set()
    reaper.join()
    reaper.sweep()
    try:
        out_dir.rmdir()
    except OSError:
        pass
    ratios = [r["ratio"] for r in reps]
    return {"matmuls_per_forward": k, "prefills": len(sizes), "tokens": sum(sizes), "reps": reps,
            "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dump_host_memory.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, seconds; reports without verdicts")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168: Kimi-K2.5)")
    ap.add_argument("--layers", type=int, default=4, help="dumped layers besides final (default 4)")
    ap.add_argument("--prefills", type=int, default=200, help="random-size prefills of the memory run (default 200)")
    ap.add_argument("--min-tokens", type=int, default=128, help="smallest prefill (default 128)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="largest prefill (default 4096)")
    ap.add_argument("--chunked-tokens", type=int, default=65536, help="the chunked request (default 65536)")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size (default 8192)")
    ap.add_argument("--pace", type=float, default=40000.0,
                    help="prefill tokens/s the memory run emulates between submits (default 40000)")
    ap.add_argument("--cap-mb", type=int, default=None, help="EAGLE3_DUMP_MAX_PENDING_MB (default: the package's)")
    ap.add_argument("--gflop-per-token", type=float, default=8.0,
                    help="synthetic prefill work per token in the ratio run (default 8: Kimi-K2.5 at TP 8)")
    ap.add_argument("--ratio-prefills", type=int, default=24, help="prefills per ratio loop (default 24)")
    ap.add_argument("--reps", type=int, default=3, help="ratio repetitions (default 3)")
    ap.add_argument("--dir", default=None, help="directory for the dump files (default: the temp dir)")
    a = ap.parse_args(argv)
    import torch

    if a.smoke:
        a.hidden, a.prefills, a.min_tokens, a.max_tokens = 64, 20, 8, 256
        a.chunked_tokens, a.chunk, a.pace, a.ratio_prefills, a.reps = 2000, 256, 1e7, 6, 2
        a.gflop_per_token, a.cap_mb = 0.0005, a.cap_mb or 1
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device; run on a GPU machine or pass --smoke", file=sys.stderr)
            return 2
        device = torch.device("cuda")
    if a.cap_mb is None:
        a.cap_mb = _module("settings").DEFAULT_MAX_PENDING_MB
    t0 = time.perf_counter()
    print("[bench] memory run: %d prefills + one %d-token chunked request, hidden %d, cap %d MiB"
          % (a.prefills, a.chunked_tokens, a.hidden, a.cap_mb), file=sys.stderr, flush=True)
    mem = memory_run(a, torch, device)
    print("[bench] memory run: %.1f s, submit p99 %.2f ms; ratio run: %d reps"
          % (mem["seconds"], mem["submit_ms"]["p99"], a.reps), file=sys.stderr, flush=True)
    ratio = ratio_run(a, torch, device)
    g = mem["rss_growth"]
    verdicts = {
        "no_caching_host_alloc_growth": mem["caching_host_alloc_growth"] == 0,
        "peak_rss_within_bound": g["peak"] <= mem["bounds"]["peak_rss_max"],
        "drained_rss_within_bound": g["after_drain"] <= mem["bounds"]["after_drain_rss_max"],
        "submit_p99_le_5ms": mem["submit_ms"]["p99"] <= 5.0,
        "all_written": mem["written"] == a.prefills + 1 and mem["dropped"] == 0 and mem["failed"] == 0,
        "worst_rep_ratio_ge_0.95": ratio["ratio_min"] >= 0.95,
    }
    res = {"args": vars(a) | {"out": str(a.out)}, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "memory": mem, "ratio": ratio, "verdicts": verdicts,
           "passed": all(verdicts.values()), "seconds": time.perf_counter() - t0}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    mib = lambda b: "%.0f MiB" % (b / 2 ** 20)  # noqa: E731
    print("rss growth: start %s, peak %s (bound %s), drained %s (bound %s), closed %s; caching host alloc +%s"
          % (mib(g["after_start"]), mib(g["peak"]), mib(mem["bounds"]["peak_rss_max"]), mib(g["after_drain"]),
             mib(mem["bounds"]["after_drain_rss_max"]), mib(g["after_close"]), mib(mem["caching_host_alloc_growth"])))
    print("submit ms: p50 %.3f p99 %.3f max %.3f (n=%d); staging waits %d (%.3f s, max %.1f ms)"
          % (mem["submit_ms"]["p50"], mem["submit_ms"]["p99"], mem["submit_ms"]["max"], mem["submit_ms"]["n"],
             mem["staging"]["waits"], mem["staging"]["wait_s_total"], 1e3 * mem["staging"]["wait_s_max"]))
    print("prefill on/off: min %.3f median %.3f max %.3f over %d reps (verdict by the worst)"
          % (ratio["ratio_min"], ratio["ratio_median"], ratio["ratio_max"], len(ratio["reps"])))
    for name, ok in verdicts.items():
        print("%s %s" % ("PASS" if ok else "FAIL", name))
    print("results: %s (%.0f s)" % (a.out, res["seconds"]))
    return 0 if a.smoke or res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
