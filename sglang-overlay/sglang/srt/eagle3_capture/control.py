"""The launching process talks to the dump writer: flush, state, stop, and no dump during SGLang's warm-up.

The writer runs in the scheduler process of TP rank 0; the launching process (``launch_server``
or ``sglang.Engine``) is its ancestor on the same node. ``check_launch`` (in the launching process,
before any worker starts) picks a control address, abstract on Linux (``@eagle3-dump-...``: no
file, no path-length limit), and exports it as ``EAGLE3_DUMP_CONTROL``, with a launch id as
``EAGLE3_DUMP_LAUNCH_ID`` and a secret of this launch as ``EAGLE3_DUMP_CONTROL_TOKEN``; the workers
inherit them and the writer listens there (``ControlServer``). A call is answered only when it
comes from the server's own user or root (SO_PEERCRED) AND carries the launch's secret: an
abstract socket is reachable from the whole network namespace (every container on a host network),
and the secret lives only in this launch's processes. One JSON line per call:

- ``{"op": "flush", "timeout": s}``: answered once every forward submitted before the call is
  written (each file fsynced) or counted as failed: ``{"flushed": true, "written": n, ...}``;
- ``{"op": "status", "rids": [...]}``: what became of each request's file (``DumpWriter.state``);
  an answer asks only for what the launch's state table (``states``) cannot give it whole;
- ``{"op": "pause"}`` / ``{"op": "resume"}``: while paused, prefills are not dumped (counted as
  ``warmup``). The HTTP server pauses the dump from its start until SGLang's own warm-up request
  has been answered, so the directory holds only the users' requests; a resume that fails is
  tried again, then reported at error level (and every answer's state says "not dumped").
- ``{"op": "stop", "why": ...}``: the writer stops (``stops``: no new request is dumped, what it
  was handed is written for at most ``EAGLE3_DUMP_DRAIN_S``, the ledger names the rest) and answers
  with the report. The launching process sends it the moment it gets SIGTERM itself (a container
  runtime signals PID 1 only: without it the scheduler would go on writing until the runtime's
  SIGKILL cuts the queue), and at the launch's end.

``install_launcher_hooks`` adds, in the launching process: ``Engine.flush_eagle3_dump(timeout)``;
a flush and a stop in ``Engine.shutdown`` (which SIGKILLs the scheduler) and at the process's exit
(a script that never calls shutdown: upstream's exit handler, registered before, runs after it); a
stop the moment the tokenizer manager's SIGTERM handler runs (``SignalHandler.sigterm_handler``),
and before it kills the process tree (each bounded by ``EAGLE3_DUMP_DRAIN_S``); on every finished answer ``meta_info["eagle3_dump"]`` (its file and its state), and a
refusal of ``n > 1``; and, when the HTTP server is in use, ``POST /eagle3_dump/flush`` (each on a
thread of its own), the warm-up pause, and a flush when uvicorn stops. A SIGTERM that reaches the
writing process itself is its own to drain (``DumpWriter.install_sigterm_drain``). What this
relies on in upstream code is listed in ``UPSTREAM``; a release where any of it is missing
refuses the dump at launch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import threading
import uuid
import weakref
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
    # ... and answers every request through TokenizerManager.generate_request (an async generator)
    "sglang.srt.managers.tokenizer_manager": ("kill_process_tree", "TokenizerManager.generate_request",
                                              "SignalHandler.sigterm_handler"),
}
# ServerArgs fields the series reads without a default (0.5.23: declared in arg_groups/fields)
SERVER_ARGS = ("tokenizer_worker_num", "dp_size", "nnodes")


MAX_FLUSH_TIMEOUT = 7 * 24 * 3600.0  # a week: any longer is a typo, and inf would never answer
ENV_TOKEN = "EAGLE3_DUMP_CONTROL_TOKEN"  # the launch's secret: a call without it is not answered
STOP_MARGIN_S = 5.0  # a stop call waits the drain and this much more for the answer
RESUME_TRIES = 12  # a resume after the warm-up is tried this often (backing off) before it is reported


class FlushError(RuntimeError):
    """The writer did not answer (not started, gone, or slower than the timeout)."""


class WriterGone(FlushError):
    """Nothing listens at the control address: the writer has exited (or never started)."""


def flush_timeout(value) -> float:
    """A flush call's ``timeout`` (None: the default) as seconds; ValueError naming the fix."""
    if value is None:
        return DEFAULT_FLUSH_TIMEOUT
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"timeout {value!r} is not a number of seconds; send e.g. {{\"timeout\": 60}}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"timeout {value!r} is not a number of seconds; send e.g. {{\"timeout\": 60}}") from None
    if not 0 < seconds <= MAX_FLUSH_TIMEOUT:  # nan fails too
        raise ValueError(f"timeout {value!r} must be a number of seconds in (0, {MAX_FLUSH_TIMEOUT:g}]; "
                         f"send e.g. {{\"timeout\": 60}}")
    return seconds


# The control socket lives in Linux's abstract namespace ("@name" in EAGLE3_DUMP_CONTROL): no file
# to leave behind, no path-length limit from a long TMPDIR; only the server's own user (or root) is
# answered (SO_PEERCRED).
def _address(path: str):
    return "\0" + path[1:] if path.startswith("@") else path


def _peer_allowed(conn) -> bool:
    import struct

    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _, uid, _ = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)


