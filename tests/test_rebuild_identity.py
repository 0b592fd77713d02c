"""Rebuilt states tied to the served weights (issue 43, item 1), and a crafted fp8 ``eagle3-dump/1`` file
(item 17).

With ``EAGLE3_DUMP_REBUILDABLE=omit`` a reader rebuilds ``layer.-1`` (embedding rows) and the post-norm
``final`` (SpecForge's training target) from the model directory it is given. The real writer
(sglang-overlay's DumpWriter, driven on CPU as tests/test_dump_storage.py drives it, with the digest
``weights.served_weights`` takes from the served directory's safetensors, as ``start_dump`` does)
writes compact files; every reader (``load_dump``, ``CompactDataset``, ``tools/extract.py`` through a
loopback server whose files the real DumpWriter writes) rebuilds from the served weights and refuses,
in one line naming both directories, another checkpoint of the same shape, a file with no digest and
one of a server with dummy weights. The writer and the reader take the same digest of a single
``model.safetensors``, a sharded checkpoint and Kimi-K2.5's wrapper; a launch whose weights readers
could not check refuses omit; a LoRA request keeps its embedding rows. The real patched server with
omit is tests/test_extract.py's ``test_omit_rebuilds_only_from_the_served_weights``."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from conftest import one_line_error, run_tool  # noqa: E402
from test_storage import _Batch  # noqa: E402  (the ForwardBatch fields the writer reads, one request)

from eaglepatch.errors import UsageError  # noqa: E402
from eaglepatch.extract import dumps  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402
from eaglepatch.storage import Rebuilder, rms_final  # noqa: E402

PKG = "e3c_rebuild_under_test"
import_package(PKG)
dump_mod = __import__(PKG + ".dump", fromlist=["DumpWriter"])
weights = __import__(PKG + ".weights", fromlist=["served_weights"])
storage = sys.modules[PKG + ".storage"]
settings = sys.modules[PKG + ".settings"]
identity = sys.modules[PKG + ".identity"]

N, H, V, EPS = 4, 64, 1024, 1e-6
LAYERS = [-1, 0, 1, 2, 3]  # dumped (EAGLE-3 ids): the embedding and the last layer N-1 among them
INDICES = [k + 1 for k in LAYERS]
AUX = [-1, 1, 2]
BF16 = torch.bfloat16


# ---- model directories ----------------------------------------------------------------------------

def _tensors(seed: int, prefix: str = "model.") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {prefix + "embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).to(BF16),
            prefix + "norm.weight": (1 + 0.5 * torch.randn(H, generator=g)).to(BF16),
            prefix + "layers.0.mlp.weight": torch.randn(8, H, generator=g).to(BF16)}


def model_dir(path: Path, seed: int, layout: str = "single", tensors: dict | None = None) -> dict:
    """A model directory holding what the reader rebuilds from: ``single`` (model.safetensors),
    ``sharded`` (model.safetensors.index.json, the embedding and the final norm in two shards),
    ``kimi`` (Kimi-K2.5's wrapper: ``language_model.model.``); config.json for tools/extract.py."""
    from safetensors.torch import save_file

    t = tensors or _tensors(seed, "language_model.model." if layout == "kimi" else "model.")
    path.mkdir(parents=True, exist_ok=True)
    if layout == "sharded":
        names = sorted(t)
        shards = {"model-00001-of-00002.safetensors": [n for n in names if "embed" in n],
                  "model-00002-of-00002.safetensors": [n for n in names if "embed" not in n]}
        for f, ns in shards.items():
            save_file({n: t[n] for n in ns}, str(path / f))
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    else:
        save_file(t, str(path / "model.safetensors"))
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": V, "hidden_size": H, "num_hidden_layers": N,
           "rms_norm_eps": EPS}
    (path / "config.json").write_text(json.dumps({"text_config": cfg, **cfg} if layout == "kimi" else cfg))
    return t


def embed_norm(t: dict):
    e = next(v for k, v in t.items() if k.endswith("embed_tokens.weight"))
    return e, next(v for k, v in t.items() if k.endswith(".norm.weight"))


def served(model: Path, load_format: str = "auto"):
    """The resolved server arguments ``start_dump`` hands ``weights.served_weights``."""
    return SimpleNamespace(model_path=str(model), load_format=load_format)


