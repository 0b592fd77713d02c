#!/usr/bin/env python3
"""What an answer waits for to say what became of its request's file (issue 43, item 11): a status
round trip into the writer's process (the control socket) against a read of the launch's state
table (overlay ``states``), in one run, with the writer's process as busy as a scheduler.

  PYTHONPATH=src python3 benchmarks/status_latency.py --out docs/results/status-latency-cpu.json

A writer process (the overlay's real DumpWriter and ControlServer) publishes 32 requests' states
and then keeps its main thread running Python without a pause, as SGLang's scheduler loop does
(``--idle``: it sleeps instead). This process, the launching side, asks for the 32 states
``--calls`` times per method and repetition: ``round_trip`` (``control.call("status")``, what
every answer did before) and ``table`` (``StateTable.get`` from its own mapping). The methods
alternate within each repetition; figures are milliseconds per lookup of 32 states, min / median /
p90 / max per repetition, and the ratio of the medians within each repetition (this machine's load
varies; the ratio within one repetition is the figure). Exit 0, or 2 on a usage error (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

RIDS = ["bench-%d" % i for i in range(32)]

WRITER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, SRC)
    from eaglepatch.overlay import import_package
    import_package("e3c_bench_w")
    dump_mod = __import__("e3c_bench_w.dump", fromlist=["DumpWriter"])
    identity = sys.modules["e3c_bench_w.identity"]
    class M: name = "EXTEND"
    class B:
        forward_mode = M()
        def __init__(s, rids):
            s.input_ids, s.extend_seq_lens_cpu = torch.arange(4 * len(rids)), [4] * len(rids)
            s.extend_prefix_lens_cpu = [0] * len(rids)
            s._eagle3_requests = [identity.RequestInfo(r, 4) for r in rids]
    w = dump_mod.DumpWriter(DUMP, [2], False, 1 << 22, {"launch_id": "bench"})
    w.start_control()
    w.submit(B(RIDS), {2: torch.randn(4 * len(RIDS), 8)}, None)
    assert w.flush_report(60)["flushed"]
    print("ready", flush=True)
    x = 0
    while True:
        if IDLE:
            time.sleep(0.01)
        else:  # the scheduler's loop: Python, never sleeping
            for i in range(1000):
                x += i
""")


def _pcts(xs: list) -> dict:
    s = sorted(xs)
    return {"min": s[0], "median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--calls", type=int, default=200, help="lookups of 32 states per method and repetition (200)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions (3)")
    ap.add_argument("--idle", action="store_true", help="the writer's main thread sleeps instead of running Python")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.exit(2, "error: --calls and --repeats must be at least 1\n")
    from eaglepatch.overlay import import_package

    import_package("e3c_bench")
    control = __import__("e3c_bench.control", fromlist=["call"])
    states = __import__("e3c_bench.states", fromlist=["StateTable"])
    identity = __import__("e3c_bench.identity", fromlist=["request_key"])
    table = states.StateTable.create()
    path, token = control.new_path(), "bench-token"
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-status-"))
    env = dict(os.environ, **{states.ENV_STATES: table.path, control.ENV_CONTROL: path, control.ENV_TOKEN: token})
    code = (WRITER.replace("SRC", repr(str(REPO / "src"))).replace("DUMP", repr(str(work)))
            .replace("RIDS", repr(RIDS)).replace("IDLE", repr(args.idle)))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            print("error: the writer process did not start", file=sys.stderr)
            return 1
        keys = [identity.request_key(r) for r in RIDS]

        def round_trip():
            reply = control.call("status", 30.0, path, token=token, rids=RIDS)
            assert all(v == "written" for v in reply["states"].values()), reply

        def from_table():
            got = [table.get(k) for k in keys]
            assert all(v == "written" for v in got), got

        reps = []
        for rep in range(args.repeats):
            times = {"round_trip": [], "table": []}
            for _ in range(args.calls):
                for name, fn in (("round_trip", round_trip), ("table", from_table)):
                    t = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t) * 1e3)
            figs = {k: _pcts(v) for k, v in times.items()}
            figs["ratio_of_medians"] = figs["round_trip"]["median"] / figs["table"]["median"]
            reps.append(figs)
            print(f"repetition {rep + 1}: round trip median {figs['round_trip']['median']:.3f} ms "
                  f"(p90 {figs['round_trip']['p90']:.3f}, max {figs['round_trip']['max']:.3f}); table median "
                  f"{figs['table']['median']:.4f} ms (max {figs['table']['max']:.4f}); ratio {figs['ratio_of_medians']:.0f}x",
                  flush=True)
    finally:
        proc.kill()
        proc.wait()
        table.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    summary = {"writer_main_thread": "idle" if args.idle else "busy", "calls": args.calls, "rids_per_call": len(RIDS),
               "repetitions": reps,
               "round_trip_median_ms": {"min": min(r["round_trip"]["median"] for r in reps),
                                        "median": statistics.median(r["round_trip"]["median"] for r in reps)},
               "table_median_ms": {"min": min(r["table"]["median"] for r in reps),
                                   "median": statistics.median(r["table"]["median"] for r in reps)},
               "ratio_of_medians": {"min": min(r["ratio_of_medians"] for r in reps),
                                    "median": statistics.median(r["ratio_of_medians"] for r in reps)}}
    print(json.dumps({k: v for k, v in summary.items() if k != "repetitions"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
