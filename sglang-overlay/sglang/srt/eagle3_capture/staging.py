"""Host staging for the dump: reusable host buffers under one byte cap.

Rows copied off the device wait in host buffers until the writer thread has written them.
``HostStaging`` hands out those buffers and holds every byte of them to a cap:

- ``reserve(sizes, held=0)`` returns one buffer per size (``uint8``, page-locked when
  ``pinned``) and counts them, plus ``held`` bytes that need no buffer (host tensors written
  as they are), as in use. It waits while the new total would pass the cap; a reservation
  larger than the cap goes through alone, once nothing else is in use (backpressure: nothing
  is dropped, the forward waits).
- ``release(buffers, held=0)`` gives them back for reuse.

A free buffer is reused for a size it holds with at most half of it wasted; otherwise a new
one is allocated, after freeing unused buffers so that the bytes allocated (in use and free)
stay within the cap. So the staging never holds more than max(cap, one oversized
reservation) bytes, whatever the sequence of request sizes.
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
        self.allocated = 0  # bytes of all buffers, free or handed out
        self.peak_in_use = 0
        self.peak_allocated = 0
        self.cond = threading.Condition()

    # ---- planning (under the lock) ----------------------------------------------------------
    def _plan(self, sizes: Sequence[int], held: int) -> Optional[Tuple[list, list]]:
        """([(position, buffer to reuse)], [(position, size to allocate)]) or None to wait."""
        oversized = sum(sizes) + held > self.cap
        free = sorted(self.free, key=lambda b: b.numel())
        reuse, new = [], []
        for pos in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            size = max(int(sizes[pos]), 1)
            pick = None
            if not oversized:
                pick = next((b for b in free if size <= b.numel() <= 2 * size), None)
            if pick is None:
                new.append((pos, size))
            else:
                free = _without(free, [pick])
                reuse.append((pos, pick))
        need = held + sum(b.numel() for _, b in reuse) + sum(s for _, s in new)
        if self.in_use and self.in_use + need > self.cap:
            return None
        return reuse, new

    def _evict_for(self, new_bytes: int, keep) -> None:
        """Free unused buffers, largest first, until new_bytes more fit under the cap."""
        spare = sorted(_without(self.free, keep), key=lambda b: -b.numel())
        while spare and self.allocated + new_bytes > self.cap:
            victim = spare.pop(0)
            self.free = _without(self.free, [victim])
            self.allocated -= victim.numel()

    # ---- the two calls ----------------------------------------------------------------------
    def reserve(self, sizes: Sequence[int], held: int = 0) -> List[torch.Tensor]:
        with self.cond:
            plan = self._plan(sizes, held)
            while plan is None:
                self.cond.wait()
                plan = self._plan(sizes, held)
            reuse, new = plan
            kept = [b for _, b in reuse]
            self.free = _without(self.free, kept)
            new_bytes = sum(s for _, s in new)
            self._evict_for(new_bytes, kept)
            out: List[Optional[torch.Tensor]] = [None] * len(sizes)
            for pos, buf in reuse:
                out[pos] = buf
            for pos, size in new:
                out[pos] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            self.allocated += new_bytes
            self.in_use += held + sum(b.numel() for b in out)
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            self.peak_allocated = max(self.peak_allocated, self.allocated)
            return out

    def release(self, buffers: Sequence[torch.Tensor], held: int = 0) -> None:
        with self.cond:
            self.in_use -= held + sum(b.numel() for b in buffers)
            if self.allocated > self.cap:  # what an oversized reservation left: let it go
                self.allocated -= sum(b.numel() for b in buffers)
            else:
                self.free.extend(buffers)
            self.cond.notify_all()
