"""tools/extract.py --format dflash|dspark (issue 44, item 2): SpecForge 0.2.0's offline DFlash and DSpark
samples, read and trained on with SpecForge's own code.

The servers are loopback stand-ins of patched sglang 0.5.17 / 0.5.23 servers
(``extract_fixtures/dumpserver.py``: /generate, the dump flush) whose files the overlay's real
``DumpWriter`` writes, bf16 (stored whole) or fp8 with the rebuildable states left out (compact), from the
rows of Hugging Face's DeepseekV3ForCausalLM on the tiny smoke checkpoint (hidden 256, 4 layers; the
embedding and layers 0-3 dumped, layer 3 before the final norm, and the post-norm final state).

- Each dataset holds exactly what the reader path gives for its dumps (``load_dump``: fp8
  dequantised, left-out states rebuilt from --model), and ``hidden_states`` equals, within the
  storage's rounding, what SpecForge's own ``extract_context_feature`` takes from HF's
  ``output_hidden_states`` for the draft's ``target_layer_ids`` (its DFlash draft's reading: id k =
  output of layer k); DSpark's ``target_last_hidden_states`` is the post-norm final state, the one
  SpecForge's DSpark objective feeds the target's LM head. The same comparison fails on a copy whose
  layers are shifted by one (ids read as capture indices, the EAGLE-3 reading of [0, 2] on 0.5.17+)
  and on a DSpark copy holding the pre-norm last layer.
- SpecForge reads them with its registered providers: ``resolve_offline_capture`` (the capture
  layers it would ask SGLang for are the manifest's draft ids; the features it persists are the
  sample's keys), its offline reader, ``LocalFeatureStore``, ``FeatureDataLoader`` with its
  ``dflash_family_data`` normaliser and collator; its DFlash and DSpark drafts (``build_draft``),
  training models (``build_training_model``: OnlineDFlashModel / OnlineDSparkModel with the target's
  LM head) and step strategies train a few steps.
- Refused in one line, nothing written: a dump without the draft's layers (naming
  EAGLE3_DUMP_LAYERS with -1, read as layer-output ids on every series) or without the final state
  (DSpark), a release that serves no DFlash (0.5.9), a config of the other family, of EAGLE-3, with
  two different layer lists, without layers, for another target depth, ids out of range or twice,
  --draft-config with an EAGLE-3 format, a resumed dataset with another draft's layers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
for _m in ("transformers", "tokenizers", "safetensors", "specforge"):
    pytest.importorskip(_m)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))
sys.path.insert(0, str(REPO / "src" / "eaglepatch" / "smoke"))

from conftest import one_line_error  # noqa: E402
from test_extract_client import run_cli  # noqa: E402  (tools/extract.py main() in this process)
from test_extract_deps import WITHOUT  # noqa: E402
from test_storage import _Batch, dump_mod, identity, ov_storage, ov_weights  # noqa: E402  (the overlay's writer)

from eaglepatch import conventions  # noqa: E402
from eaglepatch.extract import drafts, dumps  # noqa: E402
from eaglepatch.storage import Rebuilder, rms_final  # noqa: E402

EXTRACT = REPO / "tools" / "extract.py"
N, H, V = 4, 256, 1024  # the smoke checkpoint's layers, hidden size, vocabulary
DUMPED = [-1, 0, 1, 2, 3]  # layer-output ids the servers dump (3 = N-1, before the final norm)
IDS = {"dflash": [0, 2], "dspark": [1, 2]}  # the drafts' dflash_config.target_layer_ids
RELEASES = ["0.5.17", "0.5.23"]
STORAGES = {"bf16": ("bf16", "store"), "fp8": ("fp8", "omit")}
TOL = {"bf16": 0.02, "fp8": 0.08}  # max |dataset - HF| / max |HF| of a sample: bf16 and fp8 e4m3 rounding
BF16 = torch.bfloat16
N_CONV = 8
MAX_LEN = 256  # --max-len of every run: it leaves the "one-token" conversation one assistant token


# ---- the target, its drafts, the servers --------------------------------------------------------

def draft_config(family: str, ids=None, **extra) -> dict:
    """A tiny SpecForge draft config of ``family`` (its field names) for the smoke target."""
    cfg = {"architectures": ["DFlashDraftModel" if family == "dflash" else "DSparkDraftModel"], "model_type": "qwen3",
           "hidden_size": H, "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": V, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 2048, "rope_theta": 10000.0, "block_size": 4, "num_target_layers": N,
           "layer_types": ["full_attention"], "tie_word_embeddings": False,
           "dflash_config": {"target_layer_ids": list(IDS[family] if ids is None else ids), "mask_token_id": 3}}
    if family == "dspark":
        cfg["dflash_config"].update(projector_type="dspark", markov_rank=16, markov_head_type="vanilla",
                                    confidence_head_alpha=1.0)
    cfg.update(extra)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The smoke checkpoint with the chat tokenizer (--model), its HF reference, the conversations
    (one that --max-len cuts after its first assistant token: no two consecutive loss tokens) and the
    two drafts."""
    import _hf
    from safetensors.torch import load_file

    from eaglepatch.serve import tinychat

    root = tmp_path_factory.mktemp("dflash")
    model = root / "model"
    _hf.build_deepseek(model)
    tinychat.build_tokenizer(model)
    weights = load_file(str(model / "model.safetensors"))
    from eaglepatch.extract.tokenize import ChatTokenizer

    tok = ChatTokenizer(model)

    def one_token(words: int):
        msgs = [{"role": "user", "content": " ".join(["hello"] * words)},
                {"role": "assistant", "content": "yes no maybe"}]
        return tok.encode(msgs, 4 * MAX_LEN).loss_mask.index(1), msgs

    first, _ = one_token(10)
    first, msgs = one_token(10 + MAX_LEN - 1 - first)
    assert first == MAX_LEN - 1  # the last token --max-len keeps is the first assistant token
    recs = tinychat.conversations(N_CONV) + [{"id": "one-token", "messages": msgs}]
    ref = _hf.Reference(model)
    cache, lock = {}, threading.Lock()

    def run(ids):
        key = tuple(int(x) for x in ids)
        with lock:
            if key not in cache:
                cache[key] = ref.run(list(key))
            return cache[key]

    return SimpleNamespace(root=root, model=model, ref=ref, run=run, norm=weights["model.norm.weight"].to(BF16),
                           eps=json.loads((model / "config.json").read_text())["rms_norm_eps"],
                           data=tinychat.write_jsonl(root / "conv.jsonl", recs), recs=recs,
                           drafts={f: write_config(root / f"draft-{f}", draft_config(f)) for f in IDS})


