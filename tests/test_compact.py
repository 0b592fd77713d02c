"""Compact storage in the datasets (issue 30): the speculators export of an fp8 dump, the ``compact``
format and ``eaglepatch.compact.CompactDataset``, and the guard's refusal of a dataset the draft's
trainer cannot read.

Dumps come from the real writer (sglang-overlay's DumpWriter, driven on CPU as in
tests/test_dump_storage.py) in each storage setting (bf16/fp8 x store/omit), of text requests and
one ``input_embeds`` request (its embedding rows are stored: ``rows.layer.-1``); the model directory
holds the embedding and final norm the reader rebuilds from. Each dump is read once
(``load_dump``) and written in the three formats; the consumers then read with their own code:
SpecForge 0.2.0's OfflineEagle3Dataset, speculators 0.9.0's ArrowDataset through hs-connectors'
FP8Transfer (the backend the manifest names). CompactDataset must yield, item for item, the same
keys, dtypes, shapes and bits, stops doing so for a perturbed scale, and refuses another model's weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.extract import writers  # noqa: E402

GUARD = REPO / "tools" / "guard.py"
N = 4  # decoder layers: EAGLE-3 ids -1..3, 3 = the last layer before the final norm
H = 64
VOCAB = 1024
EPS = 1e-6
DUMPED = [-1, 0, 1, 2, 3]  # the server's layers (EAGLE3_DUMP_LAYERS)
AUX = [-1, 1, 2]  # the datasets' aux layers (--aux-layers)
LENS = [5, 9, 13, 3, 20]  # text requests
EMBEDS_LEN = 6  # one input_embeds request: every embedding row stored
STORAGES = [("fp8", "omit"), ("fp8", "store"), ("bf16", "omit"), ("bf16", "store")]


# ---- guard (no torch) -------------------------------------------------------------------------

def _dataset(tmp: Path, name: str, fmt: str, dump_meta: dict) -> Path:
    """A manifest as tools/extract.py writes it, with ``writers.manifest_storage``'s storage block."""
    d = tmp / name
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({
        "format": "eaglepatch-hidden-states/2", "dataset_format": fmt, "eagle3_layer_ids": [1, 29, 57],
        "hf_hidden_state_indices": [2, 30, 58], "model": {"num_hidden_layers": 61}, "samples": 3,
        "storage": writers.manifest_storage(fmt, dump_meta)}))
    return d


def _guard(*args):
    p = subprocess.run([sys.executable, str(GUARD), *map(str, args)], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


FP8_META = {"dtype": "bfloat16", "storage_dtype": "float8_e4m3fn", "scale_layout": "per_token_per_state",
            "left_out": json.dumps({"layer.-1": {"rebuild": "embed_tokens", "rows": "vocab"}})}
BF16_META = {"dtype": "bfloat16"}  # an eagle3-dump/1 dump


def test_guard_refuses_what_the_trainers_reader_cannot_read(tmp_path):
    sglang = tmp_path / "sglang.json"
    sglang.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}}))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}))
    sf = _dataset(tmp_path, "sf", "specforge", FP8_META)  # a SpecForge export is bf16 whatever the dump
    sp8 = _dataset(tmp_path, "sp8", "speculators", FP8_META)
    sp16 = _dataset(tmp_path, "sp16", "speculators", BF16_META)
    compact = _dataset(tmp_path, "compact", "compact", FP8_META)

    def refused(args, *needles):
        rc, out, err = _guard(*args)
        lines = err.strip().splitlines()
        assert rc == 1 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (rc, out, err)
        for n in needles:
            assert n in lines[0], lines[0]

    def passes(args):
        rc, out, err = _guard(*args)
        assert rc == 0 and "OK (" in out and err == "", (rc, out, err)

    # the right dataset passes
    passes(["--draft-config", sglang, "--dataset", sf])
    passes(["--draft-config", spec, "--dataset", sp16])
    passes(["--draft-config", spec, "--dataset", sp8, "--hidden-states-backend", "fp8"])
    passes(["--draft-config", sglang, "--dataset", compact, "--compact-reader"])
    # SpecForge's reader (eagle_config drafts) takes bf16 .ckpt only
    refused(["--draft-config", sglang, "--dataset", compact], "compact dataset", "OfflineEagle3Dataset",
            "--format specforge", "CompactDataset(OUT, MODEL_DIR, yields='specforge')", "--compact-reader")
    refused(["--draft-config", sglang, "--dataset", sp8], "float8_e4m3fn", "OfflineEagle3Dataset", "--format specforge")
    # speculators: fp8 needs its fp8 backend; a compact dataset its own reader
    refused(["--draft-config", spec, "--dataset", sp8], "float8_e4m3fn", "--hidden-states-backend file",
            "--hidden-states-backend fp8")
    refused(["--draft-config", spec, "--dataset", compact, "--hidden-states-backend", "fp8"], "compact dataset",
            "ArrowDataset", "yields='speculators'")


