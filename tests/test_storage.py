"""Compact dumps (``eagle3-dump/2``, issue 30) read back: the overlay's real DumpWriter writes the
files (fp8 states with a scale per row, rebuildable states left out) on CPU, ``load_dump`` reads
them with a ``Rebuilder`` of a small safetensors model directory, and every layout yields the
tensors the plain ``eagle3-dump/1`` file of the same states holds: bit for bit where nothing is
quantised, within fp8's rounding where it is. Each reference check is shown to fail on wrong
input (another embedding, shifted ids, another norm weight, another row's scale)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eaglepatch import storage  # noqa: E402
from eaglepatch.errors import UsageError  # noqa: E402
from eaglepatch.extract import dumps, record  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402

import_package("e3c_storage_test")
dump_mod = __import__("e3c_storage_test.dump", fromlist=["DumpWriter"])
ov_storage = __import__("e3c_storage_test.storage", fromlist=["quantize_rows"])
identity = __import__("e3c_storage_test.identity", fromlist=["RequestInfo"])
ov_weights = __import__("e3c_storage_test.weights", fromlist=["served_weights"])

V, H, N = 64, 32, 4  # vocabulary, hidden size, decoder layers
EPS = 1e-6
BF16 = torch.bfloat16
LAYERS = [-1, 1, N - 1]  # the embedding output, a middle layer, the last layer before the norm
INDICES = [k + 1 for k in LAYERS]  # capture indices (the pinned release reads k -> k + 1)
LAYOUTS = {"bf16-store": ("bf16", "store"), "fp8-store": ("fp8", "store"), "bf16-omit": ("bf16", "omit"),
           "fp8-omit": ("fp8", "omit")}
BF16_ROW_TOL = 2.0 ** -7  # a bf16 rounding of every element moves a row by at most ~2^-8 (L2, relative)


# ---- a small model directory: embedding and final norm in shards of a safetensors index ---------

def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(V, H, generator=g) * 0.02).to(BF16)
    norm = (1 + 0.2 * torch.randn(H, generator=g)).to(BF16)
    return embed, norm


def _model_dir(root: Path, seed: int = 0, prefix: str = "model.", sharded: bool = True) -> Path:
    """A model directory as a checkpoint ships it: config.json, the weights in two shards named by
    ``model.safetensors.index.json`` (whose third shard, of tensors a rebuild never needs, is not
    there: the Rebuilder must not open it), or one ``model.safetensors``."""
    root.mkdir(parents=True)
    embed, norm = _weights(seed)
    (root / "config.json").write_text(json.dumps({"hidden_size": H, "num_hidden_layers": N, "vocab_size": V,
                                                  "rms_norm_eps": EPS}))
    tensors = {prefix + "embed_tokens.weight": embed, prefix + "norm.weight": norm,
               prefix + "layers.0.mlp.weight": torch.randn(4, 4)}
    if not sharded:
        save_file(tensors, str(root / "model.safetensors"))
        return root
    shard = "model-0000%d-of-00003.safetensors"
    save_file({prefix + "embed_tokens.weight": embed}, str(root / (shard % 1)))
    save_file({prefix + "norm.weight": norm, prefix + "layers.0.mlp.weight": tensors[prefix + "layers.0.mlp.weight"]},
              str(root / (shard % 2)))
    wm = {prefix + "embed_tokens.weight": shard % 1, prefix + "norm.weight": shard % 2,
          prefix + "layers.0.mlp.weight": shard % 2, "lm_head.weight": shard % 3}
    (root / storage.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"right": the served model, "other": another seed's weights, "kimi": the right weights in a
    single file under Kimi-K2.5's wrapper prefix}."""
    root = tmp_path_factory.mktemp("models")
    return {"right": _model_dir(root / "right"), "other": _model_dir(root / "other", seed=1),
            "kimi": _model_dir(root / "kimi", prefix="language_model.model.", sharded=False)}


# ---- the states of a prompt, and the real writer --------------------------------------------------

