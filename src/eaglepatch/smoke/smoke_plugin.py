"""The smoke runs' test-only SGLang plugin (entry point ``eaglepatch_smoke``): what the series'
smoke patch (0005/0006, "smoke: route torch_native deepseek attention to mla") does in a patched
tree, for an unmodified release with the eaglepatch-capture plugin. Never part of the product
wheel: ``eaglepatch.smoke.smoke_plugin_dir`` lays it out (a package and its dist-info) in a smoke
run's work dir, which the run puts on PYTHONPATH.

torch_native's forward_extend reads K/V back from the KV pool, which holds the MLA latent for
DeepSeek, so its MHA prefill is wrong on CPU; the smoke routes every DeepSeek forward to MLA by
registering a handler in SGLang's own attention-backend registry (a registry call, not a hook).
"""

ENTRY_POINT = "eaglepatch_smoke"


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        AttnForwardMethod,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)
