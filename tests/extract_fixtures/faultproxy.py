"""A loopback HTTP proxy in front of a real SGLang server that injects faults on request.

``FaultProxy(upstream, dump_dir)`` forwards every request (the flush too). ``plan`` maps a prompt
key (sha256 of the prompt ids written "1,2,3", the dumps' ``prompt_key``) to a list of actions,
used one per request with that prompt; when the list runs out, requests pass untouched:

- ``"503"``: answer HTTP 503 without forwarding (a transient failure);
- ``"truncate"``: forward, flush the server, cut the request's dump (``sha256(rid)``) to half its
  size, then answer;
- ``"nan"``: forward, flush, rewrite the dump with a NaN in ``layer.1``, then answer;
- ``"ids"``: forward, flush, rewrite the dump with ``input_ids`` shifted by one;
- a dict: forward, flush, rewrite the dump with those metadata fields (another model, dtype, ...).

Because the proxy answers only after tampering, the client deterministically sees the bad file.
``log`` lists (key, action) in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import requests

from loopback import LoopbackServer


def _key(ids) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def _rewrite(path: Path, how) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    if how == "nan":
        t["layer.1"] = t["layer.1"].clone()
        t["layer.1"][0, 0] = float("nan")
    elif how == "ids":
        t["input_ids"] = t["input_ids"] + 1
    elif isinstance(how, dict):
        meta = dict(meta, **how)
    tmp = path.with_name("." + path.name + ".proxy.tmp")
    save_file(t, str(tmp), metadata=meta)
    os.replace(tmp, path)


class FaultProxy(LoopbackServer):
    def __init__(self, upstream: str, dump_dir: Path):
        self.upstream = upstream.rstrip("/")
        self.dump_dir = Path(dump_dir)
        self.plan: dict[str, list] = {}
        self.log: list = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, status: int, body: bytes, ctype="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                r = requests.get(proxy.upstream + self.path, timeout=60)
                self._reply(r.status_code, r.content, r.headers.get("Content-Type", "application/json"))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                action = None
                if self.path == "/generate":
                    req = json.loads(body)
                    ids, rid = req.get("input_ids") or [], req.get("rid") or ""
                    key = _key(ids)
                    with proxy.lock:
                        todo = proxy.plan.get(key)
                        if todo:
                            action = todo.pop(0)
                            proxy.log.append((key, action))
                if action == "503":
                    return self._reply(503, b'{"error": "injected"}')
                r = requests.post(proxy.upstream + self.path, data=body, timeout=600,
                                  headers={"Content-Type": "application/json"})
                if action is not None:
                    assert rid, "a tampered request must carry its rid (the client sends one)"
                    f = requests.post(proxy.upstream + "/eagle3_dump/flush", json={}, timeout=120)
                    assert f.status_code == 200, f.text
                    path = proxy.dump_dir / (hashlib.sha256(rid.encode()).hexdigest() + ".safetensors")
                    if action == "truncate":
                        data = path.read_bytes()
                        path.write_bytes(data[: len(data) // 2])
                    else:
                        _rewrite(path, action)
                self._reply(r.status_code, r.content, r.headers.get("Content-Type", "application/json"))

        self._serve(Handler)
