"""A loopback stand-in for the patched SGLang server, computing its dumps with Hugging Face.

``HFDumpServer(reference, dump_dir, layers)`` answers ``/get_model_info``, ``/get_server_info``
and ``/generate`` like SGLang and writes, for every ``/generate``, the dump file the patched
server writes (format ``eagle3-dump/1``, key = sha256 of the ids): ``layer.<k>`` = HF
``hidden_states[k + 1]`` for k < N-1, ``layer.<N-1>`` = the last decoder layer's output before
the final norm, ``final`` = the post-norm state. ``swap_last=True`` stores the post-norm state as
``layer.<N-1>`` too (a server that mixes up pre- and post-norm), for the checks that must catch it.
Used where a test needs layer N-1 from a server without paying an SGLang start.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from loopback import LoopbackServer


def hf_states(model, ids):
    """(hidden_states tuple [N+1 x [T, H]], pre-norm last-layer output [T, H], logits [T, V]), float32."""
    import torch

    raw = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, out: raw.__setitem__("x", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(ids)]), output_hidden_states=True)
    finally:
        hook.remove()
    return tuple(t[0].float() for t in out.hidden_states), raw["x"][0].float(), out.logits[0].float()


class HFDumpServer(LoopbackServer):
    def __init__(self, model, dump_dir: Path, layers, swap_last: bool = False):
        self.model, self.dump_dir, self.layers, self.swap_last = model, Path(dump_dir), list(layers), swap_last
        self.lock = threading.Lock()
        cfg = model.config
        n = cfg.num_hidden_layers
        server = self

        def write_dump(ids):
            import torch
            from safetensors.torch import save_file

            with server.lock:  # one forward at a time
                hs, pre, _ = hf_states(server.model, ids)
            t = {"input_ids": torch.tensor(ids, dtype=torch.int64), "final": hs[n].contiguous()}
            for k in server.layers:
                t[f"layer.{k}"] = (hs[n] if server.swap_last else pre) if k == n - 1 else hs[k + 1]
                t[f"layer.{k}"] = t[f"layer.{k}"].clone()  # own storage (safetensors refuses shared tensors)
            key = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
            meta = {"format": "eagle3-dump/1", "key": key, "eagle3_layer_ids": json.dumps(server.layers),
                    "hf_hidden_state_indices": json.dumps([k + 1 for k in server.layers]), "final": "post_norm",
                    "architecture": "DeepseekV3ForCausalLM", "model_path": "hf", "hidden_size": str(cfg.hidden_size),
                    "num_hidden_layers": str(n), "dtype": "float32", "sglang_version": "hf-stand-in",
                    "series_version": "none", "tp_size": "1", "num_tokens": str(len(ids))}
            tmp = server.dump_dir / f".{key}.tmp"
            save_file(t, str(tmp), metadata=meta)
            os.replace(tmp, server.dump_dir / f"{key}.safetensors")

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._reply({"model_path": "hf", "is_generation": True})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                write_dump([int(x) for x in body["input_ids"]])
                self._reply({"text": "", "meta_info": {"prompt_tokens": len(body["input_ids"])}})

        self._serve(Handler)
