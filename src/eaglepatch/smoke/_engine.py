"""sglang.Engine checks (run inside the CPU environment by file path).

usage: python _engine.py DEEPSEEK_CKPT KIMI_CKPT WORK_DIR [e,b,c]

e. (last) sglang.Engine and launch_server with the dump on and the radix cache on end at the
   launch check: one line naming the fix, non-zero exit, no traceback, no worker started.

b. DeepSeek-V3 Engine with the dump on: one generate call with several prompts of different
   lengths (batched by the scheduler), one file per request, ids, metadata, each layer and
   `final` equal the HF reference of that request.
c. The same through the Kimi-K2.5 wrapper (text only) with --chunked-prefill-size 64: a prompt
   of exactly one chunk (first, alone in its forward), prompts of several chunks, chunked and
   unchunked prompts in one forward; each file equals the HF reference as b's do.

Engines are started one after the other in this process; each inherits the EAGLE3_DUMP_*
variables present when it starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import _hf
import tinyconfig
from _common import (B_NAME, C_NAME, CPU_SERVER_ARGS, E_ENGINE_NAME, E_LAUNCH_NAME, H_NAME, Dumping, RowCheck, guarded,
                     log, result, server_cli)

LAYERS = [-1, 1, 3]  # 3: the last layer's output before the final norm
TOL = 1e-4
NEW_TOKENS = 3  # > 1: the prefill batch becomes a decode batch (0.5.9 bumps its lengths in place)

ENGINE_ARGS = dict(CPU_SERVER_ARGS, log_level="error")


def request_key(rid) -> str:
    """The dump file key of a request: sha256 of its request id (written here, not imported)."""
    return hashlib.sha256(str(rid).encode("utf-8")).hexdigest()


def prompt_key(ids) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def dumping(directory: Path):
    """The dump variables of an Engine started inside the block; a small pending cap: several
    requests in one forward exceed it, so backpressure is exercised."""
    return Dumping(directory, layers=LAYERS, final=1, max_pending_mb=1)


def start_engine(ckpt: Path, **extra):
    import sglang

    t0 = time.monotonic()
    kw = dict(ENGINE_ARGS, model_path=str(ckpt))
    kw.update(extra)
    engine = sglang.Engine(**kw)
    log("engine for %s started in %.1f s" % (ckpt.name, time.monotonic() - t0))
    return engine


def generate(engine, prompts, new_tokens, rids=None):
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.monotonic()
    out = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sp, rid=rids)
    log("generate %d requests x %d new tokens: %.1f s" % (len(prompts), new_tokens, time.monotonic() - t0))
    return out


def check_dump(name, directory: Path, prompts, refs, arch, ckpt, rids, flushed) -> None:
    """``rids``: each request's id as the responses' meta_info name it; ``flushed``: what the
    Engine's flush returned (every file is on disk when it returns: nothing is waited for)."""
    from safetensors import safe_open

    keys = [request_key(r) for r in rids]
    want = {k: directory / (k + ".safetensors") for k in keys}
    problems = []
    if len(set(keys)) != len(keys):
        problems.append("two requests share a request id: %s" % rids)
    missing = [k[:12] for k, p in want.items() if not p.exists()]
    if missing:
        problems.append("missing %d of %d files right after the flush (%s): %s" % (len(missing), len(keys), flushed, missing))
    names = sorted(p.name for p in directory.iterdir())
    extra = [n for n in names if n not in {k + ".safetensors" for k in keys}]
    if extra:
        problems.append("unexpected files in the dump dir: %s" % extra[:6])
    rc = RowCheck(TOL)
    checked = 0
    for ids, key, ref, rid in zip(prompts, keys, refs, rids):
        path = want[key]
        if not path.exists():
            continue
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        exp_names = {"input_ids", "final"} | {"layer.%d" % k for k in LAYERS}
        if set(tensors) != exp_names:
            problems.append("%s: tensors %s, want %s" % (key[:12], sorted(tensors), sorted(exp_names)))
            continue
        ids_t = tensors["input_ids"]
        if ids_t.dtype != torch.int64 or ids_t.tolist() != list(ids):
            problems.append("%s: input_ids differ from the request (dtype %s, %d tokens)" % (key[:12], ids_t.dtype, ids_t.numel()))
        want_meta = {
            "format": "eagle3-dump/1",
            "key": key,
            "rid": rid,
            "prompt_key": prompt_key(ids),
            "input_source": "input_ids",
            "lora_id": "",
            "mm_hashes": [],
            "eagle3_layer_ids": LAYERS,
            "hf_hidden_state_indices": [k + 1 for k in LAYERS],
            "final": "post_norm",
            "architecture": arch,
            "hidden_size": str(tinyconfig.DEEPSEEK_V3["hidden_size"]),
            "num_hidden_layers": str(tinyconfig.DEEPSEEK_V3["num_hidden_layers"]),
            "dtype": "float32",
            "num_tokens": str(len(ids)),
            "tp_size": "1",
            "model_path": str(ckpt),
        }
        for mk, mv in want_meta.items():
            got = meta.get(mk)
            if isinstance(mv, list):
                try:
                    got = json.loads(got) if got is not None else None
                except ValueError:
                    pass
            if got != mv:
                problems.append("%s: metadata %s=%r, want %r" % (key[:12], mk, got, mv))
        for mk in ("sglang_version", "series_version"):
            if not meta.get(mk):
                problems.append("%s: metadata %s missing" % (key[:12], mk))
        for k in LAYERS:
            t = tensors["layer.%d" % k]
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(ref.stream[k + 1].shape):
                problems.append("%s: layer.%d dtype %s shape %s" % (key[:12], k, t.dtype, tuple(t.shape)))
                continue
            rc.layer(t, ref, k)
        rc.final(tensors["final"], ref)
        checked += 1
    problems += rc.problems()
    detail = ("%d requests (lengths %s, two of them the same prompt) in one generate call of %d new tokens "
              "each; flush %s; %d files checked; layers %s and final: %s"
              % (len(prompts), [len(p) for p in prompts], NEW_TOKENS, flushed, checked, LAYERS, rc.figure()))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(name, not problems, "max abs diff %.2g" % rc.right, detail)