def _token_ok(request, token: str) -> bool:
    import hmac

    given = request.get("token") if isinstance(request, dict) else None
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())


# ---- writer side (scheduler process of TP rank 0) ----------------------------------------------

class ControlServer:
    def __init__(self, writer, path: str, token: str):
        self.writer = writer
        self.path = path
        self.token = token
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(_address(path))
        except OSError as exc:
            self.sock.close()
            raise RuntimeError(f"eagle3 dump: cannot listen at {path} ({exc}); another writer of this "
                               f"launch holds it (a data-parallel replica?)") from None
        self.sock.listen(128)  # flushes and status calls of every process that asks
        self.refused = 0  # calls without the launch's secret
        self.status_calls = 0  # answers' states asked for here (the state table gives the others)
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
            if not _peer_allowed(conn):
                return
            try:
                request = json.loads(_read_line(conn))
                if not _token_ok(request, self.token):
                    self.refused += 1
                    logger.warning("eagle3 dump: a control call without this launch's %s was refused", ENV_TOKEN)
                    reply = {"ok": False, "flushed": False, "error": f"refused: the call does not carry this "
                             f"launch's {ENV_TOKEN}"}
                    conn.sendall((json.dumps(reply) + "\n").encode())
                    return
                op = request.get("op")
                if op == "flush":
                    reply = dict(self.writer.flush_report(flush_timeout(request.get("timeout"))),
                                 status_calls=self.status_calls)
                elif op == "status":
                    self.status_calls += 1
                    rids = request.get("rids")
                    if not isinstance(rids, list):
                        raise ValueError("status needs a list of request ids")
                    reply = {"ok": True, "states": {str(r): self.writer.state(str(r)) for r in rids},
                             "handles": {str(r): self.writer.handle(str(r)) for r in rids}}
                elif op == "expect":  # SpecForge payloads of requests about to be sent (specforge)
                    requests = request.get("requests")
                    if not isinstance(requests, dict):
                        raise ValueError("expect needs an object of request id -> payload")
                    reply = {"ok": True, "refused": self.writer.expect(requests)}
                elif op == "captured":
                    rids = request.get("rids")
                    if not isinstance(rids, list):
                        raise ValueError("captured needs a list of request ids")
                    reply = {"ok": True, "results": self.writer.captured(rids, flush_timeout(request.get("timeout")))}
                elif op in ("pause", "resume"):
                    self.writer.paused = op == "pause"
                    reply = {"ok": True, "paused": self.writer.paused}
                elif op == "stop":
                    why = request.get("why")
                    reply = dict(self.writer.stopper.stop(why if isinstance(why, str) and why else "a stop call"),
                                 ok=True)
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}"}
            except Exception as exc:  # one bad call must not stop the control thread
                reply = {"ok": False, "flushed": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall((json.dumps(reply) + "\n").encode())
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening: the name is free again once this returns (an abstract name has no file
        to unlink; shutdown wakes the accepting thread, which holds the socket open till then)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)


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
    token = os.environ.get(ENV_TOKEN)
    if not path or not token:
        logger.warning("%s or %s is not set (the launching process did not run the series' launch "
                       "check): the dump cannot be flushed or stopped from outside", ENV_CONTROL, ENV_TOKEN)
        return None
    return ControlServer(writer, path, token)


# ---- launching process ----------------------------------------------------------------------

