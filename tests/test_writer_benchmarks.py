"""benchmarks/writer_procs.py, commit_gil.py, views_gil.py and handovers_gil.py: the measurements behind
the dump's writers beside a busy scheduler thread (docs/benchmarks.md sections 15 to 18), run short on
CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_writer_procs_writes_the_same_files_both_ways_and_reports_each_configuration(tmp_path):
    out = tmp_path / "wp.json"
    d = tmp_path / "d"
    d.mkdir()
    r = _run("writer_procs.py", "--seconds", "0.3", "--reps", "2", "--tokens", "10,30", "--requests", "4",
             "--writers", "2", "--dir", str(d), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["same_files"] == [10, 30] and res["writers"] == 2 and res["reps"] == 2
    for block in res["tokens"].values():
        for c in ("threads busy", "processes busy", "threads alone", "processes alone"):
            assert len(block[c]["all"]) == 2 and block[c]["min"] > 0
        assert len(block["processes_over_threads_busy"]["all"]) == 2
    assert list(d.iterdir()) == []  # its files and its own directory are removed
    assert "processes / threads min" in r.stderr


def test_writer_procs_file_check_fails_when_a_process_writes_other_bytes(tmp_path, monkeypatch):
    """The check the benchmark makes before it times anything: a process given a wrong offset (two
    bytes off) writes files that differ from the threads', and the check says so."""
    sys.path.insert(0, str(BENCH))
    try:
        import writer_procs
    finally:
        sys.path.remove(str(BENCH))
    sh = writer_procs.Shared(3, 4)
    assert writer_procs.same_files(sh, tmp_path, 2)
    real = writer_procs.Shared.job

    def shifted(self, d, tag, i):
        path, tensors, meta = real(self, d, tag, i)
        name = "state.2"
        dt, shape, off, nb = tensors[name]
        return path, dict(tensors, **{name: (dt, shape, off + 2, nb)}), meta

    monkeypatch.setattr(writer_procs.Shared, "job", shifted)
    assert not writer_procs.same_files(sh, tmp_path, 2)
    assert list(tmp_path.iterdir()) == []


def test_commit_gil_times_both_overlays_through_the_real_writer(tmp_path):
    """Both overlays' writers beside a busy thread and alone; ``--switch-ms 1``: this tree's runs at a
    1 ms GIL switch interval (read back while they ran), the base's at Python's 5 ms."""
    out = tmp_path / "cg.json"
    d = tmp_path / "d"
    d.mkdir()
    r = _run("commit_gil.py", "--base", "HEAD", "--seconds", "0.3", "--reps", "1", "--tokens", "10",
             "--requests", "4", "--writers", "2", "--dir", str(d), "--switch-ms", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    block = res["tokens"]["10"]
    for c in ("base busy", "tree busy", "base alone", "tree alone"):
        assert block[c]["min"] > 0, block
    assert len(block["tree_over_base_busy"]["all"]) == 1
    assert block["switch_ms"] == {"base": [5.0], "tree": [1.0]} and res["tree_switch_ms"] == 1, block
    assert block["busy_loops_per_s"]["base"]["min"] > 0 and len(block["tree_over_base_busy_loops"]["all"]) == 1
    assert list(d.iterdir()) == []


def test_views_gil_times_each_way_alone_and_beside_a_busy_thread(tmp_path):
    out = tmp_path / "vg.json"
    r = _run("views_gil.py", "--reps", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["ms_for_6_tensors"]
    assert sorted(res) == sorted(f"{w} {c}" for w in ("tensor_split", "32 slices", "split") for c in ("alone", "busy"))
    assert all(v["min"] > 0 and len(v["all"]) == 1 for v in res.values())


def test_handovers_gil_counts_calls_and_both_overlays_files(tmp_path):
    """Every call of the table counted, both overlays' writers written through (no file failed), the
    files and the benchmark's own directory removed."""
    out = tmp_path / "hg.json"
    d = tmp_path / "d"
    d.mkdir()
    r = _run("handovers_gil.py", "--base", "HEAD", "--switch-ms", "2", "--files", "2", "--tokens", "5",
             "--reps", "1", "--dir", str(d), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"os.chmod", "HELD.chmod", "save_file of 100 rows", "torch t.narrow(0, 100, 100)"} <= set(res["calls"])
    assert all(v >= 0 for v in res["calls"].values()) and res["calls"]["save_file of 100 rows"] > 0
    assert set(res["intervals_per_file"]) == {"base", "tree"} and all(v > 0 for v in res["intervals_per_file"].values())
    assert list(d.iterdir()) == []
    assert "GIL handovers per file" in r.stderr


@pytest.mark.parametrize("script,args,words", [
    ("writer_procs.py", ["--tokens", "0"], "--tokens takes counts >= 1"),
    ("writer_procs.py", ["--dir", "/nonexistent-dir"], "not a directory"),
    ("commit_gil.py", ["--writers", "0"], "--writers"),
    ("commit_gil.py", ["--base", "no-such-revision"], "not a revision"),
    ("commit_gil.py", ["--base-overlay", "/nonexistent-dir"], "no sglang/"),
    ("commit_gil.py", ["--switch-ms", "0"], "--switch-ms 0: not above 0"),
    ("views_gil.py", ["--reps", "0"], "--reps must be >= 1"),
    ("handovers_gil.py", ["--switch-ms", "1"], "--switch-ms takes 2 to 100"),
    ("handovers_gil.py", ["--dir", "/nonexistent-dir"], "not a directory"),
    ("handovers_gil.py", ["--base", "no-such-revision"], "not a revision"),
])
def test_usage_errors_are_one_line_exit_2_and_write_nothing(tmp_path, script, args, words):
    out = tmp_path / "x.json"
    r = _run(script, *args, "--out", str(out), timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0] and "fix:" in lines[0], lines
    assert not out.exists()
