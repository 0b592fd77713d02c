"""Mooncake for the online sink (``EAGLE3_DUMP_SINK=mooncake``): its Python package beside an
environment, a ``mooncake_master`` with its HTTP metadata server, and the reader of what the
dump puts in the store.

- ``ensure_site(python)``: the CPU wheel (``WHEEL``) installed with ``pip --target`` into a cached
  directory keyed by the wheel and the interpreter (``~/.cache/eaglepatch/mooncake-<key>``), put on
  ``PYTHONPATH`` beside the CPU SGLang environment (``with_site``). Its native code needs Debian's
  ``libibverbs1`` even for TCP (``eaglepatch.sysdeps`` installs it).
- ``Master``: ``mooncake_master`` on free localhost ports with ``--enable_http_metadata_server``,
  started and stopped (or killed and restarted) by the caller; its RPC and metrics servers bound to
  127.0.0.1 (``--rpc_address``, ``--metrics_host``). Its HTTP metadata server listens on every
  address whatever ``--http_metadata_server_host`` says, and so do the two ports every store client
  (the server's sink, a reader) opens (``listeners``; measured with ``WHEEL``, docs/online.md).
- ``INSTALL``: where the package and ``mooncake_master`` come from (the overlay's
  ``sinks.MOONCAKE_INSTALL``, held equal by tests/test_mooncake.py).
- ``StoreReader``: a store client that turns a request's handle (``meta_info["eagle3_dump"]``) or
  key into the dump's tensors and metadata, and into the same ``extract.dumps.Dump`` a file gives.
  Every field of the manifest is checked before a byte is read (``check_manifest``): a bad one is a
  ``StoreError`` naming the field, never data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import cpuenv

WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# where the store's package comes from; the overlay's sinks.MOONCAKE_INSTALL says the same on the server
INSTALL = ("pip install mooncake-transfer-engine (CUDA 12), mooncake-transfer-engine-cuda13 (CUDA 13) or "
           "mooncake-transfer-engine-non-cuda (no GPU) into the server's Python environment (the same package "
           "holds mooncake_master); its native code needs Debian's libibverbs1 even for TCP "
           "(apt-get install libibverbs1)")
COMPLETE = ".eaglepatch-complete"
META_SUFFIX = ":meta"  # the overlay's sinks.META_SUFFIX
ERROR_SUFFIX = ":error"  # sinks.ERROR_SUFFIX: a failed commit's {"error": why}
# a request's keys: the sha256 (hex) of its rid (the overlay's identity.file_key), alone (the data) or with a
# suffix; a sink's sentinel ("eagle3-dump-sink:host:pid:id") does not match
OBJECT_KEYS = r"^[0-9a-f]{64}(:meta|:error)?$"
MANIFEST_VERSION = 1
ALIGN = 64  # the sink's byte alignment of each tensor in an object (sinks.ALIGN, hs-connectors' _TENSOR_ALIGN)
# the tensor dtypes a manifest may name, with their bytes per element (torch's names, with or without
# the "torch." prefix, as hs-connectors' _parse_dtype reads them)
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
          "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
TOTAL = "total_aligned_bytes"  # the metadata field holding the object's size (the only one not a string)
LEASE_EXPIRED = -707  # Mooncake's ErrorCode: the read outlasted the master's --default_kv_lease_ttl
LEASE_TRIES = 4  # reads of one object before a LEASE_EXPIRED is an error


def site_dir(python: Path) -> Path:
    tag = subprocess.run([str(python), "-c", "import sys; print(sys.implementation.cache_tag)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256(f"{WHEEL} {tag}".encode()).hexdigest()[:12]
    return cpuenv.cache_dir() / f"mooncake-{key}"


def ensure_site(python: Path) -> Path:
    """The directory holding the ``mooncake`` package for ``python`` (installed once, then reused)."""
    d = site_dir(python)
    if (d / COMPLETE).is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / (d.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / COMPLETE).is_file():
            return d
        shutil.rmtree(d, ignore_errors=True)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[mooncake] installing {WHEEL} into {d}", file=sys.stderr, flush=True)
        p = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                            "--target", str(tmp), WHEEL], capture_output=True, text=True)
        if p.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"error: pip could not install {WHEEL} ({(p.stderr.strip().splitlines() or ['?'])[-1]}); "
                               f"check the package index and rerun")
        (tmp / COMPLETE).write_text(WHEEL + "\n")
        os.replace(tmp, d)
    return d


def with_site(env: dict, site: Path) -> dict:
    """``env`` with ``site`` first on ``PYTHONPATH``."""
    rest = env.get("PYTHONPATH")
    return dict(env, PYTHONPATH=os.pathsep.join([str(site)] + ([rest] if rest else [])))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Master:
    """``mooncake_master`` with its HTTP metadata server on free localhost ports."""

    def __init__(self, site: Path, log: Path, kv_lease_ms: int | None = None):
        self.binary = Path(site) / "mooncake" / "mooncake_master"
        self.log = Path(log)
        # its admin/metrics server too: on its default (0.0.0.0:9003) a second master on the host ends at start
        self.port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.kv_lease_ms = kv_lease_ms
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def env(self) -> dict:
        """The dump settings that point the sink here."""
        return {"EAGLE3_DUMP_SINK": "mooncake", "EAGLE3_DUMP_MOONCAKE_MASTER": self.address,
                "EAGLE3_DUMP_MOONCAKE_METADATA": self.metadata, "EAGLE3_DUMP_MOONCAKE_HOST": "127.0.0.1",
                "EAGLE3_DUMP_MOONCAKE_SEGMENT_MB": "256", "EAGLE3_DUMP_MOONCAKE_BUFFER_MB": "64"}

    def start(self, timeout: float = 120.0) -> "Master":
        args = [str(self.binary), f"--port={self.port}", "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self.http_port}", "--http_metadata_server_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}"]
        helptext = subprocess.run([str(self.binary), "--helpfull"], capture_output=True, text=True).stdout
        if "-metrics_host" in helptext:  # older masters (the CUDA 13 wheel 0.3.11) bind metrics on all addresses
            args.append("--metrics_host=127.0.0.1")
        if "-rpc_address" in helptext:  # its RPC port binds 0.0.0.0 by default
            args.append("--rpc_address=127.0.0.1")
        if self.kv_lease_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.kv_lease_ms}")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while not (_accepts(self.port) and _accepts(self.http_port)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master ended with {self.proc.returncode}: {self.log.read_text()[-800:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not listen within {timeout:g} s: {self.log.read_text()[-800:]}")
            time.sleep(0.1)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc = None

    def __enter__(self) -> "Master":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def listeners(pid: int) -> list:
    """(address, port) of every TCP socket process ``pid`` listens on (Linux: its socket inodes in
    /proc/<pid>/fd matched with /proc/net/tcp and tcp6); '0.0.0.0' and '::' are every address."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))  # each 32-bit word little-endian
            out.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return sorted(out)


