"""The acceptance run, phase by phase (what ``tools/acceptance.py`` runs; see docs/acceptance.md).

Phases (each timed in the result's ``phases``; a phase whose output is already in the work
directory is reused, so a run cut by ``--budget-s`` resumes with the same ``--work``):

1. ``target``: a DeepSeek-V3 trained on a synthetic language (``language``), or ``--target DIR``;
   gates: bf16-vs-fp32 greedy agreement, bigram predictability, loop rate. The training goes on
   until the gates pass (measured whenever the token accuracy reaches ``target_done_acc``), for
   the call's ``--budget-s`` (``target_budget_s``: a cap of its own, where set). A call whose
   budget ends first saves the training state (``STATE_NAME``) and ends ``incomplete`` (exit 3,
   ``Incomplete``): the same command with the same ``--work`` continues at the saved step. A
   target passed in the call leaves the later phases ``later_phases_s`` or else ends the call
   incomplete (the next reuses it). A target that fails a gate at ``target_steps``, or a given
   one that fails, is refused (exit 2, the reason on one line).
2. ``data``: the patched server with the dump on (every layer), greedy continuations of the
   train and held-out prompts through its ``/generate``, then ``tools/extract.py --format
   specforge`` on them, as a user runs it. The dump's storage is a setting (issue 30:
   ``dump_dtype=bf16|fp8``, ``rebuildable=store|omit``, the server's ``EAGLE3_DUMP_DTYPE`` and
   ``EAGLE3_DUMP_REBUILDABLE``); data of another storage than bf16/store goes to
   ``data-<dtype>-<rebuildable>`` beside ``data`` and takes ``data``'s conversations when they are
   of the same prompts. The result's ``storage`` holds each dataset's dump bytes (state tensors
   apart from ids and headers) and dataset bytes, and, beside a reference ``data``, the row error
   per state of what the reader yields against it (``storage_check``).
3. ``drafts``: SpecForge 0.2.0's LlamaForCausalLMEagle3 + OnlineEagle3Model + Eagle3TrainStrategy,
   once on the dataset and once with its aux inputs zeroed (the floor); held-out a1..ak and the
   predicted accept length; four draft directories (correct, off-by-one, floor, upstream ids).
   With ``controls=correct`` only the correct draft, once per draft seed (``draft_seeds``),
   each served (replayed) on its own: what a comparison of two datasets needs.
   With ``draft_max_steps`` the drafts train that many steps, whatever a step costs; a run whose
   budget (``--budget-s``) cut them short is ``not measured`` and reports no accept length
   (``verdicts.drafts_verdict``).
4. ``guard``: ``tools/guard.py`` on every control's draft config and the dataset.
5. GPU ``serve``: each draft on a server with ``--speculative-algorithm EAGLE3`` (3 steps, topk 1,
   4 draft tokens, CUDA graphs), the accept length from each response's meta_info
   (sum(C-1)/sum(V)), outputs compared with the no-speculation greedy ones
   (``verdicts.served_verdict``). CPU ``replay`` (sglang 0.5.9 runs no EAGLE-3 decoding on CPU:
   its tree and cache kernels are CUDA/Triton): no server loads a draft; each control's chain
   acceptance is replayed with SpecForge's TTT forward over the held-out dataset extracted with
   the layers that control's reading serves (``train.DraftRun.chain_replay``), reported as
   ``replayed`` (``verdicts.replayed_verdict``).

Before any of it (``check_options``): the settings (``parse_sets``), ``--out``, the ports the run
will listen on and a given target's architecture and tokenizer are checked, each refused in one
line. Long steps print progress (``progress``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EaglepatchError, RefusedError, UsageError
from . import language as lang_mod
from . import progress
from . import verdicts

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src"
TOOLS = REPO / "tools"
NUM_STEPS = 3
GATES = {"bf16_fp32_agreement": (">=", 0.99), "bigram_predictability": ("<=", 0.5), "loop_rate": ("<=", 0.2)}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CONTROLS = ("correct", "off_by_one", "floor", "upstream_ids")


def gate_failures(gates: dict) -> list:
    """The gates ``gates`` (train.measure's figures) fails, each as 'name value (need op limit)'."""
    return [f"{k} {gates[k]} (need {op} {lim})" for k, (op, lim) in GATES.items()
            if not (gates[k] >= lim if op == ">=" else gates[k] <= lim)]


def gate_shortfalls(gates: dict) -> list:
    """As ``gate_failures``, each with how far it is from its limit: 'name value (need op limit:
    d short)' ('d over' for an upper limit)."""
    return [f"{k} {gates[k]} (need {op} {lim}: {abs(gates[k] - lim):.4g} {'short' if op == '>=' else 'over'})"
            for k, (op, lim) in GATES.items() if not (gates[k] >= lim if op == ">=" else gates[k] <= lim)]


class Incomplete(EaglepatchError):
    """The call's budget ended before the run was done; what it did is saved under ``--work`` and
    the same command (same ``--work``) goes on from there. Exit 3, one line ``incomplete: ...``."""

    exit_code = 3

    def line(self) -> str:
        return " ".join(f"incomplete: {self.problem}; {self.fix}".split())


# The target's training state, under --work, while its gates have not passed (train.TargetTraining)
STATE_NAME = "target-training.pt"
# what a call keeps of its budget after the target's training: the last gate measurement and
# the state's save (the GPU target's state: 916 MiB measured with transformers 4.57)
TARGET_END_S = 30
# the settings a training state is bound to, beside the scale, the seed and the target's config
# (a state of other settings is refused, never mixed into this run's target)
TRAINING_KEYS = ("language", "symbols", "alphabet", "answer_len", "lead", "target_batch", "target_lr",
                 "target_embed_std")


# what the floor's training leaves of the budget for guard and serve (on the H200 serve took 87 s:
# four servers started side by side, 49-73 s each, then 128 requests to each)
SERVE_RESERVE_S = 110

# Settings of both scales (issue 30). dump_dtype / rebuildable: the data server's
# EAGLE3_DUMP_DTYPE / EAGLE3_DUMP_REBUILDABLE (bf16: states stored as computed, float32 on the CPU
# toy; fp8: float8_e4m3fn with a scale per token and state; omit: the vocabulary rows' embedding
# output and the post-norm final are left out and rebuilt by the reader). Data made with other
# than bf16/store lives in its own directory (data-<dtype>-<rebuildable>), so one --work holds
# both and the target is trained once. controls: all (the four controls) or correct (only the
# correct draft: what a comparison of data needs); draft_seeds: with controls=correct, that many
# correct drafts, seeds draft_seed (null: --seed), +1, ...; each trained, evaluated, guarded and
# served (replayed on CPU) on its own.
_STORAGE_DEFAULTS = dict(dump_dtype="bf16", rebuildable="store", controls="all", draft_seeds=1, draft_seed=None)
# family=dflash (issue 44, item 5; GPU, a release that serves DFlash): the drafts are DFlash drafts of
# dflash_layers layers and block dflash_block, trained on --format dflash data with SpecForge's
# OnlineDFlashModel (dflash_anchors blocks per sample and step), exported with the target ids
# DFLASH_IDS and served by SGLang's own DFLASH worker beside the controls of the same weights
# (verdicts.DFLASH_CONTROLS); the prediction is the correct draft's replay on the held-out data.
_FAMILY_DEFAULTS = dict(family="eagle3", dflash_layers=2, dflash_block=4, dflash_anchors=64)
# The correct DFlash draft reads the output of layer 1 (HF index 2). SGLang refuses ids outside
# 0..N-1 and never captures the last layer's output for a DFlash draft, so on the 4-layer GPU
# target the one id whose shift (+1: layer 2) and layer-input reading (-1: layer 0) both serve is 1.
DFLASH_IDS = [1]
MAX_DRAFT_SEEDS = 8
REFERENCE_STORAGE = ("bf16", "store")

# Scales. cpu: the toy trained on CPU (a few hundred tokens, a few training steps; the test runs
# the copy toy target of tests/data with its own settings); gpu: the check model's DeepSeek-V3
# (real MLA dims, MoE with a shared expert) on one H200. draft_max_steps: the correct draft's
# steps (0: its seconds, draft_budget_s, decide instead; set, draft_budget_s does not apply and
# only the run's --budget-s can cut them, which makes the figures not measured); the floor
# always trains as many steps as the correct draft got. The target trains until its gates pass
# (measured whenever two logged batches reach token accuracy target_done_acc), at most
# target_steps over all calls; target_budget_s (null: none) caps one call's training beside
# --budget-s; later_phases_s: the seconds data, drafts, guard and serve/replay need after it
# (GPU: 124 + 143 + 1 + 90 s measured on the H200), else the call ends incomplete and the next
# reuses the target.
SCALES = {
    "cpu": dict(device="cpu", language="skip", symbols=24, alphabet=None, answer_len=20, target_steps=200, target_batch=16,
                target_lr=3e-3, target_budget_s=None, target_done_acc=0.98, later_phases_s=240, train_prompts=24,
                heldout_prompts=8, gate_prompts=8,
                draft_epochs=40, draft_batch=4, draft_lr=3e-3, draft_budget_s=30, dtype="float32", target_embed_std=None,
                draft_fc_norm=False, lead=0, warm=False, draft_max_steps=0, **_STORAGE_DEFAULTS, **_FAMILY_DEFAULTS),
    "gpu": dict(device="cuda", language="copy", symbols=48, alphabet=64, answer_len=40, target_steps=16000, target_batch=128,
                target_lr=1e-3, target_budget_s=None, target_done_acc=0.98, later_phases_s=360, train_prompts=1024,
                heldout_prompts=128, gate_prompts=64,
                draft_epochs=200, draft_batch=64, draft_lr=5e-4, draft_budget_s=70, dtype="bfloat16",
                target_embed_std=None, draft_fc_norm=True, lead=0, warm=True, draft_max_steps=0, **_STORAGE_DEFAULTS,
                **_FAMILY_DEFAULTS),
}


# The settings that may be null (a scale's default is None), and their type; the others take
# their default's type.
NONE_TYPES = {"alphabet": int, "target_embed_std": float, "draft_seed": int, "target_budget_s": float}
CHOICES = {"language": lang_mod.LANGUAGES, "device": ("cpu", "cuda"), "dtype": ("float32", "bfloat16"),
           "dump_dtype": ("bf16", "fp8"), "rebuildable": ("store", "omit"), "controls": ("all", "correct"),
           "family": ("eagle3", "dflash")}
_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a word"}


def parse_sets(scale: str, items: list) -> dict:
    """``--set KEY=VALUE`` items -> overrides of ``SCALES[scale]``. VALUE is read as JSON (a bare
    word as a string); it must have the setting's type: ``true``/``false`` only for a flag, never
    for a number (``True`` is an int to Python: ``draft_max_steps=true`` trained 1 step);
    numbers finite and not negative; ``null`` only where the default is. Anything else is a
    one-line usage error naming the key, the type and an example."""
    import math

    defaults = SCALES[scale]
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or key not in defaults:
            raise UsageError(f"--set {item}: not KEY=VALUE with a known key", "use one of " + ", ".join(sorted(defaults)))
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        d = defaults[key]
        nullable = key in NONE_TYPES
        want = NONE_TYPES.get(key) or type(d)
        if isinstance(value, bool):
            ok = want is bool
        elif isinstance(value, int):
            ok = want in (int, float)
            value = float(value) if want is float else value
        elif isinstance(value, float):
            ok = want is float and math.isfinite(value)
        elif value is None:
            ok = nullable
        else:
            ok = want is str and isinstance(value, str)
        if ok and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            ok = False
        if ok and key in CHOICES and value not in CHOICES[key]:
            raise UsageError(f"--set {item}: {key} is one of " + ", ".join(CHOICES[key]),
                             f"e.g. --set {key}={CHOICES[key][0]}")
        if not ok:
            example = d if d is not None else {"alphabet": 64, "target_embed_std": 0.02, "draft_seed": 1,
                                               "target_budget_s": 300}[key]
            what = _TYPE_WORDS[want] + (" >= 0" if want in (int, float) else "") + (" or null" if nullable else "")
            raise UsageError(f"--set {item}: {key} takes {what}", f"e.g. --set {key}={json.dumps(example)}")
        out[key] = value
    return out


def served_drafts(p: dict) -> int:
    """How many drafts a run serves side by side: the four controls, or (controls=correct) one
    correct draft per draft seed."""
    return len(CONTROLS) if p.get("controls", "all") == "all" else p.get("draft_seeds", 1)


def ports_used(scale: str, p: dict, port: int) -> list:
    """The ports a run listens on: the data server at ``port``; on the GPU the draft servers at
    port + 1..4 (the four controls; with controls=correct one per draft seed); with ``warm`` the
    two warm-up servers at port + 20 and + 21."""
    out = [port]
    if scale == "gpu":
        out += [port + 1 + i for i in range(served_drafts(p))]
    if p.get("warm"):
        out += [port + 20, port + 21]
    return out


def check_target_dir(d: Path) -> dict:
    """A given ``--target`` is a DeepSeek-V3 checkpoint (config.json's architectures) with at least
    3 layers (the off-by-one control reads one layer deeper) and the chat tokenizer of
    ``serve.tinychat`` (the languages' token ids are its words); its config, else a one-line usage
    error. Pure JSON: checked before anything is trained or started."""
    from ..serve import tinychat

    d = Path(d)
    fix = "pass a DeepSeek-V3 checkpoint saved by this tool (its target/ directory) or drop --target to train one"
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        why = "has no config.json" if isinstance(exc, FileNotFoundError) else f"has an unreadable config.json ({exc})"
        raise UsageError(f"--target {d} {why}", fix) from None
    arch = cfg.get("architectures") if isinstance(cfg, dict) else None
    if arch != ["DeepseekV3ForCausalLM"]:
        raise UsageError(f"--target {d} is {arch or 'of no architecture'} (config.json), not DeepseekV3ForCausalLM", fix)
    layers, vocab_size = cfg.get("num_hidden_layers"), cfg.get("vocab_size")
    if not isinstance(layers, int) or layers < 3:
        raise UsageError(f"--target {d} has {layers} layers; the run needs at least 3 (the off-by-one control reads "
                         "one layer deeper than the draft's)", fix)
    try:
        vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        vocab = None
    if not isinstance(vocab_size, int) or vocab_size < len(tinychat.SPECIALS) + len(tinychat.WORDS) \
            or vocab != tinychat.vocab(vocab_size):
        raise UsageError(f"--target {d} does not use the chat tokenizer of eaglepatch.serve.tinychat (tokenizer.json, "
                         f"vocab_size {vocab_size})", fix)
    return cfg


def check_options(o: "Options") -> None:
    """Everything a run can be refused for before it trains or starts anything, each in one line:
    the budget, the settings together (draft_budget_s with draft_max_steps; draft_seeds outside
    1..8 or above 1 without controls=correct; a language that does not fit the target), the release, ``--out`` (a regular file or a new path: a symbolic link,
    FIFO or directory is refused; the report is written by rename), a given target's
    architecture and tokenizer, the ports (in range: exit 2; taken: exit 1)."""
    import math

    from .. import guard
    from ..outputs import check_output_file
    from ..serve import refuse_taken_port

    if not (isinstance(o.budget_s, (int, float)) and math.isfinite(o.budget_s) and o.budget_s >= 0):
        raise UsageError(f"--budget-s {o.budget_s}: not a number of seconds >= 0",
                         "pass e.g. --budget-s 570 (0: no budget)")
    p = dict(SCALES[o.scale], **o.overrides)
    if p["draft_max_steps"] and "draft_budget_s" in o.overrides:
        raise UsageError("draft_budget_s does nothing with draft_max_steps %d: the drafts train by steps"
                         % p["draft_max_steps"], "drop --draft-budget-s / --set draft_budget_s (--budget-s bounds "
                         "the run), or set draft_max_steps=0 to train by seconds")
    if not 1 <= p["draft_seeds"] <= MAX_DRAFT_SEEDS:
        raise UsageError(f"draft_seeds {p['draft_seeds']}: 1 to {MAX_DRAFT_SEEDS} drafts", "e.g. --set draft_seeds=3")
    if p["draft_seeds"] > 1 and p["controls"] != "correct":
        raise UsageError(f"draft_seeds {p['draft_seeds']} needs controls=correct (only the correct draft is trained "
                         "per seed)", "add --set controls=correct")
    try:
        guard.release_semantics(o.release)
    except UsageError as exc:
        raise UsageError(f"--release {o.release}: {exc.problem}",
                         "pass --release a release with a series under patches/ (e.g. 0.5.9 or 0.5.17)") from None
    if p["family"] == "dflash":
        check_dflash(o, p)
    if o.out is not None:
        out = Path(o.out)
        if out.parent.is_dir() or Path(out.parent) != Path(o.work):  # the default is made with the work dir
            check_output_file(out, "--out")
    cfg = check_target_dir(o.target) if o.target is not None else target_config(o.scale)
    try:
        lang_mod.Language(p["language"], cfg["vocab_size"], p["symbols"], p["answer_len"], o.seed,
                          alphabet=p["alphabet"], lead=p["lead"])
    except ValueError as exc:
        raise UsageError(f"the language settings do not fit the target: {exc}",
                         "change --set symbols/alphabet/answer_len/lead") from None
    ports = ports_used(o.scale, p, o.port)
    if not 1 <= o.port or max(ports) > 65535:
        raise UsageError(f"--port {o.port}: the run listens on ports {min(ports)} to {max(ports)}",
                         f"pass --port 1024 to {65535 - (max(ports) - o.port)}")
    for port in ports:
        refuse_taken_port("127.0.0.1", port, "a server of the run",
                          "stop that process or pass another --port (the run uses --port to --port + 4, and "
                          "--port + 20 and + 21 for the warm-up servers)")


def check_dflash(o: "Options", p: dict) -> None:
    """family=dflash: a GPU run (no CPU sglang here runs a DFlash worker) of the four controls, one
    draft seed, on a release that serves DFlash drafts on the target's model file, a target deep
    enough that the shifted ids stay below its last layer."""
    from .. import conventions

    if o.scale != "gpu":
        raise UsageError("family=dflash is a GPU run: SGLang's DFLASH worker needs CUDA",
                         "drop --cpu (run it on a GPU machine), or drop --set family=dflash")
    if p["controls"] != "all" or p["draft_seeds"] != 1:
        raise UsageError("family=dflash runs the four controls of one draft", "drop --set controls / draft_seeds")
    cfg = check_target_dir(o.target) if o.target is not None else target_config(o.scale)
    try:
        conventions.draft_rule(o.release, "dflash", conventions.config_cell(cfg))
    except UsageError as exc:
        raise UsageError(f"family=dflash: {exc.problem}", "pass --release 0.5.17 or 0.5.23") from None
    if cfg["num_hidden_layers"] < max(DFLASH_IDS) + 3:
        raise UsageError(f"family=dflash needs a target of at least {max(DFLASH_IDS) + 3} layers (its ids "
                         f"{DFLASH_IDS} shifted by one stay below the last layer); this one has "
                         f"{cfg['num_hidden_layers']}", "pass a deeper --target")
    if p["dflash_block"] < 2 or p["dflash_layers"] < 1:
        raise UsageError("dflash_block takes 2 or more, dflash_layers 1 or more", "e.g. --set dflash_block=4")


def target_config(scale: str) -> dict:
    from ..gpucheck.models import CHECK_MODEL
    from ..smoke.tinyconfig import DEEPSEEK_V3

    if scale == "cpu":
        return dict(DEEPSEEK_V3, num_attention_heads=4, num_key_value_heads=4, initializer_range=0.02)
    return dict(CHECK_MODEL)


@dataclass
class Options:
    work: Path
    scale: str = "cpu"
    out: Path | None = None
    target: Path | None = None
    release: str = "0.5.9"          # the release serving (and whose reading guard uses)
    sglang_parent: Path | None = None  # patched sglang package parent
    unpatched_parent: Path | None = None  # the same release unpatched (GPU upstream-ids control)
    site: Path | None = None
    budget_s: float = 570.0            # 0: no budget (phases always start; nothing is cut by time)
    seed: int = 0
    overrides: dict = field(default_factory=dict)
    port: int = 31000
    accept_failed_gates: bool = False  # go on past failed gates (plumbing runs; the figures then mean nothing)
    say: object = None
    again: str | None = None           # the command that runs this call again (named by an incomplete call)


class Run:
    def __init__(self, o: Options):
        self.o = o
        self.t0 = time.monotonic()
        self.p = dict(SCALES[o.scale], **o.overrides)
        self.work = Path(o.work).absolute()
        self.work.mkdir(parents=True, exist_ok=True)
        # data of another storage than the reference's, its drafts and its server logs go to their
        # own directories (data-fp8-omit, drafts-fp8-omit, logs-fp8-omit): one --work holds both
        key = (self.p["dump_dtype"], self.p["rebuildable"])
        self.suffix = "" if key == REFERENCE_STORAGE else "-%s-%s" % key
        self.dflash = self.p["family"] == "dflash"
        if self.dflash:  # data, drafts and logs of their own: the datasets hold other layers
            self.suffix += "-dflash"
        self.logs = self.work / ("logs" + self.suffix)
        self.res = {"scale": o.scale, "release": o.release, "work": str(self.work), "settings": self.p, "phases": {},
                    "verdicts": {}}
        self.say = o.say or (lambda m: print(m, file=sys.stderr, flush=True))

    def left(self) -> float:
        """Seconds left of ``--budget-s`` (infinite without a budget)."""
        if not self.o.budget_s:
            return float("inf")
        return self.o.budget_s - (time.monotonic() - self.t0)

    def phase(self, name, fn) -> bool:
        """Run one phase, timed; False (recorded) when the budget left no time to start it."""
        if self.left() < 20:
            self.res["phases"][name] = {"skipped": "budget spent (%.0f s of %.0f s)" % (time.monotonic() - self.t0, self.o.budget_s)}
            self.say("[acceptance] %s: not started, budget spent" % name)
            return False
        t = time.monotonic()
        self.say("[acceptance] phase %s ..." % name)
        try:
            fn()
        except Incomplete:  # timed all the same: the next call goes on from what it did
            self.res["phases"][name] = {"wall_s": round(time.monotonic() - t, 1), "incomplete": True}
            raise
        self.res["phases"][name] = {"wall_s": round(time.monotonic() - t, 1)}
        self.say("[acceptance] phase %s done (%.0f s)" % (name, time.monotonic() - t))
        self.save()
        return True

    def save(self):
        """The result JSON at ``--out``, whole or not at all (a temporary file in its directory,
        then a rename); never through a symbolic link or into a FIFO (``outputs.write_atomic``)."""
        from ..outputs import write_atomic

        self.res["wall_s"] = round(time.monotonic() - self.t0, 1)
        if self.o.out:
            write_atomic(self.o.out, json.dumps(self.res, indent=2) + "\n", "--out")

    # ---- 1. target ----------------------------------------------------------------------------
    def language(self, cfg):
        return lang_mod.Language(self.p["language"], cfg["vocab_size"], self.p["symbols"], self.p["answer_len"],
                                 self.o.seed, alphabet=self.p["alphabet"], lead=self.p["lead"])

    def target_fingerprint(self) -> dict:
        """What a trained target (or its training state) comes from: scale, seed, the scale's
        target config and the training settings (``TRAINING_KEYS``); a state or target of another
        is refused (``refuse_other``), never mixed into this run's."""
        import hashlib

        cfg = target_config(self.o.scale)
        return {"scale": self.o.scale, "seed": self.o.seed,
                "target_config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
                **{k: self.p[k] for k in TRAINING_KEYS}}

    def refuse_other(self, saved: dict, what: str, fix: str) -> None:
        """A one-line usage error when ``saved`` (a fingerprint) is not this run's."""
        mine = self.target_fingerprint()
        diff = [("another target config" if k == "target_config_sha256" else f"{k} {saved.get(k)!r}, not {v!r}")
                for k, v in mine.items() if saved.get(k) != v]
        if diff:
            raise UsageError(f"{what} is of another run ({'; '.join(diff)})", fix)

    def again(self) -> str:
        """How to continue an incomplete call."""
        if self.o.again:
            return "run again with the same --work to continue: " + self.o.again
        return "run the same command again with the same --work to continue"

    def incomplete(self, problem: str, fix: str) -> Incomplete:
        """An ``Incomplete`` to raise, its line in the result (``incomplete``), the result saved."""
        exc = Incomplete(problem, fix)
        self.res["incomplete"] = exc.line()
        self.save()
        return exc

    def do_target(self):
        from . import train

        d = self.work / "target"
        trained_now = False
        if self.o.target is not None:
            d = Path(self.o.target).absolute()
            cfg = json.loads((d / "config.json").read_text())
            model = train.load_target(d, self.p["device"])
            self.res["target"] = {"path": str(d), "given": True}
        elif (d / "acceptance-target.json").is_file():
            cfg = json.loads((d / "config.json").read_text())
            meta = json.loads((d / "acceptance-target.json").read_text())
            if meta.get("fingerprint"):  # targets saved before fingerprints: taken as they are
                self.refuse_other(meta["fingerprint"], f"the trained target in {d}",
                                  f"pass another --work, or --target {d} to use it as given")
            model = train.load_target(d, self.p["device"])
            self.res["target"] = meta
        else:
            cfg, model = self.train_target()
            trained_now = True
        self.cfg = cfg
        self.lg = self.language(cfg)
        gates = self.res["target"].get("gates") or train.measure(model, self.lg, self.p["gate_prompts"], self.o.seed)
        self.res["target"]["gates"] = gates
        if not self.res["target"].get("sha256"):  # two runs that compare their data served the same weights
            from .storage_check import target_sha256

            self.res["target"]["sha256"] = target_sha256(d)
        if not self.o.target:
            (d / "acceptance-target.json").write_text(json.dumps(self.res["target"], indent=2))
        self.target = d
        del model
        fails = gate_failures(gates)
        if not fails and self.o.target is None and (self.work / STATE_NAME).is_file():  # the target holds it now
            (self.work / STATE_NAME).unlink()
        self.res["verdicts"]["target_gates"] = {"passed": not fails, "failed": fails}
        if fails and self.o.accept_failed_gates:
            self.say("[acceptance] target gates failed (%s); going on as --accept-failed-gates asks: the "
                     "figures below do not measure layer choice" % "; ".join(fails))
        elif fails:
            self.save()
            raise UsageError("the target cannot tell layers apart: " + "; ".join(fails),
                             "train it longer (--target-steps/--target-budget-s) or pass another --target")
        if trained_now and self.left() < self.p["later_phases_s"]:
            raise self.incomplete(f"the target passed its gates and is saved in {d}, but the later phases need about "
                                  f"{self.p['later_phases_s']:.0f} s and {max(self.left(), 0):.0f} s of --budget-s are "
                                  "left", self.again() + " (the target is reused)")

    def train_target(self):
        """A target trained until its gates pass (``train.TargetTraining``), from the state a
        previous call saved under ``--work`` when there is one (refused in one line when another
        run saved it). Trained for ``--budget-s`` less ``TARGET_END_S`` (and ``target_budget_s``
        at most, where set). Gates passed (or ``--accept-failed-gates``): the target is saved as
        SGLang loads it and its config and model returned. Not passed: the state is saved (a
        temporary file, then a rename) and the call ends ``Incomplete`` (the budget ended: exit 3,
        naming the steps, the token accuracy, each failing gate and how far it is, the command
        to continue), or refused (``target_steps`` reached: exit 2)."""
        from . import train

        d = self.work / "target"
        cfg = target_config(self.o.scale)
        fingerprint = self.target_fingerprint()
        state_path = self.work / STATE_NAME
        state = None
        if state_path.is_file():
            state = train.TargetTraining.read(state_path)
            self.refuse_other(state.get("meta") or {}, f"the target training state {state_path}",
                              f"pass another --work, or delete {state_path} to train this run's target from step 0")
        model = train.build_target(cfg, self.p["device"], self.o.seed, self.work / "target-init",
                                   self.p["target_embed_std"])
        # what save_target checks after the training, checked before it (it took the whole
        # training to learn that a transformers saves other names)
        train.check_target_saves(model, cfg, self.work / "target-init")
        lg = self.language(cfg)
        tt = train.TargetTraining(model, lg, self.p["target_batch"], self.p["target_lr"], self.o.seed, self.p["device"])
        if state is not None:
            tt.load(state)
            del state
            self.say("[acceptance] target: resumed at step %d from %s (%d call%s before this one, %.0f s of training)"
                     % (tt.step, state_path, len(tt.calls), "s" * (len(tt.calls) != 1), tt.train_s))
        self.res["target"] = {"path": str(d), "given": False, "resumed_at_step": tt.step}
        if self.p["warm"]:
            self.start_warm(model, cfg)
        budget = self.left() - TARGET_END_S
        if self.p["target_budget_s"] is not None:
            budget = min(budget, self.p["target_budget_s"])

        def gates(m):
            g = train.measure(m, lg, self.p["gate_prompts"], self.o.seed)
            return g, gate_failures(g)

        hist = tt.run(self.p["target_steps"], budget, self.say, self.p["target_done_acc"], gates)
        g = hist.pop("gates")
        self.res["target"].update(training=hist, gates=g)
        if hist["gates_failed"]:  # saved also when --accept-failed-gates goes on: the training can go on later
            size = tt.save(state_path, fingerprint)
            self.res["target"]["state"] = {"path": str(state_path), "bytes": size, "step": tt.step}
            self.say("[acceptance] target: training state saved in %s (%.1f MiB)" % (state_path, size / 2**20))
        if hist["gates_failed"] and not self.o.accept_failed_gates:
            self.res["verdicts"]["target_gates"] = {"passed": False, "failed": hist["gates_failed"]}
            self.save()
            acc = f"token accuracy {tt.last['acc']:.3f} on its last batch" if tt.last else "no batch yet"
            done = (f"the target trained {tt.step} steps in {len(tt.calls)} call{'s' * (len(tt.calls) != 1)} "
                    f"({acc}) and fails {'; '.join(gate_shortfalls(g))}; its training state "
                    f"({size / 2**20:.1f} MiB) is saved in {state_path}")
            if hist["stopped_by"] == "steps":
                raise UsageError(f"{done}, at target_steps {self.p['target_steps']}",
                                 "raise --target-steps and run again with the same --work (the training goes on "
                                 f"from step {tt.step}), or pass another --target")
            raise self.incomplete(f"{done}, and the call's budget ended", self.again())
        train.save_target(model, cfg, d, self.p["dtype"])
        self.res["target"]["fingerprint"] = fingerprint
        return cfg, model

    def start_warm(self, model, cfg):
        """Two throwaway servers on the untrained target (the data server's flags, and a speculative
        one with an untrained draft), started while the target trains: a first start on a fresh GPU
        machine spends most of its time compiling Triton kernels (the data server's CUDA-graph
        capture took 82 s of its 155 s), and the kernels depend on shapes and dtypes, not on
        weights. The real servers then find them in the Triton cache. Each is stopped before the
        server it warms starts (``finish_warm``); its start time is in the result's ``warm``."""
        from . import train

        d = self.work / "warm"
        try:
            target = train.save_target(model, cfg, d / "target", self.p["dtype"])
            if self.dflash:
                from . import dflash

                dcfg = dflash.draft_config(cfg, DFLASH_IDS, self.p["dflash_block"], self.p["dflash_layers"],
                                           cfg["vocab_size"] - 1, self.p["dtype"])
                draft = dflash.DFlashRun(target, dcfg, self.p["device"], seed=self.o.seed).export(d / "draft")
            else:
                dcfg = train.draft_config(cfg, self.readings_ids(cfg), self.p["dtype"], self.p["draft_fc_norm"])
                draft = train.DraftRun(target, dcfg, NUM_STEPS, self.p["device"], seed=self.o.seed).export(
                    d / "draft", self.p["dtype"])
        except Exception as exc:  # noqa: BLE001 - warming is an optimisation: the run goes on cold
            self.res["warm"] = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
            return
        parent = self.patched_parent()
        self.res["warm"] = {}
        for name, dr in (("warm-data", None), ("warm-spec", draft)):
            srv = Server(self, name, parent, dr, None, port=self.o.port + 20 + len(self.res["warm"]), model=target)
            srv.start()
            self.servers[name] = srv
            self.res["warm"][name] = {"started_at_s": round(time.monotonic() - self.t0, 1)}

    def finish_warm(self, name: str):
        """Wait (within the budget) for warm server ``name`` to be ready, then stop it."""
        srv = self.servers.pop(name, None)
        if srv is None:
            return
        t = time.monotonic()
        try:
            srv.wait_ready(timeout=max(min(300.0, self.left() - 200), 5))
            self.res["warm"][name].update(ready_after_s=srv.start_s)
        except RefusedError as exc:
            self.res["warm"][name].update(error=str(exc)[:300])
        finally:
            srv.stop()
        self.res["warm"][name]["waited_s"] = round(time.monotonic() - t, 1)

    # ---- 2. data -----------------------------------------------------------------------------
    def tool_env(self) -> dict:
        """The environment of the tools/*.py the run calls: this process's PYTHONPATH (the bundle's
        transformers on the GPU, which wrote the target's tokenizer) after the repository's src."""
        rest = os.environ.get("PYTHONPATH")
        return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC)] + ([rest] if rest else [])))

    def server_env(self, parent: Path, dump: Path | None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
        paths = [str(parent)]
        if self.o.scale == "cpu":
            from ..smoke import STUBS

            paths.append(str(STUBS))
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        else:
            env.update({k: env.get(k, v) for k, v in MULTICAST_OFF.items()})
            if self.o.site:
                paths.append(str(self.o.site))
        paths.append(str(SRC))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        if dump is not None:
            n = self.cfg["num_hidden_layers"]
            env["EAGLE3_DUMP_DIR"] = str(dump)
            env["EAGLE3_DUMP_LAYERS"] = ",".join(str(k) for k in range(-1, n))
            if (self.p["dump_dtype"], self.p["rebuildable"]) != REFERENCE_STORAGE:  # set only then: a default
                env["EAGLE3_DUMP_DTYPE"] = self.p["dump_dtype"]                    # run is what it was
                env["EAGLE3_DUMP_REBUILDABLE"] = self.p["rebuildable"]
        return env

    def server_argv(self, port: int, draft: Path | None, parent: Path, model: Path | None = None) -> list:
        from ..serve import cpu_flags, dump_flags

        model = model or self.target
        if self.o.scale == "cpu":
            argv = cpu_flags(model, model, port=port)
        else:
            argv = ["--model-path", str(model), "--dtype", "bfloat16", "--attention-backend", "triton",
                    "--sampling-backend", "pytorch", *dump_flags(parent), "--chunked-prefill-size", "-1",
                    "--context-length", "2048", "--max-running-requests", "16", "--cuda-graph-bs-decode", "1", "2",
                    "4", "8", "16",
                    # Four servers share the GPU and start side by side: each sizes its KV pool as the
                    # memory free now minus (1 - fraction) x the memory free when it started, so a
                    # neighbour's pool taken in between must fit in the fraction; the pool itself is
                    # capped (64 Ki tokens: ~0.3 GB for this model).
                    "--mem-fraction-static", "0.5", "--max-total-tokens", "65536",
                    "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port)]
        if draft is not None and self.dflash:  # SGLang's own DFLASH worker, one block per verify
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft),
                     "--speculative-num-draft-tokens", str(self.p["dflash_block"]),
                     "--speculative-draft-attention-backend", "triton"]
        elif draft is not None:
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                     "--speculative-num-steps", str(NUM_STEPS), "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", str(NUM_STEPS + 1)]
        return [sys.executable, "-m", "sglang.launch_server", *argv]

    def data_name(self) -> str:
        """The data directory under the work dir: ``data`` for states stored as computed (bf16/store,
        the reference), ``data-<dump_dtype>-<rebuildable>`` otherwise."""
        return "data" + self.suffix

    def reused_greedy(self, prompts: list) -> list | None:
        """The reference data's conversations (``data/greedy.json``), when this run's data is another
        storage's and the reference was made from the same prompts: the two datasets then hold the
        same conversations (and no second greedy generation is needed). None otherwise."""
        ref = self.work / "data" / "greedy.json"
        if self.data_name() == "data" or not ref.is_file():
            return None
        try:
            conv = json.loads(ref.read_text())
            made_by = json.loads((ref.parent / "done.json").read_text()).get("target_sha256")
        except (OSError, ValueError):
            return None
        mine = self.target_sha()
        if made_by and mine and made_by != mine:  # another target's continuations
            return None
        return conv if [c.get("prompt_ids") for c in conv] == prompts else None

    def check_storage_supported(self, parent: Path) -> None:
        """A storage setting the patched tree does not know would be ignored by its server, and the
        run would compare bf16 with bf16: refused before the server starts."""
        if (self.p["dump_dtype"], self.p["rebuildable"]) == REFERENCE_STORAGE:
            return
        settings = Path(parent) / "sglang" / "srt" / "eagle3_capture" / "settings.py"
        try:
            known = "EAGLE3_DUMP_DTYPE" in settings.read_text() and "EAGLE3_DUMP_REBUILDABLE" in settings.read_text()
        except OSError:
            known = False
        if not known:
            raise UsageError(f"dump_dtype={self.p['dump_dtype']} rebuildable={self.p['rebuildable']}: the patched sglang "
                             f"at {parent} has no EAGLE3_DUMP_DTYPE / EAGLE3_DUMP_REBUILDABLE ({settings})",
                             "use a series with compact storage (issue 30), or drop the settings")

    def target_sha(self) -> str | None:
        """The target's sha256 (of its files; computed once), which the data records and is checked
        against; None while this run has no target (a caller that runs the data phase alone)."""
        t = self.res.get("target") or {}
        if not t.get("sha256") and getattr(self, "target", None) is not None:
            from .storage_check import target_sha256

            self.res["target"] = dict(t, sha256=target_sha256(self.target))
        return (self.res.get("target") or {}).get("sha256")

    def do_data(self):
        d = self.work / self.data_name()
        if (d / "done.json").is_file():
            data = json.loads((d / "done.json").read_text())
            made_by, mine = data.get("target_sha256"), self.target_sha()
            if made_by and mine and made_by != mine:  # before it was recorded: not known
                raise UsageError(f"{d} holds data another target made (target sha256 {made_by[:12]}, this run's "
                                 f"{mine[:12]}): its states are not this target's",
                                 f"remove {d} (the next call remakes it) or pass another --work")
            self.data = data
            self.res["storage"] = self.data.get("storage")
            return
        d.mkdir(parents=True, exist_ok=True)
        rng = random.Random(self.o.seed + 1)
        samples = [self.lg.sample(rng) for _ in range(self.p["train_prompts"] + self.p["heldout_prompts"])]
        parent = self.patched_parent()
        self.check_storage_supported(parent)
        dump = d / "dumps"
        dump.mkdir(exist_ok=True)
        self.finish_warm("warm-data")
        with Server(self, "data", parent, None, dump) as srv:
            prompts = [self.lg.prompt_ids(s) for s in samples]
            conv = self.reused_greedy(prompts)
            if conv is not None:
                self.say("[acceptance] data: the conversations of %s (same prompts), extracted through this "
                         "run's server" % (self.work / "data" / "greedy.json"))
                self.res["greedy_from"] = str(self.work / "data" / "greedy.json")
            else:
                outs = self.generate_all(srv, prompts, self.p["answer_len"])
                conv = []
                for i, (s, o) in enumerate(zip(samples, outs)):
                    cont = [t for t in o["output_ids"]]
                    if self.lg.eot in cont:
                        cont = cont[:cont.index(self.lg.eot)]
                    conv.append({"id": "s%04d" % i, "prompt_ids": self.lg.prompt_ids(s), "continuation": cont,
                                 "messages": [{"role": "user", "content": self.lg.words(s.user)},
                                              {"role": "assistant", "content": self.lg.words(list(s.prefix) + cont)}]})
            ntr = self.p["train_prompts"]
            for name, part in (("train", conv[:ntr]), ("heldout", conv[ntr:])):
                (d / f"{name}.jsonl").write_text("".join(json.dumps({"id": c["id"], "messages": c["messages"]}) + "\n"
                                                         for c in part))
            (d / "greedy.json").write_text(json.dumps(conv))
            # the extractions run side by side (each request has its own rid, so its own dump file)
            from concurrent.futures import ThreadPoolExecutor

            needed = self.datasets_needed()
            total = sum(ntr if name.startswith("train") else len(conv) - ntr for name, _ in needed)

            def extracted() -> str:  # extract.py records each finished sample in OUT/progress.jsonl
                n = 0
                for name, _ in needed:
                    try:
                        with open(d / f"ds-{name}" / "progress.jsonl", "rb") as f:
                            n += sum(1 for _ in f)
                    except OSError:
                        pass
                return "%d/%d samples extracted (%d datasets)" % (n, total, len(needed))

            with progress.ticking(self.say, "data", extracted), ThreadPoolExecutor(4) as pool:
                jobs = [pool.submit(self.extract, srv, d / f"{name.split('@')[0]}.jsonl", d / f"ds-{name}", aux, dump)
                        for name, aux in needed]
                for j in jobs:
                    j.result()
        storage = self.measure_storage(d, dump, needed)
        for f in dump.glob("*.safetensors"):  # the generate requests' own dumps, and the extractions'
            f.unlink()
        self.data = {"dir": str(d), "train": str(d / "ds-train@correct"), "heldout": str(d / "ds-heldout@correct"),
                     "storage": storage, "target_sha256": self.target_sha()}
        self.res["storage"] = storage
        (d / "done.json").write_text(json.dumps(self.data))

    def measure_storage(self, d: Path, dump: Path, needed: list) -> dict:
        """The data's bytes (issue 30), in the result's ``storage``: each dataset's dump files (its
        extraction's requests; ``storage_check.census``) and the dataset directories; the held-out
        conversations' dump files kept (``kept-dumps``) and, for data of another storage than the
        reference's, the row error of every state they yield against the reference data's kept
        dumps of the same conversations (same work dir, same target: ``data/kept-dumps``). Refuses
        dumps that are not stored as the settings ask (a server that ignored them)."""
        from . import storage_check as sc

        datasets = {name: d / f"ds-{name}" for name, _ in needed}
        census, files = sc.census(dump, datasets)
        want_dtype = {"bf16": None, "fp8": "float8_e4m3fn"}[self.p["dump_dtype"]]
        tr = census.get("train@correct") or {}
        if tr.get("files"):
            if want_dtype and tr["storage_dtype"] != [want_dtype]:
                raise RefusedError(f"the data server stored {tr['storage_dtype']}, not {want_dtype} as "
                                   f"dump_dtype={self.p['dump_dtype']} asks", "use a series with compact storage "
                                   "(issue 30); the server log is under %s" % (self.logs))
            omitted = self.p["rebuildable"] == "omit"
            left = [sorted(json.loads(x or "{}")) for x in tr["left_out"]]
            if omitted and left != [["final", "layer.-1"]] or not omitted and any(left):
                raise RefusedError(f"the data server left out {left}, rebuildable={self.p['rebuildable']} asks for "
                                   f"{['final', 'layer.-1'] if omitted else 'nothing'}",
                                   "use a series with compact storage (issue 30)")
        kept = d / sc.KEPT
        n_kept = sc.keep(files.get("heldout@correct", {}), kept)
        out = {"dump_dtype": self.p["dump_dtype"], "rebuildable": self.p["rebuildable"], "dump": census,
               "datasets": {name: sc.dataset_bytes(p) for name, p in datasets.items()}, "kept_dumps": n_kept,
               "greedy_sha256": sc.file_sha256(d / "greedy.json")}
        ref = self.work / "data"
        if d != ref and (ref / sc.KEPT).is_dir():
            try:
                out["row_error_vs_reference"] = dict(sc.row_errors(kept, ref / sc.KEPT, self.target),
                                                     reference=str(ref / sc.KEPT))
            except Exception as exc:  # noqa: BLE001 - a figure of its own: the data are good without it
                out["row_error_vs_reference"] = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
            try:
                ref_storage = json.loads((ref / "done.json").read_text()).get("storage") or {}
            except (OSError, ValueError):
                ref_storage = {}
            rt = (ref_storage.get("dump") or {}).get("train@correct") or {}
            if rt.get("state_bytes") and tr.get("state_bytes") is not None:
                out["vs_reference"] = {"state_bytes_ratio": round(tr["state_bytes"] / rt["state_bytes"], 4),
                                       "state_bytes_vs_bf16_store": round(tr["state_bytes"] / (2 * rt["state_values"]), 4),
                                       "file_bytes_ratio": round(tr["file_bytes"] / rt["file_bytes"], 4),
                                       "reference_storage_dtype": rt.get("storage_dtype"),
                                       "same_conversations": ref_storage.get("greedy_sha256") == out["greedy_sha256"]}
        dt, dv = tr.get("storage_dtype"), out.get("vs_reference", {})
        self.say("[acceptance] data: %s, train set dump %d files, %d state bytes (%s), %d file bytes%s"
                 % (self.data_name(), tr.get("files", 0), tr.get("state_bytes", 0), dt, tr.get("file_bytes", 0),
                    "; %.3f of the reference's state bytes" % dv["state_bytes_ratio"] if dv else ""))
        return out

    GENERATE_CHUNK = 32

    def generate_all(self, srv, prompts: list, n: int) -> list:
        """``srv.generate`` of every prompt, in requests of ``GENERATE_CHUNK`` prompts, four in flight
        (the server batches them as it batched one request of all), with a progress line (prompts
        done of all) at least every ``progress.PROGRESS_S`` seconds: one request of all of them
        left a CPU run silent for minutes."""
        from concurrent.futures import ThreadPoolExecutor

        chunks = [prompts[i:i + self.GENERATE_CHUNK] for i in range(0, len(prompts), self.GENERATE_CHUNK)]
        done = []

        def one(chunk):
            out = srv.generate(chunk, n)
            if len(out) != len(chunk):
                raise RefusedError("the data server answered %d of %d prompts" % (len(out), len(chunk)),
                                   "read its log under %s" % (self.logs))
            done.append(len(chunk))
            return out

        with progress.ticking(self.say, "data", lambda: "greedy continuations %d/%d prompts"
                              % (sum(done), len(prompts))), ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(one, chunks))
        return [o for out in outs for o in out]

    def readings(self) -> dict:
        """Control -> (draft ids, HF indices the server feeds the draft, unpatched?)."""
        from .. import guard

        if self.dflash:
            return self.dflash_readings()
        patched = guard.release_semantics(self.o.release)
        upstream = guard.release_semantics(self.o.release, unpatched=True)
        ids = self.readings_ids(self.cfg)
        hf = sorted(patched.capture(ids))
        shifted = [h + 1 for h in hf]
        off = patched.ids_for(shifted) or [h - 1 for h in shifted]
        up = upstream.ids_for(hf)
        return {"correct": (ids, hf, False), "off_by_one": (off, sorted(patched.capture(off)), False),
                "floor": (ids, hf, False),
                "upstream_ids": (up, sorted(upstream.capture(up)) if up else None, True)}

    def dflash_readings(self) -> dict:
        """The DFlash controls, each the same weights under other ids, read as the release reads a
        DFlash draft's ids on the target's model file (the series' ``draft_readings``): ``shifted`` ids + 1;
        ``layer_input`` the ids whose reading feeds the inputs of the correct layers (what a
        dataset read as layer inputs would hold: ids - 1); ``upstream_ids`` the correct ids on
        unpatched SGLang."""
        from .. import conventions

        cell = conventions.config_cell(self.cfg)  # the target's model file (DeepseekV3: deepseek_v2.py)

        def hf(ids, patched=True):
            return sorted(conventions.draft_hf_indices(self.o.release, "dflash", cell, ids, patched))

        ids = list(DFLASH_IDS)
        shifted, below = [k + 1 for k in ids], [k - 1 for k in ids]
        return {"correct": (ids, hf(ids), False), "shifted": (shifted, hf(shifted), False),
                "layer_input": (below, hf(below), False), "upstream_ids": (ids, hf(ids, False), True)}

    @staticmethod
    def readings_ids(cfg: dict) -> list:
        """The correct draft's layer ids (patched convention) for a target config."""
        return [-1, 1, 2] if cfg["num_hidden_layers"] >= 4 else [-1, 0, 1]

    def servable(self, control: str) -> bool:
        """Whether the tree of that control can capture what its reading serves (unpatched 0.5.9
        cannot capture index 0, the embedding output: guard fails such a draft)."""
        from .. import guard

        ids, hf, unpatched = self.readings()[control]
        if hf is None:
            return False
        if self.dflash:  # the DFlash reading never reaches the last layer's output; -1 is the embedding
            return max(hf) < self.cfg["num_hidden_layers"]
        sem = guard.release_semantics(self.o.release, unpatched=unpatched)
        return (0 not in hf or sem.embed_ok is not False) and (self.cfg["num_hidden_layers"] not in hf or sem.last_ok)

    def datasets_needed(self):
        r = self.readings()
        out = [("train@correct", r["correct"][1]), ("heldout@correct", r["correct"][1])]
        if self.o.scale == "cpu" and self.p["controls"] == "all" and not self.dflash:  # the replay needs what each reading serves
            for c, (_, hf, _) in r.items():
                if hf and hf != r["correct"][1] and all(0 <= h <= self.cfg["num_hidden_layers"] for h in hf):
                    out.append(("heldout@" + c, hf))
        return out

    def extract(self, srv, data: Path, out: Path, hf: list, dump: Path):
        aux = ",".join(str(h - 1) for h in hf)
        # --keep-dumps: the data phase measures the dump files and keeps the held-out ones, then
        # removes them all (measure_storage)
        cmd = [sys.executable, str(TOOLS / "extract.py"), "--server", srv.url, "--model", str(self.target),
               "--data", str(data), "--dump-dir", str(dump), "--out", str(out),
               "--format", "dflash" if self.dflash else "specforge",
               f"--aux-layers={aux}", "--no-progress", "--keep-dumps", "--concurrency", "4" if self.o.scale == "cpu" else "16"]
        t = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.tool_env())
        self.res.setdefault("extract", {})[out.name] = {"rc": r.returncode, "wall_s": round(time.monotonic() - t, 1),
                                                        "aux_hf": hf, "cmd": " ".join(cmd[1:])}
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise RefusedError("tools/extract.py failed on %s (exit %d: %s)" % (data.name, r.returncode, last),
                               "run that command (in the result's extract.%s.cmd) by hand to see why; the server "
                               "log is under %s" % (out.name, self.logs))

    def patched_parent(self) -> Path:
        if self.o.sglang_parent:
            return Path(self.o.sglang_parent)
        if self.o.scale == "cpu":
            from ..serve.demo import cached_tree

            return cached_tree(say=self.say)
        raise UsageError("the GPU run needs the patched sglang", "pass --sglang-parent DIR or --patched-files DIR with --site")

    # ---- 3. drafts ---------------------------------------------------------------------------
    def draft_plan(self) -> list:
        """(name, seed, zero_aux) of each draft the run trains, in order: the correct draft and the
        floor (controls=all), or one correct draft per draft seed (controls=correct: ``correct``,
        then ``correct@seed<s>``). Seeds start at ``draft_seed`` (null: ``--seed``)."""
        s0 = self.o.seed if self.p["draft_seed"] is None else self.p["draft_seed"]
        if self.p["controls"] == "all":
            return [("correct", s0, False), ("floor", s0, True)]
        return [("correct" if i == 0 else "correct@seed%d" % (s0 + i), s0 + i, False) for i in range(self.p["draft_seeds"])]

    def served_order(self) -> list:
        """The drafts the run serves (replays on CPU), in order; the i-th one's server listens on
        ``--port`` + 1 + i."""
        if self.dflash:
            return list(verdicts.DFLASH_CONTROLS)
        if self.p["controls"] == "all":
            return list(CONTROLS)
        return [name for name, _, _ in self.draft_plan()]

    def sample_lists(self) -> tuple:
        """The training and held-out datasets' sample files; refused when either holds none."""
        from . import train

        files = train.sample_files(Path(self.data["train"]))
        held = train.sample_files(Path(self.data["heldout"]))
        if not files or not held:
            raise RefusedError("the extracted datasets hold no samples (%d train, %d held out)" % (len(files), len(held)),
                               "check tools/extract.py's manifest under %s (failed conversations) and rerun with a "
                               "fresh --work" % self.data["dir"])
        return files, held

    def do_drafts(self):
        from . import train

        if self.dflash:
            return self.do_dflash_drafts()
        r = self.readings()
        files, held = self.sample_lists()
        self.res["guard"] = {}
        self.draft_dirs = {}
        if not self.train_drafts(files, held)["measured"]:
            return
        # each control exported and checked by guard. Its server starts only in serve: on the H200 a
        # floor trained while three servers started ran 231 steps in 135 s against the correct
        # draft's 768 in 34 s alone (docs/acceptance.md)
        for c in self.served_order():
            ids, hf, _ = r[c.split("@")[0]]
            if ids is None:
                continue
            run = self.runs.get(c, self.runs["correct"])
            run.cfg = train.draft_config(self.cfg, ids, self.p["dtype"], self.p["draft_fc_norm"])
            dest = self.work / ("drafts" + self.suffix) / c
            self.draft_dirs[c] = str(run.export(dest, self.p["dtype"], zero_fc=c == "floor"))
            self.res["drafts"].setdefault(c, {}).update({"dir": self.draft_dirs[c], "ids": ids, "served_hf": hf})
            self.guard_one(c)

    def do_dflash_drafts(self):
        """The DFlash draft: trained with SpecForge's OnlineDFlashModel on the training set, its
        held-out replay (``DFlashRun.block_replay``) is the prediction; exported once per control
        (the same weights, the control's ids) and each checked by guard."""
        from . import dflash

        r = self.readings()
        files, held = self.sample_lists()
        self.res["guard"] = {}
        self.draft_dirs = {}
        s0 = self.o.seed if self.p["draft_seed"] is None else self.p["draft_seed"]
        cfg = dflash.draft_config(self.cfg, r["correct"][0], self.p["dflash_block"], self.p["dflash_layers"],
                                  self.cfg["vocab_size"] - 1, self.p["dtype"])
        run = dflash.DFlashRun(self.target, cfg, self.p["device"], seed=s0, num_anchors=self.p["dflash_anchors"])
        by_steps = bool(self.p["draft_max_steps"])
        budget = self.left() - SERVE_RESERVE_S if by_steps else min(self.p["draft_budget_s"], self.left() - SERVE_RESERVE_S)
        budget = None if budget == float("inf") else max(budget, 5)
        hist = run.train(files, self.p["draft_batch"], self.p["draft_lr"], self.p["draft_max_steps"] or None,
                         budget, s0, self.say)
        self.res["drafts"] = {"correct": {"seed": s0, "family": "dflash", "config": cfg, "training": hist}}
        v = self.res["verdicts"]["drafts"] = verdicts.dflash_drafts_verdict(hist, by_steps)
        if not v["measured"]:
            self.say("[acceptance] " + v["verdict"])
            return
        greedy = json.loads((Path(self.data["dir"]) / "greedy.json").read_text())[self.p["train_prompts"]:]
        plen = {tuple(g["prompt_ids"] + g["continuation"] + [self.lg.eot]): len(g["prompt_ids"]) for g in greedy}
        metas = run.block_replay(held, plen)
        pred = dict(lang_mod.served_accept_length(metas), how="replayed: SpecForge's DFlash block forward over the "
                    "held-out data, a verify per anchor as the DFLASH worker walks it")
        self.res["drafts"]["correct"]["heldout"] = dict(pred, predicted_accept_length=pred["accept_length"])
        self.say("[acceptance] dflash draft: replayed accept length on the held-out data %.3f (%d verifies)"
                 % (pred["accept_length"] or 0, pred["verify_ct"]))
        self.runs = {"correct": run}
        for c in self.served_order():
            ids, hf, _ = r[c]
            dest = self.work / ("drafts" + self.suffix) / c
            self.draft_dirs[c] = str(run.export(dest, dflash.with_ids(cfg, ids), self.p["dtype"]))
            self.res["drafts"].setdefault(c, {}).update({"dir": self.draft_dirs[c], "ids": ids, "served_hf": hf})
            self.guard_one(c)

    def train_drafts(self, files: list, held: list) -> dict:
        """The correct draft, then the floor on exactly as many steps (controls=all), or one correct
        draft per draft seed (controls=correct); each evaluated on ``held`` once all trained as
        configured. By steps (``draft_max_steps``): nothing but the run's ``--budget-s`` limits
        them (a busy machine takes longer, it does not train less). By seconds (``draft_max_steps``
        0): the correct draft gets ``draft_budget_s``. Either way a draft the run's budget cut
        short makes the run ``not measured`` (the verdict says how far it got; nothing later runs:
        a cut draft's accept length is the cut's, not the layers'). Returns ``verdicts["drafts"]``."""
        from . import train

        self.runs = {}
        self.res["drafts"] = {}
        r = self.readings()
        cfg = train.draft_config(self.cfg, r["correct"][0], self.p["dtype"], self.p["draft_fc_norm"])
        want = self.p["draft_max_steps"] or None
        plan = self.draft_plan()
        hists = {}
        v = None
        for k, (name, seed, zero) in enumerate(plan):
            if name == "floor":  # exactly the correct draft's steps: same data order, same updates
                budget, max_steps = self.left() - SERVE_RESERVE_S, hists["correct"]["steps"]
            elif want:
                budget, max_steps = (self.left() - SERVE_RESERVE_S) / (len(plan) - k), want
            else:
                budget, max_steps = min(self.p["draft_budget_s"], self.left() / (len(plan) - k + 1)), None
            budget = None if budget == float("inf") else max(budget, 5)
            run = train.DraftRun(self.target, cfg, NUM_STEPS, self.p["device"], zero_aux=zero, seed=seed)
            hists[name] = run.train(files, self.p["draft_epochs"], self.p["draft_batch"], self.p["draft_lr"], budget,
                                    seed, self.say, max_steps=max_steps)
            self.res["drafts"][name] = {"seed": seed, "training": hists[name]}
            self.runs[name] = run
            if self.p["controls"] == "all":
                v = verdicts.drafts_verdict(hists["correct"], hists.get("floor"), want,
                                            None if want else self.p["draft_budget_s"])
            else:
                v = verdicts.seed_drafts_verdict(hists, want, None if want else self.p["draft_budget_s"])
            if not v["measured"]:
                break
        self.res["verdicts"]["drafts"] = v
        if not v["measured"]:
            self.say("[acceptance] " + v["verdict"])
            return v
        for name, run in self.runs.items():
            ev = run.evaluate(held)
            self.res["drafts"][name]["heldout"] = ev
            self.say("[acceptance] draft %s: held-out step accuracies %s, predicted accept length %.3f"
                     % (name, ev["step_accuracies"], ev["predicted_accept_length"]))
        return v

    def start_server(self, c: str):
        r = self.readings()
        base = c.split("@")[0]
        parent = Path(self.o.unpatched_parent) if r[base][2] else self.patched_parent()
        s = Server(self, c, parent, Path(self.draft_dirs[c]), None, port=self.o.port + 1 + self.served_order().index(c))
        self.servers[c] = s
        s.start()
        self.say("[acceptance] server %s starting (%s sglang, draft ids %s)"
                 % (c, "unpatched" if r[base][2] else "patched", r[base][0]))

    # ---- 4. guard ----------------------------------------------------------------------------
    def guard_one(self, c: str):
        """tools/guard.py on control ``c``'s draft config and the training dataset, as a user runs it
        before serving: exit 1 expected exactly where the control's reading differs from the
        training layers or its tree cannot capture them. ``correct@seed<s>`` reads as ``correct``."""
        r = self.readings()
        base = c.split("@")[0]
        cmd = [sys.executable, str(TOOLS / "guard.py"), "--draft-config", self.draft_dirs[c], "--dataset",
               self.data["train"], "--release", self.o.release, "--json"] + (["--unpatched"] if r[base][2] else [])
        t = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.tool_env())
        want_fail = r[base][1] != r["correct"][1] or not self.servable(base)
        self.res["guard"][c] = {"rc": p.returncode, "expected_rc": 1 if want_fail else 0, "cmd": " ".join(cmd[1:]),
                                "wall_s": round(time.monotonic() - t, 1), "stdout": p.stdout[-3000:],
                                "stderr": p.stderr[-500:]}

    def do_guard(self):
        out = self.res["guard"]
        bad = [c for c, v in out.items() if v["rc"] != v["expected_rc"]]
        self.res["verdicts"]["guard"] = {"passed": not bad and set(out) == set(self.draft_dirs), "wrong": bad,
                                         "failed": sorted(c for c, v in out.items() if v["rc"] == 1)}

    # ---- 5. serve (GPU) / replay (CPU) ---------------------------------------------------------
    def _unservable(self, name: str) -> dict:
        """The controls whose tree cannot capture their reading's layers: reported, not served."""
        r = self.readings()
        return {c: {"not_servable": f"sglang {self.o.release}{' unpatched' if r[c][2] else ''} cannot capture "
                                    f"HF indices {r[c][1]}", name: r[c][1]}
                for c in self.draft_dirs if c in r and not self.servable(c)}

    def seed_heldouts(self) -> dict:
        """controls=correct: each correct draft's held-out evaluation, in order."""
        return {c: self.res["drafts"][c]["heldout"] for c in self.served_order() if c in self.draft_dirs}

    def do_replay(self):
        """CPU: no server loads a draft (sglang 0.5.9 runs no EAGLE-3 decoding on CPU). Each
        control's chain acceptance is replayed with SpecForge's TTT forward over the held-out data
        extracted with the layers its reading serves; reported as ``replayed`` and judged on the
        ordering only (``verdicts.replayed_verdict``)."""
        from . import train

        r = self.readings()
        greedy = json.loads((Path(self.data["dir"]) / "greedy.json").read_text())[self.p["train_prompts"]:]
        figures = self._unservable("fed_hf")
        plen = {tuple(g["prompt_ids"] + g["continuation"] + [self.lg.eot]): len(g["prompt_ids"]) for g in greedy}
        for c in self.served_order():
            if c not in self.draft_dirs or c in figures:
                continue
            ids, hf, _ = r[c.split("@")[0]]
            name = "heldout@" + c if hf != r["correct"][1] else "heldout@correct"
            files = train.sample_files(Path(self.data["dir"]) / f"ds-{name}")
            run = self.runs.get(c, self.runs["correct"])
            metas = run.chain_replay(files, plen, NUM_STEPS)
            figures[c] = dict(lang_mod.served_accept_length(metas), how=verdicts.REPLAY_NOTE, fed_hf=hf)
        self.res["replayed"] = figures
        if self.p["controls"] == "all":
            v = verdicts.replayed_verdict(figures, self.res["drafts"]["correct"]["heldout"], self.p["answer_len"])
        else:
            v = verdicts.seeds_verdict(figures, self.seed_heldouts(), self.p["answer_len"], "replayed")
        self.res["verdicts"]["replay"] = v
        self.say("[acceptance] " + v["verdict"])

    def do_serve(self):
        """GPU: each draft on its own server, 4 started side by side; accept length from the
        responses' meta_info, outputs compared with the no-speculation greedy ones; judged by
        ``verdicts.served_verdict`` (thresholds, every request lossless, upstream ids = correct)."""
        r = self.readings()
        greedy = json.loads((Path(self.data["dir"]) / "greedy.json").read_text())[self.p["train_prompts"]:]
        served = self._unservable("served_hf")
        prompts = [g["prompt_ids"] for g in greedy]
        want = [g["continuation"] for g in greedy]
        todo = [c for c in self.served_order() if c in self.draft_dirs and c not in served]
        self.finish_warm("warm-spec")
        for c in todo:  # the servers start side by side; requests go to one at a time
            self.start_server(c)
        for c in todo:
            s = self.servers[c]
            try:
                s.wait_ready(timeout=max(min(400.0, self.left() - 30), 5))
                t = time.monotonic()
                outs = s.generate(prompts, self.p["answer_len"], timeout=max(min(self.left() - 10, 1800.0), 5))
                metas = [o["meta_info"] for o in outs]
                got = [list(o["output_ids"]) for o in outs]
                same = sum(g[:len(w)] == w for g, w in zip(got, want))
                first_diff = [next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
                              for g, w in zip(got, want)]
                served[c] = dict(lang_mod.served_accept_length(metas), how="served", served_hf=r[c.split("@")[0]][1],
                                 lossless_requests=same, first_difference_at=[d for d in first_diff if d is not None],
                                 start_s=s.start_s, generate_s=round(time.monotonic() - t, 1))
            except Exception as exc:  # noqa: BLE001 - reported per control
                served[c] = {"error": "%s: %s" % (type(exc).__name__, str(exc)[:300]), "log_tail": s.tail()}
            finally:
                s.stop()
        self.res["served"] = served
        if self.dflash:
            v = verdicts.dflash_served_verdict(served, self.res["drafts"]["correct"]["heldout"]["accept_length"])
        elif self.p["controls"] == "all":
            v = verdicts.served_verdict(served, self.res["drafts"]["correct"]["heldout"], self.p["answer_len"])
        else:
            v = verdicts.seeds_verdict(served, self.seed_heldouts(), self.p["answer_len"], "served")
        self.res["verdicts"]["serve"] = v
        self.say("[acceptance] " + v["verdict"])

    def run(self) -> dict:
        """Every phase in turn (``check_options`` first: nothing is trained or started before it);
        a phase the budget leaves no time for, and every one after it, is not started; after
        drafts the budget cut (``not measured``) nothing else runs. The result is saved after each
        phase and at the end."""
        check_options(self.o)
        self.servers = {}
        last = ("serve", self.do_serve) if self.o.scale == "gpu" else ("replay", self.do_replay)
        try:
            for name, fn in (("target", self.do_target), ("data", self.do_data), ("drafts", self.do_drafts),
                             ("guard", self.do_guard), last):
                d = self.res["verdicts"].get("drafts")
                if d is not None and not d["measured"]:
                    self.res["phases"][name] = {"skipped": d["verdict"]}
                    continue
                if not self.phase(name, fn):
                    break
        finally:
            for srv in self.servers.values():
                srv.stop()
            self.save()
        return self.res


