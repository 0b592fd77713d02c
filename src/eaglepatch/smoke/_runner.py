"""In-process ModelRunner checks (run inside the CPU environment by file path).

usage: python _runner.py CKPT_DIR KIMI_CKPT_DIR WORK_DIR [a,d,g,e]

a. EAGLE-3 capture through a target ModelRunner whose draft config names ids [-1, 1, 3] (3 =
   the last layer, before the final norm): the configured set is in place before the runner
   captures device graphs, LogitsProcessorOutput.hidden_states (CaptureHiddenMode.FULL) is
   cat(aux) of the HF residual stream at 0, 2 and 4, and stays so after a
   set_eagle3_layers_to_capture() call with no ids.
d. Greedy tokens and logits are identical with the dump on (and writing) and off. Then what the
   layer loop captures per forward mode: a dump-only runner captures the dump's layers (and the
   final-norm state) in prefill and nothing in decode; a runner with a dump and an EAGLE-3
   draft captures the draft's layers only in decode.
g. An image prompt through the real Kimi-K2.5 wrapper (precomputed image embeddings): the dump
   holds and is keyed by the ids with the image placeholder id, and equals HF fed the same
   embeddings.
e. With EAGLE3_DUMP_DIR set, the launch check refuses each setting that would make dumps wrong
   (SystemExit, one line naming the setting), on this release's real ServerArgs; ModelRunner
   init refuses too.

The runner is built and driven through the release's own one-batch benchmark module (_rt).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import _hf
import _rt
import tinyconfig
from _common import (A_NAME, D_NAME, DECODE_NAME, E_RUNNER_NAME, G_NAME, Dumping, RowCheck, guarded, log,
                     maxdiff, result)

EAGLE_IDS = [-1, 1, 3]
TOL = 1e-4
GRAPH_INITS = ("init_device_graphs", "init_cuda_graphs")  # where each release captures device graphs


def check_a(ckpt: Path, work: Path, ref) -> None:
    from sglang.srt.model_executor import model_runner as mr

    draft = work / "draft-eagle3"
    _hf.build_draft(draft, EAGLE_IDS)
    snap = {}
    graph_init = next(n for n in GRAPH_INITS if hasattr(mr.ModelRunner, n))
    orig = getattr(mr.ModelRunner, graph_init)

    def spy(self, *a, **kw):  # the ordering proof: what is configured when graphs would be captured
        snap["layers_to_capture"] = list(getattr(self.model.model, "layers_to_capture", []))
        snap["capture_aux"] = bool(getattr(self.model, "capture_aux_hidden_states", False))
        snap["last_hook"] = bool(self.model.model.norm._forward_hooks)
        return orig(self, *a, **kw)

    setattr(mr.ModelRunner, graph_init, spy)
    try:
        sa = _rt.server_args(ckpt, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                             speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
        runner = _rt.make_runner(sa)
    finally:
        setattr(mr.ModelRunner, graph_init, orig)
    n = tinyconfig.DEEPSEEK_V3["num_hidden_layers"]
    want_idx = [k + 1 for k in EAGLE_IDS if k + 1 < n]  # index n comes from the final-norm hook
    problems = []
    if snap.get("layers_to_capture") != want_idx or not snap.get("capture_aux") or not snap.get("last_hook"):
        problems.append("before %s layers_to_capture=%r capture_aux=%r final-norm hook=%r, want %r, True, True"
                        % (graph_init, snap.get("layers_to_capture"), snap.get("capture_aux"),
                           snap.get("last_hook"), want_idx))
    prompts = tinyconfig.prompts()
    refs = [ref.run(p) for p in prompts]
    H = tinyconfig.DEEPSEEK_V3["hidden_size"]

    def compare(tag, target):
        hs = _rt.extend(target, prompts, capture_full=True).hidden_states
        if hs is None:
            raise AssertionError("%s: LogitsProcessorOutput.hidden_states is None" % tag)
        total = sum(len(p) for p in prompts)
        if tuple(hs.shape) != (total, H * len(EAGLE_IDS)):
            raise AssertionError("%s: hidden_states shape %s, want (%d, %d)" % (tag, tuple(hs.shape), total, H * len(EAGLE_IDS)))
        rc, start = RowCheck(TOL), 0
        for p, r in zip(prompts, refs):
            rows = hs[start:start + len(p)]
            for j, k in enumerate(EAGLE_IDS):
                rc.layer(rows[:, j * H:(j + 1) * H], r, k)
            start += len(p)
        return rc

    rc1 = compare("configured", runner)
    runner.model.set_eagle3_layers_to_capture()  # what CUDA-graph capture / warm-up call in 0.5.9
    after = list(runner.model.model.layers_to_capture)
    if after != want_idx:
        problems.append("a no-id set_eagle3_layers_to_capture() changed layers_to_capture to %r" % after)
    rc2 = compare("after no-id call", runner)
    _rt.release(runner)
    del runner
    no_ids = _no_ids_draft(ckpt, work, prompts, refs)
    problems += rc1.problems() + rc2.problems() + no_ids[0]
    detail = ("target ModelRunner with speculative_algorithm=EAGLE3, draft eagle_config ids %s; layers_to_capture "
              "before %s=%s (+ final-norm hook); configured: %s; after no-id call: %s; %d prompts in one extend; %s"
              % (EAGLE_IDS, graph_init, snap.get("layers_to_capture"), rc1.figure(), rc2.figure(), len(prompts),
                 no_ids[1]))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(A_NAME, not problems, "max abs diff %.2g" % max(rc1.right, rc2.right), detail)


def _no_ids_draft(ckpt: Path, work: Path, prompts, refs):
    """A draft whose config names no eagle_config ids (SpecForge/ModelOpt templates): the target
    runner starts and captures upstream's default indices [2, N//2, N-3], equal to HF there.
    (problems, detail)"""
    draft = work / "draft-eagle3-no-ids"
    _hf.build_draft(draft, None)
    sa = _rt.server_args(ckpt, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                         speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
    try:
        runner = _rt.make_runner(sa)
    except Exception as exc:  # 0.5.9-2: TypeError: 'NoneType' object is not iterable
        return ["a draft without eagle_config ids failed to start: %s: %s" % (type(exc).__name__, exc)], "no-ids draft: failed"
    try:
        n = tinyconfig.DEEPSEEK_V3["num_hidden_layers"]
        H = tinyconfig.DEEPSEEK_V3["hidden_size"]
        want = sorted({2, n // 2, n - 3})
        got = list(runner.model.model.layers_to_capture)
        problems = [] if got == want else ["no-ids draft: layers_to_capture %r, want upstream's default %r" % (got, want)]
        hs = _rt.extend(runner, prompts, capture_full=True).hidden_states
        rc, start = RowCheck(TOL), 0
        if hs is None or tuple(hs.shape) != (sum(len(p) for p in prompts), H * len(want)):
            problems.append("no-ids draft: hidden_states %s" % (None if hs is None else tuple(hs.shape)))
        else:
            for p, r in zip(prompts, refs):
                rows = hs[start:start + len(p)]
                for j, i in enumerate(want):
                    rc.layer(rows[:, j * H:(j + 1) * H], r, i - 1)
                start += len(p)
            problems += ["no-ids draft: " + x for x in rc.problems()]
        return problems, "no-ids draft: layers_to_capture %s, %s" % (got, rc.figure())
    finally:
        _rt.release(runner)


# Each setting as a GPU machine's launch spells it: the release's constructor validates and
# resolves it (on 0.5.17/0.5.23 settings read through their resolved view), so where the release
# itself would turn a setting off, the case says what a launch needs for the setting to be in force:
#   - a prefill CUDA graph needs a GPU attention backend (every release turns graphs off for
#     torch_native, the CPU smoke's backend, on any device);
#   - --enable-dp-attention needs --dp-size > 1 (the release resolves it to False at dp_size 1;
#     0.5.23 rewrites the pair into --attn-dp-size 2);
#   - --attn-dp-size 2 needs --tp-size 2, --enable-prefill-cp a --cp-strategy;
#   - DFLASH / DSPARK targets need device "cuda" (the releases refuse them on "cpu") and a draft
#     path: the ServerArgs of a CUDA launch, built here without initialising CUDA.
# "{ckpt}" stands for the smoke checkpoint.
REFUSALS = [  # (label, ServerArgs settings, text the refusal must contain[, what must then be in force])
    ("radix cache on", {"disable_radix_cache": False}, "--disable-radix-cache"),
    ("mixed chunk", {"enable_mixed_chunk": True}, "--enable-mixed-chunk"),
    ("two-batch overlap", {"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
    ("piecewise cuda graph", {"enable_piecewise_cuda_graph": True}, "--enable-piecewise-cuda-graph"),
    ("prefill cuda graph", {"disable_cuda_graph": False, "disable_prefill_cuda_graph": False,
                            "cuda_graph_backend_prefill": "full", "attention_backend": "triton"},
     "--disable-prefill-cuda-graph", "prefill_graph"),
    ("dp attention", {"enable_dp_attention": True, "dp_size": 2, "tp_size": 2}, "DP attention", "attention_dp"),
    ("attention dp size", {"attn_dp_size": 2, "tp_size": 2}, "DP attention", "attention_dp"),
    ("dp replicas", {"dp_size": 2}, "--dp-size 2"),
    ("pp > 1", {"pp_size": 2}, "--pp-size"),
    ("deepep a2a", {"moe_a2a_backend": "deepep"}, "--moe-a2a-backend"),
    ("mooncake a2a", {"moe_a2a_backend": "mooncake"}, "--moe-a2a-backend"),
    ("pdmux", {"enable_pdmux": True}, "--enable-pdmux"),
    ("prefill context parallel", {"enable_prefill_cp": True, "cp_strategy": "zigzag"}, "--enable-prefill-cp"),
    ("nsa prefill context parallel", {"enable_nsa_prefill_context_parallel": True},
     "--enable-nsa-prefill-context-parallel"),
    ("scattered attention input at tp 2", {"tp_size": 2, "enable_attn_tp_input_scattered": True},
     "--enable-attn-tp-input-scattered"),
    ("attention cp size", {"tp_size": 2, "attn_cp_size": 2}, "--attn-cp-size"),
]
# Refusals a release fact decides (settings.RELEASE_FACTS): (label, settings, text, does the
# release refuse it?); where the fact says no, check_launch must accept the setting.
CUDA_DRAFT = {"device": "cuda", "speculative_draft_model_path": "{ckpt}"}
FACT_REFUSALS = [
    ("moe dense tp 1 at tp 2", {"tp_size": 2, "moe_dense_tp_size": 1}, "--moe-dense-tp-size 1",
     lambda f: f["moe_dense_tp1_scatters_capture"]),
    # the series routes the dump beside a DFlash/DSpark draft where it follows the release's setter
    ("dflash target", dict(CUDA_DRAFT, speculative_algorithm="DFLASH"), "--speculative-algorithm DFLASH",
     lambda f: "set_dflash_layers_to_capture" not in f["draft_setters"]),
    ("dspark target", dict(CUDA_DRAFT, speculative_algorithm="DSPARK"), "--speculative-algorithm DSPARK",
     lambda f: "set_dflash_layers_to_capture" not in f["draft_setters"]),
]
# Accepted with the dump on: LoRA (dump files name their adapter), on every release.
ACCEPTED = [("lora", {"enable_lora": True})]


def _filled(ckpt, settings: dict) -> dict:
    return {a: v.format(ckpt=ckpt) if isinstance(v, str) else v for a, v in settings.items()}


def _exercise(ckpt, settings, effect=None):
    """(ServerArgs of this release built with ``settings``, how) or (None, why it cannot be).
    The release's own constructor builds them (its validation and resolution, as at a launch);
    nothing is written past it. Without an ``effect`` each setting must read back unchanged from
    the release's resolved view; with one (a name of a rule reader in settings: what the rule
    sees in force), the release may respell the settings, and that reader must find it on."""
    from sglang.srt.eagle3_capture import settings as settings_mod
    from sglang.srt.eagle3_capture.settings import resolved

    settings = _filled(ckpt, settings)
    try:
        sa = _rt.server_args(ckpt, load_format="dummy", **settings)
    except Exception as exc:
        return None, "the release's ServerArgs refuse %s here (%s: %s)" % (settings, type(exc).__name__, str(exc)[:200])
    view = resolved(sa)
    changed = {a: getattr(view, a, None) for a, v in settings.items() if getattr(view, a, None) != v}
    how = "constructor" + (", device 'cuda' (built without initialising CUDA)" if settings.get("device") == "cuda" else "")
    if effect:
        in_force = getattr(settings_mod, "_" + effect)(view)
        if in_force is None:
            return None, "the release resolves %s so that no %s is in force (%s)" % (settings, effect, changed or "as set")
        return sa, "%s; %s in force: %s%s" % (how, effect, in_force, "; resolved as %s" % changed if changed else "")
    if changed:
        return None, "this release resolves %s to %s" % (settings, changed)
    return sa, how


def _launch(sa):
    """check_launch's verdict: None (accepted) or its one-line message."""
    from sglang.srt import eagle3_capture

    try:
        eagle3_capture.check_launch(sa)
    except SystemExit as exc:
        return str(exc.code)
    return None


