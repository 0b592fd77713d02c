"""benchmarks/online.py on CPU (``--cpu``): the same seeded requests through the file sink, the
Mooncake sink and SpecForge's capture protocol (its own adapter and feature store) of the CPU demo's
patched server (a real ``mooncake_master``, the CPU wheel), each pass reading back every sample;
without SpecForge's package the default leaves that sink out in one line; the usage errors. CPU
figures prove the plumbing, not performance. Runs inside the CPU environment; under another
interpreter the first test reruns this file there. About 3 minutes on a 2-core machine."""

from __future__ import annotations

import importlib.util
import json
import os
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


def online(*args, timeout=840, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ONLINE), *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


@in_env
def test_every_sink_carries_every_request_with_the_same_states(tmp_path):
    out = tmp_path / "online.json"
    p = online("--cpu", "--requests", 12, "--repeats", 2, "--out", out, "--work", tmp_path / "work")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    cfg = json.loads((tmp_path / "work" / "demo" / "model" / "config.json").read_text())
    states = 4 * cfg["hidden_size"] * 4  # layers 0-2 and the final state in float32
    # with the ids (int64); SpecForge's objects: with input_ids, loss_mask and attention_mask (int64)
    per_token = {"file": states + 8, "mooncake": states + 8, "specforge": states + 3 * 8}
    sinks = res["sinks"]
    assert set(sinks) == {"file", "mooncake", "specforge"} and res["sinks_left_out"] == {}
    for name, s in sinks.items():
        for ps in ("produce", "consume", "online"):
            assert s[ps]["samples"] == 12 and not s[ps]["errors"], (name, ps, s[ps])
            assert s[ps]["tokens"] == res["requests"]["online" if ps == "online" else "produce"]["tokens"]
            assert s[ps]["tokens_per_s"] > 0 and s[ps]["samples_per_s"] > 0, (name, ps, s[ps])
        for ps in ("consume", "online"):
            assert s[ps]["bytes_per_token"] == per_token[name] and s[ps]["gb_per_s"] > 0, (name, ps)
        assert s["online_flush"]["failed"] == 0 and s["online_flush"]["written"] >= 48, s["online_flush"]
        assert s["consume"]["failed_reads"] == 0 and len(s["repeats"]) == 2
        for ps in ("produce", "consume", "online"):  # the median repetition, with the min of both
            assert s[ps]["repetitions"] == 2 and sorted(s[ps]["tokens_per_s_all"])[0] == s[ps]["tokens_per_s_min"]
            assert s[ps]["tokens_per_s"] in s[ps]["tokens_per_s_all"]
    # the file sink's consumer deleted every file it read; the store's reader every object
    assert not list((tmp_path / "work" / "demo" / "dumps").glob("*.safetensors"))
    for key in ("mooncake_over_file", "specforge_over_file"):
        ratios = res[key]
        assert set(ratios) == {"produce", "consume", "online"}, key
        assert all(len(r["all"]) == 2 and r["min"] == min(r["all"]) > 0 and r["median"] in r["all"]
                   for r in ratios.values()), (key, ratios)
    assert any("drained" in x for x in sinks["mooncake"]["server_log"]), sinks["mooncake"]["server_log"]
    # SpecForge's own client: its adapter's calls of its lease answered every prompt at the launch's ids,
    # and after its clean-up a fresh client finds none of the keys any request named
    sf = sinks["specforge"]
    assert sf["client"]["aux_layer_ids"] == [0, 1, 2] and sf["client"]["prompts_per_call"] == 8, sf["client"]
    for ps in ("produce", "online"):
        assert sf[ps]["failed_captures"] == 0 and sf[ps]["not_captured"] == 0, (ps, sf[ps])
    clean = sf["cleanup"]
    assert "failed" not in clean and clean["keys_left"] == 0 and clean["drain"]["release_pending"] == 0, clean
    warm = 8 * len(sf["warmup"]["rounds"])
    assert clean["keys"] == 5 * (warm + 2 * 2 * 12), clean  # 5 objects a prompt: warm-up, 2 passes, 2 repetitions


