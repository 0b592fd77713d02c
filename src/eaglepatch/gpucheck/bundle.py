"""The bundle of wheels an offline GPU machine needs to run sglang and the GPU check.

``build_bundle(out_dir)`` downloads every pin of ``gpu-bundle.txt`` as a wheel for CPython 3.12 on
manylinux x86_64 (``pip download --no-deps``, cached under ``${EAGLEPATCH_CACHE}/gpu-bundle``),
installs them into one site directory (``pip install --no-deps --target``), trims
``sgl_kernel`` to its Python files and the kernels an H200 needs (``KERNEL_KEEP``), and packs the
directory into ``bundle.tar.xz`` (pieces ``bundle.tar.xz.000``, ``.001``, ... when it is larger
than one piece). Beside it: ``manifest.json`` (what is inside), ``SHA256SUMS`` and ``unpack.sh``.
The output folder is replaced only once the new one is complete, under a lock.

On the GPU machine: ``sh .gpu-bundle/unpack.sh /tmp/site && export PYTHONPATH=/tmp/site``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .. import cpuenv
from ..errors import RefusedError, UsageError

PINS_FILE = Path(__file__).with_name("gpu-bundle.txt")
PYTHON_VERSION = (3, 12)
PLATFORMS = (
    "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
    "manylinux_2_5_x86_64", "manylinux1_x86_64",
)
KERNEL_DIR = "sgl_kernel"
# What an H200 (sm90) needs of sglang-kernel besides its Python files: the common ops. The
# FlashAttention/FlashMLA/InfLLM/sm100 libraries (1.1 GB unpacked) are dropped; the GPU check
# runs Triton attention.
KERNEL_KEEP = frozenset({"sm90/common_ops.abi3.so"})
PIECE_BYTES = 64 << 20
DEFAULT_MAX_MIB = 60
BUNDLE_NAME = "bundle.tar.xz"
FIXED_MTIME = 946684800  # 2000-01-01: the same wheels give the same tarball


@dataclass(frozen=True)
class Pin:
    name: str      # canonical (PEP 503) name
    version: str
    line: int

    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str, source: str = "gpu-bundle.txt") -> list[Pin]:
    """Exact `name==version` pins, one a line ('#' comments); duplicates and ranges are errors."""
    pins: list[Pin] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)", line)
        if not m:
            raise UsageError(f"{source}:{n}: {line!r} is not an exact pin", "write name==version")
        name = canonical(m.group(1))
        if name in seen:
            raise UsageError(f"{source}:{n}: {name} is pinned twice (first on line {seen[name]})",
                             "keep one version of each package")
        seen[name] = n
        pins.append(Pin(name, m.group(2), n))
    if not pins:
        raise UsageError(f"{source} pins nothing", "list the wheels the GPU machine needs")
    return pins


def supported_tags() -> frozenset:
    """Wheel tags CPython 3.12 on manylinux x86_64 accepts (what pip on the GPU machine would)."""
    from packaging import tags

    interp = "cp%d%d" % PYTHON_VERSION
    out = set(tags.cpython_tags(PYTHON_VERSION, abis=[interp, "abi3", "none"], platforms=list(PLATFORMS)))
    out |= set(tags.compatible_tags(PYTHON_VERSION, interp, platforms=list(PLATFORMS)))
    return frozenset(out)


def wheel_info(filename: str):
    """(canonical name, version string, tags) of a wheel file name, or None for anything else."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        name, version, _build, wtags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    return canonical(name), str(version), wtags


def wheel_candidates(pins: Iterable[Pin], files: Iterable[Path]) -> dict:
    """Pin -> the wheels among ``files`` that match it and run on the GPU machine (one pass)."""
    from packaging.version import Version

    ok_tags = supported_tags()
    by_name: dict[str, list] = {}
    for f in files:
        info = wheel_info(Path(f).name)
        if info is not None:
            by_name.setdefault(info[0], []).append((Path(f), info))
    return {pin: [p for p, (_, ver, wtags) in by_name.get(pin.name, [])
                  if Version(ver) == Version(pin.version) and wtags & ok_tags] for pin in pins}


def select_wheels(pins: Iterable[Pin], files: Iterable[Path]) -> dict:
    """Pin -> the one wheel among ``files`` that matches it and runs on the GPU machine.

    Raises UsageError naming every pin without such a wheel or with two of them."""
    chosen, missing, doubled = {}, [], []
    for pin, cands in wheel_candidates(pins, files).items():
        if not cands:
            missing.append(pin.spec())
        elif len(cands) > 1:
            doubled.append("%s (%s)" % (pin.spec(), ", ".join(sorted(c.name for c in cands))))
        else:
            chosen[pin] = cands[0]
    if missing:
        raise UsageError("no cp312 manylinux x86_64 wheel for " + ", ".join(missing),
                         "check the pins in %s against the package index" % PINS_FILE.name)
    if doubled:
        raise UsageError("two wheels for " + "; ".join(doubled), "remove the extra file from the wheel cache")
    return chosen