def writer_server(w, dump_dir: Path, release: str, storage=("bf16", "store"), layers=DUMPED, final: bool = True,
                  architecture: str = "DeepseekV3ForCausalLM"):
    """A stand-in of a patched sglang ``release`` server on the smoke target: its dump files written by
    the overlay's real DumpWriter in ``storage`` (EAGLE3_DUMP_DTYPE, EAGLE3_DUMP_REBUILDABLE), its rows
    HF's residual stream in bf16 (the final state: the bf16 norm of the last layer's output)."""
    from dumpserver import DumpServer

    indices = [k + 1 for k in layers]
    st = ov_storage.Storage(*storage)
    left = ov_storage.left_out_states(st, indices, final, N)
    served = ov_weights.served_weights(SimpleNamespace(model_path=str(w.model), load_format="auto"), left) if left \
        else None
    layout = ov_storage.Layout(st, indices, final, N, "bfloat16", w.eps, V, weights=served)
    meta = {"format": "eagle3-dump/1", "eagle3_layer_ids": json.dumps(layers), "hf_hidden_state_indices":
            json.dumps(indices), "configured_layer_ids": json.dumps(layers),
            "layer_id_reading": conventions.release_rule(release), "final": "post_norm" if final else "none",
            "architecture": architecture, "model_path": str(w.model), "hidden_size": str(H),
            "num_hidden_layers": str(N), "dtype": "bfloat16", "sglang_version": release,
            "series_version": f"{release}-9", "tp_size": "1", "launch_id": "launch", "replica_rank": "0"}
    dump_dir.mkdir(parents=True, exist_ok=True)

    class WriterServer(DumpServer):
        def __init__(self):
            self.writer = dump_mod.DumpWriter(str(dump_dir), indices, final, 64 << 20, meta, vocab_size=V,
                                              layout=layout)
            self.forward = threading.Lock()  # one forward at a time, as the scheduler runs them
            super().__init__(dump_dir, layers, H, N, model_path=str(w.model))

        def _write(self, rid, ids, action):
            ref = w.run(ids)
            cap = {i: ref.stream[i].to(BF16) for i in indices}
            fin = rms_final(ref.stream[N].to(BF16), w.norm, w.eps)
            self.writer.submit(_Batch(torch.tensor(ids), identity.RequestInfo(rid, len(ids))), cap, fin)

        def flush(self):
            with self.forward:
                counts = super().flush()
                report = self.writer.flush_report(60)
            assert report["flushed"] and report["failed"] == 0, report
            return counts

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                self.writer.close()

    return WriterServer()