def new_path() -> str:
    """A control address for one launch: abstract (Linux), else a socket file in the temp dir."""
    name = f"eagle3-dump-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if sys.platform.startswith("linux"):
        return "@" + name
    return os.path.join(tempfile.gettempdir(), name + ".sock")


def call(op: str, timeout: Optional[float] = None, path: Optional[str] = None, token: Optional[str] = None,
         **fields) -> dict:
    """Send one call to the writer and return its answer; FlushError when it cannot."""
    path = path or os.environ.get(ENV_CONTROL)
    token = token or os.environ.get(ENV_TOKEN)
    if not path or not token:
        raise FlushError("the dump is not on in this process (EAGLE3_DUMP_DIR was not set when the "
                         "server or Engine started)")
    wait = flush_timeout(timeout)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(wait + 5.0)
            s.connect(_address(path))
            s.sendall((json.dumps(dict(fields, op=op, timeout=wait, token=token)) + "\n").encode())
            line = _read_line(s)
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        raise WriterGone(f"the dump writer did not answer at {path} ({exc})") from None
    except (ConnectionResetError, BrokenPipeError) as exc:  # it ended while answering (its process stopped)
        raise WriterGone(f"the dump writer ended while answering at {path} ({exc})") from None
    except (OSError, socket.timeout) as exc:
        raise FlushError(f"the dump writer did not answer at {path} ({exc})") from None
    if not line:  # it ended while answering (its process stopped): as gone
        raise WriterGone(f"the dump writer closed {path} without an answer")
    reply = json.loads(line)
    if op == "flush" and not reply.get("flushed"):
        raise FlushError(reply.get("error") or "the dump writer did not flush")
    if str(reply.get("error", "")).startswith("refused:"):
        raise FlushError(reply["error"])
    return reply


def flush(timeout: Optional[float] = None) -> dict:
    """Block until every request prefilled so far is on disk; the writer's counts."""
    return call("flush", timeout)


_STOPS = {}  # control address -> the thread that stops its writer (one stop per launch)
_STOPS_LOCK = threading.Lock()
# the launch's EAGLE3_DUMP_DRAIN_S, its sink and its state table (install_launcher_hooks)
_LAUNCH = {"drain_s": None, "sink": None, "table": None}


def _drain_s() -> float:
    got = _LAUNCH["drain_s"]
    if got is None:
        from .settings import DumpSettings

        settings = DumpSettings.from_env()
        got = settings.drain_s if settings is not None else 0.0
    return got


def _stop_writer(why: str, path: str) -> None:
    """The stop call (on a thread of its own); the outcome goes to the log."""
    drain = _drain_s()
    try:
        reply = call("stop", drain + STOP_MARGIN_S, path, why=why)
    except WriterGone:  # it ended on its own (a group signal, Ctrl-C, SGLang's shutdown request): it drained then
        logger.info("eagle3 dump: the writer stopped on its own before %s; it drains when it stops and names "
                    "what it could not write in its eagle3-dump-unwritten.*.json (or its log)", why)
        return
    except FlushError as exc:
        logger.error("eagle3 dump: the stop before %s failed: %s (files not yet written may be lost)", why, exc)
        return
    if not reply.get("stopped"):
        logger.error("eagle3 dump: the stop before %s did not end within %g s: %s", why, drain,
                     reply.get("error") or reply)
    elif reply.get("unwritten"):
        logger.error("eagle3 dump: stopped before %s: %d requests not written, named in %s", why,
                     reply["unwritten"], reply.get("ledger") or "the scheduler's log")
    else:
        logger.info("eagle3 dump: stopped before %s: every request handed to the writer is written (%s)", why,
                    ", ".join(f"{reply.get(k)} {k}" for k in ("written", "failed", "dropped", "after_stop")))


def stop_soon(why: str, path: Optional[str] = None) -> Optional[threading.Thread]:
    """Start the launch's stop (once per launch) without waiting for it; the thread doing it."""
    path = path or os.environ.get(ENV_CONTROL)
    if not path:
        return None
    with _STOPS_LOCK:
        thread = _STOPS.get(path)
        if thread is None:
            thread = _STOPS[path] = threading.Thread(target=_stop_writer, args=(why, path),
                                                     name="eagle3-dump-stop", daemon=True)
            thread.start()
    return thread


def _stop_quietly(why: str, path: Optional[str] = None) -> None:
    """Stop the writer before the launch ends and wait for it (at most the drain and a margin)."""
    thread = stop_soon(why, path)
    if thread is not None:
        thread.join(_drain_s() + 2 * STOP_MARGIN_S)