def check_e(ckpt: Path, work: Path) -> None:
    """Every rule at the launch check (what launch_server and Engine run before any worker),
    on ServerArgs this release's constructor builds and resolves from each setting as a launch
    spells it (REFUSALS); then one refusal inside ModelRunner init (the second line of defence).
    A rule whose setting this release lacks must be declared absent in settings.RELEASE_FACTS
    (and is confirmed absent); any other rule this run cannot exercise FAILS (never a silent
    skip)."""
    from sglang.srt import eagle3_capture
    from sglang.srt.eagle3_capture.settings import SERIES_RELEASE, release_facts

    facts = release_facts()
    absent = set(facts["absent_fields"])
    dump = work / "dump-refused"
    with Dumping(dump, layers=[-1, 1, 3]):
        probe = _rt.server_args(ckpt, load_format="dummy")
        eagle3_capture.check_launch(probe)  # the control: these CPU settings pass
        cases = [(label, st, needle, True, effect) for label, st, needle, *effect in REFUSALS]
        cases += [(label, st, needle, bool(refuses(facts)), None) for label, st, needle, refuses in FACT_REFUSALS]
        cases += [(label, st, None, False, None) for label, st in ACCEPTED]
        for label, st, needle, refuses, effect in cases:
            kind = "refused at launch" if refuses else "accepted at launch"
            name = "e. %s: %s" % (kind, label)
            missing = sorted(a for a in st if not hasattr(probe, a))
            declared = sorted(a for a in st if a in absent)
            if missing or declared:
                ok = missing == declared
                result("e. not on sglang %s: %s" % (SERIES_RELEASE, label), ok, "absent" if ok else "facts wrong",
                       "ServerArgs lacks %s; RELEASE_FACTS declares absent %s" % (missing, declared))
                continue
            if "speculative_algorithm" in st:
                from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

                algo = st["speculative_algorithm"]
                if not hasattr(SpeculativeAlgorithm, algo):  # a draft this release does not have
                    ok = not facts["draft_setters"]  # and whose setter the facts must not name
                    result("e. no such draft on sglang %s: %s" % (SERIES_RELEASE, label), ok,
                           "absent" if ok else "facts wrong",
                           "SpeculativeAlgorithm lacks %s; RELEASE_FACTS names draft setters %s"
                           % (algo, list(facts["draft_setters"])))
                    continue
            sa, how = _exercise(ckpt, st, effect[0] if effect else None)
            if sa is None:
                result(name, False, "not exercised", "cannot launch with %s on this release: %s" % (st, how))
                continue
            msg = _launch(sa)
            if refuses:
                ok = (msg is not None and msg.startswith("error: EAGLE3_DUMP_DIR is set but") and needle in msg
                      and "\n" not in msg)
                result(name, ok, "refused" if ok else ("passed" if msg is None else "wrong message"),
                       "%s (%s: %s)" % (msg[:300] if msg else "check_launch accepted it", st, how))
            else:
                result(name, msg is None, "accepted" if msg is None else "refused",
                       "%s (%s: %s)" % (msg[:300] if msg else "check_launch accepted it", st, how))
        guarded(E_RUNNER_NAME)(_runner_refusal)(ckpt)
    # an EAGLE-3 draft at TP > 1 with --moe-dense-tp-size 1, dump off: refused where the fact holds
    if facts["moe_dense_tp1_scatters_capture"]:
        st = {"tp_size": 2, "moe_dense_tp_size": 1, "speculative_algorithm": "EAGLE3"}
        with Dumping(None):
            sa, how = _exercise(ckpt, st)
            msg = _launch(sa) if sa is not None else "not exercised: " + how
        ok = bool(msg) and msg.startswith("error: --speculative-algorithm EAGLE3 with --moe-dense-tp-size 1")
        result("e. refused at launch, dump off: EAGLE3 draft with moe dense tp 1 at tp 2", ok,
               "refused" if ok else "not refused", "%s (%s)" % (msg, st))
    left = sorted(p.name for p in dump.iterdir())
    if left:
        result("e. refusals leave the dump dir empty", False, "%d files" % len(left), ", ".join(left[:5]))


