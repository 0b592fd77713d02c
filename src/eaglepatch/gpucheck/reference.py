"""The check model's checkpoint and its Hugging Face float32 reference (needs torch, transformers).

- ``build_checkpoint(dest)``: the seeded weights of ``models.CHECK_MODEL`` under DeepSeek-V3's
  own tensor names (what SGLang and every transformers version load), every value exactly
  representable in bf16 (stored as bf16; the router bias as float32), so the engine (bf16) and
  the reference (float32 upcast) start from identical weights. Written atomically; ``.complete``
  marks a finished one.
- ``Reference(ckpt, device)``: transformers' ``DeepseekV3ForCausalLM`` in float32 (TF32 off).
  ``states(ids)`` -> {"layer.-1": embedding output, "layer.k": output of decoder layer k (for
  k = N-1 the pre-norm output of the last layer), "final": the post-norm state} as float32 [T, H],
  read with forward hooks, independent of ``output_hidden_states`` conventions.
- ``partial_states(ids, tp, rank)``: what rank ``rank`` of a ``tp``-way tensor-parallel run would
  hold at the output of layer k if that layer skipped its MLP all-reduce (each MLP and expert
  computes only its rank's slice of the intermediate dimension), for k = 0 .. N-2.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..outputs import filled_dir
from . import models


def _tensor_shapes(cfg: dict) -> dict:
    """DeepSeek-V3 hub tensor names -> shapes."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], H),
            p + "self_attn.q_a_layernorm.weight": (cfg["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (heads * qk, cfg["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H),
            p + "self_attn.kv_a_layernorm.weight": (cfg["kv_lora_rank"],),
            p + "self_attn.kv_b_proj.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": (H, heads * cfg["v_head_dim"]),
        })
        if i < cfg["first_k_dense_replace"]:
            mlps = {"mlp.": cfg["intermediate_size"]}
        else:
            E, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (E, H)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
            mlps = {"mlp.experts.%d." % e: mi for e in range(E)}
            mlps["mlp.shared_experts."] = mi * cfg["n_shared_experts"]
        for q, inter in mlps.items():
            shapes[p + q + "gate_proj.weight"] = (inter, H)
            shapes[p + q + "up_proj.weight"] = (inter, H)
            shapes[p + q + "down_proj.weight"] = (H, inter)
    return shapes


def make_weights(cfg: dict = models.CHECK_MODEL, shaping: dict = models.SHAPING, seed: int = models.SEED) -> dict:
    """The check model's weights (bf16-exact; see module doc), name -> tensor."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(_tensor_shapes(cfg).items()):
        if name.endswith("e_score_correction_bias"):
            layer = int(name.split(".")[2])
            bias = torch.full(shape, -shaping["router_bias"])
            pair = 2 * ((layer - cfg["first_k_dense_replace"]) % (shape[0] // 2))
            bias[pair:pair + 2] = shaping["router_bias"]
            out[name] = bias.float()
            continue
        if len(shape) == 1:  # RMSNorm weights
            w = 1.0 + shaping["norm_jitter"] * torch.randn(shape, generator=gen)
            if name == "model.norm.weight":
                w = w * shaping["final_norm_scale"]
        else:
            w = shaping["init_std"] * torch.randn(shape, generator=gen)
            if name.endswith("o_proj.weight"):
                w = w * shaping["o_proj_scale"]
            elif name.endswith("down_proj.weight"):
                layer = int(name.split(".")[2])
                w = w * shaping["down_proj_scale"] * shaping["down_proj_growth"] ** layer
        out[name] = w.to(torch.bfloat16)
    return out


def build_checkpoint(dest: Path, cfg: dict = models.CHECK_MODEL) -> Path:
    """Write the check model to ``dest`` (safetensors + config.json) unless it is complete."""
    from safetensors.torch import save_file

    dest = Path(dest)
    if (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with filled_dir(Path(tempfile.mkdtemp(prefix="." + dest.name + ".", dir=dest.parent)), dest) as tmp:
        save_file(make_weights(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(dict(cfg), indent=2) + "\n")
        (tmp / "eaglepatch-check-model.json").write_text(json.dumps(
            {"key": models.checkpoint_key(cfg), "shaping": models.SHAPING, "seed": models.SEED}, indent=2) + "\n")
        (tmp / ".complete").write_text("ok\n")
    return dest


def write_config_only(dest: Path, cfg: dict) -> Path:
    """A model directory with only config.json (for load_format=dummy engines)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(dict(cfg), indent=2) + "\n")
    return dest


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Reference:
    """transformers' DeepseekV3ForCausalLM on the check model, float32."""

    def __init__(self, ckpt: Path, device: str = "cpu"):
        from transformers import DeepseekV3ForCausalLM

        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        model, info = DeepseekV3ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                              output_loading_info=True)
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if bad:
            raise RuntimeError("transformers did not load the check model cleanly: %s" % bad)
        self.model = model.to(device).eval()
        self.device = device
        self.num_layers = model.config.num_hidden_layers

    @torch.no_grad()
    def states(self, ids) -> dict:
        inner = self.model.model
        seen = {}
        hooks = [inner.embed_tokens.register_forward_hook(lambda m, a, o: seen.__setitem__(-1, _first(o)))]
        for i, layer in enumerate(inner.layers):
            hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, _first(o))))
        hooks.append(inner.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("final", _first(o))))
        try:
            self.model(torch.tensor([list(ids)], device=self.device))
        finally:
            for h in hooks:
                h.remove()
        out = {"layer.%d" % k: seen[k][0].float().cpu() for k in range(-1, self.num_layers)}
        out["final"] = seen["final"][0].float().cpu()
        return out

    @torch.no_grad()
    def partial_states(self, ids, tp: int = 2, rank: int = 0) -> dict:
        """{"layer.k": rank ``rank``'s output of layer k when layer k's MLP skipped its all-reduce}."""
        out = {}
        for k in range(self.num_layers - 1):
            saved = []
            mlp = self.model.model.layers[k].mlp
            cfg = self.model.config
            inter = {cfg.intermediate_size, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts}
            try:
                for name, p in mlp.named_parameters():
                    if "down_proj" not in name:
                        continue
                    dims = [d for d, n in enumerate(p.shape) if n in inter and n != cfg.hidden_size]
                    if len(dims) != 1:
                        raise RuntimeError("cannot find the intermediate dimension of %s %s" % (name, tuple(p.shape)))
                    d, n = dims[0], p.shape[dims[0]]
                    saved.append((p, p.detach().clone()))
                    keep = torch.zeros(n, dtype=torch.bool, device=p.device)
                    keep[rank * n // tp:(rank + 1) * n // tp] = True
                    shape = [1] * p.dim()
                    shape[d] = n
                    p.mul_(keep.view(shape).to(p.dtype))
                if not saved:
                    raise RuntimeError("layer %d has no down_proj" % k)
                out["layer.%d" % k] = self.states(ids)["layer.%d" % k]
            finally:
                for p, orig in saved:
                    p.copy_(orig)
        return out


__all__ = ["build_checkpoint", "make_weights", "write_config_only", "Reference"]