def _states(ids, seed: int = 0):
    """Capture index -> state [T, H] bf16, and the post-norm final by torch's own RMSNorm (in bf16):
    the embedding output is the model's embedding rows; the middle layer's rows differ in norm by
    1000x (so one scale per row matters); the last layer is the final norm's input."""
    embed, norm = _weights(0)
    g = torch.Generator().manual_seed(seed + 100)
    T = len(ids)
    sizes = 10.0 ** torch.linspace(-1, 2, T)
    middle = (torch.randn(T, H, generator=g) * sizes[:, None]).to(BF16)
    last = (torch.randn(T, H, generator=g) * 30).to(BF16)
    final = torch.nn.functional.rms_norm(last, (H,), norm, eps=EPS)
    return {INDICES[0]: embed[torch.as_tensor(ids)], INDICES[1]: middle, INDICES[2]: last}, final


class _Mode:
    name = "EXTEND"


class _Batch:
    """The ForwardBatch fields DumpWriter reads, for one unchunked request."""

    def __init__(self, ids, info):
        self.forward_mode = _Mode()
        self.input_ids = ids
        self.extend_seq_lens_cpu = [len(ids)]
        self.extend_prefix_lens_cpu = [0]
        self.req_pool_indices = torch.tensor([0])
        self._eagle3_requests = [info]


META = {"format": "eagle3-dump/1", "eagle3_layer_ids": json.dumps(LAYERS), "hf_hidden_state_indices": json.dumps(INDICES),
        "final": "post_norm", "architecture": "DeepseekV3ForCausalLM", "model_path": "/m", "hidden_size": str(H),
        "num_hidden_layers": str(N), "dtype": "bfloat16", "sglang_version": "0.5.9", "series_version": "0.5.9-x",
        "tp_size": "1", "launch_id": "l"}


def _write(directory: Path, layout: str, ids, captured, final, model: Path, raw_ids=None, placeholder=None) -> tuple:
    """One request's dump written by the overlay's DumpWriter with ``layout`` (a LAYOUTS key), the
    digest of ``model``'s tensors recorded as ``start_dump`` records the served model's; (path, rid).
    ``raw_ids``: the ids before a multimodal wrapper's clamp (pad values >= V)."""
    from types import SimpleNamespace

    directory.mkdir(parents=True, exist_ok=True)
    st = ov_storage.Storage(*LAYOUTS[layout])
    left = ov_storage.left_out_states(st, INDICES, True, N)
    served = ov_weights.served_weights(SimpleNamespace(model_path=str(model), load_format="auto"), left)
    lay = ov_storage.Layout(st, INDICES, True, N, "bfloat16", EPS, V, weights=served)
    w = dump_mod.DumpWriter(str(directory), INDICES, True, 1 << 20, META, vocab_size=V, layout=lay,
                            placeholder_id=placeholder)
    rid = dumps.new_rid()
    try:
        w.submit(_Batch(torch.as_tensor(ids), identity.RequestInfo(rid, len(ids))), captured, final,
                 input_ids=None if raw_ids is None else torch.as_tensor(raw_ids))
        w.flush()
        assert (w.written, w.failed) == (1, 0)
    finally:
        w.close()
    return dumps.dump_path(directory, dumps.rid_key(rid)), rid


IDS = [3, 17, 5, 63, 0, 42, 8, 8, 29, 11]


@pytest.fixture(scope="module")
def written(tmp_path_factory, models):
    """The same request's states written in every layout: {layout: (path, rid)}."""
    root = tmp_path_factory.mktemp("dumps")
    captured, final = _states(IDS)
    return {name: _write(root / name, name, IDS, captured, final, models["right"]) for name in LAYOUTS}


def _read(path: Path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _row_err(x, ref):
    return storage.rebuild_error(ref, x)["max_rel_row"]


# ---- quantisation: the overlay's arithmetic, speculators' dequantisation ------------------------------

def _varied_rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 256, generator=g) * (10.0 ** torch.linspace(-4, 3, 300))[:, None]
    x[7] = 0  # an all-zero row: the scale floor
    x[8, 3] = 1e4  # one large value in a row of small ones
    return x.to(BF16)


