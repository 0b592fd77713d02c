"""The acceptance tool's torch side: the target (built, trained on a synthetic language, measured,
saved) and the EAGLE-3 draft (trained and evaluated with SpecForge 0.2.0's own classes, exported
as SGLang loads it). Needs torch, transformers, safetensors and (drafts) specforge.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from . import language as lang_mod
from . import progress
from ..gpucheck import models as gmodels

# How the trainable target's weights are drawn before training (gpucheck.reference.make_weights):
# decisive routing (router bias +4 for two experts, -4 for the rest, kept fixed) so bf16 rounding
# cannot flip an expert choice; otherwise plain init.
TARGET_SHAPING = {"init_std": 0.02, "norm_jitter": 0.0, "o_proj_scale": 1.0, "down_proj_scale": 1.0,
                  "down_proj_growth": 1.0, "final_norm_scale": 1.0, "router_bias": 4.0}


def _device(name: str):
    return torch.device("cuda" if name == "cuda" else "cpu")


# ---- target --------------------------------------------------------------------------------------

def build_target(cfg: dict, device: str, seed: int, scratch: Path, embed_std: float | None = None):
    """The target's initial weights, drawn under DeepSeek-V3's hub names and loaded with
    ``from_pretrained`` (transformers 5 fuses the routed experts on load; 4.x does not: the hub
    checkpoint is the one format both read)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    from ..gpucheck.reference import make_weights

    torch.manual_seed(seed)
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    w = make_weights(cfg, TARGET_SHAPING, seed)
    if embed_std is not None:  # the embedding drawn at its own scale (the other weights keep init_std)
        w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"].float() * (embed_std / TARGET_SHAPING["init_std"])
    save_file({k: v.float().contiguous() for k, v in w.items()}, str(scratch / "model.safetensors"),
              metadata={"format": "pt"})
    (scratch / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32"), indent=2) + "\n")
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(scratch), dtype=torch.float32, output_loading_info=True)
    bad = {k: v[:3] for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        from ..errors import UsageError

        raise UsageError("this transformers' DeepseekV3 does not load the target's weights (%s)" % bad,
                         "run in the CPU environment or the GPU bundle (their transformers is the one the tool "
                         "is written for)")
    return model.to(_device(device))


def _batch(lg: lang_mod.Language, rng: random.Random, n: int, device):
    seqs, masks = [], []
    for _ in range(n):
        s = lg.sample(rng)
        ids = lg.full_ids(s)
        p = len(lg.prompt_ids(s))
        seqs.append(ids)
        masks.append([0] * p + [1] * (len(ids) - p))
    L = max(map(len, seqs))
    ids = torch.tensor([s + [lg.eot] * (L - len(s)) for s in seqs], device=device)
    m = torch.tensor([x + [0] * (L - len(x)) for x in masks], device=device, dtype=torch.float32)
    return ids, m


# The training state a call leaves when its budget ends before the gates pass (``TargetTraining.save``).
STATE_FORMAT = "eaglepatch-target-training/1"


class TargetTraining:
    """The target's training, resumable across calls: the model, its AdamW (router biases fixed),
    the batches' RNG, the step, the logged history and the gate checks. ``run`` trains; ``save``
    writes all of it to one file (a temporary name, then a rename); ``load`` puts a saved state
    back, so the next call continues at the saved step as if it had never stopped."""

    def __init__(self, model, lg: lang_mod.Language, batch: int, lr: float, seed: int, device: str):
        self.model, self.lg, self.batch, self.lr, self.device = model, lg, batch, lr, device
        self.dev = _device(device)
        self.params = [p for n, p in model.named_parameters() if "e_score_correction_bias" not in n]
        for n, p in model.named_parameters():
            if "e_score_correction_bias" in n:
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
        self.rng = random.Random(seed)
        self.step, self.hist, self.checks, self.calls, self.train_s = 0, [], [], [], 0.0
        self.last = None  # the last step's {"step", "loss", "acc"} (logged or not)

    def _check(self, gates, say) -> tuple:
        """``gates(model)`` -> (figures, failures) on the model as it is now, in eval mode, its
        gradients dropped first (the bf16 copy would copy them); recorded in ``checks``."""
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        t = time.monotonic()
        figures, fails = gates(self.model)
        cost = time.monotonic() - t
        self.model.train()
        self.checks.append({"step": self.step, "passed": not fails, "failed": fails, "wall_s": round(cost, 1)})
        say("[acceptance] target step %d: gates %s (%.0f s)" % (self.step, "; ".join(fails) if fails else "passed",
                                                                cost))
        return figures, fails, cost

    def run(self, steps: int, budget_s: float, say=print, done_acc: float = 0.98, gates=None) -> dict:
        """AdamW on the language's assistant tokens (the prompt is context only), from ``self.step``
        to ``steps`` at most, for ``budget_s`` seconds at most (None or inf: no limit). Every 25 steps the
        batch's teacher-forced token accuracy is logged; when two successive logged batches reach
        ``done_acc`` (the cheap proxy):
          - without ``gates``: the training stops ('accuracy');
          - with ``gates`` (model -> (figures, failures)): the gates are measured; passed, it stops
            ('gates'); failed, it trains on, and measures them again once the proxy holds and at
            least 4 times the last measurement's seconds have passed (at most a fifth of the time
            goes to measuring). At the end ('budget', 'steps') the gates of the final weights are
            measured unless they just were. The result's ``gates``/``gates_failed`` are those.
        A progress line every 25 steps and at least every ``progress.PROGRESS_S`` seconds."""
        t0 = time.monotonic()
        start, stop = self.step, "steps"
        limit = float("inf") if budget_s is None else budget_s
        tick = progress.Ticker()
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if self.dev.type == "cuda" else torch.autocast("cpu", enabled=False)
        figures = fails = None
        checked_at, cost, next_check = None, 0.0, t0
        self.model.train()
        while self.step < steps:
            # the final measurement (as long as the last one) fits in the budget too
            if time.monotonic() - t0 + (cost if gates is not None else 0.0) >= limit:
                stop = "budget"
                break
            ids, m = _batch(self.lg, self.rng, self.batch, self.dev)
            for g in self.opt.param_groups:
                g["lr"] = self.lr * min(1.0, (self.step + 1) / 50)
            with amp:
                logits = self.model(input_ids=ids).logits[:, :-1].float()
            tgt = ids[:, 1:]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
            mm = m[:, 1:].reshape(-1)
            loss = (ce * mm).sum() / mm.sum()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.step += 1
            if self.step % 25 == 0 or self.step == 1:
                acc = float(((logits.argmax(-1) == tgt).float().reshape(-1) * mm).sum() / mm.sum())
                lv = loss.item()
                self.hist.append({"step": self.step, "loss": round(lv, 4), "acc": round(acc, 4)})
                say("[acceptance] target step %d/%d: loss %.3f, token accuracy %.3f (%.0f s)"
                    % (self.step, steps, lv, acc, time.monotonic() - t0))
                tick.mark()
                proxy = len(self.hist) >= 2 and min(h["acc"] for h in self.hist[-2:]) >= done_acc
                if proxy and gates is None:
                    stop = "accuracy"
                    break
                if proxy and time.monotonic() >= next_check:
                    figures, fails, cost = self._check(gates, say)
                    checked_at, next_check = self.step, time.monotonic() + 4 * cost
                    if not fails:
                        stop = "gates"
                        break
            elif tick.due():  # a slow machine: a line at least every progress.PROGRESS_S seconds
                say("[acceptance] target step %d/%d: loss %.3f (%.0f s)"
                    % (self.step, steps, loss.item(), time.monotonic() - t0))
        wall = time.monotonic() - t0
        if self.step > start:  # the last batch's figures, logged or not (what a stopped call reports)
            acc = float(((logits.argmax(-1) == tgt).float().reshape(-1) * mm).sum() / mm.sum())
            self.last = {"step": self.step, "loss": round(loss.item(), 4), "acc": round(acc, 4)}
        if gates is not None and checked_at != self.step:
            figures, fails, _ = self._check(gates, say)
        self.model.eval()
        self.train_s += wall
        self.calls.append({"from_step": start, "to_step": self.step, "stopped_by": stop, "wall_s": round(wall, 1)})
        out = {"steps": self.step, "stopped_by": stop, "wall_s": round(wall, 1), "history": list(self.hist),
               "last": self.last}
        if gates is not None:
            out.update(gates=figures, gates_failed=fails, gate_checks=list(self.checks), calls=list(self.calls),
                       train_s=round(self.train_s, 1))
        return out

    def save(self, path: Path, meta: dict) -> int:
        """Everything ``load`` needs to continue, with ``meta`` (what the run that saved it was), in
        one file at ``path``, whole or not at all (a temporary file beside it, then a rename).
        Returns its size in bytes."""
        path = Path(path)
        cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        opt = self.opt.state_dict()
        opt = {"state": {k: {n: cpu(v) if torch.is_tensor(v) else v for n, v in s.items()}
                         for k, s in opt["state"].items()}, "param_groups": opt["param_groups"]}
        state = {"format": STATE_FORMAT, "meta": meta, "step": self.step, "history": self.hist,
                 "gate_checks": self.checks, "calls": self.calls, "train_s": self.train_s, "last": self.last,
                 "model": {k: cpu(v) for k, v in self.model.state_dict().items()}, "optimizer": opt,
                 "rng_python": self.rng.getstate(), "rng_torch": torch.get_rng_state(),
                 "rng_cuda": torch.cuda.get_rng_state_all() if self.dev.type == "cuda" else []}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(".%s.tmp-%d" % (path.name, os.getpid()))
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path.stat().st_size

    @staticmethod
    def read(path: Path) -> dict:
        """A saved state (tensors on the CPU), or a one-line usage error when it is no such file."""
        from ..errors import UsageError

        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one refusal
            raise UsageError(f"{path} is not a readable target training state ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:120]})",
                             "delete it to train the target from step 0, or pass another --work") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{path} is not a target training state of this tool (format {got!r}, not "
                             f"{STATE_FORMAT!r})", "delete it to train the target from step 0, or pass another --work")
        return state

    def load(self, state: dict) -> None:
        """Put a state ``read`` returned back: weights, AdamW, step, RNGs, history; a state that does
        not fit this model is a one-line usage error."""
        from ..errors import UsageError

        try:
            self.model.load_state_dict(state["model"], strict=True)
            self.opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError("the saved target training state does not fit this target (%s)"
                             % " ".join(str(exc).split())[:160],
                             "delete it to train the target from step 0, or pass another --work") from None
        self.step, self.hist, self.checks = state["step"], list(state["history"]), list(state["gate_checks"])
        self.calls, self.train_s, self.last = list(state["calls"]), float(state["train_s"]), state["last"]
        self.rng.setstate(state["rng_python"])
        torch.set_rng_state(state["rng_torch"])
        if self.dev.type == "cuda" and state["rng_cuda"]:
            torch.cuda.set_rng_state_all(state["rng_cuda"])


def train_target(model, lg: lang_mod.Language, steps: int, batch: int, lr: float, budget_s: float, seed: int,
                 device: str, say=print, done_acc: float = 0.98) -> dict:
    """A target trained from step 0 without gates (``TargetTraining.run``): it stops at ``steps``,
    ``budget_s``, or when two successive logged batches (25 steps apart) reach teacher-forced
    token accuracy ``done_acc``. Router biases stay fixed."""
    return TargetTraining(model, lg, batch, lr, seed, device).run(steps, budget_s, say, done_acc)


@torch.no_grad()
def greedy(model, prompts: list, n: int) -> list:
    """Greedy continuations (no cache: every step runs the whole sequence; toy lengths), prompts of
    one length batched together (no padding, so a row sees exactly what it would alone)."""
    dev = next(model.parameters()).device
    out = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        for k in range(0, len(idx), 32):
            rows = idx[k:k + 32]
            ids = torch.tensor([prompts[i] for i in rows], device=dev)
            for _ in range(n):
                nxt = model(input_ids=ids).logits[:, -1].float().argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
            for r, i in enumerate(rows):
                out[i] = ids[r, len(prompts[i]):].tolist()
    return out


@torch.no_grad()
def measure(model, lg: lang_mod.Language, n_prompts: int, seed: int) -> dict:
    """The gate figures on ``n_prompts`` held-out samples: bf16-vs-fp32 greedy agreement (teacher-
    forced top-1 on the fp32 greedy continuation), bigram predictability (a current-token table fit
    on half the continuations, scored on the other half), loop rate, task accuracy (greedy tokens
    equal to the reference answer) and rule accuracy (greedy tokens that follow the language's rule
    from the greedy token before: one early slip does not count against every later token)."""
    rng = random.Random(seed + 7919)
    samples = [lg.sample(rng) for _ in range(n_prompts)]
    prompts = [lg.prompt_ids(s) for s in samples]
    conts = greedy(model, prompts, lg.answer_len)
    task = sum(a == b for s, c in zip(samples, conts) for a, b in zip(c, s.answer)) / sum(len(s.answer) for s in samples)
    rule_hit = rule_n = 0  # each greedy step against the rule applied to the greedy tokens before it
    for s, c in zip(samples, conts):
        seq = list(s.prefix) + list(c)
        for want, got in zip(lg.rule_next(s, seq[:-1]), seq[1:]):
            if want is not None:
                rule_hit += want == got
                rule_n += 1
    agree = total = 0
    gaps = []
    bf = _bf16_copy(model)
    for p, c in zip(prompts, conts):
        ids = torch.tensor([p + c], device=next(model.parameters()).device)
        f32 = model(input_ids=ids).logits[0, len(p) - 1:-1].float()
        b16 = bf(input_ids=ids).logits[0, len(p) - 1:-1].float()
        agree += int((f32.argmax(-1) == b16.argmax(-1)).sum())
        total += f32.shape[0]
        top = f32.topk(2, -1).values
        gaps += (top[:, 0] - top[:, 1]).tolist()
    del bf
    seqs = [p[-1:] + c for p, c in zip(prompts, conts)]
    half = len(seqs) // 2
    return {"prompts": n_prompts, "task_accuracy": round(task, 4),
            "rule_accuracy": round(rule_hit / rule_n, 4) if rule_n else 0.0,
            "bf16_fp32_agreement": round(agree / total, 4),
            "bigram_predictability": round(lang_mod.bigram_predictability(seqs[:half], seqs[half:]), 4),
            "loop_rate": round(sum(lang_mod.loops(c) for c in conts) / len(conts), 4),
            "min_top1_top2_gap_fp32": round(min(gaps), 4), "median_top1_top2_gap_fp32": round(sorted(gaps)[len(gaps) // 2], 4)}


def _bf16_copy(model):
    import copy

    m = copy.deepcopy(model).to(torch.bfloat16)
    for n, b in m.named_buffers():  # router biases and rotary tables stay float32, as SGLang keeps them
        if b.dtype == torch.bfloat16:
            b.data = b.data.float() if "e_score_correction_bias" in n else b.data
    return m


def _saved_state(model, where: Path) -> dict:
    """What ``save_pretrained`` writes of ``model`` (a temporary directory under ``where``)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(dir=where) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        sd = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            sd.update(load_file(str(f)))
    return sd


def _check_hub_names(sd: dict, cfg: dict) -> None:
    from ..gpucheck.reference import _tensor_shapes

    want = _tensor_shapes(cfg)
    wrong = sorted(set(want) ^ set(sd)) + [k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k])]
    if wrong:
        from ..errors import UsageError

        raise UsageError("the target's saved tensors differ from DeepSeek-V3's hub names or shapes (%s)"
                         % wrong[:3], "run in the CPU environment or the GPU bundle")


def check_target_saves(model, cfg: dict, where: Path) -> None:
    """Before any training: ``model`` (the untrained target) saves under the names and shapes SGLang
    loads, so a transformers that writes other names is refused first, not after the training
    (``save_target`` checks the same on the trained one)."""
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    _check_hub_names(_saved_state(model, where), cfg)


def save_target(model, cfg: dict, dest: Path, dtype: str) -> Path:
    """safetensors under DeepSeek-V3's hub names (``save_pretrained`` writes them back from
    transformers 5's fused experts), checked against the names and shapes SGLang loads, in
    ``dtype`` (router biases float32, as SGLang keeps them), with model.safetensors.index.json
    (SpecForge's TargetHead and load_embedding read it), config.json and the chat tokenizer."""
    from safetensors.torch import save_file
    from ..serve import tinychat

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    sd = _saved_state(model, dest.parent)
    _check_hub_names(sd, cfg)
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    sd = {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(dt)).contiguous() for k, v in sd.items()}
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(sd)}}, indent=1))
    (dest / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=dtype), indent=2) + "\n")
    tinychat.build_tokenizer(dest, vocab_size=cfg["vocab_size"])
    return dest


