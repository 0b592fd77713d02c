"""The GPU check: orchestrates the engines (eaglepatch.gpucheck.worker), the reference and the verdicts.

Checks (issue 12, item 3), on CUDA with bf16 and CUDA graphs:

- a. capture: the target's EAGLE-3 capture for ids [-1, 1, 2] (the hidden states it hands to the
  draft after prefill) equals the float32 reference per request, for a batch of mixed lengths in
  one forward below 2048 tokens and one above.
- b. draft parity: what the draft receives in prefill and in graph-replayed target verify equals
  the reference for the same tokens.
- c. dump: one file per request with ids [-1, 1, 2, N-1] and ``final``, equal to the reference.
  a, b and c share one engine (D: EAGLE-3 with a random draft, dump and spy on; the configuration
  of check d); if the dump is refused at start, a and b run on an engine without it (S).
- d. TP=2 (two GPUs): the engine of c at TP=1 and at TP=2 with FlashInfer's all-reduce fusion off,
  then at TP=2 with the fusion's data flow emulated (every non-last layer defers its MLP
  all-reduce to the next layer): one file per request, rows and draft inputs equal TP=1's and the
  reference; the probe at the layer input (0.5.9's capture point) fails without the fix and passes
  with the all-reduce completed there.
- f. drafts keep their meaning: one draft whose ids are in upstream's convention (``F_IDS``, first
  id not 1: capture indices, the same layers as ``EAGLE_IDS``) served on the patched and on the
  unpatched sglang: both feed it the reference's rows in prefill and graph-replayed verify, and
  the same rows and tokens as each other.
- g. the dump in production settings (issue 19): a dump-only engine (no draft) with chunked prefill
  on, several new tokens per request and one prompt sent twice, with the overlap scheduler off and
  on; the flush, then the shutdown: one file per request id, all on disk at the flush, each ==
  the reference (on CPU: overlap off only).
- e. throughput at hidden 7168 (``models.THROUGHPUT_MODEL``, dummy weights): prefill tokens/s with
  the dump on vs off, and decode tokens/s with CUDA graphs, a dump-only patched server vs
  unpatched, as ratios of engines run one after the other in this one run (every repetition
  against the other engine's median; the verdict by the worst).

Every stage writes its verdicts to the results JSON at once, so a run cut short still reports.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RefusedError, UsageError
from ..outputs import write_atomic
from ..overlay import PACKAGE_DIR
from ..plugin import ENTRY_NAME as PLUGIN_NAME, TOP as PLUGIN_TOP
from . import models

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1]
SPY = HERE / "spy"
CHECKS = "abcdefgh"
TP1_CHECKS = "abcefgh"
# Environment the lent machines set (NVLink multicast off); kept for every process the check starts.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STAGE_MAX_S = 420
STAGE_MIN_S = 120  # an engine start alone takes 35-150 s: a stage with less left is not started
NUM_STEPS = 3  # EAGLE-3: 3 draft steps, chain (topk 1), 4 verified tokens per request

BASE_ENGINE = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    attention_backend="triton",
    sampling_backend="pytorch",
    disable_radix_cache=True,
    chunked_prefill_size=-1,
    context_length=4096,
    max_running_requests=8,
    random_seed=0,
    log_level="warning",
    mem_fraction_static=0.4,
    cuda_graph_bs_decode=[1, 2, 4, 8],
    disable_prefill_cuda_graph=True,
)


@dataclass
class Options:
    out: Path
    work: Path
    site: Path | None = None
    package_parent: Path | None = None
    series: Path | None = None
    patched_files: Path | None = None
    unpatched_parent: Path | None = None
    plugin: Path | None = None  # the eaglepatch-capture wheel: the unmodified --site sglang with it is under test
    checks: str = TP1_CHECKS
    budget_s: float = 540.0
    new_tokens: int = 16
    dump_ids: list | None = None
    prefill_graph: bool = False
    e_layers: int = 4
    g_modes: str = "off,on,http"  # check g's engines: overlap off, overlap on, overlap on over HTTP
    e_decode_only: bool = False  # check e: decode alone (no prefill benchmark before it), dump off and on
    cpu: bool = False  # dry run of check c on the CPU smoke environment (tests); no CUDA
    say: object = None


@dataclass
class State:
    opts: Options
    t0: float
    results: dict = field(default_factory=dict)
    ref_model: object = None
    ref_cache: dict = field(default_factory=dict)


def _say(opts, msg):
    (opts.say or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)


# ---- preflight ----------------------------------------------------------------------------


def plugin_problem(opts: Options) -> UsageError | None:
    """What is wrong with --plugin and the options beside it (argument errors, checked before CUDA)."""
    if opts.plugin is None:
        return None
    if opts.series is not None or opts.patched_files is not None or opts.package_parent is not None:
        return UsageError("--plugin checks the unmodified --site sglang with the plugin; --series, --patched-files "
                          "and --package-parent name a patched tree", "pass either --plugin WHEEL or one of those")
    if opts.cpu:
        return UsageError("--plugin runs on the GPU only", "the CPU parity of the plugin is tests/test_plugin.py")
    if opts.site is None:
        return UsageError("--plugin needs --site (the unpacked bundle holding the unmodified sglang)",
                          "pass --site /tmp/site")
    import importlib.util
    import zipfile

    w = Path(opts.plugin)
    try:
        with zipfile.ZipFile(w) as z:
            names = set(z.namelist())
    except (OSError, zipfile.BadZipFile) as exc:
        return UsageError("--plugin %s is not a readable wheel (%s)" % (w, exc),
                          "pass the wheel python3 tools/export.py --plugin DIR wrote")
    eps = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    if "%s/plugin.py" % PLUGIN_TOP not in names or not eps:
        return UsageError("--plugin %s is not the eaglepatch-capture wheel (no %s/plugin.py or no entry points)"
                          % (w, PLUGIN_TOP), "pass the wheel python3 tools/export.py --plugin DIR wrote")
    spec = importlib.util.find_spec(PLUGIN_TOP)
    if spec is not None:
        return UsageError("the plugin is already importable here (%s): the unpatched engines of checks e, f and h "
                          "would load it too" % (spec.origin or PLUGIN_TOP),
                          "run the check where it is not installed (pip uninstall eaglepatch-capture, or drop it from "
                          "PYTHONPATH); --plugin brings it to the engines under test only")
    return None


def preflight(opts: Options) -> dict:
    """One-line errors for what makes the run impossible: no CUDA, too few GPUs, no sglang."""
    bad = plugin_problem(opts)
    if bad is not None:
        raise bad
    try:
        import torch
    except ImportError:
        raise UsageError("torch is not installed", "run the check where PyTorch with CUDA is installed")
    if opts.cpu:
        if set(opts.checks) - set("cg"):
            raise UsageError("--cpu runs checks c and g only (EAGLE-3 serving and graphs need CUDA)",
                             "pass --checks c or cg")
        if opts.package_parent is None:
            raise UsageError("--cpu needs --package-parent (a tree patched with the smoke patches)",
                             "pass --package-parent DIR")
        return {"gpu": None, "torch": torch.__version__, "python": platform.python_version(), "cpu": True}
    if not torch.cuda.is_available():
        raise UsageError("CUDA is not available (torch.cuda.is_available() is False)",
                         "run the GPU check on a machine with an NVIDIA GPU; CPU tests are tests/test_gpucheck_*.py")
    need = 2 if "d" in opts.checks else 1
    if torch.cuda.device_count() < need:
        raise UsageError("check d needs 2 GPUs, this machine has %d" % torch.cuda.device_count(),
                         "run d on a 2-GPU machine (--checks d) and the others here (--checks abce)")
    if opts.package_parent is None and opts.series is None and opts.patched_files is None and opts.plugin is None:
        raise UsageError("no sglang under test",
                         "pass --patched-files DIR or --series DIR (laid over --site's sglang), --package-parent DIR "
                         "or --plugin WHEEL")
    if (opts.series is not None or opts.patched_files is not None) and opts.site is None:
        raise UsageError("--series and --patched-files need --site (the unpacked bundle holding the upstream sglang)",
                         "pass --site /tmp/site")
    for what, p in (("--site", opts.site), ("--package-parent", opts.package_parent),
                    ("--unpatched-parent", opts.unpatched_parent)):
        if p is not None and not (Path(p) / "sglang" / "__init__.py").is_file():
            raise UsageError("%s %s holds no sglang/ package" % (what, p),
                             "unpack the bundle (sh .gpu-bundle/unpack.sh DIR) and pass DIR")
    if opts.series is not None and not (Path(opts.series) / "series").is_file():
        raise UsageError("%s is not a series directory (no 'series' file)" % opts.series,
                         "pass --series patches/sglang-<release>")
    for c in "efh":
        if c in opts.checks and opts.unpatched_parent is None and opts.site is None:
            raise UsageError("check %s needs the unpatched sglang" % c, "pass --site or --unpatched-parent")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}}


def patched_parent(opts: Options) -> Path:
    """The directory put first on the PYTHONPATH of the engines under test: a patched package parent,
    or with --plugin the wheel unpacked (its package and dist-info; sglang comes from --site)."""
    if opts.plugin is not None:
        import zipfile

        dest = Path(opts.work) / "plugin"
        shutil.rmtree(dest, ignore_errors=True)
        # unzipped, not eaglepatch.plugin.install: that needs pip, which a GPU host's python may lack
        with zipfile.ZipFile(opts.plugin) as z:
            z.extractall(dest)
        _say(opts, "gpucheck: the plugin %s (unpacked in %s) on the unmodified sglang of %s"
             % (Path(opts.plugin).name, dest, opts.site))
        return dest.resolve()
    if opts.package_parent is not None:
        return Path(opts.package_parent).resolve()
    if opts.patched_files is not None:
        from .patched_files import lay_patched_files

        _say(opts, "gpucheck: laying %s over a copy of %s/sglang" % (opts.patched_files, opts.site))
        return lay_patched_files(Path(opts.patched_files), Path(opts.site), Path(opts.work) / "patched").resolve()
    from ..smoke.tree import patched_tree

    dest = Path(opts.work) / "patched"
    _say(opts, "gpucheck: applying %s to a copy of %s/sglang" % (opts.series, opts.site))
    return patched_tree(Path(opts.site), Path(opts.series), dest, smoke=False).resolve()


# ---- workers ------------------------------------------------------------------------------

def worker_env(sglang_parent: Path, site: Path | None, spy: dict | None = None, dump: dict | None = None,
               cpu: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EAGLE3_DUMP_") and not k.startswith("EAGLEPATCH_SPY")}
    for k, v in MULTICAST_OFF.items():
        env.setdefault(k, v)
    paths = [str(sglang_parent)]
    if (Path(sglang_parent) / PLUGIN_TOP).is_dir():  # --plugin: SGLang's loader loads this plugin, no other
        env["SGLANG_PLUGINS"] = PLUGIN_NAME
    if spy is not None:
        paths.append(str(SPY))
    if cpu:
        from ..smoke import STUBS

        paths.append(str(STUBS))
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if site is not None and Path(site).resolve() != Path(sglang_parent).resolve():
        paths.append(str(site))
    paths.append(str(SRC))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    for k, v in (spy or {}).items():
        env[k] = str(v)
    for k, v in (dump or {}).items():
        env[k] = str(v)
    return env


def run_worker(state: State, name: str, spec: dict, env: dict) -> dict:
    """Run one engine worker; its JSON result ({"ok": False, "error": ...} when it died)."""
    opts = state.opts
    d = Path(opts.work) / "stages" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec, indent=1))
    out = d / "result.json"
    left = opts.budget_s - (time.monotonic() - state.t0) - 30
    timeout = min(STAGE_MAX_S, left)
    if timeout < STAGE_MIN_S:
        return {"ok": False, "error": "not run: %.0f s of the %.0f s budget left" % (max(left + 30, 0), opts.budget_s),
                "skipped": True}
    _say(opts, "gpucheck: stage %s (timeout %.0f s) ..." % (name, timeout))
    t = time.monotonic()
    with open(d / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "eaglepatch.gpucheck.worker", str(d / "spec.json"), str(out)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the scheduler processes the engine left
            except (ProcessLookupError, PermissionError):
                pass
    wall = time.monotonic() - t
    res = json.loads(out.read_text()) if out.is_file() else {"ok": False}
    if rc is None:
        res.update(ok=False, error="timed out after %.0f s" % timeout)
    elif not res.get("ok") and not res.get("error"):
        res["error"] = "worker exited %s without a result" % rc
    res["wall_s"] = round(wall, 1)
    if not res.get("ok"):
        tail = (d / "log.txt").read_text(errors="replace").splitlines()[-30:]
        res["log_tail"] = tail
        _say(opts, "gpucheck: stage %s FAILED after %.0f s: %s" % (name, wall, res.get("error")))
    else:
        _say(opts, "gpucheck: stage %s done in %.0f s (engine start %.0f s)" % (name, wall, res.get("start_s", -1)))
    state.results.setdefault("stages", {})[name] = {k: v for k, v in res.items() if k not in ("runs",)}
    return res


# ---- reference ----------------------------------------------------------------------------

def _reference(state: State, ckpt: Path):
    from .reference import Reference

    if state.ref_model is None:
        state.ref_model = Reference(ckpt, device="cpu" if state.opts.cpu else "cuda")
    return state.ref_model


def ref_states(state: State, ckpt: Path, tokens) -> dict:
    key = tuple(tokens)
    if key not in state.ref_cache:
        state.ref_cache[key] = _reference(state, ckpt).states(tokens)
    return state.ref_cache[key]


def release_reference(state: State) -> None:
    """Free the reference's GPU memory before an engine starts (it sizes itself from what is free)."""
    if state.ref_model is not None:
        import torch

        state.ref_model.model.to("cpu")
        state.ref_model.device = "cpu"
        state.ref_model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- stages -------------------------------------------------------------------------------

