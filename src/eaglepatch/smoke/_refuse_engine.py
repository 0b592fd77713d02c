"""e. through a real sglang.Engine start: with EAGLE3_DUMP_DIR set and the radix cache on
(the Engine default), the start must fail with a message naming --disable-radix-cache.

usage: python _refuse_engine.py CKPT WORK_DIR

The failing scheduler signals this process (SIGQUIT -> kill of the process tree), so the Engine
start runs in a child process here and this process reads the child's output.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from _common import log, result

NAME = "e. refused at sglang.Engine start: radix cache on"
NEEDLE = "EAGLE3_DUMP_DIR is set but the radix cache is on"
FIX = "--disable-radix-cache"

CHILD = r"""
import sys, sglang
engine = sglang.Engine(model_path=sys.argv[1], device="cpu", skip_tokenizer_init=True,
                       attention_backend="torch_native", disable_cuda_graph=True, dtype="float32",
                       disable_overlap_schedule=True, max_total_tokens=4096, context_length=1024,
                       max_running_requests=8, random_seed=0)
print("ENGINE STARTED", flush=True)
engine.shutdown()
"""


def main() -> int:
    ckpt, work = sys.argv[1], Path(sys.argv[2])
    dump = work / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EAGLE3_DUMP_DIR=str(dump), EAGLE3_DUMP_LAYERS="-1,1,2")
    t0 = time.monotonic()
    log("starting an Engine with the dump on and the radix cache on (must be refused)")
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, ckpt], env=env, capture_output=True,
                              text=True, errors="replace", timeout=240, start_new_session=True)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = ((exc.stdout or "") if isinstance(exc.stdout, str) else "") + " [timed out]", None
    wall = time.monotonic() - t0
    started = "ENGINE STARTED" in out
    lines = [ln for ln in out.splitlines() if NEEDLE in ln]
    files = sorted(p.name for p in dump.iterdir())
    ok = (not started) and rc not in (0, None) and bool(lines) and FIX in lines[0] and not files
    detail = "exit %s after %.0f s; %s" % (rc, wall, lines[0].strip()[-300:] if lines else "message not found")
    if started:
        detail = "the Engine STARTED with the radix cache on; " + detail
    if files:
        detail += "; dump dir not empty: %s" % files[:5]
    if not ok and not lines:
        detail += "\n" + "\n".join(out.splitlines()[-15:])
    result(NAME, ok, "refused" if ok else ("started" if started else "no refusal message"), detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
