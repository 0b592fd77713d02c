"""The Mooncake sink (issue 33): a real ``mooncake_master`` with its HTTP metadata server on
localhost, the overlay's real ``DumpWriter`` putting each request's states into the store, and
the readers: the project's ``eaglepatch.mooncake.StoreReader`` (the same ``Dump`` the request's
file gives) and hs-connectors' own ``MooncakeHiddenStatesStore.get_sample`` on the manifest the
answer carries. Faults: a master that cannot be reached refuses the settings; a store too small
for an object fails that request by name; a store filled by objects nobody read refuses later
requests by name and loses none it reported written (the sink pins them; unpinned, the master's
eviction takes some, which the test shows), and takes requests again once readers delete; objects
nobody deletes expire after EAGLE3_DUMP_MOONCAKE_TTL_S and say so; a master killed mid-run and
restarted fails the requests it could not take, names the objects it forgot, and takes the later
ones, which both readers read; nothing whose state is written is unreadable.

The store's package is the CPU wheel installed beside the test environment
(``eaglepatch.mooncake.ensure_site``; Debian's libibverbs1 comes from eaglepatch.sysdeps)."""

import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

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


_SINKS = []


def _close_sinks():
    """Stop each sink's sweeper and close its store client. Closed here, before the master stops,
    the client unmounts its segment at once; left to the interpreter's exit, it asks the absent
    master then, seconds a call: 2 minutes after this module's tests had all passed."""
    while _SINKS:
        sink = _SINKS.pop()
        sink.close()
        sink.store.close()


@pytest.fixture(autouse=True)
def _sinks_closed():
    """Each test's sinks stop their sweeper at its end (it would go on asking a stopped master)."""
    yield
    _close_sinks()


@pytest.fixture
def master(site, tmp_path):
    with mooncake.Master(site, tmp_path / "master.log") as m:
        yield m
        _close_sinks()


def _writer(directory, master=None, writers=2, layout=None, segment_mb=None, ttl_s=None):
    env = master.env() if master is not None else {}
    if segment_mb is not None:
        env["EAGLE3_DUMP_MOONCAKE_SEGMENT_MB"] = str(segment_mb)
    if ttl_s is not None:
        env["EAGLE3_DUMP_MOONCAKE_TTL_S"] = str(ttl_s)
    sink = sinks.MooncakeSink(settings.MooncakeSettings.from_env(env)) if master is not None else None
    if sink is not None:
        _SINKS.append(sink)
    return dump_mod.DumpWriter(str(directory), _idx(LAYERS), True, 1 << 22, dict(META), writers=writers,
                               layout=layout, sink=sink)


def _theirs(master, buffer_mb=64):
    """hs-connectors' own Mooncake reader."""
    from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

    return MooncakeHiddenStatesStore(MooncakeStoreConfig(
        local_hostname="127.0.0.1", metadata_server=master.metadata, master_server_address=master.address,
        global_segment_size=0, local_buffer_size=buffer_mb << 20)).setup()