def extract(w, url, dump_dir, out, fmt, *extra, draft=True):
    """The CLI on the world's data (``draft``: pass the family's draft config)."""
    return run_cli(["--server", url, "--model", w.model, "--data", w.data, "--dump-dir", dump_dir, "--out", out,
                    "--no-progress", "--format", fmt, "--dump-timeout", "10",
                    "--max-len", str(MAX_LEN)]
                   + (["--draft-config", w.drafts[fmt]] if draft and fmt in IDS else []) + list(extra))


@pytest.fixture(scope="module")
def datasets(world):
    """(family, release, storage) -> the dataset extracted once from such a server, dumps kept."""
    made = {}

    def get(family: str, release: str, storage: str) -> SimpleNamespace:
        key = (family, release, storage)
        if key not in made:
            name = "-".join(key)
            dump_dir = world.root / f"dumps-{name}"
            with writer_server(world, dump_dir, release, STORAGES[storage]) as s:
                p = extract(world, s.url, dump_dir, world.root / f"ds-{name}", family, "--keep-dumps")
            assert p.returncode == 0, p.stderr[-3000:]
            made[key] = SimpleNamespace(out=world.root / f"ds-{name}", dump_dir=dump_dir, stderr=p.stderr,
                                        family=family, release=release, storage=storage)
        return made[key]

    return get


# ---- the comparison with HF, through SpecForge's own reading of the draft's ids -------------------

def hf_hidden_states(ref) -> list:
    """HF's ``output_hidden_states`` of one prompt (batch dim dropped): the embedding, the outputs of
    layers 0..N-2, and at index N the post-norm state (transformers appends the normed last one)."""
    return list(ref.stream[:N]) + [ref.final]


def specforge_draft(family: str, config_dir: Path):
    """SpecForge's own draft model of ``config_dir`` (what it trains; its ``target_layer_ids``)."""
    from specforge.modeling.auto import AutoDraftModel
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(config_dir))
    cfg._attn_implementation = "sdpa"
    return AutoDraftModel.from_config(cfg)


def sample_errors(w, out: Path, target_layer_ids) -> tuple[float, float]:
    """(hidden_states, target_last_hidden_states) worst relative error over the samples of ``out``
    against HF: hidden_states against SpecForge's ``extract_context_feature`` of HF's hidden states
    at the draft's ``target_layer_ids``; the target state against HF's post-norm state (0 without one)."""
    from specforge.modeling.draft.dflash import extract_context_feature

    worst = [0.0, 0.0]
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files
    for rel in files:
        s = torch.load(str(out / rel), weights_only=True)
        ref = w.run(s["input_ids"].tolist())
        want = extract_context_feature(hf_hidden_states(ref), target_layer_ids)
        assert s["hidden_states"].shape == want.shape, (s["hidden_states"].shape, want.shape)
        worst[0] = max(worst[0], float((s["hidden_states"].float() - want).abs().max() / want.abs().max()))
        if "target_last_hidden_states" in s:
            worst[1] = max(worst[1], float((s["target_last_hidden_states"].float() - ref.final).abs().max()
                                           / ref.final.abs().max()))
    return worst[0], worst[1]


