#!/usr/bin/env python3
"""Where tools/extract.py's time goes per sample, once the server has written the dump: read and
validate the dump file, then write the dataset sample; the code before issue 45 against today's,
in one run.

  python3 benchmarks/extract_path.py --out docs/results/extract-path-cpu.json
  python3 benchmarks/extract_path.py --quick --out /tmp/x.json       # a smoke (small files, 1 repetition)

Dump files are written by the overlay's real ``DumpWriter`` (bf16, hidden ``--hidden`` 7168, the
outputs of layers 0-2 and the post-norm final state: what benchmarks/peers.py dumps) into ``--dir``
(default /dev/shm, where the GPU runs keep them), ``--files`` per prompt length. Each sample then
goes through extract's own functions: ``dumps.load_dump`` (read the safetensors file through its
memory map, check the request's identity, shapes, dtypes, every value finite) and
``writers.write_sample`` (SpecForge 0.2.0's ``.ckpt``: ``torch.save`` into a temporary name, rename),
two ways, alternating which goes first in each repetition:

- ``before``: every value checked finite by ``torch.isfinite(t).all()``, and ``torch.save`` computing
  the zip CRC-32 of every tensor (torch's default);
- ``now``: ``dumps.all_finite`` (``torch.aminmax``: one pass, exact) and ``writers.no_zip_crcs()``
  (``torch.load`` never checks those CRCs).

Both ways' samples of the first repetition are loaded back with ``torch.load`` and must be equal,
tensor for tensor (the run fails otherwise). Figures per prompt length: seconds per sample in each
stage, GB/s of dump bytes, and the ratio before / now of the whole (read + validate + write) per
repetition, min and median. Runs under the cached CPU test environment (torch, safetensors), built
on first use. Exit: 0 done, 1 the samples differ, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
INNER = "EAGLEPATCH_EXTRACT_PATH_INNER"
LAYERS = [0, 1, 2]  # outputs of layers 0-2 (capture indices 1-3), and the final state
NUM_LAYERS = 4


def say(msg: str) -> None:
    print("[extract_path] " + msg, file=sys.stderr, flush=True)


def reexec_in_env() -> None:
    """Under a python without torch, run this script again with the CPU test environment's."""
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
        return
    except ImportError:
        if os.environ.get(INNER):
            raise
    from eaglepatch.cpuenv import ensure_env

    env = dict(os.environ, **{INNER: "1", "PYTHONPATH": str(SRC)})
    sys.exit(subprocess.call([str(ensure_env()), *sys.argv], env=env))


def write_dumps(directory: Path, lengths: list, files: int, hidden: int) -> dict:
    """{length: [(path, ids, rid), ...]}: dump files written by the overlay's real DumpWriter."""
    import torch

    from eaglepatch.extract import dumps
    from eaglepatch.overlay import import_package

    import_package("e3c_extract_path")
    dump_mod = __import__("e3c_extract_path.dump", fromlist=["DumpWriter"])
    identity = __import__("e3c_extract_path.identity", fromlist=["RequestInfo"])
    indices = [k + 1 for k in LAYERS]
    meta = {"format": dumps.FORMAT, "eagle3_layer_ids": json.dumps(LAYERS), "hf_hidden_state_indices":
            json.dumps(indices), "final": "post_norm", "architecture": "DeepseekV3ForCausalLM",
            "model_path": "bench", "hidden_size": str(hidden), "num_hidden_layers": str(NUM_LAYERS),
            "dtype": "bfloat16", "sglang_version": "bench", "series_version": "bench", "tp_size": "1",
            "launch_id": "bench", "replica_rank": "0"}
    directory.mkdir(parents=True, exist_ok=True)
    writer = dump_mod.DumpWriter(str(directory), indices, True, 1 << 30, meta)

    class Mode:
        name = "EXTEND"

    class Batch:
        def __init__(self, ids, info):
            self.forward_mode = Mode()
            self.input_ids = ids
            self.extend_seq_lens_cpu = [len(ids)]
            self.extend_prefix_lens_cpu = [0]
            self.req_pool_indices = torch.tensor([0])
            self._eagle3_requests = [info]

    g = torch.Generator().manual_seed(0)
    out: dict = {}
    try:
        for n in lengths:
            for _ in range(files):
                rid = dumps.new_rid()
                ids = torch.randint(2, 100000, (n,), generator=g, dtype=torch.int64)
                cap = {i: torch.randn(n, hidden, generator=g).to(torch.bfloat16) for i in indices}
                final = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
                writer.submit(Batch(ids, identity.RequestInfo(rid, n)), cap, final)
                out.setdefault(n, []).append((dumps.dump_path(directory, dumps.rid_key(rid)), ids.tolist(), rid))
        report = writer.flush_report(600)
        if not report.get("flushed") or report.get("failed"):
            raise SystemExit(f"error: the DumpWriter did not write every file ({report})")
    finally:
        writer.close()
    return out


class Way:
    """One way through the two stages: the finite check and the zip CRCs set while it runs (the
    samples are written on this thread: torch's CRC switch is per thread)."""

    def __init__(self, name: str, finite, crc: bool):
        self.name, self.finite, self.crc = name, finite, crc

    def __enter__(self):
        from torch.utils.serialization import config

        from eaglepatch.extract import dumps

        import contextlib

        from eaglepatch.extract import writers

        self._saved = (dumps.all_finite, config.save.compute_crc32, writers.no_zip_crcs)
        dumps.all_finite = self.finite
        config.save.compute_crc32 = self.crc
        if self.crc:  # write_sample's own switch off, for the way before it
            writers.no_zip_crcs = contextlib.nullcontext
        return self

    def __exit__(self, *exc):
        from torch.utils.serialization import config

        from eaglepatch.extract import dumps, writers

        dumps.all_finite, config.save.compute_crc32, writers.no_zip_crcs = self._saved


