"""Where a request's states go: a file in the dump directory, or one object in a Mooncake Store.

Both sinks take what the writer cut for one request (tensor name -> host tensor, the file
metadata) and commit it whole or not at all; ``header(key)`` is what a request's earlier commit
recorded (None: nothing there), which the writer compares before it writes again.

- ``FileSink`` (``EAGLE3_DUMP_SINK=file``, the default): ``<key>.safetensors`` written under a
  temporary name, fsynced, renamed, the directory fsynced.
- ``MooncakeSink`` (``EAGLE3_DUMP_SINK=mooncake``): the tensors packed into one object at 64-byte
  aligned offsets (``pack``), put under the request's key, then a small JSON object ``<key>:meta``
  with the manifest: ``{"version": 1, "handle": key, "tensors": {name: {shape, dtype, nbytes,
  offset}}, "metadata": {"total_aligned_bytes": n, ...the file metadata}}``. The manifest is the
  layout hs-connectors' ``MooncakeHiddenStatesStore.get_sample`` reads; the meta object is put
  after the data, so a reader that finds it finds the data whole (each put is atomic). The
  writing rank only connects (``mooncake.store.MooncakeDistributedStore``, imported at start).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Dict, Optional

import torch

ALIGN = 64  # byte alignment of each tensor in a Mooncake object (hs-connectors' _TENSOR_ALIGN)
MANIFEST_VERSION = 1
META_SUFFIX = ":meta"
ERROR_SUFFIX = ":error"  # a failed commit's marker: {"error": why} (hs-connectors' readers check it first)
FILE_MODE = 0o644  # dump files and the stop ledger: a shared directory's readers may run as other users
HOST = socket.gethostname()  # in temporary and ledger names: replicas on several hosts share a directory


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class SinkError(RuntimeError):
    """A commit that did not happen; the message says why (the request's answer and log show it)."""


class FileSink:
    name = "file"

    def __init__(self, directory: str):
        self.directory = directory

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.safetensors")

    def where(self, key: str) -> dict:
        return {"sink": self.name, "file": f"{key}.safetensors"}

    def header(self, key: str, read_header) -> Optional[Dict[str, str]]:
        return read_header(self.path(key))

    def commit(self, key: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
        from safetensors.torch import save_file

        path = self.path(key)
        tmp = os.path.join(self.directory, f".{key}.{HOST}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, FILE_MODE)  # readable by a client of another user, whatever the umask
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(self.directory)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return self.where(key)

    def fail(self, key: str, why: str) -> None:
        """Nothing to mark: a missing file and the stop ledger say it."""


def _store_error(what: str, key: str, code) -> SinkError:
    return SinkError(f"the Mooncake store refused {what} of {key} (code {code}; a full store: raise "
                     f"EAGLE3_DUMP_MOONCAKE_SEGMENT_MB on the store's clients or consume and delete objects)")


class MooncakeSink:
    name = "mooncake"

    def __init__(self, cfg):
        """``cfg``: ``settings.MooncakeSettings``. Connects now (the writer's start)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise SinkError(f"EAGLE3_DUMP_SINK=mooncake but the mooncake package cannot be imported ({exc}); "
                            f"pip install mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-non-cuda, "
                            f"and Debian's libibverbs1") from None
        self.cfg = cfg
        self.store = MooncakeDistributedStore()
        code = self.store.setup(cfg.local_host, cfg.metadata_server, cfg.segment_bytes, cfg.buffer_bytes,
                                cfg.protocol, cfg.device, cfg.master)
        if code != 0:
            raise SinkError(f"EAGLE3_DUMP_SINK=mooncake: connecting to the master {cfg.master} (metadata "
                            f"{cfg.metadata_server}, {cfg.protocol}) failed with code {code}; check "
                            f"EAGLE3_DUMP_MOONCAKE_MASTER and EAGLE3_DUMP_MOONCAKE_METADATA")
        self._local = threading.local()  # each writer thread's registered staging buffer

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
        if self.store.is_exist(key + META_SUFFIX) != 1:
            return None
        raw = self.store.get(key + META_SUFFIX)
        try:
            return dict(json.loads(bytes(raw).decode("utf-8"))["metadata"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def commit(self, key: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
        man = manifest(key, tensors, metadata)
        total = man["metadata"]["total_aligned_bytes"]
        buf = self._staging(total)
        for name, spec in man["tensors"].items():
            t = tensors[name]
            buf[spec["offset"]: spec["offset"] + spec["nbytes"]].view(t.dtype).view(t.shape).copy_(t)
        meta_key = key + META_SUFFIX
        self.store.remove(meta_key, force=True)  # an earlier commit's manifest never describes this data
        self.store.remove(key + ERROR_SUFFIX, force=True)
        code = self.store.upsert_from(key, buf.data_ptr(), total)
        if code != 0:
            raise _store_error("the object", key, code)
        code = self.store.upsert(meta_key, json.dumps(man).encode("utf-8"))
        if code != 0:
            self.store.remove(key, force=True)
            raise _store_error("the manifest", key, code)
        return dict(self.where(key), manifest=man)

    def fail(self, key: str, why: str) -> None:
        """Put the marker a reader finds instead of the object, so it fails at once with the reason
        rather than waiting (best effort: a store that takes nothing takes no marker either)."""
        body = json.dumps({"error": why[:4096]}).encode("utf-8")
        for attempt in range(3):
            try:
                code = self.store.upsert(key + ERROR_SUFFIX, body)
            except Exception as exc:  # the request is already failed and named; the marker is a courtesy
                code = repr(exc)
            if code == 0:
                return
            time.sleep(0.05 * (attempt + 1))
        logging.getLogger(__name__).error("the error marker of %s could not be put (%s): its readers wait "
                                          "for it until their timeout", key, code)