# ---- the real writer ------------------------------------------------------------------------------

def base_meta(model: Path, dump_dirs=None) -> dict:
    """``start_dump``'s metadata for this model (``dump_dirs``: the directories, as the file sink's)."""
    meta = {"format": "eagle3-dump/1", "eagle3_layer_ids": json.dumps(LAYERS), "hf_hidden_state_indices":
            json.dumps(INDICES), "configured_layer_ids": json.dumps(LAYERS), "layer_id_reading": "plus_one",
            "final": "post_norm", "architecture": "DeepseekV3ForCausalLM", "model_path": str(model),
            "hidden_size": str(H), "num_hidden_layers": str(N), "dtype": "bfloat16", "sglang_version": "0.5.9",
            "series_version": "0.5.9-4", "tp_size": "1", "launch_id": "launch", "replica_rank": "0"}
    if dump_dirs is not None:
        meta["dump_dirs"] = json.dumps([str(d) for d in dump_dirs])
    return meta


def writer(directory, model: Path, rebuildable: str = "omit", dtype: str = "bf16", digest: bool = True,
           load_format: str = "auto", dump_dirs=None):
    """A DumpWriter as ``start_dump`` makes it: the layout's left-out states with the digest of the
    served directory's tensors (``digest=False``: the layout as before issue 43, no digest)."""
    st = storage.Storage(dtype, rebuildable)
    left = storage.left_out_states(st, INDICES, True, N)
    w = weights.served_weights(served(model, load_format), left) if digest and left else None
    layout = storage.Layout(st, INDICES, True, N, "bfloat16", EPS, V, weights=w)
    return dump_mod.DumpWriter(str(directory), INDICES, True, 64 << 20, base_meta(model, dump_dirs), vocab_size=V,
                               layout=layout)


def states(ids, embed, norm, lora_rows: bool = False):
    """A forward's captured states: the embedding output is the vocabulary's rows (another
    adapter's rows with ``lora_rows``), the other layers seeded by the ids; and the final state."""
    ids = torch.as_tensor(ids)
    g = torch.Generator().manual_seed(int(ids.sum()) * 31 + len(ids))
    cap = {i: (torch.randn(len(ids), H, generator=g) * 2 ** i).to(BF16) for i in INDICES[1:]}
    cap[0] = embed[ids] + (0.01 if lora_rows else 0)
    return cap, rms_final(cap[N], norm, EPS)


def write(w, ids, embed, norm, lora_id: str = "", lora_rows: bool = False, rid: str | None = None) -> tuple:
    rid = rid or dumps.new_rid()
    cap, fin = states(ids, embed, norm, lora_rows)
    w.submit(_Batch(torch.as_tensor(ids), identity.RequestInfo(rid, len(ids), lora_id=lora_id)), cap, fin)
    return rid, cap, fin


def flushed(w) -> None:
    report = w.flush_report(60)
    assert report["flushed"] and report["failed"] == 0, report


IDS = [3, 17, 5, 63, 0, 42, 8, 8, 29, 11, 1000, 7]


def served_dump(root: Path, **kw) -> SimpleNamespace:
    """The served model (``root/served``), another checkpoint of the same shape (``root/other``) and
    one request's compact file written by the served model's writer (``kw``: ``writer``'s)."""
    t = model_dir(root / "served", 1)
    model_dir(root / "other", 2)
    embed, norm = embed_norm(t)
    (root / "dumps").mkdir()
    w = writer(root / "dumps", root / "served", **kw)
    rid, cap, fin = write(w, IDS, embed, norm)
    flushed(w)
    w.close()
    return SimpleNamespace(path=dumps.dump_path(root / "dumps", dumps.rid_key(rid)), rid=rid, cap=cap, fin=fin,
                           served=root / "served", other=root / "other")


def _error_line(exc) -> str:
    line = exc.line() if hasattr(exc, "line") else str(exc)
    assert "\n" not in line and "; " in line, line
    return line


# ---- the repro: the served weights rebuild, another checkpoint of the same shape is refused --------

