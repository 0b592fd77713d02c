"""Helpers shared by the smoke workers (run inside the CPU environment, by file path)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

T0 = time.monotonic()

# The names of the functional checks (the parent process lists them too, to report a check
# whose worker died before it ran).
A_NAME = "a. eagle3 capture [-1,1,3] == HF residual stream [0,2,4 (before the final norm)]"
B_NAME = "b. dump through sglang.Engine (DeepSeek-V3) == HF per request"
C_NAME = "c. dump through the Kimi-K2.5 wrapper under chunked prefill (chunk 64, text only) == HF per request"
D_NAME = "d. greedy tokens and logits identical with the dump on and off"
H_NAME = ("h. launch_server over HTTP with the dump: warm-up and health probes not dumped, one file per "
          "request id, flush endpoint, flushed at stop")
DECODE_NAME = "d. decode captures only what a draft needs (dump only: nothing; dump + draft: the draft's layers)"
G_NAME = "g. Kimi-K2.5 image prompts (same text, two images): one file each, ids stored with the placeholder id, rows == HF"
E_ENGINE_NAME = "e. refused at sglang.Engine start: radix cache on"
E_LAUNCH_NAME = "e. refused by launch_server: radix cache on"
E_RUNNER_NAME = "e. refused in ModelRunner init too (radix cache on)"


def server_cli(kwargs: dict) -> list:
    """``python -m sglang.launch_server`` flags for Engine keyword arguments (True: the bare flag;
    False/None: left out; a list: its items after the flag)."""
    out = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag] + [str(x) for x in v]
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out


def log(msg: str) -> None:
    print("[smoke %5.1fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


def result(name: str, passed: bool, figure: str, detail: str = "") -> None:
    rec = {"name": name, "passed": bool(passed), "figure": figure, "detail": detail}
    print("@@RESULT " + json.dumps(rec), flush=True)


def guarded(name: str):
    """Decorator: an exception inside a check is that check's FAIL, with the traceback tail."""

    def wrap(fn):
        def run(*a, **kw):
            try:
                return fn(*a, **kw)
            except Exception as exc:  # a crash is a failed check, never a skipped one
                tb = traceback.format_exc().strip().splitlines()[-12:]
                result(name, False, "error", "%s: %s\n%s" % (type(exc).__name__, exc, "\n".join(tb)))
                return None

        return run

    return wrap


DUMP_VARS = ("EAGLE3_DUMP_DIR", "EAGLE3_DUMP_LAYERS", "EAGLE3_DUMP_FINAL", "EAGLE3_DUMP_MAX_PENDING_MB")


class Dumping:
    """During ``with``: the dump variables for what starts inside the block. Every EAGLE3_DUMP_*
    variable is unset on entry and restored on exit; with a directory (created), the given ones
    are set (None leaves that variable unset)."""

    def __init__(self, directory, layers=None, final=None, max_pending_mb=None):
        values = (directory, ",".join(str(k) for k in layers) if layers is not None else None, final, max_pending_mb)
        self.directory = directory
        self.values = {k: str(v) for k, v in zip(DUMP_VARS, values) if v is not None}

    def __enter__(self):
        self.saved = {k: os.environ.pop(k, None) for k in DUMP_VARS}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.environ.update(self.values)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        return False


def maxdiff(a, b) -> float:

    a = a.detach().float().cpu()
    b = b.detach().float().cpu()
    if a.shape != b.shape:
        raise AssertionError("shape %s != %s" % (tuple(a.shape), tuple(b.shape)))
    return float((a - b).abs().max()) if a.numel() else 0.0


# The ServerArgs that run real SGLang on this CPU (cpu-smoke recipe); each worker adds its own.
CPU_SERVER_ARGS = dict(
    device="cpu",
    skip_tokenizer_init=True,
    attention_backend="torch_native",
    disable_cuda_graph=True,
    dtype="float32",
    disable_radix_cache=True,
    disable_overlap_schedule=True,
    max_total_tokens=4096,
    context_length=1024,
    max_running_requests=8,
    random_seed=0,
)


# A reference check must tell a wrong state from the right one: every comparison below is also
# made against the states a wrong reading would give (the layer one above or below, the final
# state without its norm, the last layer's output after the norm), and those must differ.
WRONG_MARGIN = 1000.0  # the nearest wrong reference differs by >= this many tolerances


class RowCheck:
    """Accumulates right/wrong distances of captured rows against an HF reference (_hf.Ref)."""

    def __init__(self, tol: float):
        self.tol = tol
        self.right = 0.0  # worst distance to the right reference
        self.wrong = float("inf")  # nearest distance to a wrong reference
        self.wrong_what = ""

    def _wrong(self, got, ref, what) -> None:
        if ref is not None and tuple(ref.shape) == tuple(got.shape):
            d = maxdiff(got, ref)
            if d < self.wrong:
                self.wrong, self.wrong_what = d, what

    def layer(self, got, ref, k: int) -> None:
        """EAGLE-3 id k (-1 = embedding, N-1 = last layer before the final norm)."""
        stream = ref.stream
        self.right = max(self.right, maxdiff(got, stream[k + 1]))
        for j in (k, k + 2):
            if 0 <= j < len(stream):
                self._wrong(got, stream[j], "id %d read as HF index %d (shifted by one)" % (k, j))
        if k + 1 == len(stream) - 1:
            self._wrong(got, ref.final, "id %d read after the final norm" % k)

    def final(self, got, ref) -> None:
        self.right = max(self.right, maxdiff(got, ref.final))
        self._wrong(got, ref.stream[-1], "final without its norm")

    def problems(self) -> list:
        out = []
        if self.right > self.tol:
            out.append("max abs diff %.3g > %g" % (self.right, self.tol))
        if self.wrong < WRONG_MARGIN * self.tol:
            out.append("the reference cannot tell a wrong state: %s differs by only %.3g" % (self.wrong_what, self.wrong))
        return out

    def figure(self) -> str:
        return "max abs diff %.2g (nearest wrong reference %.2g: %s)" % (self.right, self.wrong, self.wrong_what)