E_NEEDLE = "error: EAGLE3_DUMP_DIR is set but the radix cache is on"
E_FIX = "--disable-radix-cache"
E_MAX_S = 180.0  # a sanity bound: the import of sglang is most of it (16-60 s here)


def _kwargs_radix_on(ckpt: Path) -> dict:
    kw = dict(ENGINE_ARGS, model_path=str(ckpt))
    kw.pop("disable_radix_cache")  # the default: radix cache on
    return kw


def check_e_engine(ckpt: Path, work: Path) -> None:
    """sglang.Engine with the dump on and the radix cache on (its default) ends at the launch
    check: SystemExit with one line naming --disable-radix-cache, before any worker process
    starts, no dump written."""
    import psutil

    directory = work / "dump-refused"
    engine, code = None, None
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    with dumping(directory):
        try:
            engine = __import__("sglang").Engine(**_kwargs_radix_on(ckpt))
        except SystemExit as exc:
            code = exc.code
    wall = time.monotonic() - t0
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    files = sorted(p.name for p in directory.iterdir())
    msg = str(code)
    ok = (engine is None and msg.startswith(E_NEEDLE) and E_FIX in msg and "\n" not in msg
          and not children and not files and wall < E_MAX_S)
    detail = "Engine() raised SystemExit after %.1f s: %r; worker processes started: %d; dump files: %s" % (
        wall, msg[:300], len(children), files[:5])
    if engine is not None:
        detail = "the Engine STARTED with EAGLE3_DUMP_DIR set and the radix cache on; " + detail
        engine.shutdown()
    result(E_ENGINE_NAME, ok, "refused in %.0f s" % wall if ok else "not refused at launch", detail)


def check_e_launch_server(ckpt: Path, work: Path) -> None:
    """python -m sglang.launch_server with the dump on and the radix cache on: a non-zero exit
    and one stderr line naming the fix, no traceback, before any weight loads."""
    import socket
    import subprocess

    directory = work / "dump-refused-server"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(port)] + server_cli(_kwargs_radix_on(ckpt))
    t0 = time.monotonic()
    with dumping(directory):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    wall = time.monotonic() - t0
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    ours = [ln for ln in err if ln.startswith(E_NEEDLE)]
    files = sorted(p.name for p in directory.iterdir())
    loaded = [m for m in ("Load weight", "Loading safetensors", "Memory pool") if m in proc.stderr]
    ok = (proc.returncode != 0 and len(ours) == 1 and E_FIX in ours[0] and "Traceback" not in proc.stderr
          and not files and not loaded and wall < E_MAX_S)
    detail = ("exit %d after %.1f s; the error line: %r; traceback in stderr: %s; weights loading: %s; dump files: %s; "
              "last stderr lines: %s" % (proc.returncode, wall, ours[0][:300] if ours else None,
                                         "Traceback" in proc.stderr, loaded or "no", files[:5], err[-3:]))
    result(E_LAUNCH_NAME, ok, "exit %d in %.0f s" % (proc.returncode, wall), detail)


