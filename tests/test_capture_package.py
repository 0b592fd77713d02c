"""The SGLang-side package (sglang-overlay/) on its own, without SGLang: settings and layer-id
conventions, the dump key, the bounded host staging, the writer, and the capture routing
(set_eagle3_layers / after_model) on a small torch model shaped like DeepseekV2ForCausalLM.

The smoke tests prove the same package inside real SGLang; these pin its parts down."""

from __future__ import annotations

import hashlib
import json
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from eaglepatch.overlay import import_package  # noqa: E402

pkg = import_package("e3c_under_test")
settings = sys.modules["e3c_under_test.settings"]
staging_mod = __import__("e3c_under_test.staging", fromlist=["HostStaging"])
dump_mod = __import__("e3c_under_test.dump", fromlist=["DumpWriter"])
identity = sys.modules["e3c_under_test.identity"]
control = __import__("e3c_under_test.control", fromlist=["ControlServer"])


# ---- settings and conventions ------------------------------------------------------------------

def test_layer_ids_from_minus_one_to_last_layer():
    # the pinned release (0.5.9) reads every list k -> k + 1: -1 = embedding, 60 = the last layer
    # before the final norm (capture index 61 = N)
    assert settings.reading() == "plus_one"
    assert settings.capture_indices([-1, 0, 30, 60], 61, "x") == [0, 1, 31, 61]
    assert settings.capture_indices([30, -1], 61, "x") == [31, 0]  # the order given; capture is in layer order
    for bad, needle in (([61], r"ids \[61\] are out of range"), ([-2], r"ids \[-2\] are out of range"),
                        ([-1, 2, 61], r"ids \[61\] are out of range"), ([1, 1], "a layer twice"),
                        ([], "is empty")):
        with pytest.raises(settings.DumpConfigError, match=needle):
            settings.capture_indices(bad, 61, "x")


def test_conventions_agree():
    # capture index i = HF output_hidden_states index i; the dump names it layer.<i - 1>
    assert [settings.layer_output_id(i) for i in (0, 1, 61)] == [-1, 0, 60]
    assert settings.default_capture_indices(61) == [2, 30, 58]  # upstream's [2, N//2, N-3]
    assert settings.default_capture_indices(4) == [1, 2]  # small models repeat a default index


def test_settings_from_env():
    s = settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d", "EAGLE3_DUMP_LAYERS": "-1, 2,60",
                                        "EAGLE3_DUMP_FINAL": "off", "EAGLE3_DUMP_MAX_PENDING_MB": "1.5"})
    assert (s.directory, s.layer_ids, s.final, s.max_pending_bytes) == ("/d", [-1, 2, 60], False, 1572864)
    assert s.writers is None  # the default: commits.default_writers() at start
    assert settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d", "EAGLE3_DUMP_WRITERS": " 6 "}).writers == 6
    assert s.gil_switch_ms is None  # the interpreter's own interval
    assert settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d", "EAGLE3_DUMP_GIL_SWITCH_MS": " 0.5 "}).gil_switch_ms == 0.5
    assert settings.DumpSettings.from_env({}) is None
    assert settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d"}).capture_indices(4) == [1, 2]
    assert settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d", "EAGLE3_DUMP_LAYERS": "3,-1"}).capture_indices(4) == [0, 4]
    for env, needle in [({"EAGLE3_DUMP_LAYERS": "1,x"}, "comma-separated"),
                        ({"EAGLE3_DUMP_LAYERS": ","}, "names no layer"),
                        ({"EAGLE3_DUMP_FINAL": "maybe"}, "not a boolean"),
                        ({"EAGLE3_DUMP_MAX_PENDING_MB": "0"}, "positive finite number"),
                        ({"EAGLE3_DUMP_WRITERS": "0"}, "whole number from 1 to 64"),
                        ({"EAGLE3_DUMP_WRITERS": "65"}, "whole number from 1 to 64"),
                        ({"EAGLE3_DUMP_WRITERS": "2.5"}, "whole number from 1 to 64"),
                        ({"EAGLE3_DUMP_GIL_SWITCH_MS": "0"}, "positive finite number of milliseconds"),
                        ({"EAGLE3_DUMP_GIL_SWITCH_MS": "nan"}, "positive finite number of milliseconds"),
                        ({"EAGLE3_DUMP_GIL_SWITCH_MS": "101"}, "more than 100 milliseconds")]:
        with pytest.raises(settings.DumpConfigError, match=needle):
            settings.DumpSettings.from_env(dict(env, EAGLE3_DUMP_DIR="/d"))


def test_serve_checks_the_dump_s_own_bounds_and_defaults():
    """tools/serve.py checks a setting before the server starts with copies of the dump's bounds and
    defaults (it imports no SGLang): they are the dump's."""
    from eaglepatch import serve

    assert (serve.MAX_WRITERS, serve.MAX_GIL_SWITCH_MS, serve.DEFAULT_DRAIN_S) == (
        settings.MAX_WRITERS, settings.MAX_GIL_SWITCH_MS, settings.DEFAULT_DRAIN_S)
    ms = {st.var: st for st in serve.DUMP_SETTINGS}["EAGLE3_DUMP_GIL_SWITCH_MS"]
    assert ms.most == settings.MAX_GIL_SWITCH_MS


def test_keys_are_sha256_of_the_request_id_and_of_the_ids():
    assert dump_mod.request_key("r-1") == hashlib.sha256(b"r-1").hexdigest()
    assert dump_mod.request_key("r-1") != dump_mod.request_key("r-2")
    assert dump_mod.prompt_key([1, 2, 3]) == hashlib.sha256(b"1,2,3").hexdigest()
    assert dump_mod.prompt_key(torch.tensor([1, 2, 3])) == dump_mod.prompt_key([1, 2, 3])


# ---- the host staging: one arena, allocated at start ----------------------------------------------

HIDDEN = 7168
GIB = 1 << 30


def _job_sizes(tokens: int) -> list:
    """The buffers of one prefill at hidden 7168, bf16: ids (int64), 3 layers and final."""
    return [tokens * 8] + [tokens * HIDDEN * 2] * 4


class _CountAllocations:
    """Counts host tensor allocations (torch.empty/zeros/ones, pin_memory) while active."""

    NAMES = ("empty", "zeros", "ones", "empty_like", "zeros_like")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._wrap(name, real))
        real_pin = torch.Tensor.pin_memory
        monkeypatch.setattr(torch.Tensor, "pin_memory", self._wrap("pin_memory", real_pin))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)
        return counted


def _span(buf):
    return buf.data_ptr(), buf.data_ptr() + buf.numel()


def _drive(st, pattern: str, jobs: int = 400, seed: int = 0) -> dict:
    """Submit jobs of the pattern's sizes from this thread; a writer thread releases them in
    order after a short delay. Every buffer handed out must lie inside the arena, apart from
    every other buffer in flight."""
    rng = random.Random(seed)
    if pattern == "random":
        tokens = [rng.randint(1, 16384) for _ in range(jobs)]
    elif pattern == "sorted":
        tokens = sorted(rng.randint(1, 16384) for _ in range(jobs))
    else:  # slowly growing batches
        tokens = [64 + 40 * i for i in range(jobs)]
    cap = st.cap
    base = st.arena.untyped_storage().data_ptr()
    q: list = []
    cv = threading.Condition()
    done, live, overlaps = [], {}, []

    def writer():
        while True:
            with cv:
                while not q:
                    cv.wait()
                item = q.pop(0)
            if item is None:
                return
            time.sleep(0.0002)
            with cv:
                for b in item:
                    live.pop(b.data_ptr())
            st.release(item)
            done.append(1)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        for n in tokens:
            sizes = _job_sizes(n)
            bufs = st.reserve(sizes)
            assert [b.numel() >= s for b, s in zip(bufs, sizes)] == [True] * len(sizes)
            with cv:
                for b in bufs:
                    assert b.untyped_storage().data_ptr() == base  # a view of the arena, no copy
                    lo, hi = _span(b)
                    assert base <= lo and hi <= base + cap
                    overlaps += [(lo, hi) for a, z in live.values() if lo < z and a < hi]
                    live[lo] = (lo, hi)
                q.append(bufs)
                cv.notify()
    finally:
        with cv:
            q.append(None)
            cv.notify()
        t.join(60)
    return {"done": len(done), "overlaps": overlaps}