def load_target(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(_device(device)).eval()


# ---- draft (SpecForge 0.2.0) -----------------------------------------------------------------------

def draft_config(target_cfg: dict, ids: list, dtype: str, fc_norm: bool = False) -> dict:
    """The draft's config.json. ``fc_norm``: each aux state RMS-normed before ``fc`` (SpecForge's
    and sglang 0.5.17's ``fc_norm``: ``fc_norm.{0,1,2}.weight``; 0.5.9 has no such option). A
    trained target's embedding output can be hundreds of times smaller than its deeper states,
    and without the norms ``fc`` has to learn that ratio first."""
    cfg = dict(gmodels.draft_config(target_cfg, ids), torch_dtype=dtype)
    if fc_norm:
        cfg["fc_norm"] = True
    return cfg


class _TorchLogSoftmaxLoss:
    """SpecForge's LogSoftmaxLoss (core/loss.py: a Triton kernel) in plain torch, for a CPU run:
    the mean over every position of -sum(target * log_softmax(logits)), masked positions 0."""

    @staticmethod
    def apply(logits, target, position_mask):
        B, T, V = logits.shape
        lp = torch.log_softmax(logits.float(), -1)
        per = -(target.float() * lp).sum(-1) * position_mask.reshape(B, T).float()
        return per.sum() / (B * T)


def _specforge(device: str = "cuda"):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SpecForge's torch.compile'd teacher: no per-shape compiles
    if device != "cuda":
        import specforge.algorithms.eagle3.model as m

        m.LogSoftmaxLoss = _TorchLogSoftmaxLoss
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    return OnlineEagle3Model, LlamaForCausalLMEagle3, TargetHead, TrainBatch, Eagle3TrainStrategy


def sample_files(dataset: Path) -> list:
    return sorted(str(p) for p in Path(dataset).rglob("*.ckpt"))


def read_sample(path: str, max_len: int = 2048) -> dict:
    """One sample of a ``--format specforge`` dataset as SpecForge 0.2.0's OfflineEagle3Dataset
    hands it to training (``process_data``: batch dimension 1, the last position's loss masked).
    SpecForge's module imports HF ``datasets``, which the GPU machine lacks, so the tool reads the
    files itself; tests/test_acceptance.py checks this equals SpecForge's own reader."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    loss_mask = data["loss_mask"][:max_len][None, :].clone()
    loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask,
            "target": data["hidden_state"].squeeze(0)[:max_len][None, :],
            "hidden_state": data["aux_hidden_state"].squeeze(0)[:max_len][None, :],
            "input_ids": data["input_ids"][:max_len][None, :]}


def optimizer_step(opt, strategy, model, batch, lr: float, step: int, clip: float):
    """One optimizer step of a SpecForge step strategy on ``batch`` (the learning rate warmed up
    linearly over the first 50 steps, gradients clipped to norm ``clip``); its StepOutput."""
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, (step + 1) / 50)
    out = strategy.forward_loss(batch)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return out


class DraftRun:
    """One draft: SpecForge's LlamaForCausalLMEagle3 (embedding from the target, frozen), wrapped in
    OnlineEagle3Model (TTT of ``steps`` steps) and Eagle3TrainStrategy with the target's TargetHead
    (offline: the dataset's final state through the target's lm_head)."""

    def __init__(self, target: Path, cfg: dict, steps: int, device: str, zero_aux: bool = False, seed: int = 0):
        Online, Draft, Head, self.TrainBatch, Strategy = _specforge(device)
        from transformers import LlamaConfig

        # the draft's initial weights come from ``seed``: the correct draft and the floor start
        # from the same weights (two unseeded floors on one CPU data set predicted 2.79 and 3.32)
        torch.manual_seed(seed)
        self.dev = _device(device)
        self.zero_aux = zero_aux
        self.cfg = cfg
        self.draft = Draft(LlamaConfig(**cfg), attention_backend="sdpa")
        self.draft.load_embedding(str(target), embedding_key="model.embed_tokens.weight")
        self.draft.freeze_embedding()
        self.draft = self.draft.float().to(self.dev)
        head = Head(str(target))
        head.load_weights(str(target))
        head.freeze_weights()
        self.head = head.float().to(self.dev).eval()
        self.model = Online(self.draft, length=steps, attention_backend="sdpa").to(self.dev)
        self.strategy = Strategy(self.model, target_head=self.head)
        self.steps = steps
        self._mem = {}

    def _sample(self, path: str) -> dict:
        """read_sample, kept on the training device after the first read: every epoch after the
        first costs no file reads and no host-to-device copies (on the H200 reading and copying
        64 files a step held training at 9 steps a second)."""
        d = self._mem.get(path)
        if d is None:
            d = self._mem[path] = {k: v.to(self.dev) for k, v in read_sample(path).items()}
        return d

    def _batches(self, files: list, batch: int, rng: random.Random | None):
        order = list(range(len(files)))
        if rng is not None:
            rng.shuffle(order)
        for i in range(0, len(order), batch):
            items = [self._sample(files[j]) for j in order[i:i + batch]]
            yield self._collate(items)

    def _collate(self, items: list):
        L = max(d["input_ids"].shape[1] for d in items)

        def pad(t, value=0):
            p = L - t.shape[1]
            if p == 0:
                return t
            shape = list(t.shape)
            shape[1] = p
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], 1)

        t = {k: torch.cat([pad(d[k]) for d in items], 0) for k in ("input_ids", "loss_mask", "attention_mask")}
        t["hidden_state"] = torch.cat([pad(d["hidden_state"].float()) for d in items], 0)
        t["target"] = torch.cat([pad(d["target"].float()) for d in items], 0)
        if self.zero_aux:
            t["hidden_state"] = torch.zeros_like(t["hidden_state"])
        return self.TrainBatch(sample_ids=[str(i) for i in range(len(items))], strategy="eagle3", tensors=t,
                               metadata={"target_repr": "hidden_state"})

    def train(self, files: list, epochs: int, batch: int, lr: float, budget_s: float | None, seed: int, say=print,
              max_steps: int | None = None) -> dict:
        """AdamW over ``epochs`` passes, the learning rate warmed up linearly over the first 50 steps;
        stops early at ``max_steps`` steps or ``budget_s`` seconds (None: no time limit). The floor
        trains exactly as many steps as the correct draft got, so a budget cut on a busy machine
        cannot hand one control more training than the other; ``stopped_by`` says which limit
        ended it ('max_steps', 'epochs' or 'budget': the pipeline reports a draft the budget cut
        as not measured). A progress line (step/total, seconds) every 25 steps and at least every
        ``progress.PROGRESS_S`` seconds."""
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        rng = random.Random(seed)
        t0, step, hist = time.monotonic(), 0, []
        total = epochs * -(-len(files) // batch)
        total = min(total, max_steps) if max_steps else total
        tick = progress.Ticker()
        what = "draft%s" % (" (aux zeroed)" if self.zero_aux else "")
        self.model.train()
        stop = None
        for ep in range(epochs):
            for b in self._batches(files, batch, rng):
                out = optimizer_step(opt, self.strategy, self.model, b, lr, step, clip=0.5)
                step += 1
                if step % 25 == 0 or step == 1:
                    acc = [round(float(a), 3) for a in out.metrics["acces"]]
                    hist.append({"step": step, "epoch": ep, "loss": round(float(out.loss), 4), "acc": acc})
                    say("[acceptance] %s step %d/%d (epoch %d): loss %.3f, step accuracies %s (%.0f s)"
                        % (what, step, total, ep, float(out.loss), acc, time.monotonic() - t0))
                    tick.mark()
                elif tick.due():  # a slow machine: a line at least every progress.PROGRESS_S seconds
                    say("[acceptance] %s step %d/%d (epoch %d): loss %.3f (%.0f s)"
                        % (what, step, total, ep, float(out.loss), time.monotonic() - t0))
                if max_steps is not None and step >= max_steps:
                    stop = "max_steps"
                elif budget_s is not None and time.monotonic() - t0 > budget_s:
                    stop = "budget"
                if stop:
                    break
            if stop:
                break
        self.model.eval()
        return {"steps": step, "epochs_started": ep + 1, "stopped_by": stop or "epochs", "max_steps": max_steps,
                "budget_s": None if budget_s is None else round(budget_s, 1),
                "wall_s": round(time.monotonic() - t0, 1), "history": hist}

    @torch.no_grad()
    def evaluate(self, files: list, batch: int = 8) -> dict:
        """Held-out step accuracies a1..ak (SpecForge's own counts) and 1 + a1 + a1*a2 + ..."""
        corr = [0.0] * self.steps
        den = [0.0] * self.steps
        for b in self._batches(files, batch, None):
            m = self.strategy.forward_loss(b).metrics
            for i in range(self.steps):
                corr[i] += float(m["acc_corrects"][i])
                den[i] += float(m["acc_denoms"][i])
        acc = [c / d if d else 0.0 for c, d in zip(corr, den)]
        return {"step_accuracies": [round(a, 4) for a in acc], "tokens": int(den[0]),
                "predicted_accept_length": round(lang_mod.chain_accept_length(acc), 4)}

    @torch.no_grad()
    def chain_replay(self, files: list, prompt_lens: dict | None, num_steps: int, spans=None) -> list:
        """What a chain speculative decoder (topk 1, ``num_steps`` draft steps) accepts on each sample
        of a dataset whose aux states are the ones a server would feed the draft: SpecForge's TTT
        forward gives, per position, each step's prediction with the true (greedy) tokens as inputs
        (a prediction counts as SpecForge counts it: the draft's argmax mapped through its ``d2t``
        to a target token, equal to the target's argmax); a verify starting after the committed
        token p accepts the leading correct steps at p - 1.

        ``files``: sample files, or samples as ``read_sample`` returns them. The generated tokens of
        a sample: with ``prompt_lens`` (input_ids tuple -> prompt length P), ids[P:-1] (the trailing
        <|eot|> of the template is no generated token); with ``spans`` (a function of the input ids
        and the loss mask, both lists, giving (P, T) pairs), ids[P:T] for each pair, each its own
        request. Per request a meta_info-like dict (completion_tokens C, spec_verify_ct V) with the
        draft tokens each verify accepted (``accepted``) and could have (``room``: fewer than
        ``num_steps`` where the request ends)."""
        metas = []
        rec = {}
        orig = self.model._acc_and_loss
        d2t = getattr(self.draft, "d2t", None)

        def spy(**kw):
            pred = kw["logits"].argmax(-1)
            rec.setdefault("pred", []).append(pred + d2t[pred] if d2t is not None else pred)
            rec.setdefault("tgt", []).append(kw["target_token_ids"])
            return orig(**kw)

        self.model._acc_and_loss = spy
        try:
            for f in files:
                d = f if isinstance(f, dict) else read_sample(f)
                rec.clear()
                self.strategy.forward_loss(self._collate([{k: v.to(self.dev) for k, v in d.items()}]))
                ids = d["input_ids"][0].tolist()
                if spans is not None:
                    pairs = spans(ids, d["loss_mask"][0].tolist())
                else:
                    P = prompt_lens.get(tuple(ids))
                    pairs = [] if P is None else [(P, len(ids) - 1)]
                correct = [(rec["pred"][i][0] == rec["tgt"][i][0]).tolist() for i in range(num_steps)]
                for P, T in pairs:
                    p, V = P, 0  # p: index of the last committed token (the prefill's token first)
                    acc, room = [], []
                    while p < T - 1:
                        V += 1
                        a, m = 0, min(num_steps, T - 1 - p)
                        while a < m and correct[a][p - 1]:
                            a += 1
                        acc.append(a)
                        room.append(m)
                        p += a + 1
                    metas.append({"completion_tokens": T - P, "spec_verify_ct": V, "accepted": acc, "room": room})
        finally:
            self.model._acc_and_loss = orig
        return metas

    def load_weights(self, src: Path) -> dict:
        """The weights of a trained draft directory (``*.safetensors`` as ``export`` and SpecForge
        write them: the draft's own names, without the frozen embedding, which comes from the
        target; ``t2d``/``d2t`` when the draft has its own vocabulary) into this draft. A one-line
        usage error for a name the draft lacks, a shape that differs, or a weight it needs that
        the directory lacks. Returns {"tensors": n, "kept_from_target": [...]}."""
        from safetensors.torch import load_file

        from ..errors import UsageError

        files = sorted(Path(src).glob("*.safetensors"))
        if not files:
            raise UsageError(f"the draft directory {src} holds no *.safetensors weights",
                             "pass a directory as SpecForge or this project's export writes it (config.json and "
                             "model.safetensors)")
        sd = {}
        for f in files:
            sd.update(load_file(str(f)))
        own = self.draft.state_dict()
        unknown = sorted(k for k in sd if k not in own)
        shapes = sorted(k for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape))
        kept = [k for k in own if k not in sd and ("embed" in k.lower() or k in ("t2d", "d2t"))]
        missing = sorted(k for k in own if k not in sd and k not in kept)
        if unknown or shapes or missing:
            what = "; ".join(x for x in (f"names it does not have {unknown[:3]}" if unknown else "",
                                         f"other shapes for {shapes[:3]}" if shapes else "",
                                         f"no {missing[:3]}" if missing else "") if x)
            raise UsageError(f"the draft weights in {src} do not fit a LlamaForCausalLMEagle3 of its config.json "
                             f"({what})", "pass the config.json the draft was trained with, beside its weights")
        with torch.no_grad():
            for k, v in sd.items():
                own[k].copy_(v.to(own[k].dtype))
        self.model.eval()
        return {"tensors": len(sd), "kept_from_target": kept}

    def export(self, dest: Path, dtype: str, zero_fc: bool = False) -> Path:
        """The draft as SGLang loads it: config.json + model.safetensors with the trained weights
        (SpecForge's checkpoint filter: no frozen embedding; no t2d/d2t: full draft vocabulary).
        ``zero_fc``: the floor draft's fc (trained on zeroed aux inputs, it never got a gradient)
        is written as zeros, so a server feeding it real aux states gives it what it was trained on."""
        from safetensors.torch import save_file

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        sd = self.strategy.checkpoint_state_filter(self.model.state_dict())
        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        sd = {k: v.detach().cpu().to(dt).contiguous() for k, v in sd.items() if k not in ("t2d", "d2t")}
        if zero_fc:
            sd["fc.weight"] = torch.zeros_like(sd["fc.weight"])
            with torch.no_grad():
                self.draft.fc.weight.zero_()
            self.zero_aux = False  # replays now feed it real aux states, multiplied by the zero fc
        save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
        (dest / "config.json").write_text(json.dumps(self.cfg, indent=2) + "\n")
        return dest
