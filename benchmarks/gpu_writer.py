#!/usr/bin/env python3
"""GPU path of the dump writer: pinned device-to-host copy + write vs the same ceiling.

Runs on a CUDA machine with torch and safetensors and nothing of SGLang's dependencies: it
imports only the series' own ``sglang.srt.eagle3_capture`` package, laid out by
``--make-tree DIR`` (run where the repo's tools work) from the series' first patch into an
otherwise empty ``sglang`` package.

Per repetition, on each target directory, for one realistic dump (2048 tokens x 3 layers +
final x hidden 7168, bf16, ~117 MB on the GPU):
  ceiling   pinned non-blocking D2H of every tensor + one raw write() per tensor, no rename
  plain     ``.cpu()`` of every tensor + safetensors ``save_file`` (what a naive hook does)
  writer    ``DumpWriter.submit`` + ``flush`` (pinned reused buffers, writer thread, rename)
  submit    the part of ``writer`` the forward thread waits for (the rest overlaps compute)
Ratios are taken per repetition (ceiling_time / x_time), then median and spread.

  python3 benchmarks/gpu_writer.py --make-tree .gpu/tree          # here
  PYTHONPATH=.gpu/tree python3 benchmarks/gpu_writer.py [--reps N] [--json FILE]   # on the GPU
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

LAYERS = [-1, 2, 30]

from writer_bandwidth import raw_write  # noqa: E402  (stdlib-only at import time)


def make_tree(dest: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "src"))
    from eaglepatch.series import load_series

    series = load_series(repo / "patches" / "sglang-0.5.9")
    first = series.patches[0]
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "sglang" / "srt").mkdir(parents=True)
    (dest / "sglang" / "__init__.py").write_text("")
    (dest / "sglang" / "srt" / "__init__.py").write_text("")
    import subprocess

    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(dest.parent.resolve()))
    subprocess.run(["git", "apply", str(first.path)], cwd=dest, check=True, env=env)
    print(f"tree with {first.path.name} at {dest}")


class _Mode:
    name = "EXTEND"


class _Batch:
    """The ForwardBatch fields DumpWriter.submit reads: one request, no cached prefix."""

    def __init__(self, ids):
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = [ids.numel()]
        self.extend_prefix_lens_cpu = [0]


def bench(reps: int, tokens: int, hidden: int, dirs):
    import torch
    from safetensors.torch import save_file

    from sglang.srt.eagle3_capture.dump import DumpWriter
    from sglang.srt.eagle3_capture.settings import capture_index

    dev = torch.device("cuda")
    ids = torch.randint(2, 150000, (tokens,), device=dev, dtype=torch.int64)
    captured = {capture_index(k): torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16) for k in LAYERS}
    final = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    tensors = [ids, *captured.values(), final]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True) for t in tensors]

    def d2h_pinned():
        for buf, t in zip(pinned, tensors):
            buf.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        torch.cuda.synchronize()

    def d2h_plain():
        return [t.cpu() for t in tensors]

    # device-to-host bandwidth alone
    d2h = {"pinned": [], "pageable": []}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); d2h_pinned(); d2h["pinned"].append(nbytes / (time.perf_counter() - t0) / 1e9)
        torch.cuda.synchronize()
        t0 = time.perf_counter(); d2h_plain(); torch.cuda.synchronize()
        d2h["pageable"].append(nbytes / (time.perf_counter() - t0) / 1e9)

    results = {"bytes": nbytes, "d2h_GBps": {k: statistics.median(v) for k, v in d2h.items()}, "dirs": {}}
    for parent in dirs:
        work = Path(tempfile.mkdtemp(prefix="gpu-writer-", dir=parent))
        writer = DumpWriter(str(work), LAYERS, True, 4 * nbytes, {"format": "eagle3-dump/1"})
        batch = _Batch(ids)
        times = {"ceiling": [], "plain": [], "writer": [], "submit": []}
        for rep in range(reps + 1):  # the first round warms caches and the buffer pool
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            d2h_pinned()
            for i, buf in enumerate(pinned):
                raw_write(str(work / f"raw{i}"), buf)
            t_ceiling = time.perf_counter() - t0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host = d2h_plain()
            save_file({f"t{i}": h for i, h in enumerate(host)}, str(work / "plain.safetensors"))
            t_plain = time.perf_counter() - t0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            writer.submit(batch, captured, final)
            t_submit = time.perf_counter() - t0
            writer.flush()
            t_writer = time.perf_counter() - t0
            for p in work.iterdir():
                p.unlink()
            if rep:
                for k, v in (("ceiling", t_ceiling), ("plain", t_plain), ("writer", t_writer), ("submit", t_submit)):
                    times[k].append(v)
        writer.close()
        shutil.rmtree(work)
        row = {"ceiling_GBps": nbytes / statistics.median(times["ceiling"]) / 1e9}
        for k in ("plain", "writer", "submit"):
            ratios = [c / x for c, x in zip(times["ceiling"], times[k])]
            row[f"{k}_vs_ceiling"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            row[f"{k}_GBps"] = nbytes / statistics.median(times[k]) / 1e9
        results["dirs"][parent] = row
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-tree", type=Path, metavar="DIR", help="lay out the minimal tree and exit")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--dirs", default="/dev/shm," + tempfile.gettempdir())
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.make_tree:
        make_tree(a.make_tree)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    res = bench(a.reps, a.tokens, a.hidden, [d for d in a.dirs.split(",") if d])
    res["device"] = torch.cuda.get_device_name(0)
    res["reps"] = a.reps
    print(f"device {res['device']}, {res['bytes'] / 1e6:.0f} MB per dump, {a.reps} repetitions")
    print(f"D2H: pinned {res['d2h_GBps']['pinned']:.1f} GB/s, pageable .cpu() {res['d2h_GBps']['pageable']:.1f} GB/s")
    print("| dir | ceiling GB/s | writer GB/s | writer/ceiling (min..max) | plain .cpu()+save_file / ceiling | forward-thread share (submit/writer time) |")
    print("|---|---|---|---|---|---|")
    for d, r in res["dirs"].items():
        w, p, s = r["writer_vs_ceiling"], r["plain_vs_ceiling"], r["submit_vs_ceiling"]
        share = w["median"] / s["median"]
        print(f"| {d} | {r['ceiling_GBps']:.2f} | {r['writer_GBps']:.2f} | {w['median']:.2f} ({w['min']:.2f}..{w['max']:.2f}) "
              f"| {p['median']:.2f} | {share:.3f} |")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
