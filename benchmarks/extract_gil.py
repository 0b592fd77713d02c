#!/usr/bin/env python3
"""Extract's per-sample path beside Python work: worker threads against worker processes, in one run
(issue 45: beside a server, extract's 32 threads used 1.3 of 16 cores and wrote 22-30k tokens/s, while
the same path alone, benchmarks/extract_threads.py, wrote 79-112k on 8 cores).

  python3 benchmarks/extract_gil.py --out docs/results/extract-gil-cpu.json
  python3 benchmarks/extract_gil.py --quick --out /tmp/x.json      # a smoke

The question: does the Python a worker runs before each sample (extract's chat template, HTTP client
and JSON: pure Python, holding the GIL) starve the sample path's many short torch calls, each of which
must take the GIL back? Each sample is a dump file from the overlay's real ``DumpWriter`` sent through
extract's own ``load_dump`` and ``write_sample`` (``extract_path.one_sample``). Settings, each a pass
over every file from ``--threads`` worker threads, torch intra-op threads 1, rotated per repetition:

- ``alone``: the sample path only (the ceiling);
- ``python``: each worker first runs ``--py-ms`` ms of its own CPU time in pure Python (JSON round
  trips of a request-sized payload, measured by ``time.thread_time``, so waiting for the GIL is not
  counted as work), then the sample path in the same thread, as extract's workers do;
- ``switch``: as ``python`` with the interpreter's switch interval at ``--switch-ms`` (default 1 ms; 5 ms
  is Python's own): a thread back from a torch call waits at most that long for a Python-bound one;
- ``processes``: the same Python in the threads, the sample path in a pool of ``--processes`` worker
  processes (each its own GIL), the thread waiting for its sample.

Figures per setting and repetition: samples/s, tokens/s, wall; ratios python/alone, switch/python and
processes/python per repetition, min and median. Every pass's samples are checked equal to the first
pass's (exit 1 if not). Exit: 0 done, 1 samples differ, 2 usage error.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from extract_path import LAYERS, NUM_LAYERS, one_sample, parse, parser, say, write_dumps  # noqa: E402

SETTINGS = ("alone", "python", "switch", "processes")
PAYLOAD = {"input_ids": list(range(512)), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
           "rid": "0" * 32, "return_hidden_states": False}


def python_work(ms: float) -> int:
    """``ms`` milliseconds of this thread's CPU time in pure Python; the round trips done."""
    end, n = time.thread_time() + ms / 1000.0, 0
    while time.thread_time() < end:
        json.loads(json.dumps(PAYLOAD))
        n += 1
    return n


def _init_child(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _digest(path: Path) -> str:
    import hashlib

    import torch

    t = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for k in sorted(t):
        h.update(k.encode())
        h.update(t[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def one_pass(setting: str, items: list, layout, out: Path, hidden: int, threads: int, py_ms: float,
             pool, switch_s: float) -> tuple[dict, dict]:
    """Every item through the sample path in ``setting``; (figures, {rid: sample digest})."""
    out.mkdir(parents=True, exist_ok=True)

    def work(it):
        if setting != "alone":
            python_work(py_ms)
        if setting == "processes":
            pool.submit(one_sample, it, layout, out, hidden, True).result()
        else:
            one_sample(it, layout, out, hidden, True)
        return it[2]

    interval = sys.getswitchinterval()
    if setting == "switch":
        sys.setswitchinterval(switch_s)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as tp:
            rids = list(tp.map(work, items))
        wall = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(interval)
    tokens = sum(len(ids) for _, ids, _ in items)
    from eaglepatch.extract import writers

    digests = {r: _digest(out / writers.sample_rel("specforge", r)) for r in rids}
    shutil.rmtree(out, ignore_errors=True)
    return ({"wall_s": round(wall, 3), "samples_per_s": round(len(items) / wall, 2),
             "tokens_per_s": round(tokens / wall, 1)}, digests)


def main() -> int:
    ap = parser(__doc__, files=32, quick_files=4)
    ap.add_argument("--threads", type=int, default=32, help="worker threads, as extract's --concurrency (default 32)")
    ap.add_argument("--processes", type=int, default=0, help="worker processes of 'processes' (default: the cores)")
    ap.add_argument("--switch-ms", type=float, default=1.0, help="the switch interval of 'switch' (default 1 ms)")
    ap.add_argument("--py-ms", type=float, default=10.0,
                    help="pure-Python CPU milliseconds per sample before its path (default 10)")
    a, lengths = parse(ap)
    import multiprocessing

    import torch

    from eaglepatch.extract import writers

    torch.set_num_threads(1)
    procs = a.processes or os.cpu_count() or 1
    switch = a.switch_ms / 1000.0
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-extract-gil-", dir=a.dir))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])
    try:
        say(f"writing {a.files} dump files for each of {lengths} tokens, hidden {a.hidden}, into {work}")
        items = [it for group in write_dumps(work / "dumps", lengths, a.files, a.hidden).values() for it in group]
        layout = writers.resolve_layout("specforge", LAYERS, True, NUM_LAYERS)
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_child,
                                 initargs=(1,)) as pool:
            want = None
            for s in SETTINGS:  # untimed: first-call costs (and the pool's start) paid once per setting
                one_pass(s, items[: a.threads], layout, work / "warm", a.hidden, a.threads, a.py_ms, pool, switch)
            runs = {s: [] for s in SETTINGS}
            ratios = {"python_over_alone": [], "switch_over_python": [], "processes_over_python": []}
            for rep in range(a.repeats):
                order = SETTINGS[rep % len(SETTINGS):] + SETTINGS[:rep % len(SETTINGS)]
                got = {}
                for s in order:
                    got[s], d = one_pass(s, items, layout, work / s, a.hidden, a.threads, a.py_ms, pool, switch)
                    want = want or d
                    if d != want:
                        say(f"error: the samples of '{s}' differ from the first pass's")
                        return 1
                    runs[s].append(got[s])
                    say(f"repetition {rep + 1}, {s}: {got[s]['samples_per_s']} samples/s, "
                        f"{got[s]['tokens_per_s']} tokens/s")
                ratios["python_over_alone"].append(got["python"]["tokens_per_s"] / got["alone"]["tokens_per_s"])
                ratios["switch_over_python"].append(got["switch"]["tokens_per_s"] / got["python"]["tokens_per_s"])
                ratios["processes_over_python"].append(got["processes"]["tokens_per_s"] / got["python"]["tokens_per_s"])
        res = {"hidden": a.hidden, "lengths": lengths, "files_per_length": a.files, "samples": len(items),
               "worker_threads": a.threads, "worker_processes": procs, "py_ms": a.py_ms, "cpus": os.cpu_count(),
               "switch_ms": a.switch_ms,
               "switch_interval_s": sys.getswitchinterval(), "torch": torch.__version__, "dir": a.dir,
               "repeats": a.repeats, "runs": runs, "samples_equal": True,
               "ratios": {k: {"per_repetition": [round(r, 3) for r in v], "min": round(min(v), 3),
                              "median": round(statistics.median(v), 3)} for k, v in ratios.items()}}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        say("tokens/s ratios: " + "; ".join(f"{k} min {v['min']}x, median {v['median']}x"
                                            for k, v in res["ratios"].items()) + f"; wrote {a.out}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