def one_sample(item, layout, out_dir: Path, hidden: int, keep: bool) -> tuple:
    """(read+validate s, write s, path of the sample) of one dump through extract's functions."""
    from eaglepatch.extract import dumps, writers

    path, ids, rid = item
    t0 = time.perf_counter()
    dump = dumps.load_dump(path, ids, hidden_size=hidden, rid=rid)
    t1 = time.perf_counter()
    rel = writers.sample_rel("specforge", rid)
    writers.write_sample(layout, out_dir, rel, rid, dump, [1] * len(ids))
    t2 = time.perf_counter()
    sample = out_dir / rel
    if not keep:
        sample.unlink()
    return t1 - t0, t2 - t1, sample


def same_samples(a: Path, b: Path) -> str:
    """'' when the two .ckpt files hold equal tensors under equal keys, else why not."""
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if sorted(x) != sorted(y):
        return f"keys {sorted(x)} != {sorted(y)}"
    for k in x:
        if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k]):
            return f"{k} differs"
    return ""


def parser(doc: str, files: int, quick_files: int) -> argparse.ArgumentParser:
    """The options this benchmark and benchmarks/extract_threads.py share (``parse`` checks them)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--dir", default="/dev/shm", help="where the dump files and samples go (default /dev/shm)")
    ap.add_argument("--lengths", default="128,512,2048", help="prompt lengths, comma list (default 128,512,2048)")
    ap.add_argument("--files", type=int, default=files, help=f"dump files per length (default {files})")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke: hidden 256, {quick_files} files a length, 1 repetition")
    ap.set_defaults(quick_files=quick_files)
    return ap


def parse(ap: argparse.ArgumentParser) -> tuple:
    """(the options, the lengths), checked (exit 2 with argparse's message), inside the CPU environment."""
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths {a.lengths!r} is not a comma list of integers")
    if a.quick:
        a.hidden, a.files, a.repeats = 256, a.quick_files, 1
    if min(lengths) < 1 or min(a.files, a.repeats, a.hidden, getattr(a, "threads", 1)) < 1:
        ap.error("--lengths, --files, --repeats, --hidden (and --threads) must be >= 1")
    if not Path(a.dir).is_dir():
        ap.error(f"--dir {a.dir} is not a directory")
    reexec_in_env()
    return a, lengths


def main() -> int:
    a, lengths = parse(parser(__doc__, files=8, quick_files=2))
    import torch

    from eaglepatch.extract import dumps, writers

    before = Way("before", lambda t: bool(torch.isfinite(t).all()), True)
    now = Way("now", dumps.all_finite, False)
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-extract-path-", dir=a.dir))
    try:
        say(f"writing {a.files} dump files for each of {lengths} tokens, hidden {a.hidden}, into {work}")
        items = write_dumps(work / "dumps", lengths, a.files, a.hidden)
        layout = writers.resolve_layout("specforge", LAYERS, True, NUM_LAYERS)
        res: dict = {"hidden": a.hidden, "states": len(LAYERS) + 1, "dtype": "bfloat16", "dir": a.dir,
                     "files_per_length": a.files, "repeats": a.repeats, "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "lengths": {}}
        failed = ""
        for w in (before, now):  # untimed: first-call costs (imports, allocator, page tables) paid once
            with w:
                for group in items.values():
                    one_sample(group[0], layout, work / "warm", a.hidden, False)
        for n, group in items.items():
            nbytes = sum(p.stat().st_size for p, _, _ in group)
            per = {w.name: {"read_validate_s": [], "write_s": []} for w in (before, now)}
            ratios = []
            for rep in range(a.repeats):
                total = {}
                for w in ((before, now) if rep % 2 == 0 else (now, before)):
                    keep = rep == 0
                    with w:
                        got = [one_sample(it, layout, work / w.name, a.hidden, keep) for it in group]
                    per[w.name]["read_validate_s"].append(sum(g[0] for g in got) / len(group))
                    per[w.name]["write_s"].append(sum(g[1] for g in got) / len(group))
                    total[w.name] = sum(g[0] + g[1] for g in got)
                    if keep:
                        per[w.name]["samples"] = [g[2] for g in got]
                ratios.append(total["before"] / total["now"])
                if keep:  # the two ways' samples of this first repetition, compared, then removed
                    for x, y in zip(per["before"].pop("samples"), per["now"].pop("samples")):
                        failed = failed or same_samples(x, y)
                    shutil.rmtree(work / "before", ignore_errors=True)
                    shutil.rmtree(work / "now", ignore_errors=True)
            row = {"dump_bytes_per_sample": nbytes // len(group), "ways": per,
                   "before_over_now": {"all": [round(r, 3) for r in ratios], "min": round(min(ratios), 3),
                                       "median": round(statistics.median(ratios), 3)}}
            for name, w in per.items():
                med = statistics.median(x + y for x, y in zip(w["read_validate_s"], w["write_s"]))
                row[f"{name}_gb_per_s_median"] = round(nbytes / len(group) / med / 1e9, 3)
            res["lengths"][str(n)] = row
            say(f"{n} tokens: before / now {row['before_over_now']['median']}x median "
                f"({row['before_over_now']['min']}x min); now {row['now_gb_per_s_median']} GB/s of dump, "
                f"before {row['before_gb_per_s_median']} GB/s")
        res["samples_equal"] = not failed
        if failed:
            res["samples_differ"] = failed
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        say(f"wrote {a.out}")
        if failed:
            print(f"error: the two ways wrote different samples: {failed}", file=sys.stderr)
            return 1
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
