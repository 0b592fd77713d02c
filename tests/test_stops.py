"""Stops as production makes them, on the overlay's real DumpWriter (``stops``): a real SIGTERM to a
real process group while the writing process's main thread holds one of the writer's locks or sits
in a C call that never returns (a collective whose peers the same signal killed), a real slow or hung
disk (FUSE, tests/slowfs.py), and the ledger each launch leaves. Every test here failed on the code
before ``stops`` (see each docstring); the same stops inside real SGLang servers are in
tests/test_dump_stops.py.

The verdict of each stop is the same: the process ends within ``EAGLE3_DUMP_DRAIN_S`` and a margin,
and every request handed to the writer is either a file in the directory or named in this launch's
ledger (a name marked ``pending`` may have landed after it was recorded: the file decides)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import childkit  # noqa: E402
import slowfs  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402

import_package("e3c_stops")
settings = sys.modules["e3c_stops.settings"]
dump_mod = __import__("e3c_stops.dump", fromlist=["DumpWriter"])
identity = sys.modules["e3c_stops.identity"]
control = __import__("e3c_stops.control", fromlist=["ControlServer"])
stops = sys.modules["e3c_stops.stops"]

MARGIN_S = 15.0  # process start-up and exit on a loaded 2-core machine


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, ids, lens, infos, prefix=None):
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = list(prefix) if prefix else [0] * len(lens)
        self._eagle3_requests = list(infos)


def _forward(writer, rids, rows=16):
    infos = [identity.RequestInfo(r, rows) for r in rids]
    n = rows * len(rids)
    writer.submit(_Batch(torch.arange(n), [rows] * len(rids), infos), {2: torch.randn(n, 8)}, None)


def _key(rid: str) -> str:
    return identity.request_key(rid)


def _ledgers(d: Path) -> list:
    return sorted(Path(d).glob("eagle3-dump-unwritten.*.json"))


def _accounted(d: Path, rids, log: str = "") -> dict:
    """Every request is a file or named (in a ledger file, or, when the ledger could not be made
    durable, in the log line that says so); what each is."""
    files = {p.name[: -len(".safetensors")] for p in Path(d).glob("*.safetensors")}
    named = {}
    for ledger in _ledgers(d):
        for e in json.loads(ledger.read_text())["requests"]:
            named[e["key"]] = e
    out = {}
    for rid in rids:
        k = _key(rid)
        if k in named and k in files:
            assert named[k].get("pending"), f"{rid} is written and named as failed: {named[k]}"
            out[rid] = "written"
        elif k in files:
            out[rid] = "written"
        elif k in named:
            out[rid] = "named"
        elif k in log:
            out[rid] = "named in the log"
        else:
            raise AssertionError(f"{rid} is neither written nor named: files {len(files)}, ledgers "
                                 f"{[p.name for p in _ledgers(d)]}, log {log[-2000:]!r}")
    return out


# ---- a child process: the writer as a scheduler runs it -----------------------------------------------

CHILD = """
    import collections, ctypes

    MODE = {mode!r}
    w = dump_mod.DumpWriter({dump!r}, [2], False, 1 << 24, {{"launch_id": {launch!r}}}, chunked=True)
    w.install_sigterm_drain({drain})

    for k in range({queued}):
        forward(w, ["req-%d" % k], n=16)

    if MODE == "rank":  # a second rank of the group: SIGTERM's default action ends it at once
        if os.fork() == 0:  # a rank of its own: none of the writer's handling of SIGTERM
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            print("rank1 %d" % os.getpid(), flush=True)
            while True:
                time.sleep(1)

    if MODE == "queue-lock":  # the signal lands while the main thread holds the queue's mutex
        q = w._queue
        inner = q._put
        def _put(item):
            inner(item)
            if getattr(item, "spans", None) and item.spans[0].req.rid == "in-lock":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # still inside Queue.put: the C handler and Python's have run by now
        q._put = _put
    elif MODE == "states-lock":  # ... while it holds the writer's states lock (a chunked request pending)
        forward(w, ["chunked"], n=8, total=16)  # its first chunk: the writer holds it, waiting for the rest
        class Hooked(collections.OrderedDict):
            armed = True
            def move_to_end(self, *a, **k):
                super().move_to_end(*a, **k)
                if Hooked.armed and a and a[0] == "in-lock":
                    Hooked.armed = False
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.5)
        w._states = Hooked(w._states)

    if MODE in ("rank", "c-call"):
        # the main thread sits in a C call that never returns and never runs Python's signal
        # handler (as a rank in an NCCL collective whose peers are gone): a mutex locked twice.
        # 'submitted' is said once it is inside that call.
        main_tid = threading.get_native_id()
        def say_when_blocked():
            wchan = "/proc/self/task/%d/wchan" % main_tid
            while "futex" not in open(wchan).read():
                time.sleep(0.01)
            time.sleep(0.2)
            print("submitted", flush=True)
        threading.Thread(target=say_when_blocked, daemon=True).start()
    else:
        print("submitted", flush=True)
    if MODE in ("queue-lock", "states-lock"):
        forward(w, ["in-lock"], n=16)
    if MODE in ("rank", "c-call"):
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER is all zeros (glibc)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    # the main thread keeps running Python, as a scheduler's loop does
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        time.sleep(0.05)
    print("no stop", flush=True)
