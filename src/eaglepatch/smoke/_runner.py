"""In-process ModelRunner checks (run inside the CPU environment by file path).

usage: python _runner.py CKPT_DIR WORK_DIR

a. EAGLE-3 capture through a target ModelRunner whose draft config names ids [-1, 1, 2]:
   the configured set is in place before init_device_graphs() runs, LogitsProcessorOutput
   .hidden_states (CaptureHiddenMode.FULL) is cat(aux) of HF hidden_states[0], [2], [3], and
   stays so after a set_eagle3_layers_to_capture() call with no ids.
d. Greedy tokens and logits are identical with the dump on (and writing) and off.
e. With EAGLE3_DUMP_DIR set, ModelRunner init refuses each setting that would make dumps wrong,
   with a message naming the setting.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

import _hf
import tinyconfig
from _common import CPU_SERVER_ARGS, guarded, log, maxdiff, result

EAGLE_IDS = [-1, 1, 2]
TOL = 1e-4

BASE_ARGS = dict(CPU_SERVER_ARGS, mem_fraction_static=0.5)


def server_args(ckpt: Path, **over):
    from sglang.srt.server_args import ServerArgs

    kw = dict(BASE_ARGS, model_path=str(ckpt))
    kw.update(over)
    return ServerArgs(**kw)


_PREPARED = False


def make_runner(sa, mutate=None):
    """ServerArgs -> ModelRunner, as the recipe does; ``mutate(sa)`` runs after validation."""
    global _PREPARED
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import PortArgs

    if not _PREPARED:
        _set_envs_and_config(sa)
        _PREPARED = True
    initialize_moe_config(sa)
    if mutate is not None:
        mutate(sa)
    model_config = ModelConfig.from_server_args(sa)
    return ModelRunner(
        model_config=model_config,
        mem_fraction_static=sa.mem_fraction_static,
        gpu_id=0,
        tp_rank=0,
        tp_size=1,
        moe_ep_rank=0,
        moe_ep_size=1,
        pp_rank=0,
        pp_size=1,
        nccl_port=PortArgs.init_new(sa).nccl_port,
        server_args=sa,
    )


def release(runner) -> None:
    from sglang.srt.distributed import parallel_state as ps

    del runner
    gc.collect()
    # let the next ModelRunner initialise the (single-rank) groups again
    try:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    except Exception as exc:
        log("releasing the process groups: %s" % exc)
    # 0.5.9's destroy_model_parallel() forgets the attention-TP group (an alias of TP here)
    ps._ATTN_TP = None
    # ModelRunner.initialize() asserts this global is unset (one runner per process upstream)
    from sglang.srt.eplb import expert_location

    expert_location._global_expert_location_metadata = None


@torch.no_grad()
def extend(runner, prompts, capture_full=False):
    from sglang.bench_one_batch import TreeCacheNamespace
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(rid=str(i), origin_input_text="", origin_input_ids=list(ids),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.set_extend_input_len(len(req.fill_ids) - len(req.prefix_indices))
        reqs.append(req)
    tree_cache = TreeCacheNamespace(page_size=runner.server_args.page_size, device=runner.device,
                                    token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
    batch = ScheduleBatch.init_new(
        reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=tree_cache,
        model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    fb = ForwardBatch.init_new(batch.get_model_worker_batch(), runner)
    if capture_full:
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
    out = runner.forward(fb).logits_output
    # free the KV slots so the next extend on this runner starts clean
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return out


def check_a(ckpt: Path, work: Path, ref) -> None:
    name = "a. eagle3 capture [-1,1,2] == HF hidden_states[0,2,3]"
    from sglang.srt.model_executor import model_runner as mr

    draft = work / "draft-eagle3"
    _hf.build_draft(draft, EAGLE_IDS)
    snap = {}
    orig = mr.ModelRunner.init_device_graphs

    def spy(self):  # the ordering proof: what is configured when graphs would be captured
        snap["layers_to_capture"] = list(getattr(self.model.model, "layers_to_capture", []))
        snap["capture_aux"] = bool(getattr(self.model, "capture_aux_hidden_states", False))
        return orig(self)

    mr.ModelRunner.init_device_graphs = spy
    try:
        sa = server_args(ckpt, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                         speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
        runner = make_runner(sa)
    finally:
        mr.ModelRunner.init_device_graphs = orig
    want_idx = [k + 1 for k in EAGLE_IDS]
    problems = []
    if not runner.eagle_use_aux_hidden_state or list(runner.eagle_aux_hidden_state_layer_ids) != EAGLE_IDS:
        problems.append("runner did not read eagle ids from the draft config (%r)"
                        % (getattr(runner, "eagle_aux_hidden_state_layer_ids", None),))
    if snap.get("layers_to_capture") != want_idx or not snap.get("capture_aux"):
        problems.append("before init_device_graphs layers_to_capture=%r capture_aux=%r, want %r"
                        % (snap.get("layers_to_capture"), snap.get("capture_aux"), want_idx))
    prompts = tinyconfig.prompts()
    refs = [ref.run(p)[0] for p in prompts]
    H = tinyconfig.DEEPSEEK_V3["hidden_size"]

    def compare(tag):
        out = extend(runner, prompts, capture_full=True)
        hs = out.hidden_states
        if hs is None:
            raise AssertionError("%s: LogitsProcessorOutput.hidden_states is None" % tag)
        total = sum(len(p) for p in prompts)
        if tuple(hs.shape) != (total, H * len(EAGLE_IDS)):
            raise AssertionError("%s: hidden_states shape %s, want (%d, %d)" % (tag, tuple(hs.shape), total, H * len(EAGLE_IDS)))
        worst, start = 0.0, 0
        for p, r in zip(prompts, refs):
            rows = hs[start:start + len(p)]
            for j, k in enumerate(EAGLE_IDS):
                worst = max(worst, maxdiff(rows[:, j * H:(j + 1) * H], r[k + 1]))
            start += len(p)
        return worst

    d1 = compare("configured")
    runner.model.set_eagle3_layers_to_capture()  # what CUDA-graph capture / warm-up call
    after = list(runner.model.model.layers_to_capture)
    if after != want_idx:
        problems.append("a no-id set_eagle3_layers_to_capture() changed layers_to_capture to %r" % after)
    d2 = compare("after no-id call")
    d = max(d1, d2)
    if d > TOL:
        problems.append("max abs diff %.3g > %g" % (d, TOL))
    detail = ("target ModelRunner with speculative_algorithm=EAGLE3, draft eagle_config ids %s; "
              "layers_to_capture before init_device_graphs=%s; diff configured %.3g, after no-id call %.3g; "
              "%d prompts in one extend" % (EAGLE_IDS, snap.get("layers_to_capture"), d1, d2, len(prompts)))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(name, not problems, "max abs diff %.2g" % d, detail)
    release(runner)


# setting -> (mutation on the validated ServerArgs, text the refusal must contain)
REFUSALS = [
    ("radix cache on", lambda sa: setattr(sa, "disable_radix_cache", False), "--disable-radix-cache"),
    ("chunked prefill < context length", lambda sa: setattr(sa, "chunked_prefill_size", 256), "--chunked-prefill-size"),
    ("mixed chunk", lambda sa: setattr(sa, "enable_mixed_chunk", True), "--enable-mixed-chunk"),
    ("two-batch overlap", lambda sa: setattr(sa, "enable_two_batch_overlap", True), "--enable-two-batch-overlap"),
    ("piecewise cuda graph", lambda sa: setattr(sa, "enable_piecewise_cuda_graph", True), "--enable-piecewise-cuda-graph"),
    ("dp attention", lambda sa: setattr(sa, "enable_dp_attention", True), "--enable-dp-attention"),
    ("pp > 1", lambda sa: setattr(sa, "pp_size", 2), "--pp-size"),
    ("deepep a2a", lambda sa: setattr(sa, "moe_a2a_backend", "deepep"), "--moe-a2a-backend"),
    ("mooncake a2a", lambda sa: setattr(sa, "moe_a2a_backend", "mooncake"), "--moe-a2a-backend"),
]


def check_e(ckpt: Path, work: Path) -> None:
    dump = work / "dump-refused"
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["EAGLE3_DUMP_DIR"] = str(dump)
    os.environ["EAGLE3_DUMP_LAYERS"] = "-1,1,2"
    try:
        for label, mutate, needle in REFUSALS:
            _refusal(ckpt, label, mutate, needle)
    finally:
        os.environ.pop("EAGLE3_DUMP_DIR", None)
        os.environ.pop("EAGLE3_DUMP_LAYERS", None)
    left = sorted(p.name for p in dump.iterdir())
    if left:
        result("e. refusals leave the dump dir empty", False, "%d files" % len(left), ", ".join(left[:5]))


def _refusal(ckpt, label, mutate, needle):
    name = "e. refused in ModelRunner init: %s" % label

    @guarded(name)
    def run():
        sa = server_args(ckpt, load_format="dummy")  # refused after loading: weights do not matter
        try:
            runner = make_runner(sa, mutate=mutate)
        except Exception as exc:
            msg = str(exc)
            ok = "EAGLE3_DUMP_DIR" in msg and needle in msg
            result(name, ok, "refused" if ok else "wrong error",
                   "%s: %s" % (type(exc).__name__, msg[:400]) + ("" if ok else " (want a message naming %s)" % needle))
            release(None)
            return
        result(name, False, "started", "ModelRunner started with EAGLE3_DUMP_DIR set and %s" % label)
        release(runner)

    run()


D_NAME = "d. greedy tokens and logits identical with the dump on and off"
D_STEPS = 4


@torch.no_grad()
def greedy(runner, prompts, steps):
    """Prefill + (steps-1) decode steps through bench_one_batch's extend/decode (real sampling)."""
    from sglang.bench_one_batch import decode as b_decode
    from sglang.bench_one_batch import extend as b_extend
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(rid=str(i), origin_input_text="", origin_input_ids=list(ids),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=steps))
        req.fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.set_extend_input_len(len(req.fill_ids) - len(req.prefix_indices))
        reqs.append(req)
    ids, logits, batch = b_extend(reqs, runner)
    tokens, all_logits = [ids.tolist()], [logits.float().clone()]
    for _ in range(steps - 1):
        ids, logits = b_decode(ids, batch, runner)
        tokens.append(ids.tolist())
        all_logits.append(logits.float().clone())
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return tokens, torch.stack(all_logits)