def _runner_refusal(ckpt):
    sa = _rt.server_args(ckpt, load_format="dummy", disable_radix_cache=False)
    try:
        runner = _rt.make_runner(sa)
    except Exception as exc:
        msg = str(exc)
        ok = "EAGLE3_DUMP_DIR" in msg and "--disable-radix-cache" in msg
        result(E_RUNNER_NAME, ok, "refused" if ok else "wrong error", "%s: %s" % (type(exc).__name__, msg[:400]))
        _rt.release(None)
        return
    result(E_RUNNER_NAME, False, "started", "ModelRunner started with EAGLE3_DUMP_DIR set and the radix cache on")
    _rt.release(runner)


D_STEPS = 4


def check_d(ckpt: Path, work: Path) -> None:
    """Dump on (and really writing) vs dump off: same greedy tokens, bit-identical logits."""
    prompts = tinyconfig.prompts()[:4]
    dump = work / "dump-d"
    out = {}
    for mode in ("on", "off"):
        # 3: the final-norm hook must not change outputs
        with Dumping(dump if mode == "on" else None, layers=[-1, 1, 3]):
            runner = _rt.make_runner(_rt.server_args(ckpt))
            try:
                out[mode] = _rt.greedy(runner, prompts, D_STEPS)
                if mode == "on":
                    from sglang.srt.eagle3_capture import capture_target

                    capture_target(runner.model)._eagle3_capture_state.writer.flush()
            finally:
                _rt.release(runner)
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


