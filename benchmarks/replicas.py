#!/usr/bin/env python3
"""Benchmark 6: extraction samples/s from one server vs two replicas behind SGLang's router.

tools/extract.py's Extractor (in this process) extracts the same conversations (the tiny
DeepSeek-V3 checkpoint, the tiny chat tokenizer, specforge format) from
  - "1 server":     one patched sglang 0.5.9 server,
  - "2 via router": two replicas sharing one dump directory behind sglang-router (round robin),
  - "2 direct":     the same two replicas named directly (--server twice; the client's round robin).
The servers and the router start once and stay up (an idle server sleeps: --sleep-on-idle). A round
runs every configuration once into a fresh OUT, the order rotating per round; samples/s is the
samples written over the run's wall time from the first request to the manifest (tokenize,
request, wait for the dump, validate, write). Ratios are taken per round against "1 server".
Everything shares this machine's cores: the replicas' forwards compete with each other and with
the client, so the ratio is bounded by the core count (printed with the figures), not by the
number of replicas.

  python3 benchmarks/replicas.py [--quick] [--rounds N] [--conversations N] [--concurrency N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

LAYERS = [-1, 1, 2, 3]
CONFIGS = ["1 server", "2 via router", "2 direct"]


def conversations(tinychat, n: int, join: int) -> list:
    """``n`` conversations, each ``join`` of tinychat's joined into one (OpenAI form): longer prompts
    make the servers' forwards, not the client, the larger part of the work."""
    from eaglepatch.extract.data import normalize_messages

    recs = tinychat.conversations(n * join, seed=11)
    out = []
    for i in range(n):
        msgs = []
        for r in recs[i * join:(i + 1) * join]:
            msgs += normalize_messages(r, "tinychat conversation %s" % r.get("id"))
        out.append({"id": f"bench-{i:04d}", "messages": msgs})
    return out


def extract_once(servers: list, w: Path, out: Path, concurrency: int, limit: int | None = None) -> dict:
    from eaglepatch.extract import Options, extract

    lines: list = []
    opts = Options(servers=list(servers), model=w / "ckpt", tokenizer=w / "tok", data=w / "conv.jsonl",
                   dump_dir=w / "dumps", out=out, concurrency=concurrency, limit=limit, progress=False,
                   max_len=1000)  # the servers' --context-length is 1024
    rc = extract(opts, log=lines.append)
    if rc != 0:
        raise SystemExit("error: extraction from %s failed (exit %d):\n%s" % (servers, rc, "\n".join(lines[-20:])))
    man = json.loads((out / "manifest.json").read_text())
    shutil.rmtree(out)
    return dict(man["last_run"], tokens=man["tokens"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 48 conversations instead of 5 of 96")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (every configuration)")
    ap.add_argument("--join", type=int, default=6,
                    help="tinychat conversations joined into one prompt (default 6: 260-620 tokens)")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="torch threads per server (OMP_NUM_THREADS; default 1: a replica per core)")
    a = ap.parse_args()
    rounds = a.rounds or (2 if a.quick else 5)
    n = a.conversations or (48 if a.quick else 96)
    tree = _bench.enter_env(patched=True)

    sys.path.insert(0, str(_bench.REPO / "tests" / "extract_fixtures"))
    import _hf
    import cpuserver

    from eaglepatch.serve import tinychat

    w = Path(tempfile.mkdtemp(prefix="eaglepatch-replicas-"))
    servers = []
    try:
        _hf.build_deepseek(w / "ckpt")
        tinychat.build_tokenizer(w / "tok")
        tinychat.write_jsonl(w / "conv.jsonl", conversations(tinychat, n, a.join))
        (w / "dumps").mkdir()
        for name in ("a", "b"):
            s = cpuserver.start_server(tree, w / "ckpt", w / "tok", w / "dumps", LAYERS, w / f"{name}.log",
                                       threads=a.server_threads)
            servers.append(s)
            _bench.log("server %s up at %s (%.0f s)" % (name, s.url, s.start_s))
        with cpuserver.Router([s.url for s in servers], w / "router.log") as router:
            _bench.log("router up at %s (%.0f s)" % (router.url, router.start_s))
            urls = {"1 server": [servers[0].url], "2 via router": [router.url],
                    "2 direct": [s.url for s in servers]}
            for name in CONFIGS:  # warm-up: the first forwards of each server compile and allocate
                extract_once(urls[name], w, w / "warm", a.concurrency, limit=8)
            rates = {c: [] for c in CONFIGS}
            ratios = {c: [] for c in CONFIGS[1:]}
            for r in range(rounds):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
                this = {}
                for name in order:
                    run = extract_once(urls[name], w, w / "out", a.concurrency)
                    if run["extracted"] != n:
                        raise SystemExit("error: %s extracted %d of %d samples" % (name, run["extracted"], n))
                    this[name] = run["extracted"] / run["wall_s"]
                    tokens = run["tokens"]
                    rates[name].append(this[name])
                    _bench.log("round %d/%d %-13s %.1f samples/s" % (r + 1, rounds, name, this[name]))
                for name in CONFIGS[1:]:
                    ratios[name].append(this[name] / this["1 server"])
            served = [cpuserver.answered_after_start(s.log) for s in servers]
    finally:
        for s in servers:
            cpuserver.stop(s.proc)
        shutil.rmtree(w, ignore_errors=True)

    cores = os.cpu_count() or 0
    print("\nmachine: %s; %d conversations per run (%.0f prompt tokens on average), --concurrency %d, "
          "%d torch thread(s) per server, %d rounds"
          % (_bench.machine(), n, tokens / n, a.concurrency, a.server_threads, rounds))
    print(_bench.table(["configuration", "samples/s"], [(c, _bench.summary(rates[c])) for c in CONFIGS]))
    print()
    print(_bench.table(["ratio (per round)", "value", "cores"],
                       [("%s / 1 server" % c, "**%s**" % _bench.summary(ratios[c]), cores) for c in CONFIGS[1:]]))
    print("\nrequests answered per replica (all runs, warm-up runs included): %s" % ", ".join(map(str, served)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
