"""SpecForge's capture protocol on the writer's side (issue 46, items 1 and 3).

- The payloads SpecForge 0.2.0's own ``SGLangServerCaptureAdapter`` sends (its body, taken from its
  ``post_fn``, for EAGLE-3, DFlash and DSpark, first try and retry) are taken by
  ``specforge.payloads``; any change of a field to a value of another kind, or a field added or dropped,
  is a ``ProtocolError`` (one line), never another exception.
- A real ``mooncake_master`` and the overlay's real ``DumpWriter`` with its Mooncake sink: a request
  expected for SpecForge is put as one object per tensor at ``{store_id}/{sample_id}/g{gen}/{name}``,
  raw bytes SpecForge's ``MooncakeFeatureStore`` reads, and its answer is what SpecForge's adapter
  takes; a retry (``replace``) puts the new rows; a store too small fails that request in SpecForge's
  retryable error form, leaves none of its objects behind, and the writer goes on; a writer that cannot
  capture a payload says why (no ids at launch, a file sink, fp8 storage, no final state).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from test_capture_package import _Batch, _idx, _states, dump_mod  # noqa: E402
from test_mooncake import LAYERS, _writer, master, site  # noqa: E402,F401  (fixtures: a real master)

pkg = dump_mod.__name__.rsplit(".", 1)[0]
sf = __import__(pkg + ".specforge", fromlist=["payloads"])
storage = sys.modules[pkg + ".storage"]

IDS = (1, 3)  # SpecForge ids the writer answers with: outputs of layers 1 and 3 (LAYERS dumps -1, 1, 3)
H = 16  # _states' hidden size


def _their_body(family: str, lengths, attempt: int = 0) -> dict:
    """The /generate body SpecForge's adapter sends for prompts of ``lengths`` tokens (its own code;
    its post_fn records the body and answers nothing)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.contracts import PromptTask

    class Store:  # what the adapter needs of a store before its POST
        store_id = "sid"

        def track_external_attempt(self, *a, **k):
            return None

        def adopt(self, *a, **k):
            return None

        def discard_external_attempts(self, *a, **k):
            return None

    sent = []

    def post(url, json_body, timeout):
        sent.append(json_body)
        raise RuntimeError("recorded")

    reg = builtin_algorithm_registry().resolve(family)
    lay = reg.providers.server_streaming_for("text").layout
    schema = ServerCaptureSchema(aux_feature=lay.aux_feature, last_hidden_feature=lay.last_hidden_feature,
                                 passthrough=lay.passthrough, attention_mask_feature=lay.attention_mask_feature)
    adapter = SGLangServerCaptureAdapter("http://x", Store(), run_id="r1", algorithm=family, schema=schema,
                                         post_fn=post)
    cap = CaptureConfig.from_strategy(reg.spec.feature_contract("streaming", "text").required_tensors,
                                      aux_hidden_state_layer_ids=IDS,
                                      target_repr="hidden_state" if lay.last_hidden_feature else None,
                                      target_hidden_size=H)
    tasks = [PromptTask(task_id=f"t{i}", run_id="r1", source_id="s", attempt=attempt,
                        payload={"input_ids": list(range(5, 5 + n)), "loss_mask": [0, 1] * (n // 2) + [1] * (n % 2)},
                        max_length=n) for i, n in enumerate(lengths)]
    with pytest.raises(RuntimeError, match="recorded"):
        adapter.produce_refs(tasks, capture=cap)
    return sent[0]


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
@pytest.mark.parametrize("attempt", [0, 1])
def test_the_payloads_specforge_sends_are_taken(family, attempt):
    body = _their_body(family, [6, 9], attempt)
    got = sf.payloads(body, sf.prompt_lengths(body))
    assert [p["sample_id"] for p in got] == ["r1:t0", "r1:t1"]
    assert all(p["store_id"] == "sid" and p["gen"] == 1 and p["replace"] is bool(attempt) for p in got)
    assert "aux" in got[0]["features"] and ("last_hidden" in got[0]["features"]) == (family != "dflash")
    assert [len(p["passthrough"][0]["data"]) for p in got] == [6, 9]


_KINDS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2),
                   st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=2))


