"""A loopback stand-in for the patched SGLang server, computing its dumps with Hugging Face.

``HFDumpServer(reference, dump_dir, layers)`` (``reference``: the smoke tests' HF ``Reference``) is a
``dumpserver.DumpServer`` (the dump contract of issue 19: files named by sha256 of the request's
rid, ``POST /eagle3_dump/flush``) whose rows are the model's: ``layer.<k>`` = HF
``hidden_states[k + 1]`` for k < N-1, ``layer.<N-1>`` = the last decoder layer's output before the
final norm, ``final`` = the post-norm state. ``swap_last=True`` stores the post-norm state as
``layer.<N-1>`` too (a server that mixes up pre- and post-norm), for the checks that must catch it.
Used where a test needs layer N-1 from a server without paying an SGLang start.
"""

from __future__ import annotations

import threading
from pathlib import Path

from dumpserver import DumpServer


class HFDumpServer(DumpServer):
    def __init__(self, reference, dump_dir: Path, layers, swap_last: bool = False):
        cfg = reference.model.config
        n = cfg.num_hidden_layers
        lock = threading.Lock()

        def states(ids):
            with lock:  # one forward at a time
                ref = reference.run(ids)
            # stream[k + 1] is EAGLE-3 id k; stream[N] is layer N-1 before the norm
            out = {k: (ref.final if swap_last and k == n - 1 else ref.stream[k + 1]).clone() for k in layers}
            out["final"] = ref.final
            return out

        super().__init__(dump_dir, layers, cfg.hidden_size, n, write="now", states=states, model_path="hf",
                         meta={"architecture": "DeepseekV3ForCausalLM", "sglang_version": "hf-stand-in",
                               "series_version": "none"})