@pytest.mark.parametrize("pattern", ["random", "sorted", "growing"])
def test_staging_is_one_arena_of_the_cap_and_allocates_nothing_after_start(pattern, monkeypatch):
    cap = 2 * GIB
    counter = _CountAllocations(monkeypatch)
    st = staging_mod.HostStaging(cap, pinned=False)
    assert counter.calls == ["empty"]  # the arena, at start
    assert st.arena.untyped_storage().nbytes() == cap and st.allocated == cap
    counter.calls.clear()
    r = _drive(st, pattern)
    assert counter.calls == [], "host tensors allocated on the forward path: %s" % counter.calls[:5]
    assert r["done"] == 400 and not r["overlaps"]
    assert st.in_use == 0 and st.queued == 0
    assert 0 < st.peak_in_use <= cap and st.peak_allocated == cap  # nothing beside the arena
    assert st.alloc.free_ranges == [(0, cap)]  # every block came back and merged


def test_arena_allocator_first_fit_merges_and_wraps_around():
    a = staging_mod.ArenaAllocator(1000)
    assert [a.alloc(300), a.alloc(300), a.alloc(300)] == [0, 300, 600]
    assert a.alloc(200) is None  # 100 bytes left at the end
    a.free(0)
    assert a.alloc(200) == 0  # wraps around to the front
    assert a.free_ranges == [(200, 100), (900, 100)]
    a.free(600)  # merges with the tail
    assert a.free_ranges == [(200, 100), (600, 400)]
    assert a.alloc(350) == 600  # first fit: the front hole is too small
    a.free(300)  # merges with the hole before it
    assert a.free_ranges == [(200, 400), (950, 50)]
    assert a.largest_free == 400 and a.free_bytes == 450
    assert a.alloc(450) is None  # fragmented: 450 bytes free, not in one range
    a.free(0), a.free(600)
    assert a.free_ranges == [(0, 1000)] and not a.used


def test_arena_allocator_never_overlaps_under_random_use():
    rng = random.Random(3)
    size = 1 << 16
    a = staging_mod.ArenaAllocator(size)
    owner = [None] * size  # byte -> block offset
    live = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) > 40):
            off = live.pop(rng.randrange(len(live)))
            n = a.free(off)
            assert all(owner[i] == off for i in range(off, off + n))
            owner[off:off + n] = [None] * n
        else:
            n = rng.randint(1, 5000)
            off = a.alloc(n)
            if off is None:  # refused only when no free range is large enough
                assert a.largest_free < n
                continue
            assert all(o is None for o in owner[off:off + n]), "overlap at step %d" % step
            owner[off:off + n] = [off] * n
            live.append(off)
        assert a.free_bytes == owner.count(None)
        assert all(x[0] + x[1] < y[0] for x, y in zip(a.free_ranges, a.free_ranges[1:]))  # merged
    for off in live:
        a.free(off)
    assert a.free_ranges == [(0, size)]


def _reserve_in_background(st, sizes):
    """``st.reserve(sizes)`` on a thread of its own, given 0.3 s: ``(thread, got)``, ``got``
    empty while the reservation still waits."""
    got = []
    t = threading.Thread(target=lambda: got.append(st.reserve(sizes)), daemon=True)
    t.start()
    time.sleep(0.3)
    return t, got


def test_a_forward_waits_only_for_a_full_arena_and_the_wait_is_counted_and_logged(caplog):
    st = staging_mod.HostStaging(4096, pinned=False)
    a = st.reserve([1500, 1000])  # 1536 + 1024 bytes of the arena
    b = st.reserve([1000])
    assert st.waits == 0 and st.wait_s_total == 0  # these fit: no wait
    t, got = _reserve_in_background(st, [1400])
    assert not got, "the arena had no room for 1400 bytes; the forward must wait for the writer"
    st.release(a)
    t.join(5)
    assert got and st.in_arena(got[0][0])
    assert st.waits == 1 and 0.25 <= st.wait_s_max <= st.wait_s_total < 5
    assert "a forward waited" in caplog.text and "back-pressure" in caplog.text
    assert "forward waits: 1" in st.summary()
    st.release(b), st.release(got[0])
    assert st.alloc.free_ranges == [(0, 4096)]


def test_an_oversized_forward_goes_through_pageable_buffers_one_at_a_time():
    st = staging_mod.HostStaging(1000, pinned=False)
    a = st.reserve([600])
    big = st.reserve([3000, 10])  # larger than the whole arena: does not wait for `a`
    assert st.waits == 0 and st.oversized == 1
    assert not any(st.in_arena(x) for x in big) and big[0].numel() == 3000
    assert st.allocated == 1000 + 3072 + 256  # the arena + the oversized rows (aligned)
    t, got = _reserve_in_background(st, [5000])
    assert not got, "a second oversized forward must wait until the first is written"
    st.release(big)
    t.join(5)
    assert got and st.oversized == 2 and st.waits == 1
    st.release(got[0]), st.release(a)
    assert st.allocated == 1000 and st.in_use == 0 and st.alloc.free_ranges == [(0, 1000)]


def test_a_chunked_request_larger_than_the_cap_is_held_outside_the_arena():
    st = staging_mod.HostStaging(4096, pinned=False)
    held = st.try_reserve([8000, 2000], alone=True)  # one request alone may pass the cap
    assert held is not None and not any(st.in_arena(x) for x in held)
    assert st.chunk_bytes == 10000 and st.try_reserve([10], alone=False) is None
    f = st.reserve([4000])  # the forward's arena is untouched by the held rows: no wait
    assert st.in_arena(f[0]) and st.waits == 0
    st.release(f)
    st.release(held, queued=False)
    assert st.chunk_bytes == 0 and st.in_use == 0 and st.peak_chunk_bytes == 10000
    assert st.try_reserve([400], alone=False) is not None  # under the cap beside nothing


def test_a_rank_that_writes_nothing_holds_no_arena():
    st = staging_mod.HostStaging(1 << 30, pinned=False, allocate=False)
    assert st.arena.numel() == 0 and st.allocated == 0 and st.cap == 1 << 30
    with pytest.raises(RuntimeError, match="no arena"):
        st.reserve([10])


# ---- the writer -----------------------------------------------------------------------------------

class _Mode:
    def __init__(self, name):
        self.name = name


class _Batch:
    """The ForwardBatch fields the writer reads, and the requests ``identity`` attaches to a
    prefill's ForwardBatch (``rids``; ``totals``: each prompt's length)."""

    def __init__(self, ids, seq_lens, prefix_lens=None, mode="EXTEND", slots=None, totals=None, rids=None,
                 infos=None):
        self.forward_mode = _Mode(mode)
        self.input_ids = ids
        self.extend_seq_lens_cpu = list(seq_lens)
        self.extend_prefix_lens_cpu = list(prefix_lens or [0] * len(seq_lens))
        n = len(seq_lens)
        self.req_pool_indices = torch.tensor(slots if slots is not None else list(range(n)))
        pre = self.extend_prefix_lens_cpu
        totals = totals if totals is not None else [a + b for a, b in zip(pre, seq_lens)]
        rids = rids if rids is not None else [f"r{i}" for i in range(n)]
        self._eagle3_requests = infos if infos is not None else [
            identity.RequestInfo(rid, int(t)) for rid, t in zip(rids, totals)]