def _wait_http(url: str, proc, timeout: float) -> bool:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.5)
    return False


def stop_flush(log_text: str, written: int):
    """How a stopped server's log shows its dump was written out: the launcher's stop call (the
    writer drained before SGLang killed the tree), or (a writer that stopped on its own first,
    e.g. the scheduler exiting on the signal) the writer's own drain; None when neither, or when
    either names a request not written or another count of files."""
    import re

    launcher = re.search(r"eagle3 dump: stopped before [^:]*: every request handed to the writer is written "
                         r"\((\d+) written, 0 failed, 0 dropped", log_text)
    if launcher and int(launcher.group(1)) == written:
        return "stopped by the launcher, every file written"
    drained = re.search(r"EAGLE3_DUMP_DIR: [^;]*; drained in [\d.]+ s: (\d+) written, 0 failed, 0 dropped[^\n]*"
                        r"; nothing left unwritten", log_text)
    if drained and int(drained.group(1)) == written and "the writer stopped on its own before" in log_text:
        return "drained by the writer as it stopped on its own"
    return None


def check_h(ckpt: Path, work: Path, prompts, refs) -> None:
    """python -m sglang.launch_server with the dump on, over HTTP: SGLang's warm-up request and
    its health probes write nothing; three generate requests (one with the client's own rid,
    two with the same prompt and SGLang's rids) of several new tokens give three files, named
    by their responses' meta_info ids, == HF; POST /eagle3_dump/flush answers once they are on
    disk; stopping the server (SIGTERM, as a supervisor does) flushes the dump first (its log line)."""
    import shutil
    import signal
    import socket
    import subprocess

    import requests
    from safetensors import safe_open

    directory = work / "dump-http"
    shutil.rmtree(directory, ignore_errors=True)  # a work dir used before must not count
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = "http://127.0.0.1:%d" % port
    kw = dict(ENGINE_ARGS, model_path=str(ckpt), log_level="info")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(port)] + server_cli(kw)
    log_path = work / "launch-server-h.log"
    problems, rc = [], RowCheck(TOL)
    with dumping(directory), open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ),
                                start_new_session=True)
    try:
        if not _wait_http(url + "/health", proc, 600):
            raise RuntimeError("launch_server did not become healthy (exit %s); log tail: %s"
                               % (proc.poll(), log_path.read_text()[-1500:]))
        flush = requests.post(url + "/eagle3_dump/flush", json={"timeout": 60}, timeout=90)
        after_warmup = sorted(p.name for p in directory.iterdir())
        for probe in ("/health_generate", "/health"):
            requests.get(url + probe, timeout=120)
        requests.post(url + "/eagle3_dump/flush", json={}, timeout=90)
        after_probes = sorted(p.name for p in directory.iterdir())
        if flush.status_code != 200 or not flush.json().get("flushed"):
            problems.append("flush after start: HTTP %d %s" % (flush.status_code, flush.text[:200]))
        if after_warmup or after_probes:
            problems.append("files before any user request: %d after the warm-up, %d after /health_generate "
                            "and /health" % (len(after_warmup), len(after_probes)))
        sent = [prompts[0], prompts[1], prompts[1]]
        sp = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        bodies = [{"input_ids": list(sent[0]), "sampling_params": sp, "rid": "smoke-h-own-rid"},
                  {"input_ids": list(sent[1]), "sampling_params": sp},
                  {"input_ids": list(sent[2]), "sampling_params": sp}]
        rids = []
        for body in bodies:
            r = requests.post(url + "/generate", json=body, timeout=300)
            r.raise_for_status()
            rids.append(r.json()["meta_info"]["id"])
        t0 = time.monotonic()
        flush = requests.post(url + "/eagle3_dump/flush", json={"timeout": 60}, timeout=90)
        flush_s = time.monotonic() - t0
        counts = flush.json() if flush.status_code == 200 else {}
        names = sorted(p.name for p in directory.iterdir())
        want = sorted(request_key(r) + ".safetensors" for r in rids)
        if rids[0] != "smoke-h-own-rid":
            problems.append("meta_info id %r, want the rid the client sent" % rids[0])
        if names != want:
            problems.append("files %s after the flush, want one per request %s" % ([n[:12] for n in names], rids))
        for ids, rid in zip(sent, rids):
            path = directory / (request_key(rid) + ".safetensors")
            if not path.exists():
                continue
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("rid") != rid or f.get_tensor("input_ids").tolist() != list(ids):
                    problems.append("%s: rid %r / ids differ from the request" % (rid, meta.get("rid")))
                ref = refs[prompts.index(ids)]
                for k in LAYERS:
                    rc.layer(f.get_tensor("layer.%d" % k), ref, k)
                rc.final(f.get_tensor("final"), ref)
        problems += rc.problems()
    finally:
        if proc.poll() is None:  # a supervisor's stop: SIGTERM to the server process
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_path.read_text()
    stop = stop_flush(text, len(rids))
    if stop is None:
        problems.append("no flush logged when the server stopped; log tail: %s" % text[-600:])
    detail = ("warm-up + probes: %d files; 3 requests x %d new tokens -> %d files; flush %.2f s %s; at the stop: %s; "
              "layers %s and final: %s" % (len(after_probes), NEW_TOKENS, len(names), flush_s, counts, stop, LAYERS,
                                           rc.figure()))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(H_NAME, not problems, "max abs diff %.2g" % rc.right, detail)