def _flush_then_stop(why: str, path: Optional[str] = None) -> None:
    """A polite end (Engine.shutdown, a script's exit): everything handed over is written first
    (the flush's default bound), then the stop (nothing left: it names nothing)."""
    path = path or os.environ.get(ENV_CONTROL)
    if not path:
        return
    if path not in _STOPS:
        try:
            reply = call("flush", None, path)
            logger.info("eagle3 dump flushed before %s: %s", why, reply)
        except WriterGone:
            pass  # the stop below says so
        except FlushError as exc:  # the stop names what is not written
            logger.error("eagle3 dump: flush before %s failed: %s", why, exc)
    _stop_quietly(why, path)


def _run_in_thread(fn, *args):
    """An awaitable of ``fn(*args)`` on a thread of its own: flushes never queue behind one another
    (asyncio's default executor has a few threads, which stuck flushes would hold)."""
    import asyncio

    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda e=exc: future.done() or future.set_exception(e))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="eagle3-dump-flush", daemon=True).start()
    return future


def _engine_hooks(engine_cls) -> None:
    if getattr(engine_cls, "_eagle3_hooks", False):
        return
    shutdown = engine_cls.shutdown

    def flush_eagle3_dump(self, timeout: Optional[float] = None) -> dict:
        """Block until every request this Engine has prefilled is in EAGLE3_DUMP_DIR (fsynced);
        returns the writer's counts (written, failed, dropped, skipped, warmup)."""
        return flush(timeout)

    def shutdown_after_flush(self, *args, **kwargs):
        _flush_then_stop("Engine.shutdown")
        return shutdown(self, *args, **kwargs)

    shutdown_after_flush.__doc__ = shutdown.__doc__
    engine_cls.flush_eagle3_dump = flush_eagle3_dump
    engine_cls.shutdown = shutdown_after_flush
    engine_cls._eagle3_hooks = True


def _kill_hooks(tokenizer_manager) -> None:
    """SGLang stops a server on SIGTERM by draining its requests and then killing its process
    tree (SIGKILL: the scheduler's queue would be lost). The writer is stopped the moment the
    SIGTERM handler runs (a runtime that signals PID 1 only gives the scheduler no signal of its
    own, and its SIGKILL comes after a grace period, not after SGLang's drain), and waited for
    before the tree is killed."""
    kill = tokenizer_manager.kill_process_tree
    if not getattr(kill, "_eagle3_hooks", False):
        def kill_process_tree(*args, **kwargs):
            _stop_quietly("the server stopped")
            return kill(*args, **kwargs)

        kill_process_tree._eagle3_hooks = True
        tokenizer_manager.kill_process_tree = kill_process_tree
    handler_cls = tokenizer_manager.SignalHandler
    sigterm = handler_cls.sigterm_handler
    if getattr(sigterm, "_eagle3_hooks", False):
        return

    def sigterm_handler(self, *args, **kwargs):
        stop_soon("SIGTERM to the launching process")  # on a thread: the event loop goes on
        return sigterm(self, *args, **kwargs)

    sigterm_handler.__doc__ = sigterm.__doc__
    sigterm_handler._eagle3_hooks = True
    handler_cls.sigterm_handler = sigterm_handler


STATUS_TIMEOUT = 5.0


def _outputs(out):
    """The output dicts of one yield of TokenizerManager.generate_request (one, or a batch's list)."""
    return [o for o in (out if isinstance(out, list) else [out]) if isinstance(o, dict)]


def _finished(o: dict) -> bool:
    meta = o.get("meta_info")
    return isinstance(meta, dict) and "id" in meta and meta.get("finish_reason") is not None


def dump_states(rids, path: Optional[str] = None) -> dict:
    """rid -> what became of its dump file, from the writer (``DumpWriter.state``)."""
    return dump_handles(rids, path)[0]


def _published(rids) -> tuple:
    """({rid: state}, {rid: handle}) of the requests the launch's state table gives whole, and the
    rids it does not (a store's written object: its manifest and whether it is still there are the
    writer's to say)."""
    from .identity import request_key

    table, sink = _LAUNCH.get("table"), _LAUNCH.get("sink") or "file"
    states, handles, ask = {}, {}, []
    for rid in rids:
        key = request_key(str(rid))
        got = table.get(key) if table is not None else None
        if got is None or (sink != "file" and got in ("written", "kept")):
            ask.append(rid)
            continue
        states[str(rid)] = got
        handles[str(rid)] = ({"sink": "file", "file": key + ".safetensors"} if sink == "file" else
                             {"sink": sink, "key": key, "manifest_key": key + ":meta"})
    return states, handles, ask


