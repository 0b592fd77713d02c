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
    assert env == {"EAGLE3_DUMP_DIR": str(dumps), "EAGLE3_DUMP_LAYERS": "-1,1,29,60", "EAGLE3_DUMP_DRAIN_S": "20",
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
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--drain-s", "nan"],
         "--drain-s 'nan' is not a positive finite number of seconds; pass e.g. --drain-s 20"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--max-wait-s", "inf"],
         "--max-wait-s 'inf' is not a positive finite number of seconds"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--max-pending-mb=-5"],
         "--max-pending-mb '-5' is not a positive finite number of MiB"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--max-pending-mb", "0"], "'0' is not a positive"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--drain-s", "soon"], "'soon' is not a positive"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--final", "2"],
         "--final '2' is not 1 or 0; pass --final 1 or --final 0"),
        (["--cpu-demo", tmp_path / "demo", "--drain-s=-inf"], "--drain-s '-inf' is not a positive"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--dump-dtype", "fp16"],
         "--dump-dtype 'fp16' is not bf16 or fp8; pass --dump-dtype bf16 or fp8"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--rebuildable", "drop"],
         "--rebuildable 'drop' is not store or omit"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--dump-writers", "0"],
         "--dump-writers '0' is not a whole number of threads from 1 to 64; pass e.g. --dump-writers 4"),
        (["--cpu-demo", tmp_path / "demo", "--dump-writers", "auto"], "--dump-writers 'auto' is not a whole number"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--dump-gil-switch-ms", "101"],
         "--dump-gil-switch-ms '101' is not a number of milliseconds above 0, at most 100; pass --dump-gil-switch-ms 1"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sink", "s3"], "--sink 's3' is not file or mooncake"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sink", "mooncake"],
         "--sink mooncake needs the store's master; pass --mooncake-master HOST:PORT"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--mooncake-master", "h:1"],
         "--mooncake-master is set but the sink is file; pass --sink mooncake"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sink", "mooncake", "--mooncake-master", "h"],
         "--mooncake-master 'h' is not host:port; pass --mooncake-master 127.0.0.1:50051"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sink", "mooncake", "--mooncake-master", "h:1",
          "--mooncake-metadata", "h:2"], "--mooncake-metadata 'h:2' is not http://host:port/metadata"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--host", "[::1"], "--host '[::1' is not an address"),
        (["--model-path", "m", "--dump-dir", tmp_path / "d", "--host", "1:2:3"], "--host '1:2:3' is not an IPv6"),
    ]
    if not (importlib.util.find_spec("sglang")):  # this python has no sglang of its own to serve
        cases.append((["--model-path", "m", "--dump-dir", tmp_path / "d"], "has no sglang to serve; pass --sglang ROOT"))
    for args, needle in cases:
        r = run_tool("serve", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in one_line_error(r), (args, r.stderr)
    # the user's own dump variables are checked as the flags are (a flag given instead wins)
    env_cases = [
        ({"EAGLE3_DUMP_DRAIN_S": "inf"}, "EAGLE3_DUMP_DRAIN_S='inf' (from the environment) is not a positive finite "
                                         "number of seconds; set it to e.g. 20, unset it, or pass --drain-s"),
        ({"EAGLE3_DUMP_MAX_PENDING_MB": "nan"}, "EAGLE3_DUMP_MAX_PENDING_MB='nan' (from the environment)"),
        ({"EAGLE3_DUMP_MAX_WAIT_S": "0"}, "EAGLE3_DUMP_MAX_WAIT_S='0' (from the environment)"),
        ({"EAGLE3_DUMP_FINAL": "maybe"}, "EAGLE3_DUMP_FINAL='maybe' (from the environment) is not 1 or 0"),
        ({"EAGLE3_DUMP_DTYPE": "int8"}, "EAGLE3_DUMP_DTYPE='int8' (from the environment) is not bf16 or fp8; set it "
                                        "to bf16 or fp8, unset it, or pass --dump-dtype"),
        ({"EAGLE3_DUMP_WRITERS": "100"}, "EAGLE3_DUMP_WRITERS='100' (from the environment) is not a whole number of "
                                         "threads from 1 to 64; set it to e.g. 4, unset it, or pass --dump-writers"),
        ({"EAGLE3_DUMP_GIL_SWITCH_MS": "0"}, "EAGLE3_DUMP_GIL_SWITCH_MS='0' (from the environment) is not a number of "
                                             "milliseconds above 0, at most 100; set it to e.g. 1, unset it, or pass "
                                             "--dump-gil-switch-ms"),
    ]
    for env, needle in env_cases:
        for where in (["--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout],
                      ["--cpu-demo", tmp_path / "demo"]):
            r = run_tool("serve", *where, "--print", env=env)
            assert r.returncode == 2, (env, r.stderr)
            assert needle in one_line_error(r), (env, r.stderr)
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print",
                 "--drain-s", "5", env={"EAGLE3_DUMP_DRAIN_S": "inf"})
    assert r.returncode == 0 and split_shell(r.stdout.strip())[0]["EAGLE3_DUMP_DRAIN_S"] == "5", r.stderr
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
        r = run_tool("serve", "--cpu-demo", demo, "--sglang", patched_checkout, "--print",
                     env={"PYTHONPATH": os.pathsep.join([str(REPO / "src"), "/elsewhere"])})
        assert r.returncode == 0, r.stderr
    env, argv = split_shell(r.stdout.strip())
    tree = demo / "sglang-tree"
    # the caller's path after the tree and the stubs (a package installed beside the environment stays importable)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tree), str(STUBS), str(REPO / "src"), "/elsewhere"]
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


def test_dump_settings_from_flags_or_the_users_environment(patched_checkout, tmp_path):
    """EAGLE3_DUMP_MAX_PENDING_MB, _FINAL, _DRAIN_S and _MAX_WAIT_S: the user's own values are
    passed on (not dropped), a flag wins over them, the drain is always passed (its default when
    neither says), and one line says which value is used and where it came from."""
    base = ["--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print"]
    user = {"EAGLE3_DUMP_MAX_PENDING_MB": "8192", "EAGLE3_DUMP_FINAL": "0", "EAGLE3_DUMP_MAX_WAIT_S": "60",
            "EAGLE3_DUMP_SOMETHING_ELSE": "x"}
    r = run_tool("serve", *base, env=user)
    assert r.returncode == 0, r.stderr
    env = split_shell(r.stdout.strip())[0]
    assert {k: v for k, v in env.items() if k.startswith("EAGLE3_DUMP_")} == {
        "EAGLE3_DUMP_DIR": str(tmp_path / "d"), "EAGLE3_DUMP_MAX_PENDING_MB": "8192", "EAGLE3_DUMP_FINAL": "0",
        "EAGLE3_DUMP_DRAIN_S": "20", "EAGLE3_DUMP_MAX_WAIT_S": "60"}
    assert ("[serve] dump settings: EAGLE3_DUMP_MAX_PENDING_MB=8192 (from the environment), EAGLE3_DUMP_FINAL=0 "
            "(from the environment), EAGLE3_DUMP_DRAIN_S=20 (default), EAGLE3_DUMP_MAX_WAIT_S=60 (from the "
            "environment), EAGLE3_DUMP_DTYPE=bf16 (default), EAGLE3_DUMP_REBUILDABLE=store (default), "
            "EAGLE3_DUMP_WRITERS=auto (default), EAGLE3_DUMP_SINK=file (default)"
            ) in r.stderr.splitlines(), r.stderr
    r = run_tool("serve", *base, "--max-pending-mb", "1024", "--final", "1", "--drain-s", "45", "--max-wait-s", "7.5",
                 "--dump-dtype", "FP8", "--rebuildable", "omit", "--dump-writers", "3", "--dump-gil-switch-ms", "0.5",
                 env=dict(user, EAGLE3_DUMP_DRAIN_S="3"))
    assert r.returncode == 0, r.stderr
    env = split_shell(r.stdout.strip())[0]
    assert (env["EAGLE3_DUMP_MAX_PENDING_MB"], env["EAGLE3_DUMP_FINAL"], env["EAGLE3_DUMP_DRAIN_S"],
            env["EAGLE3_DUMP_MAX_WAIT_S"], env["EAGLE3_DUMP_DTYPE"], env["EAGLE3_DUMP_REBUILDABLE"],
            env["EAGLE3_DUMP_WRITERS"], env["EAGLE3_DUMP_GIL_SWITCH_MS"]) == ("1024", "1", "45", "7.5", "fp8", "omit", "3",
                                                                               "0.5")
    assert ("[serve] dump settings: EAGLE3_DUMP_MAX_PENDING_MB=1024 (--max-pending-mb), EAGLE3_DUMP_FINAL=1 "
            "(--final), EAGLE3_DUMP_DRAIN_S=45 (--drain-s), EAGLE3_DUMP_MAX_WAIT_S=7.5 (--max-wait-s), "
            "EAGLE3_DUMP_DTYPE=fp8 (--dump-dtype), EAGLE3_DUMP_REBUILDABLE=omit (--rebuildable), "
            "EAGLE3_DUMP_WRITERS=3 (--dump-writers), EAGLE3_DUMP_GIL_SWITCH_MS=0.5 (--dump-gil-switch-ms), "
            "EAGLE3_DUMP_SINK=file (default)") in r.stderr.splitlines(), r.stderr
    r = run_tool("serve", *base, "--sink", "mooncake", "--mooncake-master", "10.0.0.5:50051", "--mooncake-metadata",
                 "http://10.0.0.5:8080/metadata", "--mooncake-protocol", "rdma", "--mooncake-device", "mlx5_0",
                 "--mooncake-host", "10.0.0.7", "--mooncake-segment-mb", "8192", "--mooncake-buffer-mb", "1024",
                 env=user)
    assert r.returncode == 0, r.stderr
    env = split_shell(r.stdout.strip())[0]
    assert {k: v for k, v in env.items() if k.startswith(("EAGLE3_DUMP_SINK", "EAGLE3_DUMP_MOONCAKE_"))} == {
        "EAGLE3_DUMP_SINK": "mooncake", "EAGLE3_DUMP_MOONCAKE_MASTER": "10.0.0.5:50051",
        "EAGLE3_DUMP_MOONCAKE_METADATA": "http://10.0.0.5:8080/metadata", "EAGLE3_DUMP_MOONCAKE_PROTOCOL": "rdma",
        "EAGLE3_DUMP_MOONCAKE_DEVICE": "mlx5_0", "EAGLE3_DUMP_MOONCAKE_HOST": "10.0.0.7",
        "EAGLE3_DUMP_MOONCAKE_SEGMENT_MB": "8192", "EAGLE3_DUMP_MOONCAKE_BUFFER_MB": "1024"}


# A stand-in for launch_server, started by tools/serve.py through a stand-in interpreter (--python):
# it records the EAGLE3_DUMP_* variables it got, answers /health on --host/--port (IPv6 too), and
# starts a "writer" in its process group that, on SIGTERM, drains for EAGLE3_DUMP_DRAIN_S seconds
# (as the dump writer does), then leaves a marker. FAKE_MODE=wait: the server waits for its writer
# before it exits; orphan: it exits at once and the writer outlives it.
FAKE_SERVER = r"""
import http.server, json, os, signal, socket, subprocess, sys, time
state = os.environ["FAKE_STATE"]
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
with open(os.path.join(state, "env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith("EAGLE3_DUMP_")}, f)
import tempfile
# what sglang 0.5.9's PortArgs leaves in its temp dir: files of NamedTemporaryFile(delete=False), ZMQ IPC
# sockets bound there
ipc = socket.socket(socket.AF_UNIX)
ipc.bind(tempfile.NamedTemporaryFile(delete=False).name + ".ipc")
with open(os.path.join(state, "launch.json"), "w") as f:
    json.dump({"argv": args, "tmpdir": tempfile.gettempdir(), "left": sorted(os.listdir(tempfile.gettempdir())),
               "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}, f)
WRITER = '''
import os, signal, sys, time
state, drain = sys.argv[1], float(os.environ["EAGLE3_DUMP_DRAIN_S"])
def mark(name):
    open(os.path.join(state, name), "w").close()
def on_term(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark("writer-sigterm")
    time.sleep(drain)
    mark("drained")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, lambda *_: mark("writer-sigint"))
mark("writer-up")
while True:
    time.sleep(1)
'''
writer = subprocess.Popen([sys.executable, "-c", WRITER, state])
while not os.path.exists(os.path.join(state, "writer-up")):
    time.sleep(0.05)
def on_term(*_):
    if os.environ["FAKE_MODE"] == "wait":
        writer.wait()
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, lambda *_: open(os.path.join(state, "server-sigint"), "w").close())
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
class S(http.server.HTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
S((host, port), H).serve_forever()
"""


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve_and_stop(patched_checkout, tmp_path, host: str, mode: str, extra=(), env=None):
    """tools/serve.py on the stand-in server: wait for "ready", Ctrl-C (SIGINT) it; (exit status,
    its stderr, seconds from the Ctrl-C to its exit, the stand-in's state directory, the port)."""
    import signal
    import time

    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    py = tmp_path / "python"
    real, fake = shlex.quote(sys.executable), shlex.quote(str(tmp_path / "fake_server.py"))
    py.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = sglang.launch_server ]; then\n'
                  f'  shift 2; exec {real} {fake} "$@"\nfi\nexec {real} "$@"\n')
    py.chmod(0o755)
    port = _free_port(host)
    err = tmp_path / "serve.err"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "serve.py"), "--model-path", "m", "--dump-dir",
                                 str(tmp_path / "dumps"), "--sglang", str(patched_checkout), "--python", str(py),
                                 "--host", host, "--port", str(port), *extra], stdout=f, stderr=f, cwd=REPO,
                                env=dict(os.environ, FAKE_STATE=str(state), FAKE_MODE=mode, **(env or {})))
    try:
        deadline = time.monotonic() + 120
        while "[serve] ready at" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        return rc, err.read_text(), time.monotonic() - t0, state, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode,drain", [("wait", "16"), ("orphan", "12")])