def test_manifest_storage_names_the_backend_and_what_is_left_out():
    assert writers.manifest_storage("speculators", FP8_META)["speculators_backend"] == "fp8"
    assert writers.manifest_storage("speculators", FP8_META)["left_out"] == {}  # rebuilt into the file
    assert writers.manifest_storage("speculators", BF16_META)["speculators_backend"] == "file"
    sf = writers.manifest_storage("specforge", FP8_META)
    assert sf["dtype"] == "bfloat16" and sf["scale_layout"] == "none"
    c = writers.manifest_storage("compact", FP8_META)
    assert c["dtype"] == "float8_e4m3fn" and c["needs_model_dir"] and "layer.-1" in c["left_out"]


def test_compact_keeps_every_dumped_layer_and_needs_no_final():
    lay = writers.resolve_layout("compact", [1, 2], False, N)
    assert (lay.aux, lay.last) == ((1, 2), None)
    lay = writers.resolve_layout("compact", DUMPED, True, N, aux=AUX)
    assert (lay.aux, lay.last) == (tuple(AUX), N - 1)
    with pytest.raises(writers.LayoutError):
        writers.resolve_layout("compact", [1, 2], True, N, aux=[0])
    assert writers.SAMPLE_EXT["compact"] == "safetensors" and "compact" in writers.FORMATS


# ---- the formats from real dumps (torch, specforge, speculators, hs_connectors, datasets) ---------

def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    """Tensor for tensor: same keys, dtype, shape and bits."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    return a == b


def differing(ds_a, ds_b) -> list:
    assert len(ds_a) == len(ds_b)
    return [i for i in range(len(ds_a)) if not same(ds_a[i], ds_b[i])]


def _model_dir(path: Path, seed: int):
    """A model directory with what the reader rebuilds from: the embedding and the final norm."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True)
    embed = (torch.randn(VOCAB, H, generator=g) * 0.02).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_size": H, "num_hidden_layers": N, "vocab_size": VOCAB,
                                                  "rms_norm_eps": EPS}))
    return embed, norm


