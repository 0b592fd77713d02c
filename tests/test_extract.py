"""tools/extract.py end to end on CPU: the patched sglang 0.5.9 HTTP server, the tiny DeepSeek-V3
checkpoint, a tiny word-level tokenizer with a chat template, 25 conversations (24 with
assistant turns, one without), both dataset formats checked against Hugging Face
``output_hidden_states`` on the same weights, rerun, kill + resume, injected faults (through a
loopback proxy in front of the real server), the one-line errors, and the guard on the result.

These tests need torch/transformers/sglang's dependencies: they run inside the CPU environment
(``eaglepatch.cpuenv``). Under another interpreter, ``test_extract_suite_in_cpu_env`` reruns this
file there and the in-env tests are reported as skipped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

import importlib.util

IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers", "safetensors", "tqdm"))
if IN_ENV:
    import torch

in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_extract_suite_in_cpu_env)")

EXTRACT = REPO / "tools" / "extract.py"
GUARD = REPO / "tools" / "guard.py"
LAYERS = [-1, 1, 2]  # EAGLE3_DUMP_LAYERS of the server; HF indices 0, 2, 3
N_CONV = 24
TOL = 1e-4
SERVER_START_TIMEOUT = 300
FIGURES: dict = {}
# EAGLEPATCH_TEST_SERIES: another series directory for the server's tree (default: the repo's 0.5.9 series)


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_extract_suite_in_cpu_env():
    from eaglepatch.cpuenv import ensure_env

    py = ensure_env()
    p = subprocess.run([str(py), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(Path(__file__))],
                       cwd=REPO, timeout=1200)
    assert p.returncode == 0, "the extract suite failed inside the CPU env (output above)"


# ---- fixtures --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    sys.path.insert(0, str(REPO / "src" / "eaglepatch" / "smoke"))
    import _hf  # the project's tiny checkpoint builder and HF reference
    import tinychat

    root = tmp_path_factory.mktemp("extract")
    ckpt = root / "ckpt"
    _hf.build_deepseek(ckpt)
    tok = tinychat.build_tokenizer(root / "tok")
    tok_nogen = tinychat.build_tokenizer(root / "tok-nogen", generation=False)
    tok_big = tinychat.build_tokenizer(root / "tok-big", vocab_size=2048)
    recs = tinychat.conversations(N_CONV)
    recs.insert(5, {"id": "no-assistant", "messages": [{"role": "user", "content": "hello there"}]})
    data = tinychat.write_jsonl(root / "conv.jsonl", recs)
    return SimpleNamespace(root=root, ckpt=ckpt, tok=tok, tok_nogen=tok_nogen, tok_big=tok_big, data=data, recs=recs,
                           hf=_hf)


@pytest.fixture(scope="module")
def server(assets):
    from eaglepatch.fetch import unpacked_release
    from eaglepatch.smoke.tree import patched_tree

    import requests

    series = Path(os.environ.get("EAGLEPATCH_TEST_SERIES", REPO / "patches" / "sglang-0.5.9"))
    pp = patched_tree(unpacked_release("0.5.9", quiet=True), series, assets.root / "pp")
    dump_dir = assets.root / "dumps"
    dump_dir.mkdir()
    port = _free_port()
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", EAGLE3_DUMP_DIR=str(dump_dir),
               EAGLE3_DUMP_LAYERS=",".join(map(str, LAYERS)),
               PYTHONPATH=os.pathsep.join([str(pp), str(REPO / "src" / "eaglepatch" / "smoke" / "stubs")]))
    log = open(assets.root / "server.log", "w")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(assets.ckpt),
           "--tokenizer-path", str(assets.tok), "--device", "cpu", "--attention-backend", "torch_native",
           "--disable-cuda-graph", "--dtype", "float32", "--disable-radix-cache", "--chunked-prefill-size", "-1",
           "--disable-overlap-schedule", "--max-total-tokens", "4096", "--context-length", "1024",
           "--max-running-requests", "8", "--random-seed", "0", "--mem-fraction-static", "0.5",
           "--grammar-backend", "none", "--port", str(port), "--host", "127.0.0.1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail("sglang server exited (%s):\n%s" % (proc.returncode,
                            (assets.root / "server.log").read_text()[-3000:]))
            if time.monotonic() - t0 > SERVER_START_TIMEOUT:
                pytest.fail("sglang server not ready after %d s:\n%s" % (SERVER_START_TIMEOUT,
                            (assets.root / "server.log").read_text()[-3000:]))
            try:
                if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        FIGURES["server_start_s"] = round(time.monotonic() - t0, 1)
        yield SimpleNamespace(url=url, dump_dir=dump_dir, pp=pp, port=port)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def reference(assets):
    return assets.hf.Reference(assets.ckpt)


@pytest.fixture(scope="module")
def expected(assets):
    """Conversation id -> (ids, mask) by our tokenizer wrapper (checked separately below)."""
    from eaglepatch.extract.data import load_conversations
    from eaglepatch.extract.tokenize import ChatTokenizer

    tok = ChatTokenizer(assets.tok)
    return {c.id: tok.encode(c.messages, 2048) for c in load_conversations(assets.data)}


def run_cli(argv) -> SimpleNamespace:
    """tools/extract.py main() in this process (the CLI as users run it, without paying the torch and
    transformers imports again); returns its exit code and stderr."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("extract_cli", EXTRACT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = mod.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code
    return SimpleNamespace(returncode=rc, stderr=err.getvalue(), wall=time.monotonic() - t0)


