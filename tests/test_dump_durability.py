"""The dump's writer when the stop or the disk is not polite, and what keeps a file at a request's
name: the overlay's real DumpWriter on CPU tensors, real signals to a real process group, a real
slow or hung filesystem (FUSE, tests/slowfs.py), a real FIFO.

The same paths inside a real SGLang server and Engine: tests/test_dump_stops.py."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import slowfs  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402

pkg = import_package("e3c_durable")
settings = sys.modules["e3c_durable.settings"]
dump_mod = __import__("e3c_durable.dump", fromlist=["DumpWriter"])
identity = sys.modules["e3c_durable.identity"]
control = __import__("e3c_durable.control", fromlist=["ControlServer"])


class _Mode:
    def __init__(self, name):
        self.name = name


class _Batch:
    """What the writer reads of a prefill ForwardBatch: ids, lengths, and the requests
    ``identity`` attaches to it."""

    def __init__(self, ids, lens, infos):
        self.forward_mode = _Mode("EXTEND")
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = [0] * len(lens)
        self._eagle3_requests = list(infos)


def _forward(writer, infos, hidden=8, rows_seed=0):
    """Submit one prefill forward of ``infos`` (each its prompt_len rows) to ``writer``: the same
    ids for the same lengths, rows drawn from ``rows_seed``."""
    lens = [i.prompt_len for i in infos]
    ids = torch.randint(2, 1000, (sum(lens),), generator=torch.Generator().manual_seed(0))
    rows = torch.randn(sum(lens), hidden, generator=torch.Generator().manual_seed(rows_seed))
    writer.submit(_Batch(ids, lens, infos), {2: rows}, None)
    return ids, rows


def _files(d: Path) -> list:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".safetensors"))


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


BASE = {"format": "eagle3-dump/1", "model_path": "/m/a", "eagle3_layer_ids": "[1]", "final": "none",
        "dtype": "float32", "architecture": "DeepseekV3ForCausalLM"}


# ---- what keeps a file ----------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["launch", "model", "adapter", "image", "input_embeds", "layers"])
def test_a_request_id_again_as_another_request_replaces_its_file(tmp_path, change):
    """The same request id with the same prompt ids, after a restart (another launch id: another
    checkpoint, other layers) or with another adapter, image or input embeddings, is another
    request: its file is replaced, never kept. The control: the same request of the same launch
    (a retraction, a client's retry) keeps the file and writes nothing."""
    first = dict(BASE, launch_id="L1")
    req = identity.RequestInfo("rid-1", 5)
    w = dump_mod.DumpWriter(str(tmp_path), [2], False, 1 << 20, first)
    ids, rows = _forward(w, [req])
    w.flush()
    path = tmp_path / (req.key + ".safetensors")
    before = path.stat().st_ino
    _forward(w, [req])  # the same request again, same launch: kept
    w.flush()
    assert (w.written, w.reprefilled) == (1, 1) and path.stat().st_ino == before
    w.close()

    second, again = dict(first), req
    if change == "launch":
        second["launch_id"] = "L2"
    elif change == "model":
        second["model_path"] = "/m/b"
    elif change == "layers":
        second["eagle3_layer_ids"] = "[0]"
    elif change == "adapter":
        again = identity.RequestInfo("rid-1", 5, lora_id="x")
    elif change == "image":
        again = identity.RequestInfo("rid-1", 5, mm_hashes=(7,))
    else:
        again = identity.RequestInfo("rid-1", 5, input_embeds=True)
    w2 = dump_mod.DumpWriter(str(tmp_path), [2], False, 1 << 20, second)
    _forward(w2, [again], rows_seed=1)  # the same prompt ids, other rows
    w2.flush()
    assert (w2.written, w2.reprefilled) == (1, 0), change
    from safetensors.torch import load_file

    assert not torch.equal(load_file(str(path))["layer.1"], rows)  # the new request's rows
    meta = _meta(path)
    assert meta["launch_id"] == second["launch_id"] and meta["model_path"] == second["model_path"]
    w2.close()


def test_a_fifo_at_a_file_name_never_blocks_the_writer(tmp_path):
    """Anyone who can write the dump directory can plant a FIFO at a request's file name; the
    writer must not open it (today's check opened it and hung): the request is written over it."""
    req, other = identity.RequestInfo("fifo-rid", 4), identity.RequestInfo("next", 3)
    os.mkfifo(tmp_path / (req.key + ".safetensors"))
    w = dump_mod.DumpWriter(str(tmp_path), [2], False, 1 << 20, dict(BASE, launch_id="L"))
    _forward(w, [req, other])
    report = w.flush_report(10.0)
    assert report["flushed"] and report["written"] == 2, report
    assert _files(tmp_path) == sorted([req.key + ".safetensors", other.key + ".safetensors"])
    assert (tmp_path / (req.key + ".safetensors")).is_file()
    w.close()


def test_a_lone_surrogate_request_id_costs_no_other_request_its_file(tmp_path):
    """A request id UTF-8 cannot hold (a lone surrogate, which a JSON client can send) is keyed by
    its surrogatepass bytes and stored escaped; it and the requests batched with it are written."""
    odd = "bad-\udc80-rid"
    infos = [identity.RequestInfo("a", 3), identity.RequestInfo(odd, 4), identity.RequestInfo("b", 2)]
    w = dump_mod.DumpWriter(str(tmp_path), [2], False, 1 << 20, dict(BASE, launch_id="L"))
    _forward(w, infos)
    assert w.flush_report(10.0)["written"] == 3
    assert _files(tmp_path) == sorted(i.key + ".safetensors" for i in infos)
    import hashlib

    assert identity.request_key(odd) == hashlib.sha256(odd.encode("utf-8", "surrogatepass")).hexdigest()
    assert _meta(tmp_path / (identity.request_key(odd) + ".safetensors"))["rid"] == "bad-\\udc80-rid"
    w.close()


# ---- settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("var", ["EAGLE3_DUMP_MAX_PENDING_MB", "EAGLE3_DUMP_DRAIN_S", "EAGLE3_DUMP_MAX_WAIT_S"])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0", "-1", "x"])
def test_sizes_and_times_must_be_positive_and_finite(var, raw):
    with pytest.raises(settings.DumpConfigError, match=f"{var}=.*positive finite"):
        settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/tmp", var: raw})


def test_drain_and_wait_defaults_and_values():
    s = settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/tmp"})
    assert (s.drain_s, s.max_wait_s) == (settings.DEFAULT_DRAIN_S, settings.DEFAULT_MAX_WAIT_S)
    s = settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/tmp", "EAGLE3_DUMP_DRAIN_S": "2.5",
                                        "EAGLE3_DUMP_MAX_WAIT_S": "7"})
    assert (s.drain_s, s.max_wait_s) == (2.5, 7.0)


