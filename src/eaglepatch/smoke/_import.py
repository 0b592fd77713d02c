"""Import level (run inside the CPU environment by file path): import the patched modules of
the tree under test and check that the series' symbols and hooks are in place.

usage: python _import.py [HOOKS_JSON]

HOOKS_JSON: {module: [lines the series adds to it]} (from the series' upstream hunks).
"""

import hashlib
import importlib
import inspect
import json
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
    symbols(sys.argv[1] if len(sys.argv) > 1 else None)
    smoke_patch()
    return 0


@guarded("import: series symbols and hooks present")
def symbols(hooks_file):
    """The package's API is there, and every line the series adds to an upstream module is in
    the module that was imported (the tree under test is the patched one)."""
    import torch

    from sglang.srt import eagle3_capture as ec
    from sglang.srt.eagle3_capture import dump, settings

    missing = []
    for owner, names in [
        (ec, ["residual_stream", "set_eagle3_layers", "configure_runner", "after_model",
              "LanguageModelDelegate", "capture_target", "DumpConfigError", "SERIES_VERSION"]),
        (dump, ["DumpWriter", "start_dump", "request_key", "prompt_key"]),
        (settings, ["DumpSettings", "check_server_args", "ENV_DIR", "ENV_LAYERS", "ENV_FINAL", "ENV_MAX_PENDING_MB"]),
    ]:
        for n in names:
            if not hasattr(owner, n):
                missing.append("%s.%s" % (getattr(owner, "__name__", owner), n))
    problems = ["missing " + m for m in missing]
    hooks = json.loads(open(hooks_file).read()) if hooks_file else {}
    for module, lines in sorted(hooks.items()):
        src = inspect.getsource(importlib.import_module(module)).splitlines()
        stripped = {ln.strip() for ln in src}
        for line in lines:
            if line.strip() and line.strip() not in stripped:
                problems.append("%s lacks the series line %r" % (module, line.strip()))
    kimi = importlib.import_module("sglang.srt.models.kimi_k25").KimiK25ForConditionalGeneration
    for n in ("set_eagle3_layers_to_capture", "get_embed_and_head", "set_embed_and_head"):
        if not hasattr(kimi, n):
            problems.append("KimiK25ForConditionalGeneration has no %s" % n)
    h = torch.randn(3, 4)
    owned = ec.residual_stream(h, None)
    if not torch.equal(owned, h) or owned.data_ptr() == h.data_ptr():
        problems.append("residual_stream(h, None) is not an owned copy of h")
    if hasattr(dump, "prompt_key") and dump.prompt_key([1, 2, 3]) != hashlib.sha256(b"1,2,3").hexdigest():
        problems.append("prompt_key([1,2,3]) is not sha256('1,2,3')")
    if hasattr(dump, "request_key") and dump.request_key("r-1") != hashlib.sha256(b"r-1").hexdigest():
        problems.append("request_key('r-1') is not sha256('r-1')")
    nlines = sum(len(v) for v in hooks.values())
    result("import: series symbols and hooks present", not problems, "%d problems" % len(problems),
           "; ".join(problems) or "eagle3_capture %s; %d series lines found in %d upstream modules"
           % (ec.SERIES_VERSION, nlines, len(hooks)))


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