def kernel_trim_plan(rel_paths: Iterable[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped) files of the installed sgl_kernel package (paths relative to it)."""
    keep, drop = [], []
    for rel in sorted(rel_paths):
        if rel.endswith(".py") or rel.endswith(".pyi") or rel in KERNEL_KEEP or "/" not in rel and not rel.endswith(".so"):
            keep.append(rel)
        else:
            drop.append(rel)
    missing = sorted(KERNEL_KEEP - set(keep))
    if missing:
        raise RefusedError("the sglang-kernel wheel has no " + ", ".join(missing),
                           "update KERNEL_KEEP in eaglepatch/gpucheck/bundle.py for this sglang-kernel")
    return keep, drop


def piece_names(total: int, piece: int = PIECE_BYTES) -> list[str]:
    """File names of a tarball of ``total`` bytes cut into pieces of at most ``piece`` bytes."""
    if total <= piece:
        return [BUNDLE_NAME]
    count = -(-total // piece)
    return ["%s.%03d" % (BUNDLE_NAME, i) for i in range(count)]


def cache_dir() -> Path:
    return cpuenv.cache_dir() / "gpu-bundle" / "wheels"


def _pip_platform_args() -> list[str]:
    args = ["--python-version", "%d.%d" % PYTHON_VERSION, "--implementation", "cp", "--only-binary=:all:"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def download_command(pins: Iterable[Pin], dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "--progress-bar", "off", *_pip_platform_args(), "-d", str(dest), *[p.spec() for p in pins]]


def install_command(wheels: Iterable[Path], site: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
            "--disable-pip-version-check", "--target", str(site), *_pip_platform_args(),
            *[str(w) for w in wheels]]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run(cmd: list[str], what: str, log: Path) -> None:
    """``cmd`` with its output appended to ``log`` (cpuenv's runner); a failure is a one-line refusal
    quoting the log's last line."""
    try:
        cpuenv._run_logged(cmd, log, what)
    except RuntimeError:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise RefusedError("%s failed: %s" % (what, tail[0][:300] if tail else "no output"),
                           "read %s, fix the pin or the network and rerun" % log) from None


UNPACK_SH = """#!/bin/sh
# Unpack the GPU bundle: sh unpack.sh DEST, then put DEST first on PYTHONPATH.
set -e
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:?usage: sh unpack.sh DEST}
(cd "$here" && sha256sum -c --quiet SHA256SUMS) || { echo "error: the bundle in $here is damaged; rebuild it with tools/gpu_bundle.py" >&2; exit 2; }
mkdir -p "$dest"
cat "$here"/bundle.tar.xz* | xz -d -T0 | tar -x -C "$dest"
test -f "$dest/sglang/__init__.py" || { echo "error: $dest holds no sglang after unpacking; rebuild the bundle" >&2; exit 2; }
echo "unpacked the GPU bundle into $dest"
"""


class _Lock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fh = open(self.path, "w")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            raise RefusedError("another gpu_bundle.py is writing %s" % self.path.with_suffix(""),
                               "wait for it to finish and rerun")
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()
        return False


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = FIXED_MTIME
    return info


def _pack(site: Path, dest_dir: Path, say) -> list[Path]:
    """Tar (sorted, normalised owners and times) piped through multi-threaded xz, then cut."""
    xz = shutil.which("xz")
    if xz is None:
        raise UsageError("xz is not installed", "install it (apt-get install xz-utils) and rerun")
    raw = dest_dir / (BUNDLE_NAME + ".partial")
    with open(raw, "wb") as out:
        proc = subprocess.Popen([xz, "-T0", "-6", "-c"], stdin=subprocess.PIPE, stdout=out)
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                entries = sorted(p for p in site.rglob("*"))
                for i, p in enumerate(entries):
                    tar.add(p, arcname=str(p.relative_to(site)), recursive=False, filter=_tar_filter)
                    if i and i % 5000 == 0:
                        say("  packed %d of %d entries" % (i, len(entries)))
        finally:
            proc.stdin.close()
            rc = proc.wait()
    if rc != 0:
        raise RefusedError("xz failed (exit %d)" % rc, "check the free disk space and rerun")
    total = raw.stat().st_size
    names = piece_names(total)
    if len(names) == 1:
        final = dest_dir / names[0]
        os.replace(raw, final)
        return [final]
    outs = []
    with open(raw, "rb") as src:
        for name in names:
            p = dest_dir / name
            with open(p, "wb") as fh:
                fh.write(src.read(PIECE_BYTES))
            outs.append(p)
    raw.unlink()
    return outs


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def build_bundle(out_dir: Path, pins_file: Path = PINS_FILE, max_mib: float = DEFAULT_MAX_MIB,
                 wheel_cache: Path | None = None, say: Callable[[str], None] = print) -> dict:
    """Build the bundle into ``out_dir`` (replaced only when complete); returns the manifest."""
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a directory", "pass a directory with --out")
    if not pins_file.is_file():
        raise UsageError(f"{pins_file} does not exist", "pass a pin list with --pins")
    pins = read_pins(pins_file.read_text(), pins_file.name)
    cache = Path(wheel_cache) if wheel_cache else cache_dir()
    t0 = time.monotonic()

    def step(msg: str) -> None:
        say("[%5.0fs] %s" % (time.monotonic() - t0, msg))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _Lock(out_dir.parent / (out_dir.name + ".lock")):
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="." + out_dir.name + ".tmp-", dir=out_dir.parent))
        try:
            log = work / "pip.log"
            have = wheel_candidates(pins, cache.glob("*.whl"))
            todo = [p for p in pins if len(have[p]) != 1]
            step("%d pins; %d wheels cached in %s, %d to download" % (len(pins), len(pins) - len(todo), cache, len(todo)))
            if todo:
                dl = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
                try:
                    _run(download_command(todo, dl), "pip download of %d wheels" % len(todo), log)
                    for w in dl.glob("*.whl"):
                        os.replace(w, cache / w.name)
                finally:
                    shutil.rmtree(dl, ignore_errors=True)
                step("downloaded %s" % ", ".join(p.spec() for p in todo))
            chosen = select_wheels(pins, cache.glob("*.whl"))
            site = work / "site"
            step("installing %d wheels into a site directory (pip install --no-deps --target)" % len(chosen))
            _run(install_command([chosen[p] for p in pins], site), "pip install --target", log)
            kdir = site / KERNEL_DIR
            if not kdir.is_dir():
                raise RefusedError("the installed wheels hold no %s/ package" % KERNEL_DIR, "pin sglang-kernel")
            rels = [str(p.relative_to(kdir)) for p in kdir.rglob("*") if p.is_file()]
            kept, dropped = kernel_trim_plan(rels)
            dropped_bytes = 0
            for rel in dropped:
                dropped_bytes += (kdir / rel).stat().st_size
                (kdir / rel).unlink()
            step("trimmed %s: dropped %d files (%.0f MiB), kept %s" % (KERNEL_DIR, len(dropped), dropped_bytes / 2**20,
                                                                     ", ".join(sorted(KERNEL_KEEP))))
            _check_site(site, pins)
            unpacked = _dir_bytes(site)
            step("packing %.0f MiB with xz -T0 (a few minutes on 2 cores)" % (unpacked / 2**20))
            stage = work / "out"
            stage.mkdir()
            parts = _pack(site, stage, step)
            packed = sum(p.stat().st_size for p in parts)
            if packed > max_mib * 2**20 and len(parts) == 1:
                raise RefusedError("the bundle is %.1f MiB, over --max-mib %g" % (packed / 2**20, max_mib),
                                   "drop packages from the pin list or raise --max-mib")
            manifest = {
                "format": 1,
                "python": "%d.%d" % PYTHON_VERSION,
                "platforms": list(PLATFORMS),
                "packages": {p.name: {"version": p.version, "wheel": chosen[p].name,
                                      "wheel_sha256": _sha256(chosen[p]), "wheel_bytes": chosen[p].stat().st_size}
                             for p in pins},
                "trimmed": {"package": KERNEL_DIR, "kept_binaries": sorted(KERNEL_KEEP),
                            "dropped": dropped, "dropped_bytes": dropped_bytes},
                "unpacked_bytes": unpacked,
                "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in parts},
                "packed_bytes": packed,
                "build_seconds": round(time.monotonic() - t0, 1),
                "unpack": "sh unpack.sh DEST && export PYTHONPATH=DEST",
            }
            (stage / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            (stage / "SHA256SUMS").write_text("".join("%s  %s\n" % (v["sha256"], k) for k, v in manifest["files"].items()))
            (stage / "unpack.sh").write_text(UNPACK_SH)
            (stage / "unpack.sh").chmod(0o755)
            # commit point: every file is in place in the staging dir; swap it in
            old = None
            if out_dir.exists():
                old = work / "previous"
                os.replace(out_dir, old)
            os.replace(stage, out_dir)
            step("wrote %s: %s (%.1f MiB packed, %.0f MiB unpacked)" % (
                out_dir, ", ".join(p.name for p in parts), packed / 2**20, unpacked / 2**20))
            return manifest
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _check_site(site: Path, pins: list[Pin]) -> None:
    """Every pinned distribution is installed at its version (dist-info), and sglang is there."""
    found = {}
    for d in site.glob("*.dist-info"):
        m = re.fullmatch(r"(.+)-([^-]+)\.dist-info", d.name)
        if m:
            found[canonical(m.group(1))] = m.group(2)
    from packaging.version import Version

    bad = [p.spec() for p in pins if p.name not in found or Version(found[p.name]) != Version(p.version)]
    if bad:
        raise RefusedError("the site directory lacks " + ", ".join(bad), "rerun; if it repeats, report the pip log")
    if not (site / "sglang" / "__init__.py").is_file():
        raise RefusedError("the site directory holds no sglang package", "pin sglang in the pin list")


__all__ = ["Pin", "read_pins", "select_wheels", "kernel_trim_plan", "piece_names", "build_bundle",
           "supported_tags", "wheel_info", "download_command", "install_command",
           "KERNEL_KEEP", "PINS_FILE", "PIECE_BYTES"]
