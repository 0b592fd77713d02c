"""Functional checks of patches/sglang-0.5.23 with the real sglang 0.5.23 on CPU.

The test side builds (once, cached) the CPU environment from src/eaglepatch/cpu-requirements-0.5.23.txt
with eaglepatch.cpuenv, a patched copy of the released wheel (series + smoke.series) and the tiny
checkpoints (eaglepatch.smoke._hf), then runs this same file as a worker inside that environment,
one process per model. The worker drives a real in-process ModelRunner as sglang's own
`sglang.benchmark.one_batch` does and prints one `@@RESULT {json}` line per check:

- deepseek: EAGLE-3 ids [-1, 1, 2] (layer -1 = embedding output) give HF hidden_states[0, 2, 3];
  a `set_eagle3_layers_to_capture()` without ids keeps them; with EAGLE3_DUMP_DIR (layers -1,0,2)
  one safetensors file per request equals the HF reference (layers, final, ids, metadata), and the
  logits/next tokens equal HF's (output unchanged by capture and dump).
- kimi: the Kimi-K2.5 wrapper (upstream delegation) configures the language model's capture and
  its dump equals the same HF reference.

usage (worker): python test_functional_0523.py worker deepseek|kimi CKPT HF_CKPT WORK
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "src" / "eaglepatch" / "smoke"
REQUIREMENTS = REPO / "src" / "eaglepatch" / "cpu-requirements-0.5.23.txt"
SERIES = REPO / "patches" / "sglang-0.5.23"
EAGLE_IDS = [-1, 1, 2]
DUMP_IDS = [-1, 0, 2]
TOL = 1e-4


# =============================================================================================
# worker (runs inside the CPU sglang 0.5.23 environment)

def _result(name, passed, figure, detail=""):
    print("@@RESULT " + json.dumps({"name": name, "passed": bool(passed), "figure": figure, "detail": detail}),
          flush=True)


def _runner(ckpt):
    from sglang.benchmark import one_batch as ob
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    sa = ServerArgs(model_path=str(ckpt), device="cpu", skip_tokenizer_init=True, attention_backend="torch_native",
                    disable_cuda_graph=True, dtype="float32", disable_radix_cache=True,
                    disable_overlap_schedule=True, max_total_tokens=4096, context_length=1024,
                    max_running_requests=8, random_seed=0, mem_fraction_static=0.5)
    sa.resolve_once()
    _set_envs_and_config(sa)
    port_args = PortArgs.init_new(sa)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(sa, tp_rank=0, pp_rank=0),
                                                  gpu_id=0))
    ob._init_process_global_configs()
    mc = ModelConfig.from_server_args(sa)
    bootstrap.init_parallel_runtime(server_args=sa, device=get_device().device, dist_port=port_args.nccl_port)
    bootstrap.init_layer_runtime(model_config=mc)
    r = ModelRunner(model_config=mc, mem_fraction_static=0.5, gpu_id=0, nccl_port=port_args.nccl_port,
                    server_args=sa)
    r.alloc_memory_pool()
    r.init_attention_backends()
    r.init_cuda_graphs()
    return r


def _extend(runner, prompts):
    """One prefill of all prompts (as sglang.benchmark.one_batch.extend), with FULL hidden capture."""
    from array import array

    import torch
    from sglang.benchmark.one_batch import TreeCacheNamespace
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(rid=i, origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(req.origin_input_ids)
        reqs.append(req)
    tree_cache = TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                                    token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
    batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                   token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                   tree_cache=tree_cache, model_config=runner.model_config, enable_overlap=False,
                                   spec_algorithm=SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
        batch.prefill_input_ids_cpu = None
    fb = ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    with torch.no_grad():
        out = runner.forward(fb).logits_output
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return out


def _maxdiff(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    return float((a - b).abs().max()) if a.numel() else 0.0


def worker(kind, ckpt, hf_ckpt, work):
    sys.path.insert(0, str(SMOKE))
    import _hf
    import tinyconfig
    import torch
    from safetensors import safe_open

    work = Path(work)
    dump = work / f"dump-{kind}"
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["EAGLE3_DUMP_DIR"] = str(dump)
    os.environ["EAGLE3_DUMP_LAYERS"] = ",".join(map(str, DUMP_IDS))
    ref = _hf.Reference(Path(hf_ckpt))
    prompts = tinyconfig.prompts()[:5]
    refs = [ref.run(p) for p in prompts]
    runner = _runner(ckpt)
    from sglang.srt.eagle3_capture import capture_target

    target = capture_target(runner.model)
    # what upstream's configure_aux_hidden_state_capture does with the draft's ids
    runner.model.set_eagle3_layers_to_capture(list(EAGLE_IDS))
    idx = sorted({k + 1 for k in EAGLE_IDS} | {k + 1 for k in DUMP_IDS})
    got = list(target.model.layers_to_capture)
    _result(f"{kind}: layers_to_capture = union of EAGLE-3 and dump capture indices", got == idx,
            str(got), f"want {idx}")
    H = tinyconfig.DEEPSEEK_V3["hidden_size"]
    for tag in ("configured", "after a set_eagle3_layers_to_capture() without ids"):
        if tag != "configured":
            runner.model.set_eagle3_layers_to_capture()
        out = _extend(runner, prompts)
        hs = out.hidden_states
        worst, start, problems = 0.0, 0, []
        if hs is None or tuple(hs.shape) != (sum(map(len, prompts)), H * len(EAGLE_IDS)):
            problems.append(f"hidden_states shape {None if hs is None else tuple(hs.shape)}")
        else:
            for p, (r_hs, _, _, _) in zip(prompts, refs):
                rows = hs[start:start + len(p)]
                for j, k in enumerate(EAGLE_IDS):
                    worst = max(worst, _maxdiff(rows[:, j * H:(j + 1) * H], r_hs[k + 1]))
                start += len(p)
        ok = not problems and worst <= TOL
        _result(f"{kind}: EAGLE-3 ids {EAGLE_IDS} == HF hidden_states {[k + 1 for k in EAGLE_IDS]} ({tag})", ok,
                f"max abs diff {worst:.2g}", "; ".join(problems))
        # output unchanged: the last-token logits and greedy next tokens are HF's
        nl = out.next_token_logits
        ld = max(_maxdiff(nl[i], r[1][-1]) for i, r in enumerate(refs))
        same = [int(nl[i].argmax()) for i in range(len(prompts))] == [int(r[1][-1].argmax()) for r in refs]
        _result(f"{kind}: output unchanged with capture and dump on ({tag})", ld <= 1e-3 and same,
                f"max logit diff {ld:.2g}", "" if same else "greedy next tokens differ from HF")
    state = target._eagle3_capture_state
    state.writer.flush()
    files = sorted(dump.glob("*.safetensors"))
    from sglang.srt.eagle3_capture.dump import dump_key

    worst, problems = 0.0, []
    for p, (r_hs, _, _, _) in zip(prompts, refs):
        f = dump / f"{dump_key(p)}.safetensors"
        if not f.is_file():
            problems.append(f"no dump for a {len(p)}-token prompt")
            continue
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata()
            t = {k: fh.get_tensor(k) for k in fh.keys()}
        if t["input_ids"].tolist() != list(p) or t["input_ids"].dtype != torch.int64:
            problems.append("input_ids differ")
        for k in DUMP_IDS:
            worst = max(worst, _maxdiff(t[f"layer.{k}"], r_hs[k + 1]))
        worst = max(worst, _maxdiff(t["final"], r_hs[-1]))
        want = {"format": "eagle3-dump/1", "eagle3_layer_ids": json.dumps(sorted(DUMP_IDS)),
                "hf_hidden_state_indices": json.dumps([k + 1 for k in sorted(DUMP_IDS)]), "final": "post_norm",
                "num_hidden_layers": str(tinyconfig.DEEPSEEK_V3["num_hidden_layers"]),
                "hidden_size": str(H), "dtype": "float32", "sglang_version": "0.5.23",
                "series_version": "0.5.23-1", "tp_size": "1", "num_tokens": str(len(p)), "key": dump_key(p)}
        bad = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
        if bad:
            problems.append(f"metadata {bad}")
    ok = not problems and worst <= TOL and len(files) == len(prompts)
    _result(f"{kind}: one dump per request == HF reference (layers {DUMP_IDS}, final, ids, metadata)", ok,
            f"{len(files)} files, max abs diff {worst:.2g}", "; ".join(problems[:3]))
    return 0


# =============================================================================================
# test side

def _env_python() -> Path:
    """The CPU sglang 0.5.23 environment, built by eaglepatch.cpuenv from our requirement list
    (cpuenv has no parameter for the list, so a child process points its REQUIREMENTS at it)."""
    code = ("import sys; sys.path.insert(0, %r); from pathlib import Path; import eaglepatch.cpuenv as c; "
            "c.REQUIREMENTS = Path(%r); print(c.ensure_env())" % (str(REPO / "src"), str(REQUIREMENTS)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1])


def _stubs(dest: Path) -> Path:
    """Import stubs for sgl_kernel and torchvision. transformers 5.19 takes an importable
    torchvision without metadata as version 'N/A' and fails to parse it, so the torchvision
    stub gets a 0.0.0 dist-info (older than any real one: transformers uses none of its features)."""
    shutil.copytree(SMOKE / "stubs", dest, ignore=shutil.ignore_patterns("__pycache__"))
    meta = dest / "torchvision-0.0.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.0\n")
    return dest


def _patched(dest: Path) -> Path:
    from eaglepatch.fetch import unpacked_release
    from eaglepatch.series import load_series

    src = unpacked_release("0.5.23", quiet=True)
    shutil.copytree(src / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    series = load_series(SERIES)
    for p in series.patches + series.smoke:
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=p.body, cwd=dest,
                           capture_output=True, env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(dest.parent)))
        assert r.returncode == 0, f"{p.name}: {r.stderr.decode()}"
    return dest


def _run(py, pp, stubs, *args, timeout=900):
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=f"{pp}{os.pathsep}{stubs}",
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([str(py), __file__, *map(str, args)], capture_output=True, text=True, env=env,
                       timeout=timeout)
    results = [json.loads(ln[len("@@RESULT "):]) for ln in r.stdout.splitlines() if ln.startswith("@@RESULT ")]
    return r, results


def test_functional_sglang_0_5_23_on_cpu(tmp_path_factory):
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(SMOKE))
    py = _env_python()
    base = tmp_path_factory.mktemp("f0523")
    pp = _patched(base / "pp")
    stubs = _stubs(base / "stubs")
    ck = base / "ckpt"
    build = ("import sys; sys.path.insert(0, %r); import _hf; from pathlib import Path; "
             "_hf.build_deepseek(Path(%r)); _hf.build_kimi(Path(%r), Path(%r))"
             % (str(SMOKE), str(ck / "deepseek"), str(ck / "kimi"), str(ck / "deepseek")))
    r = subprocess.run([str(py), "-c", build], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(stubs)))
    assert r.returncode == 0, r.stderr[-3000:]
    # sglang 0.5.23 reads text_config.architectures of the Kimi-K2.5 wrapper (the real checkpoint has it)
    kc = json.loads((ck / "kimi" / "config.json").read_text())
    kc["text_config"]["architectures"] = ["DeepseekV3ForCausalLM"]
    (ck / "kimi" / "config.json").write_text(json.dumps(kc, indent=2) + "\n")
    failures = []
    for kind in ("deepseek", "kimi"):
        proc, results = _run(py, pp, stubs, "worker", kind, ck / kind, ck / "deepseek", base / "work")
        for res in results:
            print(("PASS " if res["passed"] else "FAIL ") + f"{res['name']}: {res['figure']} {res['detail']}")
        if proc.returncode != 0 or len(results) != 6:
            failures.append(f"{kind} worker exit {proc.returncode}, {len(results)} results:\n{proc.stderr[-3000:]}")
        failures += [f"{x['name']}: {x['figure']} {x['detail']}" for x in results if not x["passed"]]
    assert not failures, "\n".join(failures)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker(*sys.argv[2:6]))