def _idx(layer_ids):
    """The pinned release's capture indices of layer-output ids (k -> k + 1): DumpWriter's input."""
    return [k + 1 for k in layer_ids]


def _states(lens, layer_ids, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    ids = torch.randint(2, 1000, (total,), generator=g)
    captured = {k + 1: torch.randn(total, hidden, generator=g) for k in layer_ids}
    return ids, captured, torch.randn(total, hidden, generator=g)


def test_writer_splits_requests_and_skips_what_it_cannot_write(tmp_path):
    from safetensors import safe_open

    layers = [-1, 1, 3]
    w = dump_mod.DumpWriter(str(tmp_path), _idx(layers), True, 1 << 20, {"format": "eagle3-dump/1"})
    lens = [3, 5, 4]
    ids, cap, fin = _states(lens, layers)
    w.submit(_Batch(ids, lens, [0, 2, 0]), cap, fin)  # the middle one has a cached prefix
    w.submit(_Batch(ids[:3], [3], mode="DECODE"), cap, fin)  # decode writes nothing
    w.flush()
    files = sorted(p.name for p in tmp_path.iterdir())
    keys = [dump_mod.request_key("r0"), dump_mod.request_key("r2")]
    assert files == sorted(k + ".safetensors" for k in keys)
    assert (w.written, w.skipped, w.failed) == (2, 1, 0)
    with safe_open(str(tmp_path / (keys[1] + ".safetensors")), "pt") as f:
        assert f.get_tensor("input_ids").tolist() == ids[8:].tolist()
        for k in layers:
            assert torch.equal(f.get_tensor(f"layer.{k}"), cap[k + 1][8:])
        assert torch.equal(f.get_tensor("final"), fin[8:])
        meta = f.metadata()
    assert meta["key"] == keys[1] and meta["num_tokens"] == "4" and meta["rid"] == "r2"
    assert meta["prompt_key"] == dump_mod.prompt_key(ids[8:].tolist())
    w.close()


# ---- capture routing on a model shaped like DeepseekV2ForCausalLM ---------------------------------

class _Norm(torch.nn.Module):
    """RMSNorm with sglang's calling convention: norm(x) or norm(x, residual) -> (normed, x + residual)."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = x + residual
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6), s


class _Inner(torch.nn.Module):
    """DeepseekV2Model's capture loop (0.5.9 style): index i = stream entering layer i."""

    def __init__(self, n, hidden=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(n))
        self.norm = _Norm()
        self.layers_to_capture = []

    def forward(self, x):
        residual, aux = None, []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(pkg.residual_stream(x, residual))
            residual = x if residual is None else x + residual
            x = layer(residual)
        final, _ = self.norm(x, residual)
        return (final, aux) if aux else final


class _Model(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=n)
        self.model = _Inner(n)
        self.capture_aux_hidden_states = False

    def forward(self, x):
        out = pkg.after_model(self, self.model(x), None)
        if self.capture_aux_hidden_states:
            return out
        return out, None

    def reference(self, x):
        """Every residual-stream state: [embed, out of layer 0, ..., out of layer N-1 (pre-norm)]."""
        states, residual = [x], None
        for layer in self.model.layers:
            residual = x if residual is None else x + residual
            x = layer(residual)
            states.append(x + residual)
        return states


@torch.no_grad()
def test_eagle_ids_include_the_last_layer_before_the_norm():
    m = _Model(4)
    x = torch.randn(5, 8)
    ref = m.reference(x)
    pkg.set_eagle3_layers(m, [-1, 1, 3])
    assert m.model.layers_to_capture == [0, 2]  # index 4 (after the last layer) comes from the norm hook
    final, aux = m(x)
    assert len(aux) == 3
    for got, k in zip(aux, [-1, 1, 3]):
        assert torch.allclose(got, ref[k + 1], atol=1e-6)
    # a wrong reading of the ids (shifted by one) or a normed last state would not match
    assert not torch.allclose(aux[1], ref[1], atol=1e-3)
    assert not torch.allclose(aux[2], final, atol=1e-3)
    # a call without ids keeps the configured set
    pkg.set_eagle3_layers(m)
    assert m.model.layers_to_capture == [0, 2]
    _, aux2 = m(x)
    assert all(torch.equal(a, b) for a, b in zip(aux, aux2))


@torch.no_grad()
def test_only_the_last_layer_and_reconfiguration_removes_the_hook():
    m = _Model(3)
    x = torch.randn(4, 8)
    pkg.set_eagle3_layers(m, [2])
    assert m.model.layers_to_capture == []  # the model returns a bare tensor; after_model adds aux
    _, aux = m(x)
    assert torch.allclose(aux[0], m.reference(x)[3], atol=1e-6)
    pkg.set_eagle3_layers(m, [0])
    assert m.model.layers_to_capture == [1] and not m.model.norm._forward_hooks


@torch.no_grad()
@pytest.mark.parametrize("eagle", [[-1, 1], [1], [3], [-1, 1, 3]])  # 4 layers: 3 = the last
@pytest.mark.parametrize("dump", [None, [-1], [0], [3]])
@pytest.mark.parametrize("form", ["list", "packed"])
@pytest.mark.parametrize("capture", [True, False])
def test_after_model_returns_the_same_structure_on_every_route(tmp_path, eagle, dump, form, capture):
    """after_model skips the routing when nothing needs it (no dump, no final-norm capture, the
    draft takes exactly the loop's captures); every configuration, on that path or the full
    one, hands back the final state itself and the draft's states in the release's form: the
    upstream aux object where it holds exactly the draft's layers, else the subset in index
    order (the captured tensors themselves in a list, or packed into one tensor)."""
    m = _Model(4)
    pkg.set_eagle3_layers(m, eagle)
    state = m._eagle3_capture_state
    if dump is not None:
        state.writer = dump_mod.DumpWriter(str(tmp_path), _idx(dump), True, 1 << 20, {}, enabled=False)
        pkg._sync(m, state)
    m.capture_aux_hidden_states = capture
    wanted = sorted({k + 1 for k in eagle + (dump or [])})
    in_loop = [i for i in wanted if i < 4]
    assert m.model.layers_to_capture == in_loop
    assert state.passthrough == (dump is None and 3 not in eagle)
    states = {i: torch.randn(3, 8) for i in range(5)}
    final = torch.randn(3, 8)
    if not in_loop:
        output = final  # the loop captured nothing: the model returns the bare final state
    elif form == "list":
        output = (final, [states[i] for i in in_loop])
    else:
        output = (final, torch.cat([states[i] for i in in_loop], dim=-1))
    if 4 in wanted:
        state.last = states[4]  # what the final-norm hook keeps
    draft = sorted(k + 1 for k in eagle)
    if capture and form == "packed" and in_loop and not draft:
        with pytest.raises((RuntimeError, ValueError)):  # no draft layers to pack: torch.cat([])
            pkg.after_model(m, output, None)
        return
    out = pkg.after_model(m, output, None)
    assert state.last is None
    if not capture:
        assert out is final
        return
    got_final, got_aux = out
    assert got_final is final
    if isinstance(output, tuple) and draft == in_loop:
        assert got_aux is output[1]
    elif form == "packed" and in_loop:
        assert torch.equal(got_aux, torch.cat([states[i] for i in draft], dim=-1))
    else:
        assert isinstance(got_aux, list) and len(got_aux) == len(draft)
        if form == "list" or not in_loop:
            assert all(a is states[i] for a, i in zip(got_aux, draft))
        else:
            assert all(torch.equal(a, states[i]) for a, i in zip(got_aux, draft))


# ---- chunked prefill: a request's rows gathered across forwards ------------------------------------

class _Prefill:
    """Requests with their full rows; `forward(...)` cuts them into the chunks a scheduler makes."""

    def __init__(self, lens, layers, hidden=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.layers = layers
        self.reqs = []
        for n in lens:
            self.reqs.append({"ids": torch.randint(2, 1000, (n,), generator=g),
                              "layers": {k: torch.randn(n, hidden, generator=g) for k in layers},
                              "final": torch.randn(n, hidden, generator=g)})

    def forward(self, writer, parts):
        """parts: [(request index, slot, start row, rows)] in batch order."""
        ids, lay, fin = [], {k: [] for k in self.layers}, []
        for r, _, a, n in parts:
            req = self.reqs[r]
            ids.append(req["ids"][a:a + n])
            fin.append(req["final"][a:a + n])
            for k in self.layers:
                lay[k].append(req["layers"][k][a:a + n])
        batch = _Batch(torch.cat(ids), [n for *_, n in parts], [a for _, _, a, _ in parts],
                       slots=[s for _, s, _, _ in parts], totals=[len(self.reqs[r]["ids"]) for r, *_ in parts],
                       rids=[self.rid(r) for r, *_ in parts])
        captured = {k + 1: torch.cat(v) for k, v in lay.items()}
        writer.submit(batch, captured, torch.cat(fin))

    @staticmethod
    def rid(r) -> str:
        return f"req-{r}"

    def path(self, directory, r):
        return directory / (dump_mod.request_key(self.rid(r)) + ".safetensors")

    def check(self, directory, r):
        from safetensors import safe_open

        req = self.reqs[r]
        path = self.path(directory, r)
        with safe_open(str(path), "pt") as f:
            assert torch.equal(f.get_tensor("input_ids"), req["ids"])
            if "final" in f.keys():
                assert torch.equal(f.get_tensor("final"), req["final"])
            for k in self.layers:
                assert torch.equal(f.get_tensor(f"layer.{k}"), req["layers"][k])
            assert f.metadata()["num_tokens"] == str(len(req["ids"]))


def test_chunked_requests_are_gathered_and_written_once(tmp_path):
    layers = [-1, 2]
    pf = _Prefill([150, 30, 64, 10], layers)
    w = dump_mod.DumpWriter(str(tmp_path), _idx(layers), True, 1 << 20, {}, chunked=True)
    # the forwards sglang made with --chunked-prefill-size 64 (see dump.py): request 0 over
    # three forwards, request 2 over two, requests 1 and 3 whole, several in one forward
    pf.forward(w, [(0, 0, 0, 64)])
    pf.forward(w, [(0, 0, 64, 64)])
    pf.forward(w, [(0, 0, 128, 22), (1, 1, 0, 30), (2, 2, 0, 12)])
    pf.forward(w, [(2, 2, 12, 52), (3, 3, 0, 10)])
    w.flush()
    assert (w.written, w.dropped, w.failed) == (4, 0, 0)
    assert len(list(tmp_path.iterdir())) == 4
    for r in range(4):
        pf.check(tmp_path, r)
    assert w.staging.in_use == 0
    w.close()


def test_an_abandoned_chunked_request_writes_nothing_and_is_counted(tmp_path, caplog):
    layers = [1]
    pf = _Prefill([100, 100, 20], layers)
    w = dump_mod.DumpWriter(str(tmp_path), _idx(layers), False, 1 << 20, {}, chunked=True)
    pf.forward(w, [(0, 5, 0, 40)])
    pf.forward(w, [(2, 6, 0, 20)])  # request 0 is not continued: aborted between chunks
    pf.forward(w, [(1, 5, 0, 40)])  # its slot is reused by a new request
    pf.forward(w, [(1, 5, 60, 40)])  # a chunk of request 1 is missing
    w.flush()
    assert (w.written, w.dropped) == (1, 2)
    pf.check(tmp_path, 2)
    assert [p for p in tmp_path.iterdir()] == [pf.path(tmp_path, 2)]
    assert "not dumped" in caplog.text
    assert w.staging.in_use == 0
    w.close()


def test_chunked_rows_over_the_cap_never_make_the_forward_wait(tmp_path):
    """Rows held for an unfinished request only the writer frees; they must never make the
    forward wait. They are held outside the forwards' arena: the one request being chunked may
    pass the cap alone, another one that does not fit is dropped and counted. The writer is
    slowed (0.5 s a file) so that a forward waiting for it would show in its time."""
    layers = [1]
    pf = _Prefill([2000, 10, 900], layers, hidden=64)
    per_row = 64 * 4 * 2 + 8  # one layer + final (float32) + the id
    cap = 1_500_000  # request 0 alone: 2000 rows = 1.04 MB; with request 2 (900 rows) 1.51 MB
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), True, cap, {}, chunked=True)
    real_write = w._write

    def slow_write(*args, **kwargs):
        time.sleep(0.5)
        return real_write(*args, **kwargs)

    w._write = slow_write
    times, done = [], threading.Event()

    def forward(parts):
        t0 = time.perf_counter()
        pf.forward(w, parts)
        times.append(time.perf_counter() - t0)

    def run():
        forward([(0, 0, 0, 500)])
        forward([(0, 0, 500, 500), (2, 2, 0, 300)])  # a second chunked request: no room
        forward([(0, 0, 1000, 1000), (2, 2, 300, 300), (1, 1, 0, 10)])  # writes 0 and 1: 1 s
        forward([(2, 2, 600, 300)])  # fits in the arena beside the forward above
        w.flush()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30)
    assert (w.written, w.dropped) == (2, 1)
    pf.check(tmp_path, 0)
    pf.check(tmp_path, 1)
    assert max(times) < 0.25, "a forward waited %.3f s for the writer" % max(times)
    assert w.staging.waits == 0 and w.staging.wait_s_max == 0, w.staging.summary()
    assert w.staging.peak_chunk_bytes == 2000 * per_row
    assert w.staging.peak_allocated == cap + 2000 * per_row  # the arena + request 0's rows
    assert w.staging.in_use == 0 and w.staging.chunk_bytes == 0
    w.close()


