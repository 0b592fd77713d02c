"""sglang.Engine checks (run inside the CPU environment by file path).

usage: python _engine.py DEEPSEEK_CKPT KIMI_CKPT WORK_DIR [e,b,c]

e. (last) an Engine start with the dump on and the radix cache on is refused with its message.

b. DeepSeek-V3 Engine with the dump on: one generate call with several prompts of different
   lengths (batched by the scheduler), one file per request, ids, metadata, each layer and
   `final` equal the HF reference of that request.
c. The same through the Kimi-K2.5 wrapper (text only).

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
from _common import CPU_SERVER_ARGS, guarded, log, maxdiff, result

LAYERS = [-1, 1, 2]
TOL = 1e-4
FILE_TIMEOUT_S = 120

ENGINE_ARGS = dict(CPU_SERVER_ARGS, log_level="error")


def dump_key(ids) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


class Dumping:
    """Set the dump variables for the Engine started inside the block."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    def __enter__(self):
        keys = ("EAGLE3_DUMP_DIR", "EAGLE3_DUMP_LAYERS", "EAGLE3_DUMP_FINAL", "EAGLE3_DUMP_MAX_PENDING_MB")
        self.saved = {k: os.environ.pop(k, None) for k in keys}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.environ["EAGLE3_DUMP_DIR"] = str(self.directory)
            os.environ["EAGLE3_DUMP_LAYERS"] = ",".join(str(k) for k in LAYERS)
            os.environ["EAGLE3_DUMP_FINAL"] = "1"
            # small cap: several requests in one forward exceed it, so backpressure is exercised
            os.environ["EAGLE3_DUMP_MAX_PENDING_MB"] = "1"
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
        return False


def start_engine(ckpt: Path, **extra):
    import sglang

    t0 = time.monotonic()
    kw = dict(ENGINE_ARGS, model_path=str(ckpt))
    kw.update(extra)
    engine = sglang.Engine(**kw)
    log("engine for %s started in %.1f s" % (ckpt.name, time.monotonic() - t0))
    return engine


def generate(engine, prompts, new_tokens):
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.monotonic()
    out = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sp)
    log("generate %d requests x %d new tokens: %.1f s" % (len(prompts), new_tokens, time.monotonic() - t0))
    return out


