"""EAGLE-3 hidden-state capture for DeepSeek-V2/V3 and Kimi-K2.5 (eaglepatch series).

The upstream files call into this package with one-line hooks; all logic lives here, the same
for every sglang release the series covers (release differences are detected at run time;
``release`` names the release this copy was generated for):

- ``residual_stream``: the residual stream entering a decoder layer, as an owned tensor,
  also at the first layer where the residual is still ``None`` (EAGLE-3 layer id -1). Used by
  releases that capture in ``DeepseekV2Model.forward``'s layer loop.
- ``set_eagle3_layers``: reads draft-config ids exactly as unpatched sglang of this release
  does wherever it serves the list (``settings.capture_indices``), and adds -1 (the embedding
  output) and the last layer's output before the final norm; a call without ids keeps an
  explicitly configured set, so CUDA-graph capture and warm-up runs do not reset the layers to
  the defaults.
- ``check_launch``: the launching process refuses, in one line and before any weight loads,
  dump settings under which rows would be incomplete or wrong.
- ``configure_runner``: configures capture before device graphs are captured (releases that
  set the draft's ids only afterwards) and starts the per-request prefill hidden-state dump
  when ``EAGLE3_DUMP_DIR`` is set. With a dump, a forward pre-hook on the decoder stack picks the
  capture set per forward: the dump's layers only in plain prefill (EXTEND), elsewhere only the
  draft's (none without a draft), so decode and its CUDA graphs capture nothing for the dump.
- ``after_model``: hands captured states to the dump and the EAGLE-3 subset to the logits
  processor (as a list, or as one packed ``[T, K * hidden]`` tensor where the release packs).
- ``LanguageModelDelegate`` / ``capture_target``: capture and dump through a multimodal
  wrapper that holds the text model as ``language_model``.

Capture index i is the residual stream entering decoder layer i (0 = embedding output), the
same as the index into Hugging Face ``output_hidden_states``; index N (num_hidden_layers) is the
last layer's output before the final norm. How draft ids map to indices is the release's
(``settings.capture_indices``).
"""

from __future__ import annotations

import logging
from typing import List, Optional

from .release import DELIVERY
from .settings import (
    DUMP_VARS,
    SERIES_VERSION,
    check_launch,
    DumpConfigError,
    DumpSettings,
    capture_indices,
    default_capture_indices,
    release_facts,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SERIES_VERSION",
    "DumpConfigError",
    "LanguageModelDelegate",
    "after_model",
    "capture_target",
    "check_launch",
    "configure_runner",
    "residual_stream",
    "set_eagle3_layers",
]


class CaptureState:
    """Which capture indices feed the EAGLE-3 draft and which feed the dump.

    Capture index N (N = num_hidden_layers: the last layer's output before the final norm,
    EAGLE-3 id N-1) is not in any release's layer loop; a forward hook on the final norm takes
    it (``last``) while it is configured."""

    def __init__(self):
        self.eagle: Optional[List[int]] = None
        self.eagle_configured = False
        self.writer = None  # the dump's DumpWriter, None without a dump
        self.last = None  # the residual stream entering the final norm, this forward
        self.last_hook = None
        self.mode_hook = None  # with a dump: the forward pre-hook that picks the route per forward
        self.routes = {}  # "extend" (prefill: the dump's and the draft's) / "other" (the draft's)
        self.raw_ids = None  # a multimodal wrapper's prefill ids before it clamps them
        # the routing after_model follows, set by _sync whenever eagle or the writer change:
        self.in_loop: List[int] = []  # indices the layer loop captures, in order
        self.last_index: Optional[int] = None  # num_hidden_layers when the final-norm hook is on
        self.eagle_order: Optional[List[int]] = None  # sorted(set(eagle)); None before any ids
        self.aux_is_eagle = False  # the loop's captures are exactly the draft's
        self.passthrough = False  # no dump, no hook, aux_is_eagle: the captures need no routing

    @property
    def dump(self) -> Optional[List[int]]:
        """The capture indices the dump writes (those of the writer's ids), None without one."""
        if self.writer is None:
            return None
        return list(self.writer.indices)

    def order(self) -> List[int]:
        return sorted(set(self.eagle or ()) | set(self.dump or ()))


def _state(model) -> CaptureState:
    state = getattr(model, "_eagle3_capture_state", None)
    if state is None:
        state = CaptureState()
        model._eagle3_capture_state = state
        if DELIVERY == "plugin":
            _route_inner_output(model)
    return state


