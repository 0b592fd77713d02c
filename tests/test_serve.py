"""tools/serve.py: the production command it builds for a patched tree, what it refuses, and
(in the CPU environment) that the command it starts passes the dump's launch checks in the
patched tree. The CPU demo itself (``--cpu-demo``) is the server of tests/test_extract.py, which
runs the README's commands against it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hashes, one_line_error, run_tool

STUBS = REPO / "src" / "eaglepatch" / "smoke" / "stubs"
IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "fastapi", "uvicorn"))


@pytest.fixture
def patched_checkout(tmp_path) -> Path:
    """A patched sglang 0.5.9 git checkout, as the README makes one (apply --fetch)."""
    dest = tmp_path / "sglang-eagle3"
    r = run_tool("apply", "--fetch", "0.5.9", dest)
    assert r.returncode == 0, r.stderr
    return dest


def split_shell(line: str) -> tuple[dict, list]:
    """(the leading VAR=value assignments, the command line) of a printed shell line."""
    words = shlex.split(line)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


def test_help_names_both_modes_defaults_and_exit_codes():
    r = run_tool("serve", "--help")
    assert r.returncode == 0
    for needle in ("--cpu-demo DIR", "--model-path MODEL", "(default: 127.0.0.1)", "(default: 30000)",
                   "CPU demo default: -1,0,1,2,3", "exit codes: 0 stopped by Ctrl-C or SIGTERM", "2 usage error"):
        assert needle in " ".join(r.stdout.split()), needle


def test_production_print(patched_checkout, tmp_path):
    """--print: the dump variables, the patched tree first on PYTHONPATH, --disable-radix-cache, the
    flags after --; nothing is created (not even the dump directory)."""
    dumps = tmp_path / "dumps"
    r = run_tool("serve", "--model-path", "moonshotai/Kimi-K2.5", "--dump-dir", dumps, "--layers=-1,1,29,60",
                 "--sglang", patched_checkout, "--print", "--", "--tp", "8", "--context-length", "65536",
                 env={"PYTHONPATH": "/elsewhere"})
    assert r.returncode == 0, r.stderr
    env, argv = split_shell(r.stdout.strip())
    assert env == {"EAGLE3_DUMP_DIR": str(dumps), "EAGLE3_DUMP_LAYERS": "-1,1,29,60",
                   "PYTHONPATH": f"{patched_checkout / 'python'}{os.pathsep}/elsewhere"}
    assert argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.5",
                    "--disable-radix-cache", "--host", "127.0.0.1", "--port", "30000", "--tp", "8",
                    "--context-length", "65536"]
    assert f"serving git tree {patched_checkout}, sglang 0.5.9" in r.stderr
    assert not dumps.exists()
    # --disable-radix-cache given after -- is not doubled
    r = run_tool("serve", "--model-path", "m", "--dump-dir", dumps, "--sglang", patched_checkout, "--print", "--",
                 "--disable-radix-cache")
    assert split_shell(r.stdout.strip())[1].count("--disable-radix-cache") == 1


def test_refusals_leave_everything_as_it_was(patched_checkout, tmp_path, release_059):
    before = hashes(patched_checkout)
    cases = [
        (["--model-path", "m"], "--dump-dir is missing"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", release_059],
         "without the EAGLE-3 series (it has no dump); patch it first: python3 tools/apply.py"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", tmp_path / "nowhere"], "does not exist"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--layers=-2,1"], "ids are distinct, -1"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--port", "0"], "--port 0 is out of range"),
        (["--cpu-demo", tmp_path / "demo", "--python", sys.executable], "--python is for production serving"),
        (["--cpu-demo", tmp_path / "demo", "--layers=-1,4"], "--layers [4] out of range: the demo model has 4"),
        (["--cpu-demo", patched_checkout], "is not empty and was not made by the demo"),
    ]
    if not (importlib.util.find_spec("sglang")):  # this python has no sglang of its own to serve
        cases.append((["--model-path", "m", "--dump-dir", tmp_path / "d"], "has no sglang to serve; pass --sglang ROOT"))
    for args, needle in cases:
        r = run_tool("serve", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in one_line_error(r), (args, r.stderr)
    assert hashes(patched_checkout) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang-eagle3"]  # no dump dir, no demo dir


def test_an_edited_patched_tree_is_served_with_a_warning(patched_checkout, tmp_path):
    """(An edited checkout's release is no longer told by its files' hashes: --series names it, as
    tools/apply.py asks for it then.)"""
    f = patched_checkout / "python" / "sglang" / "srt" / "models" / "deepseek_v2.py"
    f.write_text(f.read_text() + "\n# a local edit\n")
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print")
    assert r.returncode == 2 and "pass --series patches/sglang-<release>" in one_line_error(r)
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print",
                 "--series", REPO / "patches" / "sglang-0.5.9")
    assert r.returncode == 0, r.stderr
    assert "warning: " in r.stderr and "differs from the patched files recorded in sglang-0.5.9/manifest.json" in r.stderr


def test_prefill_cuda_graphs_are_disabled_where_the_release_has_them(tmp_path):
    """0.5.17 and later run prefill through CUDA graphs by default under CUDA, which the dump refuses:
    serve.py adds --disable-prefill-cuda-graph for them (0.5.9 has no such setting: not added)."""
    dest = tmp_path / "sglang-0.5.17"
    assert run_tool("apply", "--fetch", "0.5.17", dest).returncode == 0
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", dest, "--print")
    assert r.returncode == 0, r.stderr
    argv = split_shell(r.stdout.strip())[1]
    assert argv[5:7] == ["--disable-radix-cache", "--disable-prefill-cuda-graph"], argv


def _env_python(release: str):
    """(python, requirement list) of the CPU environment of ``release`` when it is built, else None."""
    from eaglepatch import cpuenv

    req = cpuenv.requirements_for(release)
    d = cpuenv.env_dir(req)
    if not (d / cpuenv.COMPLETE_MARKER).is_file():
        return None
    return d / "bin" / "python", req


@pytest.mark.skipif(not IN_ENV, reason="needs sglang's dependencies (the CPU environment)")
@pytest.mark.parametrize("release", ["0.5.9", "0.5.17"])
def test_the_started_command_passes_the_dumps_launch_checks(release, tmp_path):
    """serve.py runs launch_server from the patched tree with the dump on: on a model the dump does not
    cover, the launch ends at the patched tree's model check with its one line, which comes after
    every server-argument rule (radix cache first): the flags serve.py adds pass them all, and the
    release's launch_server accepts them. (0.5.17: only where its CPU environment is built, as the
    functional smoke tests build it.)"""
    from eaglepatch.smoke import stubs_for

    found = _env_python(release)
    if found is None:
        pytest.skip(f"the CPU environment of sglang {release} is not built")
    python, req = found
    tree = tmp_path / f"sglang-{release}"
    assert run_tool("apply", "--fetch", release, tree).returncode == 0
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "torch_dtype": "float32"}))
    dumps = tmp_path / "dumps"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "serve.py"), "--model-path", str(model), "--dump-dir",
                        str(dumps), "--sglang", str(tree), "--python", str(python), "--port", "39017", "--",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(stubs_for(req, tmp_path)), SGLANG_USE_CPU_ENGINE="1",
                                HF_HUB_OFFLINE="1"))
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.returncode != 0 and errors == [
        "error: EAGLE3_DUMP_DIR is set but LlamaForCausalLM is not supported; the dump covers DeepSeek-V2/V3 and "
        "Kimi-K2.5 models: unset EAGLE3_DUMP_DIR"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and dumps.is_dir() and not list(dumps.iterdir())


@pytest.mark.skipif(not IN_ENV, reason="builds the demo's tokenizer in the CPU environment")
def test_cpu_demo_serves_a_given_tree_plus_the_smoke_patch(patched_checkout, tmp_path):
    """--cpu-demo DIR --sglang ROOT: a copy of ROOT with the test-only smoke patch goes first on
    PYTHONPATH (ROOT stays as it was); a second run reuses DIR; the demo files are there."""
    before = hashes(patched_checkout)
    demo = tmp_path / "demo"
    for _ in range(2):
        r = run_tool("serve", "--cpu-demo", demo, "--sglang", patched_checkout, "--print")
        assert r.returncode == 0, r.stderr
    env, argv = split_shell(r.stdout.strip())
    tree = demo / "sglang-tree"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tree), str(STUBS)]
    assert env["EAGLE3_DUMP_LAYERS"] == "-1,0,1,2,3" and env["EAGLE3_DUMP_DIR"] == str(demo / "dumps")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--disable-radix-cache" in argv
    handler = tree / "sglang" / "srt" / "models" / "deepseek_common" / "attention_backend_handler.py"
    assert 'AttentionBackendRegistry.register("torch_native"' in handler.read_text()
    assert hashes(patched_checkout) == before
    info = json.loads((demo / "serve.json").read_text())
    assert info["tree"] == str(tree) and len(info["commands"]) == 6
    assert json.loads((demo / "draft-specforge" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert json.loads((demo / "draft-speculators" / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 2, 3]
    assert len((demo / "conversations.jsonl").read_text().splitlines()) == 16
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (demo / "model").iterdir()}


def test_ready_announced_only_after_the_warm_up(tmp_path):
    """tools/serve.py says "ready" (and prints the extract command to run) only once /health
    answers 200: SGLang answers /get_model_info during its warm-up, when /health is still 503
    and tools/extract.py refuses the server."""
    import subprocess
    import sys
    import time

    from warmkit import warming_server

    from eaglepatch import serve

    with warming_server(2.5) as (url, warm):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        said = []
        try:
            plan = serve.Plan(argv=[], env={}, url=url, after_ready=["next: tools/extract.py ..."])
            serve._announce(proc, plan, lambda m: said.append((time.monotonic(), m)))
        finally:
            proc.kill()
    until = warm["until"]
    assert said and said[0][1].startswith("[serve] ready at"), said
    assert said[0][0] >= until, "announced ready during the warm-up"
    assert said[1][1] == "next: tools/extract.py ..."


def test_taken_port_is_refused_before_anything_starts(tmp_path):
    """serve.run on a port something listens on: RefusedError naming the port and --port, before
    the server starts or any directory is made (that listener would answer /health in its place
    and the launcher would announce it). A port whose last server left only TIME_WAIT
    connections is free, as it is for uvicorn."""
    import socket

    from eaglepatch import serve
    from eaglepatch.errors import RefusedError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        marker = tmp_path / "started"
        plan = serve.Plan(argv=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"], env={},
                          url=f"http://127.0.0.1:{port}", mkdirs=[tmp_path / "dumps"])
        with pytest.raises(RefusedError) as ei:
            serve.run(plan, say=lambda m: None)
        assert serve.port_taken("127.0.0.1", port)
    line = ei.value.line()
    assert line.startswith(f"error: port {port} on 127.0.0.1 is taken") and "--port" in line and "\n" not in line, line
    assert not marker.exists() and not (tmp_path / "dumps").exists()
    assert serve.port_taken("127.0.0.1", port) is None  # closed: free again
    # a server that closed its connections first leaves them in TIME_WAIT on its port: still free
    with socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        port = lst.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = lst.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT
        cli.recv(1)
        cli.close()
    assert serve.port_taken("127.0.0.1", port) is None
