#!/usr/bin/env python3
"""Benchmark 3: end to end on the CPU sglang.Engine with the tiny DeepSeek-V3 model.

Prefill throughput (prompt tokens / s of generate calls with max_new_tokens=1) for
  - upstream sglang 0.5.9 ("unpatched"),
  - the product series applied, EAGLE3_DUMP_DIR unset ("patched, dump off"),
  - the product series applied, dump on to a tmpfs directory, layers -1,1,2 + final ("dump on").
Each configuration is a fresh process holding one Engine (the dump settings are read when the
model runner starts); configurations run one after the other in rounds, their order rotating
per round. A round times `--calls` generate calls of `--batch` prompts of `--tokens` tokens per
configuration after a warm-up call. Ratios are taken per round between neighbouring runs.

  python3 benchmarks/end_to_end.py [--quick] [--rounds N] [--calls N] [--batch B] [--tokens T]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

ENGINE_ARGS = dict(device="cpu", skip_tokenizer_init=True, attention_backend="torch_native",
                   disable_cuda_graph=True, dtype="float32", disable_radix_cache=True,
                   disable_overlap_schedule=True, max_total_tokens=8192, context_length=1024,
                   chunked_prefill_size=-1, max_running_requests=8, random_seed=0, log_level="error",
                   mem_fraction_static=0.5)
CONFIGS = ["unpatched", "patched, dump off", "dump on"]


def worker(ckpt: str, calls: int, batch: int, tokens: int, seed: int, dump_dir: str) -> dict:
    import sglang

    engine = sglang.Engine(model_path=ckpt, **ENGINE_ARGS)
    rng = random.Random(seed)
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    try:
        engine.generate(input_ids=[[rng.randrange(2, 1000) for _ in range(tokens)] for _ in range(batch)],
                        sampling_params=sp)
        rates = []
        for _ in range(calls):
            prompts = [[rng.randrange(2, 1000) for _ in range(tokens)] for _ in range(batch)]
            t0 = time.perf_counter()
            out = engine.generate(input_ids=prompts, sampling_params=sp)
            rates.append(batch * tokens / (time.perf_counter() - t0))
            if len(out) != batch:
                raise RuntimeError("generate returned %d outputs for %d prompts" % (len(out), batch))
        files = waited = None
        if dump_dir:  # untimed: the writer drains after the last call returns
            want, t0 = (calls + 1) * batch, time.monotonic()
            while time.monotonic() - t0 < 60:
                files = len(list(Path(dump_dir).glob("*.safetensors")))
                if files >= want:
                    break
                time.sleep(0.2)
            waited = time.monotonic() - t0
    finally:
        engine.shutdown()
    return {"rates": rates, "files": files, "waited": waited}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 4 calls instead of 2 rounds of 6")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--calls", type=int)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:  # inside the environment, one configuration
        ckpt, seed, dump_dir = a.worker.split("|")
        print("@@" + json.dumps(worker(ckpt, a.calls, a.batch, a.tokens, int(seed), dump_dir)))
        return 0
    py = _bench.env_python()
    rounds = a.rounds or (1 if a.quick else 2)
    calls = a.calls or (4 if a.quick else 6)
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-e2e-"))
    dump = Path(tempfile.mkdtemp(prefix="eaglepatch-e2e-dump-", dir="/dev/shm"))
    try:
        trees = {"unpatched": _bench.build_tree(work / "upstream", patched=False),
                 "patched": _bench.build_tree(work / "patched", patched=True)}
        ckpt = work / "ckpt"
        _bench.log("building the tiny checkpoint")
        subprocess.run([str(py), "-c", "import sys, _hf; from pathlib import Path; _hf.build_deepseek(Path(sys.argv[1]))",
                        str(ckpt)], env=_bench.inner_env(trees["patched"]), check=True)
        print("# end to end, CPU sglang.Engine, tiny DeepSeek-V3 (hidden 256, 4 layers, float32): %d calls x "
              "%d prompts x %d tokens per configuration and round, max_new_tokens=1; %s"
              % (calls, a.batch, a.tokens, _bench.machine()))
        per = {c: [] for c in CONFIGS}
        medians = []
        for r in range(rounds):
            order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
            med = {}
            for c in order:
                env = _bench.inner_env(trees["unpatched" if c == "unpatched" else "patched"])
                for k in list(env):
                    if k.startswith("EAGLE3_DUMP_"):
                        del env[k]
                if c == "dump on":
                    env.update(EAGLE3_DUMP_DIR=str(dump), EAGLE3_DUMP_LAYERS="-1,1,2")
                cmd = [str(py), __file__, "--calls", str(calls), "--batch", str(a.batch), "--tokens", str(a.tokens),
                       "--worker", "%s|%d|%s" % (ckpt, r, dump if c == "dump on" else "")]
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
                if p.returncode or not lines:
                    raise SystemExit("%s failed (exit %d):\n%s" % (c, p.returncode, p.stderr[-3000:]))
                out = json.loads(lines[-1][2:])
                if c == "dump on":
                    have = len(list(dump.glob("*.safetensors")))
                    for f in dump.iterdir():
                        f.unlink()
                    if have != (calls + 1) * a.batch:
                        raise SystemExit("dump on: %d files, want %d (%s)" % (have, (calls + 1) * a.batch, out))
                per[c] += out["rates"]
                med[c] = _bench.median(out["rates"])
                _bench.log("round %d %s: %s tokens/s" % (r, c, _bench.summary(out["rates"])))
            medians.append(med)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump, ignore_errors=True)
    rows = [[c, _bench.summary(per[c])] for c in CONFIGS]
    print(_bench.table(["configuration", "prefill tokens/s (all calls)"], rows))
    r_off = [m["patched, dump off"] / m["unpatched"] for m in medians]
    r_on = [m["dump on"] / m["patched, dump off"] for m in medians]
    print(_bench.table(["ratio (per round, of the call medians)", "value"], [
        ["patched dump off / unpatched (goal 1.00 +- noise)", "**%s**" % _bench.summary(r_off)],
        ["dump on / dump off", "**%s**" % _bench.summary(r_on)],
    ]))
    print("call-to-call spread within one configuration (max-min)/median: " + ", ".join(
        "%s %.0f%%" % (c, _bench.spread_pct(per[c])) for c in CONFIGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
