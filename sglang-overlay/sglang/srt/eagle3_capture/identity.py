"""Which request each prefill row belongs to, read from the scheduler's own request objects.

``ForwardBatch`` carries no request identity in every release (0.5.9 has none; later ones only
the ids), but ``ForwardBatch.init_new(batch, model_runner)`` is handed the batch that holds the
scheduler's ``Req`` objects (``batch.reqs``). ``install`` wraps ``init_new`` once in the writing
process: for a prefill batch it takes a ``RequestInfo`` of each request, on the thread that builds
the forward and before the forward runs, and keeps the list on the ForwardBatch. Everything the
writer needs is copied out then (host values: the request id, the prompt's length), so neither
a later in-place change of the batch's device tensors (0.5.9 bumps ``orig_seq_lens`` with
``add_(1)`` when the prefill batch becomes the decode batch) nor the scheduler's later changes to
the request objects can reach the dump.

Releases that copy the ForwardBatch before the model runs (0.5.17+: the eager runner's
``dataclasses.replace``, which keeps dataclass fields only) carry the request ids in the
ForwardBatch's own ``rids`` field: there the RequestInfo list is kept in a small table keyed by
request id instead, filled in ``init_new`` and emptied when the writer takes it. Which releases
do is declared in ``CARRIES_RIDS`` and checked against the class at install (and against every
release's source in tests/test_release_facts.py); a release not declared refuses the dump.

A dump file is named after its request's id (``request_key``), the one the client sent or the one
SGLang made and returns as ``meta_info["id"]``: two requests never share a file, whatever their
prompt, image, input embeddings or LoRA adapter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from .release import SERIES_RELEASE

# Request ids the dump never writes: SGLang's own health probes (/health and /health_generate
# send a generate request with such an id).
SKIPPED_RID_PREFIXES = ("HEALTH_CHECK",)
ATTRIBUTE = "_eagle3_requests"  # where the ForwardBatch keeps its requests' RequestInfo list
# The scheduler's request attributes ``info`` reads, the same in every covered release
# (tests/test_release_facts.py checks each release's source).
REQ_FIELDS = ("rid", "origin_input_ids", "lora_id", "input_embeds", "multimodal_inputs")
# Whether the release's ForwardBatch has a ``rids`` field (the request ids, copied with the
# batch) and its model runner may hand the model a copy of the ForwardBatch: per series release.
CARRIES_RIDS = {"0.5.9": False, "0.5.17": True, "0.5.23": True}
TABLE_KEPT = 65536  # RequestInfo of prefills not taken yet (a forward that never reached the writer)


def request_key(rid: str) -> str:
    """File key of a request: sha256 (hex) of its request id, UTF-8 (a lone surrogate, which UTF-8
    cannot hold, as its three-byte form: Python's ``surrogatepass``)."""
    return hashlib.sha256(str(rid).encode("utf-8", "surrogatepass")).hexdigest()


def printable(rid: str) -> str:
    """The request id as it is stored in a file's metadata and logged: itself when UTF-8 can hold
    it, else with each lone surrogate written as a ``\\udXXX`` escape."""
    rid = str(rid)
    try:
        rid.encode("utf-8")
        return rid
    except UnicodeEncodeError:
        return rid.encode("utf-8", "backslashreplace").decode("utf-8")


HASH_PIECE = 2047  # hashlib gives the GIL away for data of 2 KiB and more (HASHLIB_GIL_MINSIZE)


def prompt_key(token_ids: Sequence[int]) -> str:
    """sha256 (hex) of the stored prompt ids written as '1,2,3' (kept in every file's metadata).
    Hashed in pieces below hashlib's GIL threshold: the dump's writer threads keep the GIL through
    it (beside the scheduler's thread, getting it back costs up to Python's switch interval)."""
    data = ",".join(str(int(t)) for t in token_ids).encode()
    h = hashlib.sha256()
    for i in range(0, len(data), HASH_PIECE):
        h.update(data[i: i + HASH_PIECE])
    return h.hexdigest()


@dataclass(frozen=True)
class RequestInfo:
    rid: str
    prompt_len: int  # tokens of the prompt (origin_input_ids): rows beyond are generated tokens
    lora_id: str = ""
    input_embeds: bool = False  # the ids SGLang stores for it are placeholders
    mm_hashes: Tuple[int, ...] = field(default=())

    @property
    def key(self) -> str:
        return request_key(self.rid)

    @property
    def skipped(self) -> bool:
        return self.rid.startswith(SKIPPED_RID_PREFIXES)

    def metadata(self) -> dict:
        return {
            "rid": printable(self.rid),
            "input_source": "input_embeds" if self.input_embeds else "input_ids",
            "lora_id": self.lora_id,
            "mm_hashes": json.dumps(list(self.mm_hashes)),
        }


def info(req) -> RequestInfo:
    """The RequestInfo of one scheduler ``Req`` (fields every covered release has)."""
    mm = getattr(req, "multimodal_inputs", None)
    items = getattr(mm, "mm_items", None) or ()
    return RequestInfo(
        rid=str(req.rid),
        prompt_len=len(req.origin_input_ids),
        lora_id=str(req.lora_id or ""),
        input_embeds=req.input_embeds is not None,
        mm_hashes=tuple(int(i.hash) for i in items if getattr(i, "hash", None) is not None),
    )


class _Table:
    """rid -> RequestInfo of prefills whose ForwardBatch the writer has not seen yet."""

    def __init__(self):
        self.lock = threading.Lock()
        self.infos: "OrderedDict[str, RequestInfo]" = OrderedDict()

    def put(self, infos: List[RequestInfo]) -> None:
        with self.lock:
            for i in infos:
                self.infos[i.rid] = i
                self.infos.move_to_end(i.rid)
            while len(self.infos) > TABLE_KEPT:
                self.infos.popitem(last=False)

    def take(self, rids) -> Optional[List[RequestInfo]]:
        with self.lock:
            if not all(str(r) in self.infos for r in rids):
                return None
            return [self.infos.pop(str(r)) for r in rids]


_TABLE = _Table()
_BY_RID: Dict[str, bool] = {}  # "on": whether install chose the table (this release carries rids)


def requests_of(forward_batch) -> Optional[List[RequestInfo]]:
    """The RequestInfo of each request of a prefill ForwardBatch (None: not known)."""
    if _BY_RID.get("on"):
        rids = forward_batch.rids
        return _TABLE.take(rids) if rids is not None else None
    return getattr(forward_batch, ATTRIBUTE, None)


def _attach(forward_batch, batch) -> None:
    if forward_batch.forward_mode.name != "EXTEND":
        return
    reqs = batch.reqs
    if reqs is None:
        return
    infos = [info(r) for r in reqs]
    if _BY_RID.get("on"):
        _TABLE.put(infos)
    else:
        setattr(forward_batch, ATTRIBUTE, infos)


def install() -> None:
    """Wrap ``ForwardBatch.init_new`` (once per process) to attach each prefill's requests."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from .settings import ENV_DIR, DumpConfigError

    declared = CARRIES_RIDS.get(SERIES_RELEASE)
    has = "rids" in {f.name for f in dataclasses.fields(ForwardBatch)}
    if declared is None or declared != has:
        raise DumpConfigError(
            f"{ENV_DIR} is set but how sglang {SERIES_RELEASE}'s ForwardBatch carries request ids is "
            f"{'not declared' if declared is None else 'not as declared'} (identity.CARRIES_RIDS: "
            f"{declared}; the class has a rids field: {has}); unset {ENV_DIR} or port the series")
    _BY_RID["on"] = has
    original = ForwardBatch.__dict__["init_new"].__func__
    if getattr(original, "_eagle3_identity", False):
        return

    def init_new(cls, batch, model_runner, *args, **kwargs):
        forward_batch = original(cls, batch, model_runner, *args, **kwargs)
        _attach(forward_batch, batch)
        return forward_batch

    init_new.__doc__ = original.__doc__
    init_new._eagle3_identity = True
    ForwardBatch.init_new = classmethod(init_new)
