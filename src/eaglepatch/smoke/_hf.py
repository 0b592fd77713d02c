"""Hugging Face side of the smoke tests (runs inside the CPU environment).

- ``build_deepseek(dest)``: a seeded transformers ``DeepseekV3ForCausalLM`` saved as safetensors.
- ``build_kimi(dest, deepseek_dir)``: a Kimi-K2.5 checkpoint whose text part is exactly the
  DeepSeek checkpoint (prefixed ``language_model.``) plus a tiny random vision tower.
- ``Reference``: the residual stream of transformers' DeepseekV3ForCausalLM (float32) per prompt,
  the last layer's output before the final norm included, the post-norm state and the logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import tinyconfig


def _deepseek_config():
    from transformers import DeepseekV3Config

    cfg = dict(tinyconfig.DEEPSEEK_V3)
    cfg.pop("torch_dtype", None)
    return DeepseekV3Config(**cfg)


def _publish(dest: Path, make) -> None:
    """``dest`` made by ``make(tmp)`` in a temporary directory ``.<name>.*`` beside it, marked
    ``.complete`` and renamed in when whole (``eaglepatch.outputs.build_beside``: where another
    builder renamed its own in first, theirs is kept; the temporary directory never stays)."""
    try:
        from eaglepatch.outputs import build_beside
    except ModuleNotFoundError:  # a worker run by file path (_build.py): src/ is two directories up
        sys.path.append(str(Path(__file__).resolve().parents[2]))
        from eaglepatch.outputs import build_beside

    def marked(tmp: Path) -> None:
        make(tmp)
        (tmp / ".complete").write_text("ok\n")

    build_beside(dest, marked, prefix="." + dest.name + ".")


def build_deepseek(dest: Path) -> None:
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(tinyconfig.SEED)
    model = DeepseekV3ForCausalLM(_deepseek_config()).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(tinyconfig.SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights start at 1: make them matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # noaux_tc routing bias starts at 0
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        cfg = json.loads((tmp / "config.json").read_text())
        # keep the SGLang-only keys (topk_method, scoring_func, ...) that transformers drops
        for k, v in tinyconfig.DEEPSEEK_V3.items():
            cfg.setdefault(k, v)
        cfg["architectures"] = ["DeepseekV3ForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    _publish(dest, save)


def _vision_weights(gen: torch.Generator) -> dict:
    v = tinyconfig.KIMI_VISION
    d, mlp, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    mh, mw = v["merge_kernel_size"]
    merged, text = v["vt_hidden_size"] * mh * mw, v["text_hidden_size"]

    def r(*shape, scale=0.05):
        return (scale * torch.randn(shape, generator=gen)).to(torch.float32)

    w = {
        "vision_tower.patch_embed.proj.weight": r(d, 3, p, p),
        "vision_tower.patch_embed.proj.bias": r(d),
        "vision_tower.patch_embed.pos_emb.weight": r(v["init_pos_emb_height"], v["init_pos_emb_width"], d),
        "vision_tower.encoder.final_layernorm.weight": 1.0 + r(d),
        "vision_tower.encoder.final_layernorm.bias": r(d),
        "mm_projector.pre_norm.weight": 1.0 + r(v["vt_hidden_size"]),
        "mm_projector.pre_norm.bias": r(v["vt_hidden_size"]),
        "mm_projector.proj.0.weight": r(merged, merged),
        "mm_projector.proj.0.bias": r(merged),
        "mm_projector.proj.2.weight": r(text, merged),
        "mm_projector.proj.2.bias": r(text),
    }
    for i in range(v["num_hidden_layers"]):
        b = "vision_tower.encoder.blocks.%d." % i
        w.update({
            b + "norm0.weight": 1.0 + r(d), b + "norm0.bias": r(d),
            b + "norm1.weight": 1.0 + r(d), b + "norm1.bias": r(d),
            b + "wqkv.weight": r(3 * d, d), b + "wqkv.bias": r(3 * d),
            b + "wo.weight": r(d, d), b + "wo.bias": r(d),
            b + "mlp.fc0.weight": r(mlp, d), b + "mlp.fc0.bias": r(mlp),
            b + "mlp.fc1.weight": r(d, mlp), b + "mlp.fc1.bias": r(d),
        })
    return w


def build_kimi(dest: Path, deepseek_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    text = {}
    for f in sorted(Path(deepseek_dir).glob("*.safetensors")):
        text.update(load_file(str(f)))
    weights = {"language_model." + k: v.contiguous() for k, v in text.items()}
    weights.update(_vision_weights(torch.Generator().manual_seed(tinyconfig.SEED + 2)))

    def save(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(tinyconfig.kimi_config(), indent=2) + "\n")

    _publish(dest, save)


def build_draft(dest: Path, layer_ids) -> None:
    """A config-only EAGLE-3 draft directory (the target runner reads its eagle_config; none when
    ``layer_ids`` is None, as SpecForge and ModelOpt templates write it)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(tinyconfig.draft_config(layer_ids), indent=2) + "\n")


class Ref:
    """The HF reference of one prompt.

    ``stream[i]`` is the residual stream entering decoder layer i (0 = embedding output) and
    ``stream[N]`` the last layer's output before the final norm: EAGLE-3 id k is ``stream[k + 1]``.
    ``final`` is the post-norm state (HF's ``hidden_states[-1]``), ``logits`` [T, V]."""

    def __init__(self, stream, final, logits):
        self.stream, self.final, self.logits = stream, final, logits


class Reference:
    """HF DeepseekV3ForCausalLM on the checkpoint's weights, float32."""

    def __init__(self, ckpt_dir: Path):
        from transformers import DeepseekV3ForCausalLM

        self.model = DeepseekV3ForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers

    @torch.no_grad()
    def run(self, ids, image=None) -> Ref:
        """``image``: (first row, embeddings [n, H]) that replace those rows' token embeddings,
        as a multimodal wrapper feeds its language model."""
        raw = {}
        last = self.model.model.layers[-1]
        h = last.register_forward_hook(lambda m, a, out: raw.__setitem__("x", out[0] if isinstance(out, tuple) else out))
        try:
            x = torch.tensor([list(ids)])
            if image is None:
                out = self.model(x, output_hidden_states=True)
            else:
                start, emb = image
                embeds = self.model.model.embed_tokens(x).clone()
                embeds[0, start:start + emb.shape[0]] = emb.to(embeds.dtype)
                out = self.model(inputs_embeds=embeds, output_hidden_states=True)
        finally:
            h.remove()
        hs = tuple(t[0].float() for t in out.hidden_states)
        if len(hs) != self.num_layers + 1:
            raise AssertionError("HF returned %d hidden states, expected %d" % (len(hs), self.num_layers + 1))
        pre = raw["x"][0].float()
        # transformers' last hidden state is the normed one: the pre-norm stream comes from the hook
        if float((hs[-1] - self.model.model.norm(pre)).abs().max()) > 1e-4:
            raise AssertionError("HF hidden_states[-1] is not norm(last layer output)")
        return Ref(hs[:-1] + (pre,), hs[-1], out.logits[0].float())