@pytest.mark.parametrize("bad", ["abc", float("nan"), float("inf"), -1, 0, True, [1], 1e12])
def test_flush_timeouts_are_checked(bad):
    with pytest.raises(ValueError, match="timeout"):
        control.flush_timeout(bad)
    assert control.flush_timeout(None) == control.DEFAULT_FLUSH_TIMEOUT and control.flush_timeout("2") == 2.0


# ---- a hung disk ------------------------------------------------------------------------------------

def test_a_forward_gives_up_waiting_on_a_hung_disk_and_its_requests_fail_loudly(tmp_path, caplog):
    """The dump disk hangs (FUSE: writes block): the writer is stuck on the first forward, the arena
    fills, and the next forward waits at most max_wait_s, then goes on without its rows (failed,
    logged with its request ids, named in the ledger at the stop) instead of holding the whole
    tensor-parallel group forever. Once the disk answers again, later requests are written."""
    gate = tmp_path / "hang"
    gate.write_text("held")
    with slowfs.mounted(tmp_path / "fs", hang_while=gate) as mnt:
        w = dump_mod.DumpWriter(str(mnt), [2], False, 4096, dict(BASE, launch_id="L"))  # a 4 KiB arena
        w.max_wait_s = 1.0
        first = [identity.RequestInfo("stuck-1", 40)]  # 40 x 8 float32 = 1.3 KiB of rows + ids
        _forward(w, first)
        time.sleep(0.3)  # the writer takes it and hangs in the write
        done = threading.Event()
        started = time.monotonic()

        def second():
            _forward(w, [identity.RequestInfo("late-1", 60), identity.RequestInfo("late-2", 60)])
            done.set()

        t = threading.Thread(target=second, daemon=True)
        t.start()
        assert done.wait(20), "the forward still waits for the hung disk"
        waited = time.monotonic() - started
        assert 0.9 <= waited < 10, waited
        assert w.failed == 2 and w.staging.timeouts == 1
        assert "late-1" in caplog.text and "keeps serving" in caplog.text
        assert set(w.unwritten) == {"late-1", "late-2"}
        gate.unlink()  # the disk answers again
        _forward(w, [identity.RequestInfo("after", 5)])
        assert w.flush_report(20.0)["flushed"]
        assert _files(mnt) == sorted(identity.request_key(r) + ".safetensors" for r in ("stuck-1", "after"))
        w.close()
        ledger = json.loads(Path(w.ledger_path).read_text())
        assert sorted(e["rid"] for e in ledger["requests"]) == ["late-1", "late-2"]


