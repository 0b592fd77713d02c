#!/usr/bin/env python3
"""Writer threads in the busy process against writer processes fed a forward at a time: the design
question behind issue 45's wait for the dump file.

  python3 benchmarks/writer_procs.py [--dir /dev/shm] [--requests 32] [--tokens 100,500] [--writers 4]
                                     [--seconds 3] [--reps 3] [--out writer-procs.json]

A server's dump writers share the scheduler's process, whose thread runs Python all the time (one
H100 run showed it at 95-100% of a core in user time, idle or not: docs/peers.md, run 22), so each
writer waits for the GIL after every system call and torch call. Here the main thread runs pure
Python throughout (the scheduler's stand-in) while one forward after another of ``--requests``
prompts of ``--tokens`` rows (an embedding, 3 layers and the final state, bf16, hidden 7168) is
written as one safetensors file per prompt into ``--dir``, by:

- ``threads``: ``--writers`` threads of this process, each writing its files with
  ``safetensors.torch.save_file`` from views of the forward's rows (what the dump does);
- ``processes``: ``--writers`` processes; the forward's rows sit in shared memory (a memfd every
  process maps), and one thread of this process sends each process one message per forward (its
  files: names, offsets, shapes) and reads one answer back; a process writes its files with
  safetensors' ``serialize_file`` given pointers into its own mapping (no torch there).

Also each configuration with the main thread idle (``alone``: the writers' own rate). Configurations
are interleaved within each repetition. Reported per token count: files/s (min and median over
repetitions) and, per repetition, processes over threads beside the busy thread. First, per token
count, one forward is written both ways and every file compared (tensors, bytes, metadata). Exit 0;
1 when the two ways wrote different files; 2 on a usage error (one line).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _bench  # noqa: E402

HIDDEN, STATES = 7168, 5  # the embedding, 3 layers, the final state
IN_FLIGHT = 2  # forwards handed out and not yet written, at most
CONFIGS = ("threads busy", "processes busy", "threads alone", "processes alone")

CHILD = r'''
import mmap, os, pickle, struct, sys
from safetensors import TensorSpec, serialize_file
fd, size = int(sys.argv[1]), int(sys.argv[2])
import ctypes
buf = (ctypes.c_char * size).from_buffer(mmap.mmap(fd, size, mmap.MAP_SHARED))  # read only, by convention
base = ctypes.addressof(buf)
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    files = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
    for path, tensors, meta in files:
        specs = {n: TensorSpec(dtype=dt, shape=shape, data_ptr=base + off, data_len=nb)
                 for n, (dt, shape, off, nb) in tensors.items()}
        tmp = path + ".tmp"
        serialize_file(specs, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    out.write(struct.pack("<I", len(files)))
    out.flush()
'''


class Shared:
    """A forward's rows in a memfd every writer process maps, as torch views."""

    def __init__(self, requests: int, tokens: int):
        import torch

        self.requests, self.tokens = requests, tokens
        self.row = HIDDEN * 2
        self.size = requests * tokens * (8 + STATES * self.row)
        self.fd = os.memfd_create("writer-procs", 0)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED)
        flat = torch.frombuffer(self.map, dtype=torch.uint8)
        n = requests * tokens
        self.ids = flat[: n * 8].view(torch.int64)
        self.ids.copy_(torch.randint(0, 100000, (n,)))
        self.states = []
        for s in range(STATES):
            off = n * 8 + s * n * self.row
            t = flat[off: off + n * self.row].view(torch.bfloat16).view(n, HIDDEN)
            t.copy_(torch.randn(n, HIDDEN).to(torch.bfloat16))
            self.states.append((off, t))
        self.file_bytes = tokens * (8 + STATES * self.row)

    def job(self, d: Path, tag: str, i: int):
        """(path, {name: (dtype, shape, offset, nbytes)}, metadata) of prompt ``i``."""
        t = self.tokens
        tensors = {"input_ids": ("int64", [t], i * t * 8, t * 8)}
        for s, (off, _) in enumerate(self.states):
            tensors[f"state.{s}"] = ("bfloat16", [t, HIDDEN], off + i * t * self.row, t * self.row)
        return str(d / f"{tag}-{i}.safetensors"), tensors, {"format": "eagle3-dump/1", "rid": str(i)}

    def views(self, i: int) -> dict:
        t = self.tokens
        out = {"input_ids": self.ids[i * t: (i + 1) * t]}
        for s, (_, full) in enumerate(self.states):
            out[f"state.{s}"] = full[i * t: (i + 1) * t]
        return out


def more(k: int, stop: float, forwards: int) -> bool:
    return k < forwards if forwards else time.monotonic() < stop