CHUNK = 64  # --chunked-prefill-size of check f: below most prompt lengths


def chunk_order(prompts):
    """Check f's prompts: the one exactly CHUNK long first (alone in the first forward, so it
    is prefilled in exactly one chunk), then the rest (several per forward, chunked and not)."""
    exact = [p for p in prompts if len(p) == CHUNK]
    return exact + [p for p in prompts if len(p) != CHUNK]


def main() -> int:
    ds_ckpt, kimi_ckpt, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    which = sys.argv[4].split(",") if len(sys.argv) > 4 else ["b", "c", "h", "e"]
    work.mkdir(parents=True, exist_ok=True)
    prompts = tinyconfig.prompts()
    refs = None
    if set(which) & {"b", "c", "h"}:
        log("HF reference for %d prompts" % len(prompts))
        ref = _hf.Reference(ds_ckpt)
        refs = [ref.run(p) for p in prompts]
        del ref

    def dump_check(name, ckpt, architecture, subdir, order=None, **engine_kw):
        """One Engine with the dump on: generate, then compare every file with HF."""

        @guarded(name)
        def run():
            directory = work / subdir
            sent = order(prompts) if order else prompts
            sent = sent + [sent[-1]]  # the same prompt twice in one call: two requests, two files
            sent_refs = [refs[prompts.index(p)] for p in sent]
            # the client's own request ids: the same files (names and metadata) in every run, so two
            # runs' dumps compare byte for byte (tests/test_plugin.py: series against plugin)
            rids = ["smoke-%s-%d" % (subdir, i) for i in range(len(sent))]
            with dumping(directory):
                engine = start_engine(ckpt, **engine_kw)
            try:
                out = generate(engine, sent, NEW_TOKENS, rids)
                flushed = engine.flush_eagle3_dump(timeout=120)
                rids = [o["meta_info"]["id"] for o in out]
                check_dump(name, directory, sent, sent_refs, architecture, ckpt, rids, flushed)
            finally:
                engine.shutdown()

        run()

    if "b" in which:
        dump_check(B_NAME, ds_ckpt, "DeepseekV3ForCausalLM", "dump-deepseek")
    if "c" in which:
        assert any(len(p) == CHUNK for p in prompts) and sum(len(p) > CHUNK for p in prompts) >= 3
        dump_check(C_NAME, kimi_ckpt, "KimiK25ForConditionalGeneration", "dump-kimi", order=chunk_order,
                   enable_multimodal=False, chunked_prefill_size=CHUNK)
    if "h" in which:
        guarded(H_NAME)(check_h)(ds_ckpt, work, prompts, refs)
    if "e" in which:
        # last: a failed start leaves this process in a state not worth reusing
        log("starting an Engine and launch_server with the dump on and the radix cache on (must be refused)")
        guarded(E_ENGINE_NAME)(check_e_engine)(ds_ckpt, work)
        guarded(E_LAUNCH_NAME)(check_e_launch_server)(ds_ckpt, work)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on threads a failed Engine start may have left behind
