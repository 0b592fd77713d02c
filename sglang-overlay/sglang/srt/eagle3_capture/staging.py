"""Host staging for the dump: reusable host buffers under one byte cap.

Rows copied off the device wait in host buffers until the writer thread has written them, and
the rows of a request prefilled in chunks wait until its last chunk. ``HostStaging`` hands out
those buffers and holds every byte of them to one cap:

- ``reserve(sizes, held=0)``, for a forward's rows (the forward thread): one buffer per size
  (``uint8``, page-locked when ``pinned``), plus ``held`` bytes that need no buffer (host
  tensors written as they are). It waits while another forward's rows are still queued for
  the writer and the new total would pass the cap (backpressure: nothing is dropped, the
  forward waits). With nothing queued it goes through, so bytes that only the writer can free
  never make the forward wait for ever.
- ``try_reserve(sizes, alone)``, for a chunked request's rows (the writer thread): the buffers,
  or None when they do not fit under the cap now (with ``alone``, the one chunked request being
  held may pass the cap as one oversized forward may); the writer then drops that request.
- ``release(buffers, held=0, queued=True)`` gives them back for reuse.

A free buffer is reused for a size it holds with at most half of it wasted; otherwise a new
one is allocated, after freeing unused buffers so that the bytes allocated (in use and free)
stay within the cap. So the staging holds at most the cap, plus one forward's rows when they
went through with nothing queued, plus the one chunked request held alone.
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence, Tuple

import torch


def _without(buffers, drop) -> list:
    """``buffers`` minus ``drop``, by identity (tensors compare by value, element-wise)."""
    ids = {id(b) for b in drop}
    return [b for b in buffers if id(b) not in ids]


class HostStaging:
    def __init__(self, cap_bytes: int, pinned: bool):
        self.cap = int(cap_bytes)
        self.pinned = pinned
        self.free: List[torch.Tensor] = []
        self.in_use = 0  # bytes of handed-out buffers + held bytes
        self.queued = 0  # the part of in_use that forwards reserved (the writer frees it)
        self.allocated = 0  # bytes of all buffers, free or handed out
        self.peak_in_use = 0
        self.peak_allocated = 0
        self.cond = threading.Condition()

    # ---- planning (under the lock) ----------------------------------------------------------
    def _plan(self, sizes: Sequence[int], held: int) -> Tuple[list, list, int]:
        """([(position, buffer to reuse)], [(position, size to allocate)], bytes in all)."""
        over_cap = sum(sizes) + held > self.cap
        free = sorted(self.free, key=lambda b: b.numel())
        reuse, new = [], []
        for pos in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            size = max(int(sizes[pos]), 1)
            pick = None
            if not over_cap:
                pick = next((b for b in free if size <= b.numel() <= 2 * size), None)
            if pick is None:
                new.append((pos, size))
            else:
                free = _without(free, [pick])
                reuse.append((pos, pick))
        need = held + sum(b.numel() for _, b in reuse) + sum(s for _, s in new)
        return reuse, new, need

    def _take(self, plan, count: int, held: int, queued: bool) -> List[torch.Tensor]:
        reuse, new, need = plan
        kept = [b for _, b in reuse]
        self.free = _without(self.free, kept)
        new_bytes = sum(s for _, s in new)
        spare = sorted(self.free, key=lambda b: -b.numel())
        while spare and self.allocated + new_bytes > self.cap:  # free unused buffers first
            victim = spare.pop(0)
            self.free = _without(self.free, [victim])
            self.allocated -= victim.numel()
        out: List[Optional[torch.Tensor]] = [None] * count
        for pos, buf in reuse:
            out[pos] = buf
        for pos, size in new:
            out[pos] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        self.allocated += new_bytes
        self.in_use += need
        if queued:
            self.queued += need
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return out

    # ---- the calls ---------------------------------------------------------------------------
    def reserve(self, sizes: Sequence[int], held: int = 0) -> List[torch.Tensor]:
        with self.cond:
            plan = self._plan(sizes, held)
            while self.queued and self.in_use + plan[2] > self.cap:
                self.cond.wait()
                plan = self._plan(sizes, held)
            return self._take(plan, len(sizes), held, queued=True)

    def try_reserve(self, sizes: Sequence[int], alone: bool = False) -> Optional[List[torch.Tensor]]:
        """``alone``: nothing else of its kind is held, so it may pass the cap like one oversized
        forward may (the forward then waits until the writer has caught up)."""
        with self.cond:
            plan = self._plan(sizes, 0)
            if not alone and self.in_use + plan[2] > self.cap:
                return None
            return self._take(plan, len(sizes), 0, queued=False)

    def release(self, buffers: Sequence[torch.Tensor], held: int = 0, queued: bool = True) -> None:
        with self.cond:
            nbytes = held + sum(b.numel() for b in buffers)
            self.in_use -= nbytes
            if queued:
                self.queued -= nbytes
            if self.allocated > self.cap:  # what went through over the cap: let it go
                self.allocated -= sum(b.numel() for b in buffers)
            else:
                self.free.extend(buffers)
            self.cond.notify_all()
