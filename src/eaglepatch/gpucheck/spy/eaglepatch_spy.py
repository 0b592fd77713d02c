"""Records what the target model hands to an EAGLE-3 draft and what the draft receives.

Installed by the check's ``sitecustomize`` in every process of an engine started for the check
(never part of the series). Hooks, each applied right after its sglang module is imported:

- ``ModelRunner.forward``: after a target forward in EXTEND or TARGET_VERIFY mode whose output
  carries hidden states (the EAGLE-3 capture, CaptureHiddenMode.FULL), a ``target`` record; before
  a draft forward in EXTEND / DRAFT_EXTEND(_V2) mode, a ``draft`` record of
  ``forward_batch.spec_info.hidden_states``. ModelRunner.forward runs outside CUDA graphs (the graph
  runners replay inside it), so records hold what the replayed graphs produced.
- the draft-extend CUDA-graph runner's ``execute`` / ``replay``: a ``draft`` record of its input.
- with EAGLEPATCH_SPY_PROBE="i,j,...": before decoder layer i of DeepSeek (eager EXTEND only), a
  ``probe`` record of ``hidden_states + residual`` (what unfixed 0.5.9 captures there) and of the
  series' ``eagle3_capture.residual_stream`` (the fix: it completes the all-reduce when the
  previous layer deferred it, ``_sglang_needs_allreduce_fusion``).
  Every rank runs the probe (its all-reduce is collective); rank 0 records.
- with EAGLEPATCH_SPY_DEFER_ALLREDUCE=1: ``LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer``
  also answers True where FlashInfer's fusion would (tp > 1, 1..2048 tokens, not the last layer),
  so every non-last layer's MLP skips its all-reduce and the next layer completes it (without the
  fused kernel: the layer's unfused fallback). This is the data flow of the fusion on machines
  whose FlashInfer workspace cannot be created.

Records are ``torch.save`` dicts in EAGLEPATCH_SPY_DIR, named ``<pid>-<seq>-<kind>.pt`` (each names
the capture package loaded in its process, ``overlay``: the series', the plugin's or none); each
process also writes ``hooks-<pid>.txt`` listing the hooks it installed or could not install.
Only TP rank 0 records.
"""

from __future__ import annotations

import importlib.abc
import inspect
import itertools
import os
import sys
import threading
import time

DIR = os.environ.get("EAGLEPATCH_SPY_DIR", "")
PROBE = {int(x) for x in os.environ.get("EAGLEPATCH_SPY_PROBE", "").split(",") if x.strip()}
DEFER = os.environ.get("EAGLEPATCH_SPY_DEFER_ALLREDUCE", "") == "1"
MAX_TOKENS = 2048

_seq = itertools.count()
_lock = threading.Lock()
_TARGET_MODES = {"EXTEND", "TARGET_VERIFY"}
_DRAFT_MODES = {"EXTEND", "DRAFT_EXTEND", "DRAFT_EXTEND_V2"}


def note(msg: str) -> None:
    try:
        with _lock, open(os.path.join(DIR, "hooks-%d.txt" % os.getpid()), "a") as fh:
            fh.write(msg + "\n")
    except OSError:
        pass


def _rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _cpu(t):
    if t is None:
        return None
    try:
        return t.detach().to("cpu", copy=True)
    except AttributeError:
        return t


def _mode(fb) -> str:
    m = getattr(fb, "forward_mode", None)
    return getattr(m, "name", str(m))


# where the capture came from in this process: the series' package, the plugin's, or neither (unpatched)
OVERLAYS = ("sglang.srt.eagle3_capture", "eaglepatch_capture")


def overlay():
    """'<module>:<DELIVERY>' of the capture package loaded in this process, or None."""
    for name in OVERLAYS:
        mod = sys.modules.get(name)
        if mod is not None:
            return "%s:%s" % (name, getattr(mod, "DELIVERY", "?"))
    return None


