"""tools/extract.py reading the online sink (issue 43, item 13): ``--mooncake-master HOST:PORT
--mooncake-metadata URL`` reads each answer's states from the Mooncake Store its handle
(``meta_info["eagle3_dump"]``) names instead of waiting for a dump file, runs every check the file
path runs, and writes the same dataset.

One real ``mooncake_master`` (``eaglepatch.mooncake.Master``, the CPU wheel of ``ensure_site``) and
ONE real patched CPU SGLang server started as the README's CPU journey starts it
(``tools/serve.py --cpu-demo``) with ``--sink mooncake``: the dataset extracted from the store is
compared with Hugging Face ``output_hidden_states`` on the same weights (test_extract's reference),
the objects read are gone from the store afterwards (``StoreReader.manifest`` raises for them), and
nothing is written to the dump directory. Without the flags, the same server's answers are refused
in one line that names them; a server whose answers carry no handle is refused in one line; one of
the two flags alone is a one-line usage error (exit 2) that writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

import cpuserver  # noqa: E402
from conftest import one_line_error, run_tool  # noqa: E402
from test_extract import AUX_FLAG, LAYERS, TOL, records, run_cli, sample_error, serve_command  # noqa: E402
from test_extract import assets, reference  # noqa: E402,F401  (fixtures: the demo's model, HF on its weights)

from eaglepatch import mooncake  # noqa: E402
from test_mooncake import site  # noqa: E402,F401  (a fixture: the mooncake package's site, on sys.path)

N = 5  # conversations: a few, each one request through the store
SPECFORGE_IDS = (0, 1, 2)  # the server's --specforge-ids: the demo's SpecForge draft's aux ids (outputs of layers 0-2)


@pytest.fixture(scope="module")
def master(site, assets):  # noqa: F811
    with mooncake.Master(site, assets.root / "master.log") as m:
        yield m


@pytest.fixture(scope="module")
def store_server(assets, site, master):  # noqa: F811
    """The README's CPU demo server with the Mooncake sink (its Python finds the package through
    PYTHONPATH, as docs/online.md says), until the module is done."""
    import requests

    port = cpuserver.free_port()
    url = f"http://127.0.0.1:{port}"
    log = assets.root / "store-server.log"
    cmd = (serve_command(assets.demo, port) + f" --sink mooncake --mooncake-master {master.address} "
           f"--mooncake-metadata {master.metadata} --mooncake-segment-mb 256 --mooncake-buffer-mb 64 "
           f"--specforge-ids {','.join(map(str, SPECFORGE_IDS))}")
    with open(log, "w") as fh:
        proc = subprocess.Popen("exec " + cmd, shell=True, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                env=mooncake.with_site(dict(os.environ), site), start_new_session=True)
    try:
        cpuserver.wait_ready(proc, url, log, "tools/serve.py --cpu-demo --sink mooncake", timeout=600,
                             ready=lambda u: requests.get(u + "/health_generate", timeout=30).status_code == 200)
        info = json.loads((assets.demo / "serve.json").read_text())
        assert info["layers"] == LAYERS, info
        yield SimpleNamespace(url=url, dump_dir=Path(info["dump_dir"]), log=log)
    except cpuserver.NotReady as exc:
        pytest.fail(str(exc))
    finally:
        cpuserver.stop(proc)


@pytest.fixture(scope="module")
def data(assets):  # noqa: F811
    from eaglepatch.serve import tinychat

    return tinychat.write_jsonl(assets.root / "store-conv.jsonl", tinychat.conversations(N, seed=11))


def store_flags(master) -> list:
    return ["--mooncake-master", master.address, "--mooncake-metadata", master.metadata]


def extract(assets, url, data, out, *extra) -> SimpleNamespace:  # noqa: F811
    return run_cli(["--server", url, "--model", assets.ckpt, "--tokenizer", assets.tok, "--data", data,
                    "--out", out, "--no-progress", AUX_FLAG, *map(str, extra)])


def dumped_files(d: Path) -> set:
    return {p.name for p in d.glob("*.safetensors")} if d.is_dir() else set()


def test_extract_reads_the_store_into_the_dataset_and_deletes_what_it_read(assets, store_server, master, data,
                                                                           reference):  # noqa: F811
    from eaglepatch.extract.data import load_conversations
    from eaglepatch.extract.dumps import rid_key
    from eaglepatch.extract.tokenize import ChatTokenizer
    from eaglepatch.extract.writers import read_sample

    files_before = dumped_files(store_server.dump_dir)
    out = assets.root / "out-store"
    p = extract(assets, store_server.url, data, out, "--format", "specforge", "--concurrency", "2",
                *store_flags(master))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"summary: {N} extracted" in p.stderr, p.stderr[-2000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == N and man["failed"] == [] and man["dump_layer_ids"] == LAYERS
    # every sample: the ids and loss mask of the conversation, the states Hugging Face computes
    tok = ChatTokenizer(assets.tok)
    want = {c.id: tok.encode(c.messages, 2048) for c in load_conversations(data)}
    recs = [r for r in records(out) if r.get("file")]
    assert sorted(r["id"] for r in recs) == sorted(want)
    worst = 0.0
    for r in recs:
        s = read_sample("specforge", out / r["file"])
        assert s["input_ids"].tolist() == want[r["id"]].input_ids
        assert s["loss_mask"].tolist() == want[r["id"]].loss_mask
        worst = max(worst, sample_error(s, reference.run(want[r["id"]].input_ids), "specforge"))
    assert worst <= TOL, f"max |dataset - HF| = {worst:.3g} > {TOL}"
    # what was read is gone from the store, and nothing went to the dump directory
    reader = mooncake.StoreReader(master.address, master.metadata)
    try:
        for r in recs:
            with pytest.raises(mooncake.StoreError, match="no object"):
                reader.manifest(rid_key(r["rid"]))
    finally:
        reader.close()
    assert dumped_files(store_server.dump_dir) == files_before
    # --keep-dumps leaves the object in the store (a new dataset, one conversation)
    kept = assets.root / "out-store-kept"
    p = extract(assets, store_server.url, data, kept, "--limit", "1", "--keep-dumps", *store_flags(master))
    assert p.returncode == 0, p.stderr[-3000:]
    rid = [r for r in records(kept) if r.get("file")][0]["rid"]
    reader = mooncake.StoreReader(master.address, master.metadata)
    try:
        assert reader.manifest(rid_key(rid))["metadata"]["rid"] == rid
        reader.delete(rid_key(rid))
    finally:
        reader.close()


def test_without_the_flags_the_store_servers_answers_are_refused_naming_them(assets, store_server, data, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    p = extract(assets, store_server.url, data, out, "--dump-dir", store_server.dump_dir, "--dump-timeout", "5")
    assert p.returncode == 2, p.stderr[-3000:]
    errs = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errs) == 1 and "Mooncake" in errs[0] and "--mooncake-master" in errs[0], p.stderr[-2000:]
    assert not out.exists()


def test_an_answer_without_a_handle_is_refused_in_one_line(assets, master, data, tmp_path):  # noqa: F811
    """A server whose answers carry no meta_info["eagle3_dump"] (a stand-in answering as a server with
    the dump off or of an older series does): one line naming the fix, nothing written."""
    from dumpserver import DumpServer

    (tmp_path / "d").mkdir()
    out = tmp_path / "out"
    with DumpServer(tmp_path / "d", LAYERS, 64, 4) as srv:
        p = extract(assets, srv.url, data, out, "--dump-timeout", "5", *store_flags(master))
    assert p.returncode == 2, p.stderr[-3000:]
    errs = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errs) == 1 and "eagle3_dump" in errs[0] and "--sink mooncake" in errs[0], p.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("given", ["--mooncake-master", "--mooncake-metadata"])
def test_one_of_the_two_flags_alone_is_a_usage_error(tmp_path, given):
    value = "127.0.0.1:50051" if given == "--mooncake-master" else "http://127.0.0.1:8080/metadata"
    out = tmp_path / "out"
    r = run_tool("extract", "--server", "http://127.0.0.1:9", "--model", tmp_path / "m", "--data", tmp_path / "c.jsonl",
                 "--out", out, given, value)
    line = one_line_error(r)
    assert r.returncode == 2 and "--mooncake-master" in line and "--mooncake-metadata" in line, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---- SpecForge's online path (issue 46): its adapter and feature store against this server -----------

def _specforge_store(master, store_id: str):
    """SpecForge's own MooncakeFeatureStore, with no memory of its own (as its online trainer runs)."""
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    return MooncakeFeatureStore(store_id=store_id, retain_on_release=True, setup_kwargs={
        "local_hostname": "127.0.0.1", "metadata_server": master.metadata, "master_server_addr": master.address,
        "protocol": "tcp", "rdma_devices": "", "global_segment_size": 0, "local_buffer_size": 64 << 20})  # as its consumer