def test_the_served_weights_rebuild_and_another_checkpoint_is_refused(tmp_path):
    """The reproduction of issue 43 item 1 (shared/repros/2026-12-05/rebuild_wrong_model.py): the
    writer's compact file read with the served directory gives the states the server computed, bit
    for bit; with another checkpoint of the same shape load_dump refused nothing and rebuilt other
    states (errors of 4.3 and 4.9). Now it is refused in one line naming both directories."""
    x = served_dump(tmp_path)
    left = json.loads(dumps.read_metadata(x.path)["left_out"])
    assert sorted(left) == ["final", "layer.-1"]
    assert left["layer.-1"]["weights"]["tensor"] == "model.embed_tokens.weight"
    assert left["final"]["weights"]["tensor"] == "model.norm.weight"

    d = dumps.load_dump(x.path, IDS, rid=x.rid, rebuilder=Rebuilder(x.served))
    assert torch.equal(d.layers["layer.-1"], x.cap[0]) and torch.equal(d.final, x.fin)
    assert d.rebuilt == {"layer.-1": "embed_tokens", "final": "final_norm"}
    with pytest.raises(UsageError) as e:
        dumps.load_dump(x.path, IDS, rid=x.rid, rebuilder=Rebuilder(x.other))
    line = _error_line(e.value)
    assert f"dumped from {tmp_path / 'served'}" in line and f"but {tmp_path / 'other'} holds" in line, line
    assert "another checkpoint" in line and "as the model directory (tools/extract.py --model)" in line, line


def test_compact_dataset_refuses_another_checkpoint(tmp_path):
    """The compact dataset keeps the dump's metadata: CompactDataset with the served directory
    yields the served states, with another checkpoint of the same shape it refuses (it yielded the
    other weights' embedding rows and targets)."""
    from eaglepatch.compact import CompactDataset
    from eaglepatch.extract import writers

    x = served_dump(tmp_path)
    dump = dumps.load_dump(x.path, IDS, rid=x.rid, rebuilder=Rebuilder(x.served))
    out = tmp_path / "compact"
    layout = writers.resolve_layout("compact", LAYERS, True, N, aux=AUX)
    rel = writers.sample_rel("compact", "c0")
    writers.write_sample(layout, out, rel, "c0", dump, [0] * 4 + [1] * (len(IDS) - 4))
    (out / "manifest.json").write_text(json.dumps({
        "dataset_format": "compact", "eagle3_layer_ids": AUX, "dump_layer_ids": LAYERS, "files": [rel],
        "model": {"num_hidden_layers": N}, "dump_provenance": {"final": "post_norm"},
        "storage": writers.manifest_storage("compact", dump.meta)}))
    item = CompactDataset(out, x.served, yields="specforge")[0]
    assert torch.equal(item["target"][0], x.fin) and torch.equal(item["hidden_state"][0][:, :H], x.cap[0])
    with pytest.raises(UsageError) as e:
        CompactDataset(out, x.other, yields="specforge")[0]
    line = _error_line(e.value)
    assert str(tmp_path / "served") in line and str(tmp_path / "other") in line, line


@pytest.mark.parametrize("layout", ["single", "sharded", "kimi"])
def test_the_writer_and_the_reader_take_the_same_digest(tmp_path, layout):
    """The server's digest (read from the safetensors files by offset) is the reader's (of the tensor
    it loads and rebuilds from), whatever the layout; one value changed in either tensor changes
    that tensor's digest only."""
    t = model_dir(tmp_path / "m", 3, layout)
    left = ["layer.-1", "final"]
    server_side = weights.served_weights(served(tmp_path / "m"), left)
    rb = Rebuilder(tmp_path / "m")
    assert server_side == {"layer.-1": rb.weights("embedding"), "final": rb.weights("norm")}
    prefix = "language_model.model." if layout == "kimi" else "model."
    assert server_side["layer.-1"]["tensor"] == prefix + "embed_tokens.weight"
    assert server_side["layer.-1"]["shape"] == [V, H] and server_side["layer.-1"]["dtype"] == "BF16"
    for changed, state in ((prefix + "embed_tokens.weight", "layer.-1"), (prefix + "norm.weight", "final")):
        t2 = {k: v.clone() for k, v in t.items()}
        t2[changed].view(-1)[5] += 1
        model_dir(tmp_path / changed, 3, layout, tensors=t2)
        other = weights.served_weights(served(tmp_path / changed), left)
        assert other[state] != server_side[state]
        assert [s for s in left if s != state] == [s for s in left if other[s] == server_side[s]]
        rb2 = Rebuilder(tmp_path / changed)
        assert {"layer.-1": rb2.weights("embedding"), "final": rb2.weights("norm")} == other