def check_d(ckpt: Path, work: Path) -> None:
    """Dump on (and really writing) vs dump off: same greedy tokens, bit-identical logits."""
    prompts = tinyconfig.prompts()[:4]
    dump = work / "dump-d"
    dump.mkdir(parents=True, exist_ok=True)
    out = {}
    for mode in ("on", "off"):
        if mode == "on":
            os.environ["EAGLE3_DUMP_DIR"] = str(dump)
            os.environ["EAGLE3_DUMP_LAYERS"] = "-1,1,2"
        runner = make_runner(server_args(ckpt))
        try:
            out[mode] = greedy(runner, prompts, D_STEPS)
            if mode == "on":
                from sglang.srt.eagle3_capture import capture_target

                capture_target(runner.model)._eagle3_capture_state.writer.flush()
        finally:
            os.environ.pop("EAGLE3_DUMP_DIR", None)
            os.environ.pop("EAGLE3_DUMP_LAYERS", None)
            release(runner)
    files = sorted(dump.glob("*.safetensors"))
    (ton, lon), (toff, loff) = out["on"], out["off"]
    d = maxdiff(lon, loff)
    problems = []
    if len(files) != len(prompts):
        problems.append("the dump-on run wrote %d files, want %d (one per prefilled request)" % (len(files), len(prompts)))
    if ton != toff:
        problems.append("greedy tokens differ: on %s, off %s" % (ton, toff))
    if d != 0.0:
        problems.append("logits differ by %.3g (want identical)" % d)
    detail = ("%d requests, prefill + %d decode steps in-process (ModelRunner, sampling at temperature 0); "
              "tokens %s; logits [%s] compared; dump-on run wrote %d files"
              % (len(prompts), D_STEPS - 1, "equal" if ton == toff else "DIFFER",
                 "x".join(str(n) for n in lon.shape), len(files)))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(D_NAME, not problems, "max abs diff %.2g" % d, detail)


def main() -> int:
    ckpt, work = Path(sys.argv[1]), Path(sys.argv[2])
    which = sys.argv[3].split(",") if len(sys.argv) > 3 else ["a", "d", "e"]
    work.mkdir(parents=True, exist_ok=True)
    if "a" in which:
        log("loading the HF reference")
        ref = _hf.Reference(ckpt)
        guarded("a. eagle3 capture [-1,1,2] == HF hidden_states[0,2,3]")(check_a)(ckpt, work, ref)
    if "d" in which:
        guarded(D_NAME)(check_d)(ckpt, work)
    if "e" in which:
        check_e(ckpt, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
