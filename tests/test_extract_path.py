"""The per-sample data path of tools/extract.py made faster for issue 45 (benchmarks/extract_path.py):
the finite check in one pass and torch.save without zip CRCs. Each change keeps what it must:

- ``dumps.all_finite`` says what ``torch.isfinite(t).all()`` says, for every float dtype a dump
  holds and any NaN or infinity anywhere (hypothesis), and a dump holding one is still refused;
- leaving the CRCs out loses no check: the installed torch's ``torch.load`` returns a changed byte
  inside a tensor without an error even when the file carries CRCs (if a torch ever checks them, this
  test fails and the choice must be made again), and a sample written without them loads equal;
- the benchmark's smoke runs extract's own functions both ways and finds the samples equal.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.extract import dumps, writers  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BAD = [float("nan"), float("inf"), float("-inf")]


@hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(0, 40), cols=st.integers(1, 70),
       bad=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True),
                              st.sampled_from(BAD)), max_size=3),
       big=st.booleans(), seed=st.integers(0, 2**16))
def test_all_finite_says_what_isfinite_all_says(dtype, rows, cols, bad, big, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g)
    if big:  # values near the dtype's largest finite one, of both signs: finite, and must pass
        t = t.sign() * torch.finfo(dtype).max
    t = t.to(dtype)
    for r, c, v in bad:
        if rows:
            t[int(r * rows), int(c * cols)] = v
    assert dumps.all_finite(t) == bool(torch.isfinite(t).all())


def test_all_finite_fails_on_each_kind_of_bad_value_in_each_dtype():
    for dtype in DTYPES:
        for v in BAD:
            for where in (0, 777, 4095):  # first, middle, last value
                t = torch.zeros(64, 64, dtype=dtype)
                t.view(-1)[where] = v
                assert not dumps.all_finite(t), (dtype, v, where)
        assert dumps.all_finite(torch.zeros(64, 64, dtype=dtype))


def _save(data: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


def _flip_inside(blob: bytes, name_part: str) -> bytes:
    """``blob`` with one byte of the stored record whose name contains ``name_part`` changed."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        info = next(i for i in z.infolist() if name_part in i.filename)
    # the local header: 30 bytes + name + extra, then the stored (uncompressed) data
    start = info.header_offset + 30 + int.from_bytes(blob[info.header_offset + 26:info.header_offset + 28], "little") \
        + int.from_bytes(blob[info.header_offset + 28:info.header_offset + 30], "little")
    out = bytearray(blob)
    out[start + 5] ^= 0x40
    return bytes(out)


def test_torch_load_never_checks_the_zip_crcs_so_leaving_them_out_loses_no_check():
    from torch.utils.serialization import config

    data = {"hidden_state": torch.arange(4096, dtype=torch.float32).reshape(1, 64, 64)}
    was = config.save.compute_crc32  # an extract run earlier in this process has switched them off
    try:
        config.save.compute_crc32 = True  # torch's default
        with_crc = _save(data)
    finally:
        config.save.compute_crc32 = was
    with zipfile.ZipFile(io.BytesIO(with_crc)) as z:
        assert z.testzip() is None  # torch's default writes CRCs, and they are right
    changed = _flip_inside(with_crc, "data/0")
    with zipfile.ZipFile(io.BytesIO(changed)) as z:
        assert z.testzip() is not None  # the CRC would catch it...
    loaded = torch.load(io.BytesIO(changed), weights_only=True)  # ...but torch.load does not look
    assert not torch.equal(loaded["hidden_state"], data["hidden_state"])

    with writers.no_zip_crcs():
        assert not config.save.compute_crc32
        without = _save(data)
    assert config.save.compute_crc32 == was  # left as it was found
    with zipfile.ZipFile(io.BytesIO(without)) as z:
        assert all(i.CRC == 0 for i in z.infolist() if "data/" in i.filename)
    assert torch.equal(torch.load(io.BytesIO(without), weights_only=True)["hidden_state"], data["hidden_state"])