def run_threads(sh: Shared, d: Path, writers: int, stop: float, done: list, forwards: int = 0) -> None:
    import queue

    from safetensors.torch import save_file

    q: "queue.Queue" = queue.Queue()

    def writer() -> None:
        while True:
            item = q.get()
            if item is None:
                return
            path, i, ev = item
            tmp = path + ".tmp"
            save_file(sh.views(i), tmp, metadata={"format": "eagle3-dump/1", "rid": str(i)})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            ev.count_down()

    class Latch:
        def __init__(self, n):
            self.n, self.cv = n, threading.Condition()

        def count_down(self):
            with self.cv:
                self.n -= 1
                if not self.n:
                    self.cv.notify_all()

        def wait(self):
            with self.cv:
                while self.n:
                    self.cv.wait()

    ts = [threading.Thread(target=writer) for _ in range(writers)]
    for t in ts:
        t.start()
    k, latches = 0, []
    while more(k, stop, forwards):
        latch = Latch(sh.requests)
        for i in range(sh.requests):
            q.put((str(d / f"t{k}-{i}.safetensors"), i, latch))
        latches.append(latch)
        if len(latches) > IN_FLIGHT:
            latches.pop(0).wait()
            done[0] += sh.requests
        k += 1
    for latch in latches:
        latch.wait()
        done[0] += sh.requests
    for _ in ts:
        q.put(None)
    for t in ts:
        t.join()


def run_processes(sh: Shared, d: Path, writers: int, stop: float, done: list, forwards: int = 0) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(sh.fd), str(sh.size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, pass_fds=(sh.fd,)) for _ in range(writers)]
    k, pending = 0, []
    while more(k, stop, forwards):
        parts = [[] for _ in procs]
        for i in range(sh.requests):
            parts[i % writers].append(sh.job(d, f"p{k}", i))
        for p, files in zip(procs, parts):
            data = pickle.dumps(files)
            p.stdin.write(struct.pack("<I", len(data)) + data)
            p.stdin.flush()
        pending.append(k)
        if len(pending) > IN_FLIGHT:
            pending.pop(0)
            for p in procs:
                p.stdout.read(4)
            done[0] += sh.requests
        k += 1
    for _ in pending:
        for p in procs:
            p.stdout.read(4)
        done[0] += sh.requests
    for p in procs:
        p.stdin.close()
        p.wait()


def one(sh: Shared, d: Path, config: str, writers: int, seconds: float) -> float:
    how, where = config.split()
    done = [0]
    with _bench.swept(d):
        stop = time.monotonic() + seconds
        fn = run_threads if how == "threads" else run_processes
        t = threading.Thread(target=fn, args=(sh, d, writers, stop, done))
        t0 = time.monotonic()
        t.start()
        if where == "busy":
            _bench.busy(lambda: time.monotonic() >= stop)
        t.join()
        wall = time.monotonic() - t0
    return round(done[0] / wall, 1)


def parts(path: Path) -> tuple:
    """(header as a dict, the bytes after it): safetensors orders metadata keys at random."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def same_files(sh: Shared, d: Path, writers: int) -> bool:
    """One forward written both ways: the same tensors, bytes and metadata in every file."""
    for fn in (run_threads, run_processes):
        fn(sh, d, writers, 0.0, [0], forwards=1)
    ok = all(parts(d / f"t0-{i}.safetensors") == parts(d / f"p0-{i}.safetensors") for i in range(sh.requests))
    for f in d.iterdir():
        f.unlink()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.forward_args(ap, "threads or processes")
    a = ap.parse_args()
    why = _bench.forward_usage(a)
    if why:
        print(why, file=sys.stderr)
        return 2
    tokens = _bench.counts(a.tokens)
    _bench.in_torch_env()
    d = Path(tempfile.mkdtemp(prefix="writer-procs-", dir=a.dir))
    res = {"dir": a.dir, "requests": a.requests, "writers": a.writers, "seconds": a.seconds, "reps": a.reps,
           "cores": os.cpu_count(), "python": sys.version.split()[0], "tokens": {}}
    try:
        for n in tokens:
            sh = Shared(a.requests, n)
            if not same_files(sh, d, a.writers):
                print(f"error: {n} tokens: the processes' files differ from the threads'", file=sys.stderr)
                return 1
            res.setdefault("same_files", []).append(n)
            runs = {c: [] for c in CONFIGS}
            for r in range(a.reps):
                for c in CONFIGS:
                    runs[c].append(one(sh, d, c, a.writers, a.seconds))
                    print(f"[writer_procs] {n} tokens rep {r + 1} {c}: {runs[c][-1]} files/s", file=sys.stderr,
                          flush=True)
            block = {c: _bench.min_median(v) for c, v in runs.items()}
            block["processes_over_threads_busy"] = _bench.min_median([round(x / y, 2) for x, y in
                                                       zip(runs["processes busy"], runs["threads busy"])])
            block["gb_per_file"] = sh.file_bytes / 1e9
            res["tokens"][str(n)] = block
    finally:
        shutil.rmtree(d, ignore_errors=True)
    _bench.emit(res, a.out)
    for n, b in res["tokens"].items():
        g = b["processes_over_threads_busy"]
        gb = b["gb_per_file"]
        print(f"[writer_procs] {n} tokens a file, {a.writers} writers, beside a busy thread: processes / threads "
              f"min {g['min']} median {g['median']} (threads {b['threads busy']['median']} files/s = "
              f"{b['threads busy']['median'] * gb:.2f} GB/s, processes {b['processes busy']['median']} = "
              f"{b['processes busy']['median'] * gb:.2f} GB/s; alone {b['threads alone']['median']} / "
              f"{b['processes alone']['median']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
