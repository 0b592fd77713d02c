"""tools/extract.py end to end on CPU: the patched sglang 0.5.9 HTTP server started as the README
says (``tools/serve.py --cpu-demo``: the tiny DeepSeek-V3 checkpoint with a tiny word-level chat
tokenizer), the README's 'Extract training data' commands as written, 25 conversations of the
suite's own (24 with assistant turns, one without), both dataset formats checked against Hugging Face
``output_hidden_states`` on the same weights, rerun, kill + resume, an edited input, injected
faults (through a loopback proxy in front of the real server), a dump of another model (the run
stops, the dataset resumes), a sample whose loss mask cannot be built, the one-line errors, and the
guard on the result.

The consumers read what was extracted with their own code: speculators 0.9.0 (ArrowDataset,
CollateFn + shift_batch, a forward and loss of its Eagle3 draft, targets built from the last slot
that reproduce the HF logits, aux slots equal to HF at the draft's target_layer_ids) and SpecForge
0.2.0 (its offline dataset and TargetHead, aux state equal to HF). Every reference check (the
dataset's, the consumers', the edited sample's) is shown failing on wrong data: aux slots of ids
shifted by one, and the last slot on the wrong side of the final norm (pre-norm where post-norm
belongs, and the reverse).

These tests need torch/transformers/sglang's dependencies: they run inside the CPU environment
(``eaglepatch.cpuenv``). Under another interpreter, ``test_extract_suite_in_cpu_env`` reruns this
file there and the in-env tests are reported as skipped.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import process_table, run_suite_in_cpu_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

import importlib.util

import cpuserver  # noqa: E402

IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers", "safetensors", "tqdm"))
if IN_ENV:
    import torch

in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_extract_suite_in_cpu_env)")

EXTRACT = REPO / "tools" / "extract.py"
GUARD = REPO / "tools" / "guard.py"
LAYERS = [-1, 0, 1, 2, 3]  # EAGLE3_DUMP_LAYERS of the server (the CPU demo's): aux layers, then the last layer N-1 = 3
AUX = [-1, 1, 2]  # the suite's datasets' aux layers (--aux-layers, AUX_FLAG); HF indices 0, 2, 3
AUX_FLAG = "--aux-layers=" + ",".join(map(str, AUX))
N_CONV = 24
TOL = 1e-4
FIGURES: dict = {}
# EAGLEPATCH_TEST_SERIES: another series directory for the server's tree (default: the repo's 0.5.9 series)


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_extract_suite_in_cpu_env():
    run_suite_in_cpu_env(__file__, 1200)


# ---- fixtures --------------------------------------------------------------------------------

README_DEMO = "/tmp/eagle3-demo"  # the demo directory and URL the README's journey names
README_URL = "http://127.0.0.1:30000"


def readme_journey() -> list:
    """The commands of the README's CPU journey ('Extract training data': the bash block that runs
    tools/serve.py --cpu-demo), in order, continuation lines joined."""
    section = (REPO / "README.md").read_text().split("\n## Extract training data\n", 1)[1].split("\n## ", 1)[0]
    block = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "tools/serve.py --cpu-demo" in b][0]
    lines = [" ".join(x.split()) for x in block.replace("\\\n", " ").splitlines()]
    return [x for x in lines if x and not x.startswith("#")]


def localize(cmd: str, demo_dir: Path, url: str = README_URL) -> str:
    """A README command for this test: the demo in ``demo_dir``, the server at ``url``, this python."""
    cmd = cmd.replace(README_DEMO, str(demo_dir)).replace(README_URL, url)
    return shlex.quote(sys.executable) + cmd[len("python3"):] if cmd.startswith("python3 ") else cmd


def serve_command(demo_dir: Path, port: int) -> str:
    """The README's serve command on this test's demo directory and port (EAGLEPATCH_TEST_SERIES:
    another series directory for the server's tree, default the repo's 0.5.9 series)."""
    cmd = readme_journey()[0]
    assert cmd.startswith("python3 tools/serve.py --cpu-demo "), cmd
    series = os.environ.get("EAGLEPATCH_TEST_SERIES")
    return localize(cmd, demo_dir) + f" --port {port}" + (f" --series {shlex.quote(series)}" if series else "")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The demo directory as the README's serve command makes it (--print: nothing started), whose
    model (checkpoint + chat tokenizer) the suite extracts from, and the suite's own data."""
    sys.path.insert(0, str(REPO / "src" / "eaglepatch" / "smoke"))
    import _hf  # the project's HF reference

    from eaglepatch.serve import tinychat

    root = tmp_path_factory.mktemp("extract")
    demo = root / "demo"
    p = subprocess.run(serve_command(demo, 30000) + " --print", shell=True, cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = Path(json.loads((demo / "serve.json").read_text())["model"])
    tok_nogen = tinychat.build_tokenizer(root / "tok-nogen", generation=False)
    tok_big = tinychat.build_tokenizer(root / "tok-big", vocab_size=2048)
    recs = tinychat.conversations(N_CONV)
    recs.insert(5, {"id": "no-assistant", "messages": [{"role": "user", "content": "hello there"}]})
    data = tinychat.write_jsonl(root / "conv.jsonl", recs)
    return SimpleNamespace(root=root, demo=demo, ckpt=ckpt, tok=ckpt, tok_nogen=tok_nogen, tok_big=tok_big, data=data,
                           recs=recs, hf=_hf)


def start_patched(assets, pp: Path, dump_dir: Path, name: str) -> SimpleNamespace:
    """A patched server on the suite's checkpoint and tokenizer, dumping LAYERS into ``dump_dir``."""
    try:
        return cpuserver.start_server(pp, assets.ckpt, assets.tok, dump_dir, LAYERS, assets.root / f"{name}.log")
    except cpuserver.NotReady as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def server(assets):
    """The one server of the suite: the README's ``tools/serve.py --cpu-demo`` command, run as written
    (on the suite's demo directory and a free port) until the module is done."""
    port = cpuserver.free_port()
    url = f"http://127.0.0.1:{port}"
    log = assets.root / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen("exec " + serve_command(assets.demo, port), shell=True, cwd=REPO, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    info = {}
    try:
        import requests

        FIGURES["server_start_s"] = round(cpuserver.wait_ready(
            proc, url, log, "tools/serve.py --cpu-demo", timeout=600,
            ready=lambda u: requests.get(u + "/health_generate", timeout=30).status_code == 200), 1)
        info = json.loads((assets.demo / "serve.json").read_text())
        assert info["url"] == url and info["layers"] == LAYERS, info
        yield SimpleNamespace(url=url, dump_dir=Path(info["dump_dir"]), pp=Path(info["tree"]), port=port, log=log,
                              proc=proc, info=info, series_version=series_manifest()["series_version"])
    except cpuserver.NotReady as exc:
        pytest.fail(str(exc))
    finally:
        cpuserver.stop(proc)  # SIGTERM to serve.py, which stops its server's process group
        pid = json.loads((assets.demo / "serve.json").read_text()).get("server_pid")
        left = group_members(pid) if pid else []
        if left:
            os.killpg(pid, signal.SIGKILL)
        assert not left, f"tools/serve.py left processes of its server behind: {left}"
        assert "[serve] server stopped" in log.read_text()


def group_members(pgid: int) -> list:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def series_manifest() -> dict:
    """The manifest of the series the serving tree carries (EAGLEPATCH_TEST_SERIES or the 0.5.9 one)."""
    series = Path(os.environ.get("EAGLEPATCH_TEST_SERIES", REPO / "patches" / "sglang-0.5.9"))
    return json.loads((series / "manifest.json").read_text())


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
    """The CLI on the suite's data; ``url``: another server URL, or a list of them (--server repeated)."""
    urls = url if isinstance(url, list) else [url or server.url]
    return run_cli([a for u in urls for a in ("--server", u)] + [
        "--model", model or assets.ckpt, "--tokenizer", tokenizer or assets.tok, "--data", assets.data,
        "--dump-dir", dump_dir or server.dump_dir, "--out", out, "--no-progress", AUX_FLAG, *extra])


def records(out: Path) -> list:
    return [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]


HF_AUX = (0, 2, 3)  # the HF hidden-state indices of AUX (output of layer k = index k + 1; embedding = 0)


def reference_slots(ref, fmt: str, aux_streams=HF_AUX, last: str | None = None) -> tuple:
    """(aux [T, L*H], last [T, H]) of the HF reference ``ref``: the aux slots are the HF hidden states
    ``aux_streams``, the last slot ``last`` ("final": post-norm, "pre": the last layer's output before
    the norm, a digit: that HF hidden state; default what ``fmt`` stores: SpecForge the final state,
    speculators the pre-norm one)."""
    last = last or ("final" if fmt == "specforge" else "pre")
    last_ref = ref.final if last == "final" else ref.stream[4] if last == "pre" else ref.stream[int(last)]
    return torch.cat([ref.stream[i] for i in aux_streams], dim=-1), last_ref


def sample_error(s: dict, ref, fmt: str, aux_streams=HF_AUX, last: str | None = None) -> float:
    """Largest |sample - HF| of one read sample against ``reference_slots``."""
    aux_ref, last_ref = reference_slots(ref, fmt, aux_streams, last)
    assert s["aux"].shape == aux_ref.shape and s["last"].shape == last_ref.shape
    return max(float((s["aux"].float() - aux_ref).abs().max()), float((s["last"].float() - last_ref).abs().max()))


def dataset_error(out: Path, fmt: str, reference, expected, **wrong) -> float:
    """The dataset's bookkeeping checked (manifest, records, ids, masks, file names and sizes);
    returns the largest |sample - HF| over every sample (``wrong``: read the reference otherwise,
    see ``sample_error``)."""
    from eaglepatch.extract.writers import read_sample, sample_rel

    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == N_CONV and man["failed"] == [] and man["dataset_format"] == fmt
    assert man["eagle3_layer_ids"] == AUX and man["hf_hidden_state_indices"] == list(HF_AUX)
    assert man["dump_layer_ids"] == LAYERS
    assert [s["id"] for s in man["skipped"]] == ["no-assistant"]
    recs = [r for r in records(out) if not r.get("skipped")]
    assert sorted(r["id"] for r in recs) == sorted(i for i in expected if i != "no-assistant")
    assert man["tokens"] == sum(len(expected[r["id"]].input_ids) for r in recs)
    worst = 0.0
    for r in recs:
        path = out / r["file"]
        assert r["file"] == sample_rel(fmt, r["id"])  # named by the conversation id
        assert path.stat().st_size == r["bytes"]
        s = read_sample(fmt, path)
        enc = expected[r["id"]]
        assert s["input_ids"].tolist() == enc.input_ids
        assert s["loss_mask"].tolist() == enc.loss_mask
        worst = max(worst, sample_error(s, reference.run(enc.input_ids), fmt, **wrong))
    return worst


def check_dataset(out: Path, fmt: str, reference, expected) -> float:
    """Every sample equals the HF reference on the same weights; returns the largest difference
    (shown failing on ids shifted by one and a skipped norm: test_dataset_check_fails_on_wrong_layers
    reads the datasets against the wrong states, test_dataset_check_fails_on_wrong_datasets feeds it
    datasets holding them)."""
    worst = dataset_error(out, fmt, reference, expected)
    assert worst <= TOL, f"max |dataset - HF| = {worst:.3g} > {TOL}"
    return worst


def rewritten_copy(src: Path, dst: Path, fmt: str, reference, **wrong) -> Path:
    """A copy of the extracted dataset ``src`` at ``dst`` whose every sample is rewritten from the HF
    reference as ``reference_slots(**wrong)`` gives it (speculators: the table's hidden_states files
    too), ids, masks, names and file sizes as they were: a dataset only a comparison of its tensors
    with HF can tell from the right one."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst, copy_function=shutil.copy)  # own copies: the originals stay untouched
    for row, rel in enumerate(json.loads((dst / "manifest.json").read_text())["files"]):
        path = dst / rel
        size = path.stat().st_size
        if fmt == "specforge":
            t = torch.load(str(path), weights_only=True)
            aux, last = reference_slots(reference.run(t["input_ids"].tolist()), fmt, **wrong)
            dt = t["hidden_state"].dtype
            t["aux_hidden_state"] = aux.to(dt).unsqueeze(0).contiguous()
            t["hidden_state"] = last.to(dt).unsqueeze(0).contiguous()
            with open(path, "wb") as fh:  # as the writer saves it
                torch.save(t, fh)
        else:
            with safe_open(str(path), framework="pt") as f:
                meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
            aux, last = reference_slots(reference.run(t["token_ids"].tolist()), fmt, **wrong)
            hs = t["hidden_states"]
            t["hidden_states"] = torch.cat([aux.reshape(hs.shape[0], -1, hs.shape[2]), last[:, None]], dim=1).to(hs.dtype)
            save_file(t, str(path), metadata=meta)
            shutil.copy(path, dst / "hidden_states" / f"hs_{row}.safetensors")
        assert path.stat().st_size == size, f"{rel}: rewritten {path.stat().st_size} bytes, extracted {size}"
    return dst


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
    f = sorted(out.glob("samples/*/*.ckpt"))
    assert len(f) == N_CONV
    d = torch.load(str(f[0]), weights_only=True)
    assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert d["hidden_state"].dim() == 3 and d["aux_hidden_state"].shape[-1] == 3 * d["hidden_state"].shape[-1]
    man = json.loads((out / "manifest.json").read_text())
    assert man["series_version"] == server.series_version and man["sglang_release"].startswith("0.5.9")
    assert man["bytes"] == sum(x.stat().st_size for x in f)
    # used dumps were removed: each sample's file, named by sha256 of its own rid
    from eaglepatch.extract.dumps import RID_PREFIX, rid_key

    recs = [r for r in records(out) if r.get("file")]
    assert len({r["rid"] for r in recs}) == N_CONV and all(r["rid"].startswith(RID_PREFIX) for r in recs)
    assert all(r["key"] == rid_key(r["rid"]) for r in recs)
    left = {x.stem for x in server.dump_dir.glob("*.safetensors")}
    assert not left & {r["key"] for r in recs}
    assert "summary: 24 extracted" in p.stderr
    # where the time went: every stage of every sample is timed (the server's forward is in generate)
    st = man["last_run"]["stage_seconds"]
    assert set(st) == {"tokenize", "generate", "wait_for_file", "read_validate", "write", "record"}, st
    assert st["generate"] > 0 and st["read_validate"] > 0 and st["write"] > 0, st
    assert "time per stage, summed over the 4 workers" in p.stderr
    # 4 workers on this machine's cores: torch's intra-op threads are its cores over 4, at least 1
    want = min(torch.get_num_threads(), max(1, len(os.sched_getaffinity(0)) // 4))
    assert f"torch intra-op threads {want}" in p.stderr, p.stderr[-1500:]
    FIGURES["specforge"] = {"max_abs_diff_vs_hf": worst, "wall_s": round(p.wall, 2), "tokens": man["tokens"],
                            "summary": [x for x in p.stderr.splitlines() if x.startswith("summary:")][0]}


@in_env
def test_worker_processes_make_the_dataset_threads_make(assets, server, reference, expected):
    """--processes 2: the samples are read, checked and written in two worker processes; the dataset
    equals the HF reference as the threads' does, the workers' seconds and answers are in the
    manifest, no worker is left behind, and a rerun finds nothing to do."""
    out = assets.root / "out-processes"
    p = extract(assets, server, out, "--format", "specforge", "--concurrency", "4", "--processes", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 worker processes, 2+2 threads" in p.stderr, p.stderr[-2000:]
    check_dataset(out, "specforge", reference, expected)
    man = json.loads((out / "manifest.json").read_text())
    run = man["last_run"]
    assert sum(s["answered"] for s in run["servers"]) == N_CONV, run  # the workers' requests counted here
    st = run["stage_seconds"]
    assert st["generate"] > 0 and st["read_validate"] > 0 and st["write"] > 0, st
    assert not multiprocessing.active_children()
    rerun = extract(assets, server, out, "--format", "specforge", "--processes", "2", "--concurrency", "2")
    assert rerun.returncode == 0 and "nothing to do: all 25 conversations" in rerun.stderr, rerun.stderr[-2000:]


def _spawned_children(pid: int) -> list:
    """The multiprocessing workers (spawn_main) whose parent is ``pid``."""
    out = []
    for child, (_, ppid) in process_table().items():
        if ppid != pid:
            continue
        try:
            cmd = (Path("/proc") / str(child) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(child)
    return out


def _marked(mark: str) -> list:
    """Live processes (not zombies) whose environment holds ``EAGLEPATCH_TEST_MARK=mark``."""
    want, out = f"EAGLEPATCH_TEST_MARK={mark}".encode(), []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and want in (d / "environ").read_bytes().split(b"\0") and \
                    (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d.name))
        except OSError:
            continue
    return out


@in_env
def test_workers_started_with_the_run_end_with_an_early_error(assets, server, tmp_path):
    """--processes starts its workers before the inputs are read (they load meanwhile). Here the server
    takes the connection and never answers, so the run waits its --request-timeout (5 s) and is then
    refused: the workers are seen during that wait (found by a mark in their inherited environment;
    a run that started them only once a dump fixed the dataset has none then), and afterwards the run
    exits 2 with its one line, writes nothing and leaves no worker behind, orphaned or not."""
    import socket
    import uuid

    mark = uuid.uuid4().hex
    out = tmp_path / "out"
    with socket.socket() as mute:  # accepts connections (the kernel's backlog) and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        cmd = [sys.executable, str(EXTRACT), "--server", "http://127.0.0.1:%d" % mute.getsockname()[1], "--model",
               str(assets.ckpt), "--tokenizer", str(assets.tok), "--data", str(assets.data), "--dump-dir",
               str(server.dump_dir), "--out", str(out), "--concurrency", "2", "--processes", "2",
               "--request-timeout", "5", "--no-progress", AUX_FLAG]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, EAGLEPATCH_TEST_MARK=mark))
        seen: set = set()
        while proc.poll() is None:  # the run's processes but itself, while it waits for the server
            seen.update(p for p in _marked(mark) if p != proc.pid)
            time.sleep(0.05)
        err = proc.stderr.read()
    assert proc.returncode == 2, err[-2000:]
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "cannot reach the SGLang server" in lines[0], err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert len(seen) >= 2, "the worker processes were not started before the inputs were read: %s" % seen
    t0 = time.monotonic()
    while _marked(mark) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not _marked(mark), "a worker process outlived the refused run"
    assert not out.exists()


@in_env
def test_a_killed_worker_process_stops_the_run_and_the_next_run_finishes(assets, server, reference, expected,
                                                                        tmp_path):
    """SIGKILL to one worker process of a --processes 2 run: the run stops (exit 2) with one line naming
    the worker and the signal, every sample it recorded is whole, the other worker is gone, and the
    same command run again completes the dataset."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(EXTRACT), "--server", server.url, "--model", str(assets.ckpt), "--tokenizer",
           str(assets.tok), "--data", str(assets.data), "--dump-dir", str(server.dump_dir), "--out", str(out),
           "--concurrency", "2", "--processes", "2", "--no-progress", AUX_FLAG]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    kids = []
    # the workers start with the run; killed once one of them has made a sample (the probe's is the main
    # process's), so the worker dies at work, holding conversations
    ledger = out / "progress.jsonl"
    while len(kids) < 2 or not ledger.is_file() or ledger.read_bytes().count(b"\n") < 2:
        assert proc.poll() is None, "extract ended before its workers could be killed: " + proc.stderr.read()[-2000:]
        assert time.monotonic() - t0 < 300, "no worker processes appeared"
        time.sleep(0.005)
        kids = _spawned_children(proc.pid)
    os.kill(kids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-2000:]
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, err[-2000:]
    assert f"extract worker process" in lines[0] and "killed by SIGKILL" in lines[0], lines[0]
    assert "run the same command again" in lines[0], lines[0]
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and
                (Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")], "a worker outlived the run"
    recs = records(out)
    assert len([r for r in recs if r.get("file")]) < N_CONV
    for r in recs:
        if r.get("file"):
            assert (out / r["file"]).stat().st_size == r["bytes"]
    again = extract(assets, server, out, "--format", "specforge", "--concurrency", "2", "--processes", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    check_dataset(out, "specforge", reference, expected)


@in_env
def test_rerun_skips_everything(assets, server):
    out = assets.root / "out-specforge"
    before = {x: x.stat().st_mtime_ns for x in out.glob("samples/*/*")}
    assert before, "test_specforge_matches_hf must run first"
    n_dumps = len(list(server.dump_dir.glob("*")))
    p = extract(assets, server, out, "--format", "specforge", "--dump-timeout", "5")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "nothing to do: all 25 conversations" in p.stderr
    assert {x: x.stat().st_mtime_ns for x in out.glob("samples/*/*")} == before
    assert len(list(server.dump_dir.glob("*"))) == n_dumps
    assert len(records(out)) == N_CONV + 1
    # resuming with other settings is refused
    p = extract(assets, server, out, "--format", "speculators")
    assert p.returncode == 2 and "format='specforge'" in p.stderr and p.stderr.startswith("error: ")


@in_env
def test_compact_reads_as_the_specforge_export(assets, server):
    """--format compact from the same server: CompactDataset yields, sample for sample, what
    SpecForge's own reader yields from the SpecForge export (ids and masks exact, states within the
    suite's tolerance: two runs of the server batch differently), and the manifest names its reader."""
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    from eaglepatch.compact import CompactDataset

    assert (assets.root / "out-specforge" / "manifest.json").is_file(), "test_specforge_matches_hf must run first"
    out = assets.root / "out-compact"
    p = extract(assets, server, out, "--format", "compact", "--concurrency", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["dataset_format"] == "compact" and "CompactDataset" in man["layout"]
    assert man["storage"]["reader"].startswith("eaglepatch.compact.CompactDataset") and man["final"] == "post_norm"
    assert man["storage"]["dtype"] == man["model"]["dtype"] and man["storage"]["left_out"] == {}
    ours = CompactDataset(out, assets.ckpt, yields="specforge")
    theirs = build_offline_eagle3_dataset(str(assets.root / "out-specforge"), max_len=2048)
    assert len(ours) == len(theirs) == man["samples"] == N_CONV
    for i in range(len(ours)):
        a, b = ours[i], theirs[i]
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        for k in a:
            if a[k].is_floating_point():
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
                assert (a[k].float() - b[k].float()).abs().max().item() <= TOL, (i, k)
            else:
                assert torch.equal(a[k], b[k]), (i, k)


@in_env
def test_killed_run_resumes(assets, server, reference, expected):
    out = assets.root / "out-speculators"
    cmd = [sys.executable, str(EXTRACT), "--server", server.url, "--model", str(assets.ckpt), "--tokenizer",
           str(assets.tok), "--data", str(assets.data), "--dump-dir", str(server.dump_dir), "--out", str(out),
           "--format", "speculators", "--concurrency", "1", "--no-progress", AUX_FLAG]
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
    # what a kill in the middle of a write leaves, whether or not this one did: our temporary name,
    # and safetensors' own (save_file writes .tmpXXXXXX beside its target, then renames it)
    shard = next(out.glob("samples/*/"))
    (shard / ".x.safetensors.123.456.tmp").write_bytes(b"partial")
    (shard / ".tmpAbC123").write_bytes(b"partial")
    p = extract(assets, server, out, "--format", "speculators", "--concurrency", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{len(done_before)} already done" in p.stderr
    ids = [r["id"] for r in records(out)]
    assert len(ids) == len(set(ids)) == N_CONV + 1  # nothing done twice
    assert not list(out.glob("samples/*/.*")), list(out.glob("samples/*/.*"))  # no temporary of any writer
    worst = check_dataset(out, "speculators", reference, expected)
    from safetensors import safe_open

    f = sorted(out.glob("hidden_states/hs_*.safetensors"))
    assert len(f) == N_CONV
    with safe_open(str(f[0]), framework="pt") as st:
        assert st.get_slice("hidden_states").get_shape()[1:] == [len(AUX) + 1, 256]
        assert json.loads(st.metadata()["hidden_states_slots"]) == ["eagle3:-1", "eagle3:1", "eagle3:2",
                                                                    "eagle3:3:pre_norm"]
        assert json.loads(st.metadata()["hf_hidden_state_indices"]) == [0, 2, 3, 4]
    man = json.loads((out / "manifest.json").read_text())
    assert man["speculators"]["target_layer_ids"] == [0, 2, 3]  # speculators' own convention: HF indices
    assert man["speculators"]["hidden_states_layer_ids"] == [0, 2, 3, 4]
    FIGURES["speculators_killed_after"] = len(done_before)
    FIGURES["speculators"] = {"max_abs_diff_vs_hf": worst, "resume_wall_s": round(p.wall, 2)}


# ---- the consumers read the extracted datasets with their own code ------------------------------

def top1(pred, ref) -> tuple[int, int]:
    """(tokens whose argmax agrees, tokens)."""
    return int((pred.argmax(-1) == ref.argmax(-1)).sum()), int(ref.shape[0])


def speculators_check(out: Path, assets, reference, expected=None, aux_hf=None) -> dict:
    """speculators 0.9.0 on the dataset at ``out``: ArrowDataset loads every row, its aux slots are
    compared with the HF hidden states of the draft's target_layer_ids (the manifest's; ``aux_hf``:
    others), its targets verifier_lm_head(verifier_norm(last slot)) with the HF logits (top-1
    agreement), CollateFn + shift_batch pack a batch whose alignment is checked, and its Eagle3 draft
    runs a forward with loss and a backward on it."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import LlamaConfig

    man = json.loads((out / "manifest.json").read_text())
    aux_hf = list(aux_hf if aux_hf is not None else man["speculators"]["target_layer_ids"])
    vc = reference.model.config
    ds = ArrowDataset(max_len=2048, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32)
    assert len(ds) == man["samples"]
    draft_cfg = LlamaConfig(vocab_size=vc.vocab_size, hidden_size=vc.hidden_size, intermediate_size=512,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                            max_position_embeddings=vc.max_position_embeddings, rms_norm_eps=vc.rms_norm_eps)
    # speculators' own check of the ids (distinct HF indices 0..N) runs here
    draft = Eagle3DraftModel.from_training_args(
        verifier_config=draft_cfg, verifier_name_or_path=str(assets.ckpt),
        target_layer_ids=aux_hf, draft_vocab_size=vc.vocab_size,
        norm_before_residual=True, ttt_steps=2, draft_attn_impl="eager").float()
    agree = total = 0
    aux_err = 0.0
    items = [ds[i] for i in range(len(ds))]
    for item in items:
        ids = item["input_ids"].tolist()
        if expected is not None:
            enc = expected[tuple(ids)]
            assert item["loss_mask"].tolist() == enc.loss_mask  # the mask comes from the table
        ref = reference.run(ids)
        aux_ref, _ = reference_slots(ref, "speculators", aux_hf)
        assert item["hidden_states"].shape == aux_ref.shape
        aux_err = max(aux_err, float((item["hidden_states"].float() - aux_ref).abs().max()))
        with torch.no_grad():
            targets = draft.verifier_lm_head(draft.verifier_norm(item["verifier_last_hidden_states"].float()))
        a, t = top1(targets, ref.logits)
        agree, total = agree + a, total + t
    batch = CollateFn(max_len=1024, hidden_size=vc.hidden_size, num_target_layers=len(aux_hf), dtype=torch.float32,
                      preprocess=shift_batch)(items[:4])
    first = items[0]
    n = first["input_ids"].shape[0] - 1
    # shift_batch pairs the state of token t with token t+1 and the target of position t+1
    assert torch.equal(batch["input_ids"][0, :n], first["input_ids"][1:])
    assert torch.equal(batch["hidden_states"][0, :n], first["hidden_states"][:-1])
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n], first["verifier_last_hidden_states"][1:])
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    _, loss, metrics = draft(**tensors, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.fc.weight.grad).all() and draft.fc.weight.grad.abs().sum() > 0
    freq = torch.load(str(out / "token_freq.pt"), weights_only=True)
    assert sum(freq.values()) == man["loss_tokens"]
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size=64, target_vocab_size=vc.vocab_size)
    assert d2t.shape == (64,) and int(t2d.sum()) == 64
    return {"aux_max_abs_diff_vs_hf": aux_err, "top1_agreement": agree / total, "tokens": total,
            "loss": round(float(loss.detach()), 4)}


@pytest.fixture(scope="module")
def by_ids(expected):
    return {tuple(e.input_ids): e for e in expected.values()}


@in_env
def test_speculators_reads_the_export(assets, server, reference, by_ids):
    out = assets.root / "out-speculators"
    assert (out / "state.json").is_file(), "test_killed_run_resumes must run first"
    fig = speculators_check(out, assets, reference, by_ids)
    assert fig["top1_agreement"] == 1.0 and fig["aux_max_abs_diff_vs_hf"] <= TOL, fig
    FIGURES["speculators_consumer"] = fig


@in_env
def test_speculators_check_catches_a_post_norm_last_slot(assets, server, reference, tmp_path):
    """The same export with the post-norm final state in the last slot (targets normalised twice):
    the consumer check fails on it. The extract itself refuses a server that stores it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = assets.root / "out-speculators"
    mixed = tmp_path / "mixed"
    shutil.copytree(src, mixed, copy_function=shutil.copy)  # own copies: the originals stay untouched
    for f in sorted((mixed / "hidden_states").glob("hs_*.safetensors")):
        t = load_file(str(f))
        t["hidden_states"][:, -1] = reference.run(t["token_ids"].tolist()).final  # the post-norm state
        save_file(t, str(f))
    fig = speculators_check(mixed, assets, reference)
    assert fig["top1_agreement"] < 0.95, fig
    FIGURES["speculators_post_norm_last_slot"] = fig
    for f in sorted((mixed / "hidden_states").glob("hs_*.safetensors")):  # the last slot one layer early
        t = load_file(str(f))
        t["hidden_states"][:, -1] = reference.run(t["token_ids"].tolist()).stream[3]  # layer N-2's output
        save_file(t, str(f))
    fig = speculators_check(mixed, assets, reference)
    assert fig["top1_agreement"] < 0.95, fig
    FIGURES["speculators_last_slot_one_layer_early"] = fig

    from hfserver import HFDumpServer

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    with HFDumpServer(reference, dumps, LAYERS, swap_last=True) as bad:
        p = extract(assets, server, tmp_path / "o", "--format", "speculators", dump_dir=dumps, url=bad.url)
    line = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert p.returncode == 2 and len(line) == 1 and "layer.3 equals the post-norm final state" in line[0], p.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def indexed_ckpt(assets):
    """The checkpoint with a model.safetensors.index.json, as sharded checkpoints have (SpecForge's
    TargetHead finds lm_head.weight through the index)."""
    from safetensors import safe_open

    d = assets.root / "ckpt-indexed"
    d.mkdir(exist_ok=True)
    for f in assets.ckpt.iterdir():
        if not (d / f.name).exists():
            (d / f.name).symlink_to(f)
    with safe_open(str(assets.ckpt / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors" for k in keys}}))
    return d


def specforge_check(out: Path, indexed_ckpt, reference, by_ids=None, aux_hf=None) -> dict:
    """SpecForge 0.2.0 on the dataset at ``out``: its offline dataset reads every sample, its aux
    state is compared with the HF hidden states the manifest records (``aux_hf``: others) and its
    TargetHead turns the stored final state into logits, compared with HF (top-1 agreement)."""
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.modeling.target.target_head import TargetHead

    if aux_hf is None:
        aux_hf = json.loads((out / "manifest.json").read_text())["hf_hidden_state_indices"]
    ds = build_offline_eagle3_dataset(str(out), max_len=2048)
    head = TargetHead(str(indexed_ckpt))
    head.load_weights(str(indexed_ckpt))
    head.freeze_weights()
    agree = total = 0
    aux_err = 0.0
    for i in range(len(ds)):
        d = ds[i]
        ids = d["input_ids"][0].tolist()
        if by_ids is not None:
            enc = by_ids[tuple(ids)]
            assert d["loss_mask"][0, :-1].tolist() == enc.loss_mask[:-1]  # SpecForge zeroes the last position
            assert d["hidden_state"].shape == (1, len(ids), len(AUX) * reference.model.config.hidden_size)
        ref = reference.run(ids)
        aux_ref, _ = reference_slots(ref, "specforge", aux_hf)
        assert d["hidden_state"][0].shape == aux_ref.shape  # SpecForge calls the aux state "hidden_state"
        aux_err = max(aux_err, float((d["hidden_state"][0].float() - aux_ref).abs().max()))
        with torch.no_grad():
            a, t = top1(head(d["target"][0].float()), ref.logits)
        agree, total = agree + a, total + t
    return {"samples": len(ds), "aux_max_abs_diff_vs_hf": aux_err, "top1_agreement": agree / total, "tokens": total}


@in_env
def test_specforge_reads_the_export(assets, server, reference, indexed_ckpt, by_ids, tmp_path):
    out = assets.root / "out-specforge"
    assert (out / "manifest.json").is_file(), "test_specforge_matches_hf must run first"
    fig = specforge_check(out, indexed_ckpt, reference, by_ids)
    assert fig["samples"] == N_CONV and fig["top1_agreement"] == 1.0 and fig["aux_max_abs_diff_vs_hf"] <= TOL, fig
    FIGURES["specforge_consumer"] = fig
    # shown failing: a SpecForge sample holding the pre-norm state where the final one belongs
    from safetensors.torch import load_file

    wrong = tmp_path / "wrong" / "samples"
    wrong.mkdir(parents=True)
    for f in sorted((assets.root / "out-speculators" / "hidden_states").glob("hs_*.safetensors"))[:6]:
        t = load_file(str(f))
        hs = t["hidden_states"]
        torch.save({"input_ids": t["token_ids"], "loss_mask": t["loss_mask"], "hidden_state": hs[:, -1][None],
                    "aux_hidden_state": hs[:, :-1].reshape(hs.shape[0], -1)[None]}, str(wrong / f"{f.stem}.ckpt"))
    bad = specforge_check(wrong.parent, indexed_ckpt, reference, aux_hf=HF_AUX)
    assert bad["samples"] == 6 and bad["top1_agreement"] < 0.95, bad
    FIGURES["specforge_pre_norm_final"] = bad


@in_env
def test_consumer_checks_fail_on_shifted_aux_ids(assets, server, reference, indexed_ckpt, tmp_path):
    """speculators_check and specforge_check compare the aux slots their readers load with HF: a
    dataset whose aux slots hold the states of ids shifted by one fails them (their top-1 checks
    read only the last slot and pass it), and so does the right dataset read with shifted ids."""
    figures = {}
    src = assets.root / "out-speculators"
    assert (src / "state.json").is_file(), "test_killed_run_resumes must run first"
    bad = rewritten_copy(src, tmp_path / "speculators", "speculators", reference, aux_streams=SHIFTED)
    figures["speculators: aux slots of ids + 1"] = speculators_check(bad, assets, reference)
    figures["speculators: read as ids + 1"] = speculators_check(src, assets, reference, aux_hf=SHIFTED)
    src = assets.root / "out-specforge"
    assert (src / "manifest.json").is_file(), "test_specforge_matches_hf must run first"
    bad = rewritten_copy(src, tmp_path / "specforge", "specforge", reference, aux_streams=SHIFTED)
    figures["specforge: aux slots of ids + 1"] = specforge_check(bad, indexed_ckpt, reference)
    figures["specforge: read as ids + 1"] = specforge_check(src, indexed_ckpt, reference, aux_hf=SHIFTED)
    passed = {name: fig for name, fig in figures.items() if not fig["aux_max_abs_diff_vs_hf"] > 100 * TOL}
    assert not passed, passed  # every wrong dataset and every wrong reading fails
    FIGURES["consumer_checks_on_shifted_aux_ids"] = {k: {"aux_max_abs_diff_vs_hf": round(v["aux_max_abs_diff_vs_hf"], 3),
                                                         "top1_agreement": v["top1_agreement"]}
                                                     for k, v in figures.items()}


@in_env
def test_dataset_check_fails_on_wrong_layers(assets, server, reference, expected):
    """The reference check every extraction test relies on, on the real extracted datasets read
    against the wrong HF states: aux ids shifted by one (up, and down where a lower index exists),
    the last slot one layer early, and the final norm skipped (SpecForge) or applied (speculators).
    Every one is far above the tolerance the true reading passes."""
    fmts = {"specforge": assets.root / "out-specforge", "speculators": assets.root / "out-speculators"}
    assert all((o / "manifest.json").is_file() for o in fmts.values()), "the format tests must run first"
    figures = {}
    for fmt, out in fmts.items():
        right = dataset_error(out, fmt, reference, expected)
        assert right <= TOL
        wrong_norm = "pre" if fmt == "specforge" else "final"
        for name, wrong in (("aux ids + 1", {"aux_streams": tuple(i + 1 for i in HF_AUX)}),
                            ("aux ids - 1", {"aux_streams": (0, 1, 2)}),
                            ("last slot one layer early", {"last": "3"}),
                            ("norm skipped" if fmt == "specforge" else "norm applied", {"last": wrong_norm})):
            err = dataset_error(out, fmt, reference, expected, **wrong)
            assert err > 100 * TOL, (fmt, name, err)
            figures[f"{fmt}: {name}"] = round(err, 3)
    FIGURES["dataset_check_on_wrong_layers_max_abs_diff"] = figures


SHIFTED = tuple(i + 1 for i in HF_AUX)  # the aux layers of EAGLE-3 ids shifted by one


@in_env
def test_dataset_check_fails_on_wrong_datasets(assets, server, reference, expected, tmp_path):
    """check_dataset itself, fed copies of the extracted datasets rewritten from the HF reference
    (ids, masks, names and sizes intact): with the aux slots of ids shifted by one, and with the
    last slot on the wrong side of the final norm (SpecForge: the pre-norm state where the post-norm
    one belongs; speculators: the post-norm state where the pre-norm one belongs), it fails."""
    figures = {}
    for fmt in ("specforge", "speculators"):
        src = assets.root / f"out-{fmt}"
        assert (src / "manifest.json").is_file(), "the format tests must run first"
        for name, wrong in (("aux ids + 1", {"aux_streams": SHIFTED}),
                            ("norm skipped", {"last": "pre"}) if fmt == "specforge" else
                            ("norm applied", {"last": "final"})):
            bad = rewritten_copy(src, tmp_path / f"{fmt}-{len(figures)}", fmt, reference, **wrong)
            assert dataset_error(bad, fmt, reference, expected, **wrong) <= TOL  # it holds what it claims to
            with pytest.raises(AssertionError, match=r"max \|dataset - HF\|"):
                check_dataset(bad, fmt, reference, expected)
            err = dataset_error(bad, fmt, reference, expected)
            assert err > 100 * TOL, (fmt, name, err)
            figures[f"{fmt}: {name}"] = round(err, 3)
    FIGURES["check_dataset_on_wrong_datasets_max_abs_diff"] = figures


@in_env
def test_edited_input_redoes_only_what_changed(assets, server, reference, tmp_path):
    """Between runs one conversation is edited, one removed and one inserted at the top (every
    position shifts): only the edited and the new one are extracted, the removed one's sample is
    deleted (SpecForge's reader takes every .ckpt under OUT), no other file is touched."""
    import shutil

    from eaglepatch.serve import tinychat
    from eaglepatch.extract.tokenize import ChatTokenizer
    from eaglepatch.extract.writers import read_sample, sample_rel

    out = tmp_path / "ds"
    shutil.copytree(assets.root / "out-specforge", out, copy_function=shutil.copy2)
    recs = [dict(r) for r in assets.recs if r["id"] != "conv-004"]
    edited = [r for r in recs if r["id"] == "conv-002"][0]
    edited["messages"] = [dict(m) for m in edited["messages"]]
    edited["messages"][-1]["content"] = "an edited reply about the red river"
    recs.insert(0, {"id": "new-000", "messages": [{"role": "user", "content": "one more"},
                                                  {"role": "assistant", "content": "yes one more"}]})
    data = tinychat.write_jsonl(tmp_path / "edited.jsonl", recs)
    before = {x: (x.stat().st_mtime_ns, x.stat().st_size) for x in out.glob("samples/*/*")}
    p = run_cli(["--server", server.url, "--model", assets.ckpt, "--tokenizer", assets.tok, "--data", data,
                 "--dump-dir", server.dump_dir, "--out", out, "--no-progress", AUX_FLAG])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "extracting 2 of 25 conversations (23 already done)" in p.stderr
    assert "removed 1 sample file(s) of conversations no longer in" in p.stderr  # conv-004's file
    after = {x: (x.stat().st_mtime_ns, x.stat().st_size) for x in out.glob("samples/*/*")}
    changed = {x.relative_to(out).as_posix() for x in after if after[x] != before.get(x)}
    assert changed == {sample_rel("specforge", "conv-002"), sample_rel("specforge", "new-000")}
    tok = ChatTokenizer(assets.tok)
    enc = tok.encode(edited["messages"], 2048)
    s = read_sample("specforge", out / sample_rel("specforge", "conv-002"))
    assert s["input_ids"].tolist() == enc.input_ids and s["loss_mask"].tolist() == enc.loss_mask
    ref = reference.run(enc.input_ids)
    assert sample_error(s, ref, "specforge") <= TOL
    # the same comparison on the wrong states fails: aux ids shifted by one, the final norm skipped
    wrong = {"aux ids + 1": sample_error(s, ref, "specforge", aux_streams=SHIFTED),
             "norm skipped": sample_error(s, ref, "specforge", last="pre")}
    assert min(wrong.values()) > 100 * TOL, wrong
    FIGURES["edited_sample_on_wrong_layers_max_abs_diff"] = {k: round(v, 3) for k, v in wrong.items()}
    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == N_CONV and sample_rel("specforge", "conv-004") not in man["files"]
    assert not (out / sample_rel("specforge", "conv-004")).exists()
    assert sorted(x.relative_to(out).as_posix() for x in out.glob("samples/*/*.ckpt")) == sorted(man["files"])
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    assert len(build_offline_eagle3_dataset(str(out), max_len=2048)) == man["samples"]


@in_env
def test_removed_conversations_leave_the_speculators_table(assets, server, expected, tmp_path):
    """Conversations removed from the input between runs: the rerun deletes their samples and
    rebuilds the table from the rest (speculators' ArrowDataset reads exactly those); --limit does not
    shrink the dataset; an input left with no sample removes the table too."""
    import shutil

    from eaglepatch.serve import tinychat
    from speculators.train.data import ArrowDataset

    from eaglepatch.extract.writers import sample_rel

    src = assets.root / "out-speculators"
    assert (src / "state.json").is_file(), "test_killed_run_resumes must run first"
    out = tmp_path / "ds"
    shutil.copytree(src, out, copy_function=shutil.copy2)  # own copies: hard links would share inodes
    gone = {"conv-001", "conv-010", "conv-017"}
    data = tinychat.write_jsonl(tmp_path / "fewer.jsonl", [r for r in assets.recs if r["id"] not in gone])

    def rerun(data, *extra):
        return run_cli(["--server", server.url, "--model", assets.ckpt, "--tokenizer", assets.tok, "--data", data,
                        "--dump-dir", server.dump_dir, "--out", out, "--format", "speculators", "--no-progress",
                        AUX_FLAG, *extra])

    p = rerun(data)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "nothing to do" in p.stderr and "removed 3 sample file(s) of conversations no longer in" in p.stderr
    man = json.loads((out / "manifest.json").read_text())
    keep = [r["id"] for r in assets.recs if r["id"] not in gone and r["id"] != "no-assistant"]
    assert man["samples"] == len(keep) == N_CONV - 3 and man["last_run"]["stale_samples_removed"] == 3
    assert man["files"] == [sample_rel("speculators", i) for i in keep]
    assert sorted(x.relative_to(out).as_posix() for x in out.glob("samples/*/*.safetensors")) == sorted(man["files"])
    ds = ArrowDataset(max_len=2048, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32)
    assert len(ds) == man["samples"] == len(list(out.glob("hidden_states/hs_*.safetensors")))
    rows = {tuple(ds[k]["input_ids"].tolist()) for k in range(len(ds))}
    assert rows == {tuple(expected[i].input_ids) for i in keep}  # the table's rows: exactly the kept ones
    freq = torch.load(str(out / "token_freq.pt"), weights_only=True)
    assert sum(freq.values()) == man["loss_tokens"]
    # --limit limits what a run extracts, not what the dataset holds
    p = rerun(data, "--limit", "3")
    assert p.returncode == 0 and "sample file(s)" not in p.stderr, p.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["samples"] == len(keep)
    assert len(ArrowDataset(max_len=2048, datapath=str(out), on_missing="raise")) == len(keep)
    # an input whose only conversation has no assistant turn: no sample, no table
    only = tinychat.write_jsonl(tmp_path / "none.jsonl", [r for r in assets.recs if r["id"] == "no-assistant"])
    p = rerun(only)
    assert p.returncode == 0 and f"removed {len(keep)} sample file(s)" in p.stderr, p.stderr[-2000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == 0 and man["files"] == [] and [s["id"] for s in man["skipped"]] == ["no-assistant"]
    assert not list(out.glob("samples/*/*")) and not (out / "hidden_states").exists()
    assert not (out / "state.json").exists() and not list(out.glob("data-*.arrow"))


@in_env
def test_a_sample_whose_mask_cannot_be_built_fails_alone(assets, server, tmp_path):
    """A chat template that drops earlier assistant turns: the two-turn conversation fails with the
    reason, the one-turn ones are extracted; nothing is recorded as skipped."""
    from eaglepatch.serve import tinychat

    tok = tinychat.build_tokenizer(tmp_path / "drop", generation=False, template=tinychat.DROP)
    one = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "good day to you"}]
    two = one + [{"role": "user", "content": "and then"}, {"role": "assistant", "content": "bye now"}]
    data = tinychat.write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": one}, {"id": "b", "messages": two},
                                                       {"id": "c", "messages": one[:1] + [{"role": "assistant",
                                                                                          "content": "red car"}]}])
    p = run_cli(["--server", server.url, "--model", assets.ckpt, "--tokenizer", tok, "--data", data,
                 "--dump-dir", server.dump_dir, "--out", tmp_path / "o", "--no-progress", AUX_FLAG])
    assert p.returncode == 1, p.stderr[-2000:]
    man = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert man["samples"] == 2 and man["skipped"] == [] and man["failed_ids"] == ["b"]
    assert "loss mask: cannot locate assistant turn 1" in man["failed"][0]["reason"]
    assert "failed: b: loss mask: cannot locate assistant turn 1" in p.stderr


@in_env
def test_bad_dumps_and_transient_failures_never_enter_the_dataset(assets, server, reference, expected):
    """A proxy in front of the real server truncates one dump, puts a NaN in another, rewrites a
    third's ids and answers 503 once: the samples are retried and the dataset is exact; a sample
    whose every attempt is bad is listed as failed and has no file. Every try of a sample carries
    the sample's one rid, so the rejected files have the name of the sample's recorded key."""
    from eaglepatch.extract.dumps import prompt_key
    from faultproxy import FaultProxy

    ids = {cid: e.input_ids for cid, e in expected.items()}
    k = {cid: prompt_key(v) for cid, v in ids.items()}
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
    key = {r["id"]: r["key"] for r in records(out)}
    assert f"bad dump from {proxy.url}: {key['conv-000']}.safetensors: truncated or corrupt" in err, err[-3000:]
    assert f"{key['conv-003']}.safetensors: layer.1 holds 1 non-finite values" in err
    assert f"{key['conv-004']}.safetensors: input_ids differ" in err
    assert "1 request retries" in err and "6 bad dumps rejected" in err
    man = json.loads((out / "manifest.json").read_text())
    assert man["failed_ids"] == ["conv-009"] and man["samples"] == N_CONV - 1
    assert "conv-009" not in {r["id"] for r in records(out)}
    from eaglepatch.extract.writers import sample_rel

    assert not (out / sample_rel("specforge", "conv-009")).exists()
    # the rerun (no faults) completes exactly the failed sample
    p = extract(assets, server, out, "--format", "specforge")
    assert p.returncode == 0 and "summary: 1 extracted" in p.stderr, p.stderr[-2000:]
    check_dataset(out, "specforge", reference, expected)


@in_env
def test_a_dump_of_another_model_stops_the_run_and_the_dataset_resumes(assets, server, reference, expected, tmp_path):
    """The real server's dumps, one of them rewritten by a proxy as another checkpoint's
    (``model_path``): the run stops in one line naming the field, both values and the server it came
    from, before that sample is written; the rerun on the server completes an exact dataset, whose
    manifest records the dumps' provenance."""
    from eaglepatch.extract.dumps import prompt_key
    from faultproxy import FaultProxy

    k = {cid: prompt_key(e.input_ids) for cid, e in expected.items()}
    out = tmp_path / "o"
    with FaultProxy(server.url, server.dump_dir) as proxy:
        proxy.plan = {k["conv-004"]: [{"model_path": "/elsewhere/other-checkpoint"}]}
        p = extract(assets, server, out, "--concurrency", "1", url=proxy.url)
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert "model_path='/elsewhere/other-checkpoint'" in line and f"from {proxy.url}" in line, line
    served = json.loads((out / ".extract-settings.json").read_text())["dump_meta"]["model_path"]
    assert f"model_path={served!r}" in line and "new --out" in line, line
    done = [r["id"] for r in records(out)]
    assert done and "conv-004" not in done and len(done) < N_CONV
    p = extract(assets, server, out)
    assert p.returncode == 0 and f"{len(done)} already done" in p.stderr, p.stderr[-3000:]
    check_dataset(out, "specforge", reference, expected)
    prov = json.loads((out / "manifest.json").read_text())["dump_provenance"]
    assert prov["model_path"] == served and prov["series_version"] == server.series_version, prov
    assert prov["eagle3_layer_ids"] == LAYERS and prov["hf_hidden_state_indices"] == [x + 1 for x in LAYERS]


# ---- many servers: a second replica, the router, a replica killed mid-run -----------------------

@pytest.fixture(scope="module")
def replicas(assets, server):
    """Second replicas of the suite's server (same patched tree, same shared dump directory), started
    on demand; ``start()`` gives a running one, ``kill(r)`` SIGKILLs its whole process group."""
    started = []

    def start():
        r = start_patched(assets, server.pp, server.dump_dir, f"replica-{len(started) + 1}")
        started.append(r)
        FIGURES.setdefault("replica_start_s", []).append(r.start_s)
        return r

    def kill(r):
        os.killpg(r.proc.pid, signal.SIGKILL)
        r.proc.wait(timeout=30)

    try:
        yield SimpleNamespace(start=start, kill=kill)
    finally:
        for r in started:
            cpuserver.stop(r.proc)


def extract_killing(assets, server, out, replicas, victim, after: int, *argv, url=None):
    """The CLI in a thread; ``victim`` is killed once ``after`` samples are recorded and it has
    answered a request of the run. Returns the CLI's result and the number of records at the kill."""
    import threading

    res = {}
    th = threading.Thread(target=lambda: res.update(p=extract(assets, server, out, *argv, url=url)))
    th.start()
    prog, t0 = out / "progress.jsonl", time.monotonic()
    try:
        while not (prog.is_file() and len(prog.read_text().splitlines()) >= after
                   and cpuserver.answered_after_start(victim.log) >= 1):
            assert th.is_alive(), "extract ended before the replica could be killed: " + res["p"].stderr[-2000:]
            assert time.monotonic() - t0 < 300, "no progress within 300 s"
            time.sleep(0.02)
        replicas.kill(victim)
        at_kill = len(prog.read_text().splitlines())
    finally:
        th.join(timeout=900)
    return res["p"], at_kill


def check_once(out: Path, fmt: str) -> None:
    """Every conversation recorded once, one sample file each, nothing half-written."""
    ids = [r["id"] for r in records(out)]
    assert len(ids) == len(set(ids)) == N_CONV + 1, sorted(ids)
    ext = "ckpt" if fmt == "specforge" else "safetensors"
    assert len(list(out.glob(f"samples/*/*.{ext}"))) == N_CONV
    assert not list(out.glob("samples/*/.*.tmp"))


@in_env
def test_client_round_robin_puts_aside_and_back():
    """The client alone against two loopback HTTP servers that can be made to answer 503: requests
    alternate; a failing server is put aside (one warning) and its request goes to the other; after
    the cooldown it gets requests again and its first answer puts it back; a request that fails on
    every server is retried per --retries, then raises; a pinned request goes to its server only."""
    import threading
    from http.server import BaseHTTPRequestHandler

    from eaglepatch.extract.client import SGLangClient, TransientError
    from loopback import LoopbackServer

    class Server(LoopbackServer):
        def __init__(self):
            self.hits, self.fail, lock, outer = 0, False, threading.Lock(), self

            class Handler(BaseHTTPRequestHandler):
                def log_message(self, *a):
                    pass

                def do_POST(self):
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    with lock:
                        outer.hits += 1
                    status, body = (503, b"{}") if outer.fail else (200, b'{"text": "x"}')
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            self._serve(Handler)

    with Server() as a, Server() as b:
        lines = []
        c = SGLangClient([a.url, b.url], retries=1, backoff=0.01, cooldown=0.5, log=lines.append)
        # the answer and the index of the server that gave it
        assert [c.generate([0, 5, 6], rid=f"r{n}") for n in range(6)] == [({"text": "x"}, n % 2) for n in range(6)]
        assert (a.hits, b.hits) == (3, 3) and c.retried == 0
        b.fail = True
        for _ in range(4):
            c.generate([0, 5, 6])
        assert (a.hits, b.hits) == (7, 4) and c.put_aside == [0, 1] and c.retried == 1
        assert lines == [f"warning: server {b.url} failed (HTTP 503: {{}}); its requests go to the other servers, "
                         f"it is tried again in 0.5 s"]
        time.sleep(0.6)
        b.fail = False
        for _ in range(2):
            c.generate([0, 5, 6])
        assert (a.hits, b.hits) == (8, 5) and lines[-1] == f"server {b.url} answers again"
        assert c.answered == [8, 4]
        a.fail = b.fail = True  # every server fails: (retries + 1) rounds of both, then the error
        with pytest.raises(TransientError, match="2 attempts failed"):
            c.generate([0, 5, 6])
        assert (a.hits, b.hits) == (10, 7) and c.retried == 4
        a.fail = b.fail = False
        assert c.generate([0, 5, 6], server=1)[1] == 1  # pinned (the run's probe): that server only, aside or not
        assert (a.hits, b.hits) == (10, 8)


@in_env
def test_router_spreads_and_survives_a_killed_replica(assets, server, replicas, reference, expected):
    """The production layout on localhost: two replicas sharing one dump directory behind SGLang's
    router; one replica is SIGKILLed mid-run. Every sample is extracted once and equals HF."""
    b = replicas.start()
    out = assets.root / "out-router"
    with cpuserver.Router([server.url, b.url], assets.root / "router.log") as router:
        FIGURES["router_start_s"] = router.start_s
        p, at_kill = extract_killing(assets, server, out, replicas, b, 3, "--format", "specforge",
                                     "--concurrency", "4", "--dump-timeout", "10", url=router.url)
    assert p.returncode == 0, p.stderr[-3000:]
    assert at_kill < N_CONV + 1, f"the replica was killed after the run ({at_kill} records)"
    assert cpuserver.answered_after_start(b.log) >= 1, "the router sent nothing to the second replica"
    # the router sent requests to the dead replica and retried them on the live one
    assert f"Failed to send typed request worker_url={b.url} route=/generate" in router.log.read_text()
    check_once(out, "specforge")
    worst = check_dataset(out, "specforge", reference, expected)
    # one answer per sample, more when a request answered by the killed replica left no dump (sent again)
    (srv,) = json.loads((out / "manifest.json").read_text())["last_run"]["servers"]
    assert srv["url"] == router.url and srv["answered"] >= N_CONV and srv["put_aside"] == 0
    FIGURES["router"] = {"max_abs_diff_vs_hf": worst, "killed_after_records": at_kill,
                         "replica_answered_before_kill": cpuserver.answered_after_start(b.log), "wall_s": round(p.wall, 2)}


@in_env
def test_two_servers_directly_one_killed(assets, server, replicas, reference, expected):
    """--server twice: each server is probed alone first, then requests go round robin; the second
    replica is SIGKILLed mid-run, the client puts it aside and sends its requests to the first."""
    b = replicas.start()
    out = assets.root / "out-two-servers"
    p, at_kill = extract_killing(assets, server, out, replicas, b, 4, "--format", "speculators",
                                 "--concurrency", "4", "--dump-timeout", "10", url=[server.url, b.url])
    assert p.returncode == 0, p.stderr[-3000:]
    assert at_kill < N_CONV + 1, f"the replica was killed after the run ({at_kill} records)"
    assert f"warning: server {b.url} failed (" in p.stderr, p.stderr[-3000:]
    assert f"from 2 servers ({server.url}, {b.url})" in p.stderr
    check_once(out, "speculators")
    worst = check_dataset(out, "speculators", reference, expected)
    a_, b_ = json.loads((out / "manifest.json").read_text())["last_run"]["servers"]
    assert (a_["url"], b_["url"]) == (server.url, b.url)
    assert a_["answered"] + b_["answered"] >= N_CONV and b_["put_aside"] >= 1 and a_["put_aside"] == 0
    assert 1 <= b_["answered"] <= cpuserver.answered_after_start(b.log)  # the client's count agrees with the replica's log
    FIGURES["two_servers"] = {"max_abs_diff_vs_hf": worst, "killed_after_records": at_kill,
                              "answered": [a_["answered"], b_["answered"]], "wall_s": round(p.wall, 2)}


@in_env
def test_dump_files_spread_over_two_directories(assets, server, reference, expected):
    """EAGLE3_DUMP_DIR=A:B (one directory per local disk, issue 31): the server spreads its files over
    both by key, ``--dump-dir A:B`` reads them all and every sample equals HF. The same directories in
    the other order find a file where it does not belong and stop the run (exit 2), naming the fix."""
    from eaglepatch.extract import dumps as dumps_mod

    disks = [assets.root / "disk-a", assets.root / "disk-b"]
    for d in disks:
        d.mkdir()
    both = os.pathsep.join(map(str, disks))
    r = start_patched(assets, server.pp, both, "two-dirs")
    try:
        out = assets.root / "out-two-dirs"
        p = extract(assets, server, out, "--format", "specforge", "--keep-dumps", dump_dir=both, url=r.url)
        assert p.returncode == 0, p.stderr[-3000:]
        check_once(out, "specforge")
        worst = check_dataset(out, "specforge", reference, expected)
        files = {i: sorted(d.glob("*.safetensors")) for i, d in enumerate(disks)}
        assert all(files.values()), {i: len(f) for i, f in files.items()}  # both directories took files
        assert sum(map(len, files.values())) >= N_CONV
        for i, fs in files.items():
            assert all(dumps_mod.spread(f.stem, 2) == i for f in fs), (i, [f.name for f in fs])
        assert not [f for d in disks for f in d.iterdir() if f.name.endswith(".tmp")]
        # the other order: the first request's file is in the other directory
        reversed_dirs = os.pathsep.join(map(str, disks[::-1]))
        q = extract(assets, server, assets.root / "out-two-dirs-reversed", "--dump-timeout", "3",
                    dump_dir=reversed_dirs, url=r.url)
        assert q.returncode == 2, q.stderr[-2000:]
        line = [x for x in q.stderr.splitlines() if x.startswith("error: ")][0]
        assert "but with --dump-dir" in line and "every directory in its order" in line, line
        assert not (assets.root / "out-two-dirs-reversed").exists()
        # one of the two directories (issue 43 item 17: blamed a full disk): named, wherever the first file lands
        q = extract(assets, server, assets.root / "out-two-dirs-one", "--dump-timeout", "3", dump_dir=disks[0], url=r.url)
        assert q.returncode == 2, q.stderr[-2000:]
        line = [x for x in q.stderr.splitlines() if x.startswith("error: ")][0]
        assert f"spreads its dump files by key over 2 directories (its EAGLE3_DUMP_DIR={both})" in line, line
        assert f"--dump-dir {disks[0]} lists 1" in line and "full disk" not in line, line
    finally:
        cpuserver.stop(r.proc)
    FIGURES["two_dump_dirs"] = {"max_abs_diff_vs_hf": worst, "files": [len(f) for f in files.values()]}
    # a listed directory that is not there: the launch ends with one line naming it
    missing = assets.root / "no-such-disk"
    with pytest.raises(cpuserver.NotReady) as e:
        cpuserver.start_server(server.pp, assets.ckpt, assets.tok, f"{disks[0]}{os.pathsep}{missing}", LAYERS,
                               assets.root / "two-dirs-missing.log")
    errors = [x for x in str(e.value).splitlines() if x.startswith("error: ")]
    listed = f"{disks[0]}{os.pathsep}{missing}"
    assert errors == [f"error: EAGLE3_DUMP_DIR={listed!r} names {str(missing)!r}, which is not an existing "
                      f"directory (':' separates the directories of the list); create each directory of the "
                      f"list, or point EAGLE3_DUMP_DIR elsewhere"], str(e.value)


@in_env
def test_omit_rebuilds_only_from_the_served_weights(assets, server, reference, expected, tmp_path, monkeypatch):
    """The real server with EAGLE3_DUMP_REBUILDABLE=omit (issue 43 item 1): its files record the digest
    of the checkpoint tensors it loaded; extract with the served directory equals HF; with another
    checkpoint of the same shape (the embedding and the final norm changed) it stops at the first dump
    in one line naming both directories. A model directory without safetensors refuses omit at
    launch, in one line."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eaglepatch.extract.dumps import read_metadata
    from eaglepatch.storage import Rebuilder

    monkeypatch.setenv("EAGLE3_DUMP_REBUILDABLE", "omit")
    d = assets.root / "omit-dumps"
    d.mkdir()
    r = start_patched(assets, server.pp, d, "omit")
    try:
        out = assets.root / "out-omit"
        p = extract(assets, server, out, "--format", "specforge", "--keep-dumps", dump_dir=d, url=r.url)
        assert p.returncode == 0, p.stderr[-3000:]
        worst = check_dataset(out, "specforge", reference, expected)
        meta = read_metadata(sorted(d.glob("*.safetensors"))[0])
        left, rb = json.loads(meta["left_out"]), Rebuilder(assets.ckpt)
        assert meta["model_path"] == str(assets.ckpt) and sorted(left) == ["final", "layer.-1"], meta
        assert left["layer.-1"]["weights"] == rb.weights("embedding") and left["final"]["weights"] == rb.weights("norm")
        other = tmp_path / "other-checkpoint"
        shutil.copytree(assets.ckpt, other)
        with safe_open(str(other / "model.safetensors"), "pt") as f:
            t, m = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        for k in (rb.tensor_name("embedding"), rb.tensor_name("norm")):
            t[k] = (t[k].float() * 1.25 + 0.01).to(t[k].dtype)  # the same shapes, other values
        save_file(t, str(other / "model.safetensors"), metadata=m)
        q = extract(assets, server, tmp_path / "out-other", "--format", "specforge", dump_dir=d, url=r.url, model=other)
        assert q.returncode == 2, q.stderr[-3000:]
        (line,) = [x for x in q.stderr.splitlines() if x.startswith("error: ")]
        assert f"dumped from {assets.ckpt}" in line and f"but {other} holds" in line, line
    finally:
        cpuserver.stop(r.proc)
    FIGURES["omit"] = {"max_abs_diff_vs_hf": worst}
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(assets.ckpt / "config.json", bare / "config.json")
    with pytest.raises(cpuserver.NotReady) as e:
        cpuserver.start_server(server.pp, bare, assets.tok, d, LAYERS, tmp_path / "omit-bare.log")
    errors = [x for x in str(e.value).splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: EAGLE3_DUMP_REBUILDABLE=omit: ") and \
        f"{bare} holds no model.safetensors.index.json or model.safetensors" in errors[0], str(e.value)[-3000:]


@in_env
def test_a_request_failing_on_every_server_is_retried_then_listed(assets, server, reference, expected):
    """Two servers (fault proxies in front of the suite's server): conv-003 is refused by both every
    time, conv-006 once by each. A refusing server is put aside and the request goes to the next one
    that is up (to all of them when none is); conv-003 is tried on both servers per --retries and
    --max-attempts, then listed as failed with no file; conv-006 is extracted. The rerun completes
    conv-003 and the dataset is exact."""
    from eaglepatch.extract.dumps import prompt_key
    from eaglepatch.extract.writers import sample_rel
    from faultproxy import FaultProxy

    k = {cid: prompt_key(e.input_ids) for cid, e in expected.items()}
    out = assets.root / "out-every-server"
    with FaultProxy(server.url, server.dump_dir) as p1, FaultProxy(server.url, server.dump_dir) as p2:
        for px in (p1, p2):
            px.plan = {k["conv-003"]: ["503"] * 8, k["conv-006"]: ["503"]}
        p = extract(assets, server, out, "--concurrency", "2", "--retries", "1", "--max-attempts", "2",
                    url=f"{p1.url},{p2.url}")
        logs = {p1.url: list(p1.log), p2.url: list(p2.log)}
    assert p.returncode == 1, p.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["failed_ids"] == ["conv-003"] and "2 attempts failed" in man["failed"][0]["reason"]
    assert not (out / sample_rel("specforge", "conv-003")).exists()
    for url, log in logs.items():  # conv-003 went to both servers
        assert (k["conv-003"], "503") in log, (url, log)
    assert 1 <= sum(log.count((k["conv-006"], "503")) for log in logs.values()) <= 2
    assert "warning: server http://127.0.0.1:" in p.stderr and "failed (HTTP 503" in p.stderr
    srv = man["last_run"]["servers"]
    assert sum(s["answered"] for s in srv) == N_CONV - 1 and all(s["answered"] >= 1 for s in srv), srv
    # 2 attempts x 2 rounds of the servers that are up (all of them when none is): 4 to 8 refusals
    assert 4 <= sum(log.count((k["conv-003"], "503")) for log in logs.values()) <= 8
    p = extract(assets, server, out)
    assert p.returncode == 0 and "summary: 1 extracted" in p.stderr, p.stderr[-2000:]
    check_dataset(out, "specforge", reference, expected)


@in_env
def test_one_line_errors(assets, server, reference, tmp_path):
    def one_line(p, *needles):
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        lines = [x for x in p.stderr.strip().splitlines() if x.startswith("error: ")]
        assert len(lines) == 1 and "; " in lines[0], p.stderr[-2000:]
        for n in needles:
            assert n in lines[0], lines[0]
        return lines[0]

    # server unreachable: the fix is the patched server with the dump on (tools/serve.py), for this model and dump dir
    line = one_line(extract(assets, server, tmp_path / "o1", url=f"http://127.0.0.1:{cpuserver.free_port()}"),
                    "cannot reach the SGLang server", f"tools/serve.py --model-path {assets.ckpt} --dump-dir")
    assert "launch_server" not in line, line
    # an empty --server entry, a server named twice (the comma list and the repeated flag)
    one_line(extract(assets, server, tmp_path / "o12", url=f"{server.url},"), "--server names no server")
    one_line(extract(assets, server, tmp_path / "o13", url=[server.url, server.url + "/"]),
             f"--server names {server.url} more than once")
    # one of two servers unreachable: refused at start, naming it
    dead = f"http://127.0.0.1:{cpuserver.free_port()}"
    one_line(extract(assets, server, tmp_path / "o14", url=f"{server.url},{dead}"),
             f"cannot reach the SGLang server at {dead}", "leave it out of --server")
    # dump directory not visible here
    one_line(extract(assets, server, tmp_path / "o2", dump_dir=tmp_path / "nowhere"), "is not visible on this machine")
    # the server does not write where we look (dump off / not patched / other directory)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    t0 = time.monotonic()
    one_line(extract(assets, server, tmp_path / "o3" / "a" / "b", "--dump-timeout", "3", dump_dir=elsewhere),
             "no dump file appeared", "EAGLE3_DUMP_DIR")
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o3").exists()  # a refused run leaves nothing behind, not even the parents it made
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
    assert not (tmp_path / "o5").exists()
    # data that is not UTF-8, a malformed model config.json, a negative request timeout
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    one_line(run_cli(["--server", server.url, "--model", assets.ckpt, "--tokenizer", assets.tok, "--data", latin,
                      "--dump-dir", server.dump_dir, "--out", tmp_path / "o6"]), "latin1.jsonl:1: not UTF-8")
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"hidden_size": 256, "num_hidden_layers": ')
    one_line(extract(assets, server, tmp_path / "o7", model=broken), "config.json is not readable JSON")
    (broken / "config.json").write_text('[1, 2]')
    one_line(extract(assets, server, tmp_path / "o8", model=broken), "is not a model config")
    one_line(extract(assets, server, tmp_path / "o9", "--request-timeout", "-1"), "--request-timeout out of range")
    # worker processes: at least one, and no more than the requests in flight
    one_line(extract(assets, server, tmp_path / "o15", "--processes", "0"), "--processes 0 is out of range")
    one_line(extract(assets, server, tmp_path / "o16", "--processes", "5", "--concurrency", "4"),
             "--processes 5 is out of range (--concurrency 4)", "between 1 and --concurrency")
    # speculators needs the last layer N-1 in the dump; --aux-layers must name dumped layers
    from hfserver import HFDumpServer

    dumps = tmp_path / "hf-dumps"
    dumps.mkdir()
    with HFDumpServer(reference, dumps, AUX) as hf:
        one_line(extract(assets, server, tmp_path / "o10", "--format", "speculators", dump_dir=dumps, url=hf.url),
                 "needs the last decoder layer's output before the final norm (EAGLE-3 id 3, HF index 4)",
                 "restart the server dumping layer 3 too: python3 tools/serve.py --layers=-1,1,2,3",
                 "EAGLE3_DUMP_LAYERS=-1,1,2,3")
    # a layer the 4-layer model does not have: refused as typed, and no fix names it
    line = one_line(extract(assets, server, tmp_path / "o11", "--aux-layers=-1,1,5"),
                    "--aux-layers=-1,1,5 names layer 5", "4-layer model")
    assert "including 5" not in line and "--layers=" not in line, line
    for i in range(1, 17):
        assert not (tmp_path / f"o{i}").exists(), f"o{i}: a refused run left files"


@in_env
@pytest.mark.parametrize("processes", [1, 2])
def test_full_disk_stops_cleanly(assets, server, tmp_path, processes):
    """--out on a 1 MiB tmpfs: the run stops with one line when the disk is full; what is recorded as
    done is whole, nothing half-written is left, and a rerun elsewhere is unaffected. With
    --processes 2 the disk fills in a worker process: the same line, and the workers are gone
    (the unmount below fails while one holds a file there)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        p = extract(assets, server, mnt / "out", "--concurrency", "2", "--processes", str(processes))
        assert p.returncode == 2, p.stderr[-2000:]
        if processes > 1:
            assert "2 worker processes, 1+1 threads" in p.stderr, p.stderr[-2000:]
            assert not multiprocessing.active_children()
        line = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
        assert len(line) == 1 and "cannot" in line[0] and "free space" in line[0], p.stderr[-2000:]
        recs = records(mnt / "out") if (mnt / "out" / "progress.jsonl").exists() else []
        for r in recs:
            if r.get("file"):
                assert (mnt / "out" / r["file"]).stat().st_size == r["bytes"]
        assert not list((mnt / "out").glob("samples/*/.*.tmp"))
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

    assert guard("--draft-config", draft(AUX), "--dataset", out).returncode == 0
    assert guard("--draft-config", draft(AUX), "--dataset", out, "--sglang", server.pp).returncode == 0
    # capture-index style ids ([2, 30, 58] on a 61-layer model; [0, 2, 3] here) are served other layers
    p = guard("--draft-config", draft([0, 2, 3]), "--dataset", out)
    assert p.returncode == 1 and "MISMATCH" in p.stdout and "[1, 3, 4]" in p.stdout and "[0, 2, 3]" in p.stdout
    # a speculators draft names the same layers in HF indices, as its manifest block does
    spec = tmp_path / "spec.json"
    man = json.loads((assets.root / "out-speculators" / "manifest.json").read_text())
    spec.write_text(json.dumps({"speculators_model_type": "eagle3",
                                "eagle_aux_hidden_state_layer_ids": man["speculators"]["eagle_aux_hidden_state_layer_ids"]}))
    p = guard("--draft-config", spec, "--dataset", assets.root / "out-speculators")
    assert p.returncode == 0 and "OK (vLLM)" in p.stdout, p.stdout
    # the draft config the export wrote for the dataset's release is read as the dataset's layers, also
    # by the release the dump came from when named, and by the newest series
    written = json.loads((out / "manifest.json").read_text())["sglang_draft_config"]
    assert written["sglang_release"].startswith("0.5.9") and written["layer_id_reading"] == "plus_one"
    cfg = tmp_path / "written.json"
    cfg.write_text(json.dumps({"eagle_config": written["eagle_config"]}))
    for extra in ([], ["--release", "0.5.9"], ["--sglang", server.pp]):
        p = guard("--draft-config", cfg, "--dataset", out, *extra)
        assert p.returncode == 0, p.stdout + p.stderr
    # a dump file is accepted as the dataset side too (one of the server's, for ids and a rid of our own)
    import requests

    from eaglepatch.extract.dumps import dump_path, new_rid, rid_key

    ids, rid = [0, 11, 12, 13], new_rid()
    assert requests.post(server.url + "/generate", json={"input_ids": ids, "rid": rid, "sampling_params": {
        "max_new_tokens": 1}}, timeout=120).status_code == 200
    assert requests.post(server.url + "/eagle3_dump/flush", json={}, timeout=120).json()["flushed"] is True
    dump = dump_path(server.dump_dir, rid_key(rid))
    assert dump.is_file(), dump
    assert guard("--draft-config", draft(AUX), "--dataset", dump).returncode == 0
    # the guard needs no torch (README: '.[guard]'): with torch unimportable it reads the dataset and the dump
    for ds in (out, dump):
        p = without("torch", GUARD, "--draft-config", draft(AUX), "--dataset", ds)
        assert p.returncode == 0 and "OK (SGLang)" in p.stdout, (p.stdout, p.stderr)
    probe = tmp_path / "needs_torch.py"
    probe.write_text("import torch\n")
    p = without("torch", probe)
    assert p.returncode != 0 and "torch" in p.stderr  # the blocking itself works
    dump.unlink()


@in_env
def test_specforge_format_needs_no_datasets(assets, server, tmp_path):
    """README: '.[extract-specforge]' has no datasets: a SpecForge extraction with datasets (and
    pyarrow) unimportable runs; speculators, which needs them, is refused in one line before it
    starts, naming its extra."""
    args = ["--server", server.url, "--model", assets.ckpt, "--data", assets.data, "--dump-dir", server.dump_dir,
            "--no-progress", "--limit", "3", AUX_FLAG]
    p = without("datasets,pyarrow", EXTRACT, *args, "--out", tmp_path / "sf", "--format", "specforge")
    assert p.returncode == 0 and "summary: 3 extracted" in p.stderr, p.stderr[-2000:]
    p = without("datasets,pyarrow", EXTRACT, *args, "--out", tmp_path / "sp", "--format", "speculators")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: extract.py --format speculators needs the Python package(s) datasets, which is not installed; "
        "pip install -e '.[extract-speculators]' (from the eaglepatch checkout)"], p.stderr
    assert not (tmp_path / "sp").exists()


# python -c WITHOUT MODULES SCRIPT ARGS...: SCRIPT run as __main__ with the comma list MODULES unimportable
WITHOUT = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',')]; sys.argv = sys.argv[2:]; "
           "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")


def without(modules: str, script, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@in_env
def test_readme_journey(assets, server, reference, indexed_ckpt):
    """README, 'Extract training data', on CPU: the suite's server is the README's serve command; its
    other commands run here as written (the demo directory and port this test's, python3 this
    python), each exits 0, and they are the commands the demo prints. The two datasets their trainers'
    readers load equal Hugging Face on the same weights (aux states and, through each trainer's
    target, the top-1 token), and the guard passes each draft config without a warning."""
    cmds = readme_journey()[1:]
    assert json.loads((assets.demo / "serve.json").read_text())["commands"] == [
        c.replace(README_DEMO, str(assets.demo)).replace(README_URL, server.url) for c in cmds]
    n = len((assets.demo / "conversations.jsonl").read_text().splitlines())
    out, walls = [], []
    for cmd in cmds:
        t0 = time.monotonic()
        p = subprocess.run(["bash", "-c", localize(cmd, assets.demo, server.url)], cwd=REPO, capture_output=True,
                           text=True, timeout=600)
        walls.append(round(time.monotonic() - t0, 1))
        assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-3000:])
        out.append(p.stdout + p.stderr)
    assert sum("tools/extract.py" in c for c in cmds) == 2 and sum("tools/guard.py" in c for c in cmds) == 2
    for cmd, text in zip(cmds, out):
        if "tools/extract.py" in cmd:
            assert f"summary: {n} extracted" in text and "0 failed" in text, text[-2000:]
        if "build_offline_eagle3_dataset" in cmd:
            assert text.startswith(f"{n} SpecForge samples"), text[-2000:]
        if "ArrowDataset" in cmd:
            assert text.startswith(f"{n} speculators samples"), text[-2000:]
        if "tools/guard.py" in cmd:
            assert ("OK (SGLang)" if "specforge" in cmd else "OK (vLLM)") in text and "warning" not in text, text
    sf = specforge_check(assets.demo / "ds-specforge", indexed_ckpt, reference)
    sp = speculators_check(assets.demo / "ds-speculators", assets, reference)
    assert sf["samples"] == n and sf["top1_agreement"] == 1.0 and sf["aux_max_abs_diff_vs_hf"] <= TOL, sf
    assert sp["top1_agreement"] == 1.0 and sp["aux_max_abs_diff_vs_hf"] <= TOL, sp
    FIGURES["readme_journey"] = {"wall_s": walls, "specforge": sf, "speculators": sp}


@in_env
def test_zz_figures(assets):
    """Prints the measured figures (pytest -s) and keeps them next to the data."""
    (assets.root / "figures.json").write_text(json.dumps(FIGURES, indent=2))
    print("\nextract figures:", json.dumps(FIGURES, indent=2))
    assert FIGURES.get("specforge") and FIGURES.get("speculators") and FIGURES.get("speculators_consumer")
