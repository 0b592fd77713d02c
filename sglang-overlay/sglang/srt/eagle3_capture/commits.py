"""The dump's file writers: several threads, each committing whole files durably.

One thread cannot keep up with a capture node: it serialises, writes and fsyncs one file at a time
(0.46-1.15 GB/s measured), while one node prefills 1.4-3.6 GB/s of states. ``CommitPool`` runs
``n`` writer threads. Each file's commit is the same as with one thread (written under a temporary
name, fsynced, renamed, the directory fsynced: readers never see a partial file, a crash leaves
the whole file or none); only different files overlap. Files are spread over the threads by key:
every file of one key goes to the same thread, in submission order, so the writes of one request
(a retracted request prefilled again) never race each other.

``when_done`` is the flush: it sets an event once every commit submitted before it is done,
without holding up the caller (the thread that gathers forwards goes on while a flush waits, so a
flush never stalls the dump's pipeline or the forward behind it). ``pending``
names the commits not yet done (the stop ledger lists them). The thread count comes from
``EAGLE3_DUMP_WRITERS`` or, by default, from the CPUs this process may run on (``default_writers``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import zlib
from typing import Callable, Dict, List

logger = logging.getLogger(__name__)

MAX_DEFAULT_WRITERS = 4  # past 4 threads the disks measured here gained nothing (benchmarks/dump_writers.py)


def default_writers() -> int:
    """Writer threads when ``EAGLE3_DUMP_WRITERS`` is unset: one per CPU this process may use, at
    most ``MAX_DEFAULT_WRITERS`` (the threads mostly wait on the disk)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WRITERS, cpus))


class CommitPool:
    """``n`` writer threads; ``submit(key, item, fn)`` runs ``fn()`` on the thread of ``key``."""

    def __init__(self, n: int, name: str = "eagle3-dump-commit"):
        if n < 1:
            raise ValueError(f"a commit pool needs at least one thread, not {n}")
        self.n = n
        self._cond = threading.Condition()
        self._pending: Dict[int, object] = {}  # ticket -> item, submitted and not done
        self._keys: Dict[str, int] = {}  # key -> commits of it not done
        self._ticket = 0
        self._waiters: List[tuple] = []  # (ticket, event): set once no commit up to ticket is pending
        self._queues: List["queue.Queue"] = [queue.Queue() for _ in range(n)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def _slot(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.n

    def submit(self, key: str, item, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on ``key``'s thread after the earlier commits of ``key``; ``item`` is what
        ``pending`` names while it is not done."""
        with self._cond:
            self._ticket += 1
            ticket = self._ticket
            self._pending[ticket] = item
            self._keys[key] = self._keys.get(key, 0) + 1
        self._queues[self._slot(key)].put((ticket, key, fn))

    def _run(self, q: "queue.Queue") -> None:
        while True:
            task = q.get()
            if task is None:
                return
            ticket, key, fn = task
            try:
                fn()
            except Exception:  # a commit handles its own failures; this thread must outlive any one
                logger.exception("eagle3 dump: a file commit raised")
            finally:
                with self._cond:
                    del self._pending[ticket]
                    left = self._keys[key] - 1
                    if left:
                        self._keys[key] = left
                    else:
                        del self._keys[key]
                    if self._waiters:
                        self._wake_waiters()
                    self._cond.notify_all()

    def _wake_waiters(self) -> None:
        """Set the events of the flushes whose commits are all done (``_cond`` held). Tickets are
        inserted in increasing order, so the first pending one is the oldest."""
        oldest = next(iter(self._pending), None)
        keep = []
        for ticket, event in self._waiters:
            if oldest is None or oldest > ticket:
                event.set()
            else:
                keep.append((ticket, event))
        self._waiters = keep

    def when_done(self, event: threading.Event) -> None:
        """Set ``event`` once every commit submitted so far is done (at once when none is pending);
        returns at once."""
        with self._cond:
            self._waiters.append((self._ticket, event))
            self._wake_waiters()

    def busy(self, key: str) -> bool:
        """Whether a commit of ``key`` is submitted and not done."""
        with self._cond:
            return key in self._keys

    def pending(self) -> list:
        """The items of the commits not done, in submission order."""
        with self._cond:
            return [self._pending[t] for t in sorted(self._pending)]

    def close(self, timeout: float = None) -> bool:
        """Finish what is queued, then stop the threads; whether they all ended within ``timeout``
        seconds (None: waits for them)."""
        for q in self._queues:
            q.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._threads)
