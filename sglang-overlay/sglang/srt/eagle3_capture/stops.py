"""How the dump's writing process stops: one small place that owns it, what it promises, the ledger.

What a stop promises, whichever way it arrives (SIGTERM to the writing process, as a group signal
sends it: systemd, Slurm, ``kill -TERM -PGID``; the launching process's ``stop`` call over the
control socket, which is how a SIGTERM to the launcher alone reaches the writer: container runtimes
signal PID 1 only; the launch's own end: ``Engine.shutdown``, the server's stop, the process's exit):

- The writer takes no new request once the stop begins (their answers say "not dumped: the server
  is stopping"), writes what it was handed for at most ``EAGLE3_DUMP_DRAIN_S`` seconds, then starts
  no other file. The whole stop, the ledger's own writes included, is bounded by that figure: a hung
  dump disk never holds it longer (past the bound the ledger's names go to the log).
- SIGTERM never runs the drain on the main thread. Python runs a signal handler on the main thread
  between bytecodes: a main thread that holds one of the writer's locks when the signal lands would
  wait on itself, and one that sits in a C call (a collective whose peers the same group signal
  killed) would never run it. Here the C-level handler only writes the signal's number to a pipe
  (``signal.set_wakeup_fd``), the Python-level handler writes to the same pipe and returns (no lock,
  no wait), and a watcher thread that holds nothing else reads the pipe, drains, and ends the
  process as the signal would have.
- The ledger (``ledger_path``: ``eagle3-dump-unwritten.<launch>.json`` in the first dump directory)
  is per launch and exact: it names every request the writer was handed in this launch and did not
  write, failed ones with why, pending ones (queued, being written, waiting for their last chunk) as
  such, and a file still being written when the drain ended as one that may land. A request written
  after an earlier failure (a client's retry) is no longer named. It is written when the stop begins
  (a SIGKILL during the drain leaves the names) and again at its end, by a thread of its own that
  always writes the newest content, never an older one after a newer; it is removed when nothing is
  left to name. A launch never touches another launch's ledger.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional

from .sinks import _fsync, durable_replace

logger = logging.getLogger(__name__)

LEDGER_FORMAT = "eagle3-dump-unwritten/2"  # /2: one per launch, pending and failed requests told apart
LEDGER_PREFIX = "eagle3-dump-unwritten."
MAX_RESERVE_S = 2.0  # the end of a drain kept for its final ledger write
MAIN_THREAD_GRACE_S = 2.0  # how long a handler from before ours gets to run on the main thread


def _launch_token(launch_id: str) -> str:
    """The launch id as it goes into a file name (ours are uuid hex; anything else is hashed)."""
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", launch_id or ""):
        return launch_id
    import hashlib

    return hashlib.sha256(str(launch_id).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def ledger_path(directory: str, launch_id: str) -> str:
    """The ledger of one launch's writer."""
    return os.path.join(directory, f"{LEDGER_PREFIX}{_launch_token(launch_id)}.json")


class LedgerFile:
    """Writes one ledger file on a thread of its own: ``put(body)`` (None: remove the file) hands the
    newest content over and returns at once with a generation number; ``wait(gen, deadline)`` says
    whether that content, or a newer one, is durable (written, fsynced, renamed, the directory
    fsynced) by then. The thread always writes the newest content handed over, so an older body never
    lands after a newer one, and a hung disk holds only this thread."""

    def __init__(self, path: str):
        self.path = path
        self.directory = os.path.dirname(path) or "."
        self._cond = threading.Condition()
        self._want = None  # (generation, body) not yet taken by the thread
        self._gen = 0
        self._done = 0  # the newest generation the thread has finished (written or failed)
        self.error: Optional[str] = None  # why the last write failed, None when it did not
        self._thread: Optional[threading.Thread] = None

    def put(self, body: Optional[dict]) -> int:
        with self._cond:
            self._gen += 1
            self._want = (self._gen, body)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="eagle3-dump-ledger", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return self._gen

    def wait(self, gen: int, deadline: float) -> bool:
        """Whether generation ``gen`` (or a newer one) is done by ``deadline`` (time.monotonic) and
        did not fail."""
        with self._cond:
            while self._done < gen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self.error is None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._want is None:
                    self._cond.wait()
                gen, body = self._want
                self._want = None
            try:
                self._write(body)
                error = None
            except OSError as exc:
                error = f"{exc.strerror or exc}"
            with self._cond:
                self._done = gen
                self.error = error
                self._cond.notify_all()

    def _write(self, body: Optional[dict]) -> None:
        if body is None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return
            _fsync(self.directory)
            return
        def write(tmp: str) -> None:
            with open(tmp, "w") as handle:
                json.dump(body, handle, indent=1)

        # the ledger's own fsync: a dump disk that hangs the files' must not hold the ledger back
        durable_replace(self.path, f"{self.path}.{uuid.uuid4().hex[:12]}.tmp", write, fsync=_fsync)