def _until(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(every)


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


def test_clear_removes_every_request_object_and_leaves_the_sinks_sentinel(master, tmp_path):
    """``StoreReader.clear`` (benchmarks/peers.py between a method's phases: the warm-up's objects nobody
    reads filled an H100 run's store) removes each request's data, manifest and error marker, and
    leaves the sink's sentinel: the sink's next sweep counts no restart of the master. Removing the
    sentinel too (Mooncake's ``remove_all``, the first version) makes it count one and write an error
    marker for every object it had put, the check failing on that input."""
    w = _writer(tmp_path, master)
    rids = _submit([w])
    assert w.flush_report(60)["written"] == len(rids)
    sink = w.sink
    reader = mooncake.StoreReader(master.address, master.metadata)
    keys = [dump_mod.request_key(r) for r in rids]
    reader.store.put(keys[0] + mooncake.ERROR_SUFFIX, b'{"error": "a marker"}')
    assert all(reader.store.is_exist(k) == 1 and reader.store.is_exist(k + mooncake.META_SUFFIX) == 1 for k in keys)
    assert reader.clear() == 2 * len(keys) + 1
    assert not any(reader.store.is_exist(k + sfx) == 1 for k in keys for sfx in ("", mooncake.META_SUFFIX,
                                                                              mooncake.ERROR_SUFFIX))
    assert reader.store.is_exist(sink.sentinel) == 1 and reader.clear() == 0
    sink.sweep()
    assert sink.counts()["master_restarts"] == 0, sink.counts()
    # the wrong way: the sentinel removed with the objects reads, to the sink, as a restarted master
    reader.store.remove_all(force=True)
    sink.sweep()
    c = sink.counts()
    assert c["master_restarts"] == 1 and c["gone_at_restart"] == len(keys), c
    reader.close()
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
    refused({"EAGLE3_DUMP_SINK": "mooncake", "EAGLE3_DUMP_MOONCAKE_MASTER": "127.0.0.1:1",
             "EAGLE3_DUMP_MOONCAKE_TTL_S": "0"}, "EAGLE3_DUMP_MOONCAKE_TTL_S='0' must be a positive finite number "
                                                 "of seconds")
    # two masters at once on one host (each on its own free ports, its metrics server's too)
    with mooncake.Master(site, tmp_path / "m.log") as m, mooncake.Master(site, tmp_path / "m2.log") as m2:
        s = settings.DumpSettings.from_env(dict(m.env(), EAGLE3_DUMP_DIR=str(tmp_path)))
        s.mooncake.check_reachable()  # both ports answer
        assert (s.sink, s.mooncake.master, s.mooncake.segment_bytes, s.mooncake.ttl_s) == (
            "mooncake", m.address, 256 << 20, 600.0)
        assert m2.proc.poll() is None and m.proc.poll() is None


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


def test_a_master_restarted_mid_run_names_what_it_lost_and_later_requests_are_read(site, tmp_path):
    """The master killed mid-run, then started again on the same address. The requests while it is
    down fail by name (state, ledger, flush report) and at once (a call to an absent master takes
    ~4.3 s to fail: the sink tries none while it is out), and their error markers are put once it
    answers again. The objects written before are gone with the old
    master (it held the only record of them): the sink notices (its sentinel object is not listed),
    counts them, their state says gone, and both readers raise the reason from an error marker. The
    sink's store client mounts its memory with the new master by itself (about 1 s, measured), so
    the requests after that are written and read back, by both readers and by a reader connected
    before the restart, equal to the file sink's files. Nothing whose state is written is unreadable."""
    from safetensors.torch import load_file

    (tmp_path / "f").mkdir()
    (tmp_path / "m").mkdir()
    m = mooncake.Master(site, tmp_path / "master.log").start()
    try:
        wf, w = _writer(tmp_path / "f"), _writer(tmp_path / "m", m)
        early = mooncake.StoreReader(m.address, m.metadata)  # a reader connected before the restart
        before = _submit([wf, w], n_forwards=1, seed=1)
        assert wf.flush_report(30)["written"] == w.flush_report(30)["written"] == len(before)
        assert _same(early.tensors(w.handle(before[0]))[0],
                     load_file(str(tmp_path / "f" / (w.handle(before[0])["key"] + ".safetensors"))))
        m.stop(kill=True)
        during = _submit([wf, w], n_forwards=1, seed=2)
        started = time.monotonic()
        r = w.flush_report(120)
        assert time.monotonic() - started < 15, "the requests during the outage were not failed at once"
        assert r["flushed"] and (r["written"], r["failed"]) == (len(before), len(during)), r
        for rid in during:
            assert w.state(rid).startswith("failed: the write failed: the Mooncake store refused the object"), \
                (rid, w.state(rid))
            assert "did not answer" in w.state(rid) and rid in w.unwritten
        m.start()  # the same ports
        _until(lambda: w.sink.counts()["master_restarts"] == 1, 60, "the sink noticing the restarted master")
        after = _submit([wf, w], n_forwards=2, seed=3)
        assert wf.flush_report(60)["flushed"]
        r = w.flush_report(60)
        assert (r["written"], r["failed"], r["gone_at_restart"], r["master_restarts"]) == (
            len(before) + len(after), len(during), len(before), 1), r
        ours, theirs = mooncake.StoreReader(m.address, m.metadata), _theirs(m)
        for rid in after:
            h = w.handle(rid)
            assert w.state(rid) == "written", (rid, w.state(rid))
            file = load_file(str(tmp_path / "f" / (h["key"] + ".safetensors")))
            assert _same(ours.tensors(h)[0], file), rid
            assert _same(theirs.get_sample(h["manifest"], timeout=5), file), rid
            # a client connected before the restart reconnects by itself within seconds (4.3 s per try)
            assert _same(early.tensors(h, timeout=30)[0], file), rid
        for rid in before:
            h = w.handle(rid)
            assert w.state(rid).startswith("gone: the Mooncake master"), (rid, w.state(rid))
            with pytest.raises(mooncake.StoreError, match="restarted after it was written"):
                ours.tensors(h)
            with pytest.raises(Exception, match="restarted after it was written"):
                theirs.get_sample(h["manifest"], timeout=5)
        for rid in during:  # their markers were put once the master answered again
            with pytest.raises(mooncake.StoreError, match="did not answer"):
                ours.tensors(w.handle(rid))
            with pytest.raises(Exception, match="did not answer"):
                theirs.get_sample({"version": 1, "handle": w.handle(rid)["key"], "tensors": {},
                                   "metadata": {"total_aligned_bytes": 0}}, timeout=5)  # no manifest was answered
        for rid in before + during + after:  # what says written reads
            if w.state(rid) == "written":
                ours.tensors(w.handle(rid))
        wf.close()
        w.close()
    finally:
        _close_sinks()  # before the master stops: a call to an absent master takes ~4.3 s
        m.stop(kill=True)
    time.sleep(0.1)


class _After:
    """The sink's own store client, with ``then(key)`` run after each successful call of ``method``
    (the sink's steps stay real; a reader or a restart happens exactly between two of them)."""

    def __init__(self, store, method: str, then):
        self._store, self._method, self._then = store, method, then

    def __getattr__(self, name):
        real = getattr(self._store, name)
        if name != self._method:
            return real

        def call(key, *args):
            code = real(key, *args)
            if code == 0:
                self._then(key)
            return code
        return call


def test_an_object_a_reader_takes_at_once_is_written_not_failed(master, tmp_path):
    """A reader may take an object the moment its manifest is in the store and delete it at once,
    before the sink's last check (that the master which took the manifest has the data). The
    request is written, not failed (before the fix that check took the reader's delete for a
    master's restart and failed the request); what the reader took equals the file sink's file."""
    from safetensors.torch import load_file

    (tmp_path / "f").mkdir()
    (tmp_path / "m").mkdir()
    wf, wm = _writer(tmp_path / "f"), _writer(tmp_path / "m", master, writers=1)
    reader = mooncake.StoreReader(master.address, master.metadata)
    taken = {}

    def take(key):
        if key.endswith(mooncake.META_SUFFIX):
            k = key[:-len(mooncake.META_SUFFIX)]
            taken[k] = reader.tensors(k, delete=True)[0]

    real = wm.sink.store
    wm.sink.store = _After(real, "upsert", take)
    rids = _submit([wf, wm], n_forwards=1, per=3)
    r = wm.flush_report(60)
    wm.sink.store = real
    assert (r["written"], r["failed"]) == (3, 0), r
    assert wf.flush_report(60)["written"] == 3
    for rid in rids:
        key = dump_mod.request_key(rid)
        assert wm.state(rid) == "written", wm.state(rid)
        assert _same(taken[key], load_file(str(tmp_path / "f" / (key + ".safetensors")))), rid
        assert real.is_exist(key) == 0 and real.is_exist(key + mooncake.META_SUFFIX) == 0  # the reader's delete
    reader.close()
    wf.close()
    wm.close()


def test_a_master_restarted_between_the_data_and_its_manifest_fails_the_request(site, tmp_path):
    """The data put to a master that then restarts, the manifest to the new one: the new master has a
    manifest without data. The sink's last check sees it (no sentinel there, or a restart counted
    since the commit began) and fails the request by name; nothing is reported written, and a
    reader gets no bytes."""
    m = mooncake.Master(site, tmp_path / "master.log").start()
    try:
        w = _writer(tmp_path, m, writers=1)
        real = w.sink.store

        def restart(key):
            if key.startswith(w.sink.sentinel):
                return
            m.stop(kill=True)
            m.start()  # the same ports
            # until this client has mounted its memory with the new master (about 1 s, measured)
            _until(lambda: real.upsert("remount-probe", b"1", w.sink._pin) == 0, 60, "the client remounting")
            real.remove("remount-probe", force=True)

        w.sink.store = _After(real, "upsert_from", restart)
        rid = _submit([w], n_forwards=1, per=1)[0]
        r = w.flush_report(90)
        w.sink.store = real
        assert (r["written"], r["failed"]) == (0, 1), r
        assert w.state(rid).startswith("failed: ") and "no longer had the object" in w.state(rid), w.state(rid)
        assert rid in w.unwritten
        reader = mooncake.StoreReader(m.address, m.metadata)
        with pytest.raises(mooncake.StoreError):
            reader.tensors(w.handle(rid), timeout=2)
        reader.close()
        w.close()
    finally:
        _close_sinks()
        m.stop(kill=True)


def _submit_big(writers, n: int, tokens: int = 1000, seed: int = 0) -> list:
    """``n`` requests of ``tokens`` tokens, hidden 64 (about 1 MiB an object at 1000), one a forward."""
    rids = []
    for i in range(n):
        ids, cap, fin = _states([tokens], LAYERS, hidden=64, seed=seed + i)
        rid = f"big{seed}-{i}"
        for w in writers:
            w.submit(_Batch(ids, [tokens], rids=[rid]), cap, fin)
        rids.append(rid)
    return rids


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned-loses-written-objects"])
def test_a_store_filled_by_unread_objects_refuses_later_requests_and_loses_none(site, tmp_path, monkeypatch, pinned):
    """16 MiB of store and 24 requests of about 1 MiB that nobody reads: the requests that do not fit
    fail by name, and every object reported written is still there, equal to its file, for both
    readers (the sink hard-pins its objects: Mooncake's eviction never takes them). Once a reader
    has read and deleted some, later requests are written again. With the pin off (the sink as it
    was), the master's eviction (90% used: ~5% of the unleased objects go) removes objects already
    reported written, which this test sees: the case that the pin prevents."""
    from safetensors.torch import load_file

    monkeypatch.setattr(sinks, "HARD_PIN", pinned)
    (tmp_path / "f").mkdir()
    (tmp_path / "m").mkdir()
    # short leases: an object is not shielded from eviction by the lease a look at it grants
    with mooncake.Master(site, tmp_path / "master.log", kv_lease_ms=500) as m:
        wf, w = _writer(tmp_path / "f"), _writer(tmp_path / "m", m, segment_mb=16)
        rids = _submit_big([wf, w], 24)
        assert wf.flush_report(120)["written"] == len(rids)
        r = w.flush_report(120)
        written = [rid for rid in rids if w.state(rid) == "written"]
        refused = [rid for rid in rids if w.state(rid).startswith(
            "failed: the write failed: the Mooncake store refused the object")]
        assert len(written) + len(refused) == len(rids) and written and refused, [w.state(x) for x in rids]
        assert (r["written"], r["failed"]) == (len(written), len(refused)), r
        assert all("no room" in w.state(rid) for rid in refused), w.state(refused[0])
        time.sleep(3)  # the master's eviction runs every 10 ms; leases are 0.5 s
        ours = mooncake.StoreReader(m.address, m.metadata)

        def file(rid):
            return load_file(str(tmp_path / "f" / (w.handle(rid)["key"] + ".safetensors")))

        lost = []
        for rid in written:
            try:
                got = ours.tensors(w.handle(rid))[0]
            except mooncake.StoreError:
                lost.append(rid)
                continue
            assert _same(got, file(rid)), rid
        if not pinned:
            assert lost, "no object reported written was evicted: this test could not see the loss it guards"
            _close_sinks()
            return
        assert lost == []
        theirs = _theirs(m, buffer_mb=16)
        for rid in written:
            assert _same(theirs.get_sample(w.handle(rid)["manifest"], timeout=5), file(rid)), rid
        for rid in written[:6]:  # a consumer reads and deletes: room again
            ours.tensors(w.handle(rid), delete=True)
        more = _submit_big([wf, w], 4, seed=100)
        assert wf.flush_report(60)["flushed"] and w.flush_report(60)["flushed"]
        assert [w.state(rid) for rid in more] == ["written"] * 4, [w.state(rid) for rid in more]
        for rid in more:
            assert _same(ours.tensors(w.handle(rid))[0], file(rid)), rid
        wf.close()
        w.close()
        _close_sinks()


def test_objects_nobody_deletes_expire_and_say_so(site, tmp_path, caplog):
    """EAGLE3_DUMP_MOONCAKE_TTL_S=4 and four objects: one read and deleted by our reader
    (``load(..., delete=True)``), one read by hs-connectors and deleted with its ``delete_sample``
    (which leaves our manifest), two never read. The two unread are removed by the writing rank,
    counted (flush report) and logged; their state says expired and both readers raise the reason.
    The consumed two are not counted; the manifest hs-connectors left is removed too; the markers go
    after another time to live: nothing of the run is left in the store."""
    import logging

    with mooncake.Master(site, tmp_path / "master.log", kv_lease_ms=500) as m:
        w = _writer(tmp_path, m, ttl_s=4)
        rids = _submit([w], n_forwards=1, per=4, seed=7)
        assert w.flush_report(30)["written"] == 4
        ours, theirs = mooncake.StoreReader(m.address, m.metadata), _theirs(m)
        assert ours.load(w.handle(rids[0]), delete=True).layers.keys() == {f"layer.{k}" for k in LAYERS}
        with pytest.raises(mooncake.StoreError, match="no object"):
            ours.tensors(w.handle(rids[0]))
        h1 = w.handle(rids[1])
        assert theirs.get_sample(h1["manifest"], timeout=5)["input_ids"].numel() > 0
        theirs.delete_sample(h1["key"])
        with caplog.at_level(logging.WARNING, logger=sinks.__name__):
            _until(lambda: w.sink.counts()["expired"] == 2, 30, "the expiry of the two unread objects")
            for rid in rids[2:]:  # at once: their markers live one time to live too
                h = w.handle(rid)
                assert w.state(rid).startswith(
                    "gone: expired: nobody deleted it within EAGLE3_DUMP_MOONCAKE_TTL_S=4 s"), w.state(rid)
                with pytest.raises(mooncake.StoreError, match="expired: nobody deleted it"):
                    ours.tensors(h)
                with pytest.raises(Exception, match="expired: nobody deleted it"):
                    theirs.get_sample(h["manifest"], timeout=1)
            time.sleep(3 * sinks.SWEEP_S)
        r = w.flush_report(30)
        assert (r["written"], r["expired"]) == (4, 2), r
        assert "removed 2 objects nobody deleted within EAGLE3_DUMP_MOONCAKE_TTL_S=4 s" in caplog.text, caplog.text
        assert [w.state(rid) for rid in rids[:2]] == ["written", "written"]
        keys = [w.handle(rid)["key"] + suffix for rid in rids for suffix in ("", ":meta", ":error")]
        # every look grants a 0.5 s lease that defers a removal: look every 2 s
        _until(lambda: [k for k in keys if ours.store.is_exist(k) != 0] == [], 30, "the store emptying", every=2)
        w.close()
        _close_sinks()


def _put_raw(m, key: str, nbytes: int):
    """An object of ``nbytes`` random bytes and its version-1 manifest, put by a store client that
    lends the store memory (returned: it holds them)."""
    import json

    import torch
    from mooncake.store import MooncakeDistributedStore

    w = MooncakeDistributedStore()
    assert w.setup("127.0.0.1", m.metadata, 256 << 20, 128 << 20, "tcp", "", m.address) == 0
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    man = {"version": 1, "handle": key, "metadata": {"total_aligned_bytes": nbytes},
           "tensors": {"x": {"shape": [nbytes], "dtype": "uint8", "nbytes": nbytes, "offset": 0}}}
    assert w.put(key, data.numpy().tobytes()) == 0
    assert w.put(key + mooncake.META_SUFFIX, json.dumps(man).encode()) == 0
    return w, data


class _Reads:
    """The real store's ``get_into``, each key's calls recorded; the first ``expire[key]`` of a key's
    answered -707 without reading (a read that outlasted its lease, as one of 400 did on the H200
    with 32 reads at once)."""

    def __init__(self, store, expire=None):
        self.store, self.expire, self.keys = store, dict(expire or {}), []

    def __call__(self, key, ptr, size):
        self.keys.append(key)
        if self.keys.count(key) <= self.expire.get(key, 0):
            return mooncake.LEASE_EXPIRED
        return self.store.get_into(key, ptr, size)

    def install(self, reader):
        reader.store = type("Counted", (), {"__getattr__": lambda _, n: getattr(self.store, n),
                                            "get_into": lambda _, *a: self(*a)})()


def test_a_read_that_outlasts_its_lease_is_read_again_and_named_when_it_always_does(site, tmp_path):
    """Mooncake answers -707 (LEASE_EXPIRED) to a read that outlasts the lease the master gave it. The
    reader reads again (the object is pinned); a read whose every try expires is an error naming the
    lease and the fix, never bytes. A master with a 1 ms lease expires every read of 64 MiB (measured:
    8 of 8); with the default lease a read that expired twice is read again and equals what was put,
    and a manifest whose every read expires is named the same way."""
    lease = r"could not be read within the master's lease in 4 tries \(code -707, LEASE_EXPIRED\); raise " \
            r"mooncake_master's --default_kv_lease_ttl"
    with mooncake.Master(site, tmp_path / "short.log", kv_lease_ms=1) as m:
        w, _ = _put_raw(m, "big", 64 << 20)
        r = mooncake.StoreReader(m.address, m.metadata)
        reads = _Reads(r.store)
        reads.install(r)
        with pytest.raises(mooncake.StoreError, match="the object (big|big:meta) \\(\\d+ bytes\\) " + lease) as e:
            r.tensors("big", timeout=5)
        # the 64 MiB object, or already its 170-byte manifest (the lease is that short): tried 4 times
        failed = str(e.value).split()[2]
        assert reads.keys.count(failed) == mooncake.LEASE_TRIES, reads.keys
        r.store = reads.store
        r.close()
        w.close()
    with mooncake.Master(site, tmp_path / "default.log") as m:
        w, data = _put_raw(m, "k", 4 << 20)
        r = mooncake.StoreReader(m.address, m.metadata)
        reads = _Reads(r.store, expire={"k": 2})
        reads.install(r)
        got, _ = r.tensors("k")
        assert reads.keys.count("k") == 3 and bytes(got["x"].numpy()) == bytes(data.numpy())
        reads = _Reads(reads.store, expire={"k:meta": mooncake.LEASE_TRIES})
        reads.install(r)
        with pytest.raises(mooncake.StoreError, match="the object k:meta \\(\\d+ bytes\\) " + lease):
            r.tensors("k")
        r.store = reads.store
        r.close()
        w.close()


# ---- the package: found before anything loads (issue 43, item 13) --------------------------------

_CHECK = """
import sys
sys.path.insert(0, {src!r})
from eaglepatch.overlay import import_package
import importlib
import_package("e3c_mc_check")
sinks, settings = importlib.import_module("e3c_mc_check.sinks"), importlib.import_module("e3c_mc_check.settings")
try:
    sinks.check_mooncake_importable()
    print("IMPORTABLE")
except settings.DumpConfigError as exc:
    print("REFUSED " + str(exc))
"""


def test_the_launch_check_names_a_missing_mooncake_package_and_where_it_comes_from(site, tmp_path):
    """``sinks.check_mooncake_importable`` (called by the launch check, before any weight loads) in an
    environment without the package: one line saying so and naming the packages (CUDA 12, CUDA 13,
    no GPU), that mooncake_master ships in them, and libibverbs1; with the package on the path: no
    error. Run in fresh interpreters, one with the package's directory on PYTHONPATH and one without."""
    import os
    import subprocess

    def run(with_site: bool) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if with_site:
            env = mooncake.with_site(env, site)
        p = subprocess.run([sys.executable, "-c", _CHECK.format(src=str(REPO / "src"))], capture_output=True,
                           text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert run(True) == "IMPORTABLE"
    out = run(False)
    assert len(out.splitlines()) == 1 and out.startswith("REFUSED EAGLE3_DUMP_SINK=mooncake but the mooncake "
                                                         "package cannot be imported (No module named"), out
    for needle in ("pip install mooncake-transfer-engine (CUDA 12)", "mooncake-transfer-engine-cuda13",
                   "mooncake-transfer-engine-non-cuda", "holds mooncake_master", "libibverbs1"):
        assert needle in out, (needle, out)


def test_the_server_and_the_tools_name_the_same_package():
    assert sinks.MOONCAKE_INSTALL == mooncake.INSTALL


def test_what_mooncake_binds_loopback_and_what_it_binds_on_every_address(master):
    """The master started as eaglepatch.mooncake.Master starts it (and as serve.py prints the command):
    its RPC port (``--rpc_address``) and metrics server (``--metrics_host``) listen on 127.0.0.1 only;
    its HTTP metadata server listens on 0.0.0.0 although ``--http_metadata_server_host=127.0.0.1``
    says otherwise; a store client (a reader here; the server's sink is the same client) opens ports
    on every address. serve.py and docs/online.md say so: this test keeps them right."""
    import os

    got = dict((port, addr) for addr, port in mooncake.listeners(master.proc.pid))
    assert got.get(master.port) == "127.0.0.1" and got.get(master.metrics_port) == "127.0.0.1", got
    assert got.get(master.http_port) == "0.0.0.0", got
    before = set(mooncake.listeners(os.getpid()))
    reader = mooncake.StoreReader(master.address, master.metadata)
    new = sorted(set(mooncake.listeners(os.getpid())) - before)
    assert new and all(addr in ("0.0.0.0", "::") for addr, _ in new), new
    reader.close()


def test_the_reading_command_serve_prints_reads_a_servers_object(master, tmp_path, monkeypatch):
    """The command tools/serve.py prints once a server with the Mooncake sink answers, run as printed
    against a stand-in /generate that commits the request's states through the overlay's real
    MooncakeSink and answers with its handle: it prints the object's tensors, and deletes it."""
    import json
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from eaglepatch import serve

    sink = sinks.MooncakeSink(settings.MooncakeSettings.from_env(master.env()))
    _SINKS.append(sink)
    handles = []

    class Generate(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            rid = f"r{len(handles)}"
            key = dump_mod.request_key(rid)
            ids, cap, fin = _states([5], LAYERS)
            tensors = {"input_ids": ids, **{f"layer.{k}": cap[k + 1] for k in LAYERS}, "final": fin}
            h = dict(sink.commit(key, tensors, dict(META, key=key, rid=rid)), state="written")
            handles.append(h)
            body = json.dumps({"text": "x", "meta_info": {"id": rid, "eagle3_dump": h}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PYTHONPATH", str(mooncake.ensure_site(Path(sys.executable))))
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        steps = serve.mooncake_next_steps(url, master.env(), sys.executable)
        command = [line for line in steps if not line.startswith("#")]
        assert len(command) == 1 and "StoreReader" in command[0], steps
        p = subprocess.run(["bash", "-c", command[0]], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "'input_ids': (5,)" in p.stdout and "'layer.-1': (5, 16)" in p.stdout and "[-1, 1, 3]" in p.stdout, \
            p.stdout
        reader = mooncake.StoreReader(master.address, master.metadata)
        with pytest.raises(mooncake.StoreError, match="no object"):
            reader.tensors(handles[0])
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- manifests the reader must refuse (issue 43, item 5) ------------------------------------------

# a valid object: three tensors at 64-byte aligned offsets, 192 bytes in all (what sinks.pack writes)
_GOOD = {"input_ids": {"shape": [4], "dtype": "torch.int64", "nbytes": 32, "offset": 0},
         "layer.0": {"shape": [4, 4], "dtype": "torch.float32", "nbytes": 64, "offset": 64},
         "scale.layer.0": {"shape": [4, 1], "dtype": "torch.bfloat16", "nbytes": 8, "offset": 128}}


def _good_manifest(key: str) -> dict:
    import copy

    return {"version": 1, "handle": key, "tensors": copy.deepcopy(_GOOD),
            "metadata": {"total_aligned_bytes": 192, "rid": "r", "format": "eagle3-dump/2"}}


class _Putter:
    """A store client that lends the store memory and puts objects with the manifests it is given."""

    def __init__(self, m):
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        assert self.store.setup("127.0.0.1", m.metadata, 64 << 20, 16 << 20, "tcp", "", m.address) == 0
        self.n = 0

    def put(self, data: bytes, man, key: str | None = None) -> str:
        import json

        self.n += 1
        key = key or f"obj-{self.n}"
        if isinstance(man, dict) and man.get("handle") == "{key}":
            man = dict(man, handle=key)
        assert self.store.put(key, data) == 0
        assert self.store.put(key + mooncake.META_SUFFIX, json.dumps(man).encode()) == 0
        return key


def test_a_negative_offset_never_returns_the_bytes_of_an_earlier_object(master):
    """A tensor of 64 bytes at offset -128 sliced the reader's registered buffer from its end: it
    returned the bytes of an object read earlier into it (the last 64 bytes of the previous object,
    without an error). Every field of the manifest is checked before a byte is read: a StoreError,
    never data."""
    w = _Putter(master)
    reader = mooncake.StoreReader(master.address, master.metadata)
    big = torch.randint(0, 256, ((1 << 20) - 64,), dtype=torch.uint8)  # fills the reader's 1 MiB buffer
    man = {"version": 1, "handle": "{key}", "metadata": {"total_aligned_bytes": big.numel()},
           "tensors": {"x": {"shape": [big.numel()], "dtype": "uint8", "nbytes": big.numel(), "offset": 0}}}
    first = w.put(big.numpy().tobytes(), man)
    assert torch.equal(reader.tensors(first)[0]["x"], big)
    bad = _good_manifest("{key}")
    bad["tensors"]["layer.0"]["offset"] = -128
    second = w.put(bytes(192), bad)
    with pytest.raises(mooncake.StoreError, match=r"malformed: tensor 'layer.0' has offset -128, not a non-negative "
                                                  r"multiple of 64"):
        reader.tensors(second)
    # the same object with the manifest as written reads its own bytes (zeros), not the earlier object's
    third = w.put(bytes(192), _good_manifest("{key}"))
    got, meta = reader.tensors(third)
    assert not got["layer.0"].view(torch.uint8).any() and meta == {"rid": "r", "format": "eagle3-dump/2"}


def test_handles_that_are_not_the_sinks_and_objects_written_again_are_refused(master):
    w = _Putter(master)
    reader = mooncake.StoreReader(master.address, master.metadata)
    key = w.put(bytes(range(192)), _good_manifest("{key}"))
    for handle in ({"sink": "file", "file": "abc.safetensors", "state": "written"}, {"sink": "mooncake"}, 7, None,
                   ""):
        with pytest.raises(mooncake.StoreError, match="not a Mooncake object's|not a handle of the Mooncake sink"):
            reader.tensors(handle)
    # an answer's handle whose object was written again since (another launch with the same rid): its
    # manifest is not the answer's, and nothing is read
    answered = _good_manifest(key)
    answered["metadata"]["rid"] = "another"
    with pytest.raises(mooncake.StoreError, match="not the one the answer carried"):
        reader.tensors({"sink": "mooncake", "key": key, "manifest": answered})
    assert reader.tensors({"sink": "mooncake", "key": key, "manifest": _good_manifest(key)})[1]["rid"] == "r"


_NAMES = list(_GOOD)
_PATHS = ([("version",), ("handle",), ("metadata",), ("tensors",), ("extra",),
           ("metadata", "total_aligned_bytes"), ("metadata", "rid"), ("metadata", "new")]
          + [("tensors", n) for n in _NAMES] + [("tensors", n, f) for n in _NAMES
                                                for f in ("shape", "dtype", "nbytes", "offset", "more")]
          + [("tensors", n, "shape", i) for n in _NAMES for i in (0, 1)])
_VALUES = st.one_of(
    st.integers(-300, 300), st.sampled_from([-64, -1, 0, 8, 32, 63, 64, 96, 128, 136, 192, 256, 1 << 31, 1 << 63]),
    st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=6),
    st.sampled_from(["torch.int64", "int64", "uint8", "torch.float32", "bfloat16", "float8_e4m3fn", "complex64",
                     "torch.Tensor", "float", "torch."]),
    st.lists(st.integers(-2, 70), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2))


_CLIENTS: dict = {}


def _mutate(man: dict, path: tuple, value, delete: bool) -> None:
    node = man
    for p in path[:-1]:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
        else:
            return
    last = path[-1]
    if isinstance(node, dict):
        if delete:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value


@hsettings(max_examples=120, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(_PATHS), _VALUES, st.booleans()), min_size=1, max_size=3))
def test_a_malformed_manifest_is_a_store_error_never_other_bytes(master, edits):
    """Any manifest, as edited: the reader raises StoreError (one line), or returns exactly the bytes
    each tensor's own spec names inside its own object, with that dtype and shape; never another
    exception, never bytes from outside the object. The reader first reads an object of other bytes,
    so bytes from its buffer's earlier contents would show."""
    import json

    if master.address not in _CLIENTS:  # one writer and one reader for all the examples of this master
        _CLIENTS[master.address] = (_Putter(master), mooncake.StoreReader(master.address, master.metadata))
    w, reader = _CLIENTS[master.address]
    junk = w.put(b"\xee" * 4096, {"version": 1, "handle": "{key}", "metadata": {"total_aligned_bytes": 4096},
                                  "tensors": {"j": {"shape": [4096], "dtype": "uint8", "nbytes": 4096, "offset": 0}}})
    assert reader.tensors(junk)[0]["j"].eq(0xEE).all()
    data = bytes(range(192))
    man = _good_manifest("{key}")
    for path, value, delete in edits:
        _mutate(man, path, value, delete)
    w.n += 1
    key = f"obj-{w.n}"
    if isinstance(man, dict) and man.get("handle") == "{key}":
        man["handle"] = key
    assert w.store.put(key, data) == 0
    assert w.store.put(key + mooncake.META_SUFFIX, json.dumps(man).encode()) == 0
    try:
        got, meta = reader.tensors(key)
    except mooncake.StoreError as exc:
        assert "\n" not in str(exc)
        return
    for name, t in got.items():
        spec = man["tensors"][name]
        off, nbytes = spec["offset"], spec["nbytes"]
        assert type(off) is int and type(nbytes) is int and 0 <= off and off + nbytes <= len(data), spec
        assert str(t.dtype) == "torch." + spec["dtype"].removeprefix("torch.") and list(t.shape) == spec["shape"]
        assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == data[off:off + nbytes], name
    assert meta == {k: v for k, v in man["metadata"].items() if k != "total_aligned_bytes"}


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

    def __init__(self, engine_setup, env_extra: dict, log: Path, n: int = 4, site: bool = True):
        import json
        import subprocess

        from eaglepatch.smoke import HERE as SMOKE_DIR, worker_env

        py, tree, ckpt, stubs = engine_setup
        env = worker_env(tree, stubs)
        if site:  # the store's package beside the environment
            env = mooncake.with_site(env, mooncake.ensure_site(py))
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


def test_an_engine_without_the_mooncake_package_is_refused_before_loading(engine_setup, master, tmp_path):
    """The sink's package missing from the server's environment (the master reachable): the launch
    ends with one line saying so and where the package comes from, before any worker starts or any
    weight loads (no traceback). It was found by the writing rank after the weights loaded: a
    traceback, and the launch killed. Needs settings.check_launch to call
    sinks.check_mooncake_importable() (issue 43, item 13a)."""
    e = _Engine(engine_setup, dict(master.env(), EAGLE3_DUMP_DIR=str(tmp_path)), tmp_path / "e.log", n=1, site=False)
    assert e.done() != 0 and not e.answers
    err = e.stderr
    assert "error: EAGLE3_DUMP_SINK=mooncake but the mooncake package cannot be imported (No module named " \
           "'mooncake')" in err and "pip install mooncake-transfer-engine (CUDA 12)" in err, err
    assert "Traceback" not in err, err