@functools.lru_cache(maxsize=1)
def _one_eagle3_body() -> dict:
    """SpecForge's body of one 4-token EAGLE-3 prompt, made once (its adapter is slow to build)."""
    return _their_body("eagle3", [4])


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_other_payload_is_one_line_naming_the_field(data):
    """A field of SpecForge's payload replaced by a value of any kind, dropped, or one added: taken
    only when it still says the same (a ProtocolError otherwise, never another exception)."""
    bad = copy.deepcopy(_one_eagle3_body())
    payload = bad["spec_capture"][0]
    paths = [(k,) for k in payload] + [("features", k) for k in payload["features"]] + \
        [("passthrough", i, k) for i, p in enumerate(payload["passthrough"]) for k in p]
    path = data.draw(st.sampled_from(paths + [("extra",), ("drop",)]))
    if path == ("extra",):
        payload[data.draw(st.sampled_from(["method", "layers", "dtype"]))] = 1
    elif path == ("drop",):
        payload.pop(data.draw(st.sampled_from(["store_id", "sample_id", "features"])))
    else:
        node = payload
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = data.draw(_KINDS)
    try:
        got = sf.payloads(bad, sf.prompt_lengths(bad))
    except sf.ProtocolError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("spec_capture"), str(exc)
        return
    assert got[0]["sample_id"] == payload["sample_id"]  # taken: a value SpecForge could have sent


def test_bodies_that_cannot_be_captured_are_refused():
    body = _their_body("dflash", [4, 5])
    for change, needle in [(lambda b: b["spec_capture"].pop(), "1 payloads for 2 prompts"),
                           (lambda b: b["spec_capture"][1].update(sample_id="r1:t0"), "same store_id/sample_id"),
                           (lambda b: b["spec_capture"][0]["passthrough"][0]["data"].pop(), r"shape \[1, 4\] and 3 values"),
                           (lambda b: b.update(input_ids=[]), "needs input_ids"),
                           (lambda b: b.update(text="hi"), "not text")]:
        bad = copy.deepcopy(body)
        change(bad)
        with pytest.raises(sf.ProtocolError, match=needle):
            sf.payloads(bad, sf.prompt_lengths(bad))


# ---- the writer, a real master, SpecForge's reader ------------------------------------------------

@contextlib.contextmanager
def _sf_store(master):  # noqa: F811
    """SpecForge's MooncakeFeatureStore on ``master``, its store client closed on leaving (before the
    master stops). SpecForge 0.2.0's store has no close of its own: its client is ``_store``; left open,
    it is destroyed at the interpreter's exit asking the stopped master to unmount."""
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    store = MooncakeFeatureStore(store_id="sid", retain_on_release=True, setup_kwargs={
        "local_hostname": "127.0.0.1", "metadata_server": master.metadata, "master_server_addr": master.address,
        "protocol": "tcp", "rdma_devices": "", "global_segment_size": 0, "local_buffer_size": 32 << 20})
    try:
        yield store
    finally:
        store._store.close()


def _payload(sample: str, n: int, replace: bool = False) -> dict:
    return sf.check_payload({"store_id": "sid", "sample_id": sample, "gen": 1, "replace": replace,
                             "features": {"aux": "hidden_state", "last_hidden": "target"},
                             "passthrough": [{"name": "input_ids", "data": list(range(n)), "shape": [1, n],
                                              "dtype": "int64"}]}, n)


def _spec_writer(tmp_path, master, **kw):  # noqa: F811
    w = _writer(tmp_path, master, **kw)
    w.specforge_ids = IDS
    return w


def _read(store, answer: dict) -> dict:
    """SpecForge's MooncakeFeatureStore reading an answer's objects, through the SampleRef its adapter
    makes of the answer (``_ref_from_result``)."""
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.contracts import PromptTask

    adapter = SGLangServerCaptureAdapter("http://x", store, run_id="r", algorithm="eagle3", schema=ServerCaptureSchema(
        aux_feature="hidden_state", last_hidden_feature="target", passthrough=(("input_ids", "input_ids", ()),)))
    cap = CaptureConfig.from_strategy(frozenset(answer["features"]), aux_hidden_state_layer_ids=IDS,
                                      target_repr="hidden_state", target_hidden_size=H)
    task = PromptTask(task_id="t", run_id="r", source_id="s", payload={"input_ids": [0]}, max_length=1)
    tensors, handle = store.get(adapter._ref_from_result(task, answer, cap))
    store.release(handle)
    return tensors