def rewritten(w, src: Path, dst: Path, shift: int = 0, pre_norm: bool = False) -> Path:
    """A copy of dataset ``src`` whose samples hold HF's states at the dataset's HF indices shifted by
    ``shift`` (-1: the ids read as capture indices, the EAGLE-3 reading of [0, 2] on 0.5.17+), and with
    ``pre_norm`` the last layer's output before the final norm as DSpark's target."""
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    hf = man["hf_hidden_state_indices"]
    for rel in man["files"]:
        s = torch.load(str(dst / rel), weights_only=True)
        ref = w.run(s["input_ids"].tolist())
        dt = s["hidden_states"].dtype
        s["hidden_states"] = torch.cat([ref.stream[i + shift] for i in hf], dim=-1).to(dt)
        if pre_norm:
            s["target_last_hidden_states"] = ref.stream[N].to(dt)
        torch.save(s, str(dst / rel))
    return dst


# ---- the datasets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("family", list(IDS))
def test_samples_hold_what_the_draft_reads(world, datasets, tmp_path, family, release, storage):
    """Every sample holds what the reader path yields for its dump (fp8 dequantised, left-out states
    rebuilt) and what SpecForge's draft reads on HF; the same check fails on a copy shifted by one
    (and, DSpark, on one holding the pre-norm last layer as target); the manifest records both
    readings; the sample without two consecutive loss tokens is skipped."""
    ds = datasets(family, release, storage)
    out = ds.out
    man = json.loads((out / "manifest.json").read_text())
    ids = IDS[family]
    hf = conventions.draft_hf_indices(release, family, "deepseek_v2", ids)
    assert man["dataset_format"] == family and man["samples"] == N_CONV and man["failed"] == []
    assert [s["id"] for s in man["skipped"]] == ["one-token"], man["skipped"]
    assert "no two consecutive assistant tokens" in man["skipped"][0]["reason"]
    d = man["draft"]
    assert d["family"] == family and d["target_layer_ids"] == ids and d["ids_from"] == "dflash_config.target_layer_ids"
    assert d["reading"] == {"sglang_release": release, "model_file": "deepseek_v2",
                            "rule": conventions.draft_rule(release, family, "deepseek_v2"),
                            "meaning": "id k = output of layer k (HF index k+1)"}
    assert d["hf_hidden_state_indices"] == hf and d["layer_output_ids"] == [h - 1 for h in hf]
    assert man["hf_hidden_state_indices"] == sorted(hf) and man["eagle3_layer_ids"] == sorted(h - 1 for h in hf)
    assert (d["block_size"], d["mask_token_id"], d["num_target_layers"]) == (4, 3, N)
    assert man["sglang_draft_config"]["dflash_config"]["target_layer_ids"] == ids
    assert man["dump_layer_ids"] == DUMPED
    assert man["final"] == ("post_norm" if family == "dspark" else None)
    assert man["storage"]["dtype"] == "bfloat16" and man["storage"]["reader"].startswith("SpecForge 0.2.0 offline")
    assert f"training.strategy={family}" in ds.stderr and "read on sglang" in ds.stderr

    # what the reader path gives for each sample's own dump (kept), tensor for tensor
    rb = Rebuilder(world.model)
    recs = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("file")]
    assert len(recs) == N_CONV
    for r in recs:
        s = torch.load(str(out / r["file"]), weights_only=True)
        dump = dumps.load_dump(dumps.dump_path(ds.dump_dir, r["key"]), s["input_ids"].tolist(), need_final=False,
                               rid=r["rid"], rebuilder=rb)
        assert (dump.storage == "float8_e4m3fn") == (storage == "fp8")
        assert sorted(s) == sorted(["input_ids", "loss_mask", "hidden_states"]
                                   + (["target_last_hidden_states"] if family == "dspark" else []))
        assert s["input_ids"].dtype == s["loss_mask"].dtype == torch.int64 and s["hidden_states"].dtype == BF16
        assert torch.equal(s["hidden_states"], torch.cat([dump.layers[f"layer.{h - 1}"] for h in sorted(hf)], -1))
        if family == "dspark":
            assert torch.equal(s["target_last_hidden_states"], dump.final)
            assert ("final" in dump.rebuilt) == (storage == "fp8")  # omit: rebuilt from --model's final norm

    # against HF through SpecForge's reading of the draft's ids, and the same check on wrong copies
    layer_ids = specforge_draft(family, world.drafts[family]).target_layer_ids
    assert list(layer_ids) == ids
    err, err_last = sample_errors(world, out, layer_ids)
    assert err <= TOL[storage] and err_last <= TOL[storage], (err, err_last)
    shifted, _ = sample_errors(world, rewritten(world, out, tmp_path / "shifted", shift=-1), layer_ids)
    assert shifted > 3 * TOL[storage], f"a dataset shifted by one passes the check ({shifted:.3g})"
    if family == "dspark":
        _, pre = sample_errors(world, rewritten(world, out, tmp_path / "pre-norm", pre_norm=True), layer_ids)
        assert pre > 3 * TOL[storage], f"a pre-norm target passes the check ({pre:.3g})"