"""


def _child(tmp_path, dump: Path, mode: str, drain: float, queued: int = 6, launch: str = "L1"):
    code = childkit.script(CHILD, dump=str(dump), mode=mode, drain=drain, queued=queued, launch=launch)
    err = tmp_path / f"child-{mode}.stderr"
    with open(err, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=fh, text=True,
                                start_new_session=True)
    return proc, err


def _threads(pid: int) -> str:
    """Each thread of a process and the kernel function it waits in (for a failure's message)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            out.append(f"{task.name}:{(task / 'comm').read_text().strip()}:{(task / 'wchan').read_text().strip()}")
    return " ".join(out)


def _wait_submitted(proc, err: Path, seconds: float = 120.0) -> None:
    """Read the child's lines until 'submitted' (a failure names what the child was doing)."""
    import select

    deadline = time.monotonic() + seconds
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise AssertionError(f"the child said nothing for {seconds:g} s (alive: {proc.poll() is None}; threads "
                                 f"{_threads(proc.pid)}): {err.read_text()[-3000:]}")
        line = proc.stdout.readline()
        assert line, f"the child ended early ({proc.wait()}): {err.read_text()[-3000:]}"
        if line.strip() == "submitted":
            return


def _stop_and_wait(proc, err: Path, drain: float, signal_group: bool = True) -> float:
    """Wait for 'submitted', SIGTERM the group (unless the child signals itself), wait for the end."""
    try:
        _wait_submitted(proc, err)
        started = time.monotonic()
        if signal_group:
            os.killpg(proc.pid, signal.SIGTERM)  # what systemd, Slurm and `kill -TERM -PGID` do
        try:
            proc.wait(timeout=drain + MARGIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the process did not end within {drain + MARGIN_S:g} s of SIGTERM; its "
                                 f"stderr: {err.read_text()[-3000:]}") from None
        return time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_main_thread_in_a_c_call_still_drains_on_a_group_sigterm(tmp_path):
    """TP > 1 as a group SIGTERM finds it: rank 1 dies at once, rank 0's main thread is in a C call
    that never returns (a collective whose peer is gone) and never runs Python's handler. Six
    requests queued on a disk whose fsyncs take 0.3 s: the watcher drains them all, and the process
    ends by SIGTERM. Before ``stops`` the handler waited for the main thread: nothing drained, no
    ledger, and the process never ended (SIGKILL needed)."""
    with slowfs.mounted(tmp_path / "fs", fsync_delay=0.3) as mnt:
        proc, err = _child(tmp_path, mnt, "rank", drain=60)
        took = _stop_and_wait(proc, err, 60)
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, err.read_text()[-2000:])
        rids = ["req-%d" % k for k in range(6)]
        assert set(_accounted(mnt, rids).values()) == {"written"}
        assert not _ledgers(mnt)  # everything written: no ledger
        assert took > 1.0  # it waited for the slow disk