def test_the_writer_puts_specforges_objects_and_a_retry_replaces_them(master, tmp_path):  # noqa: F811
    w = _spec_writer(tmp_path, master)
    lens = [5, 7]
    assert w.expect({"a": _payload("r:a", 5), "b": _payload("r:b", 7)}) == {"a": None, "b": None}
    ids, cap, fin = _states(lens, LAYERS, seed=1)
    w.submit(_Batch(ids, lens, rids=["a", "b"]), cap, fin)
    got = w.captured(["a", "b"], 60)
    with _sf_store(master) as store:
        for i, (rid, n) in enumerate(zip("ab", lens)):
            answer = got[rid]
            assert answer["aux_layer_ids"] == list(IDS) and answer["gen"] == 1, answer
            assert answer["features"]["hidden_state"] == {"shape": [1, n, 2 * H], "dtype": "float32"}
            t = _read(store, answer)
            start = sum(lens[:i])
            want = torch.cat([cap[k + 1][start:start + n] for k in IDS], -1)[None]
            assert torch.equal(t["hidden_state"], want) and torch.equal(t["target"], fin[start:start + n][None])
            assert t["input_ids"].tolist() == [list(range(n))]
        # the same sample again (SpecForge's retry: replace) with other rows: the store holds the new ones
        assert w.expect({"a2": _payload("r:a", 5, replace=True)}) == {"a2": None}
        ids, cap2, fin2 = _states([5], LAYERS, seed=9)
        w.submit(_Batch(ids, [5], rids=["a2"]), cap2, fin2)
        answer = w.captured(["a2"], 60)["a2"]
        assert torch.equal(_read(store, answer)["target"], fin2[None])
    assert not torch.equal(fin2, fin[:5])
    w.close()


def test_a_store_too_small_answers_specforges_error_and_leaves_nothing(master, tmp_path):  # noqa: F811
    """A 16 MiB store and a request of ~46 MiB: SpecForge's retryable form, naming the store's refusal;
    none of its objects is in the store; a small request after it is captured."""
    w = _spec_writer(tmp_path, master, segment_mb=16)
    n = 30000
    big = sf.check_payload({"store_id": "sid", "sample_id": "r:big", "gen": 1, "replace": False,
                            "features": {"aux": "hidden_state", "last_hidden": "target"}, "passthrough": []}, n)
    assert w.expect({"big": big, "small": _payload("r:small", 4)}) == {"big": None, "small": None}
    ids, cap, _ = _states([n], LAYERS)
    cap = {k: torch.randn(n, 256) for k in cap}
    w.submit(_Batch(ids, [n], rids=["big"]), cap, torch.randn(n, 256))
    ids, cap, fin = _states([4], LAYERS, seed=3)
    w.submit(_Batch(ids, [4], rids=["small"]), cap, fin)
    got = w.captured(["big", "small"], 60)
    assert set(got["big"]) == {"sample_id", "store_id", "gen", "error"}, got["big"]
    assert got["big"]["sample_id"] == "r:big" and "the Mooncake store refused" in got["big"]["error"], got["big"]
    from mooncake.store import MooncakeDistributedStore

    m = MooncakeDistributedStore()
    assert m.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.address) == 0
    assert [m.is_exist(f"sid/r:big/g1/{n}") for n in ("hidden_state", "target")] == [0, 0]
    m.close()
    assert "error" not in got["small"]
    with _sf_store(master) as store:
        assert _read(store, got["small"])["target"].shape == (1, 4, H)
    w.close()


def test_a_writer_that_cannot_capture_says_why(master, tmp_path):  # noqa: F811
    p = _payload("r:x", 4)
    (tmp_path / "a").mkdir()
    w = _writer(tmp_path / "a", master)  # no EAGLE3_DUMP_SPECFORGE_IDS
    assert "EAGLE3_DUMP_SPECFORGE_IDS" in w.expect({"x": p})["x"]
    w.close()
    (tmp_path / "b").mkdir()
    w = _writer(tmp_path / "b")  # the file sink
    w.specforge_ids = IDS
    assert "sink is not mooncake" in w.expect({"x": p})["x"]
    w.close()
    (tmp_path / "c").mkdir()
    fp8 = storage.Layout(storage.Storage("fp8", "store"), _idx(LAYERS), True, 4, "float32", 1e-6, 1000)
    w = _writer(tmp_path / "c", master, layout=fp8)
    w.specforge_ids = IDS
    assert "stores fp8" in w.expect({"x": p})["x"]
    w.close()
    (tmp_path / "d").mkdir()
    w = _spec_writer(tmp_path / "d", master)
    w.final = False
    assert "EAGLE3_DUMP_FINAL=1" in w.expect({"x": p})["x"]
    w.specforge_ids = (0, 1)
    dflash = dict(p, features={"aux": "hidden_states"})
    assert "no layer [0]" in w.expect({"x": dflash})["x"]
    assert w.captured(["never"], 1)["never"]["error"].startswith("not captured: no prefill")
    w.close()


