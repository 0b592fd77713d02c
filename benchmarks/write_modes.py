#!/usr/bin/env python3
"""How the dump's files are written, decided by measurement (issue 31, item 1): the file sink's own
commit against the same bytes written buffered in large blocks and written with O_DIRECT, one and
several threads, on one disk, in one run.

  PYTHONPATH=src python3 benchmarks/write_modes.py --out docs/results/write-modes-cpu.json
  PYTHONPATH=/tmp/site:src python3 benchmarks/write_modes.py --dir /data --out $OUT/write-modes.json  # a GPU machine

Every mode writes the same dump files (``--tokens`` tokens per file of ``--states`` states at
hidden ``--hidden`` in bf16: a request's safetensors file), each as the file sink commits: a
temporary name, the file fsynced, renamed, the directory fsynced. Modes:
- ``sink``: the overlay's real ``FileSink.commit`` (safetensors' ``save_file``), what the dump does;
- ``buffered``: the file's bytes (``safetensors.torch.save``, serialised per file in the timed
  work) written with ``os.write`` in ``--block-mb`` blocks;
- ``direct``: the same bytes through ``O_DIRECT`` from a page-aligned buffer, padded to 4 KiB and
  truncated back to the file's size before the fsync.
Each with 1 and ``--threads`` threads (files at once). The modes rotate between repetitions; the
figures are GB/s (bytes over the time until the last commit returned), min and median over the
repetitions, and each mode's ratio to ``sink`` in the same repetition (this machine's load varies;
ratios within one repetition are the figure). Exit 0, or 2 on a usage error (one line).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

ALIGN = 4096
MODES = ("sink", "buffered", "direct")


_SINKS = []


def _sinks():
    """The overlay's ``sinks`` module, imported once (before any thread: imports are not to race)."""
    if not _SINKS:
        from eaglepatch.overlay import import_package

        import_package("e3c_write_modes")
        _SINKS.append(__import__("e3c_write_modes.sinks", fromlist=["x"]))
    return _SINKS[0]