def test_image_pad_values_are_stored_as_the_placeholder_id(tmp_path):
    """A multimodal wrapper replaces image tokens by pad values (>= the vocabulary) and clamps
    them in place; the dump stores and keys the ids with the placeholder id instead."""
    from safetensors import safe_open

    ph, vocab = 1000, 1024
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {}, placeholder_id=ph, vocab_size=vocab)
    text = torch.tensor([5, 6, 7, 8, 9])
    raw = torch.tensor([5, 6, 7, 1_069_556_834, 1_069_556_834, 8, 9])
    processor_ids = [5, 6, 7, ph, ph, 8, 9]
    clamped = raw.clamp(0, vocab - 1)
    lens = [5, 7]
    states = {2: torch.randn(12, 4)}
    w.submit(_Batch(torch.cat([text, clamped]), lens), states, None, input_ids=torch.cat([text, raw]))
    w.submit(_Batch(clamped, [7]), {2: torch.randn(7, 4)}, None)  # no ids from before the clamp
    w.flush()
    names = sorted(p.name for p in tmp_path.iterdir())
    want = sorted(dump_mod.request_key(r) + ".safetensors" for r in ("r0", "r1"))
    assert names == want and w.failed == 1
    with safe_open(str(tmp_path / (dump_mod.request_key("r1") + ".safetensors")), "pt") as f:
        assert f.get_tensor("input_ids").tolist() == processor_ids
        assert f.metadata()["prompt_key"] == dump_mod.prompt_key(processor_ids)
    w.close()


