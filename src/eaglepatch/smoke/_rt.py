"""What differs between sglang releases for the in-process smoke checks (worker side).

Everything goes through the release's own one-batch benchmark module (``sglang.bench_one_batch``
up to 0.5.17, ``sglang.benchmark.one_batch`` later): its ``load_model`` builds the ModelRunner
the way that release initialises one, its ``prepare_synthetic_inputs_for_latency_test`` builds
the requests and its ``extend`` / ``decode`` run them. Differences left are detected here by
what the release has, never by its version number.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util

from _common import CPU_SERVER_ARGS, log

_BENCH = None
_PREPARED = False


def bench():
    """The release's one-batch benchmark module."""
    global _BENCH
    if _BENCH is None:
        for name in ("sglang.benchmark.one_batch", "sglang.bench_one_batch"):
            if importlib.util.find_spec(name.rsplit(".", 1)[0]) and importlib.util.find_spec(name):
                _BENCH = importlib.import_module(name)
                break
        else:
            raise ImportError("neither sglang.benchmark.one_batch nor sglang.bench_one_batch exists")
        _BENCH.get_tokenizer = lambda *a, **k: None  # the tiny checkpoints have no tokenizer
    return _BENCH


def server_args(ckpt, **over):
    from sglang.srt.server_args import ServerArgs

    kw = dict(CPU_SERVER_ARGS, model_path=str(ckpt), mem_fraction_static=0.5)
    kw.update(over)
    sa = ServerArgs(**kw)
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    return sa


def _prepare_process(sa) -> None:
    """Process-wide set-up that each release's benchmark does once before loading a model."""
    global _PREPARED
    b = bench()
    if not _PREPARED:
        b._set_envs_and_config(sa)
        _PREPARED = True
    try:  # releases with a runtime context publish this process's role and ranks
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    except ImportError:
        pass
    else:
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(sa, tp_rank=0, pp_rank=0),
                                                      gpu_id=0))
    if hasattr(b, "_init_process_global_configs"):
        b._init_process_global_configs()
    else:
        from sglang.srt.layers.moe import initialize_moe_config

        initialize_moe_config(sa)


def make_runner(sa):
    """ServerArgs -> a ready ModelRunner."""
    from sglang.srt.server_args import PortArgs

    port_args = PortArgs.init_new(sa)
    _prepare_process(sa)
    runner, _ = bench().load_model(sa, port_args, 0, 0)
    for name in ("torch_runner", "model_runner"):  # later releases wrap it for the benchmark
        runner = getattr(runner, name, runner)
    return runner


def requests(prompts, max_new_tokens=1, rids=None):
    """The release's Req objects for ``prompts``; each with its own request id (``rids``, or new
    unique ones: the benchmark numbers every call's requests 0, 1, ..., and the dump names a file
    by its request id)."""
    import uuid

    b = bench()
    b.BenchArgs.output_len = max_new_tokens
    reqs = b.prepare_synthetic_inputs_for_latency_test(len(prompts), 0, [list(p) for p in prompts])
    call = uuid.uuid4().hex[:12]
    for i, r in enumerate(reqs):
        r.rid = str(rids[i]) if rids is not None else "smoke-%s-%d" % (call, i)
    return reqs


class _Capture:
    """During ``with``: prefills set CaptureHiddenMode.FULL and the last forward output is kept."""

    def __init__(self, runner, full: bool):
        self.runner, self.full, self.output = runner, full, None

    def __enter__(self):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        self._orig = ForwardBatch.__dict__["init_new"]  # the classmethod object itself
        orig, full = self._orig.__func__, self.full

        def init_new(cls, *args, **kw):
            fb = orig(cls, *args, **kw)
            if full:
                fb.capture_hidden_mode = CaptureHiddenMode.FULL
            return fb

        inner = self.runner.forward

        def forward(*args, **kw):
            out = inner(*args, **kw)
            self.output = out
            return out

        ForwardBatch.init_new = classmethod(init_new)
        self.runner.forward = forward
        return self

    def __exit__(self, *exc):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        ForwardBatch.init_new = self._orig
        del self.runner.forward  # back to the class attribute
        return False


def clear(runner) -> None:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()


def extend(runner, prompts, capture_full=False, rids=None):
    """One prefill of all prompts; the LogitsProcessorOutput (hidden_states with capture_full)."""
    import torch

    with torch.no_grad(), _Capture(runner, capture_full) as cap:
        bench().extend(requests(prompts, rids=rids), runner)
    clear(runner)
    return cap.output.logits_output


def greedy(runner, prompts, steps):
    """Prefill + (steps - 1) decode steps at temperature 0: (tokens per step, logits [steps, B, V])."""
    import torch

    b = bench()
    with torch.no_grad():
        ids, logits, batch = b.extend(requests(prompts, steps), runner)
        tokens, all_logits = [ids.tolist()], [logits.float().clone()]
        for _ in range(steps - 1):
            ids, logits = b.decode(ids, batch, runner)
            tokens.append(ids.tolist())
            all_logits.append(logits.float().clone())
    clear(runner)
    return tokens, torch.stack(all_logits)


def release(runner) -> None:
    """Drop a runner so that the next one can initialise the (single-rank) groups again."""
    from sglang.srt.distributed import parallel_state as ps

    del runner
    gc.collect()
    try:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    except Exception as exc:
        log("releasing the process groups: %s" % exc)
    if hasattr(ps, "_ATTN_TP"):  # 0.5.9's destroy_model_parallel() forgets this alias of TP
        ps._ATTN_TP = None
    from sglang.srt.eplb import expert_location  # asserted unset (one runner per process upstream)

    if hasattr(expert_location, "_global_expert_location_metadata"):
        expert_location._global_expert_location_metadata = None
    else:
        expert_location.set_global_expert_location_metadata(None, allow_overwrite=True)