def three_steps(step, model, draft, batches: list) -> tuple:
    """Three AdamW steps of SpecForge's step strategy ``step`` over ``model`` on the first three
    ``batches``: (the losses, the names of the draft's weights that moved)."""
    torch.manual_seed(0)
    before = {k: v.detach().clone() for k, v in draft.named_parameters() if v.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for batch in batches[:3]:
        res = step.forward_loss(batch)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(float(res.loss.detach()))
    return losses, [k for k, v in draft.named_parameters() if k in before and not torch.equal(v, before[k])]


def _specforge_run(w, out: Path, family: str):
    """SpecForge's resolved offline run for ``out`` and the family's draft (its own Config)."""
    from specforge.application.composition import resolve_offline_capture
    from specforge.config import Config

    cfg = Config(model={"target_model_path": str(w.model), "draft_model_config": str(w.drafts[family]),
                        "torch_dtype": "bfloat16"},
                 data={"hidden_states_path": str(out)},
                 training={"strategy": family, "attention_backend": "sdpa", "num_anchors": 8})
    return cfg, resolve_offline_capture(cfg)


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("family", list(IDS))
def test_specforge_reads_and_trains_on_the_samples(world, datasets, family, storage):
    """SpecForge 0.2.0's registered providers: the layers it would capture are the manifest's draft
    ids and its persisted features the samples' keys; its offline reader, LocalFeatureStore and
    FeatureDataLoader with the family's normaliser and collator load every sample; its draft,
    training model and step strategy train three steps (finite losses, the draft's weights move).
    DSpark: the target LM head SpecForge built gives HF's next-token argmax on our
    target_last_hidden_states (its teacher is the target's own distribution)."""
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.model_loading import resolve_draft_config
    from transformers import AutoConfig, AutoTokenizer

    ds = datasets(family, RELEASES[0], storage)
    man = json.loads((ds.out / "manifest.json").read_text())
    cfg, resolved = _specforge_run(world, ds.out, family)
    assert list(resolved.capture_layers) == man["draft"]["target_layer_ids"]
    assert resolved.capture_method == family
    sample = torch.load(str(ds.out / man["files"][0]), weights_only=True)
    assert sorted(resolved.layout.output_names) == sorted(sample)

    providers = resolved.run.algorithm.providers
    offline = providers.offline_for("text")
    assert offline.normalizer_id == man["draft"]["specforge"]["normalizer"]
    refs = offline.build_reader(str(ds.out), run_id="t", ttt_length=7, max_len=2048).read()
    assert len(refs) == man["samples"]
    loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=2, collate_fn=offline.build_collator(),
                               per_sample_transform=offline.build_normalizer(2048), strategy=family)
    batches = list(loader)
    assert len(batches) == man["samples"] // 2
    assert batches[0].tensors["hidden_states"].shape[-1] == len(man["draft"]["target_layer_ids"]) * H

    draft_config = resolve_draft_config(cfg, provider=providers.model.draft_config)
    draft = providers.model.build_draft(cfg, draft_config)
    parts = providers.model.build_training_model(cfg, draft, draft_config, AutoConfig.from_pretrained(str(world.model)),
                                                 AutoTokenizer.from_pretrained(str(world.model)))
    losses, moved = three_steps(providers.step.build(parts.model), parts.model, draft, batches)
    assert len(losses) == 3 and all(x == x and abs(x) < 1e4 for x in losses), losses
    assert any(k.startswith("fc.") for k in moved), moved  # the layer that reads hidden_states learned

    if family == "dspark":
        agree = total = 0
        for rel in man["files"]:
            s = torch.load(str(ds.out / rel), weights_only=True)
            with torch.no_grad():
                teacher = parts.model.lm_head(s["target_last_hidden_states"]).float().argmax(-1)
            agree += int((teacher == world.run(s["input_ids"].tolist()).logits.argmax(-1)).sum())
            total += teacher.numel()
        assert agree / total >= 0.95, f"SpecForge's DSpark teacher agrees with HF on {agree}/{total} tokens"


