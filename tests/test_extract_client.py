"""tools/extract.py against loopback stand-ins of patched servers that follow the dump contract of
issue 19 (``extract_fixtures/dumpserver.py``: a real HTTP server writing real safetensors dumps,
named by sha256 of the request's rid, queued until ``POST /eagle3_dump/flush``):

- every request carries its own rid, the same one on every retry of its sample on any server, and
  the sample holds that request's rows; identical conversations never share a file;
- the client flushes the server instead of waiting for the file, once, when the file is not there;
  a server without the flush endpoint (an older series) is refused in one line; a file still missing
  after the flush names the rid, the key and the server;
- each dump's rid, prompt key and input source are checked, a mismatch names the file and the server;
- every dump's provenance (model, architecture, dtype, layers, series and sglang versions) is
  compared with the dataset's first dump, in this run and in a resumed one; a mismatch stops the
  run in one line naming the field, both values and the server, and the dataset stays resumable;
- the client keeps no per-sample state (no lock per dump key) that grows with the run.

The real patched server runs in tests/test_extract.py; these tests need torch, transformers and
safetensors (the CPU environment: ``python3 tools/test.py tests/test_extract_client.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_suite_in_cpu_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers", "safetensors", "tqdm"))
in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_client_suite_in_cpu_env)")

EXTRACT = REPO / "tools" / "extract.py"
LAYERS = [-1, 0, 1, 2, 3]
AUX = [-1, 1, 2]
H, N_LAYERS = 8, 4
N_CONV = 10


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_client_suite_in_cpu_env():
    run_suite_in_cpu_env(__file__, 900)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A model directory the client reads (config.json and the tiny chat tokenizer) and conversations."""
    from eaglepatch.serve import tinychat

    root = tmp_path_factory.mktemp("client")
    d = tinychat.build_tokenizer(root / "model")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 1024,
                                               "hidden_size": H, "num_hidden_layers": N_LAYERS}))
    recs = tinychat.conversations(N_CONV)
    return SimpleNamespace(dir=d, root=root, recs=recs, data=tinychat.write_jsonl(root / "conv.jsonl", recs))