def test_quantize_rows_is_the_overlays_arithmetic():
    x = _varied_rows()
    q, s = storage.quantize_rows(x)
    q_ov, s_ov = ov_storage.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (300, 1)
    assert torch.equal(q.view(torch.uint8), q_ov.view(torch.uint8)) and torch.equal(s, s_ov)
    assert torch.equal(storage.dequantize(q, s, BF16), ov_storage.dequantize(q_ov, s_ov, BF16))
    assert float(s[7]) == float(torch.tensor(storage.SCALE_MIN)) and not q[7].float().any()
    assert float(q.float().abs().max()) == storage.FP8_MAX  # a row's largest value maps to 448
    # hs-connectors' dequantisation: both factors in the model dtype, multiplied in it
    assert torch.equal(storage.dequantize(q, s, BF16), q.to(BF16) * s.to(BF16))


def test_fp8_round_trip_error_per_row_and_the_check_fails_on_another_rows_scale():
    x = _varied_rows(1)
    q, s = storage.quantize_rows(x)
    amax = x.float().abs().amax(-1).clamp_min(1e-30)
    err = (storage.dequantize(q, s, BF16).float() - x.float()).abs().amax(-1) / amax
    assert float(err.max()) < 2 ** -4, float(err.max())
    # the same bound is broken by a scale that is not the row's own (the next row's, or one per tensor)
    for wrong in (s.roll(1, 0), s.max().expand_as(s)):
        bad = (storage.dequantize(q, wrong, BF16).float() - x.float()).abs().amax(-1) / amax
        assert float(bad.max()) > 2 ** -4


# ---- every layout reads as the plain file ------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_reads_as_the_plain_file(written, models, layout):
    path, rid = written[layout]
    plain = dumps.load_dump(*written["bf16-store"][:1], IDS, rid=written["bf16-store"][1])
    d = dumps.load_dump(path, IDS, rid=rid, rebuilder=storage.Rebuilder(models["right"]))
    tensors, meta = _read(path)
    fp8, omit = layout.startswith("fp8"), layout.endswith("omit")
    assert meta["format"] == ("eagle3-dump/2" if fp8 or omit else "eagle3-dump/1")
    assert d.storage == ("float8_e4m3fn" if fp8 else "bfloat16")
    assert d.layer_ids == LAYERS and d.input_ids.tolist() == IDS
    assert all(t.dtype == BF16 and tuple(t.shape) == (len(IDS), H) for t in [*d.layers.values(), d.final])
    last = f"layer.{N - 1}"
    if omit:
        r = storage.Rebuilder(models["right"])
        assert json.loads(meta["left_out"]) == {
            "layer.-1": {"rebuild": "embed_tokens", "rows": "vocab", "weights": r.weights("embedding")},
            "final": {"rebuild": "final_norm", "from": last, "eps": EPS, "weights": r.weights("norm")}}
        assert "layer.-1" not in tensors and "final" not in tensors  # no image row: no embedding row stored
        assert d.rebuilt == {"layer.-1": "embed_tokens", "final": "final_norm"}
    else:
        assert d.rebuilt == {}
    # the embedding rows: bit for bit (stored whole in bf16, or rebuilt from the weights)
    if fp8 and not omit:
        assert _row_err(d.layers["layer.-1"], plain.layers["layer.-1"]) < 2 ** -4
    else:
        assert storage.rebuild_error(plain.layers["layer.-1"], d.layers["layer.-1"])["bit_exact"]
    if fp8:
        stored = [n for n in ("layer.-1", "layer.1", last, "final") if n in tensors]
        assert sorted(d.encoded) == sorted(stored) and meta["scale_layout"] == "per_token_per_state"
        for name in stored:  # the file's own tensors, and what the reader yields from them
            q, s = d.encoded[name]
            assert torch.equal(q.view(torch.uint8), tensors[name].view(torch.uint8))
            assert torch.equal(d.layers.get(name, d.final), storage.dequantize(q, s, BF16))
            ref = plain.layers.get(name, plain.final).float()
            err = (d.layers.get(name, d.final).float() - ref).abs().amax(-1) / ref.abs().amax(-1)
            assert float(err.max()) < 2 ** -4, (name, float(err.max()))
    else:
        assert d.encoded == {}
        for name in ("layer.1", last):
            assert torch.equal(d.layers[name], plain.layers[name])
    if omit:  # the final: the norm of the layer the reader yields, within bf16 of torch's RMSNorm in bf16
        assert torch.equal(d.final, storage.rms_final(d.layers[last], _weights(0)[1], EPS))
        assert _row_err(d.final, plain.final) < (2 ** -4 if fp8 else BF16_ROW_TOL)
    elif not fp8:
        assert torch.equal(d.final, plain.final)


