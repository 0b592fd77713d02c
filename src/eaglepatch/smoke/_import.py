"""Import level (run inside the CPU environment by file path): import the patched modules of
the tree under test and check that the series' symbols and hooks are in place.

usage: python _import.py
"""

import hashlib
import importlib
import inspect
import sys
import time

from _common import guarded, result

MODULES = [
    "sglang.srt.eagle3_capture",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.kimi_k25",
    "sglang.srt.model_executor.model_runner",
]


def main() -> int:
    for mod in MODULES:
        name = "import %s" % mod

        @guarded(name)
        def imp(mod=mod, name=name):
            t0 = time.monotonic()
            m = importlib.import_module(mod)
            result(name, True, "%.1f s" % (time.monotonic() - t0), m.__file__)

        imp()
    symbols()
    smoke_patch()
    return 0


@guarded("import: series symbols and hooks present")
def symbols():
    import torch

    from sglang.srt import eagle3_capture as ec
    from sglang.srt.eagle3_capture import dump, settings
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.models import deepseek_v2 as ds
    from sglang.srt.models import kimi_k25 as kimi

    missing = []
    for owner, names in [
        (ec, ["residual_stream", "set_eagle3_layers", "configure_runner", "after_model",
              "LanguageModelDelegate", "capture_target", "DumpConfigError", "SERIES_VERSION"]),
        (dump, ["DumpWriter", "start_dump", "dump_key"]),
        (settings, ["DumpSettings", "check_server_args", "ENV_DIR", "ENV_LAYERS", "ENV_FINAL", "ENV_MAX_PENDING_MB"]),
        (kimi.KimiK25ForConditionalGeneration, ["set_eagle3_layers_to_capture", "get_embed_and_head", "set_embed_and_head"]),
    ]:
        for n in names:
            if not hasattr(owner, n):
                missing.append("%s.%s" % (getattr(owner, "__name__", owner), n))
    problems = ["missing " + m for m in missing]
    if getattr(ds, "eagle3_capture", None) is not ec:
        problems.append("deepseek_v2 does not import sglang.srt.eagle3_capture")
    if getattr(mr, "eagle3_capture", None) is not ec:
        problems.append("model_runner does not import sglang.srt.eagle3_capture")
    hooks = [
        (ds.DeepseekV2Model.forward, "eagle3_capture.residual_stream("),
        (ds.DeepseekV2ForCausalLM.forward, "eagle3_capture.after_model("),
        (ds.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, "eagle3_capture.set_eagle3_layers("),
    ]
    for fn, needle in hooks:
        if needle not in inspect.getsource(fn):
            problems.append("%s does not call %s)" % (fn.__qualname__, needle))
    init_src = inspect.getsource(mr.ModelRunner.initialize)
    a, b = init_src.find("eagle3_capture.configure_runner("), init_src.find("self.init_device_graphs()")
    if a < 0 or b < 0 or a > b:
        problems.append("ModelRunner.initialize: configure_runner (at %d) is not before init_device_graphs (at %d)" % (a, b))
    if not issubclass(kimi.KimiK25ForConditionalGeneration, ec.LanguageModelDelegate):
        problems.append("KimiK25ForConditionalGeneration is not a LanguageModelDelegate")
    h = torch.randn(3, 4)
    owned = ec.residual_stream(h, None)
    if not torch.equal(owned, h) or owned.data_ptr() == h.data_ptr():
        problems.append("residual_stream(h, None) is not an owned copy of h")
    if dump.dump_key([1, 2, 3]) != hashlib.sha256(b"1,2,3").hexdigest():
        problems.append("dump_key([1,2,3]) is not sha256('1,2,3')")
    result("import: series symbols and hooks present", not problems,
           "%d problems" % len(problems), "; ".join(problems) or "eagle3_capture %s" % ec.SERIES_VERSION)


@guarded("import: test-only smoke patch routes torch_native DeepSeek attention to MLA")
def smoke_patch():
    from sglang.srt.models.deepseek_common import attention_backend_handler as abh

    handler = abh.AttentionBackendRegistry._handlers.get("torch_native")  # upstream: none (falls back)
    ok = handler is not None and handler(None, None) == abh.AttnForwardMethod.MLA
    result("import: test-only smoke patch routes torch_native DeepSeek attention to MLA", ok,
           "routed" if ok else "not routed",
           "" if ok else "the tree under test lacks the smoke patch: the functional checks would see the upstream torch_native MHA-prefill bug")


if __name__ == "__main__":
    sys.exit(main())
