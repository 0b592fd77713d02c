"""The CPU side of the GPU check's capture path (run by file path inside the CPU SGLang environment).

usage: python cpu_capture.py CKPT DRAFT_DIR PROMPTS_JSON

A target ModelRunner of the real (patched) sglang on CPU, configured for EAGLE-3 with the draft
config in DRAFT_DIR (ids [-1, 1, 2]), runs one extend of the prompts with
CaptureHiddenMode.FULL, the way the GPU check's engines do in prefill. The spy
(EAGLEPATCH_SPY_DIR, on PYTHONPATH through the check's sitecustomize) records what the target
hands to the draft; with EAGLE3_DUMP_DIR set the series' dump writes its files. Prints
``@@DONE <json>`` on success.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SMOKE = Path(__file__).resolve().parents[1] / "smoke"
sys.path.insert(0, str(SMOKE))

import _rt  # noqa: E402  (eaglepatch.smoke: the in-process ModelRunner, through the release's one-batch module)


def main() -> int:
    ckpt, draft, prompts_file = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    prompts = json.loads(prompts_file.read_text())
    sa = _rt.server_args(ckpt, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                         speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2,
                         context_length=2048, max_total_tokens=8192)
    runner = _rt.make_runner(sa)
    # request ids 0, 1, ... (the dump names each file by its request id; the tests read them so)
    out = _rt.extend(runner, prompts, capture_full=True, rids=[str(i) for i in range(len(prompts))])
    shape = list(out.hidden_states.shape) if out.hidden_states is not None else None
    files = 0
    if os.environ.get("EAGLE3_DUMP_DIR"):
        from sglang.srt.eagle3_capture import capture_target

        writer = capture_target(runner.model)._eagle3_capture_state.writer
        writer.flush()
        files = writer.written
    print("@@DONE " + json.dumps({"hidden_shape": shape, "written": files}), flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
