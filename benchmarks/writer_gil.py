#!/usr/bin/env python3
"""The dump's file writers beside a busy Python thread: what the GIL costs them, and what the file
sink's skipped fsyncs in a directory held in memory give back.

  python3 benchmarks/writer_gil.py [--dir /dev/shm] [--writers 1,4] [--tokens 200] [--seconds 3]
                                   [--reps 3] [--out writer-gil.json]

In a server the dump's writer threads live in the scheduler's process, whose own thread holds the
GIL while it runs Python. A writer back from a system call waits for the GIL until that thread is
asked to drop it (Python's switch interval: 5 ms by default), and a file's commit made about ten
such calls (the write, the chmod, the rename, and the open, fsync and close of each of the two
fsyncs). Here the main thread runs pure Python throughout (the scheduler's stand-in) while W
threads commit files through the overlay's real ``FileSink`` (``tokens`` rows of 4 bf16 states of
hidden 7168, as a DeepSeek-V3 dump) into ``--dir``, for ``--seconds`` per configuration:

- ``before``: fsyncs on (the sink as it was), the default 5 ms switch interval;
- ``after``: the sink's own choice of fsync (none in a directory held in memory), 5 ms;
- ``after-1ms``: ``after`` at a 1 ms switch interval (not what the dump does: a CPU server's
  forward ran slower at 1 ms, docs/benchmarks.md section 14; measured for the record);
- ``alone``: ``after`` with the main thread idle: the writers' own rate.

Configurations are interleaved within each repetition. Reported per configuration and writer
count: files/s and the main thread's loop rate (Mops/s), min and median over repetitions, and per
repetition the ratio of ``after`` to ``before`` (the writers' gain, and what the busy thread kept).
Exit 0; 2 on a usage error (one line).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _bench  # noqa: E402

CONFIGS = ("before", "after", "after-1ms", "alone")
TRIED_INTERVAL_S = 0.001  # after-1ms
HIDDEN, STATES = 7168, 4


def one(sinks, d: Path, config: str, writers: int, tokens: int, seconds: float) -> dict:
    import torch

    sink = sinks.FileSink(str(d))
    if config == "before":  # fsync as the sink did before it knew memory from disk
        sink.fsyncs = {k: None for k in sink.fsyncs}
    sys.setswitchinterval(TRIED_INTERVAL_S if config == "after-1ms" else 0.005)
    tensors = {f"layer.{i}": torch.randn(tokens, HIDDEN).to(torch.bfloat16) for i in range(STATES)}
    tensors["input_ids"] = torch.arange(tokens)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stop = time.monotonic() + seconds
    done = [0] * writers

    def write(i: int) -> None:
        k = 0
        while time.monotonic() < stop:
            sink.commit(f"w{i}-{k % 8}", tensors, {"bench": "writer_gil"})
            k += 1
            done[i] += 1

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    loops = 0
    if config != "alone":
        while time.monotonic() < stop:  # the scheduler's stand-in: Python all the time
            for _ in range(1000):
                loops += 1
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    sys.setswitchinterval(0.005)
    for f in d.iterdir():
        f.unlink()
    return {"files_per_s": round(sum(done) / wall, 1), "gb_per_s": round(sum(done) * nbytes / wall / 1e9, 3),
            "busy_thread_mops_per_s": round(loops / wall / 1e6, 2) if config != "alone" else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="parent of the directory the files go to (default /dev/shm)")
    ap.add_argument("--writers", default="1,4", help="writer thread counts, comma list (default 1,4)")
    ap.add_argument("--tokens", type=int, default=200, help="rows per file (default 200)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per configuration (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args()
    counts = _bench.counts(a.writers)
    if not counts or a.tokens < 1 or a.seconds <= 0 or a.reps < 1:
        print("error: --writers takes counts >= 1, --tokens, --seconds and --reps positive values; "
              "fix: e.g. --writers 1,4 --tokens 200 --seconds 3 --reps 3", file=sys.stderr)
        return 2
    if not Path(a.dir).is_dir():
        print(f"error: --dir {a.dir}: not a directory; fix: pass an existing directory, e.g. /dev/shm", file=sys.stderr)
        return 2
    _bench.in_torch_env()
    from eaglepatch.overlay import import_package

    import_package("e3c_writer_gil")
    sinks = __import__("e3c_writer_gil.sinks", fromlist=["FileSink"])
    d = Path(tempfile.mkdtemp(prefix="writer-gil-", dir=a.dir))
    res = {"dir": a.dir, "memory_backed": sinks.memory_backed(str(d)), "tokens": a.tokens, "seconds": a.seconds,
           "reps": a.reps, "cores": os.cpu_count(), "python": sys.version.split()[0], "writers": {}}
    try:
        for w in counts:
            runs = {c: [] for c in CONFIGS}
            for r in range(a.reps):
                for c in CONFIGS:
                    runs[c].append(one(sinks, d, c, w, a.tokens, a.seconds))
                    print(f"[writer_gil] writers {w} rep {r + 1} {c}: {runs[c][-1]}", file=sys.stderr, flush=True)
            block = {c: {"files_per_s": _bench.min_median([x["files_per_s"] for x in runs[c]])} for c in CONFIGS}
            for c in CONFIGS[:-1]:
                block[c]["busy_thread_mops_per_s"] = _bench.min_median([x["busy_thread_mops_per_s"] for x in runs[c]])
            block["after_over_before"] = {
                "files_per_s": _bench.min_median([round(x["files_per_s"] / y["files_per_s"], 2)
                                   for x, y in zip(runs["after"], runs["before"])]),
                "busy_thread": _bench.min_median([round(x["busy_thread_mops_per_s"] / y["busy_thread_mops_per_s"], 3)
                                   for x, y in zip(runs["after"], runs["before"])])}
            res["writers"][str(w)] = block
    finally:
        shutil.rmtree(d, ignore_errors=True)
    _bench.emit(res, a.out)
    for w, b in res["writers"].items():
        g, k = b["after_over_before"]["files_per_s"], b["after_over_before"]["busy_thread"]
        print(f"[writer_gil] {w} writer(s), {a.tokens} tokens a file, {'memory' if res['memory_backed'] else 'disk'}: "
              f"files/s after/before min {g['min']} median {g['median']}; busy thread kept min {k['min']} "
              f"median {k['median']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
