"""Progress of the acceptance run's long steps (issue 29, item 13: a CPU run spent 11 silent
minutes generating its data). Every long step says, at least every ``PROGRESS_S`` seconds, what it
does, how far it is (done/total) and how long it has run, on stderr through the run's ``say``:
loops call ``Ticker.due`` themselves; a blocking call (a server's start, one HTTP request, a
subprocess) runs inside ``ticking``, whose thread prints for it."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

# at most this many seconds between two progress lines of one step (read at each use: the tests
# lower it)
PROGRESS_S = 30.0


class Ticker:
    """``due()`` is True at most every ``PROGRESS_S`` seconds (the first call: after that long)."""

    def __init__(self):
        self.t0 = self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last >= PROGRESS_S:
            self.last = now
            return True
        return False

    def mark(self):
        self.last = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


@contextmanager
def ticking(say, label: str, status):
    """While the block runs: every ``PROGRESS_S`` seconds ``[acceptance] LABEL: STATUS (N s)``,
    STATUS from ``status()`` (e.g. '96/280 prompts')."""
    t0 = time.monotonic()
    stop = threading.Event()

    def loop():
        while not stop.wait(PROGRESS_S):
            try:
                s = status()
            except Exception as exc:  # noqa: BLE001 - a progress line must never end the run
                s = "(%s)" % type(exc).__name__
            say("[acceptance] %s: %s (%.0f s)" % (label, s, time.monotonic() - t0))

    th = threading.Thread(target=loop, name="acceptance-progress", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
