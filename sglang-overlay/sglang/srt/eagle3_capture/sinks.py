"""Where a request's states go: a file in the dump directory, or one object in a Mooncake Store.

Both sinks take what the writer cut for one request (tensor name -> host tensor, the file
metadata) and commit it whole or not at all; ``header(key)`` is what a request's earlier commit
recorded (None: nothing there), which the writer compares before it writes again.

- ``FileSink`` (``EAGLE3_DUMP_SINK=file``, the default): ``<key>.safetensors`` written under a
  temporary name, fsynced, renamed, the directory fsynced; in a directory held in memory (tmpfs,
  ramfs: ``memory_backed``) without the two fsyncs, which make nothing more durable there (a
  reader still sees the old file or the whole new one: the rename). ``EAGLE3_DUMP_DIR`` may name several
  directories separated by ``os.pathsep`` (one per local disk): each key's file goes to the one
  ``spread`` picks, which ``tools/extract.py`` computes the same way.
- ``MooncakeSink`` (``EAGLE3_DUMP_SINK=mooncake``): the tensors packed into one object at 64-byte
  aligned offsets (``pack``), put under the request's key, then a small JSON object ``<key>:meta``
  with the manifest: ``{"version": 1, "handle": key, "tensors": {name: {shape, dtype, nbytes,
  offset}}, "metadata": {"total_aligned_bytes": n, ...the file metadata}}``. The manifest is the
  layout hs-connectors' ``MooncakeHiddenStatesStore.get_sample`` reads; the meta object is put
  after the data, so a reader that finds it finds the data whole (each put is atomic). The
  writing rank only connects (``mooncake.store.MooncakeDistributedStore``, imported at start).
  Every object is hard pinned (Mooncake's eviction would drop objects reported written: a full
  store refuses puts instead, and those requests fail by name); a thread removes what no reader
  deleted ``EAGLE3_DUMP_MOONCAKE_TTL_S`` after its commit, fails requests at once while the
  master does not answer, and, through a sentinel object, notices a restarted master and names
  the objects it no longer has (``gone``, ``counts``; docs/online.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from typing import Dict, Optional

import torch

from .settings import DumpConfigError, dump_directories

try:  # safetensors 0.8 and later: serialize_file given each tensor's address (TensorSpec)
    from safetensors import TensorSpec
except ImportError:  # an older one: every file through save_file (the start line says so)
    TensorSpec = None

ALIGN = 64  # byte alignment of each tensor in a Mooncake object (hs-connectors' _TENSOR_ALIGN)
MANIFEST_VERSION = 1
META_SUFFIX = ":meta"
ERROR_SUFFIX = ":error"  # a failed commit's marker: {"error": why} (hs-connectors' readers check it first)
FILE_MODE = 0o644  # dump files and the stop ledger: a shared directory's readers may run as other users
HOST = socket.gethostname()  # in temporary and ledger names: replicas on several hosts share a directory


def spread(key: str, count: int) -> int:
    """Which of ``count`` dump directories holds the file of ``key``: the first 8 bytes of the
    key's sha256, big-endian, modulo ``count``. ``eaglepatch.extract.dumps.spread`` is the same
    function on the reading side (tests/test_dump_dirs.py holds them to each other)."""
    if count == 1:
        return 0
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % count


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # their files live in memory: an fsync there writes nothing anywhere


def memory_backed(directory: str) -> bool:
    """Whether ``directory`` is on a file system held in memory (``MEMORY_FILE_SYSTEMS``): the one
    mounted at the longest mount point over its real path (psutil's list of every mount)."""
    import psutil

    real = os.path.realpath(directory)
    best, fstype = "", ""
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, fstype = mount, part.fstype
    return fstype in MEMORY_FILE_SYSTEMS


class _Held:
    """Three metadata system calls made while this thread keeps the GIL (``ctypes.PyDLL``: libc's
    ``access``, ``chmod`` and ``rename``), for directories held in memory only, where they return in
    microseconds. Made through ``os`` they give the GIL away, and beside the scheduler's thread,
    which runs Python all the time, each costs the dump's writer thread up to Python's switch
    interval to get it back (benchmarks/handovers_gil.py); on a disk they may wait for it, so there
    they go through ``os`` as before. A failure raises ``OSError`` with the call's errno, as ``os``
    does."""

    def __init__(self):
        libc = ctypes.PyDLL(None, use_errno=True)
        self._access, self._chmod, self._rename = libc.access, libc.chmod, libc.rename
        self._access.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._chmod.argtypes = [ctypes.c_char_p, ctypes.c_uint]
        self._rename.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        for f in (self._access, self._chmod, self._rename):
            f.restype = ctypes.c_int

    @staticmethod
    def _raise(path: str, other: Optional[str] = None) -> None:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path, None, other)

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (a link is followed: a dangling one is nothing)."""
        return self._access(os.fsencode(path), os.F_OK) == 0

    def chmod(self, path: str, mode: int) -> None:
        if self._chmod(os.fsencode(path), mode) != 0:
            self._raise(path)

    def replace(self, src: str, dst: str) -> None:
        if self._rename(os.fsencode(src), os.fsencode(dst)) != 0:
            self._raise(src, dst)


HELD = _Held()


def _no_fsync(path: str) -> None:
    """A file system in memory: nothing to make durable. Each system call a writer thread makes costs it
    the GIL back, which the scheduler's thread holds while it runs Python, for up to Python's switch
    interval (benchmarks/writer_gil.py): the six calls of the two fsyncs are left out."""


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(path: str, tmp: str, write, fsync=None, held: bool = False) -> None:
    """``write(tmp)``, then ``tmp`` readable by others whatever the umask, fsynced, renamed over
    ``path`` and the directory fsynced: a reader sees the old file or the whole new one, and a crash
    leaves one of them; on any failure the temporary file is removed and the error raised.
    ``fsync``: the caller's (default: this module's ``_fsync``, which the dump files' tests watch).
    ``held``: the chmod and the rename keep the GIL (``HELD``: a directory in memory)."""
    fsync = fsync or _fsync
    chmod, replace = (HELD.chmod, HELD.replace) if held else (os.chmod, os.replace)
    try:
        write(tmp)
        chmod(tmp, FILE_MODE)
        fsync(tmp)
        replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync(os.path.dirname(path) or ".")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(tensors: Dict[str, torch.Tensor]) -> tuple:
    """(tensor specs, total bytes): each tensor's shape, dtype, bytes and offset in the object."""
    specs, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        specs[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "nbytes": nbytes, "offset": offset}
        offset = _aligned(offset + nbytes)
    return specs, offset


