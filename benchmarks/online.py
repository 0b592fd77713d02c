#!/usr/bin/env python3
"""Online against offline: the same requests through the Mooncake sink, SpecForge's capture protocol
and the file sink, one run.

  python3 benchmarks/online.py --cpu --out online.json                         # CPU smoke (demo model)
  sh .gpu-extra/mooncake/unpack.sh /tmp/mc && . /tmp/mc/env.sh && \\
    PYTHONPATH=$PYTHONPATH:/tmp/site:src python3 benchmarks/online.py --mooncake-site /tmp/mc --out $OUT/online.json
  python3 benchmarks/online.py --cpu --sinks file,specforge --out online.json  # some of the sinks

For each sink one patched server is started as a user starts it (``tools/serve.py``; on the GPU a
DeepSeek-V3-wide target, hidden 7168, 4 layers, dummy weights; the dump holds the outputs of layers
0, 1, 2 and the final state: 4 states a token), warmed up untimed, then driven by the same seeded
requests (random ids, ShareGPT-like lengths, ``max_new_tokens`` 1, ``--concurrency`` in flight).
The ``specforge`` server is the ``mooncake`` one started with ``--specforge-ids 0,1,2`` and driven by
SpecForge 0.2.0's own client classes (its online capture protocol, docs/online.md "Online with
SpecForge"): ``SGLangServerCaptureAdapter.produce_refs`` with the EAGLE-3 schema sends one
``/generate`` per batch of SpecForge's default lease (8 prompts, ``max_new_tokens`` 0), ``--concurrency``
/ 8 batches in flight (at least 1); its ``MooncakeFeatureStore`` reads the objects the server put
(``aux`` [1, L, 3H] = layers 0-2, ``last_hidden`` [1, L, H] = the final state: the same 4 states a
token, plus the int64 ``input_ids``, ``loss_mask`` and ``attention_mask`` it passes through).

- ``produce``: every request sent, nothing read; the clock runs from the first request to the
  flush's return (every object in the store, every file durable); ``specforge``: to the last batch's
  answer (an answer comes only once every object of its batch is in the store; the flush after it is
  not timed): samples/s, tokens/s, GB/s and bytes per token into the sink;
- ``consume``: the produce pass's samples read back as a trainer's loader reads them, one thread:
  Mooncake ``StoreReader.tensors(handle, delete=True)``, file ``safetensors`` load and unlink,
  SpecForge ``MooncakeFeatureStore.get(ref)``, ``release`` and ``abort`` (its delete), and after every
  8 samples its ``drain_sample_removals`` (the remove its trainer runs at an optimizer step: an
  ``abort`` right after its ``get`` leaves the objects in the store, the read's lease refusing the
  remove; in the clock, so that every sink's samples are gone from it when the clock stops); each
  sample's tensors moved to the GPU (on CPU: left where they are): the reader's rate into a
  training loop;
- ``online``: other requests of the same lengths, each answer's states read, moved and deleted as
  soon as its handle comes (``specforge``: each batch's refs, as soon as the batch answers, then the
  batch's ``drain_sample_removals``; a trainer fed straight from the server): tokens/s end to end,
  first request to last sample on the device.

``--repeats N`` runs the three passes N times on each server; the JSON keeps every repetition
and, per pass, the median one with the min, and the Mooncake/file and SpecForge/file ratios of
repetition i against repetition i (min, median, all). A flush that counts a failed write, or a
capture SpecForge's adapter answers as failed (``ServerCaptureFailure``), fails the run. After its
passes the ``specforge`` sink runs SpecForge's ``discard_external_attempts()`` and
``drain_pending_removals()`` and then looks for every key the run sent with a fresh store client:
one left fails the run. ``--sinks`` takes a comma list of file, mooncake, specforge; the default is
all three when SpecForge's package imports, else file and mooncake (said in one stderr line and in
the JSON's ``sinks_left_out``). Exit: 0 done; 1 a sink's server or a pass failed (named in the
JSON); 2 usage error (one line, nothing written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "src", REPO / "benchmarks", REPO / "tests" / "extract_fixtures"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import peers  # noqa: E402  (the side-by-side benchmark's server helpers)
from eaglepatch.errors import UsageError  # noqa: E402

SINKS = ("file", "mooncake", "specforge")
STORE_SINKS = ("mooncake", "specforge")  # the sinks whose server writes into a Mooncake master's store
PASSES = ("produce", "consume", "online")
SPECFORGE_IDS = tuple(k - 1 for k in peers.AUX_HF)  # SpecForge's aux ids (output of layer k): 0, 1, 2
SPECFORGE_FAMILY = "eagle3"  # the schema its adapter sends: aux + last_hidden + input_ids, loss_mask, attention_mask
PROFILES = {
    "cpu": dict(requests=24, min_len=24, max_len=600, median=110, sigma=0.8, concurrency=4, warm_s=3.0,
                pass_s=120.0, segment_mb=1024, buffer_mb=256, budget_s=900.0),
    "gpu": dict(requests=400, min_len=100, max_len=4000, median=350, sigma=0.8, concurrency=32, warm_s=30.0,
                pass_s=60.0, segment_mb=24576, buffer_mb=2048, budget_s=500.0),
}
T0 = time.monotonic()


def say(msg: str) -> None:
    print("[online %5.0fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


def lengths(n: int, prof: dict, seed: int) -> list:
    rng = random.Random(seed)
    return [int(min(prof["max_len"], max(prof["min_len"], round(rng.lognormvariate(math.log(prof["median"]),
                                                                               prof["sigma"])))))
            for _ in range(n)]


def prompts(lens: list, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def pct(xs: list, q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


class Consumer:
    """Reads one answer's states from its sink, moves them to the device, deletes them."""

    def __init__(self, sink: str, dumps: Path, device: str, master=None):
        self.sink, self.dumps, self.device = sink, dumps, device
        self.reader = None
        if sink == "mooncake":
            from eaglepatch.mooncake import StoreReader

            self.reader = StoreReader(master.address, master.metadata)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def read(self, handle: dict, timeout: float = 120.0) -> tuple:
        """(bytes, seconds) of one sample read onto the device and deleted from the sink."""
        t = time.monotonic()
        if self.sink == "mooncake":
            tensors, meta = self.reader.tensors(handle, timeout=timeout, delete=True)
        else:
            from safetensors.torch import load_file

            path = self.dumps / handle["file"]
            deadline = time.monotonic() + timeout
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise RuntimeError("no dump file %s after %.0f s (state %s)" % (path, timeout, handle.get("state")))
                time.sleep(0.005)
            tensors = load_file(str(path))
            path.unlink()
        return to_device(tensors, self.device), time.monotonic() - t


