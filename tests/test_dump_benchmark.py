"""benchmarks/dump_host_memory.py (the GPU benchmark of the dump's host memory, forward waits and
prefill cost) keeps working: its --smoke mode runs the same code paths on CPU with the package's
real DumpWriter and must write every request, the chunked one included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("torch")
pytest.importorskip("safetensors")


def test_dump_host_memory_smoke_runs_and_writes_every_request(tmp_path):
    out = tmp_path / "x.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dump_host_memory.py"), "--smoke",
                        "--out", str(out), "--dir", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    mem, ratio = res["memory"], res["ratio"]
    assert mem["written"] == mem["prefills"] == 21 and mem["dropped"] == 0 and mem["failed"] == 0
    assert mem["submit_ms"]["n"] == 20 + 8  # 20 whole prefills + the 2000-token request in 8 chunks
    assert mem["staging"]["peak_chunk_bytes"] == mem["chunked_rows_bytes"]  # the chunked request was held
    assert set(res["verdicts"]) == {"no_caching_host_alloc_growth", "peak_rss_within_bound",
                                    "drained_rss_within_bound", "submit_p99_le_5ms", "all_written",
                                    "worst_rep_ratio_ge_0.95"}
    assert res["verdicts"]["all_written"]
    assert len(ratio["reps"]) == 2 and ratio["ratio_min"] <= ratio["ratio_median"] <= ratio["ratio_max"]
    assert "prefill on/off: min" in r.stdout and "verdict by the worst" in r.stdout
    assert not list(tmp_path.glob("dump-*/*.safetensors"))  # the reaper left no dump behind


def test_write_modes_measures_every_mode_on_the_same_bytes(tmp_path):
    """benchmarks/write_modes.py (issue 31: buffered or O_DIRECT, decided by measurement): each mode
    commits whole files of the same bytes (the script asserts the sizes), the summary has every
    mode at 1 and N threads with its ratio to the sink's own commit, nothing is left in --dir, and a
    bad count is a one-line usage error."""
    out = tmp_path / "w.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    script = str(REPO / "benchmarks" / "write_modes.py")
    r = subprocess.run([sys.executable, script, "--tokens", "128", "--hidden", "512", "--files", "3", "--threads", "2",
                        "--repeats", "2", "--dir", str(disk), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    modes = ("sink", "buffered") + (() if "O_DIRECT refused here" in r.stderr else ("direct",))  # tmpfs refuses it
    assert sorted(res["summary"]) == sorted(f"{m}x{t}" for m in modes for t in (1, 2))
    assert all(s["vs_sink_median"] == 1.0 for n, s in res["summary"].items() if n.startswith("sink"))
    assert len(res["repetitions"]) == 2 and all(v > 0 for rep in res["repetitions"] for v in rep.values())
    assert list(disk.iterdir()) == []
    bad = subprocess.run([sys.executable, script, "--files", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --files 0 is not positive"), bad.stderr