def wait_files(directory: Path, keys, timeout=FILE_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    want = {k: directory / (k + ".safetensors") for k in keys}
    while time.monotonic() < deadline:
        if all(p.exists() for p in want.values()):
            return want, True
        time.sleep(0.2)
    return want, False


def check_dump(name, directory: Path, prompts, refs, arch, ckpt) -> None:
    from safetensors import safe_open

    keys = [dump_key(p) for p in prompts]
    want, complete = wait_files(directory, keys)
    problems = []
    if not complete:
        missing = [k[:12] for k, p in want.items() if not p.exists()]
        problems.append("missing %d of %d files after %d s: %s" % (len(missing), len(keys), FILE_TIMEOUT_S, missing))
    time.sleep(0.5)  # let a late extra file (a bug) show up
    names = sorted(p.name for p in directory.iterdir())
    extra = [n for n in names if n not in {k + ".safetensors" for k in keys}]
    if extra:
        problems.append("unexpected files in the dump dir: %s" % extra[:6])
    worst = {"layers": 0.0, "final": 0.0}
    checked = 0
    for ids, key, (hs, _logits, post_diff, pre_diff) in zip(prompts, keys, refs):
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
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(hs[k + 1].shape):
                problems.append("%s: layer.%d dtype %s shape %s" % (key[:12], k, t.dtype, tuple(t.shape)))
                continue
            worst["layers"] = max(worst["layers"], maxdiff(t, hs[k + 1]))
        worst["final"] = max(worst["final"], maxdiff(tensors["final"], hs[-1]))
        checked += 1
    d = max(worst.values())
    if d > TOL:
        problems.append("max abs diff %.3g > %g (layers %.3g, final %.3g)" % (d, TOL, worst["layers"], worst["final"]))
    post = max(r[2] for r in refs)
    pre = min(r[3] for r in refs)
    if post > 1e-5 or pre < 1e-3:
        problems.append("HF hidden_states[-1] is not the post-norm state (|hs[-1]-norm(last)| %.3g, |hs[-1]-last| %.3g)" % (post, pre))
    detail = ("%d requests (lengths %s) in one generate call; %d files checked; layers %s: %.3g, final: %.3g; "
              "HF hidden_states[-1] == norm(last layer output) to %.1g (and differs from it by >= %.2g)"
              % (len(prompts), [len(p) for p in prompts], checked, LAYERS, worst["layers"], worst["final"], post, pre))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(name, not problems, "max abs diff %.2g" % d, detail)


E_NAME = "e. refused at sglang.Engine start: radix cache on"
E_NEEDLE = "EAGLE3_DUMP_DIR is set but the radix cache is on"
E_FIX = "--disable-radix-cache"


_QUITS = []


def _note_sigquit(signum, frame):
    """SIGQUIT handler for the refused start (top level: ServerArgs is pickled to the scheduler)."""
    _QUITS.append(signum)


def check_e_engine(ckpt: Path, work: Path) -> None:
    """A real Engine start with the dump on and the radix cache on (the Engine default) must
    fail with a message naming --disable-radix-cache, before any file is written."""
    from sglang.srt.utils import kill_process_tree

    directory = work / "dump-refused"
    errlog = work / "refused-engine.stderr"
    engine = None
    saved = os.dup(2)
    t0 = time.monotonic()
    with Dumping(directory), open(errlog, "w") as fh:
        os.dup2(fh.fileno(), 2)  # the scheduler process inherits this stderr: its error lands here
        try:
            kw = dict(ENGINE_ARGS, model_path=str(ckpt))
            kw.pop("disable_radix_cache")
            # the failing scheduler SIGQUITs its parent; note it instead of dying
            engine = __import__("sglang").Engine(custom_sigquit_handler=_note_sigquit, **kw)
        except Exception as exc:
            start_error = "%s: %s" % (type(exc).__name__, exc)
        else:
            start_error = None
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if engine is not None:
                engine.shutdown()
            else:
                kill_process_tree(os.getpid(), include_parent=False)  # what Engine.shutdown does
    wall = time.monotonic() - t0
    text = errlog.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if E_NEEDLE in ln]
    files = sorted(p.name for p in directory.iterdir())
    ok = engine is None and bool(lines) and E_FIX in lines[0] and not files
    detail = "start failed after %.0f s (%s; scheduler sent SIGQUIT: %s); scheduler said: %s" % (
        wall, start_error, "yes" if _QUITS else "no", lines[0].strip()[-300:] if lines else "no refusal message")
    if engine is not None:
        detail = "the Engine STARTED with EAGLE3_DUMP_DIR set and the radix cache on; " + detail
    if files:
        detail += "; dump dir not empty: %s" % files[:5]
    if not lines:
        detail += "\n" + "\n".join(text.splitlines()[-15:])
    result(E_NAME, ok, "refused" if ok else ("started" if engine is not None else "no refusal message"), detail)


def main() -> int:
    ds_ckpt, kimi_ckpt, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    which = sys.argv[4].split(",") if len(sys.argv) > 4 else ["b", "c", "e"]
    work.mkdir(parents=True, exist_ok=True)
    prompts = tinyconfig.prompts()
    refs = None
    if "b" in which or "c" in which:
        log("HF reference for %d prompts" % len(prompts))
        ref = _hf.Reference(ds_ckpt)
        refs = [ref.run(p) for p in prompts]
        del ref

    def dump_check(name, ckpt, architecture, subdir, **engine_kw):
        """One Engine with the dump on: generate, then compare every file with HF."""

        @guarded(name)
        def run():
            directory = work / subdir
            with Dumping(directory):
                engine = start_engine(ckpt, **engine_kw)
            try:
                generate(engine, prompts, 1)
                check_dump(name, directory, prompts, refs, architecture, ckpt)
            finally:
                engine.shutdown()

        run()

    if "b" in which:
        dump_check("b. dump through sglang.Engine (DeepSeek-V3) == HF per request",
                   ds_ckpt, "DeepseekV3ForCausalLM", "dump-deepseek")
    if "c" in which:
        dump_check("c. dump through the Kimi-K2.5 wrapper (sglang.Engine, text only) == HF per request",
                   kimi_ckpt, "KimiK25ForConditionalGeneration", "dump-kimi", enable_multimodal=False)
    if "e" in which:
        # last: a failed start leaves this process in a state not worth reusing
        log("starting an Engine with the dump on and the radix cache on (must be refused)")
        guarded(E_NAME)(check_e_engine)(ds_ckpt, work)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # do not wait on threads a failed Engine start may have left behind
