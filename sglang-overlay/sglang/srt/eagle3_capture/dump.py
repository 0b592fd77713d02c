"""Per-request prefill hidden-state dump: one safetensors file per request.

The forward thread only slices and starts device-to-host copies into reused (pinned, on CUDA)
host buffers; a writer thread waits for the copies and writes ``<key>.safetensors`` through a
temporary name and a rename, so readers never see a partial file. Bytes copied but not yet
written are capped: when the cap is reached the forward waits (backpressure), nothing is
dropped. A failed write (a full disk, say) is logged with its key and counted; the temporary
file is removed and later requests are written again once space returns.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .staging import HostStaging
from .settings import (
    ENV_DIR,
    SERIES_RELEASE,
    SERIES_VERSION,
    DumpConfigError,
    DumpSettings,
    capture_index,
    check_directory,
    check_server_args,
    hf_index,
)

logger = logging.getLogger(__name__)

FORMAT = "eagle3-dump/1"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dump_key(token_ids: Sequence[int]) -> str:
    """File key of a request: sha256 of its prompt token ids written as '1,2,3'."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


class _Job:
    def __init__(self, tensors, buffers, held, event, spans):
        self.tensors: Dict[str, torch.Tensor] = tensors
        self.buffers = buffers
        self.held = held
        self.event = event
        self.spans: List[Tuple[int, int]] = spans