class StoreError(RuntimeError):
    """A handle or key whose object is not (or not yet) readable; the message says which and why."""


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def handle_key(handle) -> str:
    """The object key of a handle (an answer's ``meta_info["eagle3_dump"]`` of the Mooncake sink) or of
    a key given as it is; StoreError for anything else (a file sink's handle, a malformed one)."""
    if isinstance(handle, str) and handle:
        return handle
    if isinstance(handle, dict):
        if handle.get("sink", "mooncake") != "mooncake":
            raise StoreError(f"the handle is a {handle.get('sink')!r} sink's ({str(handle)[:120]}), not a Mooncake "
                             f"object's; read its file from the dump directory")
        key = handle.get("key")
        if isinstance(key, str) and key:
            return key
    raise StoreError(f"{str(handle)[:120]!r} is not a handle of the Mooncake sink (an answer's "
                     f"meta_info['eagle3_dump'] with its 'key') nor a key")


def check_manifest(man, key: str) -> dict:
    """``man`` (a manifest as read) checked field by field for the object ``key``: ``version`` 1,
    ``handle`` = ``key``, ``metadata`` a dict of strings with ``total_aligned_bytes`` a non-negative
    int, ``tensors`` a dict of name -> {shape: non-negative ints, dtype: one of ``DTYPES``, nbytes: the
    shape's elements times the dtype's size, offset: a multiple of ``ALIGN``}, every tensor inside
    the object and none overlapping another. Returns {name: (offset, nbytes, dtype name, shape)};
    StoreError (one line naming the field) otherwise, before any byte is read."""
    def bad(what: str) -> StoreError:
        return StoreError(f"the manifest of {key} is malformed: {what}; nothing read (the object was not written by "
                          f"this project's Mooncake sink, or was damaged)")

    if not isinstance(man, dict):
        raise bad(f"it is a {type(man).__name__}, not an object")
    extra = sorted(map(str, set(man) - {"version", "handle", "tensors", "metadata"}))
    if extra:
        raise bad(f"unknown fields {extra}")
    if not _int(man.get("version")) or man["version"] != MANIFEST_VERSION:
        raise StoreError(f"the manifest of {key} is version {man.get('version')!r}; this reader knows version "
                         f"{MANIFEST_VERSION}")
    if man.get("handle") != key:
        raise bad(f"its handle {str(man.get('handle'))[:80]!r} is not the key")
    meta = man.get("metadata")
    if not isinstance(meta, dict):
        raise bad("metadata is not an object")
    total = meta.get(TOTAL)
    if not _int(total) or total < 0:
        raise bad(f"metadata {TOTAL}={total!r} is not a non-negative integer")
    odd = [k for k, v in meta.items() if not isinstance(k, str) or (k != TOTAL and not isinstance(v, str))]
    if odd:
        raise bad(f"metadata {str(odd[0])[:60]!r} is not a string")
    tensors = man.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors is not an object")
    out, spans = {}, []
    for name, spec in tensors.items():
        if not isinstance(spec, dict) or set(spec) != {"shape", "dtype", "nbytes", "offset"}:
            raise bad(f"tensor {str(name)[:60]!r} is not {{shape, dtype, nbytes, offset}}")
        shape, dtype, nbytes, offset = spec["shape"], spec["dtype"], spec["nbytes"], spec["offset"]
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r} has shape {str(shape)[:60]}, not a list of non-negative integers")
        dname = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
        if dname not in DTYPES:
            raise bad(f"tensor {name!r} has dtype {str(dtype)[:40]!r}, not one of {', '.join(DTYPES)}")
        numel = 1
        for d in shape:
            numel *= d
        if not _int(nbytes) or nbytes != numel * DTYPES[dname]:
            raise bad(f"tensor {name!r} has nbytes {str(nbytes)[:40]}, its shape {shape} of {dname} is "
                      f"{numel * DTYPES[dname]} bytes")
        if not _int(offset) or offset < 0 or offset % ALIGN:
            raise bad(f"tensor {name!r} has offset {str(offset)[:40]}, not a non-negative multiple of {ALIGN}")
        if offset + nbytes > total:
            raise bad(f"tensor {name!r} ends at byte {offset + nbytes}, past the object's {total}")
        out[name] = (offset, nbytes, dname, tuple(shape))
        spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise bad(f"tensors {a!r} and {b!r} overlap")
    last = spans[-1][1] if spans else 0
    if total > -(-last // ALIGN) * ALIGN:
        raise bad(f"metadata {TOTAL}={total} is more than its tensors take ({last} bytes, aligned)")
    return out


class StoreReader:
    """A Mooncake Store client reading the dump's objects (it lends the store no memory)."""

    def __init__(self, master: str, metadata: str, local_host: str = "127.0.0.1", protocol: str = "tcp",
                 buffer_mb: int = 64):
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        self.store = MooncakeDistributedStore()
        code = self.store.setup(local_host, metadata, 0, buffer_mb << 20, protocol, "", master)
        if code != 0:
            raise StoreError(f"cannot connect to the Mooncake master {master} (metadata {metadata}): code {code}")
        # one registered read buffer per thread, kept and grown: a registration is a round trip to the
        # metadata server, which a reader paying it twice per object felt (benchmarks/online.py)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._buffers: dict = {}

    def _buffer(self, nbytes: int):
        import torch

        buf = getattr(self._local, "buf", None)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if buf is not None:
            self.store.unregister_buffer(buf.data_ptr())
            with self._lock:
                self._buffers.pop(buf.data_ptr(), None)
            self._local.buf = None
        size = 1 << max(20, (max(nbytes, 1) - 1).bit_length())
        buf = torch.empty(size, dtype=torch.uint8)
        code = self.store.register_buffer(buf.data_ptr(), buf.numel())
        if code != 0:
            raise StoreError(f"cannot register a {buf.numel()} byte buffer with the store (code {code})")
        self._local.buf = buf
        with self._lock:
            self._buffers[buf.data_ptr()] = buf
        return buf

    def _read(self, key: str, nbytes: int) -> tuple:
        """(code, buffer): ``key``'s ``nbytes`` read into this thread's buffer. A read that outlasts
        the lease the master gave it (-707: under load, a large object) is read again: the object is
        pinned and still there unless a reader deleted it (then another code)."""
        buf = self._buffer(nbytes)
        for _ in range(LEASE_TRIES):
            got = self.store.get_into(key, buf.data_ptr(), nbytes)
            if got != LEASE_EXPIRED:
                break
        return got, buf

    @staticmethod
    def _lease_error(key: str, nbytes: int) -> StoreError:
        return StoreError(f"the object {key} ({nbytes} bytes) could not be read within the master's lease in "
                          f"{LEASE_TRIES} tries (code -707, LEASE_EXPIRED); raise mooncake_master's "
                          f"--default_kv_lease_ttl above the slowest read, or read fewer objects at once")

    def close(self) -> None:
        """Unregister the read buffers and leave the store (before its master stops: quieter)."""
        with self._lock:
            bufs, self._buffers = list(self._buffers.values()), {}
        for buf in bufs:
            self.store.unregister_buffer(buf.data_ptr())
        self._local = threading.local()
        self.store.close()

    def manifest(self, handle, timeout: float = 0.0) -> dict:
        """The manifest of a handle (``meta_info["eagle3_dump"]``) or key, waiting up to ``timeout``
        seconds for it to appear (the answer may come before the object is in the store)."""
        key = handle_key(handle)
        deadline = time.monotonic() + timeout
        while (code := self.store.is_exist(key + META_SUFFIX)) != 1:
            if self.store.is_exist(key + ERROR_SUFFIX) == 1:
                raw = bytes(self.store.get(key + ERROR_SUFFIX))
                try:
                    why = json.loads(raw.decode("utf-8"))["error"]
                except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                    why = raw[:200]
                raise StoreError(f"the server could not put {key}, or removed it: {why}")
            if time.monotonic() >= deadline and code < 0:  # a master restarted: this client reconnects in seconds
                raise StoreError(f"the Mooncake master {self.master} did not answer (code {code}) for {key}; wait "
                                 f"for it (a longer timeout) or check that it runs")
            if time.monotonic() >= deadline:
                raise StoreError(f"no object {key} in the store (not yet written, failed, deleted, expired, or lost "
                                 f"at a restart of the master)")
            time.sleep(0.02)
        size = self.store.get_size(key + META_SUFFIX)
        got, buf = self._read(key + META_SUFFIX, size) if size > 0 else (size, None)
        if got == LEASE_EXPIRED:
            raise self._lease_error(key + META_SUFFIX, size)
        if got <= 0:  # listed by the master, its memory gone: the client that held it stopped
            raise StoreError(f"the object {key} is listed but its memory is gone (the server whose share of the "
                             f"store held it stopped; read objects while their server runs) (code {got})")
        raw = bytes(buf[:got].numpy())
        try:
            man = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise StoreError(f"the manifest of {key} is not JSON ({' '.join(str(exc).split())[:120]})") from None
        check_manifest(man, key)
        if isinstance(handle, dict) and "manifest" in handle and handle["manifest"] != man:
            raise StoreError(f"the store's manifest of {key} is not the one the answer carried: the object was "
                             f"written again since (another launch, or another request with the same rid); "
                             f"nothing read")
        return man

    def tensors(self, handle, timeout: float = 0.0, delete: bool = False) -> tuple:
        """({name: tensor}, file metadata) of a handle or key; ``delete``: then remove the object
        (``delete``), as a consumer that reads each request once should (the server removes what
        nobody deleted only after ``EAGLE3_DUMP_MOONCAKE_TTL_S``)."""
        import torch

        man = self.manifest(handle, timeout)
        key, total = man["handle"], man["metadata"][TOTAL]
        specs = check_manifest(man, key)
        size = self.store.get_size(key)
        if size >= 0 and size != total:  # before a buffer of the manifest's size is allocated
            raise StoreError(f"the object {key} has {size} bytes, its manifest says {total}; nothing read")
        got, buf = self._read(key, total)
        if got == LEASE_EXPIRED:
            raise self._lease_error(key, total)
        if got < 0:  # the manifest was there, the data is not (removed, expired, or lost since)
            raise StoreError(f"the object {key} has a manifest but its data could not be read (code {got}: deleted, "
                             f"expired or lost after its manifest was read); nothing returned")
        if got != total:
            raise StoreError(f"the object {key} gave {got} bytes, its manifest says {total}")
        out = {}
        for name, (offset, nbytes, dtype, shape) in specs.items():
            out[name] = buf[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape).clone()
        meta = {k: v for k, v in man["metadata"].items() if k != TOTAL}
        if delete:
            self.delete(key)
        return out, meta

    def load(self, handle, rebuilder=None, timeout: float = 0.0, delete: bool = False):
        """The ``extract.dumps.Dump`` of a handle or key: what the same request's file gives;
        ``delete``: the object is removed once read."""
        from .extract.dumps import decode

        tensors, meta = self.tensors(handle, timeout, delete=delete)
        return decode(Path("mooncake:" + meta.get("key", "?")), meta, tensors, rebuilder)

    def clear(self) -> int:
        """Remove every request object of the store, whichever server wrote it (forced: past read leases):
        data, manifest and error marker, the keys ``OBJECT_KEYS`` matches; the number of keys removed. The
        sinks' sentinels stay: a server that misses its own counts a restart of the master. For a store one
        run owns alone (a benchmark between its passes), never a shared one."""
        n = self.store.remove_by_regex(OBJECT_KEYS, force=True)
        if n < 0:
            raise StoreError(f"the Mooncake master {self.master} did not remove its objects (code {n})")
        return n

    def delete(self, handle) -> None:
        """Remove a request's object and manifest (the manifest first: a reader never finds a
        manifest without its data), and its error marker. Forced: this reader's own look at the
        object gave it a lease (Mooncake refuses a plain removal under one for its ``default_kv_lease_ttl``)."""
        key = handle_key(handle)
        for k in (key + META_SUFFIX, key, key + ERROR_SUFFIX):
            self.store.remove(k, force=True)