def test_dump_files_are_readable_by_other_users_whatever_the_umask(tmp_path):
    """A client of another user reads the shared dump directory: files are 0644 even under umask 077."""
    import os

    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), True, 1 << 20, {"format": "eagle3-dump/1"})
    ids, cap, fin = _states([4], [1])
    old = os.umask(0o077)
    try:
        w.submit(_Batch(ids, [4]), cap, fin)
        w.flush()
    finally:
        os.umask(old)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o644, oct(files[0].stat().st_mode)


# ---- request identity, lost data, durability (issue 19) ---------------------------------------------

def _read(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_requests_that_share_a_prompt_image_text_or_adapter_never_share_a_file(tmp_path):
    """The same ids from different requests (identical prompts in one batch, two images padded to
    the same placeholder ids, input_embeds placeholders, two LoRA adapters): one file each, named
    by the request id, recording what tells them apart."""
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {}, placeholder_id=1000, vocab_size=1024)
    same = torch.tensor([5, 6, 7, 8])
    infos = [identity.RequestInfo("a", 4), identity.RequestInfo("b", 4),
             identity.RequestInfo("img-1", 4, mm_hashes=(11,)), identity.RequestInfo("img-2", 4, mm_hashes=(22,)),
             identity.RequestInfo("emb", 4, input_embeds=True),
             identity.RequestInfo("lora-x", 4, lora_id="x"), identity.RequestInfo("lora-y", 4, lora_id="y")]
    n = len(infos)
    rows = torch.randn(4 * n, 4)
    w.submit(_Batch(same.repeat(n), [4] * n, infos=infos), {2: rows}, None, input_ids=same.repeat(n))
    w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(i.key + ".safetensors" for i in infos)
    for j, info in enumerate(infos):
        got, meta = _read(tmp_path / (info.key + ".safetensors"))
        assert torch.equal(got["layer.1"], rows[4 * j: 4 * j + 4])
        assert meta["rid"] == info.rid and meta["lora_id"] == info.lora_id
        assert json.loads(meta["mm_hashes"]) == list(info.mm_hashes)
        assert meta["input_source"] == ("input_embeds" if info.input_embeds else "input_ids")
        assert meta["prompt_key"] == dump_mod.prompt_key(same.tolist())
    w.close()


def test_a_retracted_request_prefilled_again_costs_no_other_request_its_file(tmp_path):
    """A request retracted under memory pressure is prefilled again, prompt and generated tokens,
    in chunks: its file (from the first prefill) stays as it was, it is not written again, and the
    ordinary request batched after it is written."""
    layers = [1]
    pf = _Prefill([10, 4, 4], layers)
    w = dump_mod.DumpWriter(str(tmp_path), _idx(layers), True, 1 << 20, {}, chunked=True)
    pf.forward(w, [(0, 0, 0, 10)])  # the first prefill of request 0: written
    w.flush()
    first = pf.path(tmp_path, 0).read_bytes()
    # prefilled again: 10 prompt + 3 generated tokens over two chunks; request 1 rides the second
    g = torch.Generator().manual_seed(5)
    again = {"ids": torch.cat([pf.reqs[0]["ids"], torch.tensor([7, 8, 9])]),
             "layers": {1: torch.randn(13, 16, generator=g)}, "final": torch.randn(13, 16, generator=g)}
    pf.reqs.append(again)
    re = len(pf.reqs) - 1

    def forward(parts, rids):
        ids = torch.cat([pf.reqs[r]["ids"][a:a + n] for r, a, n in parts])
        cap = {2: torch.cat([pf.reqs[r]["layers"][1][a:a + n] for r, a, n in parts])}
        fin = torch.cat([pf.reqs[r]["final"][a:a + n] for r, a, n in parts])
        totals = [10 if r == re else len(pf.reqs[r]["ids"]) for r, _, _ in parts]
        w.submit(_Batch(ids, [n for *_, n in parts], [a for _, a, _ in parts], totals=totals, rids=rids), cap, fin)

    forward([(re, 0, 8)], [pf.rid(0)])
    forward([(re, 8, 5), (1, 0, 4)], [pf.rid(0), pf.rid(1)])
    forward([(2, 0, 4)], [pf.rid(2)])
    w.flush()
    assert pf.path(tmp_path, 0).read_bytes() == first
    pf.check(tmp_path, 1)
    pf.check(tmp_path, 2)
    assert (w.written, w.failed, w.reprefilled) == (3, 0, 1)
    w.close()


def test_one_bad_request_costs_only_its_own_file(tmp_path, monkeypatch, caplog):
    """Anything wrong with one request's rows (here: its prompt length is longer than the rows the
    chunk holds can ever fill) is that request's failure; the others of the forward are written."""
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
    ids, cap, fin = _states([3, 4, 5], [1])
    real_write = w._write

    def write(rows, req, done):
        if req.rid == "r1":
            raise RuntimeError("boom")
        return real_write(rows, req, done)

    monkeypatch.setattr(w, "_write", write)
    w.submit(_Batch(ids, [3, 4, 5]), cap, fin)
    w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(dump_mod.request_key(r) + ".safetensors" for r in ("r0", "r2"))
    assert w.failed == 1 and "request r1" in caplog.text
    assert w.staging.in_use == 0  # the forward's rows went back, the failed request's part included
    w.close()


def test_health_probes_and_warmup_are_not_dumped(tmp_path):
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
    ids, cap, fin = _states([3, 4], [1])
    w.submit(_Batch(ids, [3, 4], rids=["HEALTH_CHECK_1733", "user"]), cap, fin)
    w.paused = True  # the HTTP server's warm-up
    w.submit(_Batch(ids, [3, 4], rids=["warm-1", "warm-2"]), cap, fin)
    w.paused = False
    w.flush()
    assert [p.name for p in tmp_path.iterdir()] == [dump_mod.request_key("user") + ".safetensors"]
    assert (w.written, w.probes, w.warmup) == (1, 1, 2)
    w.close()


def test_a_prefill_without_request_ids_writes_nothing(tmp_path, caplog):
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
    ids, cap, fin = _states([3, 4], [1])
    batch = _Batch(ids, [3, 4])
    batch._eagle3_requests = None
    w.submit(batch, cap, fin)
    w.flush()
    assert list(tmp_path.iterdir()) == [] and w.failed == 2 and "without their request ids" in caplog.text
    w.close()