def save(kind: str, fb, hidden, extra=None) -> None:
    """One record (TP rank 0 only)."""
    import torch

    if _rank() != 0:
        return
    esl = getattr(fb, "extend_seq_lens_cpu", None)
    spec = getattr(fb, "spec_info", None)
    rec = {
        "kind": kind,
        "pid": os.getpid(),
        "seq": next(_seq),
        "time": time.monotonic(),
        "mode": _mode(fb),
        "input_ids": _cpu(getattr(fb, "input_ids", None)),
        "positions": _cpu(getattr(fb, "positions", None)),
        "req_pool_indices": _cpu(getattr(fb, "req_pool_indices", None)),
        "seq_lens": _cpu(getattr(fb, "seq_lens", None)),
        "extend_seq_lens": [int(x) for x in esl] if esl is not None else None,
        "draft_token_num": getattr(spec, "draft_token_num", None),
        "hidden": _cpu(hidden),
        "overlay": overlay(),
    }
    rec.update(extra or {})
    name = "%d-%06d-%s.pt" % (os.getpid(), rec["seq"], kind)
    tmp = os.path.join(DIR, "." + name)
    torch.save(rec, tmp)
    os.replace(tmp, os.path.join(DIR, name))


# ---- post-import hooks --------------------------------------------------------------------

class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.todo: dict = {}

    def find_spec(self, name, path, target=None):
        if name not in self.todo:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig = loader.exec_module

        def exec_module(module, _orig=orig, _name=name):
            _orig(module)
            for fn in self.todo.pop(_name, []):
                _apply(fn, module)

        loader.exec_module = exec_module
        return spec


def _apply(fn, module) -> None:
    try:
        fn(module)
    except Exception as exc:  # a hook that cannot be installed is reported, never fatal
        note("FAILED %s: %s: %s" % (fn.__name__, type(exc).__name__, exc))


_FINDER = _AfterImport()


def when_imported(name: str, fn) -> None:
    if name in sys.modules:
        _apply(fn, sys.modules[name])
    else:
        _FINDER.todo.setdefault(name, []).append(fn)


# ---- the hooks ----------------------------------------------------------------------------

def hook_model_runner(mod) -> None:
    cls = mod.ModelRunner
    orig = cls.forward

    def forward(self, forward_batch, *args, **kwargs):
        draft = bool(getattr(self, "is_draft_worker", False))
        mode = _mode(forward_batch)
        if draft and mode in _DRAFT_MODES and not _capturing():
            hs = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
            if hs is not None:
                save("draft", forward_batch, hs, {"graph": None, "path": "ModelRunner.forward"})
        out = orig(self, forward_batch, *args, **kwargs)
        if not draft and mode in _TARGET_MODES and not _capturing():
            lo = getattr(out, "logits_output", out)
            hs = getattr(lo, "hidden_states", None)
            if hs is not None:
                save("target", forward_batch, hs, {"graph": getattr(out, "can_run_graph", None)})
        return out

    cls.forward = forward
    note("installed ModelRunner.forward")


def hook_draft_extend_graph(mod) -> None:
    done = []
    for cname in dir(mod):
        cls = getattr(mod, cname)
        if not (isinstance(cls, type) and "DraftExtend" in cname and "CudaGraphRunner" in cname):
            continue
        for meth in ("execute", "replay"):
            if meth not in vars(cls):
                continue
            orig = vars(cls)[meth]

            def wrapped(self, forward_batch, *args, _orig=orig, _meth=meth, **kwargs):
                hs = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
                if hs is not None and not _capturing():
                    save("draft", forward_batch, hs, {"graph": True, "path": "%s.%s" % (type(self).__name__, _meth)})
                return _orig(self, forward_batch, *args, **kwargs)

            setattr(cls, meth, wrapped)
            done.append("%s.%s" % (cname, meth))
    note(("installed " + ", ".join(done)) if done else "FAILED draft-extend graph runner: no execute/replay method")