def test_a_drain_cut_short_under_a_stuck_main_thread_names_the_rest(tmp_path):
    """The same with a 1 s drain: the process still ends by SIGTERM within the bound, and the
    launch's ledger names every request whose file is not there."""
    with slowfs.mounted(tmp_path / "fs", fsync_delay=0.4) as mnt:
        proc, err = _child(tmp_path, mnt, "c-call", drain=1.0)
        took = _stop_and_wait(proc, err, 1.0)
        assert proc.returncode == -signal.SIGTERM
        assert took < 1.0 + MARGIN_S
        got = _accounted(mnt, ["req-%d" % k for k in range(6)], err.read_text())
        assert "named" in got.values() or "named in the log" in got.values(), got


@pytest.mark.parametrize("mode", ["queue-lock", "states-lock"])
def test_a_sigterm_while_the_main_thread_holds_a_writer_lock(tmp_path, mode):
    """The SIGTERM lands while the main thread is inside the writer's queue put (its mutex held) or
    inside the states lock with a chunked request pending. Before ``stops`` the drain ran in the
    handler on that same thread and waited on the lock it held: SIGTERM was then ignored (the
    process hung; reproduced deterministically). Now the process ends by SIGTERM and every request
    is a file or named (the chunked one, whose last chunk never came, is named)."""
    with slowfs.mounted(tmp_path / "fs", fsync_delay=0.05) as mnt:
        proc, err = _child(tmp_path, mnt, mode, drain=20, queued=3)
        _stop_and_wait(proc, err, 20, signal_group=False)
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, err.read_text()[-2000:])
        got = _accounted(mnt, ["req-0", "req-1", "req-2", "in-lock"] + (["chunked"] if mode == "states-lock" else []))
        assert got["req-0"] == got["req-1"] == got["req-2"] == "written", got
        if mode == "states-lock":
            assert got["chunked"] == "named"  # its next chunk never came: not written, and named


def _wait_for_line(err: Path, text: str, seconds: float) -> float:
    """Seconds until ``text`` appears in the file ``err``; AssertionError past ``seconds``."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if text in err.read_text():
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"{text!r} did not appear within {seconds:g} s: {err.read_text()[-3000:]}")


def test_a_hung_disk_never_holds_a_stop_past_its_bound(tmp_path):
    """The dump disk hangs (writes and fsyncs block): the drain gives up at its bound, the ledger
    cannot be written there either, so its names go to the log, and the process is ended by
    SIGTERM; its last threads, inside the hung disk's calls, go once the disk answers (no process
    can leave a call a hung disk holds, SIGKILL included). Before ``stops`` the first ledger write
    blocked the handler before the bounded wait began: no names, no end."""
    gate = tmp_path / "hang"
    with slowfs.mounted(tmp_path / "fs", hang_while=gate) as mnt:
        gate.write_text("held")
        proc, err = _child(tmp_path, mnt, "python", drain=2.0, queued=3)
        try:
            _wait_submitted(proc, err)
            os.killpg(proc.pid, signal.SIGTERM)
            _wait_for_line(err, "drained in", 2.0 + MARGIN_S)
            log = err.read_text()
            assert "was not durable within the drain" in log, log[-2000:]
            for k in range(3):
                assert _key("req-%d" % k) in log
        finally:
            gate.unlink()  # the disk answers: the threads inside its calls return, the process ends
            try:
                proc.wait(timeout=30)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == -signal.SIGTERM


EXIT_CHILD = """
    w = dump_mod.DumpWriter({dump!r}, [2], False, 1 << 20, {{"launch_id": "L"}})
    w.install_sigterm_drain(2.0)
    for k in range(2):
        forward(w, ["req-%d" % k])
    print("submitted", flush=True)
    sys.exit(0)  # atexit: DumpWriter.close()
