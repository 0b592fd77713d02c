"""Per-request prefill hidden-state dump: one safetensors file per request.

The forward thread only starts device-to-host copies of a prefill's rows into one host arena
allocated at start (page-locked on CUDA; ``staging``), on a side stream so that the forward's next kernels do not wait for them;
a gather thread waits for the copies and cuts the rows per request, and the writer threads
(``commits``: ``EAGLE3_DUMP_WRITERS``, several files at once) write ``<key>.safetensors`` through a
temporary name (unique across hosts) and a rename, with the file fsynced before and the directory
after the rename: readers never see a partial file, and a node crash leaves either the whole file
or none. A forward's host rows are given back once every file cut from them is written. Bytes
copied but not yet written are capped (``staging``): at the cap the forward waits (backpressure).

Identity (``identity``): each row belongs to a request of the scheduler, taken from its ``Req``
objects before the forward runs; the file is ``<sha256 of the request id>.safetensors`` and holds
the prompt's rows only (``len(origin_input_ids)``). Requests whose id SGLang gives its health
probes, and every prefill while the HTTP server runs SGLang's warm-up (``control``), are not
dumped. A request retracted under memory pressure is prefilled again (prompt and the tokens
generated so far): its file, written at its first prefill, is kept and not written again.

Chunked prefill: a request longer than the chunk size is prefilled over several forwards
(``extend_prefix_lens`` = rows already prefilled). The writer gathers a request's rows chunk by
chunk (by request id) and writes the file once its last prompt row is in: the same file as an
unchunked prefill. A request whose chunks cannot all be captured (aborted or retracted between
chunks, a chunk missing, no room under the cap for its rows) writes nothing and is counted
(``dropped``) and logged.

One request's problem is that request's: anything that goes wrong with its rows or its file is
logged with its request id and counted (``failed``), and the other requests of the forward are
written. A failed write (a full disk, say) removes its temporary file; later requests are written
again once space returns.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import json
import logging
import os
import queue
import stat
import struct
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .settings import (
    DEFAULT_DRAIN_S,
    ENV_DIR,
    ENV_GIL_SWITCH_MS,
    ENV_LAUNCH,
    ENV_LAYERS,
    ENV_WRITERS,
    SERIES_RELEASE,
    SERIES_VERSION,
    DumpConfigError,
    DumpSettings,
    check_directory,
    check_model,
    check_server_args,
    layer_output_id,
    reading,
    resolved,
    text_config,
)
from . import specforge
from .commits import MAX_DEFAULT_WRITERS, CommitPool, default_writers
from .sinks import HOST, FileSink, MooncakeSink, SinkError, TensorSpec, dump_directories
from .identity import RequestInfo, prompt_key, request_key, requests_of, printable
from .staging import HostStaging, StagingTimeout
from .stops import Stopper, ledger_path
from .storage import EMBEDDING, SCALE_PREFIX, Layout, Storage, every_embedding_row, left_out_states

logger = logging.getLogger(__name__)

FORMAT = "eagle3-dump/1"
ABANDONED_KEPT = 4096  # dropped chunked requests whose later chunks are still skipped
UNWRITTEN_KEPT = 100000  # requests named in the unwritten ledger at most
STATES_KEPT = 65536  # requests whose file's state a response can still be told
# What must be equal for a file already at a request's name to be kept (the same request prefilled
# again: a retraction, a client's retry); anything else replaces it. The launch id is part of it:
# a restart (another checkpoint, other layers, another adapter) never keeps an earlier launch's file.
IDENTITY_FIELDS = ("launch_id", "model_path", "rid", "prompt_key", "input_source", "lora_id", "mm_hashes",
                   "eagle3_layer_ids", "final", "dtype", "architecture", "storage_dtype", "left_out")
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one of ours
CLOSE_JOIN_S = 5.0  # at exit, after the stop: how long the gather and writer threads get to end


def identity_of(metadata: Dict[str, str]) -> str:
    return json.dumps([metadata.get(k) for k in IDENTITY_FIELDS])


def read_header_of_regular_file(path: str) -> Optional[Dict[str, str]]:
    """The metadata of the safetensors file at ``path`` when it is a regular file (no link, FIFO,
    device or directory is ever opened for reading: O_NOFOLLOW | O_NONBLOCK, then fstat), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= HEADER_MAX:
            return None
        header = json.loads(os.pread(fd, n, 8))
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


__all__ = ["DumpWriter", "prompt_key", "request_key", "start_dump"]


@dataclass
class _Span:
    """One request's prompt rows in a prefill forward."""

    start: int  # first row in the forward
    length: int  # prompt rows in this forward
    prefix: int  # rows of the request prefilled before (chunked prefill)
    req: RequestInfo

    @property
    def total(self) -> int:
        return self.req.prompt_len


@dataclass
class _Job:
    tensors: Dict[str, torch.Tensor]  # name -> host rows of the whole forward
    buffers: list
    held: int
    event: object
    spans: List[_Span]


class _Hold:
    """A forward's host rows, given back (``release``) when the gather and every file cut from them
    are done: ``add`` per file handed to a writer thread, ``drop`` when one is done."""

    def __init__(self, release):
        self._release = release
        self._count = 1  # the gather's own
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._release()


