#!/usr/bin/env python3
"""Benchmark 2: SGLang's built-in return_hidden_states path vs the dump writer, per sample.

The same states of one request (default 2048 tokens x 4 states x hidden 7168, bf16) go
  - through what return_hidden_states does in 0.5.9: ``.cpu().clone().tolist()`` in the
    scheduler, pickled to the tokenizer manager (ZMQ), ``orjson.dumps`` in the HTTP response
    ("built-in (orjson)"); also with the stdlib ``json.dumps`` ("tolist + json");
  - through DumpWriter: submit() + flush() to a safetensors file on tmpfs.
Repetitions alternate the order; the speed-up is taken per repetition (path time / writer time).

  python3 benchmarks/json_vs_writer.py [--quick] [--stdlib-json] [--reps N] [--tokens T] [--hidden H] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

LAYERS = [-1, 2, 30]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 tokens instead of 2048")
    ap.add_argument("--stdlib-json", action="store_true", help="also time json.dumps (about 3x orjson)")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    _bench.enter_env(patched=True)

    import orjson
    import torch

    from sglang.srt.eagle3_capture.dump import DumpWriter

    tokens = a.tokens or (256 if a.quick else 2048)
    reps = a.reps or 3
    batch, captured, final = _bench.make_states(tokens, a.hidden, LAYERS, torch.bfloat16)
    states = [captured[k + 1] for k in LAYERS] + [final]
    nbytes = sum(t.numel() * 2 for t in states) + tokens * 8
    d = Path(tempfile.mkdtemp(prefix="eaglepatch-json-", dir=a.dir))
    writer = DumpWriter(str(d), LAYERS, True, 4 << 30, _bench.metadata())

    def builtin(dumps):
        t0 = time.perf_counter()
        rows = [s.cpu().clone().tolist() for s in states]  # scheduler_output_processor_mixin
        msg = pickle.loads(pickle.dumps({"output_hidden_states": rows}))  # scheduler -> tokenizer
        body = dumps(msg)  # http_server: ORJSONResponse
        return time.perf_counter() - t0, len(body)

    def ours():
        t0 = time.perf_counter()
        writer.submit(batch, captured, final)
        writer.flush()
        dt = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in d.iterdir())
        for p in d.iterdir():
            p.unlink()
        return dt, size

    print("# tolist + JSON vs DumpWriter: %d tokens x %d states x hidden %d bf16 (%.1f MB raw); %s"
          % (tokens, len(states), a.hidden, nbytes / 1e6, _bench.machine()))
    try:
        ours()  # warm-up
        t_or, t_js, t_w, r_or, r_js = [], [], [], [], []
        size_or = size_js = size_w = 0
        for rep in range(reps):
            if rep % 2:
                w, size_w = ours()
            o, size_or = builtin(orjson.dumps)
            if a.stdlib_json:
                j, size_js = builtin(lambda m: json.dumps(m).encode())
                t_js.append(j)
                r_js.append(j / w if rep % 2 else float("nan"))
            if rep % 2 == 0:
                w, size_w = ours()
            t_or.append(o)
            t_w.append(w)
            r_or.append(o / w)
            if a.stdlib_json:
                r_js[-1] = t_js[-1] / w
            _bench.log("rep %d: orjson %.2f s, writer %.3f s" % (rep, o, w))
    finally:
        writer.close()
        shutil.rmtree(d, ignore_errors=True)
    rows = [
        ["built-in: tolist + pickle + orjson", _bench.summary(t_or), "%.0f" % (size_or / 1e6),
         "**%s**" % _bench.summary(r_or)],
    ] + ([
        ["tolist + pickle + json.dumps", _bench.summary(t_js), "%.0f" % (size_js / 1e6),
         _bench.summary(r_js)]] if a.stdlib_json else []) + [
        ["DumpWriter (safetensors, %s)" % a.dir, _bench.summary(t_w), "%.0f" % (size_w / 1e6), "1"],
    ]
    print(_bench.table(["path", "seconds per sample", "bytes out (MB)", "slower than DumpWriter (x)"], rows))
    print("goal: DumpWriter >= 100x faster per sample; median (min..max, n=repetitions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