def test_hand_ids_read_as_the_family_and_a_resume_keeps_the_draft(world, datasets, tmp_path):
    """--aux-layers with --format dflash names the draft's target_layer_ids, read the DFlash way (on
    0.5.17 the EAGLE-3 reading of [0, 2] would be the inputs of layers 0 and 2): the same samples as
    the config's. A resumed dataset with another draft's layers is refused before any request; with
    the same draft it has nothing to do."""
    ds = datasets("dflash", "0.5.17", "bf16")
    dump_dir = tmp_path / "dumps"
    with writer_server(world, dump_dir, "0.5.17") as s:
        p = extract(world, s.url, dump_dir, tmp_path / "by-hand", "dflash", "--aux-layers=0,2", draft=False)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (ds.out, tmp_path / "by-hand"))
    assert b["draft"]["ids_from"] == "--aux-layers" and b["draft"]["config"] is None
    assert b["eagle3_layer_ids"] == a["eagle3_layer_ids"] == [0, 2]
    assert conventions.layer_output_ids(conventions.release_rule("0.5.17"), [0, 2]) == [-1, 1]  # EAGLE-3's
    for rel in a["files"]:
        assert torch.equal(torch.load(str(ds.out / rel))["hidden_states"],
                           torch.load(str(tmp_path / "by-hand" / rel))["hidden_states"])

    nowhere = "http://127.0.0.1:9"  # no server: both answers come from OUT alone
    p = extract(world, nowhere, dump_dir, tmp_path / "by-hand", "dflash", "--aux-layers=1,2", draft=False)
    line = one_line_error(p)
    assert p.returncode == 2 and "holds layer-output ids [0, 2]" in line and "layer-output ids [1, 2]" in line, line
    p = extract(world, nowhere, dump_dir, tmp_path / "by-hand", "dflash")
    assert p.returncode == 0 and "nothing to do" in p.stderr, p.stderr[-2000:]
    assert json.loads((tmp_path / "by-hand" / "manifest.json").read_text())["draft"]["ids_from"] == \
        "dflash_config.target_layer_ids"


# ---- refusals -----------------------------------------------------------------------------------------

def refused(p, out: Path, *needles) -> str:
    line = one_line_error(p)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in line, (n, line)
    assert not out.exists() or not list(out.rglob("*.ckpt")), "a refused run wrote samples"
    return line