def _engine_kwargs(opts: Options, ckpt: Path, draft: Path | None, tp: int = 1, emulate: bool = False) -> dict:
    if opts.cpu:
        from ..smoke._common import CPU_SERVER_ARGS

        return dict(CPU_SERVER_ARGS, model_path=str(ckpt), log_level="warning")
    kw = dict(BASE_ENGINE, model_path=str(ckpt), tp_size=tp)
    if opts.prefill_graph:
        kw.pop("disable_prefill_cuda_graph")
    if draft is not None:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                  speculative_draft_load_format="dummy", speculative_num_steps=NUM_STEPS,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=NUM_STEPS + 1)
    if tp > 1:
        # The lent H200s hang creating FlashInfer's fusion workspace (multicast off); the fusion's
        # data flow is emulated instead (EAGLEPATCH_SPY_DEFER_ALLREDUCE).
        kw["enforce_disable_flashinfer_allreduce_fusion"] = True
    return kw


def _runs(batches: dict, new_tokens: int) -> list:
    """One generate call per batch; every request carries its own id (the dump file's name)."""
    return [{"name": b, "prompts": p, "max_new_tokens": new_tokens, "rids": rids_of(b, p)} for b, p in batches.items()]


def rids_of(batch: str, prompts) -> list:
    return ["gpucheck-%s-%d" % (batch, i) for i in range(len(prompts))]


