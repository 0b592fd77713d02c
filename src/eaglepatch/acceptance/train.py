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
from ..gpucheck import models as gmodels

# How the trainable target's weights are drawn before training (gpucheck.reference.make_weights):
# decisive routing (router bias +4 for two experts, -4 for the rest, kept fixed) so bf16 rounding
# cannot flip an expert choice; otherwise plain init.
TARGET_SHAPING = {"init_std": 0.02, "norm_jitter": 0.0, "o_proj_scale": 1.0, "down_proj_scale": 1.0,
                  "down_proj_growth": 1.0, "final_norm_scale": 1.0, "router_bias": 4.0}


def _device(name: str):
    return torch.device("cuda" if name == "cuda" else "cpu")


# ---- target --------------------------------------------------------------------------------------

def build_target(cfg: dict, device: str, seed: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from ..gpucheck.reference import make_weights

    torch.manual_seed(seed)
    conf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    model = DeepseekV3ForCausalLM(conf)
    w = make_weights(cfg, TARGET_SHAPING, seed)
    missing, unexpected = _load_hub_weights(model, w)
    if missing or unexpected:
        from ..errors import UsageError

        raise UsageError("the target's weights do not fit this transformers' DeepseekV3 (missing %s, unexpected %s)"
                         % (missing[:3], unexpected[:3]), "run in the CPU environment or the GPU bundle (their "
                         "transformers is the one the tool is written for)")
    return model.float().to(_device(device))


def _load_hub_weights(model, w: dict):
    sd = {k: v.float() for k, v in w.items()}
    res = model.load_state_dict(sd, strict=False)
    return [k for k in res.missing_keys if "rotary" not in k], list(res.unexpected_keys)


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


def train_target(model, lg: lang_mod.Language, steps: int, batch: int, lr: float, budget_s: float, seed: int,
                 device: str, say=print) -> dict:
    """AdamW on the language's assistant tokens (the prompt is context only); stops at ``steps`` or
    ``budget_s``. Router biases stay fixed."""
    dev = _device(device)
    params = [p for n, p in model.named_parameters() if "e_score_correction_bias" not in n]
    for n, p in model.named_parameters():
        if "e_score_correction_bias" in n:
            p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    model.train()
    t0, hist, step = time.monotonic(), [], 0
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    while step < steps and time.monotonic() - t0 < budget_s:
        ids, m = _batch(lg, rng, batch, dev)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        with amp:
            logits = model(input_ids=ids).logits[:, :-1].float()
        tgt = ids[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        mm = m[:, 1:].reshape(-1)
        loss = (ce * mm).sum() / mm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == 1:
            acc = float(((logits.argmax(-1) == tgt).float().reshape(-1) * mm).sum() / mm.sum())
            hist.append({"step": step, "loss": round(float(loss), 4), "acc": round(acc, 4)})
            say("[acceptance] target step %d: loss %.3f, token accuracy %.3f (%.0f s)"
                % (step, float(loss), acc, time.monotonic() - t0))
    model.eval()
    return {"steps": step, "wall_s": round(time.monotonic() - t0, 1), "history": hist}


@torch.no_grad()
def greedy(model, prompts: list, n: int) -> list:
    """Greedy continuations (no cache: every step runs the whole sequence; toy lengths)."""
    dev = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        got = []
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].float().argmax())
            got.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], 1)
        out.append(got)
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


def save_target(model, cfg: dict, dest: Path, dtype: str) -> Path:
    """safetensors under DeepSeek-V3's hub names (+ model.safetensors.index.json, which SpecForge's
    TargetHead and load_embedding read), config.json and the chat tokenizer."""
    from safetensors.torch import save_file
    from ..gpucheck.reference import _tensor_shapes
    from ..serve import tinychat

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    want = _tensor_shapes(cfg)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in want}
    miss = sorted(set(want) - set(sd))
    if miss:
        from ..errors import UsageError

        raise UsageError("the trained target lacks the hub tensors %s (this transformers names them differently)"
                         % miss[:3], "run in the CPU environment or the GPU bundle")
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

    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).to(_device(device)).eval()


# ---- draft (SpecForge 0.2.0) -----------------------------------------------------------------------

def draft_config(target_cfg: dict, ids: list, dtype: str) -> dict:
    return dict(gmodels.draft_config(target_cfg, ids), torch_dtype=dtype)


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
    from specforge.data.preprocessing import OfflineEagle3Dataset
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    return OnlineEagle3Model, OfflineEagle3Dataset, LlamaForCausalLMEagle3, TargetHead, TrainBatch, Eagle3TrainStrategy


def sample_files(dataset: Path) -> list:
    return sorted(str(p) for p in Path(dataset).rglob("*.ckpt"))


