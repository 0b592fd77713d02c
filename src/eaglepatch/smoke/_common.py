"""Helpers shared by the smoke workers (run inside the CPU environment, by file path)."""

from __future__ import annotations

import json
import sys
import time
import traceback

T0 = time.monotonic()


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
