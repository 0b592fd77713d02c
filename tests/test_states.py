"""The launch's state table (overlay ``states``): an answer reads what became of its request's file
in its own process, without a round trip into the scheduler's, whose main loop never sleeps.
Real processes (the launching side creates the table, a writer process opens it by its /proc path),
a real DumpWriter and ControlServer; the same through a real server: tests/test_dump_stops.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

torch = pytest.importorskip("torch")

import childkit  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402

import_package("e3c_states")
dump_mod = __import__("e3c_states.dump", fromlist=["DumpWriter"])
control = __import__("e3c_states.control", fromlist=["ControlServer"])
states = __import__("e3c_states.states", fromlist=["StateTable"])
identity = sys.modules["e3c_states.identity"]


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, rids, rows=4):
        self.forward_mode = _Mode()
        self.input_ids = torch.arange(rows * len(rids))
        self.extend_seq_lens_cpu = [rows] * len(rids)
        self.extend_prefix_lens_cpu = [0] * len(rids)
        self._eagle3_requests = [identity.RequestInfo(r, rows) for r in rids]


WRITER = """
    w = dump_mod.DumpWriter({dump!r}, [2], False, 1 << 20, {{"launch_id": "L"}})
    w.start_control()
    w.paused = True
    forward(w, ["warm-a", "warm-b"], n=4)
    w.paused = False
    forward(w, ["user-a", "HEALTH_CHECK_x"], n=4)
    assert w.flush_report(30)["flushed"]
    print("published", flush=True)
    sys.stdin.read()  # stay until the parent has read
"""


def test_a_writer_in_another_process_publishes_every_state(tmp_path, monkeypatch):
    """The launching side creates the table and exports its path; a writer process opens it and
    publishes each request's state as it changes; the launching side reads them all from its own
    memory, and the control socket answers no status call for them."""
    table = states.StateTable.create()
    path, token = control.new_path(), "t"
    env = dict(os.environ, **{states.ENV_STATES: table.path, control.ENV_CONTROL: path, control.ENV_TOKEN: token})
    code = childkit.script(WRITER, dump=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published", proc.stderr.read()[-2000:]
        got = {r: table.get(identity.request_key(r)) for r in ("warm-a", "warm-b", "user-a", "HEALTH_CHECK_x", "nobody")}
        assert got["user-a"] == "written"
        assert got["warm-a"] == got["warm-b"] == "not dumped: prefilled during SGLang's warm-up (before the server was ready)"
        assert got["HEALTH_CHECK_x"] == "not dumped: an SGLang health probe"
        assert got["nobody"] is None
        monkeypatch.setenv(control.ENV_CONTROL, path)
        monkeypatch.setenv(control.ENV_TOKEN, token)
        monkeypatch.setitem(control._LAUNCH, "table", table)
        monkeypatch.setitem(control._LAUNCH, "sink", "file")
        st, handles = control.dump_handles(["user-a", "warm-a", "nobody"])
        assert st["user-a"] == "written" and st["nobody"] == "unknown"  # only "nobody" was asked for
        assert handles["user-a"] == {"sink": "file", "file": identity.request_key("user-a") + ".safetensors"}
        assert control.call("flush", 10)["status_calls"] == 1
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        table.close()


def test_a_reader_never_takes_a_torn_or_foreign_record():
    """Property: while a writer thread rewrites the records of many requests (sharing slots, long
    and cut texts among them), every read is either None or a text that was published for that
    very request; a cut text is never returned as a state."""
    table = states.StateTable.create()
    reader = states.StateTable.open(table.path)
    keys = [identity.request_key("r%d" % i) for i in range(64)]
    texts = {k: ["queued", "written", "failed: " + k[:12] + " " + "x" * (i % 7) * 40] for i, k in enumerate(keys)}
    stop = threading.Event()

    def write():
        n = 0
        while not stop.is_set():
            k = keys[n % len(keys)]
            table.put(k, texts[k][n % 3])
            n += 1

    t = threading.Thread(target=write)
    t.start()
    try:
        seen = 0
        for n in range(20000):
            k = keys[n % len(keys)]
            got = reader.get(k)
            if got is not None:
                seen += 1
                assert got in texts[k][:2] or (got == texts[k][2] and len(got.encode()) <= states.TEXT_MAX), (k, got)
        assert seen > 1000
    finally:
        stop.set()
        t.join()
        reader.close()
        table.close()


def test_slots_are_reused_oldest_first_and_a_long_state_is_asked_for():
    table = states.StateTable.create()
    try:
        long = "failed: " + "y" * 400
        table.put(identity.request_key("long"), long)
        assert table.get(identity.request_key("long")) is None  # cut: the writer gives it whole
        for i in range(3 * states.SLOTS):  # many more requests than slots: the oldest go
            table.put(identity.request_key("n%d" % i), "queued")
        assert table.get(identity.request_key("n%d" % (3 * states.SLOTS - 1))) == "queued"
        assert table.get(identity.request_key("n0")) is None
    finally:
        table.close()