def _dump_file(tmp_path, nan: bool):
    """(rid, ids, path) of a 6-token dump file, hidden 32, layers 0-2 and the final state; ``nan``:
    one NaN in layer.1."""
    from safetensors.torch import save_file

    rid = dumps.new_rid()
    key = dumps.rid_key(rid)
    ids = torch.arange(3, 9, dtype=torch.int64)
    states = {f"layer.{k}": torch.randn(6, 32).to(torch.bfloat16) for k in (0, 1, 2)}
    states["final"] = torch.randn(6, 32).to(torch.bfloat16)
    if nan:
        states["layer.1"][4, 31] = float("nan")
    meta = {"format": dumps.FORMAT, "key": key, "rid": rid, "prompt_key": dumps.prompt_key(ids.tolist()),
            "input_source": "input_ids", "eagle3_layer_ids": json.dumps([0, 1, 2]),
            "hf_hidden_state_indices": json.dumps([1, 2, 3]), "final": "post_norm", "hidden_size": "32",
            "num_hidden_layers": "4", "dtype": "bfloat16", "num_tokens": "6"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{key}.safetensors"
    save_file({"input_ids": ids, **states}, str(path), metadata=meta)
    return rid, ids, path


def test_a_dump_holding_one_nan_is_still_refused(tmp_path):
    rid, ids, path = _dump_file(tmp_path / "bad", nan=True)
    with pytest.raises(dumps.BadDump, match="layer.1 holds 1 non-finite values"):
        dumps.load_dump(path, ids.tolist(), hidden_size=32, rid=rid)
    rid, ids, path = _dump_file(tmp_path / "good", nan=False)
    assert dumps.load_dump(path, ids.tolist(), hidden_size=32, rid=rid).layers["layer.1"].shape == (6, 32)


def test_samples_written_on_worker_threads_carry_no_crcs_and_load_equal(tmp_path):
    """extract writes its samples on worker threads, and torch's CRC switch is per thread: a switch set
    once in the main thread left every worker's sample with CRCs (the first cut did that)."""
    import threading

    from torch.utils.serialization import config

    rid, ids, path = _dump_file(tmp_path, nan=False)
    dump = dumps.load_dump(path, ids.tolist(), hidden_size=32, rid=rid)
    layout = writers.resolve_layout("specforge", [0, 1, 2], True, 4)
    done = []
    t = threading.Thread(target=lambda: done.append(writers.write_sample(layout, tmp_path / "out", "s/x.ckpt", "x",
                                                                          dump, [1] * 6)))
    t.start()
    t.join()
    assert done and config.save.compute_crc32  # this thread's switch is left as it was
    sample = tmp_path / "out" / "s" / "x.ckpt"
    with zipfile.ZipFile(sample) as z:
        crcs = [i.CRC for i in z.infolist() if "/data/" in i.filename]
    assert len(crcs) == 4 and set(crcs) == {0}, crcs
    got = torch.load(sample, weights_only=True)
    assert torch.equal(got["hidden_state"][0], dump.final)
    assert torch.equal(got["aux_hidden_state"][0], torch.cat([dump.layers[f"layer.{k}"] for k in (0, 1, 2)], -1))


def test_the_benchmark_runs_both_ways_and_finds_the_samples_equal(tmp_path):
    out = tmp_path / "ep.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "extract_path.py"), "--quick", "--out", str(out),
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["samples_equal"] is True
    assert sorted(res["lengths"]) == ["128", "2048", "512"]
    for row in res["lengths"].values():
        for way in ("before", "now"):
            assert len(row["ways"][way]["read_validate_s"]) == 1 and row["ways"][way]["write_s"][0] > 0
        assert row["before_over_now"]["min"] > 0


def test_intra_op_threads_are_the_cores_over_the_workers_and_restored():
    """32 workers on 16 cores: one intra-op thread each (benchmarks/extract_threads.py measured torch's
    default 16 at 1.13-1.27x slower there); never more than torch had; restored on exit, error or not."""
    from eaglepatch.extract.run import intra_op_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(16)
        with intra_op_threads(32, cores=16) as n:
            assert n == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 16
        with intra_op_threads(4, cores=16) as n:
            assert n == 4 and torch.get_num_threads() == 4
        with intra_op_threads(1, cores=64) as n:  # never above what torch had
            assert n == 16 and torch.get_num_threads() == 16
        with pytest.raises(RuntimeError):
            with intra_op_threads(8, cores=16):
                raise RuntimeError("a worker's failure")
        assert torch.get_num_threads() == 16
    finally:
        torch.set_num_threads(before)


def test_the_threads_benchmark_runs_both_settings(tmp_path):
    out = tmp_path / "et.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "extract_threads.py"), "--quick", "--threads", "2",
                        "--out", str(out), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["intra_op_threads"]["one"] == 1 and res["samples"] == 12
    for name in ("default", "one"):
        (run,) = res["runs"][name]
        assert run["tokens_per_s"] > 0 and run["process_threads"] >= 1
    assert res["one_over_default"]["min"] > 0
    assert list(tmp_path.iterdir()) == [out]  # its dumps and samples are removed


def test_the_gil_benchmark_runs_every_setting_and_checks_the_samples(tmp_path):
    """benchmarks/extract_gil.py: the sample path alone, after pure-Python work in the same threads,
    with a shorter switch interval, and in worker processes; every pass's samples compared with the
    first pass's (a setting that wrote other bytes exits 1)."""
    out = tmp_path / "eg.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "extract_gil.py"), "--quick", "--threads", "2",
                        "--processes", "2", "--py-ms", "2", "--out", str(out), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["samples"] == 12 and res["samples_equal"] and res["worker_processes"] == 2
    assert sorted(res["runs"]) == ["alone", "processes", "python", "switch"]
    assert all(run["tokens_per_s"] > 0 for runs in res["runs"].values() for run in runs)
    assert set(res["ratios"]) == {"python_over_alone", "switch_over_python", "processes_over_python"}
    assert list(tmp_path.iterdir()) == [out]  # its dumps and samples are removed
