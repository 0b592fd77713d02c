"""tools/gpu_bundle.py: pin parsing, wheel selection for the GPU machine, sglang-kernel trimming,
pieces, and a whole offline build from small wheels made here (no network)."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, one_line_error, run_tool
from eaglepatch.errors import RefusedError, UsageError
from eaglepatch.gpucheck import bundle


def test_shipped_pins_parse_and_name_the_gpu_stack():
    pins = {p.name: p.version for p in bundle.read_pins(bundle.PINS_FILE.read_text())}
    assert pins["sglang"] == "0.5.17"
    assert pins["transformers"] == "5.12.1"  # the machine's 5.17 breaks sglang's import
    assert pins["sglang-kernel"] == "0.4.5" and pins["flashinfer-python"] == "0.6.15.post1"
    assert "torch" not in pins  # the machine's torch 2.11.0 is used


@pytest.mark.parametrize("text,needle", [
    ("sglang>=0.5\n", "not an exact pin"),
    ("pydantic_core==2.50.5\npydantic-core==2.50.5\n", "pinned twice"),
    ("# nothing\n", "pins nothing"),
])
def test_bad_pin_lists_are_refused(text, needle):
    with pytest.raises(UsageError) as e:
        bundle.read_pins(text)
    assert needle in str(e.value)


def _touch(d: Path, *names) -> list[Path]:
    out = []
    for n in names:
        (d / n).write_bytes(b"")
        out.append(d / n)
    return out


def test_wheel_selection_takes_only_what_cpython_312_on_linux_runs(tmp_path):
    files = _touch(tmp_path,
                   "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                   "orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl",
                   "orjson-3.13.0-cp312-cp312-macosx_11_0_arm64.whl",
                   "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                   "decorator-5.3.1-py3-none-any.whl",
                   "decorator-5.2.0-py3-none-any.whl",
                   "sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl",
                   "not-a-wheel.txt")
    pins = bundle.read_pins("orjson==3.13.0\ntokenizers==0.22.2\ndecorator==5.3.1\n")
    chosen = bundle.select_wheels(pins, files)
    assert sorted(p.name for p in chosen.values()) == [
        "decorator-5.3.1-py3-none-any.whl",
        "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"]
    with pytest.raises(UsageError) as e:  # only a cp311 sglang wheel: the GPU machine runs 3.12
        bundle.select_wheels(bundle.read_pins("sglang==0.5.17\n"), files)
    assert "sglang==0.5.17" in str(e.value)
    files += _touch(tmp_path, "decorator-5.3.1-py2.py3-none-any.whl")
    with pytest.raises(UsageError) as e:
        bundle.select_wheels(bundle.read_pins("decorator==5.3.1\n"), files)
    assert "two wheels" in str(e.value)


def test_kernel_trim_keeps_python_and_the_sm90_common_ops():
    rels = ["__init__.py", "flash_ops.abi3.so", "flashmla_ops.abi3.so", "spatial_ops.abi3.so", "py.typed",
            "sm90/common_ops.abi3.so", "sm100/common_ops.abi3.so", "testing/rotary.py"]
    keep, drop = bundle.kernel_trim_plan(rels)
    assert keep == ["__init__.py", "py.typed", "sm90/common_ops.abi3.so", "testing/rotary.py"]
    assert drop == ["flash_ops.abi3.so", "flashmla_ops.abi3.so", "sm100/common_ops.abi3.so", "spatial_ops.abi3.so"]
    with pytest.raises(RefusedError):
        bundle.kernel_trim_plan(["__init__.py", "sm100/common_ops.abi3.so"])


def test_pieces():
    assert bundle.piece_names(10) == ["bundle.tar.xz"]
    assert bundle.piece_names(bundle.PIECE_BYTES) == ["bundle.tar.xz"]
    assert bundle.piece_names(bundle.PIECE_BYTES * 2 + 1) == ["bundle.tar.xz.000", "bundle.tar.xz.001",
                                                              "bundle.tar.xz.002"]


def _wheel(d: Path, dist: str, version: str, files: dict, tag: str = "py3-none-any") -> Path:
    """A small valid wheel (METADATA, WHEEL, RECORD with hashes)."""
    info = "%s-%s.dist-info" % (dist.replace("-", "_"), version)
    files = dict(files)
    files[info + "/METADATA"] = b"Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (dist.encode(), version.encode())
    files[info + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: %s\n" % tag.encode()
    record = []
    for name, data in files.items():
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (name, h, len(data)))
    record.append(info + "/RECORD,,")
    files[info + "/RECORD"] = ("\n".join(record) + "\n").encode()
    path = d / ("%s-%s-%s.whl" % (dist.replace("-", "_"), version, tag))
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def small_wheels(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    _wheel(d, "sglang", "0.5.17", {"sglang/__init__.py": b"__version__ = '0.5.17'\n"})
    _wheel(d, "sglang-kernel", "0.4.5", {
        "sgl_kernel/__init__.py": b"",
        "sgl_kernel/flash_ops.abi3.so": os.urandom(4096),
        "sgl_kernel/sm90/common_ops.abi3.so": os.urandom(2048),
        "sgl_kernel/sm100/common_ops.abi3.so": os.urandom(2048),
    })
    _wheel(d, "decorator", "5.3.1", {"decorator.py": b"x = 1\n"})
    pins = tmp_path / "pins.txt"
    pins.write_text("sglang==0.5.17\nsglang-kernel==0.4.5\ndecorator==5.3.1\n")
    return d, pins


def test_offline_build_unpacks_to_a_trimmed_site(tmp_path, small_wheels):
    wheels, pins = small_wheels
    out = tmp_path / "repo" / ".gpu-bundle"
    r = run_tool("gpu_bundle", "--out", out, "--pins", pins, "--wheel-cache", wheels)
    assert r.returncode == 0, r.stderr
    assert "trimmed sgl_kernel: dropped 2 files" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "bundle.tar.xz", "manifest.json", "unpack.sh"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["packages"]["sglang"]["version"] == "0.5.17"
    assert m["trimmed"]["dropped"] == ["flash_ops.abi3.so", "sm100/common_ops.abi3.so"]
    site = tmp_path / "site"
    u = subprocess.run(["sh", str(out / "unpack.sh"), str(site)], capture_output=True, text=True)
    assert u.returncode == 0, u.stderr
    assert (site / "sgl_kernel" / "sm90" / "common_ops.abi3.so").is_file()
    assert not (site / "sgl_kernel" / "flash_ops.abi3.so").exists()
    assert (site / "sglang" / "__init__.py").read_text() == "__version__ = '0.5.17'\n"
    first = (out / "bundle.tar.xz").read_bytes()
    r = run_tool("gpu_bundle", "--out", out, "--pins", pins, "--wheel-cache", wheels)  # rebuild: same bytes
    assert r.returncode == 0 and (out / "bundle.tar.xz").read_bytes() == first
    (out / "bundle.tar.xz").write_bytes(first[:-10])  # damaged: unpack refuses with one line
    u = subprocess.run(["sh", str(out / "unpack.sh"), str(tmp_path / "site2")], capture_output=True, text=True)
    assert u.returncode == 2 and "error: the bundle" in u.stderr and not (tmp_path / "site2").exists()


def test_refusals_leave_the_previous_bundle(tmp_path, small_wheels):
    wheels, pins = small_wheels
    out = tmp_path / ".gpu-bundle"
    assert run_tool("gpu_bundle", "--out", out, "--pins", pins, "--wheel-cache", wheels).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # a pin with no wheel anywhere (pip may not reach an index: PIP_NO_INDEX)
    bad = tmp_path / "bad.txt"
    bad.write_text(pins.read_text() + "no-such-package-eaglepatch==9.9.9\n")
    r = run_tool("gpu_bundle", "--out", out, "--pins", bad, "--wheel-cache", wheels,
                 env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    assert r.returncode == 1 and "pip download of 1 wheels failed" in one_line_error(r)
    assert "Traceback" not in r.stderr
    # too large for --max-mib
    r = run_tool("gpu_bundle", "--out", out, "--pins", pins, "--wheel-cache", wheels, "--max-mib", "0.000001")
    assert r.returncode == 1 and "over --max-mib" in one_line_error(r)
    # another build holds the lock
    with open(tmp_path / ".gpu-bundle.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        r = run_tool("gpu_bundle", "--out", out, "--pins", pins, "--wheel-cache", wheels)
    assert r.returncode == 1 and "another gpu_bundle.py" in one_line_error(r)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".gpu-bundle.tmp")) == []
    r = run_tool("gpu_bundle", "--out", out, "--max-mib", "0")
    assert r.returncode == 2 and "--max-mib" in one_line_error(r)
    r = run_tool("gpu_bundle", "--out", out, "--pins", tmp_path / "missing.txt")
    assert r.returncode == 2 and "does not exist" in one_line_error(r)


def test_gitignore_keeps_the_bundle_out_of_git():
    assert "/.gpu-bundle/" in (REPO / ".gitignore").read_text().splitlines()