def test_files_are_fsynced_before_and_after_the_rename_with_names_unique_across_hosts(tmp_path, monkeypatch):
    import os

    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        calls.append(("rename", os.path.basename(a)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for host in ("node-a", "node-b"):  # two replicas writing into one shared directory
        monkeypatch.setattr(sys.modules[dump_mod.__name__.rsplit(".", 1)[0] + ".sinks"], "HOST", host)  # the file sink names its temporaries
        w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
        ids, cap, fin = _states([3], [1])
        w.submit(_Batch(ids, [3], rids=[f"request-on-{host}"]), cap, fin)
        w.flush()
        w.close()
    renames = [c[1] for c in calls if c[0] == "rename"]
    assert len(renames) == 2 and "node-a" in renames[0] and "node-b" in renames[1]
    assert all(n.endswith(".tmp") for n in renames)
    assert calls[:3] == [("fsync", str(tmp_path / renames[0])), ("rename", renames[0]), ("fsync", str(tmp_path))]


def test_no_fsync_in_a_directory_held_in_memory(tmp_path, monkeypatch):
    """A dump directory on tmpfs (/dev/shm): the file is written under a temporary name and renamed,
    without the two fsyncs, which make nothing more durable in memory and cost the writer threads the
    GIL back each (benchmarks/writer_gil.py); on the disk (tmp_path here) both stay. With one
    directory of each, each file follows its own directory. The sink's choice agrees with coreutils'
    ``stat -f`` on the file system type."""
    import os
    import subprocess
    import tempfile

    import safetensors.torch as st

    sinks = sys.modules[dump_mod.__name__.rsplit(".", 1)[0] + ".sinks"]
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    shm = Path(tempfile.mkdtemp(prefix="e3c-test-", dir="/dev/shm"))
    try:
        for d in (shm, tmp_path):
            fstype = subprocess.run(["stat", "-f", "-c", "%T", str(d)], capture_output=True, text=True).stdout.strip()
            assert sinks.memory_backed(str(d)) == (fstype in ("tmpfs", "ramfs")), (d, fstype)
        assert sinks.memory_backed(str(shm)) and not sinks.memory_backed(str(tmp_path)), "needs /tmp on a disk"
        calls = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
        both = os.pathsep.join([str(shm), str(tmp_path)])
        w = dump_mod.DumpWriter(both, _idx([1]), False, 1 << 20, {})
        assert "no fsync in %s: held in memory" % shm in w.sink.describe() and str(tmp_path) not in w.sink.describe()
        rids = [f"r{i}" for i in range(8)]
        ids, cap, fin = _states([3] * 8, [1])
        w.submit(_Batch(ids, [3] * 8, rids=rids), cap, fin)
        w.flush()
        assert w.written == 8 and not w.failed
        files = {d: sorted(p.name for p in d.glob("*.safetensors")) for d in (shm, tmp_path)}
        assert files[shm] and files[tmp_path], files  # the keys spread over both
        assert not [p for d in (shm, tmp_path) for p in d.iterdir() if p.name.endswith(".tmp")]
        for name in files[shm]:  # whole files, readable by others
            assert st.load_file(str(shm / name))["input_ids"].shape[0] == 3 and (shm / name).stat().st_mode & 0o777 == 0o644
        synced = [c for c in calls if not c.endswith("ledger.json")]
        assert not [c for c in synced if c.startswith(str(shm))], synced  # nothing in memory was fsynced
        on_disk = [c for c in synced if c.startswith(str(tmp_path))]
        assert len(on_disk) == 2 * len(files[tmp_path]), on_disk  # each disk file and its directory
        w.close()
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def _same_file(a: Path, b: Path) -> bool:
    """Two safetensors files equal: header length, header (as JSON: safetensors writes the metadata
    from a hash map, in no fixed order) and every data byte."""
    import struct

    x, y = a.read_bytes(), b.read_bytes()
    n, m = struct.unpack("<Q", x[:8])[0], struct.unpack("<Q", y[:8])[0]
    return n == m and json.loads(x[8: 8 + n]) == json.loads(y[8: 8 + m]) and x[8 + n:] == y[8 + m:]


def _shm_dir():
    import os
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    return Path(tempfile.mkdtemp(prefix="e3c-test-", dir="/dev/shm"))


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("memory", [False, True])
def test_files_from_the_forward_s_rows_are_save_file_s_bytes(tmp_path, ids_dtype, memory):
    """Whole text requests are written straight from the forward's host rows (addresses, no view
    per request); a chunked request from its own buffers; ids int64 or int32 (copied to int64), on a
    disk and in memory. Every file is byte for byte what safetensors' ``save_file`` writes of the
    request's rows, cut from the forward's inputs here, with the file's own metadata (header compared
    as JSON: safetensors orders the metadata keys as a hash map does). The comparison fails on a file
    written from an address one row off (the check's wrong input)."""
    import shutil

    from safetensors import TensorSpec
    from safetensors.torch import save_file

    d = _shm_dir() if memory else tmp_path
    try:
        layers = [-1, 1, 3]
        w = dump_mod.DumpWriter(str(d), _idx(layers), True, 1 << 20, {"format": "eagle3-dump/1"}, chunked=True)
        lens = [5, 1, 7, 3]
        ids, cap, fin = _states(lens, layers, hidden=24, seed=3)
        ids = ids.to(ids_dtype)
        w.submit(_Batch(ids, lens), cap, fin)
        # the first 4 of r9's 6 rows, then the last 2: written from its own buffers
        ids2, cap2, fin2 = _states([4], layers, hidden=24, seed=4)
        w.submit(_Batch(ids2.to(ids_dtype), [4], totals=[6], rids=["r9"]), cap2, fin2)
        ids3, cap3, fin3 = _states([2], layers, hidden=24, seed=5)
        w.submit(_Batch(ids3.to(ids_dtype), [2], prefix_lens=[4], totals=[6], rids=["r9"]), cap3, fin3)
        w.flush()
        assert (w.written, w.failed, w.dropped) == (5, 0, 0)
        sources = {"r9": (torch.cat([ids2, ids3]), {k: torch.cat([cap2[k], cap3[k]]) for k in cap2},
                          torch.cat([fin2, fin3]), 0, 6)}
        start = 0
        for i, n in enumerate(lens):
            sources[f"r{i}"] = (ids, cap, fin, start, n)
            start += n
        for rid, (i_, c_, f_, a, n) in sources.items():
            path = d / (dump_mod.request_key(rid) + ".safetensors")
            tensors, meta = _read(path)
            expected = {"input_ids": i_[a: a + n].to(torch.int64), "final": f_[a: a + n]}
            expected.update({f"layer.{k}": c_[k + 1][a: a + n] for k in layers})
            assert sorted(tensors) == sorted(expected), rid
            save_file(expected, str(tmp_path / "expected.safetensors"), metadata=meta)
            assert _same_file(path, tmp_path / "expected.safetensors"), rid
        # the wrong input: r2's file written from the rows one below its own
        ids64 = ids.to(torch.int64)
        specs = {name: TensorSpec(dtype=str(t.dtype).split(".")[-1], shape=list(t[6:13].shape),
                                  data_ptr=t[7:14].data_ptr(), data_len=t[6:13].numel() * t.element_size())
                 for name, t in {"final": fin, **{f"layer.{k}": cap[k + 1] for k in layers}}.items()}
        specs["input_ids"] = TensorSpec(dtype="int64", shape=[7], data_ptr=ids64[6:13].data_ptr(), data_len=56)
        _, meta = _read(d / (dump_mod.request_key("r2") + ".safetensors"))
        w.sink.commit("wrong", specs, meta)
        expected = {"input_ids": ids64[6:13], "final": fin[6:13], **{f"layer.{k}": cap[k + 1][6:13] for k in layers}}
        save_file(expected, str(tmp_path / "expected.safetensors"), metadata=meta)
        assert not _same_file(d / "wrong.safetensors", tmp_path / "expected.safetensors")
        w.close()
    finally:
        if memory:
            shutil.rmtree(d, ignore_errors=True)


def test_a_safetensors_without_tensorspec_writes_every_file_through_save_file(tmp_path, monkeypatch):
    """safetensors before 0.8 has no ``TensorSpec``: the writer then writes every file through
    ``save_file`` (the general path), the same files, and the start line says so."""
    sinks = sys.modules["e3c_under_test.sinks"]
    monkeypatch.setattr(sinks, "TensorSpec", None)
    monkeypatch.setattr(dump_mod, "TensorSpec", None)
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), True, 1 << 20, {"format": "eagle3-dump/1"})
    assert "every file through save_file" in w.sink.describe()
    ids, cap, fin = _states([3, 4], [1])
    w.submit(_Batch(ids, [3, 4]), cap, fin)
    w.flush()
    assert (w.written, w.failed) == (2, 0)
    tensors, meta = _read(tmp_path / (dump_mod.request_key("r1") + ".safetensors"))
    assert tensors["input_ids"].tolist() == ids[3:].tolist() and torch.equal(tensors["layer.1"], cap[2][3:])
    assert meta["prompt_key"] == dump_mod.prompt_key(ids[3:].tolist())
    w.close()