@pytest.mark.parametrize("family", list(IDS))
def test_a_dump_without_the_drafts_states_is_refused(world, tmp_path, family):
    """Layers the draft reads missing from the dump (and, DSpark, the final state): one line naming
    them and how to dump them; the list it names holds -1, so every series reads it as layer-output
    ids, whatever its EAGLE-3 reading."""
    dump_dir = tmp_path / "dumps"
    with writer_server(world, dump_dir, "0.5.17", layers=[-1, 1, 3], final=False) as s:
        p = extract(world, s.url, dump_dir, tmp_path / "out", family)
    missing = [k for k in IDS[family] if k not in (-1, 1, 3)]
    value = ",".join(map(str, sorted({-1, *IDS[family]})))
    line = refused(p, tmp_path / "out", f"layer-output ids {missing}", f"EAGLE3_DUMP_LAYERS={value}",
                   f"tools/serve.py --draft-config {world.drafts[family]}")
    assert ("EAGLE3_DUMP_FINAL=1" in line) == (family == "dspark"), line
    for release in conventions.known_releases():  # the list names those layers on every series
        ids = [int(x) for x in value.split(",")]
        assert conventions.layer_output_ids(conventions.release_rule(release), ids) == ids, release
    assert not list(dump_dir.glob("*.safetensors")), "the refused run left its dump behind"


def test_what_sglang_never_feeds_the_draft_is_refused(world, tmp_path, monkeypatch):
    """A release that serves no DFlash (0.5.9), and an id naming the last layer's output on a model
    file whose capture never reaches it (deepseek_v2.py as released: ``conventions.reaches_last``;
    the series reaches it): one line each."""
    dump_dir = tmp_path / "dumps"
    with writer_server(world, dump_dir, "0.5.9") as s:
        p = extract(world, s.url, dump_dir, tmp_path / "out", "dflash")
    refused(p, tmp_path / "out", "sglang 0.5.9 serves no DFlash draft on deepseek_v2.py")
    from eaglepatch import conventions

    monkeypatch.setattr(conventions, "SERIES_MODEL_FILES", ())  # the capture as released
    with writer_server(world, dump_dir, "0.5.17") as s:
        p = extract(world, s.url, dump_dir, tmp_path / "out-last", "dflash", "--aux-layers=0,3", draft=False)
    refused(p, tmp_path / "out-last", "name 3, the output of the last layer (HF index 4)", "never feeds")


