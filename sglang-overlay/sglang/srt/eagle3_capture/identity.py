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

A dump file is named after its request's id (``request_key``), the one the client sent or the one
SGLang made and returns as ``meta_info["id"]``: two requests never share a file, whatever their
prompt, image, input embeddings or LoRA adapter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

# Request ids the dump never writes: SGLang's own health probes (/health and /health_generate
# send a generate request with such an id).
SKIPPED_RID_PREFIXES = ("HEALTH_CHECK",)
ATTRIBUTE = "_eagle3_requests"  # where the ForwardBatch keeps its requests' RequestInfo list
# The scheduler's request attributes ``info`` reads, the same in every covered release
# (tests/test_release_facts.py checks each release's source).
REQ_FIELDS = ("rid", "origin_input_ids", "lora_id", "input_embeds", "multimodal_inputs")


def request_key(rid: str) -> str:
    """File key of a request: sha256 (hex) of its request id, UTF-8."""
    return hashlib.sha256(str(rid).encode("utf-8")).hexdigest()


def prompt_key(token_ids: Sequence[int]) -> str:
    """sha256 (hex) of the stored prompt ids written as '1,2,3' (kept in every file's metadata)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


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
            "rid": self.rid,
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


def requests_of(forward_batch) -> Optional[List[RequestInfo]]:
    return getattr(forward_batch, ATTRIBUTE, None)


def _attach(forward_batch, batch) -> None:
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or mode.name != "EXTEND":
        return
    reqs = getattr(batch, "reqs", None)
    if reqs is not None:
        setattr(forward_batch, ATTRIBUTE, [info(r) for r in reqs])


def install() -> None:
    """Wrap ``ForwardBatch.init_new`` (once per process) to attach each prefill's requests."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

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
