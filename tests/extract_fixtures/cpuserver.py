"""Patched sglang HTTP servers on CPU with the dump on, and SGLang's router in front of them, on
localhost: what the extract tests and ``benchmarks/replicas.py`` extract from.

``start_server`` runs ``python -m sglang.launch_server`` (the tree under test first on PYTHONPATH,
the import stubs after it, the CPU flags of ``tools/serve.py --cpu-demo``: ``eaglepatch.serve.cpu_flags``)
in its own process group and returns once ``/health_generate`` answers;
``Router`` runs ``python -m sglang_router.launch_router`` (the ``sglang-router`` pinned in
cpu-requirements.txt), round robin over the workers, ready once it lists all of them. ``stop``
ends a process group (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from eaglepatch.serve import cpu_flags

START_TIMEOUT = 300
STUBS = Path(__file__).resolve().parents[2] / "src" / "eaglepatch" / "smoke" / "stubs"


class NotReady(RuntimeError):
    """A server or router that exited or did not answer in time (the message holds its log's tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """End a process group started with start_new_session (SIGKILL when ``sig`` is not enough)."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=20)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, what: str, ready, timeout: float = START_TIMEOUT) -> float:
    """Poll ``ready(url)`` until it holds; returns the seconds it took. Stops the process and raises
    NotReady with the log's tail when it exits or is not ready within ``timeout``."""
    import requests

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise NotReady("%s exited (%s):\n%s" % (what, proc.returncode, log.read_text()[-3000:]))
        if time.monotonic() - t0 > timeout:
            stop(proc)
            raise NotReady("%s not ready after %d s:\n%s" % (what, timeout, log.read_text()[-3000:]))
        try:
            if ready(url):
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(0.5)


def start_server(pp: Path, ckpt: Path, tok: Path, dump_dir: Path, layers, log: Path,
                 threads: int | None = None) -> SimpleNamespace:
    """The sglang tree at ``pp`` serving ``ckpt`` on CPU with EAGLE3_DUMP_DIR=``dump_dir`` and
    EAGLE3_DUMP_LAYERS=``layers``. ``--sleep-on-idle``: an idle scheduler waits on its sockets
    instead of spinning a core (two of them would take both cores of a 2-core machine).
    (``tools/serve.py --cpu-demo`` starts the same server on its demo directory.)
    ``threads``: OMP_NUM_THREADS of the server (torch's intra-op threads; default: every core)."""
    import requests

    port = free_port()
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", EAGLE3_DUMP_DIR=str(dump_dir), PYTHONUNBUFFERED="1",
               EAGLE3_DUMP_LAYERS=",".join(map(str, layers)), PYTHONPATH=os.pathsep.join([str(pp), str(STUBS)]))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "sglang.launch_server", *cpu_flags(ckpt, tok, "127.0.0.1", port)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wall = wait_ready(proc, url, log, f"sglang server ({log.name})",
                      lambda u: requests.get(u + "/health_generate", timeout=30).status_code == 200)
    return SimpleNamespace(url=url, port=port, proc=proc, log=log, start_s=round(wall, 1))


def answered_after_start(log: Path) -> int:
    """/generate requests a server answered after its own warm-up request (from its log, written
    unbuffered)."""
    return log.read_text().partition("The server is fired up")[2].count('"POST /generate HTTP/1.1" 200')


class Router:
    """SGLang's router on localhost, round robin over ``workers`` (a context manager)."""

    def __init__(self, workers: list, log: Path):
        self.workers, self.log = list(workers), log
        self.url = f"http://127.0.0.1:{free_port()}"
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", self.url.rsplit(":", 1)[1], "--policy", "round_robin", "--log-level", "warn",
                    "--worker-urls", *self.workers]
        self.start_s = None

    def __enter__(self):
        import requests

        def ready(u):
            r = requests.get(u + "/workers", timeout=10)
            return (r.status_code == 200 and len(r.json().get("workers", [])) == len(self.workers)
                    and requests.get(u + "/get_model_info", timeout=10).status_code == 200)

        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.start_s = round(wait_ready(self.proc, self.url, self.log, "sglang router", ready), 1)
        return self

    def __exit__(self, *exc):
        stop(self.proc)
