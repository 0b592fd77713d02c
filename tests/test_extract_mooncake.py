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
           f"--mooncake-metadata {master.metadata} --mooncake-segment-mb 256 --mooncake-buffer-mb 64")
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
