"""tools/serve.py with the Mooncake sink (issue 43, item 13): the store's package is looked for in the
server's own environment before the server starts (it was found after the weights loaded: a
traceback, exit 137); serve.py says where the package and mooncake_master come from, prints the
master command binding what the settings name, says what Mooncake binds on every address whatever
it is told, and its next steps read the store, not dump files (the CPU demo printed the file sink's
extract commands). The printed reading command itself runs in tests/test_mooncake.py against a real
master."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path


from conftest import REPO, one_line_error, run_tool
from test_serve import patched_checkout  # noqa: F401  (a fixture)

MASTER = ["--sink", "mooncake", "--mooncake-master", "127.0.0.1:50051", "--mooncake-metadata",
          "http://127.0.0.1:8080/metadata"]
READER = 'StoreReader("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")'
MASTER_CMD = ("mooncake_master --rpc_address=127.0.0.1 --port=50051 --metrics_host=127.0.0.1 "
              "--enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 --http_metadata_server_port=8080")


def mooncake_site() -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from eaglepatch import mooncake

    return mooncake.ensure_site(Path(sys.executable))


def _says_where_and_what_it_binds(err: str) -> None:
    lines = err.splitlines()
    note = next((x for x in lines if x.startswith("[serve] Mooncake sink: ")), None)
    assert note is not None, err
    for needle in (f"Start the master first ({MASTER_CMD})", "pip install mooncake-transfer-engine (CUDA 12)",
                   "mooncake-transfer-engine-non-cuda (no GPU)", "holds mooncake_master", "libibverbs1"):
        assert needle in note, (needle, note)
    assert any(x.startswith("warning: Mooncake listens on every address whatever it is told") and
               "mooncake_master's HTTP metadata server binds 0.0.0.0 despite --http_metadata_server_host" in x
               for x in lines), err


def test_production_says_where_mooncake_comes_from_and_reads_the_store_next(patched_checkout, tmp_path):  # noqa: F811
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout,
                 *MASTER, "--print")
    assert r.returncode == 0, r.stderr
    _says_where_and_what_it_binds(r.stderr)
    assert "eaglepatch.mooncake import StoreReader" in r.stderr and READER in r.stderr
    ex = [x for x in r.stderr.splitlines() if "extract.py" in x and not x.strip().startswith("#")]
    assert len(ex) == 1, r.stderr
    words = shlex.split(ex[0])
    assert words[words.index("--mooncake-master") + 1] == MASTER[3] and words[words.index("--model") + 1] == "m"
    assert "--dump-dir" not in words and words[words.index("--data") + 1] == "CONVERSATIONS.jsonl", words
    # the file sink says none of it
    r = run_tool("serve", "--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--print")
    assert r.returncode == 0 and "Mooncake" not in r.stderr, r.stderr


def test_the_cpu_demo_with_the_mooncake_sink_prints_how_to_read_the_store(tmp_path):
    """--cpu-demo --sink mooncake: the next commands read the store: one answer's object, then the
    demo's conversations into a dataset with tools/extract.py reading the same master and metadata
    server; the file sink's commands (extract from dump files, load, guard) are not printed."""
    demo = tmp_path / "demo"
    r = run_tool("serve", "--cpu-demo", demo, *MASTER, "--print")
    assert r.returncode == 0, r.stderr[-3000:]
    _says_where_and_what_it_binds(r.stderr)
    after = r.stderr.split("[serve] next, from another shell in", 1)[1].splitlines()[1:]
    assert after and all(x.startswith("  ") for x in after), r.stderr[-3000:]
    assert any(READER in x for x in after), after
    cmds = [x.strip() for x in after if not x.startswith("  #")]
    ex = [x for x in cmds if "extract.py" in x]
    assert len(ex) == 1 and not any("guard.py" in x or "--dump-dir" in x for x in cmds), after
    words = shlex.split(ex[0])
    assert words[words.index("--mooncake-master") + 1] == MASTER[3], words
    assert words[words.index("--mooncake-metadata") + 1] == MASTER[5], words
    assert words[words.index("--data") + 1] == str(demo / "conversations.jsonl"), words


def test_a_server_python_without_the_package_is_refused_before_the_server_starts(patched_checkout,  # noqa: F811
                                                                                 tmp_path):
    """The server's interpreter (--python) cannot import mooncake: one line, exit 2, no server
    started. With the package on its PYTHONPATH the server is started (a stand-in that only says so)."""
    started = tmp_path / "started"
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = sglang.launch_server ]; then\n'
                  f'  touch {shlex.quote(str(started))}; exit 1\nfi\nexec {shlex.quote(sys.executable)} "$@"\n')
    py.chmod(0o755)
    args = ["--model-path", "m", "--dump-dir", tmp_path / "d", "--sglang", patched_checkout, "--python", py, *MASTER,
            "--port", "30999"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(REPO / "tools" / "serve.py"), *map(str, args)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=300)
    line = one_line_error(r)
    assert r.returncode == 2 and "--sink mooncake but" in line and "cannot import the mooncake package the sink " \
                                                                    "needs (ModuleNotFoundError: No module named " \
                                                                    "'mooncake')" in line, line
    assert "pip install mooncake-transfer-engine (CUDA 12)" in line and not started.exists()
    r = subprocess.run([sys.executable, str(REPO / "tools" / "serve.py"), *map(str, args)], capture_output=True,
                       text=True, env=dict(env, PYTHONPATH=str(mooncake_site())), cwd=REPO, timeout=300)
    assert started.exists(), r.stderr[-3000:]
    assert "cannot import the mooncake package" not in r.stderr