class _CaptureSpy:
    """Per forward of the runner's DeepseekV2Model: its forward mode, ``layers_to_capture`` as the
    loop reads it, how many states the loop captured (its output's aux part: a list on some
    releases, one packed [T, K * hidden] tensor on others) and whether the final-norm state was
    kept."""

    def __init__(self, runner):
        from sglang.srt.eagle3_capture import capture_target

        self.target = capture_target(runner.model)
        self.state = self.target._eagle3_capture_state
        self.forwards = []
        hidden = self.target.config.hidden_size

        def pre(module, args, kwargs):  # registered after the package's: sees its choice
            batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
            self.forwards.append({"mode": batch.forward_mode.name, "layers": list(module.layers_to_capture),
                                  "captured": 0, "last": False})

        def post(module, args, kwargs, output):
            aux = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if aux is not None:
                self.forwards[-1]["captured"] = len(aux) if isinstance(aux, (list, tuple)) else aux.shape[-1] // hidden

        def after_norm(module, args, output):
            if self.forwards:
                self.forwards[-1]["last"] = self.state.last is not None

        self.hooks = [self.target.model.register_forward_pre_hook(pre, with_kwargs=True),
                      self.target.model.register_forward_hook(post, with_kwargs=True),
                      self.target.model.norm.register_forward_hook(after_norm)]

    def close(self):
        for h in self.hooks:
            h.remove()

    def by_mode(self):
        """{mode: sorted set of (layers, captured, last)} over the forwards seen."""
        out = {}
        for f in self.forwards:
            out.setdefault(f["mode"], set()).add((tuple(f["layers"]), f["captured"], f["last"]))
        return {m: sorted(v) for m, v in out.items()}


