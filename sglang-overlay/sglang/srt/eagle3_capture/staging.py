"""Host staging for the dump: one host arena, allocated (and page-locked) once, at writer start.

Rows copied off the device wait in host memory until the writer thread has written them, and
the rows of a request prefilled in chunks wait until its last chunk. ``HostStaging`` holds them:

- The arena: ONE ``uint8`` host tensor of ``cap`` bytes allocated when the writer starts. On
  CUDA it is page-locked with ``cudaHostRegister`` (not through PyTorch's caching host
  allocator, which rounds each block up to a power of two and never returns it) and
  unregistered at ``close()``. Nothing is allocated or pinned for a forward after that: a
  forward's rows get one contiguous block of the arena (first fit over free offset ranges,
  neighbours merged on release), sliced into one view per tensor.
- ``reserve(sizes, held=0)`` (the forward thread): views into the arena for a forward's rows,
  plus ``held`` bytes that need no buffer (host tensors written as they are). When the block
  does not fit now, the forward waits until the writer has written earlier forwards
  (back-pressure); each wait is timed, counted and logged (rate-limited). A wait is bounded
  (``max_wait``, EAGLE3_DUMP_MAX_WAIT_S): past it ``StagingTimeout`` is raised, and the writer
  fails that forward's requests loudly instead of holding the whole tensor-parallel group.
  A forward's rows never wait for anything else: with the arena empty every forward that fits
  the cap goes through.
- A forward larger than the whole arena gets temporary pageable buffers instead (nothing
  pinned); its device-to-host copy is then synchronous, so that forward waits for its own copy
  (counted as back-pressure, ``oversized``). One such forward is in flight at a time.
- ``try_reserve(sizes, alone)`` (the writer thread): pageable buffers for a chunked request's
  whole rows, outside the arena, so that a request being gathered never takes room a forward
  needs. Their bytes are held to the same cap; with ``alone`` (no other chunked request held)
  one request may pass it. None when they do not fit: the writer then drops that request.
- ``release(buffers, held=0, queued=True)`` gives a forward's block (``queued``) or a chunked
  request's buffers back.

Host memory of the dump: the arena (``cap``, pinned on CUDA, constant from start to close),
plus the rows of chunked requests being gathered (pageable, at most ``cap`` or one request
alone), plus one oversized forward's rows while it is written (pageable); the pageable parts
are freed as soon as they are written.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

ALIGN = 256  # every view starts on a 256-byte boundary of the arena
LOG_EVERY_S = 30.0  # at most one back-pressure log line per this many seconds


def _aligned(n: int) -> int:
    return (max(int(n), 1) + ALIGN - 1) // ALIGN * ALIGN


class ArenaAllocator:
    """First fit over the free ``(offset, size)`` ranges of ``[0, size)``; no memory of its own.

    ``alloc`` returns an offset or None; ``free`` merges the range back with its neighbours."""

    def __init__(self, size: int):
        self.size = int(size)
        self.free_ranges: List[Tuple[int, int]] = [(0, self.size)] if self.size else []
        self.used: Dict[int, int] = {}  # offset -> size of handed-out blocks

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self.free_ranges)

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self.free_ranges), default=0)

    def alloc(self, nbytes: int) -> Optional[int]:
        nbytes = int(nbytes)
        for i, (off, n) in enumerate(self.free_ranges):
            if n >= nbytes:
                if n == nbytes:
                    del self.free_ranges[i]
                else:
                    self.free_ranges[i] = (off + nbytes, n - nbytes)
                self.used[off] = nbytes
                return off
        return None

    def free(self, off: int) -> int:
        nbytes = self.used.pop(off)
        ranges = self.free_ranges
        lo, hi = 0, len(ranges)
        while lo < hi:  # insertion point by offset
            mid = (lo + hi) // 2
            if ranges[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        start, end = off, off + nbytes
        if lo < len(ranges) and ranges[lo][0] == end:  # merge with the range after
            end += ranges[lo][1]
            del ranges[lo]
        if lo > 0 and ranges[lo - 1][0] + ranges[lo - 1][1] == start:  # and the one before
            start = ranges[lo - 1][0]
            del ranges[lo - 1]
            lo -= 1
        ranges.insert(lo, (start, end - start))
        return nbytes


def _register(arena: torch.Tensor) -> bool:
    """Page-lock the arena in place (cudaHostRegister); False, logged, when CUDA refuses."""
    # 1 = cudaHostRegisterPortable: pinned for every CUDA context of the process
    err = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1))
    if err != 0:
        logger.error("eagle3_capture: page-locking the %d MiB dump arena failed (cudaError %d); its "
                     "device-to-host copies are synchronous (the forward waits for them). Lower "
                     "EAGLE3_DUMP_MAX_PENDING_MB or raise the locked-memory limit", arena.numel() >> 20, err)
        return False
    return True


class StagingTimeout(RuntimeError):
    """A forward waited ``max_wait`` seconds for room in the arena (the writer is stuck)."""


class HostStaging:
    def __init__(self, cap_bytes: int, pinned: bool, allocate: bool = True):
        """``allocate=False``: a rank that writes nothing holds no arena (it must not reserve)."""
        self.cap = int(cap_bytes)
        # the one allocation of the forward path, made here, at start
        self.arena = torch.empty(self.cap if allocate else 0, dtype=torch.uint8)
        self._base = self.arena.data_ptr()
        self.pinned = bool(pinned) and self.arena.numel() > 0 and _register(self.arena)
        self.alloc = ArenaAllocator(self.cap)
        self.cond = threading.Condition()
        self.in_use = 0  # bytes of handed-out arena blocks, oversized buffers and held bytes
        self.queued = 0  # the part of in_use that forwards reserved (the writer frees it)
        self.held_bytes = 0  # host tensors of queued forwards written as they are (no buffer)
        self.chunk_bytes = 0  # pageable rows of chunked requests being gathered
        self.oversized_in_flight = 0
        self._oversized_bytes = 0
        self.peak_in_use = 0
        self._peak_extra = 0  # peak of chunked + oversized bytes
        self.peak_chunk_bytes = 0
        # back-pressure: what the forward thread waited for
        self.waits = 0
        self.wait_s_total = 0.0
        self.wait_s_max = 0.0
        self.oversized = 0  # forwards larger than the arena, copied through pageable buffers
        self.timeouts = 0  # forwards that gave up waiting (max_wait): their rows are not dumped
        self._last_log = float("-inf")
        self._closed = False

    # ---- accounting -------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Host bytes the staging holds now: the arena (constant), chunked rows, oversized rows."""
        return self.arena.numel() + self.chunk_bytes + self._oversized_bytes

    @property
    def peak_allocated(self) -> int:
        return self.arena.numel() + self._peak_extra

    def _peaks(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.peak_chunk_bytes = max(self.peak_chunk_bytes, self.chunk_bytes)
        self._peak_extra = max(self._peak_extra, self.chunk_bytes + self._oversized_bytes)

    def in_arena(self, buf: torch.Tensor) -> bool:
        return self._base <= buf.data_ptr() < self._base + self.arena.numel()

    def waited(self, seconds: float, why: str) -> None:
        """Count (and, rate-limited, log) a forward-thread wait of ``seconds``."""
        with self.cond:
            self.waits += 1
            self.wait_s_total += seconds
            self.wait_s_max = max(self.wait_s_max, seconds)
            now = time.monotonic()
            if now - self._last_log < LOG_EVERY_S:
                return
            self._last_log = now
        logger.warning("EAGLE3_DUMP_DIR: a forward waited %.1f ms for the dump (%s; back-pressure: "
                       "%d waits, %.1f s in all, max %.1f ms; arena %d MiB). Raise "
                       "EAGLE3_DUMP_MAX_PENDING_MB or use a faster dump disk",
                       seconds * 1e3, why, self.waits, self.wait_s_total, self.wait_s_max * 1e3,
                       self.cap >> 20)

    def summary(self) -> str:
        return ("arena %d MiB%s, peak %d MiB in use, peak %d MiB of chunked rows; forward waits: %d "
                "(%.3f s in all, max %.1f ms), %d oversized forwards"
                % (self.cap >> 20, " pinned" if self.pinned else "", self.peak_in_use >> 20,
                   self.peak_chunk_bytes >> 20, self.waits, self.wait_s_total, self.wait_s_max * 1e3,
                   self.oversized))

    # ---- the forward thread ------------------------------------------------------------------
    def _views(self, off: int, sizes: Sequence[int]) -> List[torch.Tensor]:
        out = []
        for size in sizes:  # never empty: an empty view has no address to give back
            out.append(self.arena[off: off + max(int(size), 1)])
            off += _aligned(size)
        return out

    def _wait(self, start: Optional[float], max_wait: Optional[float], why: str) -> float:
        """One back-pressure wait of the forward thread (``self.cond`` held); StagingTimeout once
        ``max_wait`` seconds have passed since ``start`` (the first wait)."""
        start = start or time.perf_counter()
        left = None if max_wait is None else start + max_wait - time.perf_counter()
        if left is not None and left <= 0:
            self.timeouts += 1
            raise StagingTimeout(f"{why} for {max_wait:g} s (EAGLE3_DUMP_MAX_WAIT_S)")
        self.cond.wait(left)
        return start

    def reserve(self, sizes: Sequence[int], held: int = 0, max_wait: Optional[float] = None) -> List[torch.Tensor]:
        """Buffers for one forward's rows (``sizes`` bytes each); see the module's docstring.
        ``max_wait``: the longest the forward waits for room (StagingTimeout after it)."""
        if not sizes:
            return []
        if not self.arena.numel():
            raise RuntimeError("eagle3_capture: this rank's dump staging holds no arena")
        block = sum(_aligned(s) for s in sizes)
        start, why = None, "the arena is full of rows not yet written"
        with self.cond:
            if block > self.cap:  # larger than the whole arena: pageable, one at a time
                while self.oversized_in_flight:
                    why = "another prefill larger than the arena is being written"
                    start = self._wait(start, max_wait, why)
                self.oversized += 1
                self.oversized_in_flight += 1
                self._oversized_bytes += block
                out = [torch.empty(max(int(s), 1), dtype=torch.uint8) for s in sizes]
                if self.oversized == 1:
                    logger.warning("EAGLE3_DUMP_DIR: a %d MiB prefill is larger than the %d MiB arena "
                                   "(EAGLE3_DUMP_MAX_PENDING_MB); it goes through pageable memory and "
                                   "the forward waits for its copy", block >> 20, self.cap >> 20)
            else:
                off = self.alloc.alloc(block)
                while off is None or (self.queued and self.held_bytes + held > self.cap):
                    if off is not None:
                        self.alloc.free(off)
                    try:
                        start = self._wait(start, max_wait, why)
                    except StagingTimeout:
                        self.waited(time.perf_counter() - start, why)
                        raise
                    off = self.alloc.alloc(block)
                out = self._views(off, sizes)
            self.in_use += block + held
            self.queued += block + held
            self.held_bytes += held
            self._peaks()
            if start is not None:
                self.waited(time.perf_counter() - start, why)
        return out

    # ---- the writer thread -------------------------------------------------------------------
    def try_reserve(self, sizes: Sequence[int], alone: bool = False) -> Optional[List[torch.Tensor]]:
        """Pageable buffers for a chunked request's rows, or None when they do not fit under the
        cap beside the other chunked requests held (``alone``: none is, so it may pass it)."""
        need = sum(max(int(s), 1) for s in sizes)
        with self.cond:
            if not alone and self.chunk_bytes + need > self.cap:
                return None
            self.chunk_bytes += need
            self.in_use += need
            self._peaks()
        return [torch.empty(max(int(s), 1), dtype=torch.uint8) for s in sizes]

    def release(self, buffers: Sequence[torch.Tensor], held: int = 0, queued: bool = True) -> None:
        with self.cond:
            if not queued:  # a chunked request's rows
                nbytes = sum(b.numel() for b in buffers)
                self.chunk_bytes -= nbytes
                self.in_use -= nbytes
            else:
                inside = [b.data_ptr() - self._base for b in buffers if self.in_arena(b)]
                if inside:
                    block = self.alloc.free(min(inside))
                elif buffers:  # an oversized forward's pageable buffers
                    block = sum(_aligned(b.numel()) for b in buffers)
                    self._oversized_bytes -= block
                    self.oversized_in_flight -= 1
                else:
                    block = 0
                self.in_use -= block + held
                self.queued -= block + held
                self.held_bytes -= held
            self.cond.notify_all()

    def close(self) -> None:
        """Unregister the arena's page lock and free it (after the writer has finished with it)."""
        with self.cond:
            if self._closed:
                return
            self._closed = True
            if self.pinned:
                err = int(torch.cuda.cudart().cudaHostUnregister(self._base))
                if err != 0:
                    logger.error("eagle3_capture: unregistering the dump arena failed (cudaError %d)", err)
                self.pinned = False
            self.arena = torch.empty(0, dtype=torch.uint8)