def extract(assets, server, out, *extra, dump_dir=None, url=None, tokenizer=None, model=None):
    return run_cli(["--server", url or server.url, "--model", model or assets.ckpt,
                    "--tokenizer", tokenizer or assets.tok, "--data", assets.data,
                    "--dump-dir", dump_dir or server.dump_dir, "--out", out, "--no-progress", *extra])


def records(out: Path) -> list:
    return [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]


def check_dataset(out: Path, fmt: str, reference, expected) -> float:
    """Every sample equals the HF reference on the same weights; returns the largest difference."""
    from eaglepatch.extract.writers import read_sample

    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == N_CONV and man["failed"] == [] and man["dataset_format"] == fmt
    assert man["eagle3_layer_ids"] == LAYERS and man["hf_hidden_state_indices"] == [0, 2, 3]
    assert [s["id"] for s in man["skipped"]] == ["no-assistant"]
    recs = [r for r in records(out) if not r.get("skipped")]
    assert sorted(r["id"] for r in recs) == sorted(i for i in expected if i != "no-assistant")
    assert man["tokens"] == sum(len(expected[r["id"]].input_ids) for r in recs)
    worst = 0.0
    for r in recs:
        path = out / r["file"]
        assert path.stat().st_size == r["bytes"]
        s = read_sample(fmt, path)
        enc = expected[r["id"]]
        assert s["input_ids"].tolist() == enc.input_ids
        assert s["loss_mask"].tolist() == enc.loss_mask
        hs = reference.run(enc.input_ids)[0]
        aux_ref = torch.cat([hs[0], hs[2], hs[3]], dim=-1)
        assert s["aux"].shape == aux_ref.shape and s["final"].shape == hs[4].shape
        worst = max(worst, float((s["aux"].float() - aux_ref).abs().max()),
                    float((s["final"].float() - hs[4]).abs().max()))
    assert worst <= TOL, f"max |dataset - HF| = {worst:.3g} > {TOL}"
    return worst


# ---- tokenization (no server) ------------------------------------------------------------------

@in_env
def test_chat_template_mask_both_methods(assets):
    from transformers import AutoTokenizer

    from eaglepatch.extract.data import load_conversations
    from eaglepatch.extract.tokenize import ChatTokenizer

    convs = load_conversations(assets.data)
    assert len(convs) == N_CONV + 1
    gen, off = ChatTokenizer(assets.tok), ChatTokenizer(assets.tok_nogen)
    assert (gen.mask_method, off.mask_method) == ("generation", "offsets")
    hf = AutoTokenizer.from_pretrained(str(assets.tok))
    eot = hf.convert_tokens_to_ids("<|eot|>")
    for c in convs:
        a, b = gen.encode(c.messages), off.encode(c.messages)
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask, c.id
        # the masked tokens are exactly each assistant turn's words plus its end-of-turn token
        want = []
        for m in c.messages:
            if m["role"] == "assistant":
                want += hf.convert_tokens_to_ids(m["content"].split()) + [eot]
        assert [t for t, k in zip(a.input_ids, a.loss_mask) if k] == want, c.id
        assert a.input_ids[0] == hf.bos_token_id
    # the ShareGPT and OpenAI forms of one conversation tokenize alike
    sg = [c for c in convs if c.id == "conv-001"][0]
    assert sg.messages[0]["role"] in ("system", "user") and sg.messages[-1]["role"] == "assistant"
    t = gen.encode(convs[0].messages, max_len=7)
    assert t.truncated and len(t.input_ids) == 7