def test_a_file_without_a_digest_or_with_dummy_weights_is_refused(tmp_path):
    """A compact file of the layout as it was (nothing ties it to any weights) is refused even with
    the served directory (it was read with any directory); so is one of a server that ran dummy
    weights, whose left-out states nothing can rebuild."""
    for name, kw, needle in (("old", {"digest": False}, "records no digest of the weights"),
                             ("dummy", {"load_format": "dummy"}, "--load-format dummy (random weights)")):
        x = served_dump(tmp_path / name, **kw)
        with pytest.raises(UsageError) as e:
            dumps.load_dump(x.path, IDS, rid=x.rid, rebuilder=Rebuilder(x.served))
        line = _error_line(e.value)
        assert needle in line and "EAGLE3_DUMP_REBUILDABLE=store" in line, line


def test_a_malformed_digest_is_a_bad_dump(tmp_path):
    """A ``weights`` record this reader does not know is the file's problem (BadDump: counted, retried)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    x = served_dump(tmp_path)
    with safe_open(str(x.path), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    left = json.loads(meta["left_out"])
    left["final"]["weights"]["sha256"] = "not hex"
    save_file(tensors, str(x.path), metadata=dict(meta, left_out=json.dumps(left)))
    with pytest.raises(dumps.BadDump, match=r"left_out\['final'\]\['weights'\]=.* is not a record"):
        dumps.load_dump(x.path, IDS, rid=x.rid, rebuilder=Rebuilder(x.served))


def test_a_lora_request_keeps_its_embedding_rows(tmp_path):
    """An adapter may target embed_tokens (or add tokens): a request with a lora_id stores every
    embedding row, and the reader yields the adapter's rows, not the checkpoint's (it rebuilt the
    checkpoint's); a request without one still leaves its rows out."""
    t = model_dir(tmp_path / "served", 1)
    embed, norm = embed_norm(t)
    (tmp_path / "d").mkdir()
    w = writer(tmp_path / "d", tmp_path / "served")
    lora, cap, _ = write(w, IDS, embed, norm, lora_id="adapter-with-embed-tokens", lora_rows=True)
    plain, _, _ = write(w, IDS[:5], embed, norm)
    flushed(w)
    w.close()
    rb = Rebuilder(tmp_path / "served")
    path = dumps.dump_path(tmp_path / "d", dumps.rid_key(lora))
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.get_tensor("rows.layer.-1").tolist() == list(range(len(IDS)))
    d = dumps.load_dump(path, IDS, rid=lora, rebuilder=rb)
    assert torch.equal(d.layers["layer.-1"], cap[0]) and not torch.equal(cap[0], embed[torch.as_tensor(IDS)])
    with safe_open(str(dumps.dump_path(tmp_path / "d", dumps.rid_key(plain))), "pt") as f:
        assert "layer.-1" not in f.keys() and "rows.layer.-1" not in f.keys()


# ---- the launch: omit only where readers can check the weights -----------------------------------

def test_omit_is_refused_at_launch_where_readers_could_not_check_the_weights(tmp_path):
    """A hub id (not a local directory), a directory without safetensors, weights loaded from
    another format, a checkpoint without the final norm: one line each, naming the fix. ``store``,
    or omit leaving nothing out, needs none of it; dummy weights are let through (benchmarks: every
    reader refuses their files)."""
    model_dir(tmp_path / "ok", 1)
    (tmp_path / "config-only").mkdir()
    from safetensors.torch import save_file

    (tmp_path / "no-norm").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(V, H, dtype=BF16)}, str(tmp_path / "no-norm" / "model.safetensors"))

    def check(model, load_format="auto", rebuildable="omit", indices=INDICES, final=True):
        s = SimpleNamespace(storage=storage.Storage("bf16", rebuildable), final=final)
        return weights.check_launch(served(model, load_format), s, indices, N)

    check(tmp_path / "ok")
    check("deepseek-ai/DeepSeek-V3", rebuildable="store")
    check("deepseek-ai/DeepSeek-V3", indices=[2, 3])  # omit, but nothing left out
    check(tmp_path / "config-only", load_format="dummy")
    check(tmp_path / "no-norm", final=False)  # only the embedding is left out
    for args, needle in (
            (("deepseek-ai/DeepSeek-V3",), "--model-path 'deepseek-ai/DeepSeek-V3' is not a directory on this machine"),
            ((tmp_path / "config-only",), "holds no model.safetensors.index.json or model.safetensors"),
            ((tmp_path / "ok", "pt"), "loads its weights with --load-format pt"),
            ((tmp_path / "no-norm",), "have no model.norm.weight, which final is rebuilt from")):
        with pytest.raises(settings.DumpConfigError) as e:
            check(*args)
        line = str(e.value)
        assert "\n" not in line and line.startswith("EAGLE3_DUMP_REBUILDABLE=omit: ") and needle in line, line
        assert line.endswith("or unset EAGLE3_DUMP_REBUILDABLE (store)"), line


