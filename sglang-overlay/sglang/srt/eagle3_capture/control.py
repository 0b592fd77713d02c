"""The launching process talks to the dump writer: flush, and no dump during SGLang's warm-up.

The writer runs in the scheduler process of TP rank 0; the launching process (``launch_server``
or ``sglang.Engine``) is its ancestor on the same node. ``check_launch`` (in the launching process,
before any worker starts) picks a Unix socket path and exports it as ``EAGLE3_DUMP_CONTROL``; the
workers inherit it and the writer listens there (``ControlServer``). One JSON line per call:

- ``{"op": "flush", "timeout": s}``: answered once every forward submitted before the call is
  written (each file fsynced) or counted as failed: ``{"flushed": true, "written": n, ...}``;
- ``{"op": "pause"}`` / ``{"op": "resume"}``: while paused, prefills are not dumped (counted as
  ``warmup``). The HTTP server pauses the dump from its start until SGLang's own warm-up request
  has been answered, so the directory holds only the users' requests.

``install_launcher_hooks`` adds, in the launching process: ``Engine.flush_eagle3_dump(timeout)``
and a flush in ``Engine.shutdown`` (which SIGKILLs the scheduler), a flush before the tokenizer
manager kills the process tree (a server's SIGTERM: requests drained, then SIGKILL), and, when
the HTTP server is in use, ``POST /eagle3_dump/flush``, the warm-up pause, and a flush when
uvicorn stops. What
this relies on in upstream code is listed in ``UPSTREAM``; a release where any of it is missing
refuses the dump at launch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import uuid
from typing import Optional

logger = logging.getLogger(__name__)

ENV_CONTROL = "EAGLE3_DUMP_CONTROL"
FLUSH_ROUTE = "/eagle3_dump/flush"
DEFAULT_FLUSH_TIMEOUT = 600.0

# What the hooks outside the series' hunks rely on in upstream code, the same in every covered
# release (tests/test_release_facts.py checks each release's source; install_launcher_hooks and
# identity.install refuse the dump where one is missing): module -> names.
UPSTREAM = {
    "sglang.srt.entrypoints.engine": ("Engine.shutdown",),
    # lifespan starts the warm-up thread with the module global _wait_and_warmup
    "sglang.srt.entrypoints.http_server": ("app", "lifespan", "_wait_and_warmup"),
    "sglang.srt.model_executor.forward_batch_info": ("ForwardBatch.init_new",),
    # a server's SIGTERM drains the requests, then kills the process tree through this name
    "sglang.srt.managers.tokenizer_manager": ("kill_process_tree",),
}
SERVER_ARGS = ("tokenizer_worker_num",)  # ServerArgs fields read here (0.5.23: in arg_groups/fields)


class FlushError(RuntimeError):
    """The writer did not answer (not started, gone, or slower than the timeout)."""


# ---- writer side (scheduler process of TP rank 0) ----------------------------------------------

class ControlServer:
    def __init__(self, writer, path: str):
        self.writer = writer
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._serve, name="eagle3-dump-control", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        with conn:
            try:
                request = json.loads(_read_line(conn))
                op = request.get("op")
                if op == "flush":
                    reply = self.writer.flush_report(float(request.get("timeout") or DEFAULT_FLUSH_TIMEOUT))
                elif op in ("pause", "resume"):
                    self.writer.paused = op == "pause"
                    reply = {"ok": True, "paused": self.writer.paused}
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}"}
            except Exception as exc:  # one bad call must not stop the control thread
                reply = {"ok": False, "flushed": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall((json.dumps(reply) + "\n").encode())
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _read_line(conn) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def start_server(writer) -> Optional[ControlServer]:
    path = os.environ.get(ENV_CONTROL)
    if not path:
        logger.warning("%s is not set (the launching process did not run the series' launch "
                       "check): the dump cannot be flushed from outside", ENV_CONTROL)
        return None
    return ControlServer(writer, path)


# ---- launching process ----------------------------------------------------------------------

def new_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"eagle3-dump-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")


def call(op: str, timeout: Optional[float] = None, path: Optional[str] = None) -> dict:
    """Send one call to the writer and return its answer; FlushError when it cannot."""
    path = path or os.environ.get(ENV_CONTROL)
    if not path:
        raise FlushError("the dump is not on in this process (EAGLE3_DUMP_DIR was not set when the "
                         "server or Engine started)")
    wait = DEFAULT_FLUSH_TIMEOUT if timeout is None else float(timeout)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(wait + 5.0)
            s.connect(path)
            s.sendall((json.dumps({"op": op, "timeout": wait}) + "\n").encode())
            line = _read_line(s)
    except (OSError, socket.timeout) as exc:
        raise FlushError(f"the dump writer did not answer at {path} ({exc})") from None
    if not line:
        raise FlushError(f"the dump writer closed {path} without an answer")
    reply = json.loads(line)
    if op == "flush" and not reply.get("flushed"):
        raise FlushError(reply.get("error") or "the dump writer did not flush")
    return reply


def flush(timeout: Optional[float] = None) -> dict:
    """Block until every request prefilled so far is on disk; the writer's counts."""
    return call("flush", timeout)


