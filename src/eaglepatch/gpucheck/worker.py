"""One sglang.Engine for the GPU check, in its own process (``python -m eaglepatch.gpucheck.worker SPEC OUT``).

SPEC (JSON): ``engine`` (sglang.Engine keyword arguments), ``runs`` (each ``name``, ``prompts``
(token id lists), ``max_new_tokens``: one generate call, greedy), optional ``bench`` (prefill and
decode throughput, see ``bench``), optional ``wait_files`` ({"dir", "count", "timeout_s"}: wait
for the dump writer before shutting down). OUT (JSON): ``ok``, ``error``, ``sglang`` (version,
file), ``start_s``, per run ``output_ids`` and ``wall_s``, ``bench``. Progress goes to stderr.
Runs under the python and PYTHONPATH the check chose (the patched or the upstream sglang).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

T0 = time.monotonic()


def say(msg: str) -> None:
    print("[gpucheck worker %6.1fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


def _greedy(n: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": int(n), "ignore_eos": True}


def generate(engine, prompts, new_tokens):
    out = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=_greedy(new_tokens))
    if isinstance(out, dict):
        out = [out]
    ids = []
    for o in out:
        if "output_ids" not in o:
            raise RuntimeError("generate returned no output_ids (keys %s)" % sorted(o))
        ids.append([int(t) for t in o["output_ids"]])
    return ids


def wait_files(directory: str, count: int, timeout_s: float) -> float:
    """Seconds until ``count`` .safetensors files are in ``directory`` (-1 on timeout)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if len(list(Path(directory).glob("*.safetensors"))) >= count:
            return time.monotonic() - t
        time.sleep(0.05)
    return -1.0


def bench(engine, spec: dict) -> dict:
    """Prefill tokens/s (max_new_tokens=1 calls, fresh prompts each rep) and decode tokens/s
    ((R * (M - 1)) / (t(M) - t(1)) over the same prompts), medians over ``reps``."""
    rng = random.Random(spec.get("seed", 0))
    vocab = int(spec["vocab"])
    out = {}
    p = spec.get("prefill")
    if p:
        def batch():
            return [[rng.randrange(2, vocab - 1) for _ in range(p["tokens"])] for _ in range(p["requests"])]

        generate(engine, batch(), 1)  # warm-up
        if spec.get("dump_dir"):
            wait_files(spec["dump_dir"], p["requests"], 120)
        rates, t_all = [], time.monotonic()
        for _ in range(p["reps"]):
            b = batch()
            t = time.monotonic()
            generate(engine, b, 1)
            rates.append(p["requests"] * p["tokens"] / (time.monotonic() - t))
        wall = time.monotonic() - t_all
        res = {"tokens_per_s": rates, "median": statistics.median(rates),
               "sustained": p["reps"] * p["requests"] * p["tokens"] / wall,
               "tokens": p["reps"] * p["requests"] * p["tokens"]}
        if spec.get("dump_dir"):
            want = (p["reps"] + 1) * p["requests"]
            res["drain_s"] = wait_files(spec["dump_dir"], want, 300)
            res["files"] = len(list(Path(spec["dump_dir"]).glob("*.safetensors")))
            for f in Path(spec["dump_dir"]).glob("*.safetensors"):
                f.unlink()
        out["prefill"] = res
        say("prefill: %s tokens/s" % ", ".join("%.0f" % r for r in rates))
    d = spec.get("decode")
    if d:
        prompts = [[rng.randrange(2, vocab - 1) for _ in range(d["prompt"])] for _ in range(d["requests"])]
        generate(engine, prompts, d["new_tokens"])  # warm-up
        rates = []
        for _ in range(d["reps"]):
            t = time.monotonic()
            generate(engine, prompts, 1)
            t1 = time.monotonic() - t
            t = time.monotonic()
            generate(engine, prompts, d["new_tokens"])
            tm = time.monotonic() - t
            rates.append(d["requests"] * (d["new_tokens"] - 1) / max(tm - t1, 1e-9))
        out["decode"] = {"tokens_per_s": rates, "median": statistics.median(rates)}
        say("decode: %s tokens/s" % ", ".join("%.0f" % r for r in rates))
    return out


def main(argv) -> int:
    spec_path, out_path = Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    result = {"ok": False, "error": None, "runs": [], "bench": None}

    def flush():
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out_path)

    engine = None
    try:
        import sglang

        result["sglang"] = {"version": getattr(sglang, "__version__", "?"), "file": sglang.__file__}
        say("sglang %s from %s" % (result["sglang"]["version"], sglang.__file__))
        t = time.monotonic()
        engine = sglang.Engine(**spec["engine"])
        result["start_s"] = round(time.monotonic() - t, 1)
        say("engine started in %.1f s" % result["start_s"])
        flush()
        for run in spec.get("runs", []):
            t = time.monotonic()
            ids = generate(engine, run["prompts"], run["max_new_tokens"])
            wall = time.monotonic() - t
            result["runs"].append({"name": run["name"], "output_ids": ids, "wall_s": round(wall, 3)})
            say("run %s: %d requests in %.2f s" % (run["name"], len(ids), wall))
            flush()
        if spec.get("bench"):
            result["bench"] = bench(engine, spec["bench"])
        w = spec.get("wait_files")
        if w:
            result["files_after_s"] = wait_files(w["dir"], w["count"], w.get("timeout_s", 120))
        result["ok"] = True
    except BaseException as exc:  # the orchestrator reads the error from OUT
        result["error"] = "%s: %s" % (type(exc).__name__, exc)
        result["traceback"] = traceback.format_exc()[-4000:]
        say("FAILED: %s" % result["error"])
    finally:
        flush()
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:
                say("shutdown: %s" % exc)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    rc = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