class DraftRun:
    """One draft: SpecForge's LlamaForCausalLMEagle3 (embedding from the target, frozen), wrapped in
    OnlineEagle3Model (TTT of ``steps`` steps) and Eagle3TrainStrategy with the target's TargetHead
    (offline: the dataset's final state through the target's lm_head)."""

    def __init__(self, target: Path, cfg: dict, steps: int, device: str, zero_aux: bool = False):
        Online, self.Dataset, Draft, Head, self.TrainBatch, Strategy = _specforge(device)
        from transformers import LlamaConfig

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

    def _batches(self, files: list, batch: int, rng: random.Random | None):
        ds = self.Dataset(files, max_len=2048)
        order = list(range(len(ds)))
        if rng is not None:
            rng.shuffle(order)
        for i in range(0, len(order), batch):
            items = [ds[j] for j in order[i:i + batch]]
            yield self._collate(items)

    def _collate(self, items: list):
        L = max(d["input_ids"].shape[1] for d in items)

        def pad(t, value=0):
            p = L - t.shape[1]
            if p == 0:
                return t
            shape = list(t.shape)
            shape[1] = p
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], 1)

        t = {k: torch.cat([pad(d[k]) for d in items], 0) for k in ("input_ids", "loss_mask", "attention_mask")}
        t["hidden_state"] = torch.cat([pad(d["hidden_state"].float()) for d in items], 0)
        t["target"] = torch.cat([pad(d["target"].float()) for d in items], 0)
        if self.zero_aux:
            t["hidden_state"] = torch.zeros_like(t["hidden_state"])
        return self.TrainBatch(sample_ids=[str(i) for i in range(len(items))], strategy="eagle3", tensors=t,
                               metadata={"target_repr": "hidden_state"})

    def train(self, files: list, epochs: int, batch: int, lr: float, budget_s: float, seed: int, say=print,
              max_steps: int | None = None) -> dict:
        """AdamW over ``epochs`` passes; stops early at ``budget_s`` seconds or ``max_steps`` steps
        (the floor trains exactly as many steps as the correct draft got, so a budget cut on a busy
        machine cannot hand one control more training than the other)."""
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        rng = random.Random(seed)
        t0, step, hist = time.monotonic(), 0, []
        self.model.train()
        stop = None
        for ep in range(epochs):
            for b in self._batches(files, batch, rng):
                out = self.strategy.forward_loss(b)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
                opt.step()
                step += 1
                if step % 25 == 0 or step == 1:
                    acc = [round(float(a), 3) for a in out.metrics["acces"]]
                    hist.append({"step": step, "epoch": ep, "loss": round(float(out.loss), 4), "acc": acc})
                    say("[acceptance] draft%s step %d (epoch %d): loss %.3f, step accuracies %s"
                        % (" (aux zeroed)" if self.zero_aux else "", step, ep, float(out.loss), acc))
                if max_steps is not None and step >= max_steps:
                    stop = "max_steps"
                elif time.monotonic() - t0 > budget_s:
                    stop = "budget"
                if stop:
                    break
            if stop:
                break
        self.model.eval()
        return {"steps": step, "epochs_started": ep + 1, "stopped_by": stop or "epochs",
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
    def chain_replay(self, files: list, prompt_lens: dict, num_steps: int) -> dict:
        """What a chain speculative decoder (topk 1, ``num_steps`` draft steps) accepts on each sample
        of a dataset whose aux states are the ones a server would feed the draft: SpecForge's TTT
        forward gives, per position, each step's prediction with the true (greedy) tokens as inputs;
        a verify starting after the committed token p accepts the leading correct steps at p - 1.
        ``prompt_lens``: input_ids tuple prefix -> prompt length. Per sample a meta_info-like dict
        (completion_tokens C, spec_verify_ct V)."""
        metas = []
        rec = {}
        orig = self.model._acc_and_loss

        def spy(**kw):
            rec.setdefault("pred", []).append(kw["logits"].argmax(-1))
            rec.setdefault("tgt", []).append(kw["target_token_ids"])
            return orig(**kw)

        self.model._acc_and_loss = spy
        try:
            ds = self.Dataset(files, max_len=2048)
            for j in range(len(ds)):
                d = ds[j]
                rec.clear()
                self.strategy.forward_loss(self._collate([d]))
                ids = d["input_ids"][0].tolist()
                P = prompt_lens.get(tuple(ids))
                if P is None:
                    continue
                T = len(ids) - 1  # the trailing <|eot|> of the template is no generated token
                C = T - P
                correct = [(rec["pred"][i][0] == rec["tgt"][i][0]).tolist() for i in range(num_steps)]
                p, V = P, 0  # p: index of the last committed token (the prefill's token first)
                while p < T - 1:
                    V += 1
                    a = 0
                    while a < num_steps and p + 1 + a <= T - 1 and correct[a][p - 1]:
                        a += 1
                    p += a + 1
                metas.append({"completion_tokens": C, "spec_verify_ct": V})
        finally:
            self.model._acc_and_loss = orig
        return metas

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
