#!/usr/bin/env python3
"""Pack Mooncake's store client and master for an offline GPU machine, small enough to carry.

  python3 benchmarks/mooncake_payload.py [--out .gpu-extra/mooncake] [--wheel WHEEL]

The CUDA 13 wheel (``WHEEL``, cp312, downloaded into the cache) holds a benchmark binary and a
second copy of ``libetcd_wrapper`` that are not needed at run time (45 of its 95 MB unpacked);
this keeps ``mooncake/{__init__,store}``, ``mooncake_master`` and the shared objects they load,
plus the shared libraries outside the wheel they need (``libibverbs``, ``libnuma``, ``libcurl``
and their closure, taken from this machine's system). OUT holds ``mooncake.tar.xz`` and
``unpack.sh``; on the GPU machine ``sh OUT/unpack.sh /tmp/mc`` unpacks it, copies into
``/tmp/mc/lib`` only the system libraries that machine lacks, finds the CUDA runtime the store
links, and writes ``/tmp/mc/env.sh`` (``PYTHONPATH`` and ``LD_LIBRARY_PATH``) to source.
The benchmark that uses it: benchmarks/online.py (docs/online.md).
Exit: 0 built, 1 failed, 2 usage error.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL = "mooncake-transfer-engine-cuda13==0.3.11.post1"
KEEP = ("mooncake/__init__.py", "mooncake/store.so", "mooncake/mooncake_master", "mooncake/libasio.so",
        "mooncake/libetcd_wrapper.so")
SYSTEM = ("libibverbs.so.1", "libnuma.so.1", "libcurl.so.4")
GLIBC = ("libc.so", "libm.so", "libdl.so", "libpthread.so", "librt.so", "libresolv.so", "ld-linux", "libgcc_s.so",
         "libstdc++.so", "linux-vdso")

UNPACK = r"""#!/bin/sh
# sh unpack.sh DEST: Mooncake's store client and master into DEST, the system libraries this
# machine lacks into DEST/lib, and DEST/env.sh to source (PYTHONPATH, LD_LIBRARY_PATH).
set -e
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:?usage: sh unpack.sh DEST}
mkdir -p "$dest/lib"
tar -xJf "$here/mooncake.tar.xz" -C "$dest"
for f in "$dest"/syslib/*; do
  n=$(basename "$f")
  if ! ldconfig -p | awk -v n="$n" '$1 == n {f=1} END {exit !f}'; then cp -a "$f" "$dest/lib/"; echo "unpack: $n copied (this machine lacks it)"; fi
done
cudart=$(python3 -c "
import glob, os, sys
for p in sys.path:
    for f in glob.glob(os.path.join(p, 'nvidia', '*', 'lib', 'libcudart.so.13')) + glob.glob(os.path.join(p, 'nvidia', 'cu13', 'lib', 'libcudart.so.13*')) + glob.glob(os.path.join(p, 'torch', 'lib', 'libcudart.so.13*')):
        print(os.path.dirname(f)); raise SystemExit
" 2>/dev/null || true)
lp="$dest/lib"
[ -n "$cudart" ] && lp="$lp:$cudart"
echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}" > "$dest/env.sh"
echo "export LD_LIBRARY_PATH=$lp\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" >> "$dest/env.sh"
echo "unpack: $dest (cudart: ${cudart:-not found})"
"""


def closure(libs) -> dict:
    """name -> real path of each library ``libs`` need, outside glibc and the C++ runtime."""
    out = {}
    for name in libs:
        path = subprocess.run(["sh", "-c", "ldconfig -p | awk '$1 == \"%s\" {print $NF; exit}'" % name],
                              capture_output=True, text=True).stdout.strip()
        if not path:
            raise SystemExit("error: this machine has no %s; install it (apt-get install libibverbs1 libnuma1 libcurl4) "
                             "and rerun" % name)
        out[name] = path
        for line in subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>" and not any(parts[0].startswith(g) for g in GLIBC):
                out.setdefault(parts[0], parts[2])
    for extra in ("libnl-3.so.200", "libnl-route-3.so.200"):  # libibverbs' own needs
        path = subprocess.run(["sh", "-c", "ldconfig -p | awk '$1 == \"%s\" {print $NF; exit}'" % extra],
                              capture_output=True, text=True).stdout.strip()
        if path:
            out.setdefault(extra, path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mooncake_payload.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".gpu-extra" / "mooncake", help="output folder")
    ap.add_argument("--wheel", type=Path, help="the wheel file (default: pip download %s into the cache)" % WHEEL)
    a = ap.parse_args(argv)
    wheel = a.wheel
    if wheel is None:
        cache = Path(os.environ.get("EAGLEPATCH_CACHE", Path.home() / ".cache" / "eaglepatch")) / "gpu-bundle" / "wheels"
        cache.mkdir(parents=True, exist_ok=True)
        found = sorted(cache.glob("mooncake_transfer_engine_cuda13-0.3.11.post1-cp312-*.whl"))
        if not found:
            p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                                "--python-version", "3.12", "--platform", "manylinux_2_35_x86_64", "-d", str(cache),
                                WHEEL], capture_output=True, text=True)
            if p.returncode != 0:
                print("error: pip could not download %s: %s" % (WHEEL, (p.stderr.strip().splitlines() or ["?"])[-1]),
                      file=sys.stderr)
                return 1
            found = sorted(cache.glob("mooncake_transfer_engine_cuda13-*.whl"))
        wheel = found[-1]
    elif not wheel.is_file():
        print("error: --wheel %s is not a file; pass the downloaded wheel or leave --wheel out" % wheel, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as td:
        root = Path(td) / "root"
        with zipfile.ZipFile(wheel) as z:
            libs_dir = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".libs"))
            for n in z.namelist():
                if n in KEEP or (n.startswith(libs_dir + "/") and "libetcd_wrapper" not in n):
                    z.extract(n, root)
            etcd = next(n for n in z.namelist() if n.startswith(libs_dir + "/libetcd_wrapper"))
        for n in KEEP[1:3]:
            os.chmod(root / n, 0o755)
        # the master's copy of libetcd_wrapper: the same library as mooncake/'s, under the wheel's other name
        os.symlink("../mooncake/libetcd_wrapper.so", root / etcd)
        (root / "syslib").mkdir()
        for name, path in sorted(closure(SYSTEM).items()):
            shutil.copy2(path, root / "syslib" / name)
        a.out.mkdir(parents=True, exist_ok=True)
        tmp = a.out / "mooncake.tar.xz.tmp"
        with tarfile.open(tmp, "w:xz", preset=9) as t:
            for p in sorted(root.iterdir()):
                t.add(p, arcname=p.name)
        os.replace(tmp, a.out / "mooncake.tar.xz")
        (a.out / "unpack.sh").write_text(UNPACK)
    size = (a.out / "mooncake.tar.xz").stat().st_size
    print("payload: %s (%.1f MiB) from %s; on the GPU machine: sh %s/unpack.sh /tmp/mc && . /tmp/mc/env.sh"
          % (a.out / "mooncake.tar.xz", size / 2 ** 20, wheel.name, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