def hook_dflash_worker(mod) -> None:
    """A ``draft`` record of every target state the DFlash worker writes into its draft's KV
    cache (``_append_target_hidden_to_draft_kv_by_loc``: what the draft reads, prefill and verify)."""
    cls = getattr(mod, "DFlashWorkerV2", None)
    orig = vars(cls).get("_append_target_hidden_to_draft_kv_by_loc") if cls is not None else None
    if orig is None:
        note("FAILED DFlash worker: no DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc")
        return

    class _Batch:  # what save() reads of a forward batch
        forward_mode = "DFLASH_APPEND"

    def wrapped(self, *args, **kwargs):
        hidden = kwargs.get("target_hidden", args[0] if args else None)
        if hidden is not None and not _capturing():
            fb = _Batch()
            fb.positions = kwargs.get("positions")
            commit = kwargs.get("commit_lens")
            save("draft", fb, hidden, {"graph": None, "path": "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
                                       "commit_lens": _cpu(commit)})
        return orig(self, *args, **kwargs)

    cls._append_target_hidden_to_draft_kv_by_loc = wrapped
    note("installed DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc")


def hook_communicator(mod) -> None:
    cls = mod.LayerCommunicator
    orig = cls.should_fuse_mlp_allreduce_with_next_layer

    def should_fuse(self, forward_batch):
        if orig(self, forward_batch):
            return True
        ids = getattr(forward_batch, "input_ids", None)
        n = int(ids.shape[0]) if ids is not None else 0
        if self.is_last_layer or self._context.tp_size <= 1 or not 0 < n <= MAX_TOKENS:
            return False
        if mod.get_attn_tp_context().input_scattered:
            return False
        modes = getattr(self, "layer_scatter_modes", None)
        if modes is not None and getattr(modes.mlp_mode, "name", "") == "SCATTERED":
            return False
        return True

    cls.should_fuse_mlp_allreduce_with_next_layer = should_fuse
    note("installed LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer (deferral emulated)")


def hook_decoder_layer(mod) -> None:
    cls = mod.DeepseekV2DecoderLayer
    orig = cls.forward
    sig = inspect.signature(orig)
    if "residual" not in sig.parameters:
        note("FAILED probe: DeepseekV2DecoderLayer.forward has no residual argument in this release")
        return

    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        fb = bound.arguments.get("forward_batch")
        hs = bound.arguments.get("hidden_states")
        residual = bound.arguments.get("residual")
        idx = getattr(self, "layer_id", None)
        if idx in PROBE and fb is not None and _mode(fb) == "EXTEND" and hs is not None and hs.shape[0] > 0 \
                and not _capturing():
            from sglang.srt.eagle3_capture import residual_stream  # the series' 0.5.9 capture point

            flagged = bool(getattr(hs, "_sglang_needs_allreduce_fusion", False))
            raw = hs.clone() if residual is None else hs + residual  # what unfixed 0.5.9 captures
            fixed = residual_stream(hs, residual)
            save("probe", fb, raw, {"layer_index": int(idx), "flagged": flagged, "fixed": _cpu(fixed)})
        return orig(self, *args, **kwargs)

    cls.forward = forward
    note("installed DeepseekV2DecoderLayer.forward probe at layers %s" % sorted(PROBE))


def install() -> None:
    if not DIR:
        return
    os.makedirs(DIR, exist_ok=True)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    when_imported("sglang.srt.model_executor.model_runner", hook_model_runner)
    when_imported("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner", hook_draft_extend_graph)
    when_imported("sglang.srt.speculative.dflash_worker_v2", hook_dflash_worker)
    if DEFER:
        when_imported("sglang.srt.layers.communicator", hook_communicator)
    if PROBE:
        when_imported("sglang.srt.models.deepseek_v2", hook_decoder_layer)
    note("spy active in pid %d (probe %s, deferral %s)" % (os.getpid(), sorted(PROBE), DEFER))
