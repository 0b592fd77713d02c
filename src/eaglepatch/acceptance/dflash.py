"""The acceptance tool's DFlash draft (issue 44, item 5): trained, replayed and exported with
SpecForge 0.2.0's own DFlash classes, on a ``tools/extract.py --format dflash`` dataset.

- ``DFlashRun`` builds SpecForge's ``DFlashDraftModel`` (a Qwen3-style block-diffusion draft) and
  its training wrapper ``OnlineDFlashModel`` with the target's own embedding and LM head (frozen,
  ``TargetEmbeddingsAndHead``), steps it with ``DFlashTrainStrategy`` on batches made by SpecForge's
  own offline normaliser and collator (``dflash_family_data``).
- ``block_replay`` is the replay prediction: what SGLang's DFLASH worker accepts, verify by verify,
  when it serves this draft on a target whose greedy output and hidden states are the dataset's.
  A verify anchored at a committed token p (the prefill's token first) hands the draft the target
  states of positions < p and the block [ids[p], mask, ..., mask]; the leading block positions
  whose argmax equals the greedy tokens are accepted, plus the target's own token, and the next
  anchor is the token after them. The block forward is SpecForge's own (``_forward_draft_blocks``
  with these anchors instead of random ones: the same noise embedding, positions and mask).
- ``export`` writes the draft as SGLang 0.5.17+ loads it (``config.json`` with ``dflash_config``,
  ``model.safetensors`` with the draft's own names; no embedding, no LM head).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from . import progress
from . import train as train_mod
from ..gpucheck import models as gmodels

# The names SGLang's DFlashDraftModel.load_weights takes (models/dflash.py, 0.5.17 and 0.5.23): the
# draft's own weights under SpecForge's names. A name SGLang does not know it skips with no error,
# so the export refuses any other name rather than ship a draft SGLang would run half random.
_SGLANG_LAYER_NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                       "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                       "input_layernorm.weight", "post_attention_layernorm.weight")
_SGLANG_TOP_NAMES = ("fc.weight", "hidden_norm.weight", "norm.weight")


def sglang_names(num_layers: int) -> set:
    return {f"layers.{i}.{n}" for i in range(num_layers) for n in _SGLANG_LAYER_NAMES} | set(_SGLANG_TOP_NAMES)


def draft_config(target_cfg: dict, ids: list, block_size: int, layers: int, mask_token_id: int,
                 dtype: str = "bfloat16") -> dict:
    """The DFlash draft's config.json, with the field names both SpecForge 0.2.0 and SGLang's
    ``parse_dflash_draft_config`` read (``dflash_config.target_layer_ids``, ``block_size``,
    ``mask_token_id``, ``num_target_layers``)."""
    cfg = gmodels.dflash_draft_config(target_cfg, ids, block_size)
    cfg.update(num_hidden_layers=layers, layer_types=["full_attention"] * layers, torch_dtype=dtype,
               num_target_layers=target_cfg["num_hidden_layers"])
    cfg["dflash_config"]["mask_token_id"] = mask_token_id
    return cfg


def with_ids(cfg: dict, ids: list) -> dict:
    """The same draft config naming other target layers (a control: the same weights, other ids)."""
    out = json.loads(json.dumps(cfg))
    out["dflash_config"]["target_layer_ids"] = list(ids)
    return out


def _specforge():
    from specforge.algorithms.common.dflash_family_data import build_collator, build_offline_normalizer
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import DFlashTrainStrategy

    return (DFlashDraftModel, OnlineDFlashModel, TargetEmbeddingsAndHead, DFlashTrainStrategy, TrainBatch,
            build_offline_normalizer, build_collator)


class DFlashRun:
    """One DFlash draft of config ``cfg`` for the target at ``target``, trained in float32 on
    ``device`` from weights drawn from ``seed``."""

    def __init__(self, target: Path, cfg: dict, device: str, seed: int = 0, num_anchors: int = 64,
                 max_len: int = 2048):
        Draft, Online, Parts, Strategy, self.TrainBatch, normalizer, collator = _specforge()
        from transformers import Qwen3Config

        torch.manual_seed(seed)
        self.dev = torch.device("cuda" if device == "cuda" else "cpu")
        self.cfg = cfg
        qc = Qwen3Config(**cfg)
        qc._attn_implementation = "sdpa"
        self.draft = Draft(qc).float().to(self.dev)
        parts = Parts.from_pretrained(str(target), embed_key="model.embed_tokens.weight",
                                      lm_head_key="lm_head.weight", device=self.dev.type, dtype=torch.float32)
        self.block = int(cfg["block_size"])
        self.model = Online(self.draft, parts.lm_head, parts.embed_tokens,
                            mask_token_id=int(cfg["dflash_config"]["mask_token_id"]), block_size=self.block,
                            attention_backend="sdpa", num_anchors=num_anchors).to(self.dev)
        self.strategy = Strategy(self.model)
        self.normalize = normalizer(max_len)
        self.collate_fn = collator()
        self._mem = {}

    def _sample(self, path: str) -> dict:
        """A sample as SpecForge's offline normaliser hands it on (batch dimension 1), kept on the
        training device after the first read."""
        d = self._mem.get(path)
        if d is None:
            raw = torch.load(path, map_location="cpu", weights_only=True)
            d = self._mem[path] = {k: v.to(self.dev) for k, v in self.normalize(raw).items()}
        return d

    def _batch(self, items: list):
        t = self.collate_fn(items)
        t["hidden_states"] = t["hidden_states"].float()
        return self.TrainBatch(sample_ids=[str(i) for i in range(len(items))], strategy="dflash", tensors=t,
                               metadata={})

    def train(self, files: list, batch: int, lr: float, max_steps: int | None, budget_s: float | None, seed: int,
              say=print) -> dict:
        """AdamW, the learning rate warmed up over 50 steps, over shuffled epochs of ``files`` until
        ``max_steps`` steps or ``budget_s`` seconds (either None: no such limit; ``stopped_by``
        says which ended it)."""
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        rng = random.Random(seed)
        t0, step, hist, stop, ep = time.monotonic(), 0, [], None, 0
        tick = progress.Ticker()
        self.model.train()
        while stop is None:
            order = list(range(len(files)))
            rng.shuffle(order)
            for i in range(0, len(order), batch):
                b = self._batch([self._sample(files[j]) for j in order[i:i + batch]])
                out = train_mod.optimizer_step(opt, self.strategy, self.model, b, lr, step, clip=1.0)
                step += 1
                if step % 25 == 0 or step == 1 or tick.due():
                    acc = round(float(out.metrics["accuracy"]), 4)
                    hist.append({"step": step, "epoch": ep, "loss": round(float(out.loss.detach()), 4), "acc": acc})
                    say("[acceptance] dflash draft step %d%s (epoch %d): loss %.3f, block accuracy %.3f (%.0f s)"
                        % (step, "/%d" % max_steps if max_steps else "", ep, float(out.loss.detach()), acc,
                           time.monotonic() - t0))
                    tick.mark()
                if max_steps is not None and step >= max_steps:
                    stop = "max_steps"
                elif budget_s is not None and time.monotonic() - t0 > budget_s:
                    stop = "budget"
                if stop:
                    break
            ep += 1
        self.model.eval()
        return {"steps": step, "epochs_started": ep, "stopped_by": stop, "max_steps": max_steps,
                "budget_s": None if budget_s is None else round(budget_s, 1),
                "wall_s": round(time.monotonic() - t0, 1), "history": hist}

    @torch.no_grad()
    def block_predictions(self, d: dict, anchors: list) -> torch.Tensor:
        """[len(anchors), block] argmax token of each block position, for blocks anchored at
        ``anchors`` of sample ``d`` (SpecForge's own block forward, these anchors in place of its
        random ones)."""
        m = self.model
        a = torch.tensor([anchors], dtype=torch.long, device=self.dev)
        keep = torch.ones_like(a, dtype=torch.bool)
        orig = m._sample_anchor_positions
        m._sample_anchor_positions = lambda *_a, **_k: (a, keep)
        try:
            hs = d["hidden_states"].float()
            _, _, out = m._forward_draft_blocks(input_ids=d["input_ids"], hidden_states=hs, loss_mask=d["loss_mask"])
        finally:
            m._sample_anchor_positions = orig
        return m.lm_head(out).argmax(-1).view(len(anchors), self.block)

    @torch.no_grad()
    def block_replay(self, files: list, prompt_lens: dict) -> list:
        """Per request (a sample whose prompt length P ``prompt_lens`` gives by its input ids: the
        generated tokens are ids[P:-1], the trailing <|eot|> of the template is none) a
        meta_info-like dict: completion_tokens C, spec_verify_ct V, the draft tokens each verify
        accepted and could have (``room``: fewer than block - 1 where the request ends) and the
        tokens it committed (``committed``: the accepted ones and the target's own, which the
        request's end cuts)."""
        self.model.eval()
        metas = []
        for f in files:
            d = self._sample(f) if isinstance(f, str) else f
            ids = d["input_ids"][0].tolist()
            P = prompt_lens.get(tuple(ids))
            if P is None:
                continue
            T = len(ids) - 1
            anchors = list(range(P, T - 1))
            pred = self.block_predictions(d, anchors).tolist() if anchors else []
            p, V, acc, room, done = P, 0, [], [], []
            while p < T - 1:
                V += 1
                m = min(self.block - 1, T - 1 - p)
                row = pred[p - P]
                a = 0
                while a < m and row[a + 1] == ids[p + a + 1]:
                    a += 1
                acc.append(a)
                room.append(m)
                done.append(min(a + 1, T - 1 - p))  # the request's end cuts the target's own token
                p += done[-1]
            metas.append({"completion_tokens": T - P, "spec_verify_ct": V, "accepted": acc, "room": room,
                          "committed": done})
        return metas

    def export(self, dest: Path, cfg: dict | None = None, dtype: str = "bfloat16") -> Path:
        """config.json (``cfg``, by default the trained one) and model.safetensors: the draft's own
        weights under the names SGLang loads (refused if any other name would be written, or one
        SGLang needs is missing)."""
        from safetensors.torch import save_file

        from ..errors import EaglepatchError

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        sd = {k: v.detach().cpu().to(dt).contiguous() for k, v in self.draft.state_dict().items()
              if "rotary_emb" not in k}
        want = sglang_names(int(self.cfg["num_hidden_layers"]))
        if set(sd) != want:
            raise EaglepatchError("the DFlash draft's weights are not the ones SGLang loads (extra %s, missing %s)"
                                  % (sorted(set(sd) - want)[:3], sorted(want - set(sd))[:3]),
                                  "SpecForge's DFlashDraftModel changed its names: map them in "
                                  "acceptance/dflash.py before serving", exit_code=1)
        save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
        (dest / "config.json").write_text(json.dumps(cfg or self.cfg, indent=2) + "\n")
        return dest