class _Forward:
    """What the gather thread reads once of a forward's host tensors: each contiguous tensor's
    address, safetensors dtype name, row shape and bytes a row, and the forward's ids as a list. A
    request's rows are then placed by arithmetic (``_Rows.specs``): beside the scheduler's thread,
    which runs Python all the time, each torch call that makes a view may give the GIL away and wait
    up to Python's switch interval to get it back (benchmarks/commit_gil.py), per request and tensor."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors
        self.places: Dict[str, tuple] = {}  # name -> (address, dtype name, row shape, bytes a row)
        for name, t in tensors.items():
            if t.dim() >= 1 and t.is_contiguous():
                row_shape = tuple(t.shape[1:])
                self.places[name] = (t.data_ptr(), str(t.dtype).split(".")[-1], row_shape,
                                     _numel(row_shape) * t.element_size())
        ids = tensors.get("input_ids")
        self.ids = ids.tolist() if ids is not None else None
        self.ids_int64 = ids is not None and ids.dtype == torch.int64


class _Rows(Mapping):
    """One request's rows of a forward (tensor name -> its rows): a view is made only when a name is
    looked up (a chunked request's copy, the general commit path); ``specs`` places them without one."""

    def __init__(self, forward: _Forward, start: int, length: int, names: List[str]):
        self.forward, self.start, self.length, self.names = forward, start, length, names
        self._views: Dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self.forward.tensors[name][self.start: self.start + self.length]
        return view

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def ids(self) -> List[int]:
        return self.forward.ids[self.start: self.start + self.length]

    def specs(self, ids: List[int], keep: list) -> dict:
        """safetensors ``TensorSpec`` of each tensor of this request's file (every one contiguous: the
        writer's ``_direct``); the ids as int64, from the forward's ids when they are int64, else from
        ``ids`` copied into an array appended to ``keep``, which the caller holds until the file is
        written."""
        out, places, n = {}, self.forward.places, self.length
        if "input_ids" in self.names:
            place = places.get("input_ids")
            if self.forward.ids_int64 and place is not None and place[2] == ():  # 1-D int64: 8 bytes a row
                address = place[0] + self.start * place[3]
            else:
                copy = array.array("q", ids)
                keep.append(copy)
                address = copy.buffer_info()[0]
            out["input_ids"] = TensorSpec(dtype="int64", shape=[n], data_ptr=address, data_len=n * 8)
        for name in self.names:
            if name == "input_ids":
                continue
            address, dtype, row_shape, row_bytes = places[name]
            out[name] = TensorSpec(dtype=dtype, shape=[n, *row_shape], data_ptr=address + self.start * row_bytes,
                                   data_len=n * row_bytes)
        return out


@dataclass
class _Partial:
    """A chunked request's rows so far (writer thread only)."""

    req: RequestInfo
    total: int
    tensors: Dict[str, torch.Tensor]  # name -> host rows [total, ...]
    buffers: list
    filled: int = 0
    seen: bool = field(default=True, repr=False)


class DumpWriter:
    def __init__(self, directory: str, indices: List[int], final: bool,
                 max_pending_bytes: int, metadata: Dict[str, str], enabled: bool = True,
                 chunked: bool = False, placeholder_id: Optional[int] = None, vocab_size: int = 0,
                 layout: Optional[Layout] = None, writers: int = 1, sink=None):
        """``layout``: how states are stored (``storage``); None: as computed, every state.
        ``writers``: threads writing files at once (``commits``). ``sink``: where each request's
        states go (``sinks``; None: a file in ``directory``, or in one of its directories when it names
        several). The stop ledger goes in the first directory (``stops``)."""
        self.directory = dump_directories(directory)[0]
        self.indices = list(indices)  # capture indices (= HF indices), ascending
        self.layer_ids = [layer_output_id(i) for i in self.indices]  # -1 = embedding, k = layer k's output
        # (file tensor name, capture index) per layer, in file order
        self._layers = [(f"layer.{k}", i) for k, i in zip(self.layer_ids, self.indices)]
        self.final = final
        self.layout = layout if layout is not None else Layout(Storage(), indices, False, 0, "", None, vocab_size)
        self.metadata = dict(metadata, **self.layout.metadata())
        self.enabled = enabled
        self.chunked = chunked  # prefills may be split: track requests across forwards
        self.placeholder_id = placeholder_id  # multimodal wrappers: what a pad value stands for
        self.vocab_size = vocab_size
        self.writers = writers
        self.sink = sink if sink is not None else FileSink(directory)
        self._handles: "OrderedDict[str, dict]" = OrderedDict()  # rid -> where its states are (handle())
        self.specforge_ids: Optional[tuple] = None  # EAGLE3_DUMP_SPECFORGE_IDS (None: SpecForge's protocol is off)
        self._expected: "OrderedDict[str, dict]" = OrderedDict()  # rid -> its SpecForge payload (expect())
        self._counts_lock = threading.Lock()  # the counts are bumped from the forward, gather and writer threads
        self.written = 0
        self.failed = 0
        self.skipped = 0  # rows of a request whose earlier rows were never seen (not chunking)
        self.dropped = 0  # chunked requests abandoned before their last chunk
        self.probes = 0  # SGLang's health probes, never dumped
        self.warmup = 0  # requests prefilled while paused (the HTTP server's warm-up)
        self.reprefilled = 0  # prefills again of a request whose file is written (retracted)
        self.paused = False  # set by the control socket: prefills now are not the users'
        self.max_wait_s: Optional[float] = None  # the longest a forward waits for room (None: no bound)
        self.after_stop = 0  # requests prefilled after a stop began, not dumped
        self.unwritten: "OrderedDict[str, dict]" = OrderedDict()  # rid -> why, of requests not written
        # requests handed to the writer (a span taken at submit) whose file is neither written nor
        # failed yet: with ``unwritten``, what the stop ledger names (``ledger_entries``)
        self._open: "OrderedDict[str, RequestInfo]" = OrderedDict()
        self._committing: set = set()  # rids whose file a writer thread is committing now
        self.accepting = True  # False once a stop began: later prefills are not dumped
        self.host = HOST
        self._states: "OrderedDict[str, str]" = OrderedDict()  # rid -> what became of its file (state())
        self._states_lock = threading.Lock()
        self._current: Optional[_Job] = None  # the job the writer thread works on
        self._stopping = False  # set when a drain gives up: no further file is started
        self._control = None
        self._table = None  # the launch's state table (``states``), once the control socket starts
        self.stopper = Stopper(self, DEFAULT_DRAIN_S)
        # the host arena: allocated (and page-locked on CUDA) here, once; ranks that write nothing hold none
        self.staging = HostStaging(max_pending_bytes, pinned=torch.cuda.is_available(), allocate=enabled)
        self._partials: Dict[str, _Partial] = {}  # request id -> its rows so far
        self._abandoned: "OrderedDict[str, int]" = OrderedDict()  # rid -> prompt rows of a dropped one
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._stream = None
        self._thread = None
        self._pool: Optional[CommitPool] = None
        if enabled:
            self.layout.warm_up()
            self._pool = CommitPool(writers)
            self._thread = threading.Thread(
                target=self._run, name="eagle3-dump-gather", daemon=True
            )
            self._thread.start()
            atexit.register(self.close)

    def start_control(self) -> None:
        """Listen for flush and warm-up calls from the launching process (``control``), and publish
        each request's state in the launch's state table (``states``)."""
        from .control import start_server
        from .states import ENV_STATES, StateTable

        if not self.enabled:
            return
        path = os.environ.get(ENV_STATES)
        if path:
            try:
                self._table = StateTable.open(path)
            except OSError as exc:  # the answers ask over the control socket instead
                logger.warning("%s: cannot open the launch's state table %s (%s): every answer asks the writer "
                               "for its state", ENV_DIR, path, exc)
        self._control = start_server(self)

    def _side_stream(self):
        """The stream the device-to-host copies run on: after the forward's kernels so far (it
        waits for them), beside the ones that follow, which need not wait for the copies."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    @property
    def peak_pending_bytes(self) -> int:
        return self.staging.peak_in_use

    @property
    def max_pending_bytes(self) -> int:
        return self.staging.cap

    # ---- forward thread -------------------------------------------------------------
    def submit(self, forward_batch, captured: Dict[int, torch.Tensor], final,
               input_ids: Optional[torch.Tensor] = None) -> None:
        """A forward's rows. ``input_ids``: the ids before a multimodal wrapper clamped them."""
        # Only plain prefill: decode, idle, mixed and speculative forwards write nothing.
        if not self.enabled or forward_batch.forward_mode.name != "EXTEND":
            return
        spans = self._spans(forward_batch, requests_of(forward_batch))
        if not spans:
            return
        if self.placeholder_id is not None and input_ids is None:
            self._add("failed", len(spans))  # the ids were clamped in place: their pad values are lost
            logger.error("%s: a prefill of %d requests through the multimodal wrapper came without its "
                         "ids before the clamp; not dumped", ENV_DIR, len(spans))
            return
        ids = forward_batch.input_ids if input_ids is None else input_ids
        if ids.is_cuda:
            # The ids may sit in a buffer the runner fills again for the next forward (0.5.17+'s
            # eager runner keeps static input buffers) on this stream, while the side stream may
            # still be busy with earlier forwards' rows: the side stream reads an owned copy, made
            # here in stream order before it is told to wait. The states are owned already
            # (captures are clones, the final state is a new norm output).
            ids = ids.clone()
        lay = self.layout
        sources = {"input_ids": ids}
        embedding = any(self._keeps(EMBEDDING, sp.req) for sp in spans)  # some request stores its rows
        for name, index in self._layers:
            if name != EMBEDDING or embedding:
                sources[name] = captured[index]
        if self.final and not lay.final_left_out:  # a final a reader rebuilds is never copied
            sources["final"] = final
        # Host tensors of this forward are fresh (captures are owned copies, the final state is
        # a new norm output) and nothing writes them later: they are written without a copy
        # (quantised here when stored as fp8). Device tensors (and the ids, which the scheduler
        # reuses) go through host buffers, quantised on the side stream before their copy.
        if lay.fp8 and not any(t.is_cuda for t in sources.values()):
            sources = {e: t for n, src in sources.items() for e, t in lay.encode(n, src).items()}
        everything = sources
        copied = [n for n, t in everything.items() if t.is_cuda or n == "input_ids"]
        held = sum(_nbytes(t) for n, t in everything.items() if n not in copied)
        # what each copied source becomes in host buffers: (name, dtype, shape), in buffer order
        specs = {n: lay.encoded_specs(n, everything[n]) if everything[n].is_cuda else [(n, everything[n].dtype,
                 tuple(everything[n].shape))] for n in copied}
        slots = [spec for n in copied for spec in specs[n]]
        try:
            buffers = self.staging.reserve([_numel(shape) * dt.itemsize for _, dt, shape in slots], held,
                                           self.max_wait_s)
        except StagingTimeout as exc:  # the writer is stuck (a hung dump disk): fail loudly, keep serving
            for span in spans:
                self._not_written(span.req, f"not dumped: the forward waited {exc}")
            self._add("failed", len(spans))
            logger.error("%s: a prefill of %d requests (%s) is not dumped: the forward waited %s; the "
                         "server keeps serving, and requests go on failing like this until the dump disk "
                         "takes writes again; %d failed so far", ENV_DIR, len(spans),
                         ", ".join(printable(sp.req.rid) for sp in spans[:8]), exc, self.failed)
            return
        host = {n: t.contiguous() for n, t in everything.items() if n not in copied}
        stream = self._side_stream() if any(everything[n].is_cuda for n in copied) else None
        oversized = buffers and not self.staging.in_arena(buffers[0])  # pageable: the copy is synchronous
        started = time.perf_counter()
        free = iter(buffers)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name in copied:
                src = everything[name]
                encoded = lay.encode(name, src) if src.is_cuda else {name: src}  # on the side stream
                for (enc, _, _), buf in zip(specs[name], free):
                    t = encoded[enc]
                    view = buf[: _nbytes(t)].view(t.dtype).view(t.shape)
                    view.copy_(t, non_blocking=True)
                    host[enc] = view
                if src.is_cuda:  # the allocator must not reuse it before the copy is done
                    src.record_stream(stream)
        if oversized:
            self.staging.waited(time.perf_counter() - started, "a prefill larger than the arena is copied")
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        self._queue.put(_Job(host, buffers, held, event, spans))

    def _spans(self, forward_batch, reqs: Optional[List[RequestInfo]]) -> List[_Span]:
        """The prompt rows of each request this prefill forward carries (forward thread)."""
        lengths = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        prefixes = [int(n) for n in (forward_batch.extend_prefix_lens_cpu or [0] * len(lengths))]
        if reqs is None or len(reqs) != len(lengths):
            self._add("failed", len(lengths))
            logger.error("%s: a prefill of %d requests came without their request ids (%s); not dumped",
                         ENV_DIR, len(lengths), "none" if reqs is None else f"{len(reqs)} ids")
            return []
        spans, start = [], 0
        for length, prefix, req in zip(lengths, prefixes, reqs):
            first = prefix == 0
            if req.skipped:
                self.probes += first
                self._set_state(req, "not dumped: an SGLang health probe")
            elif self.paused:
                self.warmup += first
                self._set_state(req, "not dumped: prefilled during SGLang's warm-up (before the server was ready)")
            elif not self._take_request(req, first):  # a stop began: nothing new is promised
                self.after_stop += first
                self._set_state(req, f"not dumped: the server is stopping ({self.stopper.why})")
            elif prefix >= req.prompt_len:
                pass  # generated tokens prefilled again after a retraction: not prompt rows
            elif prefix and not self.chunked:
                self.skipped += 1
                self._set_state(req, f"not dumped: it came with {prefix} tokens prefilled before")
                logger.error(
                    "%s: request %s came with %d tokens prefilled before; not dumped "
                    "(its rows would be incomplete)", ENV_DIR, printable(req.rid), prefix,
                )
            else:
                if first:
                    self._set_state(req, "queued")
                spans.append(_Span(start, min(length, req.prompt_len - prefix), prefix, req))
            start += length
        return spans

    def _keeps(self, name: str, req: RequestInfo) -> bool:
        """Whether ``req``'s file may hold rows of the tensor ``name``: the embedding's only where
        some of its rows cannot be rebuilt from the vocabulary (a multimodal wrapper's requests,
        ``storage.every_embedding_row``: ``input_embeds`` and LoRA requests), when the layout leaves
        the others out. The same for every forward of a request, so its chunks always carry the
        same tensors."""
        if not self.layout.embedding_partial or name not in (EMBEDDING, SCALE_PREFIX + EMBEDDING):
            return True
        return self.placeholder_id is not None or every_embedding_row(req)

    def handle(self, rid: str) -> dict:
        """Where a request's states are (or will be): the sink, its file or object key, and once
        committed to an object store the manifest (tensor names, shapes, dtypes, offsets and the
        file metadata: layer ids, their reading, storage dtype and scale layout)."""
        with self._states_lock:
            got = self._handles.get(str(rid))
        return dict(got) if got is not None else self.sink.where(request_key(str(rid)))

    def _set_handle(self, req: RequestInfo, where: dict) -> None:
        with self._states_lock:
            self._handles[req.rid] = where
            self._handles.move_to_end(req.rid)
            while len(self._handles) > STATES_KEPT:
                self._handles.popitem(last=False)

    # ---- SpecForge's capture protocol (specforge) ------------------------------------
    def expect(self, requests: Dict[str, dict]) -> Dict[str, Optional[str]]:
        """Take the SpecForge payloads of requests about to be sent (rid -> payload, checked by the
        launching process): their states go to SpecForge's objects instead of this sink's. rid ->
        why it cannot be captured (None: taken)."""
        whole = not (self.layout.fp8 or self.layout.left_out)
        out = {}
        for rid, payload in requests.items():
            why = specforge.refusal(payload, self.specforge_ids, self.layer_ids, self.final, whole,
                                    getattr(self.sink, "name", "file"))
            out[str(rid)] = why
            if why is None:
                with self._states_lock:
                    self._expected[str(rid)] = payload
                    while len(self._expected) > STATES_KEPT:
                        self._expected.popitem(last=False)
        return out

    def captured(self, rids: List[str], timeout: float) -> Dict[str, dict]:
        """rid -> its ``meta_info["spec_capture"]`` once its objects are put or it failed (waits up to
        ``timeout`` seconds: an answer is never sent before its objects are readable)."""
        deadline = time.monotonic() + timeout
        out = {}
        for rid in map(str, rids):
            while self.state(rid) == "queued" and time.monotonic() < deadline:  # answered: prefilled already
                time.sleep(0.002)
            state = self.state(rid)
            with self._states_lock:
                payload = self._expected.pop(rid, None)
            got = self.handle(rid).get("spec_capture")
            if got is None or (state != "written" and "error" not in got):
                why = {"queued": f"not captured within {timeout:g} s",
                       "unknown": "not captured: no prefill of it reached the dump writer"}.get(state, state)
                got = specforge.error(payload, why) if payload is not None else {"error": why}
            out[rid] = got
        return out

    def _commit_specforge(self, payload: dict, out: Dict[str, torch.Tensor], req: RequestInfo) -> None:
        """Put one request's states as SpecForge's objects (all or none) and record its answer."""
        try:
            named = specforge.tensors(payload, out, self.specforge_ids)
            self.sink.put_objects({specforge.object_key(payload, n): t for n, t in named.items()})
        except Exception as exc:  # this request only; SpecForge retries it (replace)
            self._add("failed")
            why = f"the write failed: {exc}"
            self._set_handle(req, {"sink": specforge.HANDLE, "spec_capture": specforge.error(payload, why)})
            self._not_written(req, why)
            logger.error("%s: SpecForge sample %s (request %s) was not captured (%s); %d failed so far", ENV_DIR,
                         payload["sample_id"], printable(req.rid), exc, self.failed)
            return
        self._set_handle(req, {"sink": specforge.HANDLE,
                               "spec_capture": specforge.result(payload, self.specforge_ids, named)})
        self._add("written")
        self._set_state(req, "written")
        self._written(req)

    def _add(self, count: str, n: int = 1) -> None:
        with self._counts_lock:
            setattr(self, count, getattr(self, count) + n)

    def _set_state(self, req: RequestInfo, state: str) -> None:
        with self._states_lock:
            if self._table is not None:
                self._table.put(req.key, state)
            self._states[req.rid] = state
            self._states.move_to_end(req.rid)
            while len(self._states) > STATES_KEPT:
                self._states.popitem(last=False)

    def state(self, rid: str) -> str:
        """What became of a request's file: ``queued`` (handed to the writer: a flush waits for
        it), ``written``, ``kept`` (this very request's file was there already), ``not dumped:
        <why>``, ``failed: <why>``, ``gone: <why>`` (written to a store, then expired or lost there,
        ``sinks``), or ``unknown`` (no prefill of it reached this writer)."""
        with self._states_lock:
            got = self._states.get(str(rid), "unknown")
        return (got == "written" and self.sink.gone(request_key(str(rid)))) or got  # expired, or lost in a store

    # ---- writer thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            if isinstance(job, threading.Event):  # a flush: set once every job before it is written
                self._pool.when_done(job)  # this thread goes on gathering the forwards after it
                self._queue.task_done()
                continue
            if self._stopping:  # a drain gave up: what is left stays unwritten (named in its ledger)
                self.staging.release(job.buffers, job.held)
                self._queue.task_done()
                continue
            self._current = job
            hold = _Hold(lambda job=job: self.staging.release(job.buffers, job.held))
            try:
                if job.event is not None:
                    job.event.synchronize()
                self._gather(job, hold)
            except Exception:  # the thread must outlive any one job, or the forward would hang
                self._add("failed", len(job.spans))
                for span in job.spans:
                    self._not_written(span.req, "its forward's rows could not be read")
                logger.exception("%s: a batch of %d requests was not dumped", ENV_DIR, len(job.spans))
            finally:
                self._current = None
                hold.drop()  # the rows go back once the files cut from them are written too
                self._queue.task_done()

    def _gather(self, job: _Job, hold: _Hold) -> None:
        """Write the requests this forward completes; keep the rows of unfinished ones."""
        for p in self._partials.values():
            p.seen = False
        forward = _Forward(job.tensors)
        for span in job.spans:
            rows = _Rows(forward, span.start, span.length, [n for n in job.tensors if self._keeps(n, span.req)])
            try:
                self._take(span, rows, hold)
            except Exception as exc:  # this request's problem: the others of the forward are written
                self._add("failed")
                partial = self._partials.pop(span.req.rid, None)
                if partial is not None:
                    self.staging.release(partial.buffers, queued=False)
                self._not_written(span.req, f"{type(exc).__name__}: {exc}")
                logger.exception("%s: request %s (key %s) was not dumped; %d failed so far",
                                 ENV_DIR, printable(span.req.rid), span.req.key, self.failed)
        for p in [p for p in self._partials.values() if not p.seen]:
            self._drop(p, "its next chunk did not come (aborted or retracted)")

    def _take(self, span: _Span, rows: Dict[str, torch.Tensor], hold: _Hold) -> None:
        rid = span.req.rid
        partial = self._partials.get(rid)
        if span.prefix == 0:
            self._abandoned.pop(rid, None)
            if partial is not None:
                self._drop(partial, "it was prefilled again from its start (retracted)")
                self._reopen(span.req)  # and goes on from its start
            if span.length >= span.total:
                self._handed(rows, span.req, hold.add, hold.drop)
            else:
                self._start(span, rows)
            return
        if rid in self._abandoned:  # the rest of a request already counted as dropped
            if span.prefix + span.length >= span.total:
                del self._abandoned[rid]
            return
        if partial is None:
            # retracted, prefilled again in chunks (its file written, or being written)
            if self._pool.busy(span.req.key) or self._written_before(span.req):
                return
            self._abandon(span.req, "rows %d..%d came without its earlier rows"
                          % (span.prefix, span.prefix + span.length), span.prefix + span.length)
            return
        if partial.filled != span.prefix:
            self._drop(partial, "a chunk is missing")
            return
        for name, t in rows.items():
            partial.tensors[name][span.prefix: span.prefix + span.length].copy_(t)
        partial.filled += span.length
        partial.seen = True
        if partial.filled >= partial.total:
            del self._partials[rid]
            self._handed(partial.tensors, partial.req, None,
                         lambda buffers=partial.buffers: self.staging.release(buffers, queued=False))

    def _start(self, span: _Span, rows: Dict[str, torch.Tensor]) -> None:
        shapes = {n: (span.total,) + tuple(t.shape[1:]) for n, t in rows.items()}
        sizes = [_numel(s) * rows[n].element_size() for n, s in shapes.items()]
        # the one request being chunked may pass the cap alone, as one oversized forward may
        buffers = self.staging.try_reserve(sizes, alone=not self._partials)
        if buffers is None:
            self._abandon(span.req, "its rows do not fit under %d MiB with the others pending; raise "
                          "EAGLE3_DUMP_MAX_PENDING_MB" % (self.staging.cap >> 20), span.length)
            return
        tensors = {}
        for (name, shape), buf in zip(shapes.items(), buffers):
            t = rows[name]
            tensors[name] = buf[: _numel(shape) * t.element_size()].view(t.dtype).view(shape)
            tensors[name][: span.length].copy_(t)
        self._partials[span.req.rid] = _Partial(span.req, span.total, tensors, buffers, filled=span.length)

    def _drop(self, partial: _Partial, why: str) -> None:
        self._partials.pop(partial.req.rid, None)
        self.staging.release(partial.buffers, queued=False)
        self._abandon(partial.req, why, partial.filled)

    def _abandon(self, req: RequestInfo, why: str, rows_seen: int) -> None:
        """Count a chunked request that will not be written; its later chunks are skipped."""
        self.dropped += 1
        if rows_seen < req.prompt_len:
            self._abandoned[req.rid] = req.prompt_len
            while len(self._abandoned) > ABANDONED_KEPT:  # requests that never came back
                self._abandoned.popitem(last=False)
        self._not_written(req, why)
        logger.error("%s: request %s (%d prompt tokens, prefilled in chunks) is not dumped (%d of its "
                     "rows seen): %s; %d dropped so far", ENV_DIR, req.rid, req.prompt_len, rows_seen,
                     why, self.dropped)

    def _written_before(self, req: RequestInfo, metadata: Optional[Dict[str, str]] = None) -> bool:
        """Whether this request's file is there already: kept when it is a regular file of this
        very request (``IDENTITY_FIELDS``: this launch, model, prompt, input source, adapter,
        images, layers; a retracted request prefilled again, a client's retry). Anything else at
        its name is replaced (logged when it was another request's file); nothing but a regular
        file is ever opened. Without ``metadata`` (a chunk of a request whose prompt is not all
        in yet) a file of this launch and request id is enough."""
        header = self.sink.header(req.key, read_header_of_regular_file)
        if header is None:
            return False
        if metadata is None:
            same = header.get("launch_id") == self.metadata.get("launch_id") and header.get("rid") == printable(req.rid)
        else:
            same = identity_of(header) == identity_of(metadata)
        if not same:
            logger.warning("%s: request id %s came again as another request (%s); its file is replaced", ENV_DIR,
                           printable(req.rid), ", ".join(k for k in IDENTITY_FIELDS
                                                         if header.get(k) != (metadata or self.metadata).get(k)
                                                         and k != "rid") or "launch")
            return False
        self._add("reprefilled")
        if self.state(req.rid) == "queued":
            self._set_state(req, "kept")
        self._written(req)
        return True

    def _not_written(self, req: RequestInfo, why: str) -> None:
        """Name a request this writer will not write (the stop ledger)."""
        self._set_state(req, "failed: " + why)
        with self._counts_lock:  # named from the forward, gather and writer threads
            self._open.pop(req.rid, None)
            self.unwritten[req.rid] = {"rid": printable(req.rid), "key": req.key, "why": why}
            while len(self.unwritten) > UNWRITTEN_KEPT:
                self.unwritten.popitem(last=False)

    def _take_request(self, req: RequestInfo, first: bool) -> bool:
        """Whether this prefill's rows of ``req`` are taken (no stop has begun); a request's first
        rows make it pending. One step under the lock the stop turns ``accepting`` off under, so
        every request taken is pending before the stop's ledger is made."""
        with self._counts_lock:
            if not self.accepting:
                return False
            if first:
                self._open[req.rid] = req
                self._open.move_to_end(req.rid)
            return True

    def stop_accepting(self) -> None:
        """A stop began: later prefills are not dumped (``_take_request``)."""
        with self._counts_lock:
            self.accepting = False

    def _reopen(self, req: RequestInfo) -> None:
        """A request handed to the writer (its first rows, or all of them again): pending until its
        file is written or it fails."""
        with self._counts_lock:
            self._open[req.rid] = req
            self._open.move_to_end(req.rid)

    def _written(self, req: RequestInfo) -> None:
        """Its file is there: no ledger names it, whatever an earlier try of it did."""
        with self._counts_lock:
            self._open.pop(req.rid, None)
            self.unwritten.pop(req.rid, None)

    def _handed(self, rows: Dict[str, torch.Tensor], req: RequestInfo, take, done) -> None:
        """``_write`` with the rows' memory accounted: ``take()`` before (None: nothing to take),
        ``done()`` once the file is committed or failed, or at once when it was not handed over."""
        if take is not None:
            take()
        try:
            self._write(rows, req, done)
        except BaseException:
            done()
            raise

    def _write(self, rows: Dict[str, torch.Tensor], req: RequestInfo, done) -> None:
        """Hand a whole request's rows to its writer thread; ``done()`` runs once its file is
        committed or failed (the rows' memory may then be reused)."""
        self._pool.submit(req.key, req, lambda: self._commit(rows, req, done))

    def _commit(self, rows: Dict[str, torch.Tensor], req: RequestInfo, done) -> None:
        """Write one request's file (a writer thread)."""
        try:
            if self._stopping:  # a drain gave up: still pending, named in its ledger as not written
                return
            with self._counts_lock:
                self._committing.add(req.rid)
            self._commit_file(rows, req)
        except Exception as exc:  # anything but the write itself (counted there): this request only
            self._add("failed")
            self._not_written(req, f"{type(exc).__name__}: {exc}")
            logger.exception("%s: request %s (key %s) was not dumped; %d failed so far",
                             ENV_DIR, printable(req.rid), req.key, self.failed)
        finally:
            with self._counts_lock:
                self._committing.discard(req.rid)
            done()

    def _direct(self, rows, req: RequestInfo) -> bool:
        """Whether this request's file is written straight from the forward's host rows (``_Rows.specs``,
        ``FileSink.commit`` given ``TensorSpec``s): a whole text request of one forward, to files, with nothing to
        cut or map. Anything else (a chunked request's own buffers, a multimodal wrapper's ids, kept
        embedding rows, the Mooncake sink) takes the general path: the same file either way."""
        return (TensorSpec is not None and isinstance(rows, _Rows) and rows.length == req.prompt_len
                and isinstance(self.sink, FileSink) and all(n in rows.forward.places for n in rows.names)
                and self.placeholder_id is None
                and not (self.layout.embedding_partial and EMBEDDING in rows.names))

    def _commit_file(self, rows: Dict[str, torch.Tensor], req: RequestInfo) -> None:
        length = req.prompt_len
        key = req.key
        with self._states_lock:
            payload = self._expected.get(req.rid)
        direct = payload is None and self._direct(rows, req)
        if direct:
            id_list = rows.ids()
        else:
            raw_ids = rows["input_ids"][:length]
            if raw_ids.dtype != torch.int64:
                raw_ids = raw_ids.to(torch.int64)
            ids = raw_ids
            if self.placeholder_id is not None:  # a multimodal wrapper's pad values -> its placeholder
                ids = torch.where(ids >= self.vocab_size, torch.full_like(ids, self.placeholder_id), ids)
            id_list = ids.tolist()
        pkey = prompt_key(id_list)
        if payload is not None:  # SpecForge's objects, not this sink's (a retry replaces them)
            out = {name: host[:length] for name, host in rows.items() if name != "input_ids"}
            self._commit_specforge(payload, out, req)
            return
        metadata = dict(self.metadata, key=key, prompt_key=pkey, num_tokens=str(length), **req.metadata())
        if self._written_before(req, metadata):
            return
        keep: list = []  # an int64 copy of int32 ids lives until the file is written
        if direct:
            out = rows.specs(id_list, keep)
        else:
            out = {"input_ids": ids}
            for name, host in rows.items():
                if name != "input_ids":
                    out[name] = host[:length]
            self.layout.cut_embedding(out, raw_ids, all_rows=every_embedding_row(req))
        try:
            where = self.sink.commit(key, out, metadata)
            self._set_handle(req, where)
            self._add("written")
            self._set_state(req, "written")
            self._written(req)
        except Exception as exc:  # a full or vanished disk or store must not stop serving
            self._add("failed")
            self._not_written(req, f"the write failed: {exc}")
            self.sink.fail(key, f"the write failed: {exc}")
            logger.error("%s: dump of request %s (key %s) failed (%s); %d failed so far", ENV_DIR,
                         printable(req.rid), key, exc, self.failed)

    def counts(self) -> Dict[str, int]:
        return {"written": self.written, "failed": self.failed, "dropped": self.dropped,
                "skipped": self.skipped, "probes": self.probes, "warmup": self.warmup,
                "reprefilled": self.reprefilled, "after_stop": self.after_stop, "pending_chunked": len(self._partials), **self.sink.counts()}

    def flush(self) -> None:
        """Wait until every submitted forward is written, failed, or held as a partial request."""
        if self.enabled:
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def flush_report(self, timeout: float) -> dict:
        """Wait (at most ``timeout`` seconds) until every forward submitted before the call is
        written or counted; the counts. Rows of a chunked request whose last chunk has not run
        are held, not flushed: its prefill is not over, so it has not been answered either."""
        if not self.enabled:
            return dict(self.counts(), flushed=True)
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            return dict(self.counts(), flushed=False, paused=self.paused,
                        error=f"the dump writer did not catch up within {timeout:g} s")
        return dict(self.counts(), flushed=True, paused=self.paused)

    # ---- stops (``stops``) ------------------------------------------------------------------
    @property
    def ledger_path(self) -> str:
        """This launch's stop ledger (``stops.ledger_path``)."""
        return ledger_path(self.directory, self.metadata.get("launch_id") or "")

    def pending_requests(self) -> List[RequestInfo]:
        """The requests handed to the writer whose file is neither written nor failed: queued
        forwards, files being written, chunked requests whose last chunk has not run."""
        with self._counts_lock:
            return list(self._open.values())

    def ledger_entries(self, pending_why: str, gave_up: bool = False) -> List[dict]:
        """What the stop ledger names now: every request handed to the writer in this launch and
        not written, the failed ones with why, the pending ones as such (``gave_up``: the drain
        ended, and a file a writer thread is committing may still land)."""
        with self._counts_lock:
            failed = list(self.unwritten.values())
            pending = list(self._open.values())
            committing = set(self._committing)
        chunked = set(self._partials)
        out = list(failed)
        for req in pending:
            if req.rid in chunked:
                why = "its last chunk was not prefilled before the stop"
            elif gave_up and req.rid in committing:
                why = "being written when the drain ended: its file may still land"
            else:
                why = pending_why
            out.append({"rid": printable(req.rid), "key": req.key, "why": why, "pending": True})
        return out

    def wait_written(self, deadline: float) -> bool:
        """Wait (until ``deadline``, time.monotonic) for every forward queued so far to be written,
        failed, or held as a partial chunked request; whether it was."""
        if not self.enabled or self._thread is None or not self._thread.is_alive():
            return not self._open
        done = threading.Event()
        self._queue.put(done)
        return done.wait(max(deadline - time.monotonic(), 0.0))

    def give_up(self) -> None:
        """A drain ended: no file starts after this (those left stay pending in the ledger)."""
        self._stopping = True

    def drain(self, seconds: float, why: str) -> bool:
        """Stop (``stops.Stopper.stop``) with a drain of at most ``seconds``; whether everything
        handed to the writer was written."""
        if not self.enabled:
            return True
        return bool(self.stopper.stop(why, seconds).get("flushed"))

    def install_sigterm_drain(self, seconds: float) -> None:
        """Every stop drains for at most ``seconds``; SIGTERM to this process is the stop's own
        (``stops.Stopper.install_sigterm``: a watcher thread, never the main thread, drains)."""
        self.stopper.drain_s = float(seconds)
        if self.enabled:
            self.stopper.install_sigterm()

    def close(self) -> None:
        """At exit: stop (write what was handed over for at most EAGLE3_DUMP_DRAIN_S, leave the
        ledger), stop answering the control socket, end the threads (each wait bounded)."""
        alive = self._thread is not None and self._thread.is_alive()
        report = self.stopper.stop("the process exited") if alive else {}
        if self._control is not None:  # after the stop: a stop call in flight is answered
            self._control.close()
            self._control = None
        if not alive:
            return
        if not report.get("flushed"):  # threads still at a slow or hung disk: the exit takes them
            return
        self._queue.put(None)
        self._thread.join(CLOSE_JOIN_S)
        stuck = self._thread.is_alive() or not self._pool.close(CLOSE_JOIN_S)
        for p in list(self._partials.values()):
            self.staging.release(p.buffers, queued=False)
        self._partials.clear()
        if not stuck:  # a writer thread still at a hung disk holds arena rows: leave them to the exit
            self.staging.close()
        logger.info("%s: %s; %s", ENV_DIR, ", ".join(f"{v} {k}" for k, v in self.counts().items()),
                    self.staging.summary())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _chunked(server_args) -> bool:
    """Whether prefills may be split over forwards (chunked prefill on)."""
    chunk = getattr(resolved(server_args), "chunked_prefill_size", None)
    return chunk is not None and chunk > 0


def start_dump(runner, target, settings: DumpSettings):
    """Check the server settings, then start the writer."""
    from sglang.srt.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    hf_config = runner.model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or [type(runner.model).__name__]
    config = target.config
    num_layers = config.num_hidden_layers
    indices = check_model(architectures, num_layers, settings)
    check_server_args(runner.server_args)
    for directory in settings.directories:
        check_directory(directory, settings.directory)
    from sglang.version import __version__ as sglang_version

    if sglang_version.startswith("0.0.0"):  # a source checkout without build metadata
        sglang_version = SERIES_RELEASE
    placeholder = None
    if target is not runner.model:  # a multimodal wrapper: its pad values stand for this id
        placeholder = getattr(runner.model.config, "media_placeholder_token_id", None)
        if placeholder is None:
            raise DumpConfigError(
                f"{ENV_DIR} is set but {type(runner.model).__name__}'s config names no "
                f"media_placeholder_token_id, so image pad values cannot be stored as ids; unset {ENV_DIR}"
            )
    dtype = str(runner.model_config.dtype).replace("torch.", "")
    metadata = {
        "format": FORMAT,
        "eagle3_layer_ids": json.dumps([layer_output_id(i) for i in indices]),
        "hf_hidden_state_indices": json.dumps(indices),
        # EAGLE3_DUMP_LAYERS as given, read as a draft's ids are on this release (None: the default)
        "configured_layer_ids": json.dumps(settings.layer_ids),
        "layer_id_reading": reading(settings.family),
        "layer_id_family": settings.family,  # whose reading EAGLE3_DUMP_LAYERS followed (EAGLE3_DUMP_READING)
        "final": "post_norm" if settings.final else "none",
        "architecture": architectures[0],
        "model_path": str(runner.server_args.model_path),
        "hidden_size": str(config.hidden_size),
        "num_hidden_layers": str(num_layers),
        "dtype": dtype,
        "sglang_version": str(sglang_version),
        "series_version": SERIES_VERSION,
        "tp_size": str(get_tensor_model_parallel_world_size()),
        # one per launch (the launch check sets it; a runner built without one gets its own)
        "launch_id": os.environ.get(ENV_LAUNCH) or uuid.uuid4().hex,
        "replica_rank": "0",  # --dp-size > 1 is refused (settings.check_server_args): one replica
    }
    if settings.mooncake is None:  # the directories files are spread over: a reader listing others is told
        metadata["dump_dirs"] = json.dumps(settings.directories)
    vocab_size = text_config(hf_config).vocab_size
    weights = None  # the digest of what a reader rebuilds left-out states from, on the writing rank
    left = left_out_states(settings.storage, indices, settings.final, num_layers)
    if left and get_tensor_model_parallel_rank() == 0:
        from .weights import served_weights

        weights = served_weights(resolved(runner.server_args), left)
    try:
        layout = Layout(settings.storage, indices, settings.final, num_layers, dtype,
                        getattr(config, "rms_norm_eps", None), vocab_size, weights=weights)
    except ValueError as exc:
        raise DumpConfigError(f"{ENV_DIR}: {exc}; unset EAGLE3_DUMP_REBUILDABLE (store)") from None
    sink = None
    if settings.mooncake is not None and get_tensor_model_parallel_rank() == 0:  # the writing rank only
        try:
            sink = MooncakeSink(settings.mooncake)
        except SinkError as exc:
            raise DumpConfigError(str(exc)) from None
    writer = DumpWriter(
        settings.directory,
        indices,
        settings.final,
        settings.max_pending_bytes,
        metadata,
        enabled=get_tensor_model_parallel_rank() == 0,
        chunked=_chunked(runner.server_args),
        placeholder_id=placeholder,
        vocab_size=vocab_size,
        layout=layout,
        writers=settings.writers or default_writers(),
        sink=sink,
    )
    writer.max_wait_s = settings.max_wait_s
    writer.specforge_ids = settings.specforge_ids
    if writer.enabled:
        from . import identity

        identity.install()  # each prefill's requests, taken before its forward runs
        writer.start_control()
        writer.install_sigterm_drain(settings.drain_s)
        if settings.gil_switch_ms is not None:  # the writing process's threads wait less for the GIL
            sys.setswitchinterval(settings.gil_switch_ms / 1e3)
    logger.info(
        "%s: dumping prefill hidden states to %s (%s=%s -> HF hidden_states indices %s, final %s, "
        "pending cap %d MiB, chunked prefill %s, stored as %s, rebuildable states %s%s, %d writer threads "
        "(%s), GIL switch interval %.3g ms%s, sink %s)", ENV_DIR,
        settings.directory if len(settings.directories) == 1 else
        f"{len(settings.directories)} directories, files spread by key ({', '.join(settings.directories)})",
        ENV_LAYERS, settings.layer_ids if settings.layer_ids is not None else "default",
        indices, settings.final, settings.max_pending_bytes >> 20, "on" if writer.chunked else "off",
        settings.storage.dtype, settings.storage.rebuildable,
        (": left out " + ", ".join(layout.left_out)) if layout.left_out else "",
        writer.writers, f"{ENV_WRITERS}={settings.writers}" if settings.writers else
        f"default: the CPUs this process may use, at most {MAX_DEFAULT_WRITERS}",
        sys.getswitchinterval() * 1e3, f" ({ENV_GIL_SWITCH_MS})" if settings.gil_switch_ms is not None else "",
        writer.sink.describe() if settings.mooncake is None else
        f"mooncake (master {settings.mooncake.master}, {settings.mooncake.protocol})",
    )
    return writer
