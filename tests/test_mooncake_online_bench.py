"""benchmarks/online.py on CPU (``--cpu``): the same seeded requests through the file sink and the
Mooncake sink of the CPU demo's patched server (a real ``mooncake_master``, the CPU wheel), each
pass reading back every sample; the usage errors. CPU figures prove the plumbing, not performance.
Runs inside the CPU environment; under another interpreter the first test reruns this file there.
About 2 minutes on a 2-core machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_suite_in_cpu_env

REPO = Path(__file__).resolve().parents[1]
ONLINE = REPO / "benchmarks" / "online.py"
IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "specforge"))
in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_online_suite_in_cpu_env)")


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_online_suite_in_cpu_env():
    run_suite_in_cpu_env(__file__, 900)


def online(*args, timeout=840) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ONLINE), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@in_env
def test_both_sinks_carry_every_request_with_the_same_bytes(tmp_path):
    out = tmp_path / "online.json"
    p = online("--cpu", "--requests", 12, "--repeats", 2, "--out", out, "--work", tmp_path / "work")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    cfg = json.loads((tmp_path / "work" / "demo" / "model" / "config.json").read_text())
    per_token = 4 * cfg["hidden_size"] * 4 + 8  # layers 0-2 and the final state in float32, and the id
    sinks = res["sinks"]
    assert set(sinks) == {"file", "mooncake"}
    for name, s in sinks.items():
        for ps in ("produce", "consume", "online"):
            assert s[ps]["samples"] == 12 and not s[ps]["errors"], (name, ps, s[ps])
            assert s[ps]["tokens"] == res["requests"]["online" if ps == "online" else "produce"]["tokens"]
        for ps in ("consume", "online"):
            assert s[ps]["bytes_per_token"] == per_token, (name, ps)
        assert s["online_flush"]["failed"] == 0 and s["online_flush"]["written"] >= 48, s["online_flush"]
        assert s["consume"]["failed_reads"] == 0 and len(s["repeats"]) == 2
        for ps in ("produce", "consume", "online"):  # the median repetition, with the min of both
            assert s[ps]["repetitions"] == 2 and sorted(s[ps]["tokens_per_s_all"])[0] == s[ps]["tokens_per_s_min"]
            assert s[ps]["tokens_per_s"] in s[ps]["tokens_per_s_all"]
    # the file sink's consumer deleted every file it read; the store's reader every object
    assert not list((tmp_path / "work" / "demo" / "dumps").glob("*.safetensors"))
    ratios = res["mooncake_over_file"]
    assert set(ratios) == {"produce", "consume", "online"}
    assert all(len(r["all"]) == 2 and r["min"] == min(r["all"]) and r["median"] in r["all"] for r in ratios.values())
    assert any("drained" in x for x in sinks["mooncake"]["server_log"]), sinks["mooncake"]["server_log"]


@in_env
@pytest.mark.parametrize("args,needle", [
    (["--sinks", "file,disk"], "--sinks 'file,disk' names no sink or an unknown one (disk)"),
    (["--requests", "0"], "--requests 0 is not positive"),
    (["--repeats", "0"], "--repeats 0 is not positive"),
    (["--pass-s", "nan"], "--pass-s nan is not a finite number >= 0"),
    (["--mooncake-site", "/nonexistent"], "--mooncake-site /nonexistent has no mooncake/mooncake_master"),
])
def test_usage_errors_are_one_line_and_write_nothing(tmp_path, args, needle):
    out = tmp_path / "online.json"
    p = online("--cpu", "--out", out, "--work", tmp_path / "work", *args, timeout=60)
    assert p.returncode == 2, p.stderr
    errs = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errs) == 1 and needle in errs[0], p.stderr
    assert "Traceback" not in p.stderr and not out.exists() and not (tmp_path / "work").exists()