def _flush_quietly(why: str) -> None:
    path = os.environ.get(ENV_CONTROL)
    if path and not os.path.exists(path):  # Ctrl-C reaches the scheduler too: it drained and left
        logger.warning("eagle3 dump: the writer had stopped before %s (a scheduler that exits writes "
                       "its queue first; one that is killed does not)", why)
        return
    try:
        reply = flush()
        logger.info("eagle3 dump flushed before %s: %s", why, reply)
    except FlushError as exc:
        logger.error("eagle3 dump: flush before %s failed: %s", why, exc)


def _engine_hooks(engine_cls) -> None:
    if getattr(engine_cls, "_eagle3_hooks", False):
        return
    shutdown = engine_cls.shutdown

    def flush_eagle3_dump(self, timeout: Optional[float] = None) -> dict:
        """Block until every request this Engine has prefilled is in EAGLE3_DUMP_DIR (fsynced);
        returns the writer's counts (written, failed, dropped, skipped, warmup)."""
        return flush(timeout)

    def shutdown_after_flush(self, *args, **kwargs):
        if os.environ.get(ENV_CONTROL) and not getattr(self, "_eagle3_flushed", False):
            self._eagle3_flushed = True
            _flush_quietly("Engine.shutdown")
        return shutdown(self, *args, **kwargs)

    shutdown_after_flush.__doc__ = shutdown.__doc__
    engine_cls.flush_eagle3_dump = flush_eagle3_dump
    engine_cls.shutdown = shutdown_after_flush
    engine_cls._eagle3_hooks = True


def _kill_hooks(tokenizer_manager) -> None:
    """SGLang stops a server on SIGTERM by draining its requests and then killing its process
    tree (SIGKILL: the scheduler's queue would be lost): flush between the two."""
    kill = tokenizer_manager.kill_process_tree
    if getattr(kill, "_eagle3_hooks", False):
        return

    def kill_process_tree(*args, **kwargs):
        _flush_quietly("the server stopped")
        return kill(*args, **kwargs)

    kill_process_tree._eagle3_hooks = True
    tokenizer_manager.kill_process_tree = kill_process_tree


def _http_hooks(http_server) -> None:
    app = http_server.app
    if getattr(app, "_eagle3_hooks", False):
        return
    import asyncio
    from contextlib import asynccontextmanager

    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def flush_route(request: Request):
        try:
            body = await request.json()
        except ValueError:  # no body: the default timeout
            body = {}
        timeout = body.get("timeout") if isinstance(body, dict) else None
        try:
            reply = await asyncio.get_running_loop().run_in_executor(None, flush, timeout)
        except FlushError as exc:
            return JSONResponse({"flushed": False, "error": str(exc)}, status_code=503)
        return JSONResponse(reply)

    # the module's annotations are strings (postponed); FastAPI needs the class to inject the request
    flush_route.__annotations__ = {"request": Request}
    app.add_api_route(FLUSH_ROUTE, flush_route, methods=["POST"], include_in_schema=False)

    inner_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        try:  # no dump until SGLang's warm-up request is answered (see _wait_and_warmup below)
            call("pause", 30.0)
        except FlushError as exc:
            logger.error("eagle3 dump: could not pause for the warm-up: %s", exc)
        async with inner_lifespan(a) as state:
            yield state
        await asyncio.get_running_loop().run_in_executor(None, _flush_quietly, "the server stopped")

    app.router.lifespan_context = lifespan
    warmup = http_server._wait_and_warmup

    def wait_and_warmup(*args, **kwargs):
        try:
            return warmup(*args, **kwargs)
        finally:
            try:
                call("resume", 30.0)
            except FlushError as exc:
                logger.error("eagle3 dump: could not resume after the warm-up: %s", exc)

    http_server._wait_and_warmup = wait_and_warmup
    app._eagle3_hooks = True


def install_launcher_hooks(server_args) -> None:
    """In the launching process: pick the control socket (one per launch: the workers inherit
    it) and add the flush entry points."""
    import sys

    from .settings import ENV_DIR, DumpConfigError, resolved

    workers = resolved(server_args).tokenizer_worker_num
    if workers > 1:
        raise DumpConfigError(f"{ENV_DIR} is set but --tokenizer-worker-num {workers} serves HTTP from "
                              f"several processes, and the dump's flush lives in one; use --tokenizer-worker-num 1")
    os.environ[ENV_CONTROL] = new_path()
    from sglang.srt.entrypoints import engine
    from sglang.srt.managers import tokenizer_manager

    missing = [n for n in ("shutdown",) if not callable(getattr(engine.Engine, n, None))]
    missing += [n for n in ("kill_process_tree",) if not callable(getattr(tokenizer_manager, n, None))]
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is not None:
        missing += [n for n in ("app", "lifespan", "_wait_and_warmup") if not hasattr(http_server, n)]
    if missing:
        raise DumpConfigError(f"{ENV_DIR} is set but this sglang lacks {', '.join(missing)}, which the "
                              f"dump's flush needs; use a release the series covers or unset {ENV_DIR}")
    _engine_hooks(engine.Engine)
    _kill_hooks(tokenizer_manager)
    if http_server is not None:
        _http_hooks(http_server)
