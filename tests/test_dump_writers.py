"""The dump's writer threads (issue 31, ``eagle3_capture.commits``): several files are committed at
once, each as durably as with one thread, the flush waits for every one of them, a request's own
files never race, a forward's host rows go back only once every file cut from them is written, and
a drain's ledger names the files still being written.

The real ``DumpWriter`` of the overlay on CPU tensors; the file sink's ``_fsync`` is wrapped (the real fsync still
runs) only to see how many commits overlap and to hold them at the disk for as long as a test needs."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from test_capture_package import _Batch, _idx, _states, dump_mod  # noqa: E402

commits = sys.modules[dump_mod.__name__.rsplit(".", 1)[0] + ".commits"]
sinks = sys.modules[dump_mod.__name__.rsplit(".", 1)[0] + ".sinks"]


class _Disk:
    """The real ``_fsync`` of the dump, watched: how many file fsyncs run at once, and a gate that
    holds every fsync of a file (not of the directory) until it is opened."""

    def __init__(self, monkeypatch, hold_s: float = 0.0):
        self.real = sinks._fsync
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.files = 0
        self.hold_s = hold_s
        self.gate = threading.Event()
        self.gate.set()
        monkeypatch.setattr(sinks, "_fsync", self)  # the file sink's

    def __call__(self, path):
        if os.path.isdir(path):
            return self.real(path)
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            self.gate.wait()
            time.sleep(self.hold_s)  # a disk that takes its time: commits can only overlap here
            self.real(path)
        finally:
            with self.lock:
                self.now -= 1
                self.files += 1


def _forwards(w, n_forwards: int, per: int, layers, seed0: int = 0):
    """``n_forwards`` prefills of ``per`` requests each; returns {rid: (ids, captured rows, final)}."""
    want = {}
    for f in range(n_forwards):
        lens = [3 + (f * per + i) % 7 for i in range(per)]
        ids, cap, fin = _states(lens, layers, seed=seed0 + f)
        rids = [f"f{f}-r{i}" for i in range(per)]
        w.submit(_Batch(ids, lens, rids=rids), cap, fin)
        start = 0
        for rid, n in zip(rids, lens):
            want[rid] = (ids[start:start + n], {k: cap[k + 1][start:start + n] for k in layers}, fin[start:start + n])
            start += n
    return want


def _check_files(directory: Path, want: dict, layers) -> None:
    from safetensors import safe_open

    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(dump_mod.request_key(r) + ".safetensors" for r in want), names
    for rid, (ids, cap, fin) in want.items():
        with safe_open(str(directory / (dump_mod.request_key(rid) + ".safetensors")), "pt") as f:
            assert f.get_tensor("input_ids").tolist() == ids.tolist(), rid
            for k in layers:
                assert torch.equal(f.get_tensor(f"layer.{k}"), cap[k]), (rid, k)
            assert torch.equal(f.get_tensor("final"), fin), rid


def test_several_writers_commit_at_once_and_every_file_is_whole(tmp_path, monkeypatch):
    layers = [-1, 1, 3]
    disk = _Disk(monkeypatch, hold_s=0.01)
    w = dump_mod.DumpWriter(str(tmp_path), _idx(layers), True, 1 << 22, {"format": "eagle3-dump/1"}, writers=4)
    want = _forwards(w, 12, 8, layers)
    report = w.flush_report(60)
    assert report["flushed"] and (report["written"], report["failed"]) == (96, 0), report
    assert disk.files == 96
    assert disk.most > 1, "no two files were committed at once"
    assert disk.most <= 4  # never more than the writer threads
    assert w.staging.in_use == 0  # every forward's rows went back once its files were written
    _check_files(tmp_path, want, layers)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    w.close()


def test_one_writer_commits_one_file_at_a_time(tmp_path, monkeypatch):
    """The watch above can tell: with one thread no two commits overlap."""
    disk = _Disk(monkeypatch, hold_s=0.005)
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 22, {}, writers=1)
    _forwards(w, 4, 6, [1])
    assert w.flush_report(60)["written"] == 24
    assert disk.files == 24 and disk.most == 1
    w.close()


def test_the_flush_waits_for_the_files_being_written(tmp_path, monkeypatch):
    """Rows handed to the writer threads but not yet durable are not flushed: the flush answers
    not flushed while the disk holds them, and flushed once they are committed."""
    disk = _Disk(monkeypatch)
    disk.gate.clear()
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 22, {}, writers=3)
    want = _forwards(w, 2, 5, [1])
    time.sleep(0.3)  # the gather is done: every request is with a writer thread, held at the disk
    report = w.flush_report(0.5)
    assert not report["flushed"] and report["written"] == 0, report
    assert "did not catch up" in report["error"]
    assert {r.rid for r in w.pending_requests()} == set(want)  # being committed: still pending
    assert w.staging.in_use > 0  # their rows are still in the arena
    disk.gate.set()
    report = w.flush_report(30)
    assert report["flushed"] and report["written"] == 10
    assert w.pending_requests() == [] and w.staging.in_use == 0
    w.close()


class _HeldKeys(_Disk):
    """The watch above, holding at the disk only the files whose key is in ``keys``."""

    def __init__(self, monkeypatch, keys):
        super().__init__(monkeypatch)
        self.keys = set(keys)
        self.key_gate = threading.Event()

        self.arrived = []  # the keys of the files that reached the disk, held or not

    def __call__(self, path):
        if not os.path.isdir(path):
            with self.lock:
                self.arrived.append(os.path.basename(path).split(".")[1])
        if any(f".{k}." in os.path.basename(path) for k in self.keys):
            self.key_gate.wait()
        return super().__call__(path)


def test_a_flush_holds_up_neither_the_forwards_after_it_nor_waits_for_them(tmp_path, monkeypatch):
    """A flush while files are at the disk: the forwards submitted after it are gathered and reach
    the disk while it waits (it used to stop the gathering thread until every writer was idle, so
    under a client that flushes often the dump and the forward behind it went in lock-step), and it
    answers once the files before it are written, although the later ones are still held."""
    before = [f"f0-r{i}" for i in range(3)]
    after = [f"f1-r{i}" for i in range(3)]
    disk = _HeldKeys(monkeypatch, [dump_mod.request_key(r) for r in after])
    disk.gate.clear()  # every file held at first
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 22, {}, writers=8)
    want = _forwards(w, 1, 3, [1])
    assert set(want) == set(before)
    answer = {}
    flusher = threading.Thread(target=lambda: answer.update(w.flush_report(60)))
    flusher.start()
    time.sleep(0.2)
    ids, cap, fin = _states([4, 5, 6], [1], seed=7)
    w.submit(_Batch(ids, [4, 5, 6], rids=after), cap, fin)
    later = {dump_mod.request_key(r) for r in after}
    deadline = time.monotonic() + 10
    while not later & set(disk.arrived) and time.monotonic() < deadline:
        time.sleep(0.02)
    # (a thread commits its keys in order, so a later file whose thread holds an earlier one waits
    # there; the rids here spread so that at least one has a thread of its own)
    assert later & set(disk.arrived), "no file of the forward after the flush reached the disk while it waited"
    assert flusher.is_alive() and not answer  # the files before it are still held
    disk.gate.set()  # the files before the flush go through; the later ones stay held
    flusher.join(30)
    assert not flusher.is_alive(), "the flush waited for the forwards submitted after it"
    assert answer["flushed"] and answer["written"] == 3, answer
    assert all(w.state(r) == "written" for r in before)
    assert all(w.state(r) == "queued" for r in after), [w.state(r) for r in after]
    disk.key_gate.set()
    assert w.flush_report(30)["written"] == 6
    w.close()


def test_a_request_prefilled_again_is_written_once_whatever_the_threads(tmp_path, monkeypatch):
    """A retracted request prefilled again while its first file is still at the disk: both go to
    the same writer thread, so the second sees the first and keeps it."""
    disk = _Disk(monkeypatch)
    disk.gate.clear()
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 22, {}, writers=4)
    ids, cap, fin = _states([6], [1])
    for _ in range(3):
        w.submit(_Batch(ids, [6], rids=["again"]), cap, fin)
    others = _forwards(w, 1, 6, [1], seed0=7)
    time.sleep(0.2)
    disk.gate.set()
    report = w.flush_report(30)
    assert (report["written"], report["reprefilled"], report["failed"]) == (7, 2, 0), report
    assert w.state("again") == "written"
    assert len(list(tmp_path.iterdir())) == 1 + len(others)
    w.close()


def test_a_drain_that_gives_up_names_the_files_still_at_the_disk(tmp_path, monkeypatch):
    import json

    disk = _Disk(monkeypatch)
    disk.gate.clear()
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 22, {"launch_id": "L"}, writers=2)
    want = _forwards(w, 3, 4, [1])
    time.sleep(0.3)
    assert not w.drain(0.3, "test stop")
    ledger = json.loads(Path(w.ledger_path).read_text())
    named = {e["rid"] for e in ledger["requests"]}
    assert named == set(want)  # every request: at most two are being written, the rest never start
    disk.gate.set()
    w.close()
    written = {p.stem for p in tmp_path.glob("*.safetensors")}
    assert len(written) <= 2  # only the commits already at the disk when the drain gave up landed
    assert written <= {dump_mod.request_key(r) for r in want}


def test_the_default_comes_from_the_cpus_this_process_may_use():
    n = commits.default_writers()
    assert n == max(1, min(commits.MAX_DEFAULT_WRITERS, len(os.sched_getaffinity(0))))
    with pytest.raises(ValueError):
        commits.CommitPool(0)


def test_the_sustained_benchmark_runs_and_leaves_no_file(tmp_path):
    """benchmarks/dump_sustained.py --smoke (CPU, tiny sizes): every configuration writes all of its
    files, the figures are there for each, nothing is left in its directory; bad settings: exit 2."""
    import json
    import subprocess

    bench = REPO / "benchmarks" / "dump_sustained.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    where = tmp_path / "disk"
    where.mkdir()
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(bench), "--smoke", "--writers", "1,3", "--out", str(out), "--dir", str(where)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert sorted(res["summary"]) == sorted(["off", "on-bf16-x1", "on-bf16-x3", "on-fp8-x1", "on-fp8-x3",
                                             "writer-bf16-x1", "writer-bf16-x3"])
    per = res["prefills_per_config"] * res["settings"]["requests"]
    for rep in res["reps"]:
        for run in rep["runs"]:
            if run["mode"] != "off":
                assert run["files"] == run["written"] == per and run["failed"] == 0, run
        assert rep["disk_GBps_1_stream"] > 0
    fp8 = [r["bytes_per_token"] for rep in res["reps"] for r in rep["runs"] if r.get("dtype") == "fp8"]
    bf16 = [r["bytes_per_token"] for rep in res["reps"] for r in rep["runs"] if r.get("dtype") == "bf16"]
    assert max(fp8) < 0.6 * min(bf16)  # float32 states on CPU: fp8 + scales is about a quarter
    assert list(where.iterdir()) == []
    p = subprocess.run([sys.executable, str(bench), "--smoke", "--writers", "0", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x.json").exists()
