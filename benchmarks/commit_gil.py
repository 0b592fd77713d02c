#!/usr/bin/env python3
"""The dump writer's own work beside a busy Python thread: a base revision's overlay against this tree's.

  python3 benchmarks/commit_gil.py [--base REV] [--dir /dev/shm] [--requests 32] [--tokens 100,500]
                                   [--writers 4] [--seconds 3] [--reps 3] [--switch-ms MS] [--out commit-gil.json]

The dump's gather and writer threads share the scheduler's process, whose thread holds the GIL
while it runs Python. Each torch call (a slice, a view, a dtype change) and each system call a
writer makes gives the GIL away, and getting it back waits up to Python's switch interval (5 ms)
while that thread runs. Here the main thread runs pure Python throughout (the scheduler's
stand-in) while the real ``DumpWriter`` of each overlay (``--base``'s, checked out with git, and the
working tree's) gathers forwards of ``--requests`` prompts of ``--tokens`` rows (an embedding, 3
layers and the final state, bf16, hidden 7168: a DeepSeek-V3 dump) and its ``--writers`` threads
commit one file per prompt into ``--dir``, for ``--seconds`` per configuration:

- ``busy``: beside the busy thread (what a server's dump meets);
- ``alone``: the main thread idle (the writer's own rate: the disk and the copies).

Configurations and overlays are interleaved within each repetition. Reported per token count:
files/s of each overlay and configuration (min and median over repetitions) and, per repetition,
this tree's files/s over the base's beside the busy thread. ``--switch-ms MS``: this tree's runs set
the GIL switch interval to MS (``sys.setswitchinterval``, what ``EAGLE3_DUMP_GIL_SWITCH_MS`` sets in a
server), the base's keep Python's 5 ms: with ``--base HEAD`` that compares the interval alone. The busy
thread's loops per second are reported too (the scheduler's stand-in: what a shorter interval costs
it), and their ratio tree / base. Exit 0; 2 on a usage error (one line).
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

HIDDEN, LAYERS = 7168, (-1, 2, 30, 59)  # capture of the embedding and three layers, + the final state
CONFIGS = ("busy", "alone")
IN_FLIGHT = 2  # forwards gathered and not yet written, at most


class Forward:
    """One prefill forward's host rows of ``requests`` prompts of ``tokens`` rows each."""

    def __init__(self, requests: int, tokens: int):
        import torch

        n = requests * tokens
        self.tensors = {"input_ids": torch.randint(0, 100000, (n,), dtype=torch.int64)}
        for k in LAYERS:
            self.tensors[f"layer.{k}"] = torch.randn(n, HIDDEN).to(torch.bfloat16)
        self.tensors["final"] = torch.randn(n, HIDDEN).to(torch.bfloat16)
        self.requests, self.tokens = requests, tokens
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())


