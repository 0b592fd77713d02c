"""Build the tiny smoke checkpoints (run inside the CPU environment by file path).

usage: python _build.py DEEPSEEK_DEST KIMI_DEST
"""

import sys
from pathlib import Path

import _hf
from _common import log


def main() -> int:
    ds, kimi = Path(sys.argv[1]), Path(sys.argv[2])
    if not (ds / ".complete").is_file():
        log("building the tiny DeepSeek-V3 checkpoint at %s" % ds)
        _hf.build_deepseek(ds)
    if not (kimi / ".complete").is_file():
        log("building the tiny Kimi-K2.5 checkpoint at %s" % kimi)
        _hf.build_kimi(kimi, ds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