def _asked(rids, path: Optional[str] = None) -> tuple:
    """({rid: state}, {rid: handle}) from the writer (``DumpWriter.state`` and ``.handle``)."""
    try:
        reply = call("status", STATUS_TIMEOUT, path, rids=list(rids))
        return reply["states"], reply.get("handles") or {}
    except (FlushError, KeyError, ValueError) as exc:
        return {r: f"unknown: the dump writer did not answer ({exc})" for r in rids}, {}


def dump_handles(rids, path: Optional[str] = None) -> tuple:
    """({rid: state}, {rid: handle}): from the launch's state table (``states``) where it has them
    whole, else from the writer (at ``path``: the writer only)."""
    rids = [str(r) for r in rids]
    states, handles, ask = _published(rids) if path is None else ({}, {}, rids)
    if ask:
        more_states, more_handles = _asked(ask, path)
        states.update(more_states)
        handles.update(more_handles)
    return states, handles


class _StatusBatcher:
    """One ``status`` call at a time per event loop, for every answer that finished meanwhile.

    A call per answer costs a connection, a thread here and a thread in the scheduler's process,
    whose main loop never sleeps: under load each call waits for the GIL there several times,
    and 32 answers in flight queued their calls behind one another (and past the socket's backlog:
    an answer then said "unknown"). Batched, the answers of one moment share one round trip."""

    def __init__(self):
        self._pending = []  # (rids, future) of answers waiting for the next call
        self._running = False
        self.calls = 0  # status calls made (tests: fewer than the answers under load)

    async def ask(self, rids) -> tuple:
        import asyncio

        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(rids), future))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                self.calls += 1
                try:
                    states, handles = await _run_in_thread(_asked, [r for rids, _ in batch for r in rids])
                except BaseException as exc:  # each waiting answer gets the error
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for _, future in batch:
                    if not future.done():
                        future.set_result((states, handles))
        finally:
            self._running = False


_BATCHERS = weakref.WeakKeyDictionary()  # event loop -> its _StatusBatcher


def _status_batcher() -> _StatusBatcher:
    """The running event loop's batcher (an Engine and a server each run one loop)."""
    import asyncio

    loop = asyncio.get_running_loop()
    got = _BATCHERS.get(loop)
    if got is None:
        got = _BATCHERS[loop] = _StatusBatcher()
    return got


def parallel_samples(sampling_params) -> int:
    """The largest ``n`` of a request's sampling parameters (a dict, or a batch's list of them)."""
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    counts = [p.get("n", 1) if isinstance(p, dict) else 1 for p in items]
    return max([int(c) if isinstance(c, int) and not isinstance(c, bool) else 1 for c in counts] or [1])


SPECFORGE_TIMEOUT = 240.0  # the longest an answer waits for its SpecForge objects (SpecForge waits 300 s)


async def _specforge_expect(obj, request) -> Optional[dict]:
    """SpecForge's ``spec_capture`` (``specforge``): its payloads, checked, from the HTTP body
    (SGLang's request object drops fields it does not know), handed to the writer under request ids
    set here; rid -> payload, or None for a request without it. ValueError (a 400 naming the
    field) for a payload this server cannot take."""
    from . import specforge

    raw = await request.body()
    if b'"spec_capture"' not in raw:  # the cheap test first: most requests are not SpecForge's
        return None
    try:
        body = json.loads(raw)
    except ValueError:  # SGLang parsed it already; not a body this hook reads
        return None
    if not isinstance(body, dict) or body.get("spec_capture") is None:  # the words in a prompt, say
        return None
    try:
        payloads = specforge.payloads(body, specforge.prompt_lengths(body))
    except (ValueError, specforge.ProtocolError) as exc:
        raise ValueError(str(exc)) from None
    if payloads is None:
        return None
    if not os.environ.get(ENV_CONTROL):
        raise ValueError("spec_capture needs the hidden-state dump, which is off on this server; start it with "
                         "EAGLE3_DUMP_DIR, EAGLE3_DUMP_SINK=mooncake and EAGLE3_DUMP_SPECFORGE_IDS")
    single = not isinstance(body.get("input_ids", [None])[0], list)
    given = obj.rid
    rids = ([given] if single else list(given)) if given is not None else [uuid.uuid4().hex for _ in payloads]
    if len(rids) != len(payloads):
        raise ValueError(f"rid names {len(rids)} requests for {len(payloads)} prompts")
    obj.rid = rids[0] if single else rids
    try:
        asked = {str(r): p for r, p in zip(rids, payloads)}
        reply = await _run_in_thread(lambda: call("expect", 30.0, requests=asked))
    except FlushError as exc:
        raise ValueError(f"spec_capture: the dump writer did not answer ({exc})") from None
    refused = {r: why for r, why in (reply.get("refused") or {}).items() if why}
    if not reply.get("ok") or refused:
        raise ValueError("spec_capture refused: " + (next(iter(refused.values())) if refused else
                                                     str(reply.get("error"))))
    return {str(r): p for r, p in zip(rids, payloads)}