def test_stop_waits_for_the_dump_to_drain(patched_checkout, tmp_path, mode, drain):
    """Ctrl-C: serve.py sends SIGTERM (the signal the dump writer drains on, not SIGINT) to the
    server's process group, says it waits up to the drain (the EAGLE3_DUMP_DRAIN_S it passed) plus
    30 s, and does not kill the writer while it drains: neither while launch_server waits for it
    ("wait": past the 15 s serve.py used to give) nor after launch_server has exited ("orphan": past
    the 10 s it used to give what was left)."""
    rc, err, took, state, _ = _serve_and_stop(patched_checkout, tmp_path, "127.0.0.1", mode, ["--drain-s", drain])
    assert rc == 0, err
    grace = float(drain) + 30
    assert f"[serve] stopping: waiting up to {grace:g} s for the dump to drain" in err.splitlines(), err
    assert (state / "writer-sigterm").exists() and (state / "drained").exists(), (sorted(os.listdir(state)), err)
    assert not (state / "writer-sigint").exists() and not (state / "server-sigint").exists()
    assert float(drain) <= took < grace, took
    assert json.loads((state / "env.json").read_text())["EAGLE3_DUMP_DRAIN_S"] == drain
    assert "[serve] server stopped" in err


def test_ipv6_host(patched_checkout, tmp_path):
    """--host ::1: the server listens there, serve.py reaches it at http://[::1]:PORT (says so when
    it answers) and stops it; the user's EAGLE3_DUMP_* settings reach the server."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    rc, err, _, state, port = _serve_and_stop(patched_checkout, tmp_path, "::1", "orphan", ["--drain-s", "0.2"],
                                              env={"EAGLE3_DUMP_MAX_PENDING_MB": "512", "EAGLE3_DUMP_FINAL": "0"})
    assert rc == 0, err
    assert f"[serve] ready at http://[::1]:{port} " in err, err
    got = json.loads((state / "env.json").read_text())
    assert (got["EAGLE3_DUMP_MAX_PENDING_MB"], got["EAGLE3_DUMP_FINAL"], got["EAGLE3_DUMP_DRAIN_S"]) == \
        ("512", "0", "0.2")
    # the taken-port check looks at the IPv6 address: a listener on ::1 is seen, a free port is free
    from eaglepatch import serve

    with socket.socket(socket.AF_INET6) as lst:
        lst.bind(("::1", 0))
        lst.listen(1)
        assert serve.port_taken("::1", lst.getsockname()[1])
    assert serve.port_taken("::1", _free_port("::1")) is None
    # --print: launch_server gets the bare address ([::1] is taken as ::1)
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print",
                 "--host", "[::1]")
    assert r.returncode == 0, r.stderr
    argv = split_shell(r.stdout.strip())[1]
    assert argv[argv.index("--host") + 1] == "::1"


def test_stop_kills_what_outlives_the_drain_and_margin(tmp_path, monkeypatch):
    """A server that ignores SIGTERM is killed (with its group) once the drain (EAGLE3_DUMP_DRAIN_S
    as passed) plus the margin have passed, not before (the margin made short here)."""
    import signal
    import threading
    import time

    from eaglepatch import serve

    monkeypatch.setattr(serve, "STOP_MARGIN_S", 1.0)
    up = tmp_path / "up"
    script = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")
    plan = serve.Plan(argv=[sys.executable, "-c", script, str(up)], env={"EAGLE3_DUMP_DRAIN_S": "0.5"},
                      url=f"http://127.0.0.1:{_free_port('127.0.0.1')}")
    original = signal.getsignal(signal.SIGTERM)
    asked = []

    def stop():
        while not (up.exists() and up.read_text() and signal.getsignal(signal.SIGTERM) is not original):
            time.sleep(0.05)
        asked.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()
    said = []
    rc = serve.run(plan, say=said.append)
    took = time.monotonic() - asked[0]
    assert rc == 0 and said[-2:] == ["[serve] stopping: waiting up to 1.5 s for the dump to drain",
                                     "[serve] server stopped"], said
    assert 1.5 <= took < 10, took
    with pytest.raises(ProcessLookupError):
        os.kill(int(up.read_text()), 0)
    assert signal.getsignal(signal.SIGTERM) is original


# ---- issue 43 items 16 and 17: the ready line said once, --quiet, the launch's temp dir, hostile flags -------

def test_a_launch_leaves_nothing_in_the_temp_dir_and_says_ready_once(patched_checkout, tmp_path):
    """The server gets a temp dir of its own (TMPDIR), in the user's, where SGLang's IPC sockets and
    files go; serve.py removes it at the stop (was: they stayed in the user's temp dir, one set per
    launch). Torch's compile cache keeps its place in the user's temp dir. "[serve] ready" is said
    once, when the server answers (was: also in the start banner, so a log watcher saw it first)."""
    import tempfile

    rc, err, _, state, port = _serve_and_stop(patched_checkout, tmp_path, "127.0.0.1", "orphan", ["--drain-s", "0.2"])
    assert rc == 0, err
    launch = json.loads((state / "launch.json").read_text())
    tmp = Path(launch["tmpdir"])
    assert tmp.parent == Path(tempfile.gettempdir()) and tmp.name.startswith("eaglepatch-serve-"), launch
    assert len(launch["left"]) == 2 and not tmp.exists(), launch  # the file and the socket, gone with the dir
    user = os.path.join(tempfile.gettempdir(), "torchinductor_" + __import__("getpass").getuser())
    assert launch["inductor"] == os.environ.get("TORCHINDUCTOR_CACHE_DIR", user), launch  # not under the launch's
    ready = [ln for ln in err.splitlines() if "[serve] ready" in ln]
    assert len(ready) == 1 and ready[0].startswith(f"[serve] ready at http://127.0.0.1:{port} "), err


def test_quiet(patched_checkout, tmp_path):
    """--quiet: launch_server gets --log-level warning (no line per batch or request; its HTTP log
    follows it), and serve.py says only the ready line, warnings and the stop; a --log-level after
    -- with --quiet is one line, exit 2."""
    rc, err, _, state, port = _serve_and_stop(patched_checkout, tmp_path, "127.0.0.1", "orphan",
                                              ["--drain-s", "0.2", "--quiet"])
    assert rc == 0, err
    argv = json.loads((state / "launch.json").read_text())["argv"]
    assert argv[argv.index("--log-level") + 1] == "warning", argv
    said = [ln for ln in err.splitlines() if ln.strip()]
    assert said[-3].startswith(f"[serve] ready at http://127.0.0.1:{port} ") and said[-2:] == [
        "[serve] stopping: waiting up to 30.2 s for the dump to drain", "[serve] server stopped"], err
    assert all(ln.startswith("warning: ") for ln in said[:-3]), err
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--quiet",
                 "--print", "--", "--log-level", "debug")
    assert r.returncode == 2 and "--quiet sets launch_server's --log-level warning" in one_line_error(r), r.stderr


def test_a_dump_dir_whose_name_holds_the_separator_is_refused(patched_checkout, tmp_path):
    """--dump-dir naming an existing directory 'a:b' (or a path under one): ':' separates dump
    directories, here and in the server, so serve.py refuses it in one line naming the rename or the
    symbolic link, exit 2, before anything is created (was: split into a and b, both created at the
    start). A list of absolute directories is still a list."""
    (tmp_path / "a:b").mkdir()
    (tmp_path / "x:y").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    for value in ("a:b", str(tmp_path / "a:b"), str(tmp_path / "x:y" / "dumps")):
        for mode in (["--model-path", "m", "--sglang", patched_checkout], ["--cpu-demo", tmp_path / "demo"]):
            r = run_tool("serve", *mode, "--dump-dir", value, "--print", cwd=tmp_path)
            err = one_line_error(r)
            assert r.returncode == 2 and "':' separates dump directories" in err, (value, mode, r.stderr)
            assert "rename it, or pass a symbolic link to it" in err and "ln -s " in err, err
            assert sorted(p.name for p in tmp_path.iterdir()) == before, (value, list(tmp_path.iterdir()))
    r = run_tool("serve", "--model-path", "m", "--sglang", patched_checkout, "--dump-dir",
                 f"{tmp_path / 'd0'}:{tmp_path / 'd1'}", "--print", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert split_shell(r.stdout.strip())[0]["EAGLE3_DUMP_DIR"] == f"{tmp_path / 'd0'}:{tmp_path / 'd1'}"


@pytest.mark.parametrize("host,says", [("no-such-host.invalid", "names no address this machine can resolve"),
                                       ("192.0.2.1", "is no address of this machine")])
def test_a_host_that_is_not_here_is_no_taken_port(patched_checkout, tmp_path, host, says):
    """--host naming nothing (a name that does not resolve) or another machine's address: one line
    saying so, exit 2, before anything is made (was: "port 30000 ... is taken", exit 1)."""
    before = sorted(tmp_path.iterdir())
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout,
                 "--host", host, cwd=tmp_path)
    err = one_line_error(r)
    assert r.returncode == 2 and says in err and "taken" not in err and "--host" in err, r.stderr
    assert sorted(tmp_path.iterdir()) == before


def _draft(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_draft_config_dumps_what_the_draft_reads(patched_checkout, tmp_path):
    """--draft-config: a DFlash draft's ids (Kimi-K2.7's layout) go to the server with the DFlash reading
    (EAGLE3_DUMP_READING=dflash: id k = the output of layer k on every release), an EAGLE-3 draft's with the
    release's EAGLE-3 reading; a DSpark draft without its ids gets sglang's default for this target's layers;
    --layers with --draft-config, a DSpark draft with --final 0 and a speculators draft are refused in one line."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                   "text_config": {"num_hidden_layers": 61}}))
    base = ["--model-path", model, "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print"]
    k27 = _draft(tmp_path / "k27", {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 6,
                                    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "block_size": 8,
                                                      "mask_token_id": 163838}})
    r = run_tool("serve", *base, "--draft-config", k27)
    assert r.returncode == 0, r.stderr
    env = split_shell(r.stdout.strip())[0]
    assert env["EAGLE3_DUMP_LAYERS"] == "1,12,24,35,47,58" and env["EAGLE3_DUMP_READING"] == "dflash", env
    eagle = _draft(tmp_path / "eagle", {"architectures": ["LlamaForCausalLMEagle3"],
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}})
    r = run_tool("serve", *base, "--draft-config", eagle)
    env = split_shell(r.stdout.strip())[0]
    assert env["EAGLE3_DUMP_LAYERS"] == "2,30,58" and "EAGLE3_DUMP_READING" not in env, (r.stdout, r.stderr)
    dspark = _draft(tmp_path / "dspark", {"architectures": ["DSparkDraftModel"], "num_hidden_layers": 3,
                                          "dflash_config": {"block_size": 7}, "dspark_config": {"markov_rank": 1}})
    r = run_tool("serve", *base, "--draft-config", dspark)
    env = split_shell(r.stdout.strip())[0]
    from eaglepatch import conventions

    assert env["EAGLE3_DUMP_LAYERS"] == ",".join(map(str, conventions.build_target_layer_ids(61, 3))), r.stdout
    assert env["EAGLE3_DUMP_READING"] == "dspark" and "build_target_layer_ids" in r.stderr, r.stderr
    for args, needle in ((["--draft-config", k27, "--layers=1,2"], "both name the layers"),
                         (["--draft-config", dspark, "--final", "0"], "post-norm final state"),
                         (["--draft-config", tmp_path / "absent"], "does not exist")):
        r = run_tool("serve", *base, *args)
        assert r.returncode == 2 and needle in one_line_error(r), (args, r.stderr)