def manifest(key: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
    specs, total = pack(tensors)
    return {"version": MANIFEST_VERSION, "handle": key, "tensors": specs,
            "metadata": dict(metadata, total_aligned_bytes=total)}


# Mooncake's error codes (mooncake-store/include/types.h)
NO_ROOM, NOT_FOUND, RPC_FAIL, RPC_TIMEOUT = -200, -704, -900, -901  # NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, RPC_*


class SinkError(RuntimeError):
    """A commit that did not happen; the message says why (the request's answer and log show it)."""


# where the store's Python package comes from (the package index; pick the build that matches the
# server's accelerator) and what its native code needs; mooncake_master ships in the same package
MOONCAKE_INSTALL = ("pip install mooncake-transfer-engine (CUDA 12), mooncake-transfer-engine-cuda13 (CUDA 13) or "
                    "mooncake-transfer-engine-non-cuda (no GPU) into the server's Python environment (the same "
                    "package holds mooncake_master); its native code needs Debian's libibverbs1 even for TCP "
                    "(apt-get install libibverbs1)")


def mooncake_missing() -> Optional[str]:
    """Why ``mooncake.store`` cannot be imported in this environment (None: it can), in one line."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: F401
    except ImportError as exc:  # no package, or its native library (libibverbs) missing
        return (f"EAGLE3_DUMP_SINK=mooncake but the mooncake package cannot be imported "
                f"({' '.join(str(exc).split())[:200]}); {MOONCAKE_INSTALL}")
    return None


def check_mooncake_importable() -> None:
    """For the launch check (``settings.check_launch``, before any worker starts or any weight
    loads): the Mooncake sink's package imports here, in the launching process's environment, which
    the writing rank inherits; DumpConfigError (one line: the reason and where the package comes
    from) otherwise."""
    why = mooncake_missing()
    if why is not None:
        raise DumpConfigError(why)


class FileSink:
    name = "file"

    def __init__(self, directory: str):
        """``directory``: an ``EAGLE3_DUMP_DIR`` value, one directory or several (``dump_directories``)."""
        self.directories = dump_directories(directory)
        self.directory = self.directories[0]
        # a directory in memory: no fsync (None: this module's _fsync, looked up at each commit), and
        # its metadata calls keep the GIL (HELD)
        self.fsyncs = {d: _no_fsync if memory_backed(d) else None for d in self.directories}
        self.held = {d: f is _no_fsync for d, f in self.fsyncs.items()}

    def describe(self) -> str:
        """The start line's words for this sink."""
        memory = [d for d, f in self.fsyncs.items() if f is _no_fsync]
        return self.name + (f" (no fsync in {', '.join(memory)}: held in memory; its file system calls but "
                            f"the write keep the GIL)" if memory else "") + (
            "" if TensorSpec is not None else "; this safetensors has no TensorSpec (0.8 and later do): every "
            "file through save_file, one torch view per tensor and request")

    def directory_of(self, key: str) -> str:
        return self.directories[spread(key, len(self.directories))]

    def path(self, key: str) -> str:
        return os.path.join(self.directory_of(key), f"{key}.safetensors")

    def where(self, key: str) -> dict:
        return {"sink": self.name, "file": f"{key}.safetensors"}

    def header(self, key: str, read_header) -> Optional[Dict[str, str]]:
        path = self.path(key)
        if self.held[self.directory_of(key)] and not HELD.exists(path):  # the usual case, the GIL kept
            return None
        return read_header(path)

    def commit(self, key: str, tensors: Dict[str, object], metadata: Dict[str, str]) -> dict:
        """Write ``<key>.safetensors``: ``tensors`` maps each name to a host tensor, or (every one) to a
        safetensors ``TensorSpec`` (dtype, shape, address, bytes; the caller keeps that memory alive),
        written by ``serialize_file`` with no torch call: the file ``save_file`` writes of the same rows."""
        from safetensors import serialize_file
        from safetensors.torch import save_file

        if TensorSpec is not None and tensors and all(isinstance(t, TensorSpec) for t in tensors.values()):
            return self._commit(key, lambda t: serialize_file(tensors, t, metadata=metadata))
        return self._commit(key, lambda t: save_file(tensors, t, metadata=metadata))

    def _commit(self, key: str, write) -> dict:
        directory = self.directory_of(key)
        path = self.path(key)
        tmp = os.path.join(directory, f".{key}.{HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        durable_replace(path, tmp, write, fsync=self.fsyncs[directory], held=self.held[directory])
        return self.where(key)

    def fail(self, key: str, why: str) -> None:
        """Nothing to mark: a missing file and the stop ledger say it."""

    def gone(self, key: str) -> Optional[str]:
        """A written file stays until someone removes it."""
        return None

    def counts(self) -> Dict[str, int]:
        return {}


def _store_error(what: str, key: str, code, master: str = "") -> SinkError:
    if code == NO_ROOM:
        why = ("no room: the store is full of objects nobody deleted; have readers delete what they read, lower "
               "EAGLE3_DUMP_MOONCAKE_TTL_S, or give the store more memory (EAGLE3_DUMP_MOONCAKE_SEGMENT_MB)")
    elif code in (RPC_FAIL, RPC_TIMEOUT):
        why = f"the master {master} did not answer: it is down or unreachable; later requests go on when it is back"
    else:
        why = "see the master's log"
    return SinkError(f"the Mooncake store refused {what} of {key} (code {code}: {why})")


logger = logging.getLogger(__name__)

# Every object the sink puts is hard pinned: Mooncake's eviction (the master frees ~5% of the unleased
# objects once its memory is 90% used, or when a put finds no room) never takes one a reader has not
# deleted; a full store refuses new puts instead, and those requests fail by name.
HARD_PIN = True
SWEEP_S = 1.0  # how often the sink checks its master (a restart) and removes what is past its time to live
TRACKED_MAX = 1 << 18  # objects the sink remembers for expiry and for a master's restart (oldest forgotten)
MARKED_MAX = 4096  # at a master's restart, error markers for at most this many of the newest objects gone


class MooncakeSink:
    name = "mooncake"

    def __init__(self, cfg):
        """``cfg``: ``settings.MooncakeSettings``. Connects now (the writer's start), puts this
        sink's sentinel object and starts the thread that watches the master and expires objects."""
        why = mooncake_missing()
        if why is not None:
            raise SinkError(why)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        self.cfg = cfg
        self.store = MooncakeDistributedStore()
        code = self.store.setup(cfg.local_host, cfg.metadata_server, cfg.segment_bytes, cfg.buffer_bytes,
                                cfg.protocol, cfg.device, cfg.master)
        if code != 0:
            raise SinkError(f"EAGLE3_DUMP_SINK=mooncake: connecting to the master {cfg.master} (metadata "
                            f"{cfg.metadata_server}, {cfg.protocol}) failed with code {code}; check "
                            f"EAGLE3_DUMP_MOONCAKE_MASTER and EAGLE3_DUMP_MOONCAKE_METADATA")
        self._pin = ReplicateConfig()
        self._pin.with_hard_pin = HARD_PIN
        self._local = threading.local()  # each writer thread's registered staging buffer
        self._lock = threading.Lock()  # the records below: writer threads and the sweeper
        self._objects: "OrderedDict[str, float]" = OrderedDict()  # key -> its commit (monotonic), oldest first
        self._markers: "OrderedDict[str, float]" = OrderedDict()  # marker key -> when it is removed
        self._gone: "OrderedDict[str, str]" = OrderedDict()  # key -> why a written object is no longer there
        self._counts = {"expired": 0, "gone_at_restart": 0, "master_restarts": 0}
        self._tracked_full = False
        self._down_since: Optional[float] = None  # the master has not answered since then: requests fail at once
        self._unmarked: "OrderedDict[str, str]" = OrderedDict()  # key -> why: markers to put once it answers
        self._forgot_since: Optional[float] = None  # the master answered without our sentinel since then
        self._restarts_seen = 0  # restarts noticed, counted before the sentinel is put again (see commit)
        # a master that lists this object knows what this sink put: one that does not has restarted
        self.sentinel = f"eagle3-dump-sink:{HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        code = self.store.upsert(self.sentinel, b"1", self._pin)
        if code != 0:
            raise SinkError(f"EAGLE3_DUMP_SINK=mooncake: the master {cfg.master} took the connection but refused a "
                            f"1-byte object (code {code}); check that the store has memory "
                            f"(EAGLE3_DUMP_MOONCAKE_SEGMENT_MB)")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="eagle3-dump-mooncake-sweep", daemon=True)
        self._sweeper.start()

    def where(self, key: str) -> dict:
        return {"sink": self.name, "key": key, "manifest_key": key + META_SUFFIX}

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self.store.unregister_buffer(buf.data_ptr())
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            code = self.store.register_buffer(buf.data_ptr(), buf.numel())
            if code != 0:
                raise SinkError(f"the Mooncake store could not register a {buf.numel()} byte staging buffer "
                                f"(code {code})")
            self._local.buf = buf
        return buf

    def header(self, key: str, read_header=None) -> Optional[Dict[str, str]]:
        if self._down_since is not None:  # the commit after it fails at once
            return None
        code = self.store.is_exist(key + META_SUFFIX)
        if code != 1:
            self._unanswered(code)
            return None
        raw = self.store.get(key + META_SUFFIX)
        try:
            return dict(json.loads(bytes(raw).decode("utf-8"))["metadata"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    # ---- a master that does not answer -----------------------------------------------------
    def _unanswered(self, code) -> bool:
        """Whether ``code`` says the master did not answer. The first such answer starts an outage:
        requests then fail at once (a call to an absent master takes ~4.3 s to fail, measured) until
        the sweeper hears the master again."""
        if code not in (RPC_FAIL, RPC_TIMEOUT):
            return False
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if first:
            logger.error("the Mooncake master %s does not answer (code %s): requests are failed, by name and at once, "
                         "until it answers again", self.cfg.master, code)
        return True

    def _refuse_while_down(self, key: str) -> None:
        since = self._down_since
        if since is not None:
            raise SinkError(f"the Mooncake store refused the object of {key} (code {RPC_FAIL}: the master "
                            f"{self.cfg.master} did not answer for {time.monotonic() - since:.0f} s; not tried: "
                            f"requests fail at once until it answers again)")

    def _call(self, key: str, what: str, code, ok=(0,)) -> None:
        """Raise the request's error unless ``code`` is one of ``ok`` (None: any answer) (noting a
        master that did not answer)."""
        if self._unanswered(code) or (ok is not None and code not in ok):
            raise _store_error(what, key, code, self.cfg.master)

    def commit(self, key: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
        self._refuse_while_down(key)
        restarts = self._restarts_seen
        man = manifest(key, tensors, metadata)
        total = man["metadata"]["total_aligned_bytes"]
        buf = self._staging(total)
        for name, spec in man["tensors"].items():
            t = tensors[name]
            buf[spec["offset"]: spec["offset"] + spec["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
        meta_key = key + META_SUFFIX
        # an earlier commit's manifest never describes this data
        self._call(key, "the removal of an earlier manifest", self.store.remove(meta_key, force=True), None)
        self._call(key, "the removal of an error marker", self.store.remove(key + ERROR_SUFFIX, force=True), None)
        self._call(key, "the object", self.store.upsert_from(key, buf.data_ptr(), total, self._pin))
        code = self.store.upsert(meta_key, json.dumps(man).encode("utf-8"), self._pin)
        if code != 0:
            self.store.remove(key, force=True)
            self._call(key, "the manifest", code)
        code = self.store.is_exist(key)
        if code == 0 and self._read_already(restarts):
            code = 1
        if code != 1:  # the master that took the manifest does not have the data: it restarted in between
            self._unanswered(code)
            self.store.remove(meta_key, force=True)
            raise SinkError(f"the Mooncake master {self.cfg.master} no longer had the object {key} once its manifest "
                            f"was put (code {code}: it restarted or stopped during the put); not written")
        with self._lock:
            self._objects.pop(key, None)
            self._objects[key] = time.monotonic()
            self._gone.pop(key, None)
            self._unmarked.pop(key, None)
            if len(self._objects) > TRACKED_MAX:
                self._objects.popitem(last=False)
                if not self._tracked_full:
                    self._tracked_full = True
                    logger.warning("the Mooncake sink tracks at most %d objects: older ones are no longer expired "
                                   "after EAGLE3_DUMP_MOONCAKE_TTL_S=%g s; lower it or have readers delete what "
                                   "they read", TRACKED_MAX, self.cfg.ttl_s)
        return dict(self.where(key), manifest=man)

    def put_objects(self, objects: Dict[str, torch.Tensor]) -> None:
        """Put each tensor as one raw, hard-pinned object at its key (SpecForge's layout, ``specforge``):
        all of them or, when one fails, none (those put are removed; an earlier object at a key is
        removed first, so a failed retry leaves nothing a reader could take for it)."""
        self._refuse_while_down(next(iter(objects), "?"))
        specs, total = pack(objects)
        buf = self._staging(total)
        for key, spec in specs.items():
            t = objects[key]
            buf[spec["offset"]: spec["offset"] + spec["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
        put = []
        try:
            for key, spec in specs.items():
                self._call(key, "the removal of an earlier object", self.store.remove(key, force=True), None)
                self._call(key, "the object", self.store.upsert_from(key, buf.data_ptr() + spec["offset"],
                                                                     spec["nbytes"], self._pin))
                put.append(key)
            codes = self.store.batch_is_exist(list(specs))
            lost = [k for k, c in zip(specs, codes) if c != 1]
            if lost:  # the master restarted during the puts
                self._unanswered(codes[0] if codes else None)
                raise SinkError(f"the Mooncake master {self.cfg.master} no longer had {lost[0]} once every object "
                                f"was put (it restarted or stopped during the puts); not written")
        except BaseException:
            for key in put:
                self.store.remove(key, force=True)
            raise

    def _read_already(self, restarts: int) -> bool:
        """Whether an object missing right after its manifest was put was taken by a reader (who reads
        once the manifest is there and may delete it at once) rather than lost to a master that
        restarted during the put. A
        restarted master does not list this sink's sentinel until the sweeper, having counted the
        restart first, puts it again: the sentinel there and no restart counted since the commit
        began means the same master took data and manifest."""
        return (self.store.is_exist(self.sentinel) == 1 and self._restarts_seen == restarts
                and self._forgot_since is None)

    def _mark(self, key: str, why: str, attempts: int = 1) -> bool:
        """Put ``key``'s error marker (pinned; removed after the time to live like an object). With
        the master not answering, it is put once the master answers again (``_unmarked``)."""
        body = json.dumps({"error": why[:4096]}).encode("utf-8")
        code = None
        for attempt in range(attempts):
            if self._down_since is not None:
                code = RPC_FAIL
                break
            try:
                code = self.store.upsert(key + ERROR_SUFFIX, body, self._pin)
            except Exception as exc:  # the request is already failed and named; the marker is a courtesy
                code = repr(exc)
            if code == 0:
                with self._lock:
                    self._markers.pop(key + ERROR_SUFFIX, None)
                    self._markers[key + ERROR_SUFFIX] = time.monotonic() + self.cfg.ttl_s
                    while len(self._markers) > TRACKED_MAX:
                        self._markers.popitem(last=False)
                return True
            if self._unanswered(code):
                break
            if attempt + 1 < attempts:
                time.sleep(0.05 * (attempt + 1))
        if code in (RPC_FAIL, RPC_TIMEOUT):
            with self._lock:
                self._unmarked.pop(key, None)
                self._unmarked[key] = why
                while len(self._unmarked) > MARKED_MAX:
                    self._unmarked.popitem(last=False)
            return False
        logger.error("the error marker of %s could not be put (%s): its readers wait for it until their "
                     "timeout", key, code)
        return False

    def fail(self, key: str, why: str) -> None:
        """Put the marker a reader finds instead of the object, so it fails at once with the reason
        rather than waiting (best effort: a store that takes nothing takes no marker either; one
        whose master does not answer gets it when the master answers again)."""
        self._mark(key, why, attempts=3)

    def _mark_unmarked(self) -> None:
        """The markers of requests failed while the master did not answer, now that it answers."""
        with self._lock:
            items = list(self._unmarked.items())
            self._unmarked.clear()
        for key, why in items:
            with self._lock:
                if key in self._objects:  # committed since (a retry): its data stands
                    continue
            self._mark(key, why)

    # ---- what became of written objects ------------------------------------------------------
    def gone(self, key: str) -> Optional[str]:
        """Why an object this sink wrote is no longer in the store (None: not known to be gone)."""
        with self._lock:
            return self._gone.get(key)

    def counts(self) -> Dict[str, int]:
        """Objects removed unread after their time to live, objects a restarted master no longer had,
        and the master's restarts seen (merged into the writer's counts and flush report)."""
        with self._lock:
            return dict(self._counts)

    def _went(self, keys, why: str, count: str) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                self._gone.pop(key, None)
                self._gone[key] = why
                while len(self._gone) > TRACKED_MAX:
                    self._gone.popitem(last=False)
            self._counts[count] += len(keys)

    def close(self) -> None:
        """Stop the sweeper (the objects stay: they live as long as this process's store client)."""
        self._stop.set()
        if self._sweeper.is_alive() and self._sweeper is not threading.current_thread():
            self._sweeper.join(timeout=30)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self.sweep()
            except Exception:  # the sweeper must outlive a bad answer; the next sweep tries again
                logger.exception("the Mooncake sink's sweep failed")

    def sweep(self) -> None:
        """Notice a master that stopped answering or restarted, then remove what is past its time."""
        if self._master_knows_us():
            self._expire(time.monotonic())

    def _master_knows_us(self) -> bool:
        code = self.store.is_exist(self.sentinel)
        now = time.monotonic()
        if code not in (0, 1):  # no answer: requests fail at once until it answers again
            if not self._unanswered(code):
                logger.error("the Mooncake master %s answered the sink's check with code %s", self.cfg.master, code)
            return False
        was_down = self._down_since
        if code == 1:
            if was_down is not None:
                with self._lock:
                    self._down_since = None
                logger.warning("the Mooncake master %s answers again after %.1f s; the objects put before are "
                               "intact", self.cfg.master, now - was_down)
                self._mark_unmarked()
            return True
        # it answers and does not list our sentinel: a restarted master that knows none of our objects
        if self._forgot_since is None:
            self._forgot_since = was_down if was_down is not None else now
            self._restarts_seen += 1  # before the sentinel is put again: a commit under way sees it (_read_already)
        code = self.store.upsert(self.sentinel, b"1", self._pin)
        if code != 0:  # this client has not mounted its memory with the new master yet (about 1 s)
            return False
        with self._lock:
            self._down_since = None  # requests are tried again
        down, self._forgot_since = now - self._forgot_since, None
        with self._lock:
            keys = list(self._objects)
        gone = []
        for i in range(0, len(keys), 1024):  # objects put since the restart are there; the others are gone
            chunk = keys[i:i + 1024]
            codes = self.store.batch_is_exist([k + META_SUFFIX for k in chunk])
            gone += [k for k, c in zip(chunk, codes) if c == 0]
        why = (f"gone: the Mooncake master {self.cfg.master} restarted after it was written and no longer has it "
               f"(lost unless a reader had already taken it)")
        for key in gone[-MARKED_MAX:]:  # the marker first: a state that says gone has its marker
            self._mark(key, why)
        self._went(gone, why, "gone_at_restart")
        self._mark_unmarked()
        with self._lock:
            self._counts["master_restarts"] += 1
        logger.error("the Mooncake master %s restarted (no answer, or no object of this server, for %.1f s): it no "
                     "longer has %d objects this server wrote%s; they are lost unless a reader had taken them "
                     "(their readers get an error marker, their state says gone); objects put from now on are "
                     "written as before", self.cfg.master, down, len(gone),
                     f" ({', '.join(gone[:5])}{', ...' if len(gone) > 5 else ''})" if gone else "")
        return True

    def _expire(self, now: float) -> None:
        ttl = self.cfg.ttl_s
        with self._lock:
            due = []
            for key, committed in self._objects.items():
                if committed + ttl > now:
                    break
                due.append((key, committed))
            markers = []
            for key, deadline in self._markers.items():
                if deadline > now:
                    break
                markers.append(key)
        expired, done = [], []
        for key, committed in due:
            with self._lock:
                if self._objects.get(key) != committed:  # committed again since: not due
                    continue
            # not forced: a reader's lease (a read in progress) defers the removal to a later sweep
            code = self.store.remove(key + META_SUFFIX)
            if code not in (0, NOT_FOUND):
                continue
            code = self.store.remove(key)
            if code == 0:
                expired.append(key)  # nobody had deleted it
            elif code == NOT_FOUND:
                done.append(key)  # read and deleted (a reader that deleted the data only leaves the manifest)
        with self._lock:
            for key in done:
                self._objects.pop(key, None)
        if expired:
            why = (f"gone: expired: nobody deleted it within EAGLE3_DUMP_MOONCAKE_TTL_S={ttl:g} s of its commit; "
                   f"the server removed it")
            for key in expired:
                self._mark(key, why)
            self._went(expired, why, "expired")
            logger.warning("the Mooncake sink removed %d objects nobody deleted within EAGLE3_DUMP_MOONCAKE_TTL_S="
                           "%g s (%s%s); %d expired so far", len(expired), ttl, ", ".join(expired[:5]),
                           ", ..." if len(expired) > 5 else "", self.counts()["expired"])
        for marker in markers:
            code = self.store.remove(marker)
            if code in (0, NOT_FOUND):
                with self._lock:
                    if self._markers.get(marker, now + 1) <= now:
                        self._markers.pop(marker, None)