def test_in_memory_the_commit_keeps_the_gil_through_its_metadata_calls(tmp_path, monkeypatch):
    """In a directory held in memory a file's existence check, chmod and rename are libc calls that
    keep the GIL (``sinks.HELD``): ``os``'s would each give it away beside the scheduler's thread.
    With ``os.chmod``, ``os.replace`` and ``os.open`` made to fail in the writer's modules, files are
    still written there, mode 0644 whatever the umask; on the disk the same calls go through ``os``
    (they fail here, by name). A held rename that fails (a directory at the file's name) fails that
    request by name and leaves no temporary file."""
    import os
    import shutil

    sinks = sys.modules["e3c_under_test.sinks"]
    shm = _shm_dir()
    try:
        def refuse(*a, **kw):
            raise OSError("the os call this path must not make")

        for mod in (sinks.os, dump_mod.os):
            monkeypatch.setattr(mod, "chmod", refuse)
            monkeypatch.setattr(mod, "replace", refuse)
            monkeypatch.setattr(mod, "open", refuse)
        w = dump_mod.DumpWriter(str(shm), _idx([1]), False, 1 << 20, {})
        assert "the write keep the GIL" in w.sink.describe()
        ids, cap, fin = _states([3, 4], [1])
        old = os.umask(0o077)
        try:
            w.submit(_Batch(ids, [3, 4]), cap, fin)
            w.flush()
        finally:
            os.umask(old)
        assert (w.written, w.failed) == (2, 0)
        for rid in ("r0", "r1"):
            assert (shm / (dump_mod.request_key(rid) + ".safetensors")).stat().st_mode & 0o777 == 0o644
        (shm / (dump_mod.request_key("r5") + ".safetensors")).mkdir()
        (shm / (dump_mod.request_key("r5") + ".safetensors") / "x").write_text("not empty")
        w.submit(_Batch(ids[:3], [3], rids=["r5"]), cap, fin)
        w.flush()
        assert (w.written, w.failed) == (2, 1)
        assert w.state("r5").startswith("failed: the write failed: [Errno"), w.state("r5")
        assert not [p for p in shm.iterdir() if p.name.endswith(".tmp")]
        w.close()
        disk = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
        disk.submit(_Batch(ids[:3], [3], rids=["d0"]), cap, fin)
        disk.flush()
        assert disk.failed == 1 and "the os call this path must not make" in disk.state("d0")
        disk.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_prompt_key_is_the_sha256_of_the_ids_text_however_long():
    """Hashed in pieces below hashlib's GIL threshold: the same digest as one sha256 of the text."""
    for n in (0, 1, 300, 2047, 5000):
        ids = [(i * 7919) % 200000 for i in range(n)]
        text = ",".join(str(i) for i in ids).encode()
        assert dump_mod.prompt_key(ids) == hashlib.sha256(text).hexdigest()
    assert dump_mod.prompt_key([1, 2, 3]) != hashlib.sha256(b"1,2,3,").hexdigest()


def test_flush_returns_only_once_the_files_are_on_disk(tmp_path, monkeypatch):
    """A write that takes time (a slow disk): the flush answers after the file is there, over the
    real control socket, and reports the counts; pause and resume travel the same way."""
    sinks = sys.modules["e3c_under_test.sinks"]
    real = sinks.durable_replace

    def slow(*a, **kw):  # whichever path writes the file (save_file, or serialize_file given addresses)
        time.sleep(0.6)
        return real(*a, **kw)

    monkeypatch.setattr(sinks, "durable_replace", slow)
    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
    path = str(tmp_path / "c.sock")
    monkeypatch.setenv(control.ENV_TOKEN, "the launch's secret")
    server = control.ControlServer(w, path, "the launch's secret")
    try:
        ids, cap, fin = _states([3], [1])
        w.submit(_Batch(ids, [3], rids=["slow"]), cap, fin)
        reply = control.call("flush", 30, path=path)
        assert (tmp_path / (dump_mod.request_key("slow") + ".safetensors")).exists()
        assert reply["flushed"] is True and reply["written"] == 1
        assert control.call("pause", 5, path=path)["paused"] is True and w.paused
        assert control.call("resume", 5, path=path)["paused"] is False and not w.paused
        monkeypatch.setattr(sinks, "durable_replace", lambda *a, **kw: time.sleep(3))
        w.submit(_Batch(ids, [3], rids=["slower"]), cap, fin)
        with pytest.raises(control.FlushError, match="did not catch up within 0.5 s"):
            control.call("flush", 0.5, path=path)
    finally:
        server.close()
        w.flush()
        w.close()
    with pytest.raises(control.FlushError, match="did not answer"):
        control.call("flush", 1, path=path)


def test_answers_finished_together_share_one_status_call(tmp_path, monkeypatch):
    """64 answers finishing at once through the answer hook (a stand-in TokenizerManager whose
    generate_request is a real async generator, the real ControlServer and DumpWriter on a real
    socket): each answer names its own file and state, in far fewer status calls than answers
    (a call per answer queued 64 connections in the scheduler's process, where each waits for the
    GIL behind the busy main loop)."""
    import asyncio

    w = dump_mod.DumpWriter(str(tmp_path), _idx([1]), False, 1 << 20, {})
    path = str(tmp_path / "c.sock")
    server = control.ControlServer(w, path, "the launch's secret")
    monkeypatch.setenv(control.ENV_CONTROL, path)
    monkeypatch.setenv(control.ENV_TOKEN, "the launch's secret")
    rids = [f"r{i}" for i in range(64)]
    ids, cap, fin = _states([3] * 32, [1])
    w.submit(_Batch(ids, [3] * 32, rids=rids[:32]), cap, fin)
    w.flush()  # the first half written, the second half never prefilled ("unknown")
    calls = []
    real = control._asked
    monkeypatch.setattr(control, "_asked", lambda r, p=None: calls.append(list(r)) or real(r, p))

    class TM:
        async def generate_request(self, obj, request=None):
            await asyncio.sleep(0.01)
            yield {"meta_info": {"id": obj.rid, "finish_reason": {"type": "length"}}}

    control._answer_hooks(TM)

    async def answer(rid):
        return [out async for out in TM().generate_request(SimpleNamespace(rid=rid, sampling_params={}))]

    async def main():
        return await asyncio.gather(*(answer(r) for r in rids))

    try:
        outs = asyncio.run(main())
    finally:
        server.close()
        w.close()
    for rid, out in zip(rids, outs):
        meta = out[-1]["meta_info"]["eagle3_dump"]
        assert meta["file"] == dump_mod.request_key(rid) + ".safetensors", meta
        assert meta["state"] == ("written" if rid in rids[:32] else "unknown"), (rid, meta)
    assert sorted(r for c in calls for r in c) == sorted(rids)  # each answer asked once
    assert len(calls) <= 4, f"{len(calls)} status calls for 64 answers finished together"


# Engine.shutdown, the exit of a script that never calls it, and the server's stop on SIGTERM run
# through real SGLang in tests/test_dump_stops.py (a real Engine, a real group SIGTERM).


def test_releases_that_copy_the_forward_batch_find_requests_by_id(monkeypatch):
    """0.5.17+: the model may get a dataclasses.replace copy of the ForwardBatch (fields only):
    the RequestInfo list travels by request id through identity's table, and only once."""
    import dataclasses

    monkeypatch.setitem(identity._BY_RID, "on", True)

    @dataclasses.dataclass
    class FB:
        forward_mode: object
        rids: list

    class Req:
        def __init__(self, rid, n):
            self.rid, self.origin_input_ids, self.lora_id = rid, list(range(n)), None
            self.input_embeds, self.multimodal_inputs = None, None

    fb = FB(_Mode("EXTEND"), ["a", "b"])
    identity._attach(fb, SimpleNamespace(reqs=[Req("a", 3), Req("b", 5)]))
    copy = dataclasses.replace(fb)
    assert not hasattr(copy, identity.ATTRIBUTE)
    got = identity.requests_of(copy)
    assert [(i.rid, i.prompt_len) for i in got] == [("a", 3), ("b", 5)]
    assert identity.requests_of(copy) is None  # taken once
    identity._attach(FB(_Mode("DECODE"), ["c"]), SimpleNamespace(reqs=[Req("c", 1)]))
    assert identity.requests_of(FB(_Mode("EXTEND"), ["c"])) is None  # decode batches carry nothing