def one(name: str, root: Path, d: Path, fwd: Forward, config: str, writers: int, seconds: float,
        switch_s: float | None = None) -> dict:
    """Files/s of the overlay at ``root`` (imported as ``name``) for ``seconds``, and the busy thread's
    loops/s; ``switch_s``: the GIL switch interval meanwhile (None: the interpreter's)."""
    from eaglepatch.overlay import import_package

    import_package(name, root)
    dump = __import__(name + ".dump", fromlist=["DumpWriter"])
    ident = __import__(name + ".identity", fromlist=["RequestInfo"])
    w = dump.DumpWriter(str(d), [k + 1 for k in LAYERS], True, 1 << 30, {"format": "eagle3-dump/1"},
                        writers=writers)
    stop = time.monotonic() + seconds
    done = [0]

    def gather() -> None:  # the writer's gather thread: whole forwards, their files on the pool
        k, flushes = 0, []
        while time.monotonic() < stop:
            spans = [dump._Span(i * fwd.tokens, fwd.tokens, 0, ident.RequestInfo(rid=f"{config}-{k}-{i}",
                                                                                   prompt_len=fwd.tokens))
                     for i in range(fwd.requests)]
            job = dump._Job(dict(fwd.tensors), [], 0, None, spans)
            hold = dump._Hold(lambda: None)
            w._gather(job, hold)
            hold.drop()
            flushes.append(threading.Event())
            w._pool.when_done(flushes[-1])
            if len(flushes) > IN_FLIGHT:  # the staging memory's bound: a few forwards ahead of the files
                flushes.pop(0).wait()
                done[0] += fwd.requests
            k += 1
        for f in flushes:
            f.wait()
            done[0] += fwd.requests

    before = sys.getswitchinterval()
    loops = 0
    with _bench.swept(d):
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        try:
            t = threading.Thread(target=gather)
            t0 = time.monotonic()
            t.start()
            if config == "busy":
                loops = _bench.busy(lambda: time.monotonic() >= stop)
            busy_s = time.monotonic() - t0
            interval = sys.getswitchinterval()
            t.join()
            wall = time.monotonic() - t0
        finally:
            sys.setswitchinterval(before)
        w.close()
    assert w.failed == 0, f"{name}: {w.failed} files failed"
    return {"files_per_s": round(done[0] / wall, 1), "busy_loops_per_s": round(loops / busy_s),
            "switch_ms": round(interval * 1e3, 3),
            "gb_per_s": round(done[0] * fwd.nbytes / fwd.requests / wall / 1e9, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.base_args(ap)
    _bench.forward_args(ap, "threads")
    ap.add_argument("--switch-ms", type=float, help="this tree's runs with this GIL switch interval, milliseconds "
                    "(above 0, at most 100; default: Python's 5 ms, as the base's)")
    a = ap.parse_args()
    why = _bench.forward_usage(a)
    from eaglepatch.serve import MAX_GIL_SWITCH_MS

    if not why and a.switch_ms is not None and not 0 < a.switch_ms <= MAX_GIL_SWITCH_MS:
        why = (f"error: --switch-ms {a.switch_ms:g}: not above 0 and at most {MAX_GIL_SWITCH_MS:g}; "
               f"fix: e.g. --switch-ms 1")
    if why:
        print(why, file=sys.stderr)
        return 2
    why = _bench.base_usage(a)
    if why:
        print(why, file=sys.stderr)
        return 2
    tokens = _bench.counts(a.tokens)
    _bench.in_torch_env()
    from eaglepatch.overlay import overlay_root

    scratch = Path(tempfile.mkdtemp(prefix="commit-gil-"))
    d = Path(tempfile.mkdtemp(prefix="commit-gil-", dir=a.dir))
    base_root, base_rev = _bench.base_overlay(a, scratch)
    roots = {"base": base_root, "tree": overlay_root()}
    res = {"base": base_rev, "dir": a.dir, "requests": a.requests, "writers": a.writers, "seconds": a.seconds,
           "reps": a.reps, "cores": os.cpu_count(), "python": sys.version.split()[0],
           "tree_switch_ms": a.switch_ms, "tokens": {}}
    try:
        for n in tokens:
            fwd = Forward(a.requests, n)
            runs = {(o, c): [] for o in roots for c in CONFIGS}
            loops = {o: [] for o in roots}
            intervals = {o: set() for o in roots}
            for r in range(a.reps):
                for c in CONFIGS:
                    for o, root in roots.items():
                        got = one(f"e3c_commit_gil_{o}", root, d, fwd, c, a.writers, a.seconds,
                                  a.switch_ms / 1e3 if o == "tree" and a.switch_ms else None)
                        runs[o, c].append(got["files_per_s"])
                        if c == "busy":
                            loops[o].append(got["busy_loops_per_s"])
                        intervals[o].add(got["switch_ms"])
                        print(f"[commit_gil] {n} tokens rep {r + 1} {o} {c}: {got}", file=sys.stderr, flush=True)
            block = {f"{o} {c}": _bench.min_median(v) for (o, c), v in runs.items()}
            block["tree_over_base_busy"] = _bench.min_median([round(x / y, 2) for x, y in
                                               zip(runs["tree", "busy"], runs["base", "busy"])])
            block["busy_loops_per_s"] = {o: _bench.min_median(v) for o, v in loops.items()}
            block["switch_ms"] = {o: sorted(v) for o, v in intervals.items()}  # as read while each ran
            block["tree_over_base_busy_loops"] = _bench.min_median([round(x / y, 2) for x, y in
                                                                    zip(loops["tree"], loops["base"])])
            res["tokens"][str(n)] = block
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    _bench.emit(res, a.out)
    for n, b in res["tokens"].items():
        g = b["tree_over_base_busy"]
        print(f"[commit_gil] {n} tokens a file, {a.writers} writers, beside a busy thread: files/s this tree / "
              f"{base_rev} min {g['min']} median {g['median']} (base {b['base busy']['median']}, tree "
              f"{b['tree busy']['median']}; alone {b['base alone']['median']} / {b['tree alone']['median']}); "
              f"the busy thread's loops/s this tree / base min {b['tree_over_base_busy_loops']['min']} median "
              f"{b['tree_over_base_busy_loops']['median']}"
              + (f" (this tree at a {a.switch_ms:g} ms GIL switch interval)" if a.switch_ms else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