def test_a_plain_file_loads_as_before(written):
    path, rid = written["bf16-store"]
    tensors, meta = _read(path)
    assert meta["format"] == "eagle3-dump/1" and not {"storage_dtype", "left_out"} & set(meta)
    d = dumps.load_dump(path, IDS, rid=rid)  # no rebuilder needed
    assert (d.storage, d.encoded, d.rebuilt) == ("bfloat16", {}, {})
    for k in LAYERS:
        assert d.layers[f"layer.{k}"] is tensors[f"layer.{k}"] or torch.equal(d.layers[f"layer.{k}"], tensors[f"layer.{k}"])
    assert torch.equal(d.final, tensors["final"])
    assert dumps.storage_meta(meta) == {"storage_dtype": "bfloat16", "scale_layout": "none", "left_out": "{}"}


@pytest.mark.parametrize("layout", ["bf16-omit", "fp8-omit"])
def test_image_rows_are_stored_with_their_positions(tmp_path, models, layout):
    """A multimodal wrapper's image rows (pad values >= the vocabulary, stored as its placeholder
    id) are not rebuildable: stored, with their positions; the text rows are rebuilt."""
    ph = 60
    raw = [3, 17, 10_000_001, 10_000_001, 10_000_002, 5, 8]
    ids = [t if t < V else ph for t in raw]
    captured, final = _states([t if t < V else 0 for t in raw], seed=5)
    image = torch.randn(3, H).to(BF16) * 4
    captured[INDICES[0]][2:5] = image  # the vision tower's rows
    clamped = torch.as_tensor(raw).clamp(0, V - 1)
    path, rid = _write(tmp_path, layout, clamped, captured, final, models["right"], raw_ids=raw, placeholder=ph)
    tensors, _ = _read(path)
    assert tensors["rows.layer.-1"].tolist() == [2, 3, 4] and tensors["layer.-1"].shape[0] == 3
    d = dumps.load_dump(path, ids, rid=rid, rebuilder=storage.Rebuilder(models["right"]))
    emb = d.layers["layer.-1"]
    text = [0, 1, 5, 6]
    assert storage.rebuild_error(captured[INDICES[0]][text], emb[text])["bit_exact"]
    if layout == "bf16-omit":
        assert torch.equal(emb[2:5], image)
    else:
        assert _row_err(emb[2:5], image) < 2 ** -4 and "layer.-1" not in d.encoded  # not every row: not passed on


# ---- the rebuild's reference checks fail on wrong input ------------------------------------------------

def test_embedding_rebuild_is_bit_exact_and_fails_on_wrong_weights_or_shifted_ids(written, models):
    plain = dumps.load_dump(written["bf16-store"][0], IDS, rid=written["bf16-store"][1])
    stored = plain.layers["layer.-1"]
    ids = torch.tensor(IDS)
    right = storage.Rebuilder(models["right"])
    good = storage.rebuild_error(stored, right.embedding(ids, BF16))
    assert good == {"max_abs": 0.0, "max_rel_row": 0.0, "bit_exact": True, "rows": len(IDS)}
    assert storage.rebuild_error(stored, storage.Rebuilder(models["kimi"]).embedding(ids, BF16))["bit_exact"]
    other = storage.rebuild_error(stored, storage.Rebuilder(models["other"]).embedding(ids, BF16))
    shifted = storage.rebuild_error(stored, right.embedding((ids + 1) % V, BF16))
    for bad in (other, shifted):
        assert not bad["bit_exact"] and bad["max_rel_row"] > 0.5
    # through the reader: another model's weights are refused (the dump records the served ones' digest)
    path, rid = written["bf16-omit"]
    with pytest.raises(UsageError, match="another checkpoint"):
        dumps.load_dump(path, IDS, rid=rid, rebuilder=storage.Rebuilder(models["other"]))