class Server:
    """One ``sglang.launch_server`` in its own process group (log under the work dir)."""

    def __init__(self, run: Run, name: str, parent: Path, draft: Path | None, dump: Path | None, port: int | None = None,
                 model: Path | None = None):
        self.run, self.name = run, name
        self.port = port or run.o.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = run.server_argv(self.port, draft, parent, model)
        self.env = run.server_env(parent, dump)
        self.log = run.logs / f"server-{name}.log"
        self.proc = None

    def start(self):
        """Start the server; refused when its port is taken: a server already listening there would
        answer /health and /generate in its place, and the run would take its data from the wrong
        model (seen when a killed test run left its data server behind)."""
        from ..serve import refuse_taken_port

        refuse_taken_port("127.0.0.1", self.port, f"the {self.name} server",
                          "stop that process or pass another --port (the run uses --port to --port + 4, and "
                          "--port + 20 and + 21 for the warm-up servers)")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.t = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float = 400):
        """Until /health answers 200 (after the server's warm-up), at most ``timeout`` seconds from now."""
        end = time.monotonic() + timeout
        tick = progress.Ticker()
        while time.monotonic() < end:
            if tick.due():
                self.run.say(f"[acceptance] server {self.name}: starting, waiting for /health "
                             f"({tick.elapsed():.0f} s of at most {timeout:.0f} s)")
            if self.proc.poll() is not None:
                last = " | ".join(self.tail()[-2:])[-300:] or "no output"
                raise RefusedError(f"server {self.name} exited with {self.proc.returncode} before answering ({last})",
                                   f"read its log {self.log}")
            try:
                # /health answers 503 until the server's warm-up request is done (tools/extract.py
                # refuses a server in that state); /get_model_info answers before it
                with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
                    if r.status == 200:
                        self.start_s = round(time.monotonic() - self.t, 1)
                        self.run.say(f"[acceptance] server {self.name} ready ({self.start_s:.0f} s)")
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RefusedError(f"server {self.name} did not answer in {timeout:.0f} s",
                           f"read its log {self.log}; a busy machine may need a larger --budget-s")

    def generate(self, prompts: list, n: int, timeout: float = 600) -> list:
        body = json.dumps({"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": n,
                                                                     "ignore_eos": True}}).encode()
        req = urllib.request.Request(self.url + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
        return out if isinstance(out, list) else [out]

    def tail(self) -> list:
        try:
            return self.log.read_text(errors="replace").splitlines()[-20:]
        except OSError:
            return []

    def stop(self):
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def __enter__(self):
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