class DumpWriter:
    def __init__(self, directory: str, layer_ids: List[int], final: bool,
                 max_pending_bytes: int, metadata: Dict[str, str], enabled: bool = True):
        self.directory = directory
        self.layer_ids = layer_ids
        self.final = final
        self.metadata = metadata
        self.enabled = enabled
        self.written = 0
        self.failed = 0
        self.skipped = 0
        self.staging = HostStaging(max_pending_bytes, pinned=torch.cuda.is_available())
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._thread = None
        if enabled:
            self._thread = threading.Thread(
                target=self._run, name="eagle3-dump-writer", daemon=True
            )
            self._thread.start()
            atexit.register(self.close)

    # ---- forward thread -------------------------------------------------------------
    def submit(self, forward_batch, captured: Dict[int, torch.Tensor], final) -> None:
        # Only plain prefill: decode, idle, mixed and speculative forwards write nothing.
        if not self.enabled or forward_batch.forward_mode.name != "EXTEND":
            return
        seq_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        prefix_lens = [int(n) for n in forward_batch.extend_prefix_lens_cpu or [0] * len(seq_lens)]
        spans, start = [], 0
        for length, prefix in zip(seq_lens, prefix_lens):
            if prefix:
                self.skipped += 1
                logger.error(
                    "%s: a request with %d cached prefix tokens was not dumped "
                    "(its rows would be incomplete)", ENV_DIR, prefix,
                )
            else:
                spans.append((start, length))
            start += length
        if not spans:
            return
        sources = {"input_ids": forward_batch.input_ids}
        for layer_id in self.layer_ids:
            sources[f"layer.{layer_id}"] = captured[capture_index(layer_id)]
        if self.final:
            sources["final"] = final
        # Host tensors of this forward are fresh (captures are owned copies, the final state is
        # a new norm output) and nothing writes them later: they are written without a copy.
        # Device tensors (and the ids, which the scheduler reuses) go through host buffers.
        copied = [n for n, t in sources.items() if t.is_cuda or n == "input_ids"]
        held = sum(_nbytes(t) for n, t in sources.items() if n not in copied)
        buffers = self.staging.reserve([_nbytes(sources[n]) for n in copied], held)
        tensors = {n: t.contiguous() for n, t in sources.items() if n not in copied}
        for name, buf in zip(copied, buffers):
            src = sources[name]
            host = buf[: _nbytes(src)].view(src.dtype).view(src.shape)
            host.copy_(src, non_blocking=True)
            tensors[name] = host
        event = None
        if sources["input_ids"].is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._queue.put(_Job(tensors, buffers, held, event, spans))

    @property
    def pending_bytes(self) -> int:
        return self.staging.in_use

    @property
    def peak_pending_bytes(self) -> int:
        return self.staging.peak_in_use

    @property
    def max_pending_bytes(self) -> int:
        return self.staging.cap

    # ---- writer thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                if job.event is not None:
                    job.event.synchronize()
                for start, length in job.spans:
                    self._write_one(job.tensors, start, length)
            except Exception:  # the thread must outlive any one job, or the forward would hang
                self.failed += len(job.spans)
                logger.exception("%s: a batch of %d requests was not dumped", ENV_DIR, len(job.spans))
            finally:
                self.staging.release(job.buffers, job.held)
                self._queue.task_done()

    def _write_one(self, tensors, start: int, length: int) -> None:
        from safetensors.torch import save_file

        ids = tensors["input_ids"][start : start + length].to(torch.int64)
        key = dump_key(ids.tolist())
        out = {"input_ids": ids}
        for name, host in tensors.items():
            if name != "input_ids":
                out[name] = host[start : start + length]
        metadata = dict(self.metadata, key=key, num_tokens=str(length))
        path = os.path.join(self.directory, f"{key}.safetensors")
        tmp = os.path.join(self.directory, f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file(out, tmp, metadata=metadata)
            os.replace(tmp, path)
            self.written += 1
        except Exception as exc:  # a full or vanished disk must not stop serving
            self.failed += 1
            logger.error("%s: dump %s failed (%s); %d failed so far", ENV_DIR, key, exc, self.failed)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def flush(self) -> None:
        """Wait until every submitted request is written (or has failed)."""
        if self.enabled:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join()
            logger.info("%s: %d dumps written, %d failed, %d skipped", ENV_DIR,
                        self.written, self.failed, self.skipped)


def start_dump(runner, target, settings: DumpSettings):
    """Check the server settings, then start the writer; returns (capture indices, writer)."""
    from sglang.srt.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    if not isinstance(target, DeepseekV2ForCausalLM):
        raise DumpConfigError(
            f"{ENV_DIR} is set but {type(target).__name__} is not supported; the dump "
            f"covers DeepSeek-V2/V3 and Kimi-K2.5 models: unset {ENV_DIR}"
        )
    config = target.config
    num_layers = config.num_hidden_layers
    layer_ids = settings.resolved_layer_ids(num_layers)
    check_server_args(runner.server_args, runner.model_config.context_len)
    check_directory(settings.directory)
    from sglang.version import __version__ as sglang_version

    if sglang_version.startswith("0.0.0"):  # a source checkout without build metadata
        sglang_version = SERIES_RELEASE

    dtype = str(runner.model_config.dtype).replace("torch.", "")
    architectures = getattr(runner.model_config.hf_config, "architectures", None) or [
        type(runner.model).__name__
    ]
    metadata = {
        "format": FORMAT,
        "eagle3_layer_ids": json.dumps(layer_ids),
        "hf_hidden_state_indices": json.dumps([hf_index(k) for k in layer_ids]),
        "final": "post_norm" if settings.final else "none",
        "architecture": architectures[0],
        "model_path": str(runner.server_args.model_path),
        "hidden_size": str(config.hidden_size),
        "num_hidden_layers": str(num_layers),
        "dtype": dtype,
        "sglang_version": str(sglang_version),
        "series_version": SERIES_VERSION,
        "tp_size": str(get_tensor_model_parallel_world_size()),
    }
    writer = DumpWriter(
        settings.directory,
        layer_ids,
        settings.final,
        settings.max_pending_bytes,
        metadata,
        enabled=get_tensor_model_parallel_rank() == 0,
    )
    logger.info(
        "%s: dumping prefill hidden states to %s (EAGLE-3 layer ids %s, final %s, "
        "pending cap %d MiB)", ENV_DIR, settings.directory, layer_ids, settings.final,
        settings.max_pending_bytes >> 20,
    )
    return [capture_index(k) for k in layer_ids], writer