def test_draft_config_refusals(world, tmp_path):
    """Each bad configuration is one line, exit 2, before any request (no server listens)."""
    root = tmp_path / "cfgs"

    def cfg(name, family="dflash", **kw):
        c = draft_config(family)
        for k, v in kw.items():
            if k.startswith("dc_"):
                c["dflash_config"][k[3:]] = v
            elif v is None:
                c.pop(k, None)
            else:
                c[k] = v
        return write_config(root / name, c)

    eagle = write_config(root / "eagle", {"architectures": ["LlamaForCausalLMEagle3"],
                                          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    cases = [
        (["--format", "dflash", "--draft-config", world.drafts["dspark"]], "is a DSpark draft", "--format dspark"),
        (["--format", "dspark", "--draft-config", world.drafts["dflash"]], "is a DFlash draft", "--format dflash"),
        (["--format", "dflash", "--draft-config", eagle], "is an EAGLE-3 draft", "--format specforge"),
        (["--format", "dspark", "--draft-config", cfg("two", "dspark", dspark_target_layer_ids=[0, 1])],
         "names two layer lists: dspark_target_layer_ids=[0, 1]", "what SpecForge 0.2.0 trains"),
        (["--format", "dflash", "--draft-config", cfg("none", dc_target_layer_ids=None)],
         "names no layers", "dflash_config.target_layer_ids"),
        (["--format", "dflash", "--draft-config", cfg("deep", num_target_layers=61)],
         "made for a 61-layer target", "has 4 layers"),
        (["--format", "dflash", "--draft-config", cfg("range", dc_target_layer_ids=[1, 4])], "name [4]", "0..3"),
        (["--format", "dflash", "--aux-layers=2,2"], "name layer 2 twice", "name each layer once"),
        (["--format", "dflash", "--aux-layers=-1,2"], "name [-1]", "0..3"),
        (["--format", "dflash", "--draft-config", root / "absent"], "does not exist", "--draft-config"),
        (["--format", "specforge", "--draft-config", world.drafts["dflash"]], "--draft-config reads a DFlash",
         "--format dflash or dspark"),
        (["--format", "dflash", "--draft-config", world.drafts["dflash"], "--aux-layers=0,2"],
         "both --draft-config and --aux-layers", "pass one"),
        (["--format", "dspark"], "needs the DSpark draft's layers", "--draft-config DIR"),
    ]
    for i, (args, *needles) in enumerate(cases):
        out = tmp_path / f"out-{i}"
        p = run_cli(["--server", "http://127.0.0.1:9", "--model", world.model, "--data", world.data, "--dump-dir",
                     tmp_path, "--out", out, "--no-progress", "--max-len", str(MAX_LEN), *args])
        refused(p, out, *needles)
        assert not out.exists(), args


def test_field_names_as_the_trainers_write_them(tmp_path):
    """The Kimi-K2.7 DFlash layout (SpecForge's, 61 layers, block 8) and the Kimi-K3 DSpark layout (93
    layers, block 7) read as SpecForge's own resolver reads their ids; z-lab's dflash package keeps
    block_size in dflash_config, older configs at the top level; DSpark's prefixed fields win, as
    SGLang's parser takes them. On sglang 0.5.23 both families read id k as layer k's output on
    kimi_k25.py and kimi_k3.py."""
    from specforge.algorithms.model_providers import resolve_dflash_capture_layers

    k27 = draft_config("dflash", [1, 12, 24, 35, 47, 58], num_target_layers=61, block_size=8)
    k3 = draft_config("dspark", [7, 23, 51, 67, 83], num_target_layers=93, block_size=7)
    zlab = dict(draft_config("dflash", [1, 13, 25, 37, 49], num_target_layers=52), block_size=None)
    zlab["dflash_config"]["block_size"] = 16
    zlab["architectures"] = ["DFlash2DraftModel"]
    bundled = dict(draft_config("dspark", [7, 23], num_target_layers=93), dspark_target_layer_ids=[7, 23],
                   dspark_block_size=5)
    for name, c, fmt, block, arch in [("k27", k27, "dflash", 8, "KimiK25ForConditionalGeneration"),
                                      ("k3", k3, "dspark", 7, "KimiK3ForConditionalGeneration"),
                                      ("zlab", zlab, "dflash", 16, "KimiK25ForConditionalGeneration"),
                                      ("bundled", bundled, "dspark", 5, "KimiK3ForConditionalGeneration")]:
        spec = drafts.read_draft_config(write_config(tmp_path / name, c), fmt)
        assert list(spec.ids) == resolve_dflash_capture_layers(None, c, None), name
        assert (spec.family, spec.block_size, spec.mask_token_id) == (fmt, block, 3), name
        assert spec.num_target_layers == c["num_target_layers"]
        dl = drafts.draft_layers(spec, {"sglang_version": "0.5.23", "series_version": "0.5.23-9", "architecture": arch,
                                        "num_hidden_layers": str(c["num_target_layers"])})
        assert list(dl.hf) == [k + 1 for k in spec.ids] and list(dl.out_ids) == list(spec.ids), name
    with pytest.raises(Exception, match="serves no DFlash draft on kimi_k3.py"):
        drafts.draft_layers(drafts.spec_by_hand("dflash", [1]), {"sglang_version": "0.5.17",
                                                                 "architecture": "KimiK3ForConditionalGeneration"})


def test_without_torch_the_install_line_names_the_specforge_extra(tmp_path):
    p = subprocess.run([sys.executable, "-c", WITHOUT, "torch", str(EXTRACT), "--server", "http://127.0.0.1:9",
                        "--model", str(tmp_path), "--data", str(tmp_path / "none.jsonl"), "--dump-dir", str(tmp_path),
                        "--out", str(tmp_path / "out"), "--format", "dspark"], capture_output=True, text=True,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "--format dspark needs the Python package(s) torch" in lines[0], lines[0]
    assert "pip install -e '.[extract-specforge]'" in lines[0], lines[0]
