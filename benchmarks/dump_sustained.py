#!/usr/bin/env python3
"""Sustained dump: prefill without a pause until the last file is durable, dump on and off, and the
writer threads against the disk's own sequential bandwidth, all in one run.

Imports the overlay's ``eagle3_capture`` package directly (torch and safetensors only), so it runs in
the GPU bundle as it is:

  PYTHONPATH=/tmp/site:src python3 benchmarks/dump_sustained.py --out $OUT/dump-sustained.json
  PYTHONPATH=src python3 benchmarks/dump_sustained.py --smoke --out /tmp/x.json   # CPU, seconds

Each repetition, in a rotating order:
- ``disk``: one file of the bf16 run's bytes written in 64 MiB blocks and fsynced (one stream), and
  the same bytes as one file per writer thread at once (the most writers asked for);
- ``off``: ``--tokens`` prompt tokens as prefills of ``--prefill-tokens`` (``--requests`` requests
  each), every prefill a synthetic forward (bf16 ``[T, H] @ [H, H]`` matmuls, their count calibrated
  at start so that the forward alone runs at ``--forward-tokens-per-s``; default 67000, the check
  model's prefill on one H200 without the dump, docs/gpu.md), the states the matmul outputs;
- ``on``: the same with the real ``DumpWriter`` (``--layers`` layers + final, hidden ``--hidden``,
  per dtype and writer count), timed until its flush returns (every file durable);
- ``writer``: the same submits with no forward between them: what the writer threads put on the
  disk at most.
Reported per configuration and repetition: tokens/s, GB/s into files, the forward thread's submit
times (p50/p99/max) and the host arena's waits, the arena's peak bytes; min and median over the
repetitions, and the process's peak resident memory.

Verdicts (GPU runs; --smoke only reports): in every repetition, sustained on / off >= 0.9 for each
dtype at the default writer count, and the writer alone >= 0.9 of the disk's one-stream bandwidth.
Exit 0 all verdicts pass (or --smoke), 1 a verdict failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

GOAL = 0.9
BLOCK = 64 << 20


def _module(name: str):
    from eaglepatch.overlay import import_package

    import_package("e3c_sustained")
    return __import__("e3c_sustained." + name, fromlist=["x"])


class _Mode:
    name = "EXTEND"


class _Batch:
    """The ForwardBatch fields ``DumpWriter.submit`` reads, with the requests ``identity`` attaches."""

    def __init__(self, ids, lens, infos):
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = [0] * len(lens)
        self._eagle3_requests = list(infos)


def _pct(values, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _empty(directory: Path) -> None:
    for p in directory.iterdir():
        p.unlink()


def disk_bandwidth(directory: Path, nbytes: int, streams: int) -> float:
    """GB/s of ``nbytes`` written as ``streams`` files at once (64 MiB blocks, each fsynced)."""
    import threading

    block = os.urandom(BLOCK)
    per = max(BLOCK, nbytes // streams // BLOCK * BLOCK)

    def one(i: int) -> None:
        fd = os.open(str(directory / f"disk-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = per
            while left > 0:
                left -= os.write(fd, block[:min(BLOCK, left)])
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    _empty(directory)
    return per * streams / seconds / 1e9


class Rig:
    def __init__(self, a, torch, device):
        self.a, self.torch, self.device = a, torch, device
        self.dump, self.identity, self.storage = _module("dump"), _module("identity"), _module("storage")
        H = a.hidden
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.weight = torch.randn(H, H, device=device, dtype=self.dtype) / H ** 0.5
        self.x = torch.randn(a.prefill_tokens, H, device=device, dtype=self.dtype)
        self.ids = torch.randint(2, 150000, (a.prefill_tokens,), device=device)
        self.indices = list(range(1, a.layers + 1))  # capture indices of layers 0..L-1
        self.k = self._calibrate()
        self.capture_at = {int(j * (self.k - 1) / max(a.layers, 1)): self.indices[j] for j in range(a.layers)}
        self.prefills = max(1, a.tokens // a.prefill_tokens)
        self.serial = 0

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _calibrate(self) -> int:
        """Matmuls per forward so that the forward alone runs at ``--forward-tokens-per-s``."""
        h = self.x
        for _ in range(3):
            h = h @ self.weight
        self._sync()
        t0 = time.perf_counter()
        for _ in range(8):
            h = h @ self.weight
        self._sync()
        per = (time.perf_counter() - t0) / 8
        want = self.a.prefill_tokens / self.a.forward_tokens_per_s
        return max(self.a.layers + 1, int(round(want / per)))

    def forward(self):
        captured, h = {}, self.x
        for i in range(self.k):
            h = h @ self.weight
            if i in self.capture_at:
                captured[self.capture_at[i]] = h
        return captured, h

    def writer(self, directory: Path, dtype: str, writers: int):
        s = self.storage
        layout = s.Layout(s.Storage(dtype, "store"), self.indices, True, self.a.layers + 1,
                          str(self.dtype).replace("torch.", ""), 1e-6, 150000)
        return self.dump.DumpWriter(str(directory), self.indices, True, self.a.cap_mb << 20, {"launch_id": "bench"},
                                    layout=layout, writers=writers)

    def batch(self):
        n = self.a.requests
        lens = [self.a.prefill_tokens // n] * n
        lens[-1] += self.a.prefill_tokens - sum(lens)
        infos = []
        for length in lens:
            self.serial += 1
            infos.append(self.identity.RequestInfo(f"bench-{self.serial}", length))
        return _Batch(self.ids, lens, infos)

    def run(self, directory: Path, mode: str, dtype: str = "bf16", writers: int = 1) -> dict:
        """One configuration: ``off`` (forward only), ``on`` (forward + dump), ``writer`` (dump only)."""
        w = self.writer(directory, dtype, writers) if mode != "off" else None
        states = self.forward() if mode == "writer" else None
        submits = []
        self._sync()
        t0 = time.perf_counter()
        for _ in range(self.prefills):
            captured, final = states if states is not None else self.forward()
            if w is not None:
                t = time.perf_counter()
                w.submit(self.batch(), captured, final)
                submits.append(time.perf_counter() - t)
        self._sync()
        if w is not None:
            w.flush()  # the last file durable
        seconds = time.perf_counter() - t0
        tokens = self.prefills * self.a.prefill_tokens
        out = {"mode": mode, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
        if w is not None:
            files = list(directory.glob("*.safetensors"))
            nbytes = sum(f.stat().st_size for f in files)
            counts = w.counts()
            out.update(dtype=dtype, writers=writers, files=len(files), written=counts["written"],
                       failed=counts["failed"], bytes=nbytes, bytes_per_token=round(nbytes / tokens, 1),
                       GBps=round(nbytes / seconds / 1e9, 3),
                       submit_ms={"p50": round(1e3 * _pct(submits, 0.5), 3), "p99": round(1e3 * _pct(submits, 0.99), 3),
                                  "max": round(1e3 * max(submits), 3)},
                       arena_waits=w.staging.waits, arena_wait_s=round(w.staging.wait_s_total, 4),
                       arena_peak_bytes=w.staging.peak_in_use)
            w.close()
            _empty(directory)
        return out


def _summary(values) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dump_sustained.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, seconds; reports without verdicts")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    ap.add_argument("--layers", type=int, default=3, help="dumped layers besides final (default 3: 4 states)")
    ap.add_argument("--tokens", type=int, default=131072, help="prompt tokens per configuration (default 131072)")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per prefill forward (default 8192)")
    ap.add_argument("--requests", type=int, default=4, help="requests per prefill (default 4: 2048-token files)")
    ap.add_argument("--forward-tokens-per-s", type=float, default=67000.0,
                    help="the synthetic forward's own rate (default 67000: the H200 check model without the dump)")
    ap.add_argument("--writers", default=None,
                    help="writer-thread counts to run, comma-separated (default: 1 and the package's default)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="EAGLE3_DUMP_DTYPE values to run (default bf16,fp8)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--cap-mb", type=int, default=4096, help="EAGLE3_DUMP_MAX_PENDING_MB (default 4096, the package's)")
    ap.add_argument("--dir", default=None, help="directory for the files (default: the temp dir)")
    a = ap.parse_args(argv)
    import torch

    commits = _module("commits")
    if a.smoke:
        a.hidden, a.tokens, a.prefill_tokens, a.forward_tokens_per_s, a.reps = 256, 8192, 1024, 20000.0, 2
    default_writers = commits.default_writers()
    try:
        writers = sorted({int(x) for x in a.writers.split(",")}) if a.writers else sorted({1, default_writers})
        dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    except ValueError:
        print(f"error: --writers {a.writers!r} is not a comma-separated list of whole numbers; "
              f"pass e.g. --writers 1,4", file=sys.stderr)
        return 2
    bad = [d for d in dtypes if d not in ("bf16", "fp8")] + [str(n) for n in writers if not 1 <= n <= 64]
    if bad or not dtypes or a.tokens < a.prefill_tokens or a.reps < 1:
        print(f"error: unusable settings ({', '.join(bad) or 'sizes'}); pass --dtypes bf16,fp8, --writers from "
              f"1 to 64, --tokens >= --prefill-tokens and --reps >= 1", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rig = Rig(a, torch, device)
    work = Path(tempfile.mkdtemp(prefix="dump-sustained-", dir=a.dir))
    configs = [("off", "bf16", 1)] + [("on", d, n) for d in dtypes for n in writers] + \
              [("writer", "bf16", n) for n in writers]
    reps = []
    try:
        rig.run(work, "on", dtypes[0], writers[-1])  # warm-up: kernels, the arena, the page cache's first pages
        for r in range(a.reps):
            k = r % len(configs)
            order = configs[k:] + configs[:k]
            rep = {"disk_GBps_1_stream": None, "runs": []}
            for mode, dtype, n in order:
                rep["runs"].append(rig.run(work, mode, dtype, n))
            nbytes = next(x["bytes"] for x in rep["runs"] if x["mode"] == "writer")
            rep["disk_GBps_1_stream"] = round(disk_bandwidth(work, nbytes, 1), 3)
            rep[f"disk_GBps_{writers[-1]}_streams"] = round(disk_bandwidth(work, nbytes, writers[-1]), 3)
            off = next(x for x in rep["runs"] if x["mode"] == "off")["tokens_per_s"]
            for x in rep["runs"]:
                if x["mode"] == "on":
                    x["on_over_off"] = round(x["tokens_per_s"] / off, 4)
                if x["mode"] == "writer":
                    x["over_disk_1_stream"] = round(x["GBps"] / rep["disk_GBps_1_stream"], 4)
            reps.append(rep)
            partial = {"settings": {"reps_done": len(reps), "of": a.reps}, "reps": reps}
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(partial, indent=1) + "\n")  # a run cut short keeps its repetitions
            print(f"rep {r}: off {off:.0f} tokens/s; " + "; ".join(
                f"{x['mode']} {x.get('dtype', '')} x{x.get('writers', '')}: {x['tokens_per_s']:.0f} tokens/s "
                f"{x.get('GBps', 0):.2f} GB/s" for x in rep["runs"] if x["mode"] != "off")
                + f"; disk {rep['disk_GBps_1_stream']:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def figures(mode, dtype, n, key):
        return [next(x[key] for x in rep["runs"] if (x["mode"], x.get("dtype", "bf16"), x.get("writers", 1))
                     == (mode, dtype, n)) for rep in reps]

    summary = {}
    for mode, dtype, n in configs:
        name = mode if mode == "off" else f"{mode}-{dtype}-x{n}"
        s = {"tokens_per_s": _summary(figures(mode, dtype, n, "tokens_per_s"))}
        if mode == "on":
            s["on_over_off"] = _summary(figures(mode, dtype, n, "on_over_off"))
        if mode != "off":
            s["GBps"] = _summary(figures(mode, dtype, n, "GBps"))
        if mode == "writer":
            s["over_disk_1_stream"] = _summary(figures(mode, dtype, n, "over_disk_1_stream"))
        summary[name] = s
    verdicts = {}
    if not a.smoke:
        for d in dtypes:
            worst = summary[f"on-{d}-x{default_writers}"]["on_over_off"]["min"]
            verdicts[f"sustained on/off {d} x{default_writers} >= {GOAL} every rep"] = {"worst": worst,
                                                                                   "passed": worst >= GOAL}
        worst = summary[f"writer-bf16-x{default_writers}"]["over_disk_1_stream"]["min"]
        verdicts[f"writer x{default_writers} / disk one stream >= {GOAL} every rep"] = {"worst": worst,
                                                                                   "passed": worst >= GOAL}
    res = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "settings": {k: v for k, v in vars(a).items() if k != "out"} | {"writers": writers, "dtypes": dtypes,
                                                                           "default_writers": default_writers,
                                                                           "cpus": os.cpu_count()},
           "matmuls_per_forward": rig.k, "prefills_per_config": rig.prefills, "reps": reps, "summary": summary,
           "peak_rss_bytes": _peak_rss(), "verdicts": verdicts,
           "passed": all(v["passed"] for v in verdicts.values()) if verdicts else None}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: " + ", ".join(f"{k} min {v['min']:.3g} median {v['median']:.3g}" for k, v in s.items()))
    for name, v in verdicts.items():
        print(f"{'PASS' if v['passed'] else 'FAIL'} {name}: worst {v['worst']:.3f}")
    return 0 if a.smoke or res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
