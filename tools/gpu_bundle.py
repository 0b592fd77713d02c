#!/usr/bin/env python3
"""Build the bundle of wheels an offline GPU machine needs to run sglang and tools/gpucheck.py.

  python3 tools/gpu_bundle.py [--out .gpu-bundle] [--pins FILE] [--max-mib 60] [--wheel-cache DIR]

Downloads the pins of src/eaglepatch/gpucheck/gpu-bundle.txt as cp312 manylinux x86_64 wheels
(cached), installs them into one site directory, trims sglang-kernel to what an H200 needs and
packs it with xz into OUT/bundle.tar.xz (64 MiB pieces when larger), with OUT/manifest.json,
OUT/SHA256SUMS and OUT/unpack.sh. OUT is replaced only when the new bundle is complete.
On the GPU machine: sh OUT/unpack.sh /tmp/site && export PYTHONPATH=/tmp/site
Exit: 0 built, 1 refused (download, install or size), 2 usage error.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("gpu_bundle.py", __doc__)
    ap.add_argument("--out", type=Path, default=REPO / ".gpu-bundle", help="output folder (default: .gpu-bundle)")
    ap.add_argument("--pins", type=Path, help="pin list (default: src/eaglepatch/gpucheck/gpu-bundle.txt)")
    ap.add_argument("--max-mib", type=float, default=60.0, help="refuse a single tarball larger than this")
    ap.add_argument("--wheel-cache", type=Path, help="wheel cache (default: ${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}/gpu-bundle/wheels)")
    a = ap.parse_args(argv)

    def body() -> int:
        cli.require("gpu_bundle.py", "packaging")  # wheel names, tags and versions
        from eaglepatch.errors import UsageError
        from eaglepatch.gpucheck import bundle

        if a.max_mib <= 0:
            raise UsageError("--max-mib %g is not positive" % a.max_mib, "pass a size in MiB, e.g. --max-mib 60")
        m = bundle.build_bundle(a.out, a.pins or bundle.PINS_FILE, a.max_mib, a.wheel_cache,
                                say=lambda s: print(s, file=sys.stderr, flush=True))
        print("bundle: %d packages, %.1f MiB packed (%s), %.0f MiB unpacked, built in %.0f s" % (
            len(m["packages"]), m["packed_bytes"] / 2**20, ", ".join(m["files"]), m["unpacked_bytes"] / 2**20,
            m["build_seconds"]))
        return 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