def test_the_launch_refuses_what_cannot_serve_specforge(master, tmp_path):  # noqa: F811
    """Before any weight loads: ids that are not SpecForge's (negative, repeated, not numbers), the file
    sink, ids the dump does not capture, fp8 storage: one line each, naming the fix."""
    settings = sys.modules[pkg + ".settings"]
    base = {"EAGLE3_DUMP_DIR": str(tmp_path), "EAGLE3_DUMP_SINK": "mooncake",
            "EAGLE3_DUMP_MOONCAKE_MASTER": master.address, "EAGLE3_DUMP_MOONCAKE_METADATA": master.metadata}
    for raw, needle in [("-1,2", "not a comma-separated list of layer ids >= 0"), ("1,1", "names a layer twice"),
                        ("a", "not a comma-separated list")]:
        with pytest.raises(settings.DumpConfigError, match=needle):
            settings.DumpSettings.from_env(dict(base, EAGLE3_DUMP_SPECFORGE_IDS=raw))
    with pytest.raises(settings.DumpConfigError, match="EAGLE3_DUMP_SINK is 'file'; SpecForge reads"):
        settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": str(tmp_path), "EAGLE3_DUMP_SPECFORGE_IDS": "1"})
    s = settings.DumpSettings.from_env(dict(base, EAGLE3_DUMP_SPECFORGE_IDS="3, 1"))
    assert s.specforge_ids == (3, 1)  # SpecForge's order, which its answer check compares
    settings.check_specforge(s, _idx(LAYERS))  # outputs of layers 1 and 3 are dumped
    with pytest.raises(settings.DumpConfigError, match=r"names layers \[2\] that EAGLE3_DUMP_LAYERS does not dump"):
        settings.check_specforge(settings.DumpSettings.from_env(dict(base, EAGLE3_DUMP_SPECFORGE_IDS="1,2")),
                                 _idx(LAYERS))
    with pytest.raises(settings.DumpConfigError, match="stores fp8 or leaves states out"):
        settings.check_specforge(settings.DumpSettings.from_env(dict(base, EAGLE3_DUMP_SPECFORGE_IDS="1",
                                                                     EAGLE3_DUMP_DTYPE="fp8")), _idx(LAYERS))


def test_serve_refuses_specforge_ids_without_the_store(tmp_path):
    from conftest import one_line_error, run_tool

    for ids, needle in [("1,29", "--specforge-ids needs the Mooncake sink"), ("1,-2", "--specforge-ids '1,-2' is not")]:
        r = run_tool("serve", "--model-path", tmp_path, "--dump-dir", tmp_path / "d", "--specforge-ids", ids, "--print")
        assert r.returncode == 2 and needle in one_line_error(r), r.stderr
        assert not (tmp_path / "d").exists()


def test_a_master_restarted_fails_the_captures_meanwhile_in_specforges_form_and_later_ones_are_read(site, tmp_path):  # noqa: F811
    """The master killed between two captures and started again on the same address: the capture
    while it is down answers SpecForge's retryable form at once (not after a store call's ~4.3 s
    timeout each), naming the master; once the sink has seen the new master a capture is read by
    SpecForge's store; what was put before the restart is gone with the old master and SpecForge's
    get raises for it (its own error, not other bytes)."""
    import time

    from test_mooncake import _close_sinks, _until

    from eaglepatch import mooncake

    m = mooncake.Master(site, tmp_path / "master.log").start()
    try:
        w = _spec_writer(tmp_path, m)

        def capture(rid: str, seed: int) -> dict:
            assert w.expect({rid: _payload(f"r:{rid}", 6)}) == {rid: None}
            ids, cap, fin = _states([6], LAYERS, seed=seed)
            w.submit(_Batch(ids, [6], rids=[rid]), cap, fin)
            return w.captured([rid], 60)[rid]

        before = capture("before", 1)
        assert "error" not in before
        m.stop(kill=True)
        started = time.monotonic()
        during = capture("during", 2)
        assert time.monotonic() - started < 15, "a capture during the outage was not failed at once"
        assert set(during) == {"sample_id", "store_id", "gen", "error"} and "did not answer" in during["error"], during
        m.start()
        _until(lambda: w.sink.counts()["master_restarts"] == 1, 60, "the sink noticing the restarted master")
        after = capture("after", 3)
        assert "error" not in after, after
        with _sf_store(m) as store:
            assert _read(store, after)["target"].shape == (1, 6, H)
            with pytest.raises(KeyError):
                _read(store, before)
        w.close()
    finally:
        _close_sinks()
        m.stop(kill=True)
