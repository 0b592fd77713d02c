"""What the GPU check relies on in an sglang tree, read from its source (no import, no GPU).

``check_tree(package_parent, engine_kwargs)`` returns a list of problems (empty when the check can
run there): the spy's hook targets, the ServerArgs fields the engines are started with, the
forward modes and outputs the records are read from. tools/gpucheck.py runs it before starting any
engine; the CPU tests run it against the released wheels.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _tree(pp: Path, rel: str):
    p = Path(pp) / "sglang" / "srt" / rel
    if not p.is_file():
        return None
    return ast.parse(p.read_text(encoding="utf-8", errors="replace"))


def _classes(tree) -> dict:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} if tree is not None else {}


def _method(cls, name):
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return n
    return None


def _fields(cls) -> set:
    out = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def server_args_fields(pp: Path) -> set:
    cls = _classes(_tree(pp, "server_args.py")).get("ServerArgs")
    return _fields(cls) if cls is not None else set()


def check_tree(pp: Path, engine_kwargs: dict | None = None, probe: bool = False, deferral: bool = False,
               dflash: bool = False) -> list[str]:
    problems = []
    if dflash:  # check h: the DFlash worker's write of target states into its draft's KV cache
        dw = _classes(_tree(pp, "speculative/dflash_worker_v2.py")).get("DFlashWorkerV2")
        f = _method(dw, "_append_target_hidden_to_draft_kv_by_loc") if dw is not None else None
        if f is None or "target_hidden" not in {a.arg for a in f.args.args + f.args.kwonlyargs}:
            problems.append("speculative/dflash_worker_v2.py has no DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc"
                            "(target_hidden, ...): what a DFlash draft is handed is unseen (check h)")
    mr = _classes(_tree(pp, "model_executor/model_runner.py"))
    if "ModelRunner" not in mr or _method(mr["ModelRunner"], "forward") is None:
        problems.append("model_executor/model_runner.py has no ModelRunner.forward (the spy's main hook)")
    out_cls = mr.get("ModelRunnerOutput")
    if out_cls is None or not {"logits_output", "can_run_graph"} <= _fields(out_cls):
        problems.append("ModelRunnerOutput has no logits_output/can_run_graph: graph replays cannot be told apart")
    fbi = _tree(pp, "model_executor/forward_batch_info.py")
    modes = set()
    fm = _classes(fbi).get("ForwardMode")
    if fm is not None:
        modes = {t.id for n in fm.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for m in ("EXTEND", "TARGET_VERIFY"):
        if m not in modes:
            problems.append("ForwardMode has no %s" % m)
    if not modes & {"DRAFT_EXTEND", "DRAFT_EXTEND_V2"}:
        problems.append("ForwardMode has no DRAFT_EXTEND(_V2)")
    ge = _classes(_tree(pp, "speculative/eagle_draft_extend_cuda_graph_runner.py"))
    if not any("DraftExtend" in n and "CudaGraphRunner" in n and (_method(c, "execute") or _method(c, "replay"))
               for n, c in ge.items()):
        problems.append("no draft-extend CUDA-graph runner with execute/replay: graph-replayed draft inputs unseen")
    if deferral:
        lc = _classes(_tree(pp, "layers/communicator.py")).get("LayerCommunicator")
        if lc is None or _method(lc, "should_fuse_mlp_allreduce_with_next_layer") is None:
            problems.append("LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer is gone: the fusion's "
                            "data flow cannot be emulated in this release")
    if probe:
        dl = _classes(_tree(pp, "models/deepseek_v2.py")).get("DeepseekV2DecoderLayer")
        f = _method(dl, "forward") if dl is not None else None
        params = {a.arg for a in f.args.args} if f is not None else set()
        if not {"hidden_states", "forward_batch", "residual"} <= params:
            problems.append("DeepseekV2DecoderLayer.forward takes no residual: the layer-input probe (0.5.9's "
                            "capture point) does not apply to this release")
    if engine_kwargs:
        fields = server_args_fields(pp)
        unknown = sorted(k for k in engine_kwargs if k not in fields)
        if not fields:
            problems.append("server_args.py has no ServerArgs dataclass")
        elif unknown:
            problems.append("ServerArgs of this release has no %s" % ", ".join(unknown))
    return problems


__all__ = ["check_tree", "server_args_fields"]