def test_final_rebuild_is_within_bf16_of_a_real_rmsnorm_and_fails_on_another_norm_weight(written, models):
    plain = dumps.load_dump(written["bf16-store"][0], IDS, rid=written["bf16-store"][1])
    last = plain.layers[f"layer.{N - 1}"]
    good = storage.Rebuilder(models["right"]).final(last, EPS)
    assert _row_err(good, plain.final) < BF16_ROW_TOL
    assert _row_err(storage.Rebuilder(models["other"]).final(last, EPS), plain.final) > 10 * BF16_ROW_TOL
    assert _row_err(storage.Rebuilder(models["right"]).final(plain.layers["layer.1"], EPS), plain.final) > 0.1
    path, rid = written["bf16-omit"]
    with pytest.raises(UsageError, match="another checkpoint"):
        dumps.load_dump(path, IDS, rid=rid, rebuilder=storage.Rebuilder(models["other"]))


# ---- what the reader refuses ------------------------------------------------------------------------------

def _variant(src: Path, dst: Path, meta=None, tensors=None, drop=()) -> Path:
    """``src`` rewritten to ``dst`` with metadata and tensors replaced or dropped."""
    t, m = _read(src)
    m.update(meta or {})
    t.update(tensors or {})
    for k in drop:
        t.pop(k, None)
    save_file(t, str(dst), metadata=m)
    return dst


def _left_out(**change):
    base = {"layer.-1": {"rebuild": "embed_tokens", "rows": "vocab"},
            "final": {"rebuild": "final_norm", "from": f"layer.{N - 1}", "eps": EPS}}
    base.update(change)
    return json.dumps({k: v for k, v in base.items() if v is not None})


def _scale(path):
    return _read(path)[0]["scale.layer.1"]


