#!/usr/bin/env python3
"""How many times the dump's writer gives the GIL away per file: each time costs it up to Python's switch
interval beside SGLang's scheduler thread, which runs Python all the time.

  python3 benchmarks/handovers_gil.py [--base REV | --base-overlay DIR] [--switch-ms 20] [--files 8]
                                      [--tokens 100] [--reps 3] [--dir /dev/shm] [--out handovers.json]

The main thread runs pure Python throughout (the scheduler's stand-in) with the switch interval set long
(``--switch-ms``, 20 ms: far above what the calls themselves take), so a thread that gives the GIL away
waits about one interval to get it back, and seconds / interval counts the handovers. Two parts:

- ``calls``: single calls a writer makes (torch calls, system calls through ``os``, the same system calls
  through libc with the GIL kept, ``sinks.HELD``), intervals per call (median over ``--reps``);
- ``files``: the real ``DumpWriter`` of each overlay (``--base``'s, checked out with git, and this
  tree's), one writer thread, one forward of ``--files`` prompts of ``--tokens`` rows (the embedding,
  3 layers and the final state, bf16, hidden 7168) gathered and written into ``--dir``: intervals per
  file, from the gather's start to the last file renamed.

Run it on a quiet machine with a core to spare for each thread: where the cores are busy, the busy
thread is not woken within a short system call's microseconds, the caller takes the GIL back first, and
short calls count as no handover (on the 2-core CPU machine during a CI run: os.chmod 0.0 intervals,
against 1.0 quiet). Exit 0; 2 on a usage error (one line).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _bench  # noqa: E402


def beside_busy(work, switch_s: float) -> float:
    """Seconds ``work()`` takes in a thread while this one runs pure Python, at ``switch_s``."""
    out, stop = {}, [False]

    def run() -> None:
        time.sleep(0.03)  # the busy loop holds the GIL first, as the scheduler's thread does
        t0 = time.monotonic()
        try:
            work()
        finally:
            out["s"] = time.monotonic() - t0
            stop[0] = True

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    try:
        t = threading.Thread(target=run)
        t.start()
        _bench.busy(lambda: stop[0])
        t.join()
    finally:
        sys.setswitchinterval(before)
    return out["s"]


def calls(sinks, d: Path, switch_s: float, reps: int) -> dict:
    """Intervals per call of what a writer calls."""
    import torch
    from safetensors.torch import save_file

    ids = torch.arange(100)
    rows = torch.randn(3200, 7168).to(torch.bfloat16)
    tensors = {"input_ids": ids, **{f"layer.{k}": rows[:100].clone() for k in range(4)}}
    a, b, missing = str(d / "a.safetensors"), str(d / "b.safetensors"), str(d / "missing")
    save_file(tensors, a)
    table = {
        "nothing": lambda: None,
        "torch slice t[100:200]": lambda: rows[100:200],
        "torch t.narrow(0, 100, 100)": lambda: rows.narrow(0, 100, 100),
        "torch ids.to(int64) (already int64)": lambda: ids.to(torch.int64),
        "torch t.data_ptr()": lambda: rows.data_ptr(),
        "torch ids.tolist()": lambda: ids.tolist(),
        "os.open of a missing file": lambda: _missing(missing),
        "os.chmod": lambda: os.chmod(a, 0o644),
        "os.replace (2 calls)": lambda: (os.replace(a, b), os.replace(b, a)),
        "HELD.exists of a missing file": lambda: sinks.HELD.exists(missing),
        "HELD.chmod": lambda: sinks.HELD.chmod(a, 0o644),
        "HELD.replace (2 calls)": lambda: (sinks.HELD.replace(a, b), sinks.HELD.replace(b, a)),
        "save_file of 100 rows": lambda: save_file(tensors, a),
    }
    out = {}
    for name, f in table.items():
        n = 5 if name.startswith(("save_file", "torch t.narrow")) else 20
        per = [beside_busy(lambda: [f() for _ in range(n)], switch_s) / n / switch_s for _ in range(reps)]
        out[name] = round(statistics.median(per), 2)
        print(f"[handovers_gil] {name}: {out[name]} intervals per call", file=sys.stderr, flush=True)
    return out


def _missing(path: str) -> None:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except FileNotFoundError:
        pass


def files(name: str, root: Path, d: Path, fwd, switch_s: float, reps: int) -> float:
    """Intervals per file through the overlay at ``root``'s real writer (median over ``reps``)."""
    from eaglepatch.overlay import import_package
    import commit_gil

    import_package(name, root)
    dump = __import__(name + ".dump", fromlist=["DumpWriter"])
    ident = __import__(name + ".identity", fromlist=["RequestInfo"])
    w = dump.DumpWriter(str(d), [k + 1 for k in commit_gil.LAYERS], True, 1 << 30, {"format": "eagle3-dump/1"},
                        writers=1)
    k = [0]

    def forward() -> None:
        k[0] += 1
        spans = [dump._Span(i * fwd.tokens, fwd.tokens, 0, ident.RequestInfo(rid=f"{name}-{k[0]}-{i}",
                                                                               prompt_len=fwd.tokens))
                 for i in range(fwd.requests)]
        hold = dump._Hold(lambda: None)
        w._gather(dump._Job(dict(fwd.tensors), [], 0, None, spans), hold)
        hold.drop()
        done = threading.Event()
        w._pool.when_done(done)
        done.wait()

    try:
        forward()  # imports and first calls, not timed
        per = [beside_busy(forward, switch_s) / switch_s / fwd.requests for _ in range(reps)]
    finally:
        w.close()
    assert w.failed == 0, f"{name}: {w.failed} files failed"
    return round(statistics.median(per), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _bench.base_args(ap)
    ap.add_argument("--switch-ms", type=float, default=20.0, help="the GIL switch interval meanwhile (default 20)")
    ap.add_argument("--files", type=int, default=8, help="prompts of the forward (default 8)")
    ap.add_argument("--tokens", type=int, default=100, help="rows per prompt (default 100)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--dir", default="/dev/shm", help="parent of the directory the files go to (default /dev/shm)")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args()
    if not (2 <= a.switch_ms <= 100) or a.files < 1 or a.tokens < 1 or a.reps < 1:
        print("error: --switch-ms takes 2 to 100, --files, --tokens and --reps whole numbers >= 1; "
              "fix: e.g. --switch-ms 20 --files 8 --tokens 100 --reps 3", file=sys.stderr)
        return 2
    if not os.path.isdir(a.dir):
        print(f"error: --dir {a.dir}: not a directory; fix: e.g. --dir /dev/shm", file=sys.stderr)
        return 2
    why = _bench.base_usage(a)
    if why:
        print(why, file=sys.stderr)
        return 2
    _bench.in_torch_env()
    import commit_gil
    from eaglepatch.overlay import import_package, overlay_root

    switch_s = a.switch_ms / 1e3
    scratch = Path(tempfile.mkdtemp(prefix="handovers-gil-"))
    d = Path(tempfile.mkdtemp(prefix="handovers-gil-", dir=a.dir))
    res = { "switch_ms": a.switch_ms, "files": a.files, "tokens": a.tokens, "reps": a.reps,
           "dir": a.dir, "cores": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        base_root, base_rev = _bench.base_overlay(a, scratch)
        roots = {"base": base_root, "tree": overlay_root()}
        res["base"] = base_rev
        import_package("e3c_handovers_calls", roots["tree"])
        res["calls"] = calls(__import__("e3c_handovers_calls.sinks", fromlist=["HELD"]), d, switch_s, a.reps)
        fwd = commit_gil.Forward(a.files, a.tokens)
        res["intervals_per_file"] = {o: files(f"e3c_handovers_{o}", root, d, fwd, switch_s, a.reps)
                                     for o, root in roots.items()}
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    _bench.emit(res, a.out)
    f = res["intervals_per_file"]
    print(f"[handovers_gil] GIL handovers per file beside a busy thread ({a.tokens} rows, 1 writer, {a.switch_ms:g} ms "
          f"interval): base {base_rev} {f['base']}, this tree {f['tree']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