"""


def test_a_normal_exit_on_a_hung_disk_ends_within_the_drain(tmp_path):
    """``close()`` at exit (the scheduler ending normally, an Engine script) is a stop too: on a
    hung disk its drain ends within EAGLE3_DUMP_DRAIN_S and names what it could not write in the
    log. Before, it flushed without a bound and never named anything."""
    gate = tmp_path / "hang"
    err = tmp_path / "exit.stderr"
    with slowfs.mounted(tmp_path / "fs", hang_while=gate) as mnt:
        gate.write_text("held")
        code = childkit.script(EXIT_CHILD, dump=str(mnt))
        with open(err, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=fh, text=True,
                                    start_new_session=True)
        try:
            _wait_submitted(proc, err)
            _wait_for_line(err, "drained in", 2.0 + MARGIN_S)
            log = err.read_text()
            assert _key("req-0") in log and _key("req-1") in log, log[-2000:]
        finally:
            gate.unlink()
            try:
                proc.wait(timeout=30)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        # it ended once the disk answered (a thread still inside a hung disk's call when Python
        # finalizes may end the process by an abort as that call returns: the names are logged by then)
        assert proc.returncode is not None


# ---- the ledger ---------------------------------------------------------------------------------------

def _writer(d, launch="L", **kw):
    return dump_mod.DumpWriter(str(d), [2], False, 1 << 22, {"launch_id": launch}, **kw)


def test_a_launch_never_touches_another_launch_s_ledger(tmp_path):
    """A restarted container has the same host name and, often, the same pids: an earlier launch's
    unread ledger must survive a later launch's clean stop and its own ledger. Before, ledgers were
    named by host and pid only, and the clean stop removed the earlier one."""
    earlier = _writer(tmp_path, launch="0123456789abcdef0123456789abcdef")
    old_path = Path(earlier.ledger_path)
    old_body = {"format": "eagle3-dump-unwritten/2", "launch_id": "0123456789abcdef0123456789abcdef",
                "requests": [{"rid": "lost-1", "key": _key("lost-1"), "why": "not written"}]}
    earlier.close()
    old_path.write_text(json.dumps(old_body))
    later = _writer(tmp_path, launch="fedcba9876543210fedcba9876543210")
    assert later.ledger_path != str(old_path)
    assert later.drain(2.0, "SIGTERM")  # nothing pending: a clean stop
    assert json.loads(old_path.read_text()) == old_body
    later2 = _writer(tmp_path, launch="fedcba9876543210fedcba9876543211")
    later2._not_written(identity.RequestInfo("new-1", 4), "a test failure")
    later2.drain(2.0, "SIGTERM")
    assert json.loads(old_path.read_text()) == old_body
    names = {p.name: [e["rid"] for e in json.loads(p.read_text())["requests"]] for p in _ledgers(tmp_path)}
    assert sorted(names.values()) == [["lost-1"], ["new-1"]], names
    later.close()
    later2.close()


def test_the_final_ledger_names_every_request_the_drain_left(tmp_path):
    """The drain gives up while a writer thread is in a slow write, and that write finishes just as
    the drain gives up (forced): commits queued behind it are skipped. Before, skipped commits left
    the pool's pending list without being named, so the final ledger (which replaced the first)
    lost them: 19 of 20 in 2 of 3 forced runs. Now the ledger is kept from what was handed over,
    not from a snapshot of the queues."""
    w = _writer(tmp_path, chunked=True, writers=1)
    gate = threading.Event()
    real = w.sink.commit

    def slow_commit(key, tensors, metadata):
        out = real(key, tensors, metadata)
        gate.wait(30)
        return out

    w.sink.commit = slow_commit
    rids = ["req-%d" % i for i in range(20)]
    _forward(w, rids, rows=4)
    many = ["chunked-%d" % i for i in range(3000)]  # long prompts still in chunked prefill at the stop
    w.submit(_Batch(torch.arange(3000), [1] * 3000, [identity.RequestInfo(r, 2) for r in many]),
             {2: torch.randn(3000, 4)}, None)
    time.sleep(1.0)

    def disk():  # the write in progress completes the moment the drain gives up
        while not w._stopping:
            time.sleep(0)
        gate.set()

    threading.Thread(target=disk, daemon=True).start()
    assert not w.drain(0.5, "SIGTERM")
    time.sleep(1.0)
    got = _accounted(tmp_path, rids + many[:50])
    assert list(got.values()).count("written") <= 2, got  # the one at the disk (and none after it)
    assert all(got[r] == "named" for r in many[:50])
    w.close()


def test_a_request_written_on_a_retry_is_no_longer_named(tmp_path):
    """A write fails once (a full disk), the client sends the same request id again and it is
    written: the ledger at the stop must not name it. Before, it stayed named as unwritten."""
    w = _writer(tmp_path)
    real = w.sink.commit
    failures = [1]

    def commit(key, tensors, metadata):
        if failures:
            failures.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(key, tensors, metadata)

    w.sink.commit = commit
    _forward(w, ["req-A", "req-B"], rows=8)
    assert w.flush_report(20)["flushed"]
    assert w.state("req-A").startswith("failed: the write failed")
    _forward(w, ["req-A"], rows=8)  # the retry
    assert w.flush_report(20)["flushed"] and w.state("req-A") == "written"
    assert w.drain(2.0, "SIGTERM")
    assert not _ledgers(tmp_path), [p.read_text() for p in _ledgers(tmp_path)]
    w.close()


def test_after_a_stop_new_prefills_are_not_dumped_and_say_why(tmp_path):
    """The launcher's stop call (SIGTERM to PID 1) lets the server finish its requests: prefills
    after the stop are not dumped, their state says so, and nothing about them is promised."""
    w = _writer(tmp_path)
    _forward(w, ["before"])
    report = w.stopper.stop("SIGTERM to the launching process")
    assert report["stopped"] and report["flushed"] and report["unwritten"] == 0
    _forward(w, ["after"])
    assert w.state("after") == "not dumped: the server is stopping (SIGTERM to the launching process)"
    assert w.counts()["after_stop"] == 1
    again = w.stopper.stop("the server stopped")  # a later stop answers the first one's report
    assert again["again"] and again["written"] == 1
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [_key("before") + ".safetensors"]
    w.close()


# ---- settings a launch refuses before any weight loads ---------------------------------------------

@pytest.mark.parametrize("var, raw", [
    ("EAGLE3_DUMP_DRAIN_S", "1e10"), ("EAGLE3_DUMP_MAX_WAIT_S", "1e10"), ("EAGLE3_DUMP_DRAIN_S", "inf"),
    ("EAGLE3_DUMP_WRITERS", "\u00b2"), ("EAGLE3_DUMP_WRITERS", "\u0663"), ("EAGLE3_DUMP_MAX_PENDING_MB", "1e308"),
    ("EAGLE3_DUMP_MAX_PENDING_MB", "1e10"), ("EAGLE3_DUMP_LAYERS", "\u0663,4"), ("EAGLE3_DUMP_LAYERS", "1" * 400),
])
def test_out_of_range_settings_are_refused_with_one_line(tmp_path, var, raw):
    """Each of these passed the settings check before (then a raw traceback at launch, a crash after
    the weights loaded, or an OverflowError inside the SIGTERM handler that lost 7 of 8 queued
    files); now the settings refuse it with one line naming the variable."""
    env = {"EAGLE3_DUMP_DIR": str(tmp_path), var: raw}
    with pytest.raises(settings.DumpConfigError) as err:
        settings.DumpSettings.from_env(env)
    assert var in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("var", ["EAGLE3_DUMP_MOONCAKE_SEGMENT_MB", "EAGLE3_DUMP_MOONCAKE_BUFFER_MB",
                                 "EAGLE3_DUMP_MOONCAKE_TTL_S"])
def test_out_of_range_mooncake_settings_are_refused(tmp_path, var):
    env = {"EAGLE3_DUMP_DIR": str(tmp_path), "EAGLE3_DUMP_SINK": "mooncake",
           "EAGLE3_DUMP_MOONCAKE_MASTER": "127.0.0.1:50051", var: "1e308"}
    with pytest.raises(settings.DumpConfigError, match=var):
        settings.DumpSettings.from_env(env)


def test_any_setting_text_is_read_or_refused_with_one_line(tmp_path):
    """Property: whatever text a variable holds, reading the settings either succeeds or raises the
    one-line DumpConfigError a launch turns into its refusal (never another exception)."""
    from hypothesis import given, settings as hsettings, strategies as st

    names = [v for v in settings.DUMP_VARS if v not in ("EAGLE3_DUMP_DIR", "EAGLE3_DUMP_SINK")]

    @hsettings(max_examples=400, deadline=None, derandomize=True)
    @given(st.sampled_from(names), st.text(max_size=30), st.booleans())
    def check(var, raw, mooncake):
        env = {"EAGLE3_DUMP_DIR": str(tmp_path), var: raw}
        if mooncake:
            env.update(EAGLE3_DUMP_SINK="mooncake", EAGLE3_DUMP_MOONCAKE_MASTER="127.0.0.1:50051")
            env.setdefault(var, raw)
        try:
            got = settings.DumpSettings.from_env(env)
        except settings.DumpConfigError as exc:
            assert "\n" not in str(exc)
            return
        assert 0 < got.drain_s <= settings.MAX_SECONDS and 0 < got.max_wait_s <= settings.MAX_SECONDS
        assert 0 < got.max_pending_bytes <= settings.memory_mib() << 20
        assert got.gil_switch_ms is None or 0 < got.gil_switch_ms <= settings.MAX_GIL_SWITCH_MS

    check()


# ---- the control socket: the launch's secret, the resume after the warm-up ------------------------

def test_a_call_without_the_launch_s_secret_changes_nothing(tmp_path, monkeypatch):
    """The control socket is abstract: any process of the network namespace reaches it (every root
    of every container on a host network). Before, a root peer could pause the dump. Now a call
    without this launch's secret is refused and counted, and the dump is not paused."""
    w = _writer(tmp_path)
    path = control.new_path()
    server = control.ControlServer(w, path, "the-launch-secret")
    try:
        for token in (None, "", "another-launch"):
            monkeypatch.setenv(control.ENV_TOKEN, token or "x")
            with pytest.raises(control.FlushError, match="refused"):
                control.call("pause", 5, path, token=token or "x")
        assert not w.paused and server.refused == 3
        monkeypatch.setenv(control.ENV_TOKEN, "the-launch-secret")
        assert control.call("pause", 5, path)["paused"] and w.paused
    finally:
        server.close()
        w.close()