def _route_inner_output(model) -> None:
    """Plugin delivery only: what the series' line in ``DeepseekV2ForCausalLM.forward`` does
    (``hidden_states = after_model(self, hidden_states, forward_batch)`` right after the call
    of the decoder stack), as a forward hook on this model's decoder stack instance: module
    hooks run around the call, outside anything compiled inside it. Only on a model whose forward
    is DeepseekV2ForCausalLM's, the one forward the series changes (a NextN draft's own forward,
    or another architecture's, never calls after_model there either)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    if type(model).forward is not DeepseekV2ForCausalLM.forward:
        return

    def hook(module, args, kwargs, output):
        # the forward calls self.model(input_ids, positions, forward_batch, ...)
        return after_model(model, output, kwargs["forward_batch"] if "forward_batch" in kwargs else args[2])

    model.model.register_forward_hook(hook, with_kwargs=True)


def _keep_last(state: CaptureState):
    """Forward hook of the final norm: keep the residual stream it normalised (owned)."""

    def hook(module, args, kwargs, output):
        if state.last_index is None:  # this forward's route takes no final-norm capture
            return
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        if residual is None:  # norm(x): x itself is the stream
            state.last = args[0].clone()
        elif isinstance(output, tuple) and len(output) >= 2 and output[1] is not None:
            state.last = output[1].clone()  # norm(x, residual) -> (normed, x + residual)
        else:
            raise RuntimeError(
                "eagle3_capture: the final norm returned no updated residual; the last layer's "
                "output (EAGLE-3 id num_hidden_layers - 1) cannot be captured in this release"
            )

    return hook


def _route(indices, num_layers: int, eagle: Optional[List[int]], dump: bool) -> dict:
    """What the layer loop captures and how after_model routes it, for one set of indices."""
    in_loop = [i for i in indices if i < num_layers]
    eagle_order = sorted(set(eagle)) if eagle is not None else None
    wants_last = num_layers in indices
    aux_is_eagle = eagle_order == in_loop
    return {"in_loop": in_loop, "last_index": num_layers if wants_last else None,
            "eagle_order": eagle_order, "aux_is_eagle": aux_is_eagle,
            "passthrough": not dump and not wants_last and aux_is_eagle}


def _use(model, state: CaptureState, route: dict) -> None:
    for name, value in route.items():
        setattr(state, name, value)
    model.model.layers_to_capture = list(route["in_loop"])


def _forward_mode(args, kwargs):
    """The forward mode's name of a DeepseekV2Model call (forward_batch is its third argument)."""
    batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
    mode = getattr(batch, "forward_mode", None)
    return getattr(mode, "name", None)


def _pick_route(model, state: CaptureState):
    """Forward pre-hook of DeepseekV2Model (called as a module, so module hooks fire, also while
    a CUDA graph is recorded): the dump's layers only in EXTEND (plain prefill, all the dump
    writes); any other forward (decode, verify, idle, draft extend) captures only what the
    draft needs, so a dump-only server captures nothing there and its decode graphs hold no
    capture."""

    def hook(module, args, kwargs):
        mode = _forward_mode(args, kwargs)
        key = "other" if mode is not None and mode != "EXTEND" else "extend"
        _use(model, state, state.routes[key])

    return hook


def _sync(model, state: CaptureState) -> None:
    num_layers = model.config.num_hidden_layers
    order = state.order()
    dump = state.writer is not None
    state.routes = {"extend": _route(order, num_layers, state.eagle, dump)}
    if dump:
        state.routes["other"] = _route(sorted(set(state.eagle or ())), num_layers, state.eagle, False)
    _use(model, state, state.routes["extend"])
    wants_last = any(r["last_index"] is not None for r in state.routes.values())
    if wants_last and state.last_hook is None:
        state.last_hook = model.model.norm.register_forward_hook(_keep_last(state), with_kwargs=True)
    elif not wants_last and state.last_hook is not None:
        state.last_hook.remove()
        state.last_hook = None
    if dump and state.mode_hook is None:
        state.mode_hook = model.model.register_forward_pre_hook(_pick_route(model, state), with_kwargs=True)
    elif not dump and state.mode_hook is not None:
        state.mode_hook.remove()
        state.mode_hook = None


def residual_stream(hidden_states, residual):
    """The residual stream entering a layer; an owned tensor even when residual is None.

    With tensor parallelism and FlashInfer's all-reduce fusion (sglang 0.5.9 turns it on for
    DeepSeek-V3 and Kimi-K2.5 on Hopper/Blackwell, for batches of <= 2048 tokens), the previous
    layer leaves its MLP all-reduce to this layer's fused norm and marks ``hidden_states``
    (``_sglang_needs_allreduce_fusion``): this rank then holds only its share. The capture
    completes the sum on a copy (the fused norm still gets the share). The mark is set in the
    same Python pass that records a CUDA graph, so a graph holds the extra all-reduce exactly
    when it holds the deferral."""
    if residual is None:
        return hidden_states.clone()
    mark = _fusion_mark()
    if mark and getattr(hidden_states, mark, False):  # set on the deferring layers' outputs only
        from sglang.srt.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(hidden_states.clone()) + residual
    return hidden_states + residual