# ---- launch refusals the release's facts decide -------------------------------------------------

def _args(**kw):
    base = dict(disable_radix_cache=True, tp_size=1, dp_size=1)  # the fields every release has
    base.update(kw)
    return SimpleNamespace(**base)


def test_release_facts_decide_the_moe_dense_and_draft_refusals(monkeypatch):
    assert settings.SERIES_RELEASE in settings.RELEASE_FACTS
    monkeypatch.setattr(settings, "SERIES_RELEASE", "0.5.9")
    with pytest.raises(settings.DumpConfigError, match=r"--moe-dense-tp-size 1 at --tp-size 2 .*drop --moe-dense-tp-size"):
        settings.check_server_args(_args(tp_size=2, moe_dense_tp_size=1))
    with pytest.raises(settings.DumpConfigError, match=r"EAGLE3 with --moe-dense-tp-size 1 at --tp-size 4"):
        settings.check_draft_args(_args(tp_size=4, moe_dense_tp_size=1, speculative_algorithm="EAGLE3"))
    settings.check_server_args(_args(tp_size=1, moe_dense_tp_size=1))  # one rank: nothing scattered
    settings.check_draft_args(_args(tp_size=4, moe_dense_tp_size=1, speculative_algorithm="EAGLE"))  # no capture
    settings.check_server_args(_args(enable_lora=True, lora_paths=["a=/x"]))  # LoRA is not refused
    monkeypatch.setattr(settings, "SERIES_RELEASE", "0.5.17")
    settings.check_server_args(_args(tp_size=2, moe_dense_tp_size=1))  # 0.5.17's capture gathers them
    for algo in ("DFLASH", "dspark"):  # the package follows the release's DFlash setter: the dump goes beside it
        settings.check_server_args(_args(speculative_algorithm=algo))
    settings.check_server_args(_args(speculative_algorithm="EAGLE3"))
    monkeypatch.setitem(settings.RELEASE_FACTS, "0.5.17", dict(settings.RELEASE_FACTS["0.5.17"], draft_setters=()))
    for algo in ("DFLASH", "dspark"):  # a release whose setter the package does not follow refuses
        with pytest.raises(settings.DumpConfigError, match="--speculative-algorithm %s sets the captured layers" % algo.upper()):
            settings.check_server_args(_args(speculative_algorithm=algo))
    monkeypatch.setattr(settings, "SERIES_RELEASE", "0.5.99")
    with pytest.raises(settings.DumpConfigError, match="no launch-rule facts for sglang 0.5.99"):
        settings.check_server_args(_args())
    settings.check_draft_args(_args(speculative_algorithm=None))  # no draft, no dump: nothing to check


def test_prefill_cp_refusal_names_cp_not_what_the_release_derives_from_it():
    """On DeepSeek (MLA / DSA) 0.5.17 and 0.5.23 resolve --enable-prefill-cp into DP attention,
    --moe-a2a-backend deepep and --moe-dense-tp-size 1 as well: the refusal must name what the user
    set, not tell them to drop a backend they never chose."""
    derived = dict(enable_prefill_cp=True, cp_strategy="zigzag", tp_size=2, attn_cp_size=2, moe_a2a_backend="deepep",
                   enable_dp_attention=True, dp_size=2, moe_dense_tp_size=1)
    with pytest.raises(settings.DumpConfigError, match=r"prefill context parallelism \(--enable-prefill-cp"):
        settings.check_server_args(_args(**derived))
    with pytest.raises(settings.DumpConfigError, match=r"DP attention .*2 attention ranks"):
        settings.check_server_args(_args(enable_dp_attention=True, dp_size=2, tp_size=2))
    with pytest.raises(settings.DumpConfigError, match=r"DP attention .*4 attention ranks"):
        settings.check_server_args(_args(attn_dp_size=4, tp_size=4))
    with pytest.raises(settings.DumpConfigError, match="--dp-size 2 runs 2 data-parallel replicas"):
        settings.check_server_args(_args(enable_dp_attention=False, dp_size=2))  # plain DP replicas: one writer each


_NODE_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from eaglepatch.overlay import import_package
pkg = import_package("e3c_node")
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
try:
    pkg.same_dump_on_every_node(pkg._dump_fingerprint(), None, 2, 1)
    print("SAME")
except pkg.DumpConfigError as exc:
    print("REFUSED " + str(exc))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("second", ["/data/dumps", None, "/other"])
def test_nodes_of_one_tp_group_must_agree_on_the_dump(tmp_path, second):
    """Two real gloo ranks (one per "node"): the same settings pass; the dump set on one node only,
    or set differently, refuses on both with one line naming both nodes' settings."""
    import os
    import subprocess

    store = tmp_path / "store"
    procs = []
    for rank, d in enumerate(["/data/dumps", second]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
        if d is not None:
            env["EAGLE3_DUMP_DIR"] = d
        procs.append(subprocess.Popen([sys.executable, "-c", _NODE_CHILD, str(REPO / "src"), str(rank), str(store)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    lines = [o[0].strip() for o in outs]
    if second == "/data/dumps":
        assert lines == ["SAME", "SAME"]
    else:
        assert all(x.startswith("REFUSED the EAGLE3_DUMP_* variables differ between the nodes") for x in lines), lines
        assert lines[0] == lines[1] and "node 0: " in lines[0] and "node 1: " in lines[0] and "\n" not in lines[0]
        assert "set the same EAGLE3_DUMP_DIR" in lines[0]


def test_the_dump_reads_its_layers_as_the_named_family(monkeypatch):
    """EAGLE3_DUMP_READING: the dump's layer list read as a DFlash/DSpark draft's ids are on this release
    (id k = the output of layer k: index k + 1) rather than as EAGLE-3 ids (on 0.5.17 a list whose first id
    is not 1 names capture indices); a release that serves neither family refuses it in one line."""
    monkeypatch.setattr(settings, "SERIES_RELEASE", "0.5.17")
    monkeypatch.setattr(settings, "UPSTREAM_EAGLE_ID_MAPPING", "plus_one_if_first_is_one")  # 0.5.17's release.py
    env = {"EAGLE3_DUMP_DIR": "/d", "EAGLE3_DUMP_LAYERS": "0,2"}
    assert settings.DumpSettings.from_env(env).capture_indices(4) == [0, 2]
    for family in ("dflash", "dspark"):
        got = settings.DumpSettings.from_env(dict(env, EAGLE3_DUMP_READING=family))
        assert got.family == family and got.capture_indices(4) == [1, 3]
    monkeypatch.setattr(settings, "SERIES_RELEASE", "0.5.9")
    with pytest.raises(settings.DumpConfigError, match="EAGLE3_DUMP_READING=dflash: sglang 0.5.9 serves no dflash"):
        settings.DumpSettings.from_env(dict(env, EAGLE3_DUMP_READING="dflash")).capture_indices(4)
    with pytest.raises(settings.DumpConfigError, match="EAGLE3_DUMP_READING='medusa' is not one of"):
        settings.DumpSettings.from_env(dict(env, EAGLE3_DUMP_READING="medusa"))