async def _specforge_answer(done, expected: dict) -> None:
    """Each finished answer of a SpecForge request carries ``meta_info["spec_capture"]``, once its
    objects are readable (or why they are not: SpecForge retries)."""
    from . import specforge

    rids = [str(o["meta_info"]["id"]) for o in done if str(o["meta_info"]["id"]) in expected]
    if not rids:
        return
    try:
        results = (await _run_in_thread(lambda: call("captured", SPECFORGE_TIMEOUT, rids=rids)))["results"]
    except (FlushError, KeyError, ValueError) as exc:
        results = {r: specforge.error(expected[r], f"the dump writer did not answer ({exc})") for r in rids}
    for o in done:
        rid = str(o["meta_info"]["id"])
        if rid in expected:
            o["meta_info"]["spec_capture"] = results.get(rid) or specforge.error(expected[rid], "no result")


def _answer_hooks(tokenizer_manager_cls) -> None:
    """Every finished answer (``/generate`` and ``Engine.generate``) says where its request's
    states are and what became of them: ``meta_info["eagle3_dump"] = {"sink": "file", "file":
    "<key>.safetensors", "state": ...}`` (``DumpWriter.state``: queued, written, kept, not dumped:
    why, failed: why); with the Mooncake sink ``{"sink": "mooncake", "key", "manifest_key",
    "manifest" (once committed: tensors, shapes, dtypes, offsets, the file metadata), "state"}``
    (``DumpWriter.handle``)."""
    inner = tokenizer_manager_cls.generate_request
    if getattr(inner, "_eagle3_hooks", False):
        return
    from .identity import request_key

    async def generate_request(self, obj, request=None):
        samples = parallel_samples(getattr(obj, "sampling_params", None))
        if samples > 1:
            raise ValueError(
                f"EAGLE3_DUMP_DIR is on and this request asks for n={samples} samples: SGLang first prefills "
                f"the prompt under a request id no answer names (its dump file would be an orphan), then "
                f"each sample again; send the prompt once per sample instead (n=1)")
        expected = await _specforge_expect(obj, request) if request is not None else None
        async for out in inner(self, obj, request):
            done = [o for o in _outputs(out) if _finished(o)]
            if done and expected:
                await _specforge_answer(done, expected)
            if done and os.environ.get(ENV_CONTROL):
                # the launch's state table first (no round trip into the scheduler), the writer for the rest
                states, handles, ask = _published([str(o["meta_info"]["id"]) for o in done])
                if ask:
                    more_states, more_handles = await _status_batcher().ask(ask)
                    states, handles = dict(states, **more_states), dict(handles, **more_handles)
                for o in done:
                    rid = o["meta_info"]["id"]
                    where = handles.get(str(rid)) or {"sink": "file", "file": request_key(rid) + ".safetensors"}
                    o["meta_info"]["eagle3_dump"] = dict(where, state=states.get(str(rid), "unknown"))
            yield out

    generate_request.__doc__ = inner.__doc__
    generate_request._eagle3_hooks = True
    tokenizer_manager_cls.generate_request = generate_request