def _die_by(signum: int) -> None:
    """End this process as an unhandled ``signum`` would (its default action), from any thread:
    Python lets only the main thread change a handler, so the default is set through libc."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the default action ends the process before this returns
    finally:
        os._exit(128 + signum)


class Stopper:
    """The stop of one writer (``DumpWriter.stopper``)."""

    def __init__(self, writer, drain_s: float):
        self.writer = writer
        self.drain_s = float(drain_s)
        self.ledger = LedgerFile(writer.ledger_path)
        self._lock = threading.Lock()  # taken briefly by whoever starts a stop; never by a signal handler
        self._started = False
        self._done = threading.Event()
        self.report: Optional[dict] = None
        self.why: Optional[str] = None
        self._pipe = None  # (read fd, write fd) once SIGTERM is ours
        self._previous = None  # the SIGTERM handler before ours
        self._end_on_main = False  # set by the watcher: the main thread runs the handler from before ours

    # ---- the stop ----------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._started

    def stop(self, why: str, seconds: Optional[float] = None) -> dict:
        """Stop the writer (once; a later call waits for the first, bounded, and gets its report)."""
        seconds = self.drain_s if seconds is None else float(seconds)
        with self._lock:
            first = not self._started
            self._started = True
            if first:
                self.why = why
        if not first:
            if not self._done.wait(seconds + MAX_RESERVE_S):
                return {"stopped": False, "error": f"a stop ({self.why}) is still draining after {seconds:g} s"}
            return dict(self.report or {}, again=True)
        report: dict = {"stopped": False}
        try:
            report = self._drain(why, seconds)
        finally:
            self.report = report
            self._done.set()
        return report

    def _drain(self, why: str, seconds: float) -> dict:
        w = self.writer
        started = time.monotonic()
        deadline = started + max(seconds, 0.0)
        reserve = min(MAX_RESERVE_S, max(seconds, 0.0) / 4)
        w.stop_accepting()  # later prefills are not dumped (their answers say why)
        pending = w.ledger_entries(f"handed to the writer and not written when the stop began ({why})")
        logger.log(logging.WARNING if pending else logging.INFO,
                   "EAGLE3_DUMP_DIR: %s: writing the %d requests handed to the writer (at most %g s, "
                   "EAGLE3_DUMP_DRAIN_S); later prefills are not dumped", why, len(pending), seconds)
        if pending:  # a SIGKILL during the drain still leaves the names
            self.ledger.put(self._body(pending))
        flushed = w.wait_written(deadline - reserve)
        if not flushed:
            w.give_up()  # no other file starts: the ledger below stays true
        entries = w.ledger_entries(f"not written within the {seconds:g} s drain (EAGLE3_DUMP_DRAIN_S)",
                                   gave_up=not flushed)
        gen = self.ledger.put(self._body(entries) if entries else None)
        durable = self.ledger.wait(gen, deadline)
        took = time.monotonic() - started
        counts = w.counts()
        if entries and not durable:
            logger.error("EAGLE3_DUMP_DIR: %s: the ledger %s was not durable within the drain (%s); the %d "
                         "requests not written are: %s", why, self.ledger.path,
                         self.ledger.error or "its disk is slow or hung", len(entries), json.dumps(entries))
        logger.log(logging.WARNING if pending or entries else logging.INFO,
                   "EAGLE3_DUMP_DIR: %s; drained in %.1f s: %s%s", why, took,
                       ", ".join(f"{v} {k}" for k, v in counts.items()),
                       (f"; {len(entries)} not written, named in {self.ledger.path}" if durable else
                        f"; {len(entries)} not written, named in the log above") if entries else
                       "; nothing left unwritten")
        return dict(counts, stopped=True, flushed=flushed, unwritten=len(entries),
                    ledger=self.ledger.path if entries and durable else None, seconds=round(took, 3))

    def _body(self, entries: List[dict]) -> dict:
        w = self.writer
        return {"format": LEDGER_FORMAT, "launch_id": w.metadata.get("launch_id"), "host": w.host,
                "pid": os.getpid(), "time": time.time(), "why": self.why, "counts": w.counts(),
                "requests": entries}

    # ---- SIGTERM -----------------------------------------------------------------------------
    def install_sigterm(self) -> bool:
        """Own SIGTERM in this process (main thread only, where Python lets handlers be set):
        whether it is now ours. A process that ignored SIGTERM keeps ignoring it."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("EAGLE3_DUMP_DIR: the dump started off the main thread, so SIGTERM to this process "
                           "does not drain it (a stop call or the process's exit still does)")
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return False
        read_fd, write_fd = os.pipe()
        for fd in (read_fd, write_fd):
            os.set_inheritable(fd, False)
        os.set_blocking(write_fd, False)  # the C-level handler must never block
        self._pipe = (read_fd, write_fd)
        self._previous = previous
        signal.signal(signal.SIGTERM, self._on_main_thread)
        chained = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd, chained), name="eagle3-dump-stop",
                         daemon=True).start()
        return True

    def _on_main_thread(self, signum, frame) -> None:
        """Python's SIGTERM handler: it may run while the main thread holds anything, so it takes no
        lock and waits for nothing; the watcher does the work."""
        if self._end_on_main:  # the watcher has drained: the handler from before ours ends the process
            previous = self._previous
            signal.signal(signal.SIGTERM, previous)
            previous(signum, frame)
            return
        try:
            os.write(self._pipe[1], bytes([signal.SIGTERM]))
        except OSError:  # the pipe is full: the watcher has its byte already
            pass

    def _watch(self, read_fd: int, chained: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 512)
            except InterruptedError:
                continue
            if not data:
                return
            if chained >= 0:  # whoever had the wakeup fd before keeps getting its signals
                try:
                    os.write(chained, data)
                except OSError:
                    pass
            if signal.SIGTERM in data and not self._started:
                self.stop("SIGTERM")
                self._end()
                return

    def _end(self) -> None:
        """End the process as SIGTERM would have without us: the handler from before ours, on the
        main thread (a Python handler may run nowhere else), or the default action."""
        previous = self._previous
        if callable(previous):
            self._end_on_main = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(MAIN_THREAD_GRACE_S)  # the main thread sits in a C call: the default instead
            logger.error("EAGLE3_DUMP_DIR: the main thread did not run SIGTERM's earlier handler within %g s; "
                         "ending the process by the signal's default action", MAIN_THREAD_GRACE_S)
        _die_by(signal.SIGTERM)


def call_with_deadline(fn: Callable[[], Dict], seconds: float) -> Optional[Dict]:
    """``fn()`` on a thread of its own, waited for at most ``seconds``; None when it has not returned."""
    box: Dict[str, Dict] = {}

    def run():
        box["out"] = fn()

    t = threading.Thread(target=run, name="eagle3-dump-bounded", daemon=True)
    t.start()
    t.join(max(seconds, 0.0))
    return box.get("out")