def _specforge_adapter(url: str, store, family: str, run_id: str, hidden: int):
    """SpecForge 0.2.0's server-capture adapter for ``family`` and the capture config its run checks
    answers against (the server's ids, the target's hidden size)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig

    reg = builtin_algorithm_registry().resolve(family)
    lay = reg.providers.server_streaming_for("text").layout
    schema = ServerCaptureSchema(aux_feature=lay.aux_feature, last_hidden_feature=lay.last_hidden_feature,
                                 passthrough=lay.passthrough, attention_mask_feature=lay.attention_mask_feature)
    adapter = SGLangServerCaptureAdapter(url, store, run_id=run_id, algorithm=family, schema=schema, timeout_s=120.0)
    cap = CaptureConfig.from_strategy(reg.spec.feature_contract("streaming", "text").required_tensors,
                                      aux_hidden_state_layer_ids=SPECFORGE_IDS,
                                      target_repr="hidden_state" if lay.last_hidden_feature else None,
                                      target_hidden_size=hidden)
    return reg, lay, adapter, cap


def _tasks(assets, data, run_id: str, attempt: int = 0) -> list:  # noqa: F811
    from specforge.runtime.contracts import PromptTask

    from eaglepatch.extract.data import load_conversations
    from eaglepatch.extract.tokenize import ChatTokenizer

    tok = ChatTokenizer(assets.tok)
    out = []
    for c in load_conversations(data):
        enc = tok.encode(c.messages, 2048)
        out.append(PromptTask(task_id=c.id, run_id=run_id, source_id="conv", attempt=attempt,
                              payload={"input_ids": list(enc.input_ids), "loss_mask": list(enc.loss_mask)},
                              max_length=len(enc.input_ids)))
    return out


def _keys_left(master, keys, remove: bool = False) -> list:
    """The keys a fresh client of the store still finds (after SpecForge's lease has passed); with
    ``remove``, removed once found."""
    from mooncake.store import MooncakeDistributedStore

    m = MooncakeDistributedStore()
    assert m.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        found = [k for k in keys if m.is_exist(k) == 1]
        for k in found if remove else []:
            m.remove(k, force=True)
        return found
    finally:
        m.close()


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_specforge_trains_from_the_server_through_its_own_adapter_and_store(assets, store_server, master, data,
                                                                             reference, family, monkeypatch):  # noqa: F811
    """SpecForge 0.2.0's SGLangServerCaptureAdapter sends one /generate for a batch of prompts
    (max_new_tokens 0, spec_capture payloads); every answer passes its checks (identity, the launch's
    aux ids, widths) and becomes a SampleRef; its MooncakeFeatureStore reads, at its own keys, the
    states Hugging Face computes (aux = outputs of layers 0-2 side by side, target = post-norm final),
    the ids and loss mask sent; its streaming collator and the family's training model train three steps
    (finite losses, the draft's weights move). Its deletes (abort, discard, drain) leave no object."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader

    hidden = json.loads((assets.ckpt / "config.json").read_text())["hidden_size"]
    run_id = f"run-{family}"
    store = _specforge_store(master, f"sf-{family}")
    reg, lay, adapter, cap = _specforge_adapter(store_server.url, store, family, run_id, hidden)
    tasks = _tasks(assets, data, run_id)
    refs = adapter.produce_refs(tasks, capture=cap)
    failures = [r for r in refs if isinstance(r, ServerCaptureFailure)]
    assert not failures, failures
    assert len(refs) == len(tasks)
    keys = []
    try:
        worst = 0.0
        for task, ref in zip(tasks, refs):
            assert ref.sample_id == f"{run_id}:{task.task_id}"
            tensors, handle = store.get(ref)
            ids = task.payload["input_ids"]
            assert tensors["input_ids"].tolist() == [ids] and tensors["loss_mask"].tolist() == [task.payload["loss_mask"]]
            ref_hf = reference.run(ids)
            aux = torch.cat([ref_hf.stream[k + 1] for k in SPECFORGE_IDS], dim=-1)
            got = tensors[lay.aux_feature]
            assert got.shape == (1, len(ids), len(SPECFORGE_IDS) * hidden), got.shape
            worst = max(worst, float((got[0].float() - aux).abs().max()))
            if lay.last_hidden_feature:
                worst = max(worst, float((tensors[lay.last_hidden_feature][0].float() - ref_hf.final).abs().max()))
                assert tensors["attention_mask"].tolist() == [[1] * len(ids)]
            store.release(handle)
            keys += [f"sf-{family}/{ref.sample_id}/g1/{name}" for name in tensors]
        assert worst <= TOL, f"max |SpecForge's tensors - HF| = {worst:.3g} > {TOL}"

        streaming = reg.providers.server_streaming_for("text")
        loader = FeatureDataLoader(store, refs=list(refs), batch_size=1, collate_fn=streaming.build_collator(),
                                   strategy=family, gc_interval_s=None)
        losses, moved = _train_three_steps(assets, family, list(loader), store_server.url, master, monkeypatch)
        assert len(losses) == 3 and all(x == x and abs(x) < 1e4 for x in losses), losses
        assert moved, "no weight of the draft that reads the states moved"
    finally:
        for ref in refs:
            if not isinstance(ref, ServerCaptureFailure):
                store.abort(ref.sample_id)
        store.discard_external_attempts()
        store.drain_pending_removals()
        # SpecForge 0.2.0's store has no close: its client (_store) is closed here, before the module's
        # master stops; left open, the interpreter's exit destroys it asking the stopped master to unmount
        store._store.close()
    assert keys and _keys_left(master, keys) == []


def _train_three_steps(assets, family: str, batches: list, url: str, master, monkeypatch) -> tuple:  # noqa: F811
    """Three optimizer steps of SpecForge's own draft, training model and step strategy for ``family``
    on ``batches``, configured as its online run against this server and master; (losses, whether a weight that reads the states moved)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config import Config
    from specforge.training.model_loading import resolve_draft_config
    from transformers import AutoConfig, AutoTokenizer

    draft_dir = assets.root / f"specforge-draft-{family}"
    if family == "eagle3":
        draft_dir = Path(json.loads((assets.demo / "serve.json").read_text())["drafts"]["specforge"]["dir"])
    else:
        tcfg = json.loads((assets.ckpt / "config.json").read_text())
        draft_dir.mkdir(exist_ok=True)
        (draft_dir / "config.json").write_text(json.dumps({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tcfg["hidden_size"],
            "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": tcfg["vocab_size"], "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_theta": 10000.0, "block_size": 4, "num_target_layers": tcfg["num_hidden_layers"],
            "layer_types": ["full_attention"], "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": list(SPECFORGE_IDS), "mask_token_id": 3}}))
    cfg = Config(model={"target_model_path": str(assets.ckpt), "draft_model_config": str(draft_dir),
                        "torch_dtype": "float32"},
                 data={"prompts_path": str(assets.root / "store-conv.jsonl")},
                 deployment={"mode": "disaggregated", "disaggregated": {
                     "control_dir": str(assets.root / f"specforge-control-{family}"), "backend": "mooncake",
                     "server_urls": [url], "mooncake_metadata_server": master.metadata,
                     "mooncake_master_server_addr": master.address}},
                 training={"strategy": family, "attention_backend": "sdpa", "num_anchors": 8})
    providers = builtin_algorithm_registry().resolve(family).providers
    draft_config = resolve_draft_config(cfg, provider=providers.model.draft_config)
    draft = providers.model.build_draft(cfg, draft_config)
    parts = providers.model.build_training_model(cfg, draft, draft_config, AutoConfig.from_pretrained(str(assets.ckpt)),
                                                 AutoTokenizer.from_pretrained(str(assets.tok)))
    head = None
    if family == "eagle3":  # the LM head SpecForge applies to the post-norm state it was sent (its TargetHead)
        import specforge.algorithms.eagle3.model as eagle3_model
        from specforge.modeling.target.target_head import TargetHead

        from eaglepatch.acceptance.train import _TorchLogSoftmaxLoss

        # its loss is a Triton kernel (GPU only): the same sum in torch, as the acceptance run trains on a CPU
        monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", _TorchLogSoftmaxLoss)

        head = TargetHead.from_pretrained(str(_indexed(assets.ckpt, assets.root / "target-indexed"))).float()
    step = providers.step.build(parts.model, target_head=head) if head is not None else providers.step.build(parts.model)
    from test_extract_dflash import three_steps

    losses, moved = three_steps(step, parts.model, draft, batches)
    return losses, any(k.startswith("fc.") for k in moved)


def _indexed(ckpt: Path, to: Path) -> Path:
    """The one-file checkpoint as a sharded one looks (its ``model.safetensors.index.json``), which
    SpecForge's TargetHead reads the LM head's file from; the files are links."""
    from safetensors import safe_open

    to.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if not (to / f.name).exists():
            (to / f.name).symlink_to(f)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    (to / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                 "weight_map": {n: "model.safetensors" for n in names}}))
    return to


def _spec_body(ids: list, sample: str, extra_key: str, new: int = 0, **change) -> dict:
    """A /generate body as SpecForge's adapter sends it, for one DFlash prompt (``new``: its
    max_new_tokens: 0 in SpecForge 0.2.0, 1 on its main branch)."""
    payload = {"store_id": "sf-raw", "sample_id": sample, "gen": 1, "replace": False,
               "features": {"aux": "hidden_states"},
               "passthrough": [{"name": "input_ids", "data": ids, "shape": [1, len(ids)], "dtype": "int64"}]}
    payload.update(change)
    return {"input_ids": [ids], "extra_key": [extra_key], "sampling_params": {"temperature": 0.0, "max_new_tokens": new},
            "spec_capture": [payload]}


def test_spec_capture_refusals_and_retries_over_http(assets, store_server, master):  # noqa: F811
    """What SpecForge's adapter meets on this server beyond its happy path: a payload the server cannot
    take is a 400 whose message is one line naming the field (its adapter fails that batch); the same
    prompt again under the same extra_key, with max_new_tokens 1 as SpecForge's main branch sends (the
    prompt would be in a radix cache: the dump refuses that cache at launch, so no capture is ever
    short), and its retry (``replace``) are captured whole; a request without spec_capture is answered
    as before (no spec_capture, the sink's handle)."""
    import requests

    ids = list(range(40, 72))
    url = store_server.url + "/generate"
    hidden = json.loads((assets.ckpt / "config.json").read_text())["hidden_size"]
    want = {"shape": [1, len(ids), len(SPECFORGE_IDS) * hidden], "dtype": "float32"}
    r = requests.post(url, json=_spec_body(ids, "r:bad", "k0", gen=0), timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert r.json()["error"]["message"] == "spec_capture[0].gen 0 must be an integer >= 1", r.text
    for new, replace in [(1, False), (1, True), (0, True)]:
        got = requests.post(url, json=_spec_body(ids, "r:p", "k1", new=new, replace=replace), timeout=60).json()
        got = (got[0] if isinstance(got, list) else got)["meta_info"]["spec_capture"]
        assert "error" not in got and got["sample_id"] == "r:p" and got["features"]["hidden_states"] == want, got
    plain = requests.post(url, json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=60).json()
    assert "spec_capture" not in plain["meta_info"] and plain["meta_info"]["eagle3_dump"]["sink"] == "mooncake"
    words = requests.post(url, json={"text": "spec_capture", "sampling_params": {"max_new_tokens": 1}},
                          timeout=60)  # a prompt that names the field is a prompt
    assert words.status_code == 200 and "spec_capture" not in words.json()["meta_info"], words.text[:300]
    keys = ["sf-raw/r:p/g1/hidden_states", "sf-raw/r:p/g1/input_ids"]
    assert _keys_left(master, keys, remove=True) == keys  # the retry's objects (removed here, as SpecForge would)