_FACTS = {}


def _fusion_mark() -> Optional[str]:
    """The release's deferred all-reduce mark (settings.RELEASE_FACTS), read once."""
    if "mark" not in _FACTS:
        _FACTS["mark"] = release_facts()["allreduce_fusion_mark"]
    return _FACTS["mark"]


def set_eagle3_layers(model, layer_ids: Optional[List[int]] = None) -> None:
    """Configure EAGLE-3 capture on a DeepseekV2ForCausalLM (last pipeline rank)."""
    state = _state(model)
    num_layers = model.config.num_hidden_layers
    if layer_ids is not None:
        state.eagle = capture_indices(layer_ids, num_layers, "eagle_aux_hidden_state_layer_ids")
        state.eagle_configured = True
        logger.info("EAGLE-3 draft layer ids %s -> capture indices %s (HF output_hidden_states indices)",
                    list(layer_ids), state.eagle)
    elif not state.eagle_configured:
        state.eagle = default_capture_indices(num_layers)
    model.capture_aux_hidden_states = True
    _sync(model, state)


class LanguageModelDelegate:
    """Mixin for wrappers that hold the text model as ``self.language_model``."""

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[List[int]] = None):
        return self.language_model.set_eagle3_layers_to_capture(layer_ids)

    def get_embed_and_head(self):
        return self.language_model.get_embed_and_head()

    def set_embed_and_head(self, embed, head):
        return self.language_model.set_embed_and_head(embed, head)


def capture_target(model):
    """The module that owns the decoder stack (the language model of a wrapper)."""
    inner = getattr(model, "language_model", None)
    if inner is not None and hasattr(inner, "set_eagle3_layers_to_capture") and hasattr(inner, "model"):
        return inner
    return model


def _draft_ids_to_configure(runner):
    """(configure, ids): whether the runner sets the draft's ids only after device graphs (sglang
    <= 0.5.10 keeps them on the runner itself; later releases configure them before graphs), and
    the ids (None: the draft's config names none, so SGLang's defaults)."""
    if not release_facts()["draft_ids_on_runner"]:
        return False, None
    if runner.eagle_use_aux_hidden_state:
        ids = runner.eagle_aux_hidden_state_layer_ids
        return True, (list(ids) if ids is not None else None)
    return False, None


def _keep_raw_ids(wrapper, state: CaptureState) -> None:
    """Multimodal wrappers clamp the pad values of image tokens out of ``input_ids`` in place
    before the language model runs; keep a copy of a prefill's ids for the dump. ModelRunner
    calls ``model.forward`` directly (no module hooks fire), so the instance's forward is
    wrapped."""
    inner = wrapper.forward

    def forward(input_ids, positions, forward_batch, *args, **kwargs):
        if input_ids is not None and forward_batch.forward_mode.name == "EXTEND":
            state.raw_ids = input_ids.clone()
        return inner(input_ids, positions, forward_batch, *args, **kwargs)

    wrapper.forward = forward


def _dump_fingerprint(env=None) -> str:
    """What this process's EAGLE3_DUMP_* variables say, as one comparable string."""
    import os

    env = os.environ if env is None else env
    return repr(sorted((k, env[k].strip()) for k in DUMP_VARS if env.get(k, "").strip()))