@pytest.fixture
def dumps(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    return d


def server(dumps, layers=None, **kw):
    from dumpserver import DumpServer

    return DumpServer(dumps, LAYERS if layers is None else layers, H, N_LAYERS, **kw)


def run_cli(argv) -> SimpleNamespace:
    """tools/extract.py main() in this process; its exit code and stderr."""
    spec = importlib.util.spec_from_file_location("extract_cli", EXTRACT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = mod.main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return SimpleNamespace(returncode=rc, stderr=err.getvalue())


def extract(model, urls, dumps, out, *extra, data=None):
    urls = urls if isinstance(urls, list) else [urls]
    return run_cli([a for u in urls for a in ("--server", u)] + [
        "--model", model.dir, "--data", data or model.data, "--dump-dir", dumps, "--out", out, "--no-progress",
        "--aux-layers=" + ",".join(map(str, AUX)), "--dump-timeout", "5", *extra])


def extract_process(model, url, dumps, out):
    """tools/extract.py as a process of its own (one worker), for a test that signals or kills it."""
    import subprocess

    return subprocess.Popen([sys.executable, str(EXTRACT), "--server", url, "--model", str(model.dir), "--data",
                             str(model.data), "--dump-dir", str(dumps), "--out", str(out), "--no-progress",
                             "--aux-layers=" + ",".join(map(str, AUX)), "--concurrency", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def one_line(p, *needles) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = [x for x in p.stderr.strip().splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "; " in lines[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def records(out: Path) -> list:
    return [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]


def prompt_keys(model) -> dict:
    """Conversation id -> the prompt key (sha256 of its ids) the client sends."""
    from dumpserver import prompt_key

    from eaglepatch.extract.data import load_conversations
    from eaglepatch.extract.tokenize import ChatTokenizer

    tok = ChatTokenizer(model.dir)
    return {c.id: prompt_key(tok.encode(c.messages, 2048).input_ids) for c in load_conversations(model.data)}


def check_rows(out: Path) -> int:
    """Every SpecForge sample holds the rows of its own prompt (the stand-in's rows are a function of
    the ids); returns the number of samples."""
    import torch
    from dumpserver import expected_rows

    files = sorted(out.glob("samples/*/*.ckpt"))
    for f in files:
        d = torch.load(str(f), weights_only=True)
        ids = d["input_ids"].tolist()
        want = torch.cat([expected_rows(ids, k, H) for k in AUX], dim=-1)[None]
        assert torch.equal(d["aux_hidden_state"], want), f
        assert torch.equal(d["hidden_state"], expected_rows(ids, 99, H)[None]), f
    return len(files)


def snapshot(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# ---- rid, flush ---------------------------------------------------------------------------------

@in_env
def test_every_request_carries_its_rid_and_reads_its_own_file(model, dumps, tmp_path):
    """The stand-in writes a dump only when flushed, named by sha256 of the rid the client sent: the
    run completes with no wait, every sample holds its own rows, the rids are the client's own and
    one per conversation, the flush is called at most once per request, used dumps are removed."""
    with server(dumps) as s:
        t0 = time.monotonic()
        p = extract(model, s.url, dumps, tmp_path / "out", "--concurrency", "3", "--dump-timeout", "30")
        wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert wall < 30, f"the run took {wall:.1f} s: it waited for files instead of flushing"
    assert check_rows(tmp_path / "out") == N_CONV
    rids = [r for r, _ in s.requests]
    assert len(rids) == N_CONV and len(set(rids)) == N_CONV, rids
    assert all(r.startswith("eaglepatch-") and len(r) == len("eaglepatch-") + 32 for r in rids), rids
    # one new token, greedy, never n > 1 (SGLang's parallel sampling prefills a request of its own, with a
    # rid it makes up, whose file no answer names)
    assert s.sampling == [{"max_new_tokens": 1, "temperature": 0.0}] * len(rids), s.sampling
    assert 1 <= s.flushes <= len(rids)
    assert not list(dumps.iterdir()), "used dumps were not removed"
    recs = {r["id"]: r for r in records(tmp_path / "out")}
    pk = prompt_keys(model)
    by_prompt = {k: r for r, k in s.requests}
    for cid, rec in recs.items():
        from dumpserver import sha

        assert rec["rid"] == by_prompt[pk[cid]] and rec["key"] == sha(rec["rid"]), rec


@in_env
def test_files_written_at_once_need_no_flush(model, dumps, tmp_path):
    """A server whose file is there when it answers is flushed only once, by each server's probe."""
    with server(dumps, write="now") as a, server(dumps, write="now") as b:
        p = extract(model, [a.url, b.url], dumps, tmp_path / "out", "--concurrency", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (a.flushes, b.flushes) == (1, 1)
    servers = json.loads((tmp_path / "out" / "manifest.json").read_text())["last_run"]["servers"]
    assert [s["flushes"] for s in servers] == [1, 1], servers
    assert check_rows(tmp_path / "out") == N_CONV


@in_env
def test_without_the_bar_progress_lines_name_the_seconds_per_stage(model, dumps, tmp_path):
    """--no-progress with --log-every: progress lines with samples, tokens/s and seconds per stage (a
    run stopped early still shows where its time went); the default (30 s) writes none in a short
    run; --log-every 0 is a usage error that writes nothing."""
    with server(dumps, write="now") as s:
        p = extract(model, s.url, dumps, tmp_path / "out", "--concurrency", "1", "--log-every", "1e-9")
        q = extract(model, s.url, dumps, tmp_path / "out2", "--concurrency", "1")
    assert p.returncode == 0 and q.returncode == 0, (p.stderr[-2000:], q.stderr[-2000:])
    lines = [x for x in p.stderr.splitlines() if x.startswith("progress: ")]
    # one line per sample but the probe's (the sample sent alone before the workers start) at most
    assert N_CONV - 1 <= len(lines) <= N_CONV, p.stderr[-3000:]
    assert lines[-1].startswith(f"progress: {N_CONV}/{N_CONV} samples, "), lines[-1]
    for stage in ("tokenize", "generate", "wait for file", "read validate", "write", "record"):
        assert f" {stage} " in lines[-1], (stage, lines[-1])
    assert not [x for x in q.stderr.splitlines() if x.startswith("progress: ")], q.stderr[-2000:]
    one_line(extract(model, s.url, dumps, tmp_path / "out3", "--log-every", "0"), "--log-every out of range")
    assert not (tmp_path / "out3").exists()


@in_env
def test_a_retry_elsewhere_keeps_the_rid(model, dumps, tmp_path):
    """conv-004 is refused once by each server (HTTP 503), conv-007's first two requests are
    answered and never written: each is sent again, with the same rid on every server, and lands in
    one file; the missing file is named with its rid, key and server."""
    pk = prompt_keys(model)
    with server(dumps) as a, server(dumps) as b:
        for s in (a, b):
            s.plan = {pk["conv-004"]: ["503"], pk["conv-007"]: ["lose"]}
        p = extract(model, [a.url, b.url], dumps, tmp_path / "out", "--concurrency", "2", "--retries", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert check_rows(tmp_path / "out") == N_CONV
    for cid, least in (("conv-004", 2), ("conv-007", 2)):
        sent = [r for s in (a, b) for r, k in s.requests if k == pk[cid]]
        assert len(sent) >= least and len(set(sent)) == 1, (cid, sent)
    rid7 = next(r for s in (a, b) for r, k in s.requests if k == pk["conv-007"])
    from dumpserver import sha

    lost = [x for x in p.stderr.splitlines() if "after the flush" in x]
    assert lost and rid7 in lost[0] and sha(rid7) in lost[0], p.stderr[-3000:]
    assert any(u in lost[0] for u in (a.url, b.url)), lost[0]


@in_env
def test_a_server_without_the_flush_endpoint_is_refused(model, dumps, tmp_path):
    """A server that answers 404 at /eagle3_dump/flush runs an older series: one line naming the URL
    and the fix, at once (no wait), nothing left behind."""
    with server(dumps, flush_status=404, write="now") as s:
        t0 = time.monotonic()
        p = extract(model, s.url, dumps, tmp_path / "out", "--dump-timeout", "30")
        wall = time.monotonic() - t0
    line = one_line(p, f"{s.url}/eagle3_dump/flush", "404", "upgrade")
    assert "series" in line, line
    assert wall < 20, wall
    assert not (tmp_path / "out").exists()


@in_env
def test_a_server_still_warming_up_is_refused(model, dumps, tmp_path):
    """SGLang answers /get_model_info during its warm-up but /health 503, and the series dumps no
    request sent before the warm-up ends: refused in one line naming the server, before any request."""
    with server(dumps) as s:
        s.health = 503
        p = extract(model, s.url, dumps, tmp_path / "out")
    one_line(p, f"the server at {s.url} is starting", "warm-up", "fired up and ready to roll")
    assert s.requests == [] and not (tmp_path / "out").exists()


@in_env
def test_a_server_writing_elsewhere_is_named_after_the_flush(model, dumps, tmp_path):
    """The probe's file is still missing after the flush (the server dumps into another directory):
    one line naming the server, the rid and the key, at once."""
    other = tmp_path / "other"
    other.mkdir()
    with server(other) as s:
        p = extract(model, s.url, dumps, tmp_path / "out", "--dump-timeout", "30")
    rid = s.requests[0][0]
    from dumpserver import sha

    one_line(p, "no dump file", rid, sha(rid), s.url, "EAGLE3_DUMP_DIR")
    assert not (tmp_path / "out").exists()


@in_env
def test_dump_identity_is_checked(model, dumps, tmp_path):
    """A dump whose rid, prompt key or input source is not the request's is rejected with a line
    naming the file and the server, and retried; one that is wrong every time fails its sample."""
    pk = prompt_keys(model)
    with server(dumps) as s:
        s.plan = {pk["conv-002"]: ["rid"], pk["conv-003"]: ["prompt"], pk["conv-005"]: ["embeds"],
                  pk["conv-006"]: ["embeds"] * 3}
        p = extract(model, s.url, dumps, tmp_path / "out", "--concurrency", "2")
    assert p.returncode == 1, p.stderr[-3000:]
    err = p.stderr
    for cid, what in (("conv-002", "rid"), ("conv-003", "prompt_key"), ("conv-005", "input_source")):
        lines = [x for x in err.splitlines() if f"conversation {cid!r} attempt 1/3: bad dump" in x]
        assert lines and what in lines[0] and s.url in lines[0] and ".safetensors" in lines[0], (cid, err[-3000:])
    assert "input_embeds" in err and "6 bad dumps rejected" in err, err[-3000:]
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert man["failed_ids"] == ["conv-006"] and man["samples"] == N_CONV - 1
    assert check_rows(tmp_path / "out") == N_CONV - 1


@in_env
def test_behind_the_router_every_replica_is_flushed(model, dumps, tmp_path):
    """SGLang's router (sglang-router, in the CPU env) has no flush route: the client flushes the
    replicas the router lists. Two stand-ins behind it: the run completes, both were flushed. A
    replica of an older series (404 at its flush) is named in one line, with the router."""
    import cpuserver

    with server(dumps) as a, server(dumps) as b:
        with cpuserver.Router([a.url, b.url], tmp_path / "router.log") as router:
            p = extract(model, router.url, dumps, tmp_path / "out", "--concurrency", "4")
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"{router.url} is SGLang's router (2 replicas)" in p.stderr, p.stderr[-3000:]
        assert a.requests and b.requests and a.flushes >= 1 and b.flushes >= 1
        assert check_rows(tmp_path / "out") == N_CONV
    with server(dumps) as a, server(dumps, flush_status=404) as b:
        with cpuserver.Router([a.url, b.url], tmp_path / "router2.log") as router:
            p = extract(model, router.url, dumps, tmp_path / "out2")
    one_line(p, f"{b.url}/eagle3_dump/flush", f"behind the router {router.url}", "404", "upgrade")
    assert not (tmp_path / "out2").exists()


# ---- provenance -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _http(answer):
    """A loopback HTTP server answering each request with ``answer(method, path)`` -> (status, JSON)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            status, body = answer(method, self.path)
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._reply("GET")

        def do_POST(self):
            self._reply("POST")

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield "http://127.0.0.1:%d" % srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@in_env
def test_a_router_slow_to_list_its_replicas_is_not_taken_for_a_server_with_the_dump_off():
    """Behind SGLang's router (404 at the flush) the client reads ``GET /workers``. A router that
    answers it 503 at first is still a router: tried again, its replica flushed. One that never
    answers it is a flush problem naming /workers and the cause (the sample is tried again), never
    ``NoFlush`` ("the dump is off on that server"), which the client said for a router it could not
    read in a CI run of 2026-12-07 (the old client fails here with NoFlush). A server answering 404
    at both is still NoFlush."""
    from eaglepatch.extract.client import WORKERS_TRIES, NoFlush, SGLangClient

    flushed, asked = [], []
    with _http(lambda m, path: (flushed.append(path) or 200, {"flushed": True})) as replica:
        def router(fails):
            def answer(method, path):
                if path == "/workers":
                    asked.append(path)
                    if len(asked) <= fails:
                        return 503, {"error": "busy"}
                    return 200, {"workers": [{"url": replica + "/"}], "total": 1}
                return 404, {"detail": "Not Found"}
            return answer

        with _http(router(WORKERS_TRIES - 1)) as url:  # answers on the last try
            c = SGLangClient(url, backoff=0.01)
            assert c.flush(0, time.monotonic()) == [] and c._router[0] and flushed == ["/eagle3_dump/flush"]
            assert len(asked) == WORKERS_TRIES
        asked.clear()
        flushed.clear()
        with _http(router(10 ** 6)) as url:  # never answers /workers
            c = SGLangClient(url, backoff=0.01)
            problems = c.flush(0, time.monotonic())
            assert len(problems) == 1 and url + "/workers did not answer: HTTP 503" in problems[0], problems
            assert not c._router[0] and not flushed and len(asked) == WORKERS_TRIES
        with _http(lambda m, path: (404, {"detail": "Not Found"})) as url:  # no flush, no router: NoFlush
            with pytest.raises(NoFlush, match="answered HTTP 404"):
                SGLangClient(url, backoff=0.01).flush(0, time.monotonic())


@in_env
def test_dumps_of_another_model_stop_the_run_and_the_dataset_resumes(model, dumps, tmp_path):
    """The dataset records its first dump's provenance. A later dump of another checkpoint (in the
    middle of a run), a resumed run on a server of another series, and a second replica of another
    dtype are each refused in one line naming the field, both values and the server's URL; what was
    recorded stays whole and a run on the right server completes the dataset."""
    out = tmp_path / "out"
    pk = prompt_keys(model)
    with server(dumps) as a:
        a.plan = {pk["conv-003"]: [{"model_path": "other/checkpoint"}]}
        p = extract(model, a.url, dumps, out, "--concurrency", "1")
    one_line(p, "model_path", "'stand-in'", "'other/checkpoint'", a.url)
    assert [r["id"] for r in records(out)] == ["conv-000", "conv-001", "conv-002"]
    assert not any(out.glob("samples/*/.*.tmp"))
    settings = json.loads((out / ".extract-settings.json").read_text())
    assert settings["dump_meta"]["model_path"] == "stand-in" and settings["dump_meta"]["series_version"] == "0.5.9-4"
    before = snapshot(out)
    # days later, a server with another series: refused at its first dump, nothing changed
    with server(dumps, meta={"series_version": "0.5.9-5"}) as c:
        p = extract(model, c.url, dumps, out)
    one_line(p, "series_version", "'0.5.9-4'", "'0.5.9-5'", c.url, "new --out")
    assert snapshot(out) == before
    # two replicas, the second of another dtype (its tensors say so too): refused at its probe
    import torch
    from dumpserver import expected_rows

    def half(ids):
        return {k: expected_rows(ids, k, H).to(torch.bfloat16) for k in [*LAYERS, 99]} | {
            "final": expected_rows(ids, 99, H).to(torch.bfloat16)}

    with server(dumps) as a, server(dumps, meta={"dtype": "bfloat16"}, states=half) as b:
        p = extract(model, [a.url, b.url], dumps, out)
    one_line(p, "dtype", "'float32'", "'bfloat16'", b.url)
    assert len(records(out)) == 4  # the first replica's probe sample was recorded whole
    with server(dumps) as a:
        p = extract(model, a.url, dumps, out)
    assert p.returncode == 0 and "4 already done" in p.stderr, p.stderr[-3000:]
    assert check_rows(out) == N_CONV
    man = json.loads((out / "manifest.json").read_text())
    assert man["samples"] == N_CONV and man["series_version"] == "0.5.9-4"
    assert man["dump_provenance"]["model_path"] == "stand-in" and man["dump_provenance"]["dtype"] == "float32"


# ---- no per-sample state --------------------------------------------------------------------------

def _locks_held(obj) -> int:
    """Lock objects reachable from ``obj``'s attributes (through dicts, lists, tuples and sets)."""
    kinds = (type(threading.Lock()), type(threading.RLock()))
    seen, n, todo = set(), 0, list(vars(obj).values())
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, kinds):
            n += 1
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo.extend(v)
    return n


@in_env
def test_no_lock_per_sample_and_identical_conversations_each_get_their_file(model, dumps, tmp_path):
    """The locks the run holds do not grow with the number of samples; eight identical conversations
    in flight together are each extracted from their own request's file."""
    from eaglepatch.extract import Extractor, Options
    from eaglepatch.serve import tinychat

    same = [{"id": f"twin-{i}", "messages": model.recs[0]["messages"]} for i in range(8)]
    held = []
    for n, recs in ((3, same[:3]), (8, same + model.recs[1:])):
        data = tinychat.write_jsonl(tmp_path / f"conv-{n}.jsonl", recs)
        with server(dumps) as s:
            ex = Extractor(Options(servers=[s.url], model=model.dir, data=data, dump_dir=dumps,
                                   out=tmp_path / f"out-{n}", concurrency=4, progress=False, aux_layers=AUX),
                           log=lambda m: None)
            assert ex.run() == 0
        held.append(_locks_held(ex))
        assert check_rows(tmp_path / f"out-{n}") == len(recs)
        rids = [r for r, _ in s.requests]
        assert len(rids) == len(set(rids)) == len(recs)
    assert held[0] == held[1], f"the run holds {held[0]} locks after 3 samples, {held[1]} after {len(recs)}"


# ---- issue 29: hints that name what the user runs, leftover dumps -----------------------------------

def test_aux_layers_value_after_a_space_is_one_line():
    """``--aux-layers -1,2``: argparse reads '-1,2' as an option and says only "expected one
    argument"; the tool says in one line to join the value with '=' (no server, no file needed)."""
    p = run_cli(["--server", "http://127.0.0.1:9", "--model", "m", "--data", "d", "--dump-dir", "x", "--out", "o",
                 "--aux-layers", "-1,2"])
    line = one_line(p, "--aux-layers -1,2", "write --aux-layers=-1,2")
    assert "expected one argument" not in p.stderr, line
    assert one_line(run_cli(["--aux", "-1,1,2"]), "--aux -1,1,2", "write --aux-layers=-1,1,2")


@in_env
def test_no_server_names_serve_py_before_the_tokenizer_loads(model, dumps, tmp_path):
    """Nothing listens at --server: one line naming tools/serve.py with this run's model and dump
    directory (not launch_server without the dump), given before torch or transformers is imported
    (they take seconds: the user waited 18-29 s for this line)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    atexit_probe = ("import atexit, runpy, sys; atexit.register(lambda: sys.stderr.write('HEAVY=' + ','.join("
                    "m for m in ('torch', 'transformers') if m in sys.modules) + chr(10))); sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    import subprocess

    p = subprocess.run([sys.executable, "-c", atexit_probe, str(EXTRACT), "--server", f"http://127.0.0.1:{port}",
                        "--model", str(model.dir), "--data", str(model.data), "--dump-dir", str(dumps),
                        "--out", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True, timeout=120)
    line = one_line(p, f"cannot reach the SGLang server at http://127.0.0.1:{port}",
                    f"tools/serve.py --model-path {model.dir} --dump-dir {dumps}")
    assert "launch_server" not in line, line
    assert "HEAVY=\n" in p.stderr, p.stderr  # neither torch nor transformers was imported
    assert not (tmp_path / "out").exists()


@in_env
def test_layer_errors_name_the_flags_and_only_real_layers(model, dumps, tmp_path):
    """A 4-layer model. --aux-layers=-1,1,5 names no layer under any reading: refused before any
    request, naming the flag as typed. -1,1,4 is read (k -> k+1) as layer 4: refused at the first dump,
    its fix naming only dumped layers (never 'dump layer 4'). A missing dumped layer and speculators'
    missing last layer name tools/serve.py --layers= (the flag the user typed) with the list to use."""
    with server(dumps) as s:
        line = one_line(extract(model, s.url, dumps, tmp_path / "o1", "--aux-layers=-1,1,5"),
                        "--aux-layers=-1,1,5 names layer 5", "4-layer model")
        assert s.requests == [], "the ids were refused after a request"
        line = one_line(extract(model, s.url, dumps, tmp_path / "o2", "--aux-layers=-1,1,4"),
                        "--aux-layers=-1,1,4", "names [4], which a 4-layer model does not have",
                        "with layers the server dumps: -1,0,1,2,3")
        assert "--layers=" not in line and "including" not in line, line
    with server(dumps, layers=[-1, 1, 2, 3]) as s:
        one_line(extract(model, s.url, dumps, tmp_path / "o3", "--aux-layers=-1,0,1"),
                 "--aux-layers=-1,0,1 asks for EAGLE-3 layers [0] but the server dumps [-1, 1, 2, 3]",
                 "python3 tools/serve.py --layers=-1,0,1,2,3", "EAGLE3_DUMP_LAYERS=-1,0,1,2,3")
    with server(dumps, layers=[-1, 0, 1, 2]) as s:
        line = one_line(extract(model, s.url, dumps, tmp_path / "o4", "--format", "speculators"),
                        "needs the last decoder layer's output before the final norm (EAGLE-3 id 3, HF index 4)",
                        "python3 tools/serve.py --layers=-1,0,1,2,3", "EAGLE3_DUMP_LAYERS=-1,0,1,2,3")
    for i in range(1, 5):
        assert not (tmp_path / f"o{i}").exists()


@in_env
def test_a_server_with_the_dump_off_is_named_so(model, dumps, tmp_path):
    """A patched server started without EAGLE3_DUMP_DIR has no flush route (404) and writes no file:
    the line says the dump is off there and how to start it with tools/serve.py (it called such a
    server one of an 'older series')."""
    with server(dumps, flush_status=404) as s:
        p = extract(model, s.url, dumps, tmp_path / "out")
    line = one_line(p, f"{s.url}/eagle3_dump/flush answered HTTP 404", "the dump is off on that server",
                    "EAGLE3_DUMP_DIR", f"tools/serve.py --model-path {model.dir} --dump-dir {dumps}")
    assert "series" not in line.split("; ")[0], line
    assert not (tmp_path / "out").exists() and not list(dumps.iterdir())


def plant_foreign_dump(dumps: Path) -> Path:
    """Another client's dump file in the shared directory (its own rid): never ours to remove."""
    import torch
    from dumpserver import sha
    from safetensors.torch import save_file

    rid = "eaglepatch-" + "f" * 32  # even a rid of our form: it is in no request file of ours
    path = dumps / f"{sha(rid)}.safetensors"
    save_file({"input_ids": torch.tensor([1, 2, 3])}, str(path), metadata={"format": "eagle3-dump/1", "rid": rid})
    return path


@in_env
def test_a_run_removes_the_dumps_its_failed_samples_left(model, dumps, tmp_path):
    """conv-003's file comes after its only attempt gave up (written by a later sample's flush): at the
    end the run says it removes it, and does; another client's file in the directory stays."""
    pk = prompt_keys(model)
    foreign = plant_foreign_dump(dumps)
    with server(dumps) as s:
        s.plan = {pk["conv-003"]: ["late"]}
        p = extract(model, s.url, dumps, tmp_path / "out", "--concurrency", "1", "--max-attempts", "1")
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"removed 1 dump file(s) from {dumps} that this run requested and did not use" in p.stderr, p.stderr[-3000:]
    assert sorted(dumps.iterdir()) == [foreign]
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert man["failed_ids"] == ["conv-003"]
    assert man["last_run"]["unused_dumps_removed"] == {"earlier_runs": 0, "this_run": 1}


@in_env
def test_sigterm_stops_the_run_as_ctrl_c_does_and_the_rerun_goes_on(model, dumps, tmp_path):
    """A SIGTERM (a job scheduler's stop) while a request waits for its answer: the run says how many
    samples it finished and where its time went, ends in one line (exit 2, no traceback) with the
    samples done recorded, and the same command completes the dataset from there."""
    import signal

    pk = prompt_keys(model)
    out = tmp_path / "out"
    with server(dumps) as s:
        s.plan = {pk["conv-002"]: ["hang"]}
        proc = extract_process(model, s.url, dumps, out)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if any(k == pk["conv-002"] for _, k in s.requests):
                    break
                time.sleep(0.05)
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            s.release.set()  # the request in flight is answered; the run does not record it
            err = proc.communicate(timeout=60)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
            s.release.set()
        assert proc.returncode == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert lines[-1] == ("error: interrupted (Ctrl-C or SIGTERM); the samples done are kept in --out: run the "
                             "same command again to go on from there"), err[-3000:]
        assert "Traceback" not in err
        stopped = [x for x in lines if x.startswith("stopped: ")]
        assert stopped and stopped[0].startswith("stopped: 2 sample(s) of this run finished and recorded"), err[-3000:]
        assert "time per stage" in stopped[0]
        assert [r["id"] for r in records(out)] == ["conv-000", "conv-001"]
        p = extract(model, s.url, dumps, out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"extracting {N_CONV - 2} of {N_CONV} conversations (2 already done)" in p.stderr, p.stderr[-3000:]
    assert check_rows(out) == N_CONV


@in_env
def test_a_rerun_removes_what_a_killed_run_left(model, dumps, tmp_path):
    """A run killed (SIGKILL) while a request whose file is written waits for its answer leaves that
    file; the next run on the same --out says so, removes it (and no other client's file) and
    completes the dataset."""
    import os
    import signal

    from dumpserver import sha

    pk = prompt_keys(model)
    foreign = plant_foreign_dump(dumps)
    out = tmp_path / "out"
    with server(dumps) as s:
        s.plan = {pk["conv-002"]: ["hang"]}
        proc = extract_process(model, s.url, dumps, out)
        try:
            deadline = time.monotonic() + 120
            left = None
            while time.monotonic() < deadline and proc.poll() is None:
                rids = [r for r, k in s.requests if k == pk["conv-002"]]
                if rids and (dumps / f"{sha(rids[0])}.safetensors").exists():
                    left = dumps / f"{sha(rids[0])}.safetensors"
                    break
                time.sleep(0.05)
            assert left is not None, proc.stderr.read() if proc.poll() is not None else "no file in 120 s"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stderr.close()
            s.release.set()
        assert left.exists() and foreign.exists()
        p = extract(model, s.url, dumps, out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"removed 1 dump file(s) from {dumps} that earlier runs on {out} requested and never used"
            in p.stderr), p.stderr[-3000:]
    assert not left.exists() and sorted(dumps.iterdir()) == [foreign]
    assert check_rows(out) == N_CONV
    man = json.loads((out / "manifest.json").read_text())
    assert man["last_run"]["unused_dumps_removed"]["earlier_runs"] == 1
    assert not (out / ".extract-requests.jsonl").exists()  # nothing left to look for