@pytest.mark.parametrize("release", ["0.5.9", "0.5.17", "0.5.23"])
def test_every_covered_release_declares_the_server_args_the_launch_check_reads(release):
    from eaglepatch.fetch import unpacked_release
    from eaglepatch.series import available_series

    assert release in available_series()
    root = unpacked_release(release, quiet=True)
    fields = [root / "sglang/srt/server_args.py"] + sorted((root / "sglang/srt/arg_groups/fields").glob("*.py"))
    declared = "".join(p.read_text() for p in fields if p.exists())
    assert [f for f in weights.SERVER_ARGS if f"\n    {f}:" not in declared] == []


# ---- the real CLI: tools/extract.py against a loopback server whose files the real writer writes ----

@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from eaglepatch.serve import tinychat

    root = tmp_path_factory.mktemp("rebuild-cli")
    served_dir = tinychat.build_tokenizer(root / "served")
    t = model_dir(served_dir, 1)
    other = tinychat.build_tokenizer(root / "other")
    model_dir(other, 2)
    recs = tinychat.conversations(4)
    return SimpleNamespace(root=root, served=served_dir, other=other, tensors=t, recs=recs,
                           data=tinychat.write_jsonl(root / "conv.jsonl", recs))


def writer_server(dump_spec: str, model: Path, tensors: dict, dump_dirs=None):
    """The loopback stand-in of a patched server (extract_fixtures/dumpserver.py: /generate, the
    flush) whose dump files the real DumpWriter writes, spread over ``dump_spec``'s directories."""
    from dumpserver import DumpServer

    embed, norm = embed_norm(tensors)

    class WriterServer(DumpServer):
        def __init__(self):
            self.w = writer(dump_spec, model, dump_dirs=dump_dirs)
            self.forward = threading.Lock()  # one forward at a time, as the scheduler runs them
            super().__init__(Path(dump_spec.split(os.pathsep)[0]), LAYERS, H, N, model_path=str(model))

        def _write(self, rid, ids, action):
            write(self.w, ids, embed, norm, rid=rid)

        def flush(self):
            with self.forward:
                counts = super().flush()
                flushed(self.w)
            return counts

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                self.w.close()

    return WriterServer()


def _extract(cli, url, model, dump_dir, out, env=None):
    return run_tool("extract", "--server", url, "--model", model, "--data", cli.data, "--dump-dir", dump_dir,
                    "--out", out, "--no-progress", "--format", "specforge", "--aux-layers=" + ",".join(map(str, AUX)),
                    "--dump-timeout", "10", env=env)


def test_extract_rebuilds_from_the_served_model_and_refuses_another(cli_model, tmp_path):
    """tools/extract.py with ``--dump-dir ~/dumps`` (``~`` expanded, as tools/serve.py does; it was
    'not visible on this machine'): with the served directory every sample's embedding slot and
    target are the server's own rows; with another checkpoint of the same shape the run stops at its
    first dump, in one line naming both directories, and writes no sample."""
    home = tmp_path / "home"
    (home / "dumps").mkdir(parents=True)
    env = {"HOME": str(home)}
    embed, norm = embed_norm(cli_model.tensors)
    with writer_server(str(home / "dumps"), cli_model.served, cli_model.tensors) as s:
        p = _extract(cli_model, s.url, cli_model.served, "~/dumps", tmp_path / "out", env)
        assert p.returncode == 0, p.stderr[-3000:]
        samples = sorted((tmp_path / "out").glob("samples/*/*.ckpt"))
        assert len(samples) == len(cli_model.recs)
        for f in samples:
            d = torch.load(str(f), weights_only=True)
            cap, fin = states(d["input_ids"], embed, norm)
            assert torch.equal(d["aux_hidden_state"][0][:, :H], cap[0]), f
            assert torch.equal(d["hidden_state"][0], fin), f
        q = _extract(cli_model, s.url, cli_model.other, "~/dumps", tmp_path / "out-other", env)
    assert q.returncode == 2 and "Traceback" not in q.stderr, q.stderr[-3000:]
    line = one_line_error(q)
    assert f"dumped from {cli_model.served}" in line and f"but {cli_model.other} holds" in line, line
    assert not list((tmp_path / "out-other").glob("samples/*/*.ckpt"))