REFUSED = {
    "unknown storage dtype": ({"storage_dtype": "float8_e5m2"}, None, (),
                              "storage_dtype 'float8_e5m2' is not one this reader knows"),
    "unknown scale layout": ({"scale_layout": "per_tensor"}, None, (), "scale_layout 'per_tensor' is not one"),
    "scales without fp8": ({"scale_layout": "none"}, None, (), "does not go with storage_dtype"),
    "unknown left-out state": ({"left_out": _left_out(**{"layer.1": {"rebuild": "embed_tokens"}})}, None, (),
                               "left_out names 'layer.1', which this reader cannot rebuild"),
    "unknown rebuild kind": ({"left_out": _left_out(final={"rebuild": "layer_norm", "from": "layer.3", "eps": EPS})},
                             None, (), "rebuild kind 'layer_norm', this reader knows 'final_norm'"),
    "final from another layer": ({"left_out": _left_out(final={"rebuild": "final_norm", "from": "layer.1",
                                                               "eps": EPS})}, None, (), "rebuilds from 'layer.1'"),
    "unknown format": ({"format": "eagle3-dump/3"}, None, (), "this reader knows eagle3-dump/1 and eagle3-dump/2"),
    "scale of another shape": (None, {"scale.layer.1": lambda p: _scale(p)[:, 0]}, (), "scale.layer.1 has shape"),
    "negative scale": (None, {"scale.layer.1": lambda p: -_scale(p)}, (), "not finite positive"),
    "fp8 NaN": (None, {"layer.1": lambda p: torch.full((len(IDS), H), 0x7F, dtype=torch.uint8).view(
        torch.float8_e4m3fn)}, (), "layer.1 holds 320 non-finite values after dequantising"),
    "a scale missing": (None, None, ("scale.layer.1",), "do not match the metadata"),
    "id past vocab_size": ({"vocab_size": "40"}, None, (), "is neither stored nor rebuildable"),
    "rows unsorted": (None, {"layer.-1": lambda p: torch.zeros(2, H, dtype=torch.float8_e4m3fn),
                             "scale.layer.-1": lambda p: torch.ones(2, 1),
                             "rows.layer.-1": lambda p: torch.tensor([4, 2])}, (), "not sorted and unique"),
    "rows out of range": (None, {"layer.-1": lambda p: torch.zeros(1, H, dtype=torch.float8_e4m3fn),
                                 "scale.layer.-1": lambda p: torch.ones(1, 1),
                                 "rows.layer.-1": lambda p: torch.tensor([len(IDS)])}, (), "outside 0..9"),
    "rows without their state": (None, {"rows.layer.-1": lambda p: torch.tensor([1])}, (), "all or none"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_reader_refuses_what_it_does_not_know(tmp_path, written, models, case):
    meta, tensors, drop, needle = REFUSED[case]
    src, rid = written["fp8-omit"]
    made = {k: f(src) for k, f in (tensors or {}).items()}
    bad = _variant(src, tmp_path / src.name, meta, made, drop)
    with pytest.raises(dumps.BadDump, match=needle) as exc:
        dumps.load_dump(bad, IDS, rid=rid, rebuilder=storage.Rebuilder(models["right"]))
    assert str(exc.value).startswith(src.name + ": ") and "\n" not in str(exc.value)


def test_a_compact_file_without_a_rebuilder_names_the_fix(written):
    for layout in ("bf16-omit", "fp8-omit"):
        path, rid = written[layout]
        with pytest.raises(dumps.BadDump, match=r"leaves out \['final', 'layer.-1'\].*pass the served model's "
                                                r"directory with its weights \(tools/extract.py --model"):
            dumps.load_dump(path, IDS, rid=rid)
    d = dumps.load_dump(*written["fp8-store"][:1], IDS, rid=written["fp8-store"][1])  # nothing left out: none needed
    assert d.rebuilt == {} and len(d.encoded) == 4


# ---- the Rebuilder --------------------------------------------------------------------------------------

def test_rebuilder_reads_only_the_tensors_it_needs(models):
    r = storage.Rebuilder(models["right"])  # the index names a third shard that is not there: never opened
    assert r.tensor_name("embedding") == "model.embed_tokens.weight"
    assert storage.Rebuilder(models["kimi"]).tensor_name("norm") == "language_model.model.norm.weight"
    assert tuple(r.embedding([1, 2]).shape) == (2, H) and r.embedding([1], torch.float32).dtype == torch.float32
    assert set(r._tensors) == {"embedding"}  # the norm weight not read before it is needed


def test_rebuilder_errors_are_one_line_with_a_fix(tmp_path, models):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    cases = [(tmp_path / "bare", lambda r: r.embedding([1]), "holds no model weights"),
             (models["right"], lambda r: r.embedding([V]), f"token id {V} is outside model.embed_tokens.weight"),
             (models["right"], lambda r: r.embedding([1], hidden_size=H + 1), "the dump's hidden size is"),
             (models["right"], lambda r: r.final(torch.zeros(2, H + 1, dtype=BF16), EPS), "has 32 values")]
    noembed = tmp_path / "noembed"
    noembed.mkdir()
    save_file({"model.norm.weight": torch.ones(H)}, str(noembed / "model.safetensors"))
    cases.append((noembed, lambda r: r.embedding([1]), "have no embedding"))
    missing = tmp_path / "missing-shard"
    missing.mkdir()
    (missing / storage.INDEX_FILE).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "a.safetensors"}}))
    cases.append((missing, lambda r: r.embedding([1]), "a.safetensors \\(the shard that holds"))
    cases.append((missing, lambda r: r.final(torch.zeros(1, H, dtype=BF16), EPS), "have no model.norm.weight"))
    for where, call, needle in cases:
        with pytest.raises(UsageError, match=needle) as exc:
            call(storage.Rebuilder(where))
        assert "--model" in exc.value.fix and "\n" not in exc.value.line()