def _all_rids(prompts: dict) -> list:
    return [r for b, p in prompts.items() for r in rids_of(b, p)]


def _add(state: State, verdict) -> None:
    d = verdict.as_dict() if hasattr(verdict, "as_dict") else verdict
    state.results.setdefault("results", []).append(d)
    _say(state.opts, "  %s %s: %s" % ("PASS" if d["passed"] else "FAIL", d["name"], d["figure"]))
    write_results(state)


def _failed_stage(state: State, names, res) -> None:
    why = res.get("error") or "failed"
    for n in names:
        _add(state, {"name": n, "passed": False, "figure": "not run" if res.get("skipped") else "engine failed",
                     "detail": why + ("\n" + "\n".join(res.get("log_tail", [])) if res.get("log_tail") else ""),
                     "comparisons": [], "facts": {}})


def write_results(state: State) -> None:
    out = Path(state.opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = state.results
    r["passed"] = bool(r.get("results")) and all(x["passed"] for x in r["results"])
    r["elapsed_s"] = round(time.monotonic() - state.t0, 1)
    write_atomic(out, json.dumps(r, indent=1, sort_keys=True) + "\n", "--out")


A_NAME = "a. EAGLE-3 capture [-1,1,2] == reference per request, forwards below and above 2048 tokens"
B_NAME = "b. draft inputs in prefill and graph-replayed verify == reference for the same tokens"
C_NAME = "c. dump: one file per request, layers [-1,1,2,N-1] and final == reference"


def spy_engine(state, name, ck, draft, sglang_pp, prompts, engine=None, dump=None) -> tuple[dict, list]:
    """One EAGLE-3 engine (dump off) with the spy on: (worker result, the spy's records).
    ``engine``: the engine's arguments instead (another draft); ``dump``: the dump's settings."""
    from . import records as R

    opts = state.opts
    spy_dir = Path(opts.work) / "spy" / name
    shutil.rmtree(spy_dir, ignore_errors=True)
    spy_dir.mkdir(parents=True)
    spec = {"engine": engine or _engine_kwargs(opts, ck, draft), "runs": _runs(prompts, opts.new_tokens)}
    res = run_worker(state, name, spec, worker_env(sglang_pp, opts.site, spy={"EAGLEPATCH_SPY_DIR": spy_dir},
                                                   dump=dump))
    if not res.get("ok"):
        return res, []
    state.results.setdefault("spy_hooks", {})[name] = R.hook_notes(spy_dir)
    recs = R.load_records(spy_dir)
    state.results["stages"][name]["overlay"] = R.overlays(recs)
    return res, recs


def stage_spec_engine(state, ck, draft, sglang_pp, prompts, refs, name="S", checks=("a", "b")):
    """EAGLE-3 on, dump off: checks a and b."""
    res, recs = spy_engine(state, name, ck, draft, sglang_pp, prompts)
    if not res.get("ok"):
        _failed_stage(state, [n for n, c in ((A_NAME, "a"), (B_NAME, "b")) if c in checks], res)
        return
    evaluate_ab(state, ck, recs, res, prompts, refs, checks)


def evaluate_ab(state, ck, recs, res, prompts, refs, checks) -> None:
    from . import records as R

    all_prompts = [p for b in prompts.values() for p in b]
    all_refs = [r for b in prompts for r in refs[b]]
    outputs = [o for run in res["runs"] for o in run["output_ids"]]
    if "a" in checks:
        v = R.check_capture(A_NAME, recs, all_prompts, all_refs, models.EAGLE_IDS)
        fw = v.facts.get("forward_tokens", [])
        lim = models.FUSE_ALLREDUCE_MAX_TOKENS
        if not (any(t <= lim for t in fw) and any(t > lim for t in fw)):
            v.passed = False
            v.detail = "forwards of %s tokens: want one at most %d and one above | " % (fw, lim) + v.detail
        _add(state, v)
    if "b" in checks:
        v = R.check_draft(B_NAME, recs, all_prompts, outputs, lambda toks: ref_states(state, ck, toks),
                          models.EAGLE_IDS)
        release_reference(state)
        _add(state, v)


def check_abc(state, ck, draft, sglang_pp, prompts, refs) -> None:
    """One engine (EAGLE-3, dump and spy on) serves a, b and c; when the dump is refused at start,
    a and b run again on an engine without it."""
    opts = state.opts
    ab = tuple(c for c in "ab" if c in opts.checks and draft is not None)
    if "c" not in opts.checks:
        if ab:
            stage_spec_engine(state, ck, draft, sglang_pp, prompts, refs, "S", ab)
        return
    res, recs, dump_dir, ids = stage_dump_engine(state, ck, draft, sglang_pp, prompts, "D")
    if not res.get("ok"):
        _failed_stage(state, [C_NAME], res)
        refused = "EAGLE3_DUMP" in str(res.get("error")) + "\n".join(res.get("log_tail", []))
        if ab and refused and not res.get("skipped"):
            stage_spec_engine(state, ck, draft, sglang_pp, prompts, refs, "S", ab)
        elif ab:
            _failed_stage(state, [n for n, c in ((A_NAME, "a"), (B_NAME, "b")) if c in ab], res)
        return
    evaluate_c(state, ck, dump_dir, ids, prompts, refs)
    if ab:
        evaluate_ab(state, ck, recs, res, prompts, refs, ab)


def stage_dump_engine(state, ck, draft, sglang_pp, prompts, name, tp=1, emulate=False, probe=False):
    """An engine with the dump and EAGLE-3 on (and the spy); returns (result, records, dump dir)."""
    from . import records as R

    opts = state.opts
    ids = opts.dump_ids or models.dump_ids(models.CHECK_MODEL["num_hidden_layers"])
    spy_dir = Path(opts.work) / "spy" / name
    dump_dir = Path(opts.work) / "dump" / name
    for d in (spy_dir, dump_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    spy = {"EAGLEPATCH_SPY_DIR": spy_dir}
    if emulate:
        spy["EAGLEPATCH_SPY_DEFER_ALLREDUCE"] = "1"
    if probe:
        spy["EAGLEPATCH_SPY_PROBE"] = ",".join(str(i) for i in range(models.CHECK_MODEL["num_hidden_layers"]))
    dump = {"EAGLE3_DUMP_DIR": dump_dir, "EAGLE3_DUMP_LAYERS": ",".join(str(k) for k in ids),
            "EAGLE3_DUMP_FINAL": "1"}
    spec = {"engine": _engine_kwargs(opts, ck, draft, tp=tp, emulate=emulate),
            "runs": _runs(prompts, opts.new_tokens),
            "flush": {"dir": str(dump_dir), "timeout_s": 120}}
    res = run_worker(state, name, spec, worker_env(sglang_pp, opts.site, spy=spy, dump=dump, cpu=opts.cpu))
    recs = R.load_records(spy_dir) if res.get("ok") else []
    if res.get("ok"):
        state.results.setdefault("spy_hooks", {})[name] = R.hook_notes(spy_dir)
        state.results["stages"][name]["overlay"] = R.overlays(recs)
    return res, recs, dump_dir, ids


def _dump_meta(tp: int, dtype: str = "bfloat16") -> dict:
    return {"format": "eagle3-dump/1", "final": "post_norm", "architecture": "DeepseekV3ForCausalLM",
            "dtype": dtype, "tp_size": str(tp),
            "hidden_size": str(models.CHECK_MODEL["hidden_size"]),
            "num_hidden_layers": str(models.CHECK_MODEL["num_hidden_layers"])}


def evaluate_c(state, ck, dump_dir, ids, prompts, refs) -> None:
    from . import records as R

    all_prompts = [p for b in prompts.values() for p in b]
    all_refs = [r for b in prompts for r in refs[b]]
    meta = dict(_dump_meta(1, "float32" if state.opts.cpu else "bfloat16"), model_path=str(ck))
    _add(state, R.check_dump(C_NAME, dump_dir, all_prompts, all_refs, ids, meta, _all_rids(prompts)))


def check_d(state, ck, draft, sglang_pp, prompts, refs):
    """TP=1 and TP=2 (fusion off, then its data flow emulated) on the small batch (< 2048 tokens)."""
    from . import records as R

    small = {"small": prompts["small"]}
    ps, rs = prompts["small"], refs["small"]
    base, base_recs, base_dir, ids = stage_dump_engine(state, ck, draft, sglang_pp, small, "T1", tp=1)
    if not base.get("ok"):
        _failed_stage(state, ["d. TP=1 baseline for TP=2"], base)
        return
    base_states = R.dump_states(base_dir, _all_rids(small))
    base_draft = R.draft_prefill_inputs(base_recs, ps, models.EAGLE_IDS)
    for name, emulate in (("T2", False), ("T2e", True)):
        tag = "TP=2, fusion off" if not emulate else "TP=2, deferred MLP all-reduce (the fusion's data flow)"
        res, recs, dump_dir, _ = stage_dump_engine(state, ck, draft, sglang_pp, small, name, tp=2,
                                                   emulate=emulate, probe=emulate)
        names = ["d. %s: %s" % (tag, x) for x in ("dump == reference", "dump == TP=1", "draft inputs == reference",
                                                   "draft prefill inputs == TP=1")]
        if not res.get("ok"):
            _failed_stage(state, names, res)
            continue
        meta = dict(_dump_meta(2), model_path=str(ck))
        _add(state, R.check_dump(names[0], dump_dir, ps, rs, ids, meta, _all_rids(small)))
        _add(state, R.compare_runs(names[1], R.dump_states(dump_dir, _all_rids(small)), base_states))
        outputs = res["runs"][0]["output_ids"]
        v = R.check_draft(names[2], recs, ps, outputs, lambda toks: ref_states(state, ck, toks), models.EAGLE_IDS)
        release_reference(state)
        _add(state, v)
        _add(state, R.compare_runs(names[3], R.draft_prefill_inputs(recs, ps, models.EAGLE_IDS), base_draft))
        if emulate:
            hooks = R.hook_notes(Path(state.opts.work) / "spy" / name)
            deferral = any("deferral emulated" in ln for lines in hooks.values() for ln in lines)
            unfixed, fixed = R.check_probe("d. %s: probe at the layer input (0.5.9's capture point)" % tag, recs, ps, rs)
            if not deferral:
                unfixed.passed = False
                unfixed.detail = "the deferral hook was not installed: %s | %s" % (hooks, unfixed.detail)
            _add(state, unfixed)
            _add(state, fixed)


# upstream's convention (0.5.14+: the first id is not 1, so the ids are capture indices): HF 0, 2, 3,
# the layers of EAGLE_IDS [-1, 1, 2]; the series' earlier reading (k + 1) fed it HF 1, 3, 4
F_IDS = [2, 0, 3]
F_NAMES = {
    "F-patched": "f. draft ids [2, 0, 3] (upstream's convention), patched: prefill and verify rows == reference HF [0, 2, 3]",
    "F-unpatched": "f. draft ids [2, 0, 3] (upstream's convention), unpatched: prefill and verify rows == reference HF [0, 2, 3]",
}
F_SAME = "f. draft ids [2, 0, 3]: patched and unpatched feed the draft the same prefill rows and give the same tokens"


def _overlay_seen(state, recs, under_test: bool) -> tuple[bool, str]:
    """Whether the engine's records name the capture package they must (the series' or the plugin's
    for the engine under test, none for the unpatched one): a comparison of patched and unpatched
    proves nothing when the capture never loaded."""
    from . import records as R

    want, got = [expected_overlay(state.opts)] if under_test else [None], R.overlays(recs)
    return got == want, "capture package %s%s" % ("/".join(map(str, got)) or "unrecorded",
                                                    "" if got == want else " (want %s)" % want[0])


def check_f(state, ck, sglang_pp, prompts, refs):
    """One draft in upstream's id convention on the patched and on the unpatched tree."""
    from . import records as R
    from .reference import write_config_only

    opts = state.opts
    unpatched = Path(opts.unpatched_parent or opts.site).resolve()
    draft = write_config_only(Path(opts.work) / "models" / "draft-f", models.draft_config(models.CHECK_MODEL, F_IDS))
    small = {"small": prompts["small"]}
    ps, rs = prompts["small"], refs["small"]
    seen = {}
    for name, pp in (("F-patched", sglang_pp), ("F-unpatched", unpatched)):
        res, recs = spy_engine(state, name, ck, draft, pp, small)
        if not res.get("ok"):
            _failed_stage(state, [F_NAMES[name]], res)
            continue
        outputs = res["runs"][0]["output_ids"]
        cap = R.check_capture(F_NAMES[name], recs, ps, rs, models.EAGLE_IDS)
        ver = R.check_draft(F_NAMES[name], recs, ps, outputs, lambda toks: ref_states(state, ck, toks), models.EAGLE_IDS)
        release_reference(state)
        loaded, which = _overlay_seen(state, recs, name == "F-patched")
        v = {"name": F_NAMES[name], "passed": cap.passed and ver.passed and loaded,
             "figure": "prefill %s; verify %s; %s" % (cap.figure, ver.figure, which),
             "detail": "prefill: %s || verify: %s" % (cap.detail, ver.detail)}
        _add(state, v)
        seen[name] = (R.draft_prefill_inputs(recs, ps, models.EAGLE_IDS), outputs)
    if len(seen) == 2:
        (pa, pa_out), (up, up_out) = seen["F-patched"], seen["F-unpatched"]
        v = R.compare_runs(F_SAME, pa, up)
        bitwise = all(sorted(a) == sorted(b) and all(bool((a[k] == b[k]).all()) for k in a) for a, b in zip(pa, up))
        d = v.as_dict()
        same_tokens = pa_out == up_out
        d["passed"] = d["passed"] and same_tokens
        d["figure"] = "%s; rows bit for bit equal: %s; tokens equal: %s" % (d["figure"], bitwise, same_tokens)
        _add(state, d)


H_NAMES = {
    "H-unpatched": "h. DFlash draft ids %s, unpatched: prefill rows == reference outputs of layers %s",
    "H-patched": "h. DFlash draft ids %s, patched, dump off: prefill rows == reference outputs of layers %s",
    "H-patched-dump": "h. DFlash draft ids %s, patched, dump on: prefill rows == reference outputs of layers %s",
}
H_SAME = ("h. DFlash draft ids %s: patched (dump off and on) and unpatched feed the draft the same states bit for "
          "bit (every prefill and verify write into its KV cache) and give the same tokens")


def _dflash_engine(opts, ck: Path, draft: Path) -> dict:
    """SGLang's own DFLASH worker on the check model (dummy draft weights, Triton attention)."""
    return dict(BASE_ENGINE, model_path=str(ck), speculative_algorithm="DFLASH",
                speculative_draft_model_path=str(draft), speculative_draft_load_format="dummy",
                speculative_num_draft_tokens=models.DFLASH_BLOCK, speculative_draft_attention_backend="triton")


def _draft_writes(recs) -> list:
    """What the DFlash draft was handed, in order: (rows, commit lengths) of every write."""
    return [(r["hidden"], r.get("commit_lens")) for r in recs
            if r["kind"] == "draft" and r.get("path", "").startswith("DFlashWorkerV2")]


def check_h(state, ck, sglang_pp, prompts, refs):
    """A DFlash draft served by the release's own DFLASH worker (issue 44 item 4): what the target
    hands it on the unpatched tree, on the patched tree with the dump off and with it on; the prefill
    rows against the reference (the DFlash reading: id k is the output of layer k), and every state
    the worker writes into the draft's KV cache, patched against unpatched, bit for bit."""
    from . import records as R
    from .reference import write_config_only

    opts = state.opts
    ids = models.DFLASH_IDS
    unpatched = Path(opts.unpatched_parent or opts.site).resolve()
    draft = write_config_only(Path(opts.work) / "models" / "draft-h-dflash",
                              models.dflash_draft_config(models.CHECK_MODEL, ids))
    small = {"small": prompts["small"]}
    ps, rs = prompts["small"], refs["small"]
    dump_dir = Path(opts.work) / "dump" / "H-patched-dump"
    shutil.rmtree(dump_dir, ignore_errors=True)
    dump_dir.mkdir(parents=True)
    dump = {"EAGLE3_DUMP_DIR": dump_dir, "EAGLE3_DUMP_LAYERS": "-1,1,%d" % (models.CHECK_MODEL["num_hidden_layers"] - 1),
            "EAGLE3_DUMP_FINAL": "1"}
    seen = {}
    for name, pp, dmp in (("H-unpatched", unpatched, None), ("H-patched", sglang_pp, None),
                          ("H-patched-dump", sglang_pp, dump)):
        label = H_NAMES[name] % (ids, ids)
        res, recs = spy_engine(state, name, ck, draft, pp, small, engine=_dflash_engine(opts, ck, draft), dump=dmp)
        if not res.get("ok"):
            _failed_stage(state, [label], res)
            continue
        v = R.check_capture(label, recs, ps, rs, ids)
        # the same rows read the EAGLE-3 / "layer input" way (id k: the input of layer k) must fail
        shifted = [k - 1 for k in ids]
        wrong = R.check_capture(label, recs, ps, rs, shifted)
        writes = _draft_writes(recs)
        d = v.as_dict()
        loaded, which = _overlay_seen(state, recs, name != "H-unpatched")
        d["passed"] = d["passed"] and bool(writes) and not wrong.passed and loaded
        d["figure"] = "%s; the shifted reading (layers %s) fails: %s, %s; %d writes into the draft's KV cache; %s" % (
            d["figure"], shifted, not wrong.passed, wrong.figure, len(writes), which)
        if dmp is not None:
            files = sorted(dump_dir.glob("*.safetensors"))
            d["passed"] = d["passed"] and len(files) == len(ps)
            d["figure"] += "; %d dump files for %d requests" % (len(files), len(ps))
        _add(state, d)
        seen[name] = (writes, res["runs"][0]["output_ids"])
    if len(seen) == 3:
        base, base_out = seen["H-unpatched"]
        parts, ok = [], True
        for name in ("H-patched", "H-patched-dump"):
            got, out = seen[name]
            same = len(got) == len(base) and all(
                a.shape == b.shape and bool((a == b).all()) and (ca is None) == (cb is None)
                and (ca is None or bool((ca == cb).all())) for (a, ca), (b, cb) in zip(got, base))
            ok = ok and same and out == base_out
            parts.append("%s: %d writes, bit for bit %s, tokens equal %s" % (name, len(got), same, out == base_out))
        _add(state, {"name": H_SAME % (ids,), "passed": ok and bool(base), "figure": "; ".join(parts),
                     "detail": "unpatched: %d writes, %d tokens generated" % (len(base), sum(map(len, base_out))),
                     "comparisons": [], "facts": {}})


G_CHUNK = 256  # --chunked-prefill-size of check g: most prompts of both batches span several chunks
G_NEW_TOKENS = 8
# the compact dump's settings (check e's fp8 engine, check g's fp8 mode)
E_FP8 = {"EAGLE3_DUMP_DTYPE": "fp8", "EAGLE3_DUMP_REBUILDABLE": "omit"}


def g_name(overlap: bool, http: bool = False, fp8: bool = False) -> str:
    return ("g. dump-only %s%s, overlap scheduler %s, chunked prefill %d, %d new tokens, one prompt sent "
            "twice: one file per request == reference, %s"
            % ("launch_server over HTTP" if http else "sglang.Engine",
               " with the compact dump (fp8, rebuildable states left out and rebuilt from the checkpoint)"
               if fp8 else "", "on" if overlap else "off", G_CHUNK,
               G_NEW_TOKENS, "the flush endpoint after the first batch, none lost at a SIGTERM right after the "
               "second" if http else "all on disk at the flush, kept through the shutdown"))


def _stored_names(dump_dir: Path) -> list:
    """The tensor names of each dump file in ``dump_dir``."""
    from safetensors import safe_open

    out = []
    for path in sorted(Path(dump_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.append(set(f.keys()))
    return out


def check_g(state, ck, sglang_pp, prompts, refs):
    """Production settings for the dump (issue 19): no draft, chunked prefill, several new tokens
    (the prefill batch becomes a decode batch), the overlap scheduler off and on; the flush, then
    the shutdown; every request's file (by request id) against the reference."""
    from . import records as R

    opts = state.opts
    batches = {b: list(p) for b, p in prompts.items()}
    first = next(iter(batches))
    batches[first] = batches[first] + [batches[first][-1]]  # the same prompt twice in one call
    brefs = {b: list(r) for b, r in refs.items()}
    brefs[first] = brefs[first] + [brefs[first][-1]]
    ids = opts.dump_ids or models.dump_ids(models.CHECK_MODEL["num_hidden_layers"])
    dump = {"EAGLE3_DUMP_LAYERS": ",".join(str(k) for k in ids), "EAGLE3_DUMP_FINAL": "1"}
    all_prompts = [p for b in batches.values() for p in b]
    all_refs = [r for b in brefs.values() for r in b]
    known = {"off": (False, False, False), "on": (True, False, False), "http": (True, True, False),
             "fp8": (True, False, True)}
    modes = [known[m] for m in opts.g_modes.split(",")]
    if opts.cpu:  # CPU: no overlap scheduler, no HTTP run
        modes = list(dict.fromkeys((False, False, fp8) for overlap, http, fp8 in modes if not http))
    for overlap, http, fp8 in modes:
        name = "G-overlap-" + ("on" if overlap else "off") + ("-http" if http else "") + ("-fp8" if fp8 else "")
        dump_dir = Path(opts.work) / "dump" / name
        shutil.rmtree(dump_dir, ignore_errors=True)
        dump_dir.mkdir(parents=True)
        engine = dict(_engine_kwargs(opts, ck, None), chunked_prefill_size=G_CHUNK,
                      disable_overlap_schedule=not overlap)
        spec = {"engine": engine, "runs": _runs(batches, G_NEW_TOKENS), "flush": {"dir": str(dump_dir), "timeout_s": 120},
                "http": http}
        settings = dict(dump, EAGLE3_DUMP_DIR=dump_dir, **(E_FP8 if fp8 else {}))
        res = run_worker(state, name, spec, worker_env(sglang_pp, opts.site, dump=settings, cpu=opts.cpu))
        if not res.get("ok"):
            _failed_stage(state, [g_name(overlap, http, fp8)], res)
            continue
        meta = dict(_dump_meta(1, "float32" if opts.cpu else "bfloat16"), model_path=str(ck))
        if fp8:
            meta.update(format="eagle3-dump/2", storage_dtype="float8_e4m3fn", scale_layout="per_token_per_state")
        v = R.check_dump(g_name(overlap, http, fp8), dump_dir, all_prompts, all_refs, ids, meta,
                         _all_rids(batches)).as_dict()
        if fp8:  # the states compared were rebuilt: no file holds the embedding or the final state
            stored = _stored_names(dump_dir)
            v["facts"].update(stored_tensors=sorted(set().union(*stored)) if stored else [])
            if not stored or any({"layer.-1", "final"} & names for names in stored):
                v["passed"] = False
                v["detail"] = "a compact file stores the embedding or the final state (or none was written) | " \
                    + v["detail"]
        f = res.get("flush") or {}
        n = len(all_prompts)
        counts = f.get("counts") or {}
        if http:  # the flush after the first run, then the last run and a stop with no flush asked for
            flushed = (f.get("files_at_flush") == f.get("requests_at_flush") == counts.get("written")
                       and f.get("files_after_shutdown") == n)
        else:
            flushed = f.get("files_at_flush") == n and f.get("files_after_shutdown") == n and counts.get("written") == n
        v["facts"].update(flush=f)
        v["detail"] = "flush after %.2f s: %s files at the flush (of %s requests then), %s of %d after the %s, counts %s | %s" % (
            f.get("s", -1), f.get("files_at_flush"), f.get("requests_at_flush", n), f.get("files_after_shutdown"), n,
            "stop (SIGTERM, no flush asked for; %s s)" % res.get("stop_s") if http else "shutdown", counts, v["detail"])
        v["passed"] = v["passed"] and flushed
        _add(state, v)


def check_e(state, sglang_pp):
    """Prefill with the dump on vs off (patched), bf16 and compact (fp8, rebuildable states left
    out) dumps in the same run, with the bytes per token each wrote; decode with graphs on a
    dump-only patched server vs unpatched."""
    from .reference import write_config_only

    opts = state.opts
    cfg = dict(models.THROUGHPUT_MODEL, num_hidden_layers=opts.e_layers)
    mdir = write_config_only(Path(opts.work) / "models" / ("throughput-%d" % opts.e_layers), cfg)
    unpatched = Path(opts.unpatched_parent or opts.site).resolve()
    requests, tokens = 16, 1024
    bench = {"vocab": cfg["vocab_size"], "seed": 1,
             "prefill": {"requests": requests, "tokens": tokens, "reps": 5},
             "decode": {"requests": 32, "prompt": 128, "new_tokens": 128, "reps": 3}}
    engine = dict(BASE_ENGINE, model_path=str(mdir), load_format="dummy", mem_fraction_static=0.8,
                  max_running_requests=32, cuda_graph_bs_decode=[32], context_length=2048)
    # bf16: the draft's [-1, 1, 2] + final (4 states, as every earlier run); compact: the same plus
    # the last layer N-1 (speculators' last slot), of which the embedding and final are rebuilt
    ids = {"e-patched-dump": models.EAGLE_IDS, "e-patched-dump-fp8": models.dump_ids(opts.e_layers)}
    dumps = {}
    for name, extra in (("e-patched-dump", {}), ("e-patched-dump-fp8", E_FP8)):
        d = Path(opts.work) / "dump" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        dumps[name] = dict(extra, EAGLE3_DUMP_DIR=d, EAGLE3_DUMP_LAYERS=",".join(map(str, ids[name])),
                           EAGLE3_DUMP_FINAL="1")
    out = {}
    engines = (("e-patched", sglang_pp, None), ("e-unpatched", unpatched, None),
               ("e-patched-dump", sglang_pp, dumps["e-patched-dump"]),
               ("e-patched-dump-fp8", sglang_pp, dumps["e-patched-dump-fp8"]))
    if opts.e_decode_only:  # decode alone, the series with the dump on and off (no prefill before it)
        engines = (engines[2], engines[1], engines[0])
        bench.pop("prefill")
    for name, pp, dmp in engines:
        b = dict(bench)
        if name == "e-unpatched":  # decode of upstream
            b.pop("prefill", None)
        if name in ("e-patched", "e-patched-dump-fp8") and not opts.e_decode_only:
            b.pop("decode")  # prefill without the dump / with the compact one
        if dmp is not None:  # prefill with the dump; decode of a dump-only server
            b["dump_dir"] = str(dmp["EAGLE3_DUMP_DIR"])
        res = run_worker(state, name, {"engine": engine, "bench": b}, worker_env(pp, opts.site, dump=dmp))
        out[name] = res
    state.results["throughput"] = {
        "model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                      "num_attention_heads", "vocab_size")},
        "prefill": bench.get("prefill"), "decode": bench["decode"], "dump_ids": ids,
        "dump_settings": {k: {n: str(x) for n, x in v.items() if n != "EAGLE3_DUMP_DIR"} for k, v in dumps.items()},
        "engines": {k: v.get("bench") for k, v in out.items()}}

    def reps(name, part):
        try:
            return list(out[name]["bench"][part]["tokens_per_s"])
        except (KeyError, TypeError):
            return None

    verdicts = (
        ("e. prefill tokens/s, dump on / off (hidden 7168)", "e-patched-dump", "e-patched", 0.95, "prefill"),
        ("e. prefill tokens/s, compact dump (fp8, rebuildable states left out) on / off (hidden 7168)",
         "e-patched-dump-fp8", "e-patched", 0.95, "prefill"),
        ("e. decode tokens/s with CUDA graphs, dump-only patched server / unpatched (hidden 7168)",
         "e-patched-dump", "e-unpatched", 0.99, "decode"))
    if opts.e_decode_only:
        verdicts = verdicts[2:] + (
            ("e. decode tokens/s with CUDA graphs, patched with the dump off / unpatched (hidden 7168)",
             "e-patched", "e-unpatched", 0.99, "decode"),)
    for nm, num_name, den_name, goal, what in verdicts:
        num, den = reps(num_name, what), reps(den_name, what)
        if not num or not den:
            errs = "; ".join("%s: %s" % (k, v.get("error")) for k, v in out.items() if not v.get("ok"))
            _add(state, {"name": nm, "passed": False, "figure": "not measured", "detail": errs, "comparisons": [],
                         "facts": {}})
            continue

        # every repetition of the numerator against the denominator's median: the goal holds only
        # when the worst repetition meets it
        per_rep = [x / statistics.median(den) for x in num]
        worst, median = min(per_rep), statistics.median(num) / statistics.median(den)
        facts = {"ratio_worst": worst, "ratio_median": median, "ratio_per_rep": per_rep, "numerator": num,
                 "denominator": den, "goal": goal}
        detail = ("%s tokens/s over %s tokens/s (each rep / the median of the other); per rep %s; worst %.3f, "
                  "median %.3f; goal: worst >= %.2f" % (["%.0f" % x for x in num], ["%.0f" % x for x in den],
                                                        ["%.3f" % r for r in per_rep], worst, median, goal))
        if what == "prefill":
            p = out[num_name]["bench"]["prefill"]
            facts.update(sustained_on=p.get("sustained"), drain_s=p.get("drain_s"), files=p.get("files"),
                         bytes_per_token=p.get("bytes_per_token"), dump_ids=ids[num_name],
                         dump_settings={k: v for k, v in dumps[num_name].items() if k != "EAGLE3_DUMP_DIR"})
            detail += "; the flush after the last request took %.2f s; %.0f bytes per token" % (
                p.get("drain_s", -1), p.get("bytes_per_token") or -1)
        _add(state, {"name": nm, "passed": worst >= goal, "figure": "worst %.3f, median %.3f" % (worst, median),
                     "detail": detail, "comparisons": [], "facts": facts})


def _patched_files_info(files):
    if files is None:
        return None
    p = Path(files) / "patched-files.json"
    return json.loads(p.read_text()) if p.is_file() else str(files)


def _plugin_info(wheel) -> dict | None:
    if wheel is None:
        return None
    import hashlib

    return {"wheel": Path(wheel).name, "sha256": hashlib.sha256(Path(wheel).read_bytes()).hexdigest()}


def expected_overlay(opts: Options) -> str:
    """What the spy's records of an engine under test name as its capture package (records.overlays)."""
    return ("%s:plugin" % PLUGIN_TOP if opts.plugin is not None
            else "%s:series" % PACKAGE_DIR.replace("/", "."))


def static_problems(opts: Options, sglang_pp: Path) -> list:
    from .static import check_tree

    kw = dict(_engine_kwargs(opts, Path("model"), Path("draft"), tp=2), load_format="dummy")
    if "h" in opts.checks:
        kw.update(_dflash_engine(opts, Path("model"), Path("draft")))
    return check_tree(sglang_pp, kw, probe="d" in opts.checks, deferral="d" in opts.checks, dflash="h" in opts.checks)


# ---- entry --------------------------------------------------------------------------------

def run_check(opts: Options) -> dict:
    t0 = time.monotonic()
    opts.checks = "".join(c for c in CHECKS if c in opts.checks)
    host = preflight(opts)
    Path(opts.work).mkdir(parents=True, exist_ok=True)
    from .criterion import TOL

    state = State(opts, t0)
    state.results.update({"format": 1, "tool": "gpucheck", "host": host, "checks": opts.checks,
                          "series": str(opts.series) if opts.series else None,
                          "patched_files": _patched_files_info(opts.patched_files),
                          "package_parent": str(opts.package_parent) if opts.package_parent else None,
                          "plugin": _plugin_info(opts.plugin),
                          "criterion": {"tol": TOL, "rule": "max over token rows of |x - ref| / |ref| <= tol"},
                          "model": models.CHECK_MODEL, "shaping": models.SHAPING, "eagle_ids": models.EAGLE_IDS,
                          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    write_results(state)
    sglang_pp = patched_parent(opts)
    state.results["patched_parent"] = str(sglang_pp)
    problems = [] if opts.cpu else static_problems(opts, Path(opts.site) if opts.plugin else sglang_pp)
    state.results["static_problems"] = problems
    write_results(state)
    if problems:
        raise RefusedError("the sglang under test lacks what the check needs: " + "; ".join(problems),
                           "run the check on the release it was written for (0.5.17) or update eaglepatch.gpucheck.spy")
    if set(opts.checks) & set("abcdfgh"):
        from .reference import build_checkpoint, write_config_only

        mroot = Path(opts.work) / "models"
        ck = build_checkpoint(mroot / ("check-" + models.checkpoint_key()))
        draft = write_config_only(mroot / "draft", models.draft_config(models.CHECK_MODEL))
        prompts = {b: models.prompts(b) for b in (("small",) if opts.cpu else models.BATCHES)}
        if opts.cpu:
            draft = None  # EAGLE-3 serving does not run on CPU
        _say(opts, "gpucheck: float32 reference for %d prompts" % sum(len(p) for p in prompts.values()))
        refs = {b: [ref_states(state, ck, p) for p in ps] for b, ps in prompts.items()}
        release_reference(state)
        if set(opts.checks) & set("abc"):
            check_abc(state, ck, draft, sglang_pp, prompts, refs)
        if "d" in opts.checks:
            check_d(state, ck, draft, sglang_pp, prompts, refs)
        if "f" in opts.checks and not opts.cpu:
            check_f(state, ck, sglang_pp, prompts, refs)
        if "g" in opts.checks:
            check_g(state, ck, sglang_pp, prompts, refs)
        if "h" in opts.checks and not opts.cpu:
            check_h(state, ck, sglang_pp, prompts, refs)
    if "e" in opts.checks:
        check_e(state, sglang_pp)
    write_results(state)
    return state.results


__all__ = ["Options", "run_check", "preflight", "worker_env", "BASE_ENGINE", "MULTICAST_OFF"]