DECODE_DUMP_LAYERS = [-1, 1, 3]  # capture indices 0, 2 and 4 (= N: the final-norm hook)
DECODE_DRAFT_IDS = [1]  # capture index 2


def check_decode_capture(ckpt: Path, work: Path) -> None:
    prompts = tinyconfig.prompts()[:3]
    n = tinyconfig.DEEPSEEK_V3["num_hidden_layers"]
    draft = work / "draft-decode"
    _hf.build_draft(draft, DECODE_DRAFT_IDS)
    runs = {
        "dump only": ({}, {"EXTEND": [((0, 2), 2, True)], "DECODE": [((), 0, False)]}),
        "dump + draft %s" % DECODE_DRAFT_IDS: (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), speculative_num_steps=1,
                 speculative_eagle_topk=1, speculative_num_draft_tokens=2),
            {"EXTEND": [((0, 2), 2, True)], "DECODE": [((2,), 1, False)]}),
    }
    problems, seen = [], {}
    for label, (over, want) in runs.items():
        with Dumping(work / ("dump-decode-%d" % len(seen)), layers=DECODE_DUMP_LAYERS):
            runner = _rt.make_runner(_rt.server_args(ckpt, **over))
            spy = _CaptureSpy(runner)
            try:
                _rt.greedy(runner, prompts, D_STEPS)
                spy.state.writer.flush()
                written = spy.state.writer.written
            finally:
                spy.close()
                _rt.release(runner)
        got = spy.by_mode()
        seen[label] = got
        if got != want:
            problems.append("%s: per mode (layers_to_capture, states captured, final-norm state kept) %s, "
                            "want %s" % (label, got, want))
        if written != len(prompts):
            problems.append("%s: %d dump files written, want %d" % (label, written, len(prompts)))
    detail = ("%d-layer model, EAGLE3_DUMP_LAYERS=%s (capture indices 0, 2, %d); prefill + %d decode steps; per "
              "forward mode (layers_to_capture, states captured, final-norm state kept): %s"
              % (n, ",".join(map(str, DECODE_DUMP_LAYERS)), n, D_STEPS - 1, seen))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(DECODE_NAME, not problems, "decode capture %s" % ("draft only" if not problems else "WRONG"), detail)


