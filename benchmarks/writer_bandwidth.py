#!/usr/bin/env python3
"""Benchmark 1: dump-writer bandwidth vs one raw write() of the same bytes, same directory.

One realistic dump (default 2048 tokens x 4 states [layers -1, 2, 30 + final] x hidden 7168,
bf16, ~117 MB) is written repeatedly by sglang's DumpWriter (submit: copy into reused host
buffers + queue; writer thread: safetensors to a temporary name + rename; timed until flush()
returns) and by a single write() of one contiguous buffer holding the same number of bytes
(no extra copy, no rename). Each repetition times both, alternating which goes first, on every
target directory (tmpfs and disk); the ratio raw_time / writer_time (= writer bandwidth / raw
bandwidth) is taken per repetition, then median and spread. Neither side fsyncs: on disk this
is the page-cache path the server sees. Files are removed between timings (untimed).

  python3 benchmarks/writer_bandwidth.py [--quick] [--reps N] [--tokens T] [--hidden H]
                                         [--dirs DIR,DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

LAYERS = [-1, 2, 30]


def raw_write(path: str, buf) -> None:
    mv = memoryview(buf.numpy()).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])
    finally:
        os.close(fd)


def clear(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions instead of 11")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dirs", help="comma list of parent directories (default /dev/shm and the temp dir)")
    a = ap.parse_args()
    _bench.enter_env(patched=True)

    import torch

    from sglang.srt.eagle3_capture.dump import DumpWriter

    reps = a.reps or (5 if a.quick else 11)
    parents = a.dirs.split(",") if a.dirs else ["/dev/shm", tempfile.gettempdir()]
    batch, captured, final = _bench.make_states(a.tokens, a.hidden, LAYERS, torch.bfloat16)
    nbytes = batch.input_ids.numel() * 8 + sum(t.numel() * 2 for t in captured.values()) + final.numel() * 2
    raw_buf = torch.empty(nbytes, dtype=torch.uint8)
    raw_buf.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    print("# writer bandwidth: %d tokens x %d states x hidden %d bf16 = %.1f MB per file; %s"
          % (a.tokens, len(LAYERS) + 1, a.hidden, nbytes / 1e6, _bench.machine()))
    rows = []
    for parent in parents:
        d = Path(tempfile.mkdtemp(prefix="eaglepatch-bw-", dir=parent))
        fs = os.popen("stat -f -c %T " + str(d)).read().strip()
        writer = DumpWriter(str(d), LAYERS, True, 4 << 30, _bench.metadata())
        try:
            writer.submit(batch, captured, final)  # warm-up: host buffers, page cache, imports
            writer.flush()
            raw_write(str(d / "raw.bin"), raw_buf)
            clear(d)
            t_raw, t_wr, t_sub, ratios, ratios_w = [], [], [], [], []
            for rep in range(reps):
                def do_raw():
                    t0 = time.perf_counter()
                    raw_write(str(d / "raw.bin"), raw_buf)
                    return time.perf_counter() - t0

                def do_writer():
                    t0 = time.perf_counter()
                    writer.submit(batch, captured, final)
                    t1 = time.perf_counter()
                    writer.flush()
                    t2 = time.perf_counter()
                    t_sub.append(t1 - t0)
                    return t2 - t0

                if rep % 2 == 0:
                    r = do_raw(); clear(d); w = do_writer(); clear(d)
                else:
                    w = do_writer(); clear(d); r = do_raw(); clear(d)
                t_raw.append(r)
                t_wr.append(w)
                ratios.append(r / w)
                ratios_w.append(r / (w - t_sub[-1]))
            if writer.failed:
                raise SystemExit("writer reported %d failed writes" % writer.failed)
        finally:
            writer.close()
            shutil.rmtree(d, ignore_errors=True)
        gbs = lambda ts: [nbytes / t / 1e9 for t in ts]  # noqa: E731
        rows.append([
            "%s (%s)" % (parent, fs),
            _bench.summary(gbs(t_raw)),
            _bench.summary(gbs(t_wr)),
            _bench.summary([s * 1e3 for s in t_sub]),
            "**%s**" % _bench.summary(ratios),
            _bench.summary(ratios_w),
        ])
    print(_bench.table(["directory (fs)", "raw write() GB/s", "DumpWriter GB/s",
                        "submit() ms (forward-thread stall)", "writer / raw bandwidth",
                        "file-writing part only / raw"], rows))
    print("ratio goal >= 0.8; figures are median (min..max, n=repetitions). 'file-writing part' ="
          " flush() wait after submit() returned (safetensors + rename on the writer thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
