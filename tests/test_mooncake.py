"""The Mooncake sink (issue 33): a real ``mooncake_master`` with its HTTP metadata server on
localhost, the overlay's real ``DumpWriter`` putting each request's states into the store, and
the readers: the project's ``eaglepatch.mooncake.StoreReader`` (the same ``Dump`` the request's
file gives) and hs-connectors' own ``MooncakeHiddenStatesStore.get_sample`` on the manifest the
answer carries. Faults: a master that cannot be reached refuses the settings; a store too small
for an object fails that request by name; a master killed mid-run fails the requests it could not
take, and nothing is reported written that is not readable.

The store's package is the CPU wheel installed beside the test environment
(``eaglepatch.mooncake.ensure_site``; Debian's libibverbs1 comes from eaglepatch.sysdeps)."""

import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from eaglepatch import mooncake  # noqa: E402
from test_capture_package import _Batch, _idx, _states, dump_mod  # noqa: E402

pkg = dump_mod.__name__.rsplit(".", 1)[0]
settings = sys.modules[pkg + ".settings"]
sinks = __import__(pkg + ".sinks", fromlist=["MooncakeSink"])
storage = sys.modules[pkg + ".storage"]

LAYERS = [-1, 1, 3]
META = {"format": "eagle3-dump/1", "launch_id": "L", "model_path": "m", "eagle3_layer_ids": "[-1, 1, 3]",
        "hf_hidden_state_indices": "[0, 2, 4]", "final": "post_norm", "hidden_size": "16", "num_hidden_layers": "4",
        "dtype": "float32", "architecture": "DeepseekV3ForCausalLM", "sglang_version": "0.5.9",
        "series_version": "test", "tp_size": "1", "configured_layer_ids": "[-1, 1, 3]",
        "layer_id_reading": "test", "replica_rank": "0"}


@pytest.fixture(scope="module")
def site():
    d = mooncake.ensure_site(Path(sys.executable))
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    return d


@pytest.fixture
def master(site, tmp_path):
    with mooncake.Master(site, tmp_path / "master.log") as m:
        yield m


def _writer(directory, master=None, writers=2, layout=None, segment_mb=None):
    env = master.env() if master is not None else {}
    if segment_mb is not None:
        env["EAGLE3_DUMP_MOONCAKE_SEGMENT_MB"] = str(segment_mb)
    sink = sinks.MooncakeSink(settings.MooncakeSettings.from_env(env)) if master is not None else None
    return dump_mod.DumpWriter(str(directory), _idx(LAYERS), True, 1 << 22, dict(META), writers=writers,
                               layout=layout, sink=sink)


def _submit(writers, n_forwards=3, per=4, seed=0):
    rids = []
    for f in range(n_forwards):
        lens = [4 + (f + i) % 5 for i in range(per)]
        ids, cap, fin = _states(lens, LAYERS, seed=seed + f)
        names = [f"s{seed}-f{f}-r{i}" for i in range(per)]
        for w in writers:
            w.submit(_Batch(ids, lens, rids=names), cap, fin)
        rids += names
    return rids


def _same(a, b) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_store_holds_what_the_file_holds_and_both_readers_read_it(master, tmp_path, dtype):
    from safetensors.torch import load_file

    layout = storage.Layout(storage.Storage(dtype, "store"), _idx(LAYERS), True, 4, "float32", 1e-6, 1000)
    (tmp_path / "f").mkdir()
    (tmp_path / "m").mkdir()
    wf, wm = _writer(tmp_path / "f", layout=layout), _writer(tmp_path / "m", master, layout=layout)
    rids = _submit([wf, wm])
    assert wf.flush_report(60)["written"] == wm.flush_report(60)["written"] == len(rids)
    assert list((tmp_path / "m").iterdir()) == []  # nothing on disk with the store as the sink
    reader = mooncake.StoreReader(master.address, master.metadata)
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    theirs = MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname="127.0.0.1", metadata_server=master.metadata, master_server_address=master.address,
        global_segment_size=0, local_buffer_size=64 << 20)).setup()
    for rid in rids:
        h = wm.handle(rid)
        assert h["sink"] == "mooncake" and h["key"] == dump_mod.request_key(rid) and wm.state(rid) == "written"
        man = h["manifest"]
        assert man["metadata"]["rid"] == rid and man["metadata"]["eagle3_layer_ids"] == "[-1, 1, 3]"
        file = load_file(str(tmp_path / "f" / (h["key"] + ".safetensors")))
        got, meta = reader.tensors(h)
        assert _same(got, file), rid
        assert _same(theirs.get_sample(man, timeout=5), file), rid  # hs-connectors' reader, unchanged
        assert reader.load(h).layers.keys() == {f"layer.{k}" for k in LAYERS}
    # a wrong input fails the comparison: another request's object
    assert not _same(reader.tensors(wm.handle(rids[1]))[0], load_file(str(tmp_path / "f" / (
        dump_mod.request_key(rids[0]) + ".safetensors"))))
    reader.delete(wm.handle(rids[0]))
    with pytest.raises(mooncake.StoreError, match="no object"):
        reader.tensors(wm.handle(rids[0]))
    wf.close()
    wm.close()


