"""Configs of the tiny smoke checkpoints and the smoke prompts (pure Python, no torch).

Imported both by the parent process (to key the checkpoint cache) and by the workers that run
in the CPU environment.
"""

from __future__ import annotations

import hashlib
import json
import random

SEED = 1234
BUILDER_VERSION = "1"  # bump when the way weights are drawn changes

# DeepSeek-V3 text model (the recipe's working tiny config). rope_scaling must be deepseek
# yarn: SGLang's CPU rotary path asserts it.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 64,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.05,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

# A very small MoonViT vision tower + projector for the Kimi-K2.5 wrapper. SGLang 0.5.9 reads
# the tower sizes from hidden_size/num_* and the projector from vt_hidden_size/text_hidden_size.
KIMI_VISION = {
    "patch_size": 14,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": 32,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": DEEPSEEK_V3["hidden_size"],
}


MEDIA_PLACEHOLDER_ID = 1000


def kimi_config() -> dict:
    text = dict(DEEPSEEK_V3)  # keeps architectures: SGLang's DeepseekV2ForCausalLM reads it
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": dict(KIMI_VISION),
        # not vocab_size - 1: that is what the multimodal clamp writes over pad values, and a
        # check of the stored image ids must be able to tell the two apart
        "media_placeholder_token_id": MEDIA_PLACEHOLDER_ID,
        "pad_token_id": 0,
        "bos_token_id": DEEPSEEK_V3["bos_token_id"],
        "eos_token_id": DEEPSEEK_V3["eos_token_id"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def draft_config(layer_ids) -> dict:
    """The config of an EAGLE-3 draft for the tiny DeepSeek-V3 whose ``eagle_config`` names
    ``layer_ids`` (EAGLE-3 ids): what SGLang's target runner and SpecForge read; no
    ``eagle_config`` when ``layer_ids`` is None, as SpecForge and ModelOpt templates write it."""
    c = DEEPSEEK_V3
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_attention_heads"],
        "vocab_size": c["vocab_size"],
        "draft_vocab_size": c["vocab_size"],
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    return cfg


def checkpoint_key(kind: str, env_key: str) -> str:
    """Cache key of a tiny checkpoint: its config, seed, builder version and the env."""
    cfg = DEEPSEEK_V3 if kind == "deepseek_v3" else kimi_config()
    blob = json.dumps({"kind": kind, "config": cfg, "seed": SEED, "builder": BUILDER_VERSION,
                       "env": env_key}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Prompt lengths of the concurrent dump requests: a few to a few hundred tokens.
PROMPT_LENGTHS = [3, 17, 64, 129, 200, 311, 45]


def prompts(seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = DEEPSEEK_V3["vocab_size"]
    # avoid the BOS/EOS ids and the Kimi media placeholder id
    ids = [i for i in range(2, vocab) if i != MEDIA_PLACEHOLDER_ID]
    return [[rng.choice(ids) for _ in range(n)] for n in PROMPT_LENGTHS]
