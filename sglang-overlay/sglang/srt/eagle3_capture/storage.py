"""How the dump stores a forward's states: bf16 as computed, or fp8 with a scale per (token, state);
and which states it leaves out because a trainer rebuilds them from the target's weights.

``EAGLE3_DUMP_DTYPE=fp8``: every stored state becomes ``float8_e4m3fn`` [T, H] plus a float32
scale per row, ``scale.<name>`` [T, 1] (one per token and state: the states of one token differ
in norm by 100x and more, and a scale shared by them would flush the small ones to fp8's
subnormals). It is quantised where the rows are, before any copy: on the GPU in the dump's side
stream, so PCIe, host memory and the disk all carry half. Readers dequantise as speculators'
hs-connectors does, ``q.to(dtype) * scale.to(dtype)``.

``EAGLE3_DUMP_REBUILDABLE=omit``: the embedding output (``layer.-1``) of a row whose id is in the
vocabulary is ``embed_tokens.weight[id]``, so only the other rows (image rows of a multimodal
wrapper, every row of an ``input_embeds`` request) are stored, with their positions
(``rows.layer.-1``); and the post-norm ``final``, when the last layer's pre-norm output is dumped
too, is that output's final RMSNorm, so it is not copied at all. The file's ``left_out`` says what
was left out and how to rebuild it (docs/design.md, "Compact storage"), and each entry the
digest of the checkpoint tensor it is rebuilt from (``weights``), which a reader checks against
the model directory it is given. A request whose embedding rows may not be the vocabulary's
(``every_embedding_row``: ``input_embeds``, or a LoRA adapter, which may target ``embed_tokens``
or add tokens) stores all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# the scale is amax times this float32 constant: a product rounds the same on every device (CUDA
# turns a division by a scalar into a product by its reciprocal, the CPU does not)
INV_FP8_MAX = 1.0 / FP8_MAX
SCALE_MIN = 1e-12  # the scale of an all-zero row (its values quantise to 0 whatever the scale)
CHUNK_ROWS = 4096  # rows quantised per step: bounds the float32 temporary (4096 x 7168 x 4 B = 117 MiB)
FORMAT_COMPACT = "eagle3-dump/2"  # a file with fp8 states or a state left out
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}  # EAGLE3_DUMP_DTYPE -> the stored dtype
REBUILDABLE = ("store", "omit")  # EAGLE3_DUMP_REBUILDABLE
EMBEDDING = "layer.-1"
ROWS_PREFIX = "rows."
SCALE_PREFIX = "scale."


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``x`` [T, H] as float8_e4m3fn with one float32 scale per row ([T, 1]), on
    ``x``'s device and the current stream. scale = max(amax(|row|) * float32(1/448), 1e-12);
    q = clamp(x / scale, -448, 448) in float32, cast to e4m3fn (round to nearest even): the same
    bits on every device."""
    rows = x.shape[0]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    for start in range(0, rows, CHUNK_ROWS):
        part = x[start: start + CHUNK_ROWS].float()
        s = (part.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=SCALE_MIN)
        q[start: start + CHUNK_ROWS] = (part / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale[start: start + CHUNK_ROWS] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What every reader yields for a stored fp8 state (hs-connectors' own dequantisation)."""
    return q.to(dtype) * scale.to(dtype)


@dataclass(frozen=True)
class Storage:
    """The dump's storage settings (``EAGLE3_DUMP_DTYPE``, ``EAGLE3_DUMP_REBUILDABLE``)."""

    dtype: str = "bf16"  # a key of DTYPES
    rebuildable: str = "store"  # store | omit

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def omit(self) -> bool:
        return self.rebuildable == "omit"


def left_out_states(storage: Storage, indices: List[int], final: bool, num_layers: int) -> List[str]:
    """The states a writer with these settings leaves out (rebuilt by readers from the target's
    weights): the embedding output when it is dumped (its vocabulary rows), the post-norm final
    state when the last layer's pre-norm output (capture index N) is dumped too."""
    out = []
    if storage.omit and 0 in indices:
        out.append(EMBEDDING)
    if storage.omit and final and num_layers in indices:
        out.append("final")
    return out


def every_embedding_row(req) -> bool:
    """Whether a request (``identity.RequestInfo``) stores all its embedding rows when the layout
    leaves the vocabulary's out: an ``input_embeds`` request (its ids are placeholders) and a
    request with a LoRA adapter (SGLang's adapters may target ``embed_tokens`` and add tokens, and
    load at run time, so its rows need not be the checkpoint's ``embed_tokens.weight[id]``)."""
    return bool(req.input_embeds or req.lora_id)


class Layout:
    """What one writer stores of its layers: decided once, at start, from the settings and the
    layers (capture indices, ascending) it dumps. ``weights``: left-out state -> the record of
    the checkpoint tensor it is rebuilt from (``weights.served_weights``), written into its
    ``left_out`` entry; a writer that writes files has it for every state it leaves out (its
    files are refused by every reader otherwise)."""

    def __init__(self, storage: Storage, indices: List[int], final: bool, num_layers: int,
                 model_dtype: str, rms_norm_eps: Optional[float], vocab_size: int,
                 weights: Optional[Dict[str, dict]] = None):
        self.storage = storage
        self.fp8 = storage.fp8
        left = left_out_states(storage, indices, final, num_layers)
        # the embedding: only rows not from the vocabulary (needs a per-forward decision)
        self.embedding_partial = EMBEDDING in left
        # the final state: never copied when the pre-norm last layer (capture index N) is dumped
        self.final_left_out = "final" in left
        if self.final_left_out and rms_norm_eps is None:
            raise ValueError("the model's config names no rms_norm_eps, so the final state cannot be rebuilt")
        left_out: Dict[str, dict] = {}
        if self.embedding_partial:
            left_out[EMBEDDING] = {"rebuild": "embed_tokens", "rows": "vocab"}
        if self.final_left_out:
            left_out["final"] = {"rebuild": "final_norm", "from": f"layer.{num_layers - 1}",
                                 "eps": float(rms_norm_eps)}
        for name, entry in left_out.items():
            if weights and name in weights:
                entry["weights"] = dict(weights[name])
        self.left_out = left_out
        self.compact = self.fp8 or bool(left_out)
        self.model_dtype = model_dtype
        self.vocab_size = int(vocab_size)

    def metadata(self) -> Dict[str, str]:
        """The file metadata this layout adds (nothing for a plain bf16 file: ``eagle3-dump/1``)."""
        if not self.compact:
            return {}
        return {"format": FORMAT_COMPACT,
                "storage_dtype": DTYPES[self.storage.dtype] if self.fp8 else self.model_dtype,
                "scale_layout": "per_token_per_state" if self.fp8 else "none",
                "left_out": json.dumps(self.left_out, sort_keys=True),
                "vocab_size": str(self.vocab_size)}

    def warm_up(self) -> None:
        """Run the quantisation once on this process's GPU (the writer's start): its kernels load
        lazily on first use, which would otherwise cost the first prefill that dumps ~100 ms in
        the forward thread."""
        if not (self.fp8 and torch.cuda.is_available()):
            return
        dtype = getattr(torch, self.model_dtype, None) if self.model_dtype else None
        sample = torch.ones((2, 4096), dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16,
                            device=torch.device("cuda", torch.cuda.current_device()))
        quantize_rows(sample)
        torch.cuda.synchronize()

    def encoded_specs(self, name: str, t: torch.Tensor) -> List[Tuple[str, torch.dtype, tuple]]:
        """(name, dtype, shape) of each tensor ``encode`` makes of ``name``, in its order."""
        if not self.fp8 or name == "input_ids":
            return [(name, t.dtype, tuple(t.shape))]
        return [(name, torch.float8_e4m3fn, tuple(t.shape)), (SCALE_PREFIX + name, torch.float32, (t.shape[0], 1))]

    def encode(self, name: str, t: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The tensors stored for the state ``name`` (run on the stream its copy runs on)."""
        if not self.fp8 or name == "input_ids":
            return {name: t}
        q, scale = quantize_rows(t)
        return {name: q, SCALE_PREFIX + name: scale}

    def cut_embedding(self, out: Dict[str, torch.Tensor], raw_ids: torch.Tensor, all_rows: bool) -> None:
        """Keep only the embedding rows a reader cannot rebuild (``raw_ids`` >= the vocabulary:
        a multimodal wrapper's pad values; ``all_rows``: a request of ``every_embedding_row``), with
        their positions; no row to keep: no embedding tensor at all."""
        if not self.embedding_partial or EMBEDDING not in out:
            return
        keep = torch.ones_like(raw_ids, dtype=torch.bool) if all_rows else raw_ids >= self.vocab_size
        positions = torch.nonzero(keep).flatten().to(torch.int64)
        names = [EMBEDDING] + ([SCALE_PREFIX + EMBEDDING] if self.fp8 else [])
        if not positions.numel():
            for n in names:
                del out[n]
            return
        for n in names:
            out[n] = out[n].index_select(0, positions)
        out[ROWS_PREFIX + EMBEDDING] = positions
