"""Mooncake for the online sink (``EAGLE3_DUMP_SINK=mooncake``): its Python package beside an
environment, a ``mooncake_master`` with its HTTP metadata server, and the reader of what the
dump puts in the store.

- ``ensure_site(python)``: the CPU wheel (``WHEEL``) installed with ``pip --target`` into a cached
  directory keyed by the wheel and the interpreter (``~/.cache/eaglepatch/mooncake-<key>``), put on
  ``PYTHONPATH`` beside the CPU SGLang environment (``with_site``). Its native code needs Debian's
  ``libibverbs1`` even for TCP (``eaglepatch.sysdeps`` installs it).
- ``Master``: ``mooncake_master`` on free localhost ports with ``--enable_http_metadata_server``,
  started and stopped (or killed and restarted) by the caller.
- ``StoreReader``: a store client that turns a request's handle (``meta_info["eagle3_dump"]``) or
  key into the dump's tensors and metadata, and into the same ``extract.dumps.Dump`` a file gives.
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
COMPLETE = ".eaglepatch-complete"
META_SUFFIX = ":meta"  # the overlay's sinks.META_SUFFIX
ERROR_SUFFIX = ":error"  # sinks.ERROR_SUFFIX: a failed commit's {"error": why}
MANIFEST_VERSION = 1
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


class StoreError(RuntimeError):
    """A handle or key whose object is not (or not yet) readable; the message says which and why."""


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
        key = handle["key"] if isinstance(handle, dict) else str(handle)
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
        except (ValueError, UnicodeDecodeError) as exc:
            raise StoreError(f"the manifest of {key} is not JSON ({exc})") from None
        if man.get("version") != MANIFEST_VERSION or man.get("handle") != key:
            raise StoreError(f"the manifest of {key} is version {man.get('version')!r} for {man.get('handle')!r}; "
                             f"this reader knows version {MANIFEST_VERSION}")
        return man

    def tensors(self, handle, timeout: float = 0.0, delete: bool = False) -> tuple:
        """({name: tensor}, file metadata) of a handle or key; ``delete``: then remove the object
        (``delete``), as a consumer that reads each request once should (the server removes what
        nobody deleted only after ``EAGLE3_DUMP_MOONCAKE_TTL_S``)."""
        import torch

        man = self.manifest(handle, timeout)
        key, total = man["handle"], int(man["metadata"]["total_aligned_bytes"])
        got, buf = self._read(key, total)
        if got == LEASE_EXPIRED:
            raise self._lease_error(key, total)
        if got < 0:  # the manifest was there, the data is not (removed, expired, or lost since)
            raise StoreError(f"the object {key} has a manifest but its data could not be read (code {got}: deleted, "
                             f"expired or lost after its manifest was read); nothing returned")
        if got != total:
            raise StoreError(f"the object {key} gave {got} bytes, its manifest says {total}")
        out = {}
        for name, spec in man["tensors"].items():
            dtype = getattr(torch, str(spec["dtype"]).replace("torch.", ""))
            end = int(spec["offset"]) + int(spec["nbytes"])
            if end > total:
                raise StoreError(f"{key}: tensor {name} ends at byte {end}, past the object's {total}")
            out[name] = buf[int(spec["offset"]):end].view(dtype).view(tuple(spec["shape"])).clone()
        meta = {k: v for k, v in man["metadata"].items() if k != "total_aligned_bytes"}
        if delete:
            self.delete(key)
        return out, meta

    def load(self, handle, rebuilder=None, timeout: float = 0.0, delete: bool = False):
        """The ``extract.dumps.Dump`` of a handle or key: what the same request's file gives;
        ``delete``: the object is removed once read."""
        from .extract.dumps import decode

        tensors, meta = self.tensors(handle, timeout, delete=delete)
        return decode(Path("mooncake:" + meta.get("key", "?")), meta, tensors, rebuilder)

    def delete(self, handle) -> None:
        """Remove a request's object and manifest (the manifest first: a reader never finds a
        manifest without its data), and its error marker. Forced: this reader's own look at the
        object gave it a lease (Mooncake refuses a plain removal under one for its ``default_kv_lease_ttl``)."""
        key = handle["key"] if isinstance(handle, dict) else str(handle)
        for k in (key + META_SUFFIX, key, key + ERROR_SUFFIX):
            self.store.remove(k, force=True)