@in_env
def test_without_specforge_the_default_leaves_its_sink_out_in_one_line(tmp_path):
    """A SpecForge package that does not import (a stand-in first on the path raising ImportError):
    the default runs file and mooncake and says why in one stderr line and in the JSON (--budget-s
    spent: no server started); naming it is a one-line usage error that writes nothing."""
    (tmp_path / "shadow" / "specforge").mkdir(parents=True)
    (tmp_path / "shadow" / "specforge" / "__init__.py").write_text("raise ImportError('no SpecForge here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "online.json"
    p = online("--cpu", "--out", out, "--work", tmp_path / "work", "--budget-s", 0.001, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    said = [x for x in p.stderr.splitlines() if "specforge sink is left out" in x]
    assert len(said) == 1 and "no SpecForge here" in said[0], p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "no SpecForge here" in res["sinks_left_out"]["specforge"]
    assert set(res["sinks"]) == {"file", "mooncake"}, res["sinks"]
    out2 = tmp_path / "named.json"
    p = online("--cpu", "--sinks", "file,specforge", "--out", out2, "--work", tmp_path / "work2", env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    errs = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errs) == 1 and "--sinks specforge needs SpecForge's package" in errs[0], p.stderr
    assert "Traceback" not in p.stderr and not out2.exists() and not (tmp_path / "work2").exists()


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


@in_env
def test_a_failed_capture_fails_the_pass_and_the_clean_up_removes_what_it_left(tmp_path):
    """The benchmark's SpecForge pass against a stand-in that answers every prompt of SpecForge's
    capture calls with its retryable form (the overlay's own ``payloads`` and ``error``: what this
    server answers when its store is full) after putting the prompt's objects (a write whose answer
    failed: what ``discard_external_attempts`` exists for). Each prompt is a named failed capture, the
    pass fails the sink, and the benchmark's clean-up (SpecForge's discard and drain) leaves none of
    the keys that were there."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))
    import online as bench
    from loopback import LoopbackServer

    from eaglepatch import mooncake, overlay

    site = mooncake.ensure_site(Path(sys.executable))
    sys.path.insert(0, str(site))
    from mooncake.store import MooncakeDistributedStore

    pkg = overlay.import_package()
    sf = __import__(pkg.__name__ + ".specforge", fromlist=["payloads"])

    class Refusing(LoopbackServer):
        def __init__(self, store):
            self.store, self.lock, self.put = store, threading.Lock(), []
            outer = self

            class H(BaseHTTPRequestHandler):
                def log_message(self, *a):
                    pass

                def do_POST(self):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    rows = []
                    for p in sf.payloads(body, sf.prompt_lengths(body)):
                        for name in [*p["features"].values(), *(x["name"] for x in p["passthrough"])]:
                            key = sf.object_key(p, name)
                            with outer.lock:
                                assert outer.store.put(key, b"\0" * 64) == 0, key
                                outer.put.append(key)
                        answer = sf.error(p, "the store is full (stand-in)")
                        rows.append({"text": "", "meta_info": {"spec_capture": answer}})
                    raw = json.dumps(rows).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)

            self._serve(H)

    with mooncake.Master(site, tmp_path / "master.log") as master:
        writer = MooncakeDistributedStore()
        assert writer.setup("127.0.0.1", master.metadata, 64 << 20, 16 << 20, "tcp", "", master.address) == 0
        try:
            with Refusing(writer) as srv:
                client = bench.SpecForgeClient(srv.url, master, 64, "cpu", "t", 8)
                prompts = [list(range(3, 3 + n)) for n in (5, 9, 7, 12, 4, 6, 8, 10, 11, 3)]
                got = bench.drive_specforge(client, prompts, time.monotonic() + 60, read=True)
                summ = bench.summary(got["recs"], got["wall_s"], "test")
                bench.Bench.failures(summ, got["errors"], len(prompts))
                assert summ["samples"] == 0 and summ["failed_captures"] == 10 and summ["not_captured"] == 10, summ
                assert all(e.startswith("capture failed") and "the store is full (stand-in)" in e
                           for e in summ["errors"]), summ["errors"]
                assert bench.sink_failed({"online": summ})
                assert len(srv.put) == 50 and all(writer.is_exist(k) == 1 for k in srv.put)
                assert sorted(client.keys) == sorted(srv.put)  # the keys the run looks for are the ones put
                clean = client.close()
            assert "failed" not in clean and clean["discarded"] == 10 and clean["keys_left"] == 0, clean
            assert not any(writer.is_exist(k) == 1 for k in srv.put)
        finally:
            writer.close()
