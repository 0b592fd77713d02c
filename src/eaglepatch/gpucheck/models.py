"""Models, prompts and layer ids of the GPU check (pure Python: imported everywhere).

``CHECK_MODEL`` is a 4-layer DeepSeek-V3 with the real MLA head dimensions (kv_lora_rank 512,
rope 64, nope 128, v 128; 16 heads), one dense layer and three MoE layers, shaped so that a
per-row relative error tells a wrong layer from bf16 noise by a wide margin:

- routing is decisive: each MoE layer's ``e_score_correction_bias`` is +4 for two experts and -4
  for the others, while sigmoid scores differ by less than 1, so bf16 rounding cannot flip the
  top-2 choice (near-tie flips are what made a random DeepSeek-V3 differ from HF on a few tokens);
- each layer's MLP output dominates the residual stream entering it (``down_proj`` scaled by
  ``2 * 2**layer``, attention ``o_proj`` by 0.3), so the output of layer k differs from the output
  of layer k +- 1, and from a TP partial sum of layer k, by a large fraction of its norm;
- the final norm weight is scaled by 0.25, so the post-norm ``final`` differs from the pre-norm
  output of the last layer (a skipped norm) by most of its norm.

``THROUGHPUT_MODEL`` has DeepSeek-V3's real widths (hidden 7168, 128 heads, intermediate 18432,
moe_intermediate 2048, top-8 routing in 8 groups) with 4 layers and 64 experts, so it fits one
H200 several times over; it runs with dummy weights.
"""

from __future__ import annotations

import hashlib
import json
import random

from ..smoke import tinyconfig

EAGLE_IDS = [-1, 1, 2]
SEED = 20261130
BUILDER_VERSION = "1"
FUSE_ALLREDUCE_MAX_TOKENS = 2048  # sglang's FUSE_ALLREDUCE_MAX_BATCH_SIZE (0.5.9 .. 0.5.23)

CHECK_MODEL = dict(
    tinyconfig.DEEPSEEK_V3,  # the CPU smoke model, widened to the real MLA head dimensions
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=768,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=4096,
    rope_scaling=dict(tinyconfig.DEEPSEEK_V3["rope_scaling"], original_max_position_embeddings=1024),
    initializer_range=0.02,
    torch_dtype="bfloat16",
)

# How the check model's weights are drawn (reference.build_checkpoint); part of its cache key.
SHAPING = {
    "init_std": 0.02,
    "norm_jitter": 0.1,
    "o_proj_scale": 0.3,
    "down_proj_scale": 2.0,
    "down_proj_growth": 2.0,
    "final_norm_scale": 0.25,
    "router_bias": 4.0,
}

THROUGHPUT_MODEL = dict(
    CHECK_MODEL,
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    max_position_embeddings=8192,
)


def _one_layer_draft(target: dict, heads: int = 8) -> dict:
    """The fields a one-layer draft of ``target`` shares between the EAGLE-3 and DFlash configs."""
    return {
        "hidden_size": target["hidden_size"],
        "intermediate_size": 2 * target["hidden_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": target["hidden_size"] // heads,
        "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def draft_config(target: dict, layer_ids=EAGLE_IDS) -> dict:
    """An EAGLE-3 draft (LlamaForCausalLMEagle3) for ``target``, reading ``layer_ids``; the GPU
    check loads it with dummy (random) weights."""
    return dict(_one_layer_draft(target), architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                draft_vocab_size=target["vocab_size"],
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True})


# The DFlash draft of check h: ids [0, 2] of the 4-layer check model, which every reading tells
# apart (DFlash: the outputs of layers 0 and 2, reference layer.0 and layer.2; the EAGLE-3 or
# "layer input" reading would give layer.-1 and layer.1).
DFLASH_IDS = [0, 2]
DFLASH_BLOCK = 4


def dflash_draft_config(target: dict, layer_ids=DFLASH_IDS, block_size: int = DFLASH_BLOCK) -> dict:
    """A DFlash draft (DFlashDraftModel, the field names sglang's parse_dflash_draft_config reads)
    for ``target``, reading ``layer_ids``; the GPU check loads it with dummy (random) weights."""
    return dict(_one_layer_draft(target), architectures=["DFlashDraftModel"], model_type="qwen3",
                block_size=block_size,
                dflash_config={"target_layer_ids": list(layer_ids), "block_size": block_size,
                               "mask_token_id": target["vocab_size"] - 1,
                               "num_target_layers": target["num_hidden_layers"]})


def checkpoint_key(config: dict = CHECK_MODEL) -> str:
    blob = json.dumps({"config": config, "shaping": SHAPING, "seed": SEED, "builder": BUILDER_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Prompt lengths: "small" totals 769 tokens (below the 2048-token all-reduce fusion limit),
# "large" 2811 tokens in one forward (above it), mixed lengths in both.
BATCHES = {
    "small": [3, 17, 64, 129, 200, 311, 45],
    "large": [700, 1100, 64, 947],
}


def prompts(batch: str, seed: int = SEED, vocab: int = CHECK_MODEL["vocab_size"]) -> list[list[int]]:
    """Distinct random prompts (ids 2 .. vocab-2) for one of ``BATCHES``."""
    if batch not in BATCHES:
        raise KeyError("unknown batch %r; use one of %s" % (batch, ", ".join(BATCHES)))
    rng = random.Random("%s-%d" % (batch, seed))
    return [[rng.randrange(2, vocab - 1) for _ in range(n)] for n in BATCHES[batch]]


def dump_ids(num_layers: int) -> list[int]:
    """The dump ids the check asks for: the EAGLE-3 ids and, where the series accepts it, N-1
    (the pre-norm output of the last layer)."""
    ids = list(EAGLE_IDS)
    if num_layers - 1 not in ids:
        ids.append(num_layers - 1)
    return ids


__all__ = ["EAGLE_IDS", "CHECK_MODEL", "THROUGHPUT_MODEL", "SHAPING", "BATCHES", "prompts", "draft_config",
           "checkpoint_key", "dump_ids", "FUSE_ALLREDUCE_MAX_TOKENS"]