def _write_dumps(dump_dir: Path, dtype: str, rebuildable: str, embed, norm, model: Path) -> list:
    """The real DumpWriter's files of LENS text requests and one input_embeds request: [(path, ids, rid)],
    with the digest of ``model``'s tensors (the served model's, as ``start_dump`` records it)."""
    import torch

    from eaglepatch.extract.dumps import new_rid
    from eaglepatch.overlay import import_package
    from eaglepatch.storage import rms_final

    import_package("e3c_compact_under_test")
    storage = sys.modules["e3c_compact_under_test.storage"]
    dump_mod = __import__("e3c_compact_under_test.dump", fromlist=["DumpWriter"])
    identity = sys.modules["e3c_compact_under_test.identity"]
    weights = __import__("e3c_compact_under_test.weights", fromlist=["served_weights"])
    indices = [k + 1 for k in DUMPED]
    st = storage.Storage(dtype, rebuildable)
    served = weights.served_weights(SimpleNamespace(model_path=str(model), load_format="auto"),
                                    storage.left_out_states(st, indices, True, N))
    layout = storage.Layout(st, indices, True, N, "bfloat16", EPS, VOCAB, weights=served)
    meta = {"format": "eagle3-dump/1", "eagle3_layer_ids": json.dumps(DUMPED), "hf_hidden_state_indices":
            json.dumps(indices), "configured_layer_ids": json.dumps(DUMPED), "layer_id_reading": "plus_one",
            "final": "post_norm", "architecture": "DeepseekV3ForCausalLM", "model_path": "/m", "hidden_size": str(H),
            "num_hidden_layers": str(N), "dtype": "bfloat16", "sglang_version": "0.5.9", "series_version": "0.5.9-9",
            "tp_size": "1", "launch_id": "l", "replica_rank": "0"}
    w = dump_mod.DumpWriter(str(dump_dir), indices, True, 64 << 20, meta, vocab_size=VOCAB, layout=layout)
    g = torch.Generator().manual_seed(7)
    out = []
    for i, n in enumerate(LENS + [EMBEDS_LEN]):
        embeds = i == len(LENS)
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        # each slot with its own norm (they differ 100x and more on real targets); the embedding is the
        # vocabulary's row (rebuildable) except for the input_embeds request
        cap = {h: (torch.randn(n, H, generator=g) * 10.0 ** (h - 2)).to(torch.bfloat16) for h in indices}
        cap[0] = (torch.randn(n, H, generator=g) * 0.02).to(torch.bfloat16) if embeds else embed[ids]
        rid = new_rid()
        req = identity.RequestInfo(rid, n, input_embeds=embeds)
        w.submit(SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), input_ids=ids, extend_seq_lens_cpu=[n],
                                 extend_prefix_lens_cpu=[0], _eagle3_requests=[req]), cap, rms_final(cap[N], norm, EPS))
        out.append((dump_dir / f"{dump_mod.request_key(rid)}.safetensors", ids.tolist(), None if embeds else rid))
    w.close()
    assert (w.written, w.failed) == (len(out), 0)
    return out