def _http_hooks(http_server) -> None:
    app = http_server.app
    if getattr(app, "_eagle3_hooks", False):
        return
    from contextlib import asynccontextmanager

    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def flush_route(request: Request):
        try:
            body = await request.json()
        except ValueError:  # no body: the default timeout
            body = {}
        try:
            if body is not None and not isinstance(body, dict):
                raise ValueError('the body must be a JSON object, e.g. {"timeout": 60}')
            timeout = flush_timeout((body or {}).get("timeout"))
        except ValueError as exc:
            return JSONResponse({"flushed": False, "error": str(exc)}, status_code=400)
        try:
            reply = await _run_in_thread(flush, timeout)
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
        await _run_in_thread(_stop_quietly, "the server stopped")

    app.router.lifespan_context = lifespan
    warmup = http_server._wait_and_warmup

    def wait_and_warmup(*args, **kwargs):
        try:
            return warmup(*args, **kwargs)
        finally:
            resume_after_warmup()

    http_server._wait_and_warmup = wait_and_warmup
    app._eagle3_hooks = True


def resume_after_warmup(tries: int = RESUME_TRIES, first_wait: float = 0.25) -> bool:
    """Resume the dump once SGLang's warm-up is answered; a failed call is tried again (backing
    off, about a minute in all), then reported at error level. Whether it resumed."""
    import time

    wait, error = first_wait, None
    for attempt in range(tries):
        try:
            call("resume", 30.0)
            if attempt:
                logger.warning("eagle3 dump: resumed after the warm-up at try %d (%s)", attempt + 1, error)
            return True
        except WriterGone as exc:  # nobody to resume: the writer has stopped
            error = exc
            break
        except FlushError as exc:
            error = exc
            time.sleep(wait)
            wait = min(wait * 2, 10.0)
    logger.error("eagle3 dump: could not resume after the warm-up (%s); the dump stays PAUSED: no request is "
                 "dumped and every answer's eagle3_dump state says so. Restart the server", error)
    return False


def install_launcher_hooks(server_args, drain_s: Optional[float] = None) -> None:
    """In the launching process: pick the control socket (one per launch: the workers inherit
    it) and add the flush entry points."""
    import sys

    from .settings import ENV_DIR, ENV_LAUNCH, DumpConfigError, resolved

    workers = resolved(server_args).tokenizer_worker_num
    if workers > 1:
        raise DumpConfigError(f"{ENV_DIR} is set but --tokenizer-worker-num {workers} serves HTTP from "
                              f"several processes, and the dump's flush lives in one; use --tokenizer-worker-num 1")
    path = os.environ[ENV_CONTROL] = new_path()
    os.environ[ENV_LAUNCH] = uuid.uuid4().hex  # names this launch in every file it writes
    import secrets

    os.environ[ENV_TOKEN] = secrets.token_hex(16)  # only this launch's processes have it
    _LAUNCH["drain_s"] = drain_s
    _LAUNCH["sink"] = (os.environ.get("EAGLE3_DUMP_SINK", "").strip().lower() or "file")
    from .states import ENV_STATES, StateTable

    try:
        table = _LAUNCH["table"] = StateTable.create()
        os.environ[ENV_STATES] = table.path
    except OSError as exc:  # answers then ask the writer for every state
        logger.warning("eagle3 dump: no state table (%s): every answer asks the writer for its state", exc)
    # Upstream's Engine registered atexit(self.shutdown) before this ran, bound to the shutdown
    # the class had then; exit handlers run last-registered first, so this flush runs before it
    # (and before multiprocessing ends the workers): a script that never calls shutdown loses nothing.
    import atexit

    atexit.register(_flush_then_stop, "the process exited", path)
    from sglang.srt.entrypoints import engine
    from sglang.srt.managers import tokenizer_manager

    missing = [n for n in ("shutdown",) if not callable(getattr(engine.Engine, n, None))]
    missing += [n for n in ("kill_process_tree",) if not callable(getattr(tokenizer_manager, n, None))]
    missing += ["SignalHandler.sigterm_handler"] if not callable(
        getattr(getattr(tokenizer_manager, "SignalHandler", None), "sigterm_handler", None)) else []
    missing += [n for n in ("generate_request",) if not callable(getattr(tokenizer_manager.TokenizerManager, n, None))]
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http_server is not None:
        missing += [n for n in ("app", "lifespan", "_wait_and_warmup") if not hasattr(http_server, n)]
    if missing:
        raise DumpConfigError(f"{ENV_DIR} is set but this sglang lacks {', '.join(missing)}, which the "
                              f"dump's flush needs; use a release the series covers or unset {ENV_DIR}")
    _engine_hooks(engine.Engine)
    _kill_hooks(tokenizer_manager)
    _answer_hooks(tokenizer_manager.TokenizerManager)
    if http_server is not None:
        _http_hooks(http_server)