def test_a_resume_that_fails_is_tried_again_then_reported(tmp_path, monkeypatch, caplog):
    """After SGLang's warm-up the dump is resumed; a resume that fails (the writer busy past the
    socket's backlog, a slow start) is tried again, and one that never succeeds is reported at
    error level. Before, one failed call left the dump paused for the server's life, at warning."""
    w = _writer(tmp_path)
    w.paused = True
    path = control.new_path()
    monkeypatch.setenv(control.ENV_CONTROL, path)
    monkeypatch.setenv(control.ENV_TOKEN, "s")
    calls = []
    real = control.call

    server = control.ControlServer(w, path, "s")

    def flaky(op, *a, **k):  # the first two calls time out (a writer's process too busy to answer)
        calls.append(op)
        if len(calls) < 3:
            raise control.FlushError(f"the dump writer did not answer at {path} (timed out)")
        return real(op, *a, **k)

    monkeypatch.setattr(control, "call", flaky)
    assert control.resume_after_warmup(tries=6, first_wait=0.05)
    assert not w.paused and len(calls) == 3
    server.close()
    w.close()
    monkeypatch.setenv(control.ENV_CONTROL, control.new_path())  # nobody there, ever
    with caplog.at_level("ERROR"):
        assert not control.resume_after_warmup(tries=3, first_wait=0.01)
    assert "stays PAUSED" in caplog.text