# ---- SIGTERM to the process group -------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, sys, time, signal
    sys.path.insert(0, {src!r})
    from eaglepatch.overlay import import_package
    import_package("e3c_child")
    dump_mod = __import__("e3c_child.dump", fromlist=["DumpWriter"])
    identity = sys.modules["e3c_child.identity"]
    import torch

    class M:
        name = "EXTEND"

    class B:
        def __init__(self, ids, lens, infos):
            self.forward_mode, self.input_ids = M(), ids
            self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu = list(lens), [0] * len(lens)
            self._eagle3_requests = infos

    w = dump_mod.DumpWriter({dump!r}, [2], False, 1 << 24, {{"launch_id": "L"}})
    w.install_sigterm_drain({drain})
    for k in range(6):
        infos = [identity.RequestInfo("req-%d" % k, 16)]
        w.submit(B(torch.arange(16), [16], infos), {{2: torch.randn(16, 8)}}, None)
    print("submitted", flush=True)
    # the main thread keeps running Python, as a scheduler's loop does: a signal the kernel hands to one
    # of the writer's threads only sets Python's flag, and one long sleep would run the handler 10 min later
    for _ in range(6000):
        time.sleep(0.1)
""")


def _signalled_child(tmp_path, dump: Path, drain: float):
    code = CHILD.format(src=str(REPO / "src"), dump=str(dump), drain=drain)
    err = tmp_path / "child.stderr"  # a file, not a pipe nobody reads until the end: a child that logs more
    # than a pipe holds would block on its own stderr and look like a drain that never ends
    with open(err, "w") as err_fh:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err_fh, text=True,
                                start_new_session=True)
    proc.stderr = open(err)  # the tests read it as they read the pipe
    try:
        line = proc.stdout.readline().strip()
        if line != "submitted":
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"the child said {line!r} before 'submitted': {proc.stderr.read()[-2000:]}")
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what systemd, Slurm, container runtimes and serve.py do
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # seen twice in whole-suite runs, never alone: say what was going on
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            fs_log = Path(dump).parent / "slowfs.log"
            raise AssertionError(
                f"the child did not end within 60 s of SIGTERM; its stderr: {proc.stderr.read()[-3000:]!r}; "
                f"files: {sorted(os.listdir(dump)) if os.path.isdir(dump) else None}; slowfs log: "
                f"{fs_log.read_text()[-2000:] if fs_log.is_file() else None!r}") from None
    except BaseException:  # never leave the child behind (it would sleep for 10 minutes)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, time.monotonic() - started


def test_sigterm_to_the_group_writes_every_queued_file_on_a_slow_disk(tmp_path):
    """Six requests queued on a disk whose fsyncs take 0.4 s (about 5 s of writing), then SIGTERM
    to the whole process group: the writing process drains its queue, then ends by the signal."""
    with slowfs.mounted(tmp_path / "fs", fsync_delay=0.4) as mnt:
        proc, took = _signalled_child(tmp_path, mnt, drain=60)
        assert proc.returncode == -signal.SIGTERM, proc.stderr.read()[-2000:]
        assert len(_files(mnt)) == 6, (_files(mnt), proc.stderr.read()[-2000:])
        assert not list(Path(mnt).glob("eagle3-dump-unwritten.*"))
        assert took > 2.0  # it did wait for the slow disk


def test_a_drain_cut_short_names_what_it_did_not_write(tmp_path):
    """The same with a 1 s drain: the process still ends within the bound, and a durable ledger in
    the dump directory names every request whose file is not there."""
    with slowfs.mounted(tmp_path / "fs", fsync_delay=0.4) as mnt:
        proc, took = _signalled_child(tmp_path, mnt, drain=1.0)
        assert proc.returncode == -signal.SIGTERM
        assert took < 20, took
        written = set(_files(mnt))
        assert len(written) < 6
        ledgers = list(Path(mnt).glob("eagle3-dump-unwritten.*.json"))
        assert len(ledgers) == 1, os.listdir(mnt)
        named = {e["key"] + ".safetensors" for e in json.loads(ledgers[0].read_text())["requests"]}
        everything = {identity.request_key("req-%d" % k) + ".safetensors" for k in range(6)}
        # every missing file is named; a file still being written when the drain gave up may land too
        assert everything - written <= named <= everything and len(named - (everything - written)) <= 1, (named, written)
        assert not math.isnan(took)


# ---- what an answer says of its file ---------------------------------------------------------------

def test_the_writer_tells_what_became_of_each_request_s_file(tmp_path, monkeypatch):
    """Over the real control socket (abstract, as a launch makes it): a probe and a request
    prefilled during the warm-up are not dumped, and say why; a user's request is queued, then
    written; the same request again is kept; an unknown id is unknown."""
    w = dump_mod.DumpWriter(str(tmp_path), [2], False, 1 << 20, dict(BASE, launch_id="L"))
    path = control.new_path()
    assert path.startswith("@")
    monkeypatch.setenv(control.ENV_TOKEN, "the launch's secret")
    server = control.ControlServer(w, path, "the launch's secret")
    try:
        w.paused = True
        _forward(w, [identity.RequestInfo("warm", 3)])
        w.paused = False
        _forward(w, [identity.RequestInfo("HEALTH_CHECK_1", 2), identity.RequestInfo("user", 4)])
        states = control.dump_states(["warm", "HEALTH_CHECK_1", "user", "nobody"], path)
        assert states["warm"].startswith("not dumped: prefilled during SGLang's warm-up")
        assert states["HEALTH_CHECK_1"] == "not dumped: an SGLang health probe"
        assert states["user"] in ("queued", "written") and states["nobody"] == "unknown"
        assert control.call("flush", 10, path)["flushed"]
        assert control.dump_states(["user"], path) == {"user": "written"}
        _forward(w, [identity.RequestInfo("HEALTH_CHECK_2", 2), identity.RequestInfo("user", 4)])  # the same prompt
        w.flush()
        assert control.dump_states(["user"], path) == {"user": "kept"}
    finally:
        server.close()
        w.close()
    assert control.dump_states(["user"], path)["user"].startswith("unknown: the dump writer did not answer")


@pytest.mark.parametrize("params, n", [(None, 1), ({}, 1), ({"n": 1}, 1), ({"n": 3}, 3), ([{"n": 1}, {"n": 2}], 2),
                                       ({"n": True}, 1), ({"n": "2"}, 1)])
def test_parallel_samples_of_a_request(params, n):
    assert control.parallel_samples(params) == n
