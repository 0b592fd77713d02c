"""benchmarks/peers.py's ``ours-sharded`` (issue 45): ``ours`` with several extract processes at once,
each on its round-robin share of the conversations, on the CPU demo: every conversation lands in
exactly one shard's dataset, SpecForge's own reader loads them all as one dataset, the rows match the
float32 reference, and the ratio to the limit is computed for it as for ``ours``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_suite_in_cpu_env

IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "specforge"))
in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_peers_sharded_in_cpu_env)")


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_peers_sharded_in_cpu_env():
    run_suite_in_cpu_env(__file__, 1000)


@in_env
def test_ours_sharded_deals_every_conversation_to_one_extract_process(tmp_path):
    out, work = tmp_path / "peers.json", tmp_path / "work"
    p = subprocess.run(["nice", "-n", "5", sys.executable, str(REPO / "benchmarks" / "peers.py"), "--cpu",
                        "--methods", "limit,ours-sharded", "--extract-shards", "2", "--conversations", "8",
                        "--out", str(out), "--work", str(work), "--keep-work", "--budget-s", "400"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    m = res["methods"]["ours-sharded"]
    assert m["status"] == "measured" and m["extract_processes"] == 2, m
    (rep,) = m["repetitions"]
    n = res["conversations"]["count"]
    assert rep["samples_done"] == n and rep["extract_exit"] == [0, 0] and rep["concurrency_each"] >= 1, rep
    assert rep["reader"]["loaded"] and rep["reader"]["samples"] == n, rep["reader"]
    assert rep["reference"]["verdict"] == "pass" and not rep["reference"]["missing"], rep["reference"]
    ds = Path(rep["dataset"])
    per_shard = [sorted(q.name for q in (ds / d).rglob("*.ckpt")) for d in ("shard-0", "shard-1")]
    assert all(per_shard) and not set(per_shard[0]) & set(per_shard[1])  # each conversation in one shard
    assert sum(map(len, per_shard)) == n
    r = res["ratio_to_limit"]["methods"]["ours-sharded"]["overall"]
    lim = res["methods"]["limit"]["repetitions"][0]["tokens_per_s"]
    assert r["per_repetition"] == [pytest.approx(rep["tokens_per_s"] / lim, rel=1e-3)]