# ---- the dataset records the layout -------------------------------------------------------------------

def test_a_dataset_records_and_compares_the_storage_layout(written):
    from eaglepatch.extract import run

    assert set(record.STORAGE_PROVENANCE) <= set(record.PROVENANCE)
    plain = dumps.load_dump(written["bf16-store"][0], IDS, rid=written["bf16-store"][1])
    fp8 = dumps.load_dump(written["fp8-store"][0], IDS, rid=written["fp8-store"][1])
    seen = [{k: run._norm(k, run._provenance_meta(d).get(k)) for k in record.STORAGE_PROVENANCE} for d in (plain, fp8)]
    assert seen[0] == {"storage_dtype": "bfloat16", "scale_layout": "none", "left_out": "{}"}
    assert seen[1] == {"storage_dtype": "float8_e4m3fn", "scale_layout": "per_token_per_state", "left_out": "{}"}
    # a dataset recorded before the layout was recorded held plain dumps only
    assert dumps.storage_meta({"dtype": "bfloat16", "model_path": "/m"}) == {
        "storage_dtype": "bfloat16", "scale_layout": "none", "left_out": "{}"}
    assert run._norm("left_out", '{"b": 1, "a": 2}') == run._norm("left_out", {"a": 2, "b": 1})


def test_decode_is_load_dump_past_the_request_checks(written, models):
    """``dumps.decode``: what a reader of a file that is no request's dump (a compact dataset's
    sample) uses; it yields what ``load_dump`` yields."""
    r = storage.Rebuilder(models["right"])
    for layout in ("bf16-store", "fp8-omit"):
        path, rid = written[layout]
        tensors, meta = _read(path)
        a, b = dumps.load_dump(path, IDS, rid=rid, rebuilder=r), dumps.decode(path, meta, tensors, r)
        assert (a.storage, sorted(a.encoded), a.rebuilt) == (b.storage, sorted(b.encoded), b.rebuilt)
        assert all(torch.equal(a.layers[k], b.layers[k]) for k in a.layers) and torch.equal(a.final, b.final)


def test_extract_reads_compact_dumps_with_the_models_weights_and_refuses_a_second_layout(tmp_path, written, models):
    """Stage 4 of tools/extract.py: the dump read with a Rebuilder of --model; the dataset's
    provenance records the first dump's storage layout, and a dump of another layout stops the run."""
    from eaglepatch.extract import run

    o = run.Options(servers=["http://127.0.0.1:1"], model=models["right"], data=tmp_path / "d.jsonl",
                    dump_dir=tmp_path, out=tmp_path / "out", format="compact")  # every dumped layer kept
    cfg = {"hidden_size": H, "num_hidden_layers": N, "vocab_size": V}
    x = run.Extractor(o, log=lambda m: None)
    path, rid = written["fp8-omit"]
    d = x.validate(path, IDS, rid, cfg, "http://s")
    assert d.rebuilt == {"layer.-1": "embed_tokens", "final": "final_norm"}
    assert x.dump_meta["storage_dtype"] == "float8_e4m3fn" and json.loads(x.dump_meta["left_out"])["final"]["eps"] == EPS
    for other in ("fp8-store", "bf16-store"):
        with pytest.raises(record.Fatal, match=r"has (storage_dtype|left_out)=.*EAGLE3_DUMP_DTYPE, EAGLE3_DUMP_REBUILDABLE"):
            x.validate(written[other][0], IDS, written[other][1], cfg, "http://s")
    bare = run.Extractor(dataclasses.replace(o, model=tmp_path), log=lambda m: None)  # --model without weights
    with pytest.raises(UsageError, match="holds no model weights"):
        bare.validate(path, IDS, rid, cfg, "http://s")
