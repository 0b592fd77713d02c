"""One sglang.Engine for the GPU check, in its own process (``python -m eaglepatch.gpucheck.worker SPEC OUT``).

SPEC (JSON): ``engine`` (sglang.Engine keyword arguments), ``runs`` (each ``name``, ``prompts``
(token id lists), ``max_new_tokens``, optional ``rids``: one generate call, greedy), optional
``bench`` (prefill and decode throughput, see ``bench``), optional ``flush`` ({"dir",
"timeout_s"}: ``engine.flush_eagle3_dump`` after the runs, then the shutdown, then the files in
``dir`` are counted: what a flush-then-shutdown leaves). OUT (JSON): ``ok``, ``error``, ``sglang``
(version, file), ``start_s``, per run ``output_ids``, ``rids`` (each response's meta_info id) and
``wall_s``, ``bench``, ``flush``. Progress goes to stderr.
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


def generate(engine, prompts, new_tokens, rids=None, with_rids=False):
    kw = {"rid": list(rids)} if rids else {}
    out = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=_greedy(new_tokens), **kw)
    if isinstance(out, dict):
        out = [out]
    ids, got = [], []
    for o in out:
        if "output_ids" not in o:
            raise RuntimeError("generate returned no output_ids (keys %s)" % sorted(o))
        ids.append([int(t) for t in o["output_ids"]])
        got.append(o.get("meta_info", {}).get("id"))
    if rids and got != list(rids):
        raise RuntimeError("responses name request ids %s, sent %s" % (got[:4], list(rids)[:4]))
    return (ids, got) if with_rids else ids


def flush_dump(engine, timeout_s: float = 300) -> dict:
    """The series' flush: every request prefilled so far is on disk when it returns."""
    t = time.monotonic()
    counts = engine.flush_eagle3_dump(timeout=timeout_s)
    return {"s": round(time.monotonic() - t, 3), "counts": counts}


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
            flush_dump(engine)
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
            res["drain_s"] = flush_dump(engine)["s"]
            files = list(Path(spec["dump_dir"]).glob("*.safetensors"))
            res["files"] = len(files)
            res["bytes"] = sum(f.stat().st_size for f in files)  # every file holds p["tokens"] prompt rows
            res["bytes_per_token"] = res["bytes"] / max(len(files) * p["tokens"], 1)
            for f in files:
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


class HttpServer:
    """``python -m sglang.launch_server`` with the spec's engine arguments, driven over HTTP the
    way a client does (/generate, the series' /eagle3_dump/flush); stopped with SIGTERM."""

    def __init__(self, kwargs: dict, log_path: Path):
        import socket
        import subprocess

        from eaglepatch.smoke._common import server_cli

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = "http://127.0.0.1:%d" % self.port
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(self.port)] + server_cli(kwargs)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        import requests

        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("launch_server exited %s; see %s" % (self.proc.returncode, log_path))
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError("launch_server was not healthy within 400 s")

    def generate(self, prompts, rids, new_tokens):
        import requests

        body = {"input_ids": [list(p) for p in prompts], "rid": list(rids), "sampling_params": _greedy(new_tokens)}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        got = [o["meta_info"]["id"] for o in out]
        if got != list(rids):
            raise RuntimeError("responses name request ids %s, sent %s" % (got[:4], list(rids)[:4]))
        return [[int(t) for t in o["output_ids"]] for o in out], got

    def flush(self, timeout_s):
        import requests

        t = time.monotonic()
        r = requests.post(self.url + "/eagle3_dump/flush", json={"timeout": timeout_s}, timeout=timeout_s + 30)
        if r.status_code != 200:
            raise RuntimeError("flush: HTTP %d %s" % (r.status_code, r.text[:300]))
        return {"s": round(time.monotonic() - t, 3), "counts": r.json()}

    def stop(self):
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def main_http(spec: dict, result: dict, out_path: Path) -> None:
    """The spec's runs through launch_server over HTTP: the flush endpoint after every run but
    the last; after the last, the stop (SIGTERM) with no flush asked for, as a supervisor stops a
    server: the files counted after it exited show whether the stop lost any."""
    t = time.monotonic()
    server = HttpServer(spec["engine"], out_path.with_name("launch_server.log"))
    result["start_s"] = round(time.monotonic() - t, 1)
    f = spec.get("flush")
    runs = spec.get("runs", [])
    try:
        for k, run in enumerate(runs):
            t = time.monotonic()
            ids, rids = server.generate(run["prompts"], run["rids"], run["max_new_tokens"])
            result["runs"].append({"name": run["name"], "output_ids": ids, "rids": rids,
                                   "wall_s": round(time.monotonic() - t, 3)})
            if f and k < len(runs) - 1:
                result["flush"] = server.flush(f.get("timeout_s", 300))
                result["flush"]["files_at_flush"] = len(list(Path(f["dir"]).glob("*.safetensors")))
                result["flush"]["requests_at_flush"] = sum(len(r["prompts"]) for r in runs[:k + 1])
    finally:
        t = time.monotonic()
        result["stop_rc"] = server.stop()
        result["stop_s"] = round(time.monotonic() - t, 1)
    if f:
        result.setdefault("flush", {})["files_after_shutdown"] = len(list(Path(f["dir"]).glob("*.safetensors")))
        result["flush"]["stop_without_flush"] = True


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
        if spec.get("http"):
            main_http(spec, result, out_path)
            result["ok"] = True
            return 0
        t = time.monotonic()
        engine = sglang.Engine(**spec["engine"])
        result["start_s"] = round(time.monotonic() - t, 1)
        say("engine started in %.1f s" % result["start_s"])
        flush()
        for run in spec.get("runs", []):
            t = time.monotonic()
            ids, rids = generate(engine, run["prompts"], run["max_new_tokens"], run.get("rids"), with_rids=True)
            wall = time.monotonic() - t
            result["runs"].append({"name": run["name"], "output_ids": ids, "rids": rids, "wall_s": round(wall, 3)})
            say("run %s: %d requests in %.2f s" % (run["name"], len(ids), wall))
            flush()
        if spec.get("bench"):
            result["bench"] = bench(engine, spec["bench"])
        f = spec.get("flush")
        if f:
            result["flush"] = flush_dump(engine, f.get("timeout_s", 300))
            result["flush"]["files_at_flush"] = len(list(Path(f["dir"]).glob("*.safetensors")))
            say("flush: %s" % result["flush"])
            engine.shutdown()
            engine = None
            result["flush"]["files_after_shutdown"] = len(list(Path(f["dir"]).glob("*.safetensors")))
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
