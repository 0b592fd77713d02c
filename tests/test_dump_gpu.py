"""The dump writer with CUDA tensors: the side stream, its event and the page-locked host arena,
which CPU tests never run. Skipped without a GPU; run on the lent H200 with

  python3 tests/test_dump_gpu.py [--overlay DIR] [--out FILE.json]

(no pytest needed there; ``--overlay`` runs another copy of the overlay, e.g. an older commit's,
to show a check failing on it). The raw results of runs are in docs/results/dump-gpu-*.json.

1. Ids that the next forward overwrites: the runner keeps its input ids in a static buffer and
   fills it again for the next forward on the main stream, while the side stream is still busy
   copying an earlier, large forward's rows. The file must hold the ids of its own forward.
2. A forward's rows reach the file bit for bit through the pinned arena, the submit returns
   before its device-to-host copies are done (the forward does not wait for them), and the
   arena is page-locked.
3. ``EAGLE3_DUMP_DTYPE=fp8``: the states are quantised on the GPU, on the side stream, before the
   copy: the file's fp8 values and scales are bit for bit what the same arithmetic gives on the
   CPU, the host arena carries about half the bytes of the bf16 dump of the same rows, and the
   submit still returns before the copies are done.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

try:
    import pytest
except ImportError:  # the GPU machine may have no pytest: __main__ below runs the checks
    pytest = None

HIDDEN = 7168


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, ids, lens, infos):
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = [0] * len(lens)
        self._eagle3_requests = list(infos)


def _package(overlay=None, module=None):
    from eaglepatch.overlay import import_package

    name = "e3c_gpu_%d" % (abs(hash(str(overlay))) % 10**6)
    import_package(name, Path(overlay) if overlay else None)
    if module is not None:
        return __import__(name + "." + module, fromlist=["x"])
    return __import__(name + ".dump", fromlist=["DumpWriter"]), __import__(name + ".identity", fromlist=["RequestInfo"])


def check_ids_survive_the_next_forward(tmp: Path, overlay=None) -> dict:
    dump, identity = _package(overlay)
    dev = torch.device("cuda")
    w = dump.DumpWriter(str(tmp), [2, 3], False, 4 << 30, {"launch_id": "gpu"})
    big_t = 40000  # 40000 x 7168 x 2 B x 2 states = 1.07 GiB of rows for the side stream
    big = [identity.RequestInfo("big", big_t)]
    ids_big = torch.randint(0, 1000, (big_t,), device=dev)
    rows = {i: torch.randn(big_t, HIDDEN, device=dev, dtype=torch.bfloat16) for i in (2, 3)}
    static = torch.empty(4096, dtype=torch.int64, device=dev)  # the runner's input buffer
    small_t, mismatches, trials = 64, 0, 5
    for trial in range(trials):
        w.submit(_Batch(ids_big, [big_t], big), rows, None)
        want = torch.arange(small_t, device=dev) + 1000 * (trial + 1)
        static[:small_t].copy_(want)
        small_rows = {i: torch.randn(small_t, HIDDEN, device=dev, dtype=torch.bfloat16) for i in (2, 3)}
        req = identity.RequestInfo("small-%d" % trial, small_t)
        w.submit(_Batch(static[:small_t], [small_t], [req]), small_rows, None)
        static[:small_t].fill_(-7)  # the next forward's ids, on the main stream, at once
        w.flush()
        from safetensors.torch import load_file

        got = load_file(str(tmp / (req.key + ".safetensors")))["input_ids"]
        mismatches += int(not torch.equal(got, want.cpu()))
    w.close()
    return {"check": "ids survive the next forward", "trials": trials, "files with another forward's ids": mismatches,
            "passed": mismatches == 0}


def _copies_pending(w) -> bool:
    """Whether the writer's side stream still has work queued right after a submit returned: the
    forward thread did not wait for its copies. (Read from the stream itself: the queued job is
    no witness, the gather thread may have taken it already; on the H200 that peek answered
    False for the fp8 forward, docs/results/dump-gpu-h200-writers.json.)"""
    return w._stream is not None and not w._stream.query()


def check_rows_bit_for_bit_and_async(tmp: Path, overlay=None) -> dict:
    dump, identity = _package(overlay)
    dev = torch.device("cuda")
    w = dump.DumpWriter(str(tmp), [2, 3], False, 4 << 30, {"launch_id": "gpu"})
    t = 30000
    rows = {i: torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16) for i in (2, 3)}
    ids = torch.randint(0, 1000, (t,), device=dev)
    req = identity.RequestInfo("rows", t)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    w.submit(_Batch(ids, [t], [req]), rows, None)
    submit_s = time.perf_counter() - t0
    pending_after_submit = _copies_pending(w)
    w.flush()
    from safetensors.torch import load_file

    got = load_file(str(tmp / (req.key + ".safetensors")))
    equal = all(torch.equal(got["layer.%d" % (i - 1)], rows[i].cpu()) for i in (2, 3)) and torch.equal(
        got["input_ids"], ids.cpu())
    pinned = bool(w.staging.pinned)
    w.close()
    return {"check": "rows bit for bit through the pinned arena, submit does not wait", "bytes": 2 * t * HIDDEN * 2,
            "submit_ms": round(submit_s * 1e3, 2), "copies still running after submit": pending_after_submit,
            "bit for bit": equal, "arena page-locked": pinned, "passed": equal and pinned and pending_after_submit}


def check_fp8_quantised_on_the_side_stream(tmp: Path, overlay=None) -> dict:
    dump, identity = _package(overlay)
    storage = _package(overlay, "storage")
    from safetensors.torch import load_file

    dev = torch.device("cuda")
    t, indices = 30000, [1, 2, 3, 4]  # four states of a 30K-token prefill, norms 100x apart as on real targets
    rows = {i: (torch.randn(t, HIDDEN, device=dev) * 10.0 ** (i - 2)).to(torch.bfloat16) for i in indices}
    ids = torch.randint(0, 1000, (t,), device=dev)
    out = {"check": "fp8 quantised on the GPU side stream before the copy", "tokens": t, "states": len(indices)}
    peaks, files = {}, {}
    for dtype in ("bf16", "fp8"):
        d = tmp / dtype
        d.mkdir()
        layout = storage.Layout(storage.Storage(dtype, "store"), indices, False, 8, "bfloat16", None, 1000)
        w = dump.DumpWriter(str(d), indices, False, 4 << 30, {"launch_id": "gpu"}, layout=layout)
        req = identity.RequestInfo("fp8-" + dtype, t)
        # one forward first, as a server's earlier prefills do: the side stream's allocator blocks
        # (and, with fp8, the float32 temporaries) exist after it
        w.submit(_Batch(ids, [t], [identity.RequestInfo("warm-" + dtype, t)]), rows, None)
        w.flush()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.submit(_Batch(ids, [t], [req]), rows, None)
        out["submit_ms_" + dtype] = round((time.perf_counter() - t0) * 1e3, 2)
        out["copies still running after submit (%s)" % dtype] = _copies_pending(w)
        w.flush()
        peaks[dtype] = w.staging.peak_in_use
        files[dtype] = load_file(str(d / (req.key + ".safetensors")))
        w.close()
    same, differ = True, {}
    for i in indices:
        q, scale = storage.quantize_rows(rows[i].cpu())
        name = "layer.%d" % (i - 1)
        got_q, got_s = files["fp8"][name], files["fp8"]["scale." + name]
        differ[name] = {"values": int((got_q.view(torch.uint8) != q.view(torch.uint8)).sum()),
                        "scales": int((got_s != scale).sum())}
        same = same and got_q.dtype == torch.float8_e4m3fn and not any(differ[name].values())
    out["differing from the CPU's"] = differ
    out.update({"fp8 bit for bit as on the CPU": same, "arena bytes fp8 / bf16": round(peaks["fp8"] / peaks["bf16"], 4),
                "ids equal": torch.equal(files["fp8"]["input_ids"], ids.cpu())})
    out["passed"] = bool(same and out["ids equal"] and out["arena bytes fp8 / bf16"] <= 0.55
                         and out["copies still running after submit (fp8)"])
    return out


CHECKS = (check_ids_survive_the_next_forward, check_rows_bit_for_bit_and_async, check_fp8_quantised_on_the_side_stream)

if pytest is not None:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the lent H200: see docstring)")

    @cuda
    def test_ids_survive_the_next_forward_overwriting_their_buffer(tmp_path):
        r = check_ids_survive_the_next_forward(tmp_path)
        assert r["passed"], r

    @cuda
    def test_rows_reach_the_file_bit_for_bit_through_the_pinned_arena_without_waiting(tmp_path):
        r = check_rows_bit_for_bit_and_async(tmp_path)
        assert r["passed"], r

    @cuda
    def test_fp8_is_quantised_on_the_side_stream_bit_for_bit_as_on_the_cpu(tmp_path):
        r = check_fp8_quantised_on_the_side_stream(tmp_path)
        assert r["passed"], r


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="the dump writer's GPU checks")
    ap.add_argument("--overlay", help="another copy of sglang-overlay/ to run (default: this repo's)")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "overlay": a.overlay or "repo",
           "results": []}
    for check in CHECKS:
        with tempfile.TemporaryDirectory() as d:
            r = check(Path(d), a.overlay)
        print(json.dumps(r), flush=True)
        out["results"].append(r)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    sys.exit(0 if all(r["passed"] for r in out["results"]) else 1)