def test_the_same_request_again_is_kept(master, tmp_path):
    w = _writer(tmp_path, master)
    ids, cap, fin = _states([6], LAYERS)
    for _ in range(2):
        w.submit(_Batch(ids, [6], rids=["again"]), cap, fin)
    r = w.flush_report(30)
    assert (r["written"], r["reprefilled"], r["failed"]) == (1, 1, 0), r
    w.close()


def test_settings_refuse_what_cannot_work(site, tmp_path):
    def refused(env, needle):
        with pytest.raises(settings.DumpConfigError, match=needle):
            s = settings.DumpSettings.from_env(dict(env, EAGLE3_DUMP_DIR=str(tmp_path)))
            s.mooncake.check_reachable()

    refused({"EAGLE3_DUMP_SINK": "mooncake"}, "needs EAGLE3_DUMP_MOONCAKE_MASTER")
    refused({"EAGLE3_DUMP_SINK": "mooncake", "EAGLE3_DUMP_MOONCAKE_MASTER": "nohost"}, "is not host:port")
    refused({"EAGLE3_DUMP_SINK": "s3"}, "not one of file, mooncake")
    refused({"EAGLE3_DUMP_MOONCAKE_MASTER": "127.0.0.1:1"}, "set but EAGLE3_DUMP_SINK is 'file'")
    refused({"EAGLE3_DUMP_SINK": "mooncake", "EAGLE3_DUMP_MOONCAKE_MASTER": "127.0.0.1:1",
             "EAGLE3_DUMP_MOONCAKE_METADATA": "P2PHANDSHAKE"}, "MOONCAKE_MASTER='127.0.0.1:1' cannot be reached")
    with mooncake.Master(site, tmp_path / "m.log") as m:
        s = settings.DumpSettings.from_env(dict(m.env(), EAGLE3_DUMP_DIR=str(tmp_path)))
        s.mooncake.check_reachable()  # both ports answer
        assert (s.sink, s.mooncake.master, s.mooncake.segment_bytes) == ("mooncake", m.address, 256 << 20)


def test_a_store_too_small_fails_the_request_by_name(master, tmp_path):
    """A 16 MiB store and an object of ~31 MiB: the request fails, says why, and is in the ledger;
    it is not reported written. Small ones after it are written."""
    w = _writer(tmp_path, master, segment_mb=16)
    n = 30000
    ids, cap, _ = _states([n], LAYERS)
    cap = {k: torch.randn(n, 64) for k in cap}
    w.submit(_Batch(ids, [n], rids=["big"]), cap, torch.randn(n, 64))
    small = _submit([w], n_forwards=1, per=2, seed=5)
    r = w.flush_report(60)
    assert (r["written"], r["failed"]) == (len(small), 1), r
    assert w.state("big").startswith("failed: the write failed: the Mooncake store refused"), w.state("big")
    assert "big" in w.unwritten
    # readers never get data for it: ours raises (with the reason when the error marker landed; the
    # marker is best effort: a store that just refused an object was seen to lose it), hs-connectors'
    # get_sample raises too
    reader = mooncake.StoreReader(master.address, master.metadata)
    with pytest.raises(mooncake.StoreError, match="could not put .*the Mooncake store refused|no object"):
        reader.tensors(w.handle("big"), timeout=5)
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    theirs = MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname="127.0.0.1", metadata_server=master.metadata, master_server_address=master.address,
        global_segment_size=0, local_buffer_size=16 << 20)).setup()
    fake = {"version": 1, "handle": w.handle("big")["key"], "tensors": {}, "metadata": {"total_aligned_bytes": 0}}
    with pytest.raises(Exception):
        theirs.get_sample(fake, timeout=5)
    assert reader.tensors(w.handle(small[0]), timeout=30)[0]["input_ids"].numel() > 0
    w.close()


def test_a_master_killed_mid_run_fails_those_requests_and_reports_nothing_unreadable(site, tmp_path):
    m = mooncake.Master(site, tmp_path / "master.log").start()
    try:
        w = _writer(tmp_path, m)
        before = _submit([w], n_forwards=1, seed=1)
        assert w.flush_report(30)["written"] == len(before)
        m.stop(kill=True)
        during = _submit([w], n_forwards=1, seed=2)
        r = w.flush_report(120)
        assert r["flushed"] and r["written"] == len(before), r
        for rid in during:
            assert w.state(rid).startswith("failed: the write failed"), (rid, w.state(rid))
        w.close()
    finally:
        m.stop(kill=True)
    time.sleep(0.1)


# ---- through a real sglang.Engine (CPU, sglang 0.5.9 with the series) ----------------------------

