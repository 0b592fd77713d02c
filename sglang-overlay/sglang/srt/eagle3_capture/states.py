"""What became of each request's file, published where the launching process reads it without
asking the scheduler: a table in memory both processes map.

Every finished answer says what became of its request's file (``meta_info["eagle3_dump"]``).
Asking the writer costs a round trip into the scheduler's process, whose main loop never sleeps:
the control thread there waits for the GIL several times per call (p90 22 ms, max 96 ms per
answer on a busy CPU scheduler, ``benchmarks/status_latency.py``), and every answer waited for it.
Instead the writer puts each request's state into this table the moment it changes (``queued`` on
the forward thread, before the forward's output exists), and an answer reads it in its own
process, in microseconds. A state the table cannot give whole (not there, too long, a record
being rewritten, a store's manifest) is asked for over the control socket as before.

The table is an anonymous memory file (memfd: nothing is left behind when a process dies) that
the launching process creates before any worker starts; it exports
``EAGLE3_DUMP_STATES=/proc/<pid>/fd/<fd>``, which the writing process opens. ``SLOTS`` records of
``RECORD`` bytes; a request's record is one of ``WAYS`` slots from its key's hash (the oldest of
them is reused when all hold other requests). A record: ``seq`` (odd while it is being written),
``stamp`` (a counter of writes, for the reuse), the first 16 bytes of the request's key, the text's
length (its top bit: the text was cut), the text (UTF-8) and a CRC-32 of key, length and text: a
reader takes a record only when ``seq`` is even and the same before and after, and the CRC holds,
so a torn read is never taken for a state, whatever order another CPU sees the bytes in.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from typing import Optional

ENV_STATES = "EAGLE3_DUMP_STATES"
SLOTS = 1 << 16
RECORD = 256
WAYS = 8
_HEAD = struct.Struct("<QQ16sH")  # seq, stamp, key, length
TEXT_MAX = RECORD - _HEAD.size - 4  # the CRC-32 takes the last 4 bytes
CUT = 0x8000
SIZE = SLOTS * RECORD


def _slot0(key16: bytes) -> int:
    return int.from_bytes(key16[:8], "little") % SLOTS


def _crc(key16: bytes, length: int, text: bytes) -> int:
    return zlib.crc32(key16 + length.to_bytes(2, "little") + text)


class StateTable:
    """One launch's table, mapped (``create`` in the launching process, ``open`` in the writer's)."""

    def __init__(self, fd: int, owner: bool):
        self.fd = fd
        self.owner = owner
        self.map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._stamp = 0
        self._lock = threading.Lock()  # the writer's threads put one at a time

    @classmethod
    def create(cls) -> "StateTable":
        fd = os.memfd_create("eagle3-dump-states", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        return cls(fd, True)

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    @classmethod
    def open(cls, path: str) -> "StateTable":
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size != SIZE:
                raise OSError(f"{path} is not a state table of this series ({os.fstat(fd).st_size} bytes)")
            return cls(fd, False)
        except BaseException:
            os.close(fd)
            raise

    # ---- the writer ------------------------------------------------------------------------------
    def put(self, key_hex: str, text: str) -> None:
        """Publish ``text`` as the state of the request whose key (sha256 hex) is ``key_hex``."""
        key16 = bytes.fromhex(key_hex[:32])
        raw = text.encode("utf-8", "surrogatepass")
        length = len(raw)
        if length > TEXT_MAX:
            raw = raw[:TEXT_MAX]
            length = TEXT_MAX | CUT
        with self._lock:
            self._stamp += 1
            off = self._slot_for(key16) * RECORD
            seq = _HEAD.unpack_from(self.map, off)[0]
            seq = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
            struct.pack_into("<Q", self.map, off, seq)
            _HEAD.pack_into(self.map, off, seq, self._stamp, key16, length)
            start = off + _HEAD.size
            self.map[start: start + len(raw)] = raw
            struct.pack_into("<I", self.map, off + RECORD - 4, _crc(key16, length, raw))
            struct.pack_into("<Q", self.map, off, seq + 1)  # even: whole

    def _slot_for(self, key16: bytes) -> int:
        first = _slot0(key16)
        oldest, oldest_stamp = first, None
        for w in range(WAYS):
            slot = (first + w) % SLOTS
            _, stamp, key, _ = _HEAD.unpack_from(self.map, slot * RECORD)
            if key == key16 or stamp == 0:
                return slot
            if oldest_stamp is None or stamp < oldest_stamp:
                oldest, oldest_stamp = slot, stamp
        return oldest

    # ---- a reader ---------------------------------------------------------------------------------
    def get(self, key_hex: str, tries: int = 4) -> Optional[str]:
        """The published state of that request, whole, or None (not there, cut, or being rewritten
        each time it was read: ask the writer)."""
        key16 = bytes.fromhex(key_hex[:32])
        first = _slot0(key16)
        for w in range(WAYS):
            off = ((first + w) % SLOTS) * RECORD
            for _ in range(tries):
                seq, stamp, key, length = _HEAD.unpack_from(self.map, off)
                if seq % 2:
                    continue
                if key != key16 or stamp == 0:
                    break
                n = length & ~CUT
                if n > TEXT_MAX:
                    break
                raw = bytes(self.map[off + _HEAD.size: off + _HEAD.size + n])
                (crc,) = struct.unpack_from("<I", self.map, off + RECORD - 4)
                if _HEAD.unpack_from(self.map, off)[0] != seq or crc != _crc(key16, length, raw):
                    continue
                if length & CUT:
                    return None
                return raw.decode("utf-8", "surrogatepass")
        return None

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