@in_env
def test_data_errors_are_usage_errors(tmp_path):
    from eaglepatch.errors import UsageError
    from eaglepatch.extract.data import load_conversations

    cases = {
        '{"id": 1, "messages": []}\n{"id": 1, "messages": []}\n': "duplicate conversation id",
        '{"text": "x"}\n': "neither 'messages' nor 'conversations'",
        '{"conversations": [{"from": "alien", "value": "x"}]}\n': "unknown speaker",
        'not json\n': "not valid JSON",
    }
    for i, (text, msg) in enumerate(cases.items()):
        p = tmp_path / f"d{i}.jsonl"
        p.write_text(text)
        with pytest.raises(UsageError, match=msg):
            load_conversations(p)


# ---- end to end --------------------------------------------------------------------------------

@in_env
def test_specforge_matches_hf(assets, server, reference, expected):
    out = assets.root / "out-specforge"
    p = extract(assets, server, out, "--format", "specforge", "--concurrency", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    worst = check_dataset(out, "specforge", reference, expected)
    # SpecForge's offline reader: torch.load'ed dict, [1, T, H] states, ".ckpt" files
    f = sorted(out.glob("rows_*/data_*.ckpt"))
    assert len(f) == N_CONV
    d = torch.load(str(f[0]), weights_only=True)
    assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert d["hidden_state"].dim() == 3 and d["aux_hidden_state"].shape[-1] == 3 * d["hidden_state"].shape[-1]
    man = json.loads((out / "manifest.json").read_text())
    assert man["series_version"] == "0.5.9-1" and man["sglang_release"].startswith("0.5.9")
    assert man["bytes"] == sum(x.stat().st_size for x in f)
    # used dumps were removed (the server's warm-up and health-check dumps are not ours)
    from eaglepatch.extract.dumps import dump_key

    left = {x.stem for x in server.dump_dir.glob("*.safetensors")}
    assert not left & {dump_key(e.input_ids) for e in expected.values()}
    assert "summary: 24 extracted" in p.stderr
    FIGURES["specforge"] = {"max_abs_diff_vs_hf": worst, "wall_s": round(p.wall, 2), "tokens": man["tokens"],
                            "summary": [x for x in p.stderr.splitlines() if x.startswith("summary:")][0]}


@in_env
def test_rerun_skips_everything(assets, server):
    out = assets.root / "out-specforge"
    before = {x: x.stat().st_mtime_ns for x in out.glob("rows_*/*")}
    assert before, "test_specforge_matches_hf must run first"
    n_dumps = len(list(server.dump_dir.glob("*")))
    p = extract(assets, server, out, "--format", "specforge", "--dump-timeout", "5")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "nothing to do: all 25 conversations" in p.stderr
    assert {x: x.stat().st_mtime_ns for x in out.glob("rows_*/*")} == before
    assert len(list(server.dump_dir.glob("*"))) == n_dumps
    assert len(records(out)) == N_CONV + 1
    # resuming with other settings is refused
    p = extract(assets, server, out, "--format", "speculators")
    assert p.returncode == 2 and "format='specforge'" in p.stderr and p.stderr.startswith("error: ")


@in_env
def test_killed_run_resumes(assets, server, reference, expected):
    out = assets.root / "out-speculators"
    cmd = [sys.executable, str(EXTRACT), "--server", server.url, "--model", str(assets.ckpt), "--tokenizer",
           str(assets.tok), "--data", str(assets.data), "--dump-dir", str(server.dump_dir), "--out", str(out),
           "--format", "speculators", "--concurrency", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prog = out / "progress.jsonl"
    t0 = time.monotonic()
    while not (prog.is_file() and len(prog.read_text().splitlines()) >= 4):
        assert proc.poll() is None, "extract ended before it could be killed"
        assert time.monotonic() - t0 < 120, "no progress within 120 s"
        time.sleep(0.02)
    proc.kill()
    proc.wait(timeout=30)
    done_before = {r["id"] for r in records(out)}
    assert 4 <= len(done_before) < N_CONV + 1, f"killed after {len(done_before)} samples"
    p = extract(assets, server, out, "--format", "speculators", "--concurrency", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{len(done_before)} already done" in p.stderr
    ids = [r["id"] for r in records(out)]
    assert len(ids) == len(set(ids)) == N_CONV + 1  # nothing done twice
    assert not list(out.glob("rows_*/.*.tmp"))
    worst = check_dataset(out, "speculators", reference, expected)
    from safetensors import safe_open

    f = sorted(out.glob("rows_*/data_*.safetensors"))[0]
    with safe_open(str(f), framework="pt") as st:
        assert st.get_slice("hidden_states").get_shape()[1:] == [len(LAYERS) + 1, 256]
        assert json.loads(st.metadata()["hidden_states_layers"]) == ["eagle3:-1", "eagle3:1", "eagle3:2",
                                                                     "final:post_norm"]
    FIGURES["speculators_killed_after"] = len(done_before)
    FIGURES["speculators"] = {"max_abs_diff_vs_hf": worst, "resume_wall_s": round(p.wall, 2)}


@in_env
def test_bad_dumps_and_transient_failures_never_enter_the_dataset(assets, server, reference, expected):
    """A proxy in front of the real server truncates one dump, puts a NaN in another, rewrites a
    third's ids and answers 503 once: the samples are retried and the dataset is exact; a sample
    whose every attempt is bad is listed as failed and has no file."""
    from eaglepatch.extract.dumps import dump_key
    from faultproxy import FaultProxy

    ids = {cid: e.input_ids for cid, e in expected.items()}
    k = {cid: dump_key(v) for cid, v in ids.items()}
    out = assets.root / "out-faults"
    with FaultProxy(server.url, server.dump_dir) as proxy:
        proxy.plan = {k["conv-000"]: ["truncate"], k["conv-003"]: ["nan"], k["conv-004"]: ["ids"],
                      k["conv-007"]: ["503"], k["conv-009"]: ["truncate", "nan", "truncate"]}
        p = extract(assets, server, out, "--format", "specforge", "--concurrency", "3", "--max-attempts", "3",
                    url=proxy.url)
        log = list(proxy.log)
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(log) == 7
    err = p.stderr
    assert f"{k['conv-000']}.safetensors: truncated or corrupt" in err
    assert f"{k['conv-003']}.safetensors: layer.1 holds 1 non-finite values" in err
    assert f"{k['conv-004']}.safetensors: metadata key" in err or "input_ids differ" in err
    assert "1 request retries" in err and "6 bad dumps rejected" in err
    man = json.loads((out / "manifest.json").read_text())
    assert man["failed_ids"] == ["conv-009"] and man["samples"] == N_CONV - 1
    assert "conv-009" not in {r["id"] for r in records(out)}
    assert not (out / "rows_0-5000" / "data_10.ckpt").exists()  # conv-009 is line 11 -> index 10
    # the rerun (no faults) completes exactly the failed sample
    p = extract(assets, server, out, "--format", "specforge")
    assert p.returncode == 0 and "summary: 1 extracted" in p.stderr, p.stderr[-2000:]
    check_dataset(out, "specforge", reference, expected)


@in_env
def test_one_line_errors(assets, server, tmp_path):
    def one_line(p, *needles):
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        lines = [x for x in p.stderr.strip().splitlines() if x.startswith("error: ")]
        assert len(lines) == 1 and "; " in lines[0], p.stderr[-2000:]
        for n in needles:
            assert n in lines[0], lines[0]
        return lines[0]

    # server unreachable
    one_line(extract(assets, server, tmp_path / "o1", url=f"http://127.0.0.1:{_free_port()}"),
             "cannot reach the SGLang server")
    # dump directory not visible here
    one_line(extract(assets, server, tmp_path / "o2", dump_dir=tmp_path / "nowhere"), "is not visible on this machine")
    # the server does not write where we look (dump off / not patched / other directory)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    t0 = time.monotonic()
    one_line(extract(assets, server, tmp_path / "o3", "--dump-timeout", "3", dump_dir=elsewhere),
             "no dump file appeared", "EAGLE3_DUMP_DIR")
    assert time.monotonic() - t0 < 60
    assert not list((tmp_path / "o3").glob("rows_*/*"))
    # tokenizer/model mismatch: a tokenizer larger than the model's vocabulary
    one_line(extract(assets, server, tmp_path / "o4", tokenizer=assets.tok_big),
             "tokenizer/model mismatch", "2048 tokens", "vocab_size is 1024")
    # --model is not the served model (other hidden size): refused at the first dump
    other = tmp_path / "other-model"
    other.mkdir()
    cfg = json.loads((assets.ckpt / "config.json").read_text())
    cfg["hidden_size"] = 512
    (other / "config.json").write_text(json.dumps(cfg))
    one_line(extract(assets, server, tmp_path / "o5", model=other), "hidden_size=256", "hidden_size=512")
    assert not list((tmp_path / "o5").glob("rows_*/*"))


@in_env
def test_full_disk_stops_cleanly(assets, server, tmp_path):
    """--out on a 1 MiB tmpfs: the run stops with one line when the disk is full; what is recorded as
    done is whole, nothing half-written is left, and a rerun elsewhere is unaffected."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        p = extract(assets, server, mnt / "out", "--concurrency", "2")
        assert p.returncode == 2, p.stderr[-2000:]
        line = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
        assert len(line) == 1 and "cannot" in line[0] and "free space" in line[0], p.stderr[-2000:]
        recs = records(mnt / "out") if (mnt / "out" / "progress.jsonl").exists() else []
        for r in recs:
            if r.get("file"):
                assert (mnt / "out" / r["file"]).stat().st_size == r["bytes"]
        assert not list((mnt / "out").glob("rows_*/.*.tmp"))
        assert len([r for r in recs if r.get("file")]) < N_CONV
        # no file is left open on the full filesystem: it unmounts at once
        um = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        assert um.returncode == 0, "a file on the full disk is still open: " + um.stderr
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@in_env
def test_guard_on_the_extracted_dataset(assets, server, tmp_path):
    out = assets.root / "out-specforge"
    assert (out / "manifest.json").is_file(), "test_specforge_matches_hf must run first"

    def draft(ids):
        p = tmp_path / ("d%s.json" % "_".join(map(str, ids)))
        p.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids,
                                                  "use_aux_hidden_state": True}}))
        return p

    def guard(*args):
        return subprocess.run([sys.executable, str(GUARD), *map(str, args)], capture_output=True, text=True, timeout=60)

    assert guard("--draft-config", draft(LAYERS), "--dataset", out).returncode == 0
    assert guard("--draft-config", draft(LAYERS), "--dataset", out, "--sglang", server.pp).returncode == 0
    # capture-index style ids ([2, 30, 58] on a 61-layer model; [0, 2, 3] here) are served other layers
    p = guard("--draft-config", draft([0, 2, 3]), "--dataset", out)
    assert p.returncode == 1 and "MISMATCH" in p.stdout and "[1, 3, 4]" in p.stdout and "[0, 2, 3]" in p.stdout
    # a dump file is accepted as the dataset side too
    d = sorted(server.dump_dir.glob("*.safetensors"))
    if d:
        assert guard("--draft-config", draft(LAYERS), "--dataset", d[0]).returncode == 0


@in_env
def test_zz_figures(assets):
    """Prints the measured figures (pytest -s) and keeps them next to the data."""
    (assets.root / "figures.json").write_text(json.dumps(FIGURES, indent=2))
    print("\nextract figures:", json.dumps(FIGURES, indent=2))
    assert FIGURES.get("specforge") and FIGURES.get("speculators")