ENGINE = """
import json, sys
sys.path.insert(0, {smoke!r})
from _common import CPU_SERVER_ARGS
import sglang

engine = sglang.Engine(**dict(CPU_SERVER_ARGS, model_path={ckpt!r}, log_level="error"))
for k in range({n}):
    out = engine.generate(input_ids=[3 + k, 5, 7, 11, 13, 17, 19, 23][: 5 + k % 4], sampling_params={{"max_new_tokens": 1}})
    print("ANSWER " + json.dumps(out["meta_info"]["eagle3_dump"] | {{"rid": out["meta_info"]["id"]}}), flush=True)
print("FLUSH " + json.dumps(engine.flush_eagle3_dump(timeout=120)), flush=True)
sys.stdin.readline()  # the objects live in this process's share of the store: read them first
engine.shutdown()
"""


@pytest.fixture(scope="module")
def engine_setup(site, tmp_path_factory):
    from eaglepatch import cpuenv
    from eaglepatch.fetch import unpacked_release
    from eaglepatch.series import available_series
    from eaglepatch.smoke import ensure_checkpoints, stubs_for
    from eaglepatch.smoke.tree import patched_tree

    req = cpuenv.requirements_for("0.5.9")
    py = cpuenv.ensure_env(req)
    work = tmp_path_factory.mktemp("mooncake-engine")
    stubs = stubs_for(req, work)
    ckpt = ensure_checkpoints(py, work, req, stubs)["deepseek_v3"]
    tree = patched_tree(unpacked_release("0.5.9", quiet=True), available_series()["0.5.9"], work / "tree")
    return py, tree, ckpt, stubs


class _Engine:
    """The engine script as a process: its answers and flush report, and the process held until
    ``done()`` (the store's objects live in its memory segment while it runs)."""

    def __init__(self, engine_setup, env_extra: dict, log: Path, n: int = 4):
        import json
        import subprocess

        from eaglepatch.smoke import HERE as SMOKE_DIR, worker_env

        py, tree, ckpt, stubs = engine_setup
        env = mooncake.with_site(worker_env(tree, stubs), mooncake.ensure_site(py))
        env.update(EAGLE3_DUMP_LAYERS="-1,1,3", **env_extra)
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen([str(py), "-c", ENGINE.format(smoke=str(SMOKE_DIR), ckpt=str(ckpt), n=n)],
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, text=True)
        self.answers, self.flush = [], None
        for line in self.proc.stdout:
            if line.startswith("ANSWER "):
                self.answers.append(json.loads(line.split(" ", 1)[1]))
            elif line.startswith("FLUSH "):
                self.flush = json.loads(line.split(" ", 1)[1])
                break

    def done(self) -> int:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
        except OSError:
            pass
        return self.proc.wait(timeout=300)

    @property
    def stderr(self) -> str:
        return self.log.read_text()[-3000:]


def test_an_engine_with_the_mooncake_sink_answers_with_handles_to_what_its_files_would_hold(engine_setup, master,
                                                                                             tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "f").mkdir()
    (tmp_path / "m").mkdir()
    e = _Engine(engine_setup, {"EAGLE3_DUMP_DIR": str(tmp_path / "f")}, tmp_path / "file.log")
    files = e.answers
    assert e.done() == 0 and len(files) == 4, e.stderr
    e = _Engine(engine_setup, dict(master.env(), EAGLE3_DUMP_DIR=str(tmp_path / "m")), tmp_path / "mooncake.log")
    objs, flush = e.answers, e.flush
    assert len(objs) == 4 and flush is not None, e.stderr
    assert flush["flushed"] and flush["written"] == 4, flush
    assert list((tmp_path / "m").glob("*.safetensors")) == []
    assert all(a["sink"] == "file" and a["file"] == dump_mod.request_key(a["rid"]) + ".safetensors" for a in files)
    reader = mooncake.StoreReader(master.address, master.metadata)
    for f, o in zip(files, objs):
        assert o["sink"] == "mooncake" and o["key"] == dump_mod.request_key(o["rid"]), o
        assert o["state"] in ("queued", "written"), o
        got, meta = reader.tensors(o, timeout=30)
        want = load_file(str(tmp_path / "f" / f["file"]))
        assert _same(got, want), o["rid"]
        assert meta["rid"] == o["rid"] and meta["eagle3_layer_ids"] == "[-1, 1, 3]"
    assert e.done() == 0, e.stderr
    # the objects lived in the stopped server's share of the store: a reader says so, never reads junk
    with pytest.raises(mooncake.StoreError, match="no object|gone"):
        reader.tensors(objs[0])


def test_an_engine_refuses_a_master_it_cannot_reach_before_loading(engine_setup, tmp_path):
    port = mooncake._free_port()
    e = _Engine(engine_setup, {"EAGLE3_DUMP_DIR": str(tmp_path), "EAGLE3_DUMP_SINK": "mooncake",
                               "EAGLE3_DUMP_MOONCAKE_MASTER": f"127.0.0.1:{port}"}, tmp_path / "e.log", n=1)
    assert e.done() != 0 and not e.answers
    assert f"error: EAGLE3_DUMP_MOONCAKE_MASTER='127.0.0.1:{port}' cannot be reached" in e.stderr, e.stderr