def to_device(tensors: dict, device: str) -> int:
    """Move one sample's tensors to ``device`` as a training loop does (on CPU: left where they
    are); their bytes."""
    import torch

    nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    if device != "cpu":
        moved = [v.to(device, non_blocking=True) for v in tensors.values()]
        torch.cuda.synchronize()
        assert sum(v.numel() * v.element_size() for v in moved) == nbytes
    return nbytes


def specforge_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("specforge")
    except md.PackageNotFoundError:
        return None


def specforge_missing() -> str | None:
    """Why SpecForge's client classes (its capture adapter, its Mooncake feature store) do not
    import here; None when they do."""
    import importlib

    try:
        for mod in ("specforge.inference.adapters.server_capture", "specforge.runtime.data_plane.mooncake_store",
                    "specforge.launch"):
            importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the reason, in one line
        return "%s: %s" % (type(exc).__name__, " ".join(str(exc).split())[:200])
    return None


class SpecForgeClient:
    """SpecForge 0.2.0's own client side of its online capture protocol, as its online run builds
    it: ``SGLangServerCaptureAdapter`` (EAGLE-3 schema) sends each batch of prompts and turns the
    answers into refs; ``MooncakeFeatureStore`` (lending the store no memory) reads each ref's
    objects, ``release`` and ``abort`` delete them. Every key a request named is remembered, to be
    looked for once the run has cleaned up."""

    def __init__(self, url: str, master, hidden: int, device: str, tag: str, concurrency: int):
        import inspect

        from specforge.algorithms.builtin import builtin_algorithm_registry
        from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
        from specforge.inference.capture import CaptureConfig
        from specforge.launch import build_disagg_online_producer
        from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

        self.master, self.device = master, device
        # SpecForge's default lease: the prompts one capture call of its online producer carries
        self.lease = inspect.signature(build_disagg_online_producer).parameters["lease"].default
        self.inflight = max(1, concurrency // self.lease)  # capture calls in flight: --concurrency prompts
        self.run_id = "online-" + tag
        self.store = MooncakeFeatureStore(store_id="bench-" + tag, retain_on_release=True, setup_kwargs={
            "local_hostname": "127.0.0.1", "metadata_server": master.metadata, "master_server_addr": master.address,
            "protocol": "tcp", "rdma_devices": "", "global_segment_size": 0, "local_buffer_size": 64 << 20})
        reg = builtin_algorithm_registry().resolve(SPECFORGE_FAMILY)
        lay = reg.providers.server_streaming_for("text").layout
        schema = ServerCaptureSchema(aux_feature=lay.aux_feature, last_hidden_feature=lay.last_hidden_feature,
                                     passthrough=lay.passthrough, attention_mask_feature=lay.attention_mask_feature)
        self.names = [n for n in (lay.aux_feature, lay.last_hidden_feature, *(x[0] for x in lay.passthrough),
                                  lay.attention_mask_feature) if n]
        self.adapter = SGLangServerCaptureAdapter(url, self.store, run_id=self.run_id, algorithm=SPECFORGE_FAMILY,
                                                  schema=schema, timeout_s=600.0)
        self.capture = CaptureConfig.from_strategy(
            reg.spec.feature_contract("streaming", "text").required_tensors, aux_hidden_state_layer_ids=SPECFORGE_IDS,
            target_repr="hidden_state" if lay.last_hidden_feature else None, target_hidden_size=hidden)
        self.keys: list = []  # every object key a request asked for
        self._lock = threading.Lock()
        self._n = 0

    def produce(self, batch: list) -> tuple:
        """(refs or ServerCaptureFailure per prompt, in order; seconds): one capture call."""
        from specforge.runtime.contracts import PromptTask

        with self._lock:
            first, self._n = self._n, self._n + len(batch)
        tasks = [PromptTask(task_id="t%06d" % (first + i), run_id=self.run_id, source_id="online-bench",
                            payload={"input_ids": ids, "loss_mask": [1] * len(ids)}, max_length=len(ids))
                 for i, ids in enumerate(batch)]
        with self._lock:
            self.keys += [self.store._tkey("%s:%s" % (self.run_id, t.task_id), 1, n)  # SpecForge's own key layout
                          for t in tasks for n in self.names]
        t = time.monotonic()
        refs = self.adapter.produce_refs(tasks, capture=self.capture)
        return refs, time.monotonic() - t

    def read(self, ref) -> tuple:
        """(bytes, seconds) of one ref read onto the device and deleted (release, abort: the objects
        are gone for SpecForge at once, from the store once ``reclaim`` has run)."""
        t = time.monotonic()
        tensors, handle = self.store.get(ref)
        nbytes = to_device(tensors, self.device)
        self.store.release(handle)
        self.store.abort(ref.sample_id)
        return nbytes, time.monotonic() - t

    def reclaim(self, sample_ids: list) -> float:
        """Seconds to remove the objects of ``sample_ids`` from the store: SpecForge's
        ``drain_sample_removals``, which its trainer runs at each optimizer step (an ``abort`` right
        after a ``get`` only marks them: the read's lease makes the master refuse the remove)."""
        t = time.monotonic()
        self.store.drain_sample_removals(sample_ids)
        return time.monotonic() - t

    def close(self) -> dict:
        """SpecForge's terminal clean-up (``discard_external_attempts``, ``drain_pending_removals``),
        then every key the run asked for looked for with a fresh client: what is left."""
        from eaglepatch.mooncake import StoreReader

        out: dict = {"release_pending_before": self.store.health()["release_pending"]}
        for what, call in (("discarded", self.store.discard_external_attempts),
                           ("drain", self.store.drain_pending_removals)):
            try:
                out[what] = call()
            except Exception as exc:  # noqa: BLE001 - named in the result, fails the sink
                out["failed"] = "%s: %s: %s" % (what, type(exc).__name__, str(exc)[:300])
        try:
            reader = StoreReader(self.master.address, self.master.metadata)
            try:
                left = [k for k in self.keys if reader.store.is_exist(k) != 0]  # 1 there, < 0 no answer
            finally:
                reader.close()
        except Exception as exc:  # noqa: BLE001 - named in the result, fails the sink
            out["failed"] = "the keys could not be looked for: %s: %s" % (type(exc).__name__, str(exc)[:300])
            left = None
        finally:
            # SpecForge keeps its store's client for the life of its process; this one ends with its master
            self.store._store.close()
        if left is not None:
            out.update(keys=len(self.keys), keys_left=len(left), keys_left_first=left[:5])
            if left:
                out["failed"] = "%d of the run's %d keys are still in the store (first %s)" % (
                    len(left), len(self.keys), left[0])
        return out


def capture_errors(batch: list, refs) -> list:
    """One line per prompt of ``batch`` that SpecForge's adapter answered with a ServerCaptureFailure."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    return ["capture failed (%d tokens): %s: %s" % (len(ids), r.task_id, str(r.reason)[:300])
            for ids, r in zip(batch, refs) if isinstance(r, ServerCaptureFailure)]


def drive_specforge(client: SpecForgeClient, prompts_: list, deadline: float, read: bool) -> dict:
    """Send ``prompts_`` through SpecForge's adapter in batches of its lease, ``client.inflight``
    batches at once; with ``read`` each batch's refs are read, moved and deleted as soon as it
    answers, and then removed from the store (``reclaim``). Returns per-sample records (with the
    ref) like ``drive``."""
    recs, errors, reclaim_s = [], [], []
    t0 = time.monotonic()
    batches = [prompts_[i:i + client.lease] for i in range(0, len(prompts_), client.lease)]

    def one(batch):
        if time.monotonic() > deadline:
            return
        try:
            refs, answer_s = client.produce(batch)
        except Exception as exc:  # noqa: BLE001 - the whole batch, counted and named
            errors.append("batch of %d: %s: %s" % (len(batch), type(exc).__name__, str(exc)[:300]))
            return
        errors.extend(capture_errors(batch, refs))
        mine = []
        for ids, ref in zip(batch, refs):
            if not hasattr(ref, "sample_id"):
                continue
            rec = {"tokens": len(ids), "answer_s": answer_s, "ref": ref}
            if read:
                try:
                    rec["bytes"], rec["read_s"] = client.read(ref)
                except Exception as exc:  # noqa: BLE001 - counted and named
                    errors.append("read %s: %s: %s" % (ref.sample_id, type(exc).__name__, str(exc)[:300]))
                    continue
            mine.append(rec)
        if read and mine:
            try:
                reclaim_s.append(client.reclaim([r["ref"].sample_id for r in mine]))
            except Exception as exc:  # noqa: BLE001 - counted and named
                errors.append("reclaim: %s: %s" % (type(exc).__name__, str(exc)[:300]))
                return
        for rec in mine:
            rec["done"] = time.monotonic() - t0
        recs.extend(mine)

    with ThreadPoolExecutor(client.inflight) as pool:
        list(pool.map(one, batches))
    return {"recs": recs, "errors": errors, "wall_s": time.monotonic() - t0, "reclaim_s": round(sum(reclaim_s), 3)}


def drive(url: str, batch: list, concurrency: int, deadline: float, consumer: Consumer | None) -> dict:
    """Send ``batch`` (id lists) with ``concurrency`` in flight; with ``consumer`` each answer's
    states are read and deleted as soon as it comes. Returns per-request records."""
    import requests

    local = threading.local()
    recs, errors = [], []
    t0 = time.monotonic()

    def one(ids):
        if time.monotonic() > deadline:
            return
        s = getattr(local, "s", None) or requests.Session()
        local.s = s
        t = time.monotonic()
        try:
            r = s.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1,
                                                                                      "temperature": 0}}, timeout=600)
            r.raise_for_status()
            meta = r.json()["meta_info"]
            handle = meta["eagle3_dump"]
            rec = {"tokens": len(ids), "answer_s": time.monotonic() - t, "handle": handle}
            if consumer is not None:
                rec["bytes"], rec["read_s"] = consumer.read(handle)
            rec["done"] = time.monotonic() - t0
            recs.append(rec)
        except Exception as exc:  # noqa: BLE001 - counted and named in the result
            errors.append("%s: %s" % (type(exc).__name__, str(exc)[:300]))

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, batch))
    return {"recs": recs, "errors": errors, "wall_s": time.monotonic() - t0}


def notable(log: Path, n: int = 30) -> list:
    """The server log's lines about failed or refused writes and errors (the last ``n``), kept in the
    result: a device call returns only a few files."""
    import re

    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    pat = re.compile(r"(fail|refus|error|Error|Traceback|EAGLE3_DUMP|eagle3)", re.I)
    return [x[:400] for x in lines if pat.search(x) and "metadata_plugin" not in x and '" 200 OK' not in x][-n:]


def flush(url: str) -> dict:
    import requests

    r = requests.post(url + "/eagle3_dump/flush", json={}, timeout=600)
    r.raise_for_status()
    return r.json()


def sink_failed(res: dict) -> bool:
    """Whether a sink's result fails the run: its server did not start, a flush counted a failed
    write, a pass lost a request (a failed capture, call or read), or SpecForge's clean-up failed."""
    return bool("failed" in res or (res.get("online_flush") or {}).get("failed")
                or (res.get("cleanup") or {}).get("failed") or any(res.get(ps, {}).get("errors") for ps in PASSES))


def summary(recs: list, wall: float, what: str) -> dict:
    tok = sum(r["tokens"] for r in recs)
    by = sum(r.get("bytes", 0) for r in recs)
    out = {"samples": len(recs), "tokens": tok, "wall_s": round(wall, 3), "clock": what,
           "samples_per_s": round(len(recs) / wall, 2) if wall > 0 else None,
           "tokens_per_s": round(tok / wall, 1) if wall > 0 else None,
           "answer_s_p50": pct([r["answer_s"] for r in recs if "answer_s" in r], 0.5),
           "answer_s_p99": pct([r["answer_s"] for r in recs if "answer_s" in r], 0.99)}
    if by:
        out.update(bytes=by, bytes_per_token=round(by / max(tok, 1), 1), gb_per_s=round(by / wall / 1e9, 3),
                   read_s_p50=pct([r["read_s"] for r in recs if "read_s" in r], 0.5),
                   read_s_p99=pct([r["read_s"] for r in recs if "read_s" in r], 0.99))
    return out


class Bench:
    def __init__(self, a, prof: dict):
        self.a, self.prof = a, prof
        self.gpu = not a.cpu
        self.work = Path(a.work).absolute() if a.work else Path(tempfile.mkdtemp(prefix="eaglepatch-online-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.device = "cuda" if self.gpu else "cpu"
        # the peers benchmark's driver lends its server plumbing (flags, environment, patched files)
        ns = argparse.Namespace(cpu=a.cpu, work=str(self.work), model=str(self.work / "model"), site=a.site,
                                patched_files=a.patched_files, warm_s=0, budget_s=a.budget_s, method_s=None,
                                conversations=None, mooncake_site=a.mooncake_site)
        self.run = peers.Run(ns, peers.PROFILES["cpu" if a.cpu else "gpu"])
        self.result = {"profile": "cpu" if a.cpu else "gpu", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "sinks": {}}

    def prepare(self) -> None:
        r = self.run
        if self.gpu:
            from eaglepatch.gpucheck import models
            from eaglepatch.gpucheck.reference import write_config_only
            from eaglepatch.serve import tinychat

            cfg = dict(models.THROUGHPUT_MODEL, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
            r.model = write_config_only(self.work / "model", cfg)
            r.tokenizer = self.work / "tokenizer"
            if not (r.tokenizer / "tokenizer_config.json").is_file():
                tinychat.build_tokenizer(r.tokenizer, vocab_size=cfg["vocab_size"])
            r.release = r.site_release()
            self.vocab, self.hidden = cfg["vocab_size"], cfg["hidden_size"]
        else:
            r.prepare()  # the CPU demo (model, tokenizer, patched tree) and its conversations
            self.vocab, self.hidden = r.vocab, r.hidden
        n = self.a.requests or self.prof["requests"]
        self.batches = {"produce": prompts(lengths(n, self.prof, 11), self.vocab, 12),
                        "online": prompts(lengths(n, self.prof, 21), self.vocab, 22)}
        self.result["requests"] = {k: {"count": len(v), "tokens": sum(map(len, v)),
                                       "min": min(map(len, v)), "median": sorted(map(len, v))[len(v) // 2],
                                       "max": max(map(len, v))} for k, v in self.batches.items()}
        self.result["server"] = "patched sglang %s (tools/serve.py), dump layers %s and the final state" % (
            r.release, ",".join(map(str, r.dump_ids(r.release))))
        say("requests per pass: %d (%d tokens in produce, %d in online)" % (
            n, self.result["requests"]["produce"]["tokens"], self.result["requests"]["online"]["tokens"]))

    def serve_cmd(self, sink: str, port: int, dumps: Path, master) -> list:
        r = self.run
        ids = r.dump_ids(r.release)
        cmd = [sys.executable, REPO / "tools" / "serve.py"]
        if self.gpu:
            from eaglepatch.gpucheck.patched_files import lay_patched_files

            files = Path(self.a.patched_files or REPO / ".gpu-patched")
            pp = lay_patched_files(files, r.site, self.work / "patched")
            cmd += ["--model-path", r.model, "--dump-dir", dumps, "--layers=" + ",".join(map(str, ids)),
                    "--sglang", pp, "--series", REPO / "patches" / ("sglang-" + r.release), "--port", port,
                    "--python", sys.executable]
        else:
            cmd += ["--cpu-demo", self.work / "demo", "--layers=" + ",".join(map(str, ids)), "--port", port]
        if sink in STORE_SINKS:
            cmd += ["--sink", "mooncake", "--mooncake-master", master.address, "--mooncake-metadata", master.metadata,
                    "--mooncake-segment-mb", self.prof["segment_mb"], "--mooncake-buffer-mb", self.prof["buffer_mb"],
                    "--mooncake-ttl-s", 3600]
        if sink == "specforge":
            cmd += ["--specforge-ids", ",".join(map(str, SPECFORGE_IDS))]
        if self.gpu:
            cmd += ["--", "--tokenizer-path", r.tokenizer, "--load-format", "dummy", *r.gpu_engine_flags()]
        return [str(c) for c in cmd]

    def sink(self, sink: str) -> dict:
        import cpuserver

        from eaglepatch import mooncake

        r = self.run
        d = self.work / sink
        d.mkdir(exist_ok=True)
        dumps = (self.work / "dumps-gpu") if self.gpu else (self.work / "demo" / "dumps")
        master = None
        env = r.base_env()
        if sink in STORE_SINKS:
            site = self.run.mooncake_site()
            env = mooncake.with_site(env, site)
            if str(site) not in sys.path:  # once, for the first sink of the store
                os.environ["PYTHONPATH"] = os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]]
                                                                           if os.environ.get("PYTHONPATH") else []))
                sys.path.insert(0, str(site))
            master = mooncake.Master(site, d / "master.log").start()
        port = cpuserver.free_port()
        url = "http://127.0.0.1:%d" % port
        log = d / "server.log"
        p = peers.start(self.serve_cmd(sink, port, dumps, master), log, env=env)
        res: dict = {}
        self.result["sinks"][sink] = res  # written after each pass: a call cut short keeps what it measured
        consumer = None
        try:
            try:
                res["server_startup_s"] = round(peers.wait_http(p, url, log, r.wait_s()), 1)
            except Exception:  # noqa: BLE001 - named in the result
                return {"failed": "the %s-sink server did not start: %s" % (sink, peers.log_tail(log, 3)), "log": str(log)}
            say("%s: server ready in %.0f s" % (sink, res["server_startup_s"]))
            conc = self.a.concurrency or self.prof["concurrency"]
            if sink == "specforge":
                consumer = sf = SpecForgeClient(url, master, self.hidden, self.device, "%d-%d" % (os.getpid(), port),
                                                conc)
                res["client"] = {"specforge": specforge_version(), "schema": SPECFORGE_FAMILY,
                                 "aux_layer_ids": list(SPECFORGE_IDS), "prompts_per_call": sf.lease,
                                 "calls_in_flight": sf.inflight, "store_id": sf.store.store_id}
                res["warmup"] = self.warm(sf.lease * sf.inflight, lambda b, dl: drive_specforge(sf, b, dl, read=True))
            else:
                consumer = Consumer(sink, dumps, self.device, master)
                res["warmup"] = self.warm(conc, lambda b, dl: drive(url, b, conc, dl, consumer))
            repeats = self.a.repeats or 1
            res["repeats"] = []
            for i in range(repeats):
                rep: dict = {}
                res["repeats"].append(rep)
                who = "%s (repetition %d of %d)" % (sink, i + 1, repeats)
                if sink == "specforge":
                    self.passes_specforge(url, consumer, rep, who)
                else:
                    self.passes(sink, url, consumer, rep, who)
            for ps in PASSES:  # the repetition of median tokens/s, with the min, median and all of them
                reps = [r[ps] for r in res["repeats"] if r.get(ps, {}).get("tokens_per_s")]
                if not reps:
                    continue
                reps_sorted = sorted(reps, key=lambda x: x["tokens_per_s"])
                res[ps] = dict(reps_sorted[(len(reps_sorted) - 1) // 2])
                res[ps].update(tokens_per_s_min=reps_sorted[0]["tokens_per_s"],
                               tokens_per_s_all=[x["tokens_per_s"] for x in reps],
                               errors=[e for r in res["repeats"] for e in r.get(ps, {}).get("errors", [])][:5],
                               repetitions=len(reps))
            res["produce_flush"] = res["repeats"][-1].get("produce_flush")
            res["online_flush"] = res["repeats"][-1].get("online_flush")
            self.write()
        finally:
            if isinstance(consumer, SpecForgeClient):  # SpecForge's clean-up while the server's store is up
                res["cleanup"] = consumer.close()
                say("specforge clean-up: %s" % {k: v for k, v in res["cleanup"].items() if k != "keys_left_first"})
            peers.stop(p)
            if isinstance(consumer, Consumer):
                consumer.close()
            if master is not None:
                master.stop()
            res["server_log"] = notable(log)
        return res

    def passes(self, sink: str, url: str, consumer: Consumer, res: dict, who: str) -> None:
        """One repetition of the three passes into ``res`` (written after each)."""
        pass_s = self.a.pass_s or self.prof["pass_s"]
        conc = self.a.concurrency or self.prof["concurrency"]
        # produce: nothing read until the flush has returned
        t0 = time.monotonic()
        got = drive(url, self.batches["produce"], conc, t0 + pass_s, None)
        res["produce_flush"] = flush(url)
        wall = time.monotonic() - t0
        res["produce"] = summary(got["recs"], wall, "first request to the flush's return")
        res["produce"]["errors"] = got["errors"][:5]
        res["produce"]["flush_after_last_answer_s"] = round(wall - got["wall_s"], 2)
        self.write()
        say("%s produce: %s samples, %s tokens/s (flush %.1f s after the last answer)" % (
            who, res["produce"]["samples"], res["produce"]["tokens_per_s"], wall - got["wall_s"]))
        # consume: the produce pass's samples, one reader, onto the device, deleted
        t1 = time.monotonic()
        reads, errs = [], []
        for rec in got["recs"]:
            try:
                b, s = consumer.read(rec["handle"], timeout=30)
                reads.append({"tokens": rec["tokens"], "bytes": b, "read_s": s})
            except Exception as exc:  # noqa: BLE001 - counted and named
                errs.append("%s: %s" % (type(exc).__name__, str(exc)[:300]))
        res["consume"] = summary(reads, time.monotonic() - t1, "one reader thread, read + to %s + delete"
                                 % self.device)
        res["consume"]["errors"] = errs[:5]
        res["consume"]["failed_reads"] = len(errs)
        res["produce"]["bytes_per_token"] = res["consume"].get("bytes_per_token")
        say("%s consume: %d samples, %s tokens/s, %s GB/s, %s B/token" % (
            who, len(reads), res["consume"]["tokens_per_s"], res["consume"].get("gb_per_s"),
            res["consume"].get("bytes_per_token")))
        self.write()
        # online: produce and consume at once
        t2 = time.monotonic()
        got = drive(url, self.batches["online"], conc, t2 + pass_s, consumer)
        res["online"] = summary(got["recs"], time.monotonic() - t2, "first request to the last sample on %s"
                                % self.device)
        res["online"]["errors"] = got["errors"][:5]
        res["online"]["failed"] = len(got["errors"])
        res["online_flush"] = flush(url)
        self.write()
        say("%s online: %s samples, %s tokens/s" % (who, res["online"]["samples"], res["online"]["tokens_per_s"]))

    def passes_specforge(self, url: str, client: SpecForgeClient, res: dict, who: str) -> None:
        """One repetition of the three passes through SpecForge's adapter and store into ``res``."""
        pass_s = self.a.pass_s or self.prof["pass_s"]
        # produce: every batch's capture call answered (its objects all in the store), nothing read
        got = drive_specforge(client, self.batches["produce"], time.monotonic() + pass_s, read=False)
        res["produce"] = summary(got["recs"], got["wall_s"], "first capture call to the last answer (every "
                                 "object in the store)")
        self.failures(res["produce"], got["errors"], len(self.batches["produce"]))
        res["produce_flush"] = flush(url)  # untimed: the dump's own counts
        self.write()
        say("%s produce: %s samples, %s tokens/s" % (who, res["produce"]["samples"], res["produce"]["tokens_per_s"]))
        # consume: the produce pass's refs, one reader thread, onto the device, deleted (release, abort)
        t1 = time.monotonic()
        reads, errs, reclaim_s = [], [], 0.0
        for i in range(0, len(got["recs"]), client.lease):  # a trainer's steps: its lease of samples each
            done = []
            for rec in got["recs"][i:i + client.lease]:
                try:
                    b, sec = client.read(rec["ref"])
                    reads.append({"tokens": rec["tokens"], "bytes": b, "read_s": sec})
                    done.append(rec["ref"].sample_id)
                except Exception as exc:  # noqa: BLE001 - counted and named
                    errs.append("read %s: %s: %s" % (rec["ref"].sample_id, type(exc).__name__, str(exc)[:300]))
            try:
                reclaim_s += client.reclaim(done) if done else 0.0
            except Exception as exc:  # noqa: BLE001 - counted and named
                errs.append("reclaim: %s: %s" % (type(exc).__name__, str(exc)[:300]))
        res["consume"] = summary(reads, time.monotonic() - t1, "one reader thread, MooncakeFeatureStore.get + to %s + "
                                 "release + abort, drain_sample_removals per %d samples" % (self.device, client.lease))
        res["consume"]["errors"] = errs[:5]
        res["consume"]["failed_reads"] = len(errs)
        res["consume"]["reclaim_s"] = round(reclaim_s, 3)
        res["produce"]["bytes_per_token"] = res["consume"].get("bytes_per_token")
        say("%s consume: %d samples, %s tokens/s, %s GB/s, %s B/token" % (
            who, len(reads), res["consume"]["tokens_per_s"], res["consume"].get("gb_per_s"),
            res["consume"].get("bytes_per_token")))
        self.write()
        # online: each batch's refs read, moved and deleted as soon as it answers
        got = drive_specforge(client, self.batches["online"], time.monotonic() + pass_s, read=True)
        res["online"] = summary(got["recs"], got["wall_s"], "first capture call to the last sample on %s "
                                "(each batch's removed from the store)" % self.device)
        self.failures(res["online"], got["errors"], len(self.batches["online"]))
        res["online"]["reclaim_s"] = got["reclaim_s"]
        res["online"]["failed"] = len(got["errors"])
        res["online_flush"] = flush(url)
        res["release_pending"] = client.store.health()["release_pending"]  # removals SpecForge deferred so far
        self.write()
        say("%s online: %s samples, %s tokens/s" % (who, res["online"]["samples"], res["online"]["tokens_per_s"]))

    @staticmethod
    def failures(summ: dict, errors: list, sent: int) -> None:
        """A pass's errors (failed captures, failed calls and reads) into its summary: any fails the run."""
        summ["errors"] = errors[:5]
        summ["failed_captures"] = sum(1 for e in errors if e.startswith("capture failed"))
        summ["not_captured"] = sent - summ["samples"]

    def warm(self, size: int, send) -> dict:
        """Untimed rounds of ``size`` requests (``send(batch, deadline)``: each read and deleted) until
        one runs within 10% of the one before or ``--warm-s`` is spent: Triton compiles per new batch
        shape on a fresh server."""
        limit = self.prof["warm_s"] if self.a.warm_s is None else self.a.warm_s
        rec = {"limit_s": limit, "rounds": []}
        t0 = time.monotonic()
        seed = 100
        while time.monotonic() - t0 < limit:
            batch = prompts(lengths(size, self.prof, seed), self.vocab, seed + 1)
            seed += 2
            got = send(batch, time.monotonic() + limit + 60)
            if got["errors"]:
                rec["error"] = got["errors"][0]
                break
            rate = sum(map(len, batch)) / max(got["wall_s"], 1e-9)
            rec["rounds"].append(round(rate, 1))
            if len(rec["rounds"]) > 1 and abs(rate - rec["rounds"][-2]) <= 0.1 * rec["rounds"][-2]:
                break
        rec["warm_s"] = round(time.monotonic() - t0, 1)
        say("warm-up: %d round(s), tokens/s %s" % (len(rec["rounds"]), rec["rounds"]))
        return rec

    def write(self) -> None:
        if self.a.out:
            out = Path(self.a.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(self.result, indent=2) + "\n")
            os.replace(tmp, out)

    def go(self) -> int:
        self.prepare()
        budget = self.a.budget_s or self.prof["budget_s"]
        for sink in self.a.sinks:
            if time.monotonic() - T0 > budget:
                self.result["sinks"][sink] = {"not_measured": "the run had used its --budget-s %g" % budget}
                continue
            self.result["sinks"][sink] = self.sink(sink)
            self.write()
        s = self.result["sinks"]
        for sink in ("mooncake", "specforge"):
            if not all(k in s and "repeats" in s[k] for k in (sink, "file")):
                continue
            # repetition i of one sink against repetition i of the other: min, median and all the ratios
            ratios = {}
            for ps in PASSES:
                rs = sorted(round(m[ps]["tokens_per_s"] / f[ps]["tokens_per_s"], 3)
                            for m, f in zip(s[sink]["repeats"], s["file"]["repeats"])
                            if m.get(ps, {}).get("tokens_per_s") and f.get(ps, {}).get("tokens_per_s"))
                if rs:
                    ratios[ps] = {"min": rs[0], "median": rs[(len(rs) - 1) // 2], "all": rs}
            self.result[sink + "_over_file"] = ratios
        self.result["wall_s"] = round(time.monotonic() - T0, 1)
        self.write()
        bad = [k for k, v in s.items() if sink_failed(v)]
        print(json.dumps({k: {ps: v.get(ps, {}).get("tokens_per_s") for ps in PASSES} for k, v in s.items()}
                         | {k: self.result.get(k) for k in ("mooncake_over_file", "specforge_over_file")}))
        if bad:
            print("error: sink(s) %s failed or lost requests; see %s" % (", ".join(bad), self.a.out or "the JSON"),
                  file=sys.stderr)
            return 1
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="online.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: the CPU demo's model, the CPU Mooncake wheel")
    ap.add_argument("--sinks", help="comma list of file, mooncake, specforge (default: all three when SpecForge's "
                                    "package imports, else file and mooncake)")
    ap.add_argument("--out", help="results JSON")
    ap.add_argument("--requests", type=int, help="requests per pass (cpu 24, gpu 400)")
    ap.add_argument("--concurrency", type=int, help="requests in flight (cpu 4, gpu 32)")
    ap.add_argument("--repeats", type=int, help="repetitions of the three passes per server (default 1); the result "
                                               "keeps each, and per pass the median one with the min")
    ap.add_argument("--pass-s", type=float, help="stop sending a pass's requests after this (cpu 120, gpu 60)")
    ap.add_argument("--warm-s", type=float, help="untimed warm-up per server at most this long (cpu 3, gpu 30)")
    ap.add_argument("--budget-s", type=float, help="start no sink once the run has used this (cpu 900, gpu 500)")
    ap.add_argument("--work", help="working directory (default: a new temporary one)")
    ap.add_argument("--site", help="GPU: the site directory holding the installed sglang (default: where it is found)")
    ap.add_argument("--patched-files", help="GPU: the series' patched files (default .gpu-patched; docs/gpu.md)")
    ap.add_argument("--mooncake-site", help="the directory holding the mooncake package (GPU: /tmp/mc from "
                                            "benchmarks/mooncake_payload.py; default: the CPU wheel, installed once)")
    a = ap.parse_args(argv)
    left_out = {}
    try:
        if a.sinks is None:
            a.sinks = list(SINKS)
            why = specforge_missing()
            if why:
                a.sinks.remove("specforge")
                left_out["specforge"] = "SpecForge's package does not import (%s)" % why
                say("the specforge sink is left out: %s; pip install specforge==0.2.0 to run it"
                    % left_out["specforge"])
        else:
            a.sinks = [s.strip() for s in a.sinks.split(",") if s.strip()]
            bad = [s for s in a.sinks if s not in SINKS]
            if bad or not a.sinks:
                raise UsageError("--sinks %r names no sink or an unknown one (%s)" % (",".join(a.sinks), ",".join(bad)),
                                 "pass a comma list of %s" % ", ".join(SINKS))
            why = specforge_missing() if "specforge" in a.sinks else None
            if why:
                raise UsageError("--sinks specforge needs SpecForge's package, which does not import here (%s)" % why,
                                 "pip install specforge==0.2.0, or leave specforge out of --sinks")
        for name in ("requests", "concurrency", "repeats"):
            v = getattr(a, name)
            if v is not None and v < 1:
                raise UsageError("--%s %d is not positive" % (name, v), "pass a whole number >= 1")
        for name in ("pass_s", "warm_s", "budget_s"):
            v = getattr(a, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise UsageError("--%s %r is not a finite number >= 0" % (name.replace("_", "-"), v),
                                 "pass seconds, e.g. 60")
        if a.mooncake_site and not (Path(a.mooncake_site) / "mooncake" / "mooncake_master").is_file():
            raise UsageError("--mooncake-site %s has no mooncake/mooncake_master" % a.mooncake_site,
                             "unpack benchmarks/mooncake_payload.py's output there (sh OUT/unpack.sh DIR)")
        bench = Bench(a, PROFILES["cpu" if a.cpu else "gpu"])
        bench.result["sinks_left_out"] = left_out
        return bench.go()
    except UsageError as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