G_LAYERS = [-1, 1, 3]


def _image_request(wrapper, H, seed=7):
    """An image prompt as sglang's multimodal processor hands it over: the placeholder id once per
    image token, the image as precomputed embeddings; padded by the real wrapper."""
    from array import array

    from sglang.srt.managers import schedule_batch as sb

    ph = wrapper.config.media_placeholder_token_id
    ids = tinyconfig.prompts()[1][:6] + [ph] * 5 + tinyconfig.prompts()[0]
    emb = 0.05 * torch.randn(5, H, generator=torch.Generator().manual_seed(seed))
    item = sb.MultimodalDataItem(modality=sb.Modality.IMAGE, offsets=[(6, 10)], precomputed_embeddings=emb,
                                 format=sb.MultimodalInputFormat.PRECOMPUTED_EMBEDDING)
    mm = sb.MultimodalInputs(mm_items=[item], im_token_id=ph)
    item.set_pad_value()
    try:
        padded = list(wrapper.pad_input_ids(list(ids), mm))
    except (TypeError, AssertionError):  # later releases keep ids as array('q')
        padded = list(wrapper.pad_input_ids(array("q", ids), mm))
    return ids, padded, mm, (6, emb)


def check_g(kimi_ckpt: Path, work: Path, ref) -> None:
    """Two image prompts with the same text and the same number of image tokens but different
    images, and a text prompt, in one prefill through the real Kimi-K2.5 wrapper with the dump
    on: one file per request (named by its request id), each holding the ids with the
    placeholder id (not the pad values, not the clamped vocab - 1) and rows equal to HF fed that
    request's image; the two image files differ in rows and in their recorded image hashes."""
    from safetensors import safe_open

    from sglang.srt.eagle3_capture import capture_target
    from sglang.srt.eagle3_capture.dump import request_key

    dump = work / "dump-image"
    with Dumping(dump, layers=G_LAYERS):
        runner = _rt.make_runner(_rt.server_args(kimi_ckpt, enable_multimodal=True))
    try:
        H = tinyconfig.DEEPSEEK_V3["hidden_size"]
        ids, padded, mm, image = _image_request(runner.model, H, seed=7)
        ids2, padded2, mm2, image2 = _image_request(runner.model, H, seed=8)
        text = tinyconfig.prompts()[2]
        reqs = _rt.requests([padded, padded2, text])
        reqs[0].multimodal_inputs = mm
        reqs[1].multimodal_inputs = mm2
        rids = [r.rid for r in reqs]
        with torch.no_grad():
            _rt.bench().extend(reqs, runner)
        _rt.clear(runner)
        capture_target(runner.model)._eagle3_capture_state.writer.flush()
    finally:
        _rt.release(runner)
    vocab = tinyconfig.DEEPSEEK_V3["vocab_size"]
    files = sorted(p.name for p in dump.iterdir())
    problems, rc = [], RowCheck(TOL)
    want = [request_key(r) + ".safetensors" for r in rids]
    if ids != ids2 or padded == padded2:
        problems.append("the two image prompts must share their processor ids and differ in pad values")
    if files != sorted(want):
        problems.append("files %s, want one per request id %s" % ([f[:12] for f in files], rids))
    hashes = []
    for name, prompt, img in zip(want, (ids, ids2, text), (image, image2, None)):
        path = dump / name
        if not path.exists():
            continue
        with safe_open(str(path), "pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
            hashes.append(json.loads((f.metadata() or {}).get("mm_hashes", "null")))
        if got["input_ids"].tolist() != list(prompt):
            problems.append("stored ids %s..., want %s..." % (got["input_ids"].tolist()[4:12], list(prompt)[4:12]))
        r = ref.run(prompt, image=img)
        for k in G_LAYERS:
            rc.layer(got["layer.%d" % k], r, k)
        rc.final(got["final"], r)
    if len(hashes) == 3 and not (hashes[0] and hashes[1] and hashes[0] != hashes[1] and hashes[2] == []):
        problems.append("recorded image hashes %s: want two different non-empty lists and [] for text" % hashes)
    problems += rc.problems()
    pads = sorted({t for t in padded + padded2 if t >= vocab})
    detail = ("two image prompts of %d tokens (%d image tokens, placeholder %d, pad values %s, clamped to %d) and a "
              "%d-token text prompt in one prefill; files %d; layers %s and final: %s"
              % (len(ids), len(image[1]), mm.im_token_id, pads, vocab - 1, len(text), len(files), G_LAYERS, rc.figure()))
    if problems:
        detail = "; ".join(problems) + " | " + detail
    result(G_NAME, not problems, "max abs diff %.2g" % rc.right, detail)


def main() -> int:
    ckpt, kimi_ckpt, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    which = sys.argv[4].split(",") if len(sys.argv) > 4 else ["a", "d", "g", "e"]
    work.mkdir(parents=True, exist_ok=True)
    if "a" in which:
        log("loading the HF reference")
        guarded(A_NAME)(check_a)(ckpt, work, _hf.Reference(ckpt))
    if "d" in which:
        guarded(D_NAME)(check_d)(ckpt, work)
        guarded(DECODE_NAME)(check_decode_capture)(ckpt, work)
    if "g" in which:
        guarded(G_NAME)(check_g)(kimi_ckpt, work, _hf.Reference(ckpt))
    if "e" in which:
        check_e(ckpt, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