def test_extract_names_a_server_directory_left_out_of_dump_dir(cli_model, tmp_path):
    """A server spreading its files over two directories, a client listing one of them that holds
    dumps of that server already: the run stops at its first request in one line saying so, whether
    that request's file is in the listed directory or the other (it blamed a full disk). With no
    dump to learn from, the line names the possibility."""
    disks = [tmp_path / "disk-a", tmp_path / "disk-b"]
    for d in disks:
        d.mkdir()
    spec = os.pathsep.join(map(str, disks))
    with writer_server(spec, cli_model.served, cli_model.tensors, dump_dirs=disks) as s:
        p = run_tool("extract", "--server", s.url, "--model", cli_model.served, "--data", cli_model.data,
                     "--dump-dir", spec, "--out", tmp_path / "kept", "--no-progress", "--format", "specforge",
                     "--aux-layers=" + ",".join(map(str, AUX)), "--keep-dumps")
        assert p.returncode == 0, p.stderr[-3000:]
        # the directory the client lists: one holding dumps of this server (which one is the keys'
        # hashes: random request ids left disk-a without one, one run in 16)
        listed = next(d for d in disks if list(d.glob("*.safetensors")))
        for i in range(4):  # each run's first request lands in either directory
            p = _extract(cli_model, s.url, cli_model.served, listed, tmp_path / f"out{i}")
            assert p.returncode == 2, p.stderr[-3000:]
            line = one_line_error(p)
            assert f"spreads its dump files by key over 2 directories (its EAGLE3_DUMP_DIR={spec})" in line, line
            assert f"--dump-dir {listed} lists 1" in line and "full disk" not in line, line
            assert "every directory in its order" in line, line
    empty = tmp_path / "empty"
    empty.mkdir()
    problem, fix = dumps.no_dump_message(empty, "rid x", "0" * 64)
    assert "spreads its files over more directories than --dump-dir lists" in problem, problem
    assert "every directory in its order" in fix and "full disk" not in problem + fix


def test_a_dump_1_file_of_fp8_states_is_a_bad_dump_not_an_internal_error(cli_model, tmp_path):
    """A crafted ``eagle3-dump/1`` file whose states (and dtype) are fp8: the reader raised
    NotImplementedError (torch has no isfinite for fp8) and the CLI ended in an internal error; now
    the file is a bad dump, counted and retried, and the sample listed as failed naming why."""
    from dumpserver import DumpServer, expected_rows

    def fp8_states(ids):
        return {k: expected_rows(ids, k, H).to(torch.float8_e4m3fn) for k in LAYERS} | {
            "final": expected_rows(ids, 99, H).to(torch.float8_e4m3fn)}

    (tmp_path / "d").mkdir()
    with DumpServer(tmp_path / "d", LAYERS, H, N, meta={"dtype": "float8_e4m3fn"}, states=fp8_states) as s:
        p = run_tool("extract", "--server", s.url, "--model", cli_model.served, "--data", cli_model.data,
                     "--dump-dir", tmp_path / "d", "--out", tmp_path / "out", "--no-progress",
                     "--aux-layers=" + ",".join(map(str, AUX)), "--max-attempts", "2", "--limit", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr[-3000:]
    assert "2 bad dumps rejected" in p.stderr, p.stderr[-3000:]
    failed = [x for x in p.stderr.splitlines() if x.startswith("failed: conv-000: bad dump from")]
    assert len(failed) == 1 and "format eagle3-dump/1 with dtype 'float8_e4m3fn'" in failed[0], p.stderr[-3000:]