"""A loopback stand-in for a patched SGLang server that follows the dump contract of issue 19.

``DumpServer(dump_dir, layers, hidden_size, num_layers)`` answers ``GET /get_model_info`` and
``POST /generate`` like SGLang, and ``POST /eagle3_dump/flush`` like the series:

- the request's rid is the ``rid`` of the JSON body, else one the server makes (``meta_info["id"]``
  of every answer, as SGLang's);
- its dump is ``<dump_dir>/<sha256(rid)>.safetensors`` (format ``eagle3-dump/1``), with the contract's
  metadata: ``key`` = sha256(rid), ``rid``, ``prompt_key`` = sha256 of the ids written "1,2,3",
  ``input_source`` = ``input_ids``, ``lora_id``, ``mm_hashes`` and the model's fields;
- ``write="flush"`` (default) queues every dump and writes it only when ``/eagle3_dump/flush`` is
  called (a client that waits for the file instead never sees it); ``write="now"`` writes it
  before answering; ``flush_status=404`` answers the flush as a server without the endpoint does
  (an older series).

``layer.<k>`` rows are a function of the prompt's own ids (``expected_rows``), so a test can see
whose rows a sample holds. ``meta`` overrides metadata fields (another model, dtype, series...);
``plan`` maps a prompt key to actions, one per request with that prompt: ``"503"`` (refused before
the prefill), ``"lose"`` (answered, never written), ``"late"`` (written by the flush after the next
one: a file that comes after its client gave up), ``"hang"`` (written at once, answered only when
``release`` is set), ``"rid"`` / ``"prompt"`` / ``"embeds"`` (written with another rid, another prompt
key, ``input_source=input_embeds``), or a dict (written with those metadata fields). ``requests``
lists (rid, prompt key) of every ``/generate``, ``sampling`` its ``sampling_params``, ``flushes``
counts flush calls; ``health`` is the status of ``GET /health`` (503: SGLang during its warm-up,
whose requests are not dumped).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from loopback import LoopbackServer


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_key(ids) -> str:
    return sha(",".join(str(int(t)) for t in ids))


def expected_rows(ids, layer: int, hidden_size: int):
    """The rows this stand-in stores for ``layer`` of a prompt: row t is ids[t] + layer / 8 + j / 1024."""
    import torch

    ids_t = torch.tensor([int(x) for x in ids], dtype=torch.float32)[:, None]
    return ids_t + layer / 8 + torch.arange(hidden_size, dtype=torch.float32)[None, :] / 1024


class DumpServer(LoopbackServer):
    def __init__(self, dump_dir: Path, layers, hidden_size: int, num_layers: int, *, write: str = "flush",
                 flush_status: int = 200, meta: dict | None = None, states=None, model_path: str = "stand-in"):
        self.dump_dir, self.layers = Path(dump_dir), list(layers)
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.write, self.flush_status, self.meta = write, flush_status, dict(meta or {})
        self.states = states or (lambda ids: {k: expected_rows(ids, k, hidden_size) for k in self.layers}
                                 | {"final": expected_rows(ids, 99, hidden_size)})
        self.model_path = model_path
        self.health = 200  # /health's status (SGLang: 503 while its warm-up runs)
        self.plan: dict[str, list] = {}
        self.requests: list = []
        self.sampling: list = []
        self.flushes = 0
        self.queue: list = []
        self.later: list = []  # "late" jobs: queued by the next flush, written by the one after
        self.release = threading.Event()  # answers the "hang" requests
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, status, obj):
                body = json.dumps(obj).encode() if obj is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # /get_model_info, and what SGLang's router asks (/health, /server_info, ...)
                if self.path.startswith("/health") and server.health != 200:
                    return self._reply(server.health, None)
                self._reply(200, {"model_path": server.model_path, "is_generation": True})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/eagle3_dump/flush":
                    with server.lock:
                        server.flushes += 1
                    if server.flush_status != 200:
                        return self._reply(server.flush_status, {"detail": "Not Found"})
                    return self._reply(200, dict(server.flush(), flushed=True))
                if self.path != "/generate":
                    return self._reply(404, {"detail": "Not Found"})
                body = json.loads(raw)
                ids = [int(x) for x in body["input_ids"]]
                rid = body.get("rid") or uuid.uuid4().hex
                pk = prompt_key(ids)
                with server.lock:
                    server.requests.append((rid, pk))
                    server.sampling.append(body.get("sampling_params"))
                    todo = server.plan.get(pk)
                    action = todo.pop(0) if todo else None
                if action == "503":
                    return self._reply(503, {"error": "injected"})
                if action == "late":
                    with server.lock:
                        server.later.append((rid, ids, None))
                elif action == "hang":
                    server._write(rid, ids, None)
                    server.release.wait(300)
                elif action != "lose":
                    job = (rid, ids, action)
                    if server.write == "now":
                        server._write(*job)
                    else:
                        with server.lock:
                            server.queue.append(job)
                self._reply(200, {"text": "x", "meta_info": {"id": rid, "prompt_tokens": len(ids)}})

        self._serve(Handler)

    def flush(self) -> dict:
        with self.lock:
            jobs, self.queue, self.later = self.queue, self.later, []
        for job in jobs:
            self._write(*job)
        return {"written": len(jobs), "failed": 0, "dropped": 0, "skipped": 0}

    def _write(self, rid: str, ids: list, action) -> None:
        import torch
        from safetensors.torch import save_file

        t = {"input_ids": torch.tensor(ids, dtype=torch.int64)}
        states = self.states(ids)
        for k in self.layers:
            t[f"layer.{k}"] = states[k].contiguous()
        if "final" in states:
            t["final"] = states["final"].contiguous()
        key = sha(rid)
        meta = {"format": "eagle3-dump/1", "key": key, "rid": rid, "prompt_key": prompt_key(ids),
                "input_source": "input_ids", "lora_id": "", "mm_hashes": "[]",
                "eagle3_layer_ids": json.dumps(self.layers),
                "hf_hidden_state_indices": json.dumps([k + 1 for k in self.layers]),
                "configured_layer_ids": json.dumps(self.layers), "layer_id_reading": "plus_one",
                "final": "post_norm" if "final" in t else "none", "architecture": "LlamaForCausalLM",
                "model_path": self.model_path, "hidden_size": str(self.hidden_size),
                "num_hidden_layers": str(self.num_layers), "dtype": "float32", "sglang_version": "0.5.9",
                "series_version": "0.5.9-4", "tp_size": "1", "num_tokens": str(len(ids))}
        meta.update(self.meta)
        if isinstance(action, dict):  # this request's dump with other metadata
            meta.update(action)
        elif action == "rid":
            meta["rid"] = "someone-else"
        elif action == "prompt":
            meta["prompt_key"] = prompt_key(ids[1:])
        elif action == "embeds":
            meta["input_source"] = "input_embeds"
        tmp = self.dump_dir / f".{key}.{uuid.uuid4().hex}.tmp"
        save_file(t, str(tmp), metadata=meta)
        os.replace(tmp, self.dump_dir / f"{key}.safetensors")
