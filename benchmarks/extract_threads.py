#!/usr/bin/env python3
"""Extract's per-sample path under many worker threads: torch's intra-op threads at their default
against one, in one run (issue 45: on the H100 host extract ran 32 worker threads, held 560 threads
and used 1.3 of 16 cores while the machine sat half idle).

  python3 benchmarks/extract_threads.py --out docs/results/extract-threads-cpu.json
  python3 benchmarks/extract_threads.py --quick --out /tmp/x.json      # a smoke

Dump files come from the overlay's real ``DumpWriter`` (``extract_path.write_dumps``: bf16, hidden
``--hidden``, four states), ``--files`` of each length in ``--lengths``. Each repetition sends every
file through extract's own ``load_dump`` and ``write_sample`` (``extract_path.one_sample``) from
``--threads`` worker threads, once per intra-op setting (``torch.set_num_threads``: ``default`` is
what torch chose at start, then ``1``), alternating which goes first. Figures per setting and
repetition: samples/s, tokens/s, the process's CPU seconds over wall seconds (cores used), and the
threads the process holds after the pass; then the ratio one / default per repetition, min and
median. Exit: 0 done, 2 usage error.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_path import LAYERS, NUM_LAYERS, one_sample, parse, parser, say, write_dumps  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_pass(items: list, layout, out: Path, hidden: int, threads: int) -> dict:
    """Every item through extract's path from ``threads`` workers; the samples are removed as written."""
    t0, c0 = time.perf_counter(), cpu_s()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda it: one_sample(it, layout, out, hidden, False), items))
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    tokens = sum(len(ids) for _, ids, _ in items)
    return {"wall_s": round(wall, 3), "samples_per_s": round(len(items) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "cores_used": round(cpu / wall, 2),
            "process_threads": len(os.listdir("/proc/self/task"))}


def main() -> int:
    ap = parser(__doc__, files=32, quick_files=4)
    ap.add_argument("--threads", type=int, default=32, help="worker threads, as extract's --concurrency (default 32)")
    a, lengths = parse(ap)
    import torch

    from eaglepatch.extract import writers

    default = torch.get_num_threads()
    settings = {"default": default, "one": 1}
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-extract-threads-", dir=a.dir))
    try:
        say(f"writing {a.files} dump files for each of {lengths} tokens, hidden {a.hidden}, into {work}")
        items = [it for group in write_dumps(work / "dumps", lengths, a.files, a.hidden).values() for it in group]
        layout = writers.resolve_layout("specforge", LAYERS, True, NUM_LAYERS)
        for name, n in settings.items():  # untimed: first-call costs paid once per setting
            torch.set_num_threads(n)
            one_pass(items[: a.threads], layout, work / "warm", a.hidden, a.threads)
        runs = {name: [] for name in settings}
        ratios = []
        for rep in range(a.repeats):
            order = list(settings) if rep % 2 == 0 else list(reversed(settings))
            got = {}
            for name in order:
                torch.set_num_threads(settings[name])
                got[name] = one_pass(items, layout, work / name, a.hidden, a.threads)
                runs[name].append(got[name])
                say(f"repetition {rep + 1}, intra-op threads {settings[name]} ({name}): "
                    f"{got[name]['samples_per_s']} samples/s, {got[name]['tokens_per_s']} tokens/s, "
                    f"{got[name]['cores_used']} cores, {got[name]['process_threads']} threads")
            ratios.append(got["one"]["tokens_per_s"] / got["default"]["tokens_per_s"])
        res = {"hidden": a.hidden, "lengths": lengths, "files_per_length": a.files, "samples": len(items),
               "worker_threads": a.threads, "intra_op_threads": settings, "cpus": os.cpu_count(),
               "torch": torch.__version__, "dir": a.dir, "repeats": a.repeats, "runs": runs,
               "one_over_default": {"per_repetition": [round(r, 3) for r in ratios], "min": round(min(ratios), 3),
                                    "median": round(statistics.median(ratios), 3)}}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        say(f"one / default intra-op threads, tokens/s: min {res['one_over_default']['min']}x, "
            f"median {res['one_over_default']['median']}x; wrote {a.out}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
