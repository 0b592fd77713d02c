"""A loopback stand-in for the patched SGLang server, computing its dumps with Hugging Face.

``HFDumpServer(reference, dump_dir, layers)`` (``reference``: the smoke tests' HF ``Reference``) answers ``/get_model_info``
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


class HFDumpServer(LoopbackServer):
    def __init__(self, reference, dump_dir: Path, layers, swap_last: bool = False):
        self.reference, self.dump_dir, self.layers, self.swap_last = reference, Path(dump_dir), list(layers), swap_last
        self.lock = threading.Lock()
        cfg = reference.model.config
        n = cfg.num_hidden_layers
        server = self

        def write_dump(ids):
            import torch
            from safetensors.torch import save_file

            with server.lock:  # one forward at a time
                ref = server.reference.run(ids)
            t = {"input_ids": torch.tensor(ids, dtype=torch.int64), "final": ref.final.contiguous()}
            for k in server.layers:  # stream[k + 1] is EAGLE-3 id k; stream[N] is layer N-1 before the norm
                t[f"layer.{k}"] = (ref.final if server.swap_last and k == n - 1 else ref.stream[k + 1]).clone()
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