def same_dump_on_every_node(fingerprint: str, group, world_size: int, ranks_per_node: int) -> None:
    """Every rank of a tensor-parallel group spanning nodes sends its dump settings to all
    (``group``: the group's CPU (gloo) process group); settings that differ refuse on every rank,
    so no node dumps partial rows or waits in a collective the others never join."""
    import torch.distributed as dist

    everyone = [None] * world_size
    dist.all_gather_object(everyone, fingerprint, group=group)
    if len(set(everyone)) > 1:
        nodes = {}
        for rank, fp in enumerate(everyone):
            nodes.setdefault(fp, set()).add(rank // max(ranks_per_node, 1))
        parts = ["node%s %s: %s" % ("s" if len(n) > 1 else "", ",".join(map(str, sorted(n))), fp)
                 for fp, n in nodes.items()]
        raise DumpConfigError(
            "the EAGLE3_DUMP_* variables differ between the nodes of this tensor-parallel group (%s); "
            "set the same EAGLE3_DUMP_DIR, EAGLE3_DUMP_LAYERS, EAGLE3_DUMP_FINAL and "
            "EAGLE3_DUMP_MAX_PENDING_MB on every node, or none" % "; ".join(parts))


def _check_nodes(runner) -> None:
    """With ``--nnodes`` > 1 a launch check sees one node only: the TP group compares settings."""
    from .settings import resolved

    args = resolved(runner.server_args)
    nnodes = args.nnodes
    if nnodes <= 1:
        return
    from sglang.srt.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    same_dump_on_every_node(_dump_fingerprint(), tp.cpu_group, tp.world_size,
                            max(tp.world_size // nnodes, 1))


def configure_runner(runner) -> None:
    """Called by ModelRunner after the model is loaded, before device graphs are captured."""
    configure, ids = _draft_ids_to_configure(runner)
    if configure:
        runner.model.set_eagle3_layers_to_capture(ids)
    if runner.is_draft_worker:
        return
    _follow_draft_setters(capture_target(runner.model))
    _check_nodes(runner)  # every rank, dump or not, before any rank may refuse alone
    settings = DumpSettings.from_env()
    if settings is None:
        return
    from .dump import start_dump

    target = capture_target(runner.model)
    state = _state(target)
    state.writer = start_dump(runner, target, settings)
    if target is not runner.model and state.writer.enabled:  # only the writing rank reads the ids
        _keep_raw_ids(runner.model, state)
    _sync(target, state)


def _follow_draft_setters(target) -> None:
    """A DFlash or DSpark draft's setter (``release_facts()["draft_setters"]``) runs as upstream wrote
    it, reading the draft's ids exactly as unpatched sglang does; the capture it set becomes the
    draft's, routed as the package routes EAGLE-3's: the draft is handed exactly its own states
    (what upstream hands it, wherever upstream can capture them), the last layer's output before
    the final norm is captured too (a DFlash id N-1, which upstream's layer loop never reaches),
    and with a dump its layers go beside them (prefill: both; every other forward: the draft's)."""
    for name in release_facts()["draft_setters"]:
        inner = getattr(target, name, None)
        if inner is None or getattr(inner, "_eagle3_follows", False):
            continue

        def follow(layer_ids, *args, _inner=inner, _name=name, **kwargs):
            out = _inner(layer_ids, *args, **kwargs)
            upstream = list(target.model.layers_to_capture)  # what unpatched sglang captures for the draft
            state = _state(target)
            state.eagle = upstream
            state.eagle_configured = True
            logger.info("%s(%s) -> capture indices %s, as upstream reads them (HF output_hidden_states indices)",
                        _name, list(layer_ids), upstream)
            _sync(target, state)
            return out

        follow._eagle3_follows = True
        follow.__doc__ = getattr(inner, "__doc__", None)
        setattr(target, name, follow)


def _split(aux, count: int):
    """Captured states as a list (releases that pack them use one [T, K * H] tensor)."""
    if isinstance(aux, (list, tuple)):
        return list(aux)
    return list(aux.split(aux.shape[-1] // count, dim=-1))


def after_model(model, output, forward_batch):
    """Route the output of DeepseekV2Model.forward: dump first, then the EAGLE-3 subset."""
    state = getattr(model, "_eagle3_capture_state", None)
    if state is None:
        return output
    in_loop = state.in_loop
    final, aux = output if isinstance(output, tuple) else (output, None)
    if state.passthrough and (aux is not None or not in_loop):
        # nothing to dump, no final-norm capture, the draft takes what the loop captured
        if not model.capture_aux_hidden_states:
            return final
        return final, (aux if aux is not None else [])
    captured = dict(zip(in_loop, _split(aux, len(in_loop)) if in_loop else ()))
    if state.last_index is not None:
        last, state.last = state.last, None
        if last is None:  # the final norm did not run: an idle batch has no rows
            if final.shape[0]:
                raise RuntimeError("eagle3_capture: the final norm ran without its capture hook")
            last = final
        captured[state.last_index] = last
    if state.writer is not None:
        raw_ids, state.raw_ids = state.raw_ids, None
        state.writer.submit(forward_batch, captured, final, input_ids=raw_ids)
    if not model.capture_aux_hidden_states:
        return final
    eagle = state.eagle_order  # None only before any ids: iterating it fails as before
    if aux is not None and state.aux_is_eagle:
        return final, aux  # exactly what upstream captured
    subset = [captured[i] for i in eagle]
    if aux is None or isinstance(aux, (list, tuple)):
        return final, subset
    import torch

    return final, torch.cat(subset, dim=-1)