def _mask(n: int) -> list:
    return [0] * (n // 2) + [1] * (n - n // 2)


@pytest.fixture(scope="module", params=STORAGES, ids=["-".join(s) for s in STORAGES])
def built(request, tmp_path_factory):
    """Dumps in one storage setting, each read once and written in the three formats, with the
    manifest fields the readers use (record.manifest's) and the speculators table."""
    pytest.importorskip("torch")
    for m in ("safetensors", "datasets", "specforge", "speculators", "hs_connectors"):
        pytest.importorskip(m)
    from eaglepatch.extract.dumps import load_dump, read_metadata
    from eaglepatch.storage import Rebuilder

    dtype, rebuildable = request.param
    root = tmp_path_factory.mktemp(f"compact-{dtype}-{rebuildable}")
    embed, norm = _model_dir(root / "model", seed=1)
    _model_dir(root / "other-embedding", seed=2)
    (root / "dumps").mkdir()
    dumps = _write_dumps(root / "dumps", dtype, rebuildable, embed, norm, root / "model")
    rb = Rebuilder(root / "model")
    layouts = {fmt: writers.resolve_layout(fmt, DUMPED, True, N, aux=AUX) for fmt in writers.FORMATS}
    outs = {fmt: root / fmt for fmt in writers.FORMATS}
    files = {fmt: [] for fmt in writers.FORMATS}
    decoded = []
    for i, (path, ids, rid) in enumerate(dumps):
        key = None if rid else read_metadata(path)["key"]  # the input_embeds request: checked by key
        dump = load_dump(path, ids, need_final=False, rid=rid, key=key, rebuilder=rb)
        decoded.append(dump)
        for fmt in writers.FORMATS:
            rel = writers.sample_rel(fmt, f"conv-{i:03d}")
            writers.write_sample(layouts[fmt], outs[fmt], rel, f"conv-{i:03d}", dump, _mask(len(ids)))
            files[fmt].append(rel)
    writers.publish_speculators(outs["speculators"], files["speculators"])
    dump_meta = read_metadata(dumps[0][0])
    for fmt in writers.FORMATS:
        (outs[fmt] / "manifest.json").write_text(json.dumps({
            "dataset_format": fmt, "eagle3_layer_ids": AUX, "dump_layer_ids": DUMPED, "files": files[fmt],
            "model": {"num_hidden_layers": N}, "dump_provenance": {"final": "post_norm"},
            "storage": writers.manifest_storage(fmt, dump_meta)}))
    return SimpleNamespace(root=root, dtype=dtype, rebuildable=rebuildable, dumps=dumps, decoded=decoded, outs=outs,
                           files=files, model=root / "model")


def _specforge_reader(out: Path, max_len: int = 2048):
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    return build_offline_eagle3_dataset(str(out), max_len=max_len)


def _speculators_reader(out: Path):
    """ArrowDataset through the transfer the manifest names (speculators' FP8Backend/FileBackend build
    these from --hidden-states-backend)."""
    from hs_connectors.transfer import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    backend = json.loads((out / "manifest.json").read_text())["storage"]["speculators_backend"]
    transfer = {"fp8": FP8Transfer, "file": FileTransfer}[backend](out / "hidden_states")
    return ArrowDataset(max_len=2048, datapath=str(out), transfer=transfer, on_missing="raise")


def test_compact_reads_as_specforge_reads_its_export(built):
    from eaglepatch.compact import CompactDataset

    for max_len in (2048, 7):  # 7: SpecForge cuts the longer samples
        theirs = _specforge_reader(built.outs["specforge"], max_len)
        ours = CompactDataset(built.outs["compact"], built.model, yields="specforge", max_len=max_len)
        assert len(ours) == len(theirs) == len(built.dumps)
        assert differing(ours, theirs) == []
    item = ours[0]
    assert item["hidden_state"].dtype == item["target"].dtype == __import__("torch").bfloat16
    assert item["hidden_state"].shape[-1] == len(AUX) * H


def test_compact_reads_as_speculators_reads_its_export(built):
    from eaglepatch.compact import CompactDataset

    theirs = _speculators_reader(built.outs["speculators"])
    ours = CompactDataset(built.outs["compact"], built.model, yields="speculators")
    assert len(ours) == len(theirs) == len(built.dumps)
    assert differing(ours, theirs) == []
    assert ours[0]["hidden_states"].shape == (LENS[0], len(AUX) * H)


def test_the_exports_hold_what_the_dump_stores(built):
    """speculators from an fp8 dump: fp8 states and float32 scales [T, L+1, 1], the dump's own q and
    scale passed on untouched (the rebuilt embedding quantised); SpecForge: bf16. compact: the dump
    file's tensors bit for bit plus loss_mask, about the dump's size."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eaglepatch.storage import Rebuilder

    fp8 = built.dtype == "fp8"
    for i, (path, ids, _) in enumerate(built.dumps):
        stored = load_file(str(path))
        sp_path = built.outs["speculators"] / built.files["speculators"][i]
        sp = load_file(str(sp_path))
        with safe_open(str(sp_path), framework="pt") as f:
            sp_meta = f.metadata()
        T = len(ids)
        assert sp["hidden_states"].shape == (T, len(AUX) + 1, H)
        assert sp_meta["hidden_states_dtype"] == ("float8_e4m3fn" if fp8 else "bfloat16")
        if fp8:
            assert sp["hidden_states"].dtype == torch.float8_e4m3fn and sp_meta["scale_layout"] == "per_token_per_state"
            scales = sp[writers.SCALES_KEY]
            assert scales.dtype == torch.float32 and scales.shape == (T, len(AUX) + 1, 1)
            for slot, k in enumerate(AUX + [N - 1]):
                name = f"layer.{k}"
                if name in stored and stored[name].shape[0] == T:  # stored whole: passed on untouched
                    assert torch.equal(_bits(sp["hidden_states"][:, slot]), _bits(stored[name]))
                    assert torch.equal(scales[:, slot], stored["scale." + name])
        else:
            assert sp["hidden_states"].dtype == torch.bfloat16 and writers.SCALES_KEY not in sp
        sf = torch.load(str(built.outs["specforge"] / built.files["specforge"][i]), weights_only=True)
        assert sf["hidden_state"].dtype == sf["aux_hidden_state"].dtype == torch.bfloat16
        c_path = built.outs["compact"] / built.files["compact"][i]
        compact = load_file(str(c_path))
        assert compact.pop("loss_mask").tolist() == _mask(T)
        assert same(compact, stored)
        assert c_path.stat().st_size <= path.stat().st_size + 8 * T + 512
        # read back for checks (writers.read_sample): the three agree where they hold the same state
        back = {fmt: writers.read_sample(fmt, built.outs[fmt] / built.files[fmt][i], Rebuilder(built.model))
                for fmt in writers.FORMATS}
        assert same(back["compact"]["aux"], back["specforge"]["aux"]) and same(back["compact"]["final"],
                                                                               back["specforge"]["last"])
        assert back["speculators"]["aux"].dtype == torch.bfloat16
        if not fp8:
            assert same(back["compact"]["aux"], back["speculators"]["aux"])
            assert same(back["compact"]["last"], back["speculators"]["last"])
    if built.rebuildable == "omit":  # nothing rebuildable is stored
        text = load_file(str(built.outs["compact"] / built.files["compact"][0]))
        assert "final" not in text and "layer.-1" not in text
        embeds = load_file(str(built.outs["compact"] / built.files["compact"][-1]))
        assert embeds["rows.layer.-1"].tolist() == list(range(EMBEDS_LEN))


def test_the_comparison_fails_on_wrong_compact_data(built, tmp_path):
    """A scale perturbed in one sample: the items that use it differ from the consumers' (and only
    those); another model's embedding and final norm: refused (the dumps record the served ones')."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eaglepatch.compact import CompactDataset

    sf = _specforge_reader(built.outs["specforge"])
    spec = _speculators_reader(built.outs["speculators"])
    if built.dtype == "fp8":
        bad = tmp_path / "perturbed"
        shutil.copytree(built.outs["compact"], bad)
        rel = built.files["compact"][1]  # speculators row 1
        with safe_open(str(bad / rel), framework="pt") as f:
            meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        t["scale.layer.1"][2] *= 1.5
        save_file(t, str(bad / rel), metadata=meta)
        assert differing(CompactDataset(bad, built.model, yields="speculators"), spec) == [1]
        hit = sorted(built.files["compact"]).index(rel)  # SpecForge's order: the paths sorted
        assert differing(CompactDataset(bad, built.model, yields="specforge"), sf) == [hit]
    if built.rebuildable == "omit":
        from eaglepatch.errors import UsageError

        other = built.root / "other-embedding"
        # every text sample's embedding (an aux layer) and every final state would be rebuilt from it: refused
        for yields in ("specforge", "speculators"):
            with pytest.raises(UsageError, match="another checkpoint"):
                CompactDataset(built.outs["compact"], other, yields=yields)[0]
    else:  # nothing rebuilt: the model directory is not read
        assert differing(CompactDataset(built.outs["compact"], built.root / "other-embedding", yields="specforge"),
                         sf) == []
    # a reader given the wrong view's layers yields other tensors too
    assert differing(CompactDataset(built.outs["compact"], built.model, yields="specforge", aux=[0, 1, 2]), sf)
    assert torch.is_tensor(sf[0]["target"])


def test_compact_dataset_refusals_are_one_line(built, tmp_path):
    from eaglepatch.compact import CompactDataset
    from eaglepatch.errors import UsageError

    with pytest.raises(UsageError, match="not a compact dataset"):
        CompactDataset(built.outs["specforge"], built.model)
    with pytest.raises(UsageError, match=r"aux layers \[7\] are not in"):
        CompactDataset(built.outs["compact"], built.model, aux=[7])
    with pytest.raises(UsageError, match="yields='x'"):
        CompactDataset(built.outs["compact"], built.model, yields="x")
    if built.rebuildable == "omit":
        with pytest.raises(UsageError, match="holds no model weights"):
            CompactDataset(built.outs["compact"], tmp_path, yields="specforge")[0]