def _commit_bytes(directory: str, key: str, data: bytes, block: int, direct: bool) -> None:
    """The file sink's commit protocol around a write of ``data``: buffered blocks, or O_DIRECT."""
    path = os.path.join(directory, key + ".safetensors")
    tmp = os.path.join(directory, f".{key}.{uuid.uuid4().hex[:12]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        view = memoryview(data)
        if direct:
            padded = -(-len(data) // ALIGN) * ALIGN
            buf = mmap.mmap(-1, min(block, padded))  # anonymous: page-aligned, as O_DIRECT needs
            try:
                for off in range(0, padded, len(buf)):
                    chunk = view[off:off + len(buf)]
                    n = len(chunk)
                    buf[:n] = chunk
                    if n < len(buf):
                        buf[n:] = bytes(len(buf) - n)
                    size = -(-n // ALIGN) * ALIGN
                    wrote = os.write(fd, memoryview(buf)[:size])
                    assert wrote == size, (wrote, size)
            finally:
                buf.close()
            os.ftruncate(fd, len(data))
        else:
            for off in range(0, len(data), block):
                os.write(fd, view[off:off + block])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _sinks()._fsync(directory)  # the sink's own directory fsync


def run_mode(mode: str, threads: int, directory: str, tensors: dict, blob: bytes, files: int, block: int) -> float:
    """Seconds to commit ``files`` files with ``threads`` at once."""
    from safetensors.torch import save

    sink = _sinks().FileSink(directory) if mode == "sink" else None

    def one(i: int) -> None:
        key = f"{mode}-{threads}-{i:05d}"
        if sink is not None:
            sink.commit(key, tensors, {"format": "eagle3-dump/1"})
        else:  # serialised per file, as a writer would have to (the timed work holds it)
            data = save(tensors, metadata={"format": "eagle3-dump/1"})
            assert len(data) == len(blob)
            _commit_bytes(directory, key, data, block, direct=(mode == "direct"))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(files)))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, help="a directory on the disk to measure (default: a new one under /var/tmp)")
    ap.add_argument("--out", type=Path, help="write the results JSON here")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per file (default 1024)")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    ap.add_argument("--states", type=int, default=4, help="states per token (default 4: three layers + final)")
    ap.add_argument("--files", type=int, default=24, help="files per mode and repetition (default 24)")
    ap.add_argument("--threads", type=int, default=4, help="the several-threads count (default 4)")
    ap.add_argument("--block-mb", type=int, default=64, help="write block in MiB (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    a = ap.parse_args(argv)
    for name in ("tokens", "hidden", "states", "files", "threads", "block_mb", "repeats"):
        if getattr(a, name) < 1:
            print(f"error: --{name.replace('_', '-')} {getattr(a, name)} is not positive; pass a whole number "
                  f">= 1", file=sys.stderr)
            return 2
    if a.dir is not None and not a.dir.is_dir():
        print(f"error: --dir {a.dir} is not an existing directory; create it or pass another", file=sys.stderr)
        return 2

    import torch
    from safetensors.torch import save

    _sinks()
    base = tempfile.mkdtemp(prefix="eaglepatch-write-modes-", dir=str(a.dir) if a.dir else "/var/tmp")
    try:
        g = torch.Generator().manual_seed(0)
        tensors = {f"layer.{k}": torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16)
                   for k in range(a.states - 1)}
        tensors["final"] = torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16)
        tensors["input_ids"] = torch.arange(a.tokens, dtype=torch.int64)
        blob = save(tensors, metadata={"format": "eagle3-dump/1"})
        block = a.block_mb << 20
        try:  # does this filesystem take O_DIRECT at all (tmpfs does not)
            _commit_bytes(base, "probe", blob[:ALIGN * 3 + 5], block, direct=True)
            modes = MODES
        except OSError as exc:
            print(f"[write-modes] O_DIRECT refused here ({exc.strerror}); measuring sink and buffered only",
                  file=sys.stderr)
            modes = MODES[:2]
        configs = [(m, t) for t in sorted({1, a.threads}) for m in modes]
        reps = []
        for r in range(a.repeats):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            rec = {}
            for mode, threads in order:
                d = os.path.join(base, f"r{r}-{mode}-{threads}")
                os.mkdir(d)
                s = run_mode(mode, threads, d, tensors, blob, a.files, block)
                size = sum(p.stat().st_size for p in Path(d).iterdir())
                assert size == len(blob) * a.files, (mode, size)  # every file whole, the same bytes
                rec[f"{mode}x{threads}"] = round(size / s / 1e9, 4)
                shutil.rmtree(d)
                print(f"[write-modes] rep {r + 1}: {mode} x{threads}: {rec[f'{mode}x{threads}']:.3f} GB/s",
                      file=sys.stderr)
            reps.append(rec)
        names = list(reps[0])
        summary = {}
        for n in names:
            vals = [rep[n] for rep in reps]
            sink = [rep["sink" + n[n.index("x"):]] for rep in reps]
            ratios = [v / s for v, s in zip(vals, sink)]
            summary[n] = {"gb_per_s_min": min(vals), "gb_per_s_median": statistics.median(vals),
                          "vs_sink_min": round(min(ratios), 3), "vs_sink_median": round(statistics.median(ratios), 3)}
        result = {"benchmark": "write_modes", "file_bytes": len(blob), "files": a.files, "threads": a.threads,
                  "block_mb": a.block_mb, "repeats": a.repeats, "dir": str(a.dir or "/var/tmp"),
                  "cpus": os.cpu_count(), "repetitions": reps, "summary": summary}
        for n, v in summary.items():
            print(f"[write-modes] {n:12s} GB/s min {v['gb_per_s_min']:.3f} median {v['gb_per_s_median']:.3f}; "
                  f"vs sink min {v['vs_sink_min']:.3f} median {v['vs_sink_median']:.3f}", file=sys.stderr)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
