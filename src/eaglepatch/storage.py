"""Compact dump storage on the reading side (``eagle3-dump/2``; docs/design.md, "Compact storage").

- fp8: a stored state is ``float8_e4m3fn`` [R, H] with a float32 scale per row [R, 1];
  ``quantize_rows`` is the server's arithmetic (sglang-overlay's ``eagle3_capture/storage.py``,
  compared in tests/test_storage.py) and ``dequantize`` is speculators' hs-connectors':
  ``q.to(dtype) * scale.to(dtype)``, so every reader yields the same tensors.
- left out: states a reader rebuilds from the target's weights (``Rebuilder``): the embedding
  output of vocabulary rows (``embed_tokens.weight[id]``) and the post-norm final state (the final
  RMSNorm of the last layer's pre-norm output). Each left-out entry records the digest of the
  checkpoint tensor the server ran (the overlay's ``eagle3_capture/weights.py``); ``Rebuilder.check``
  refuses a directory whose tensor is another.

``rebuild_error`` measures a rebuild against a stored copy (how the rebuild is proven).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from .errors import UsageError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_MIN = 1e-12  # the scale of an all-zero row
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# where a checkpoint keeps its text model: a causal LM ("model."), Kimi-K2.5's wrapper
# ("language_model.model."), transformers' newer multimodal layout ("model.language_model.")
PREFIXES = ("model.", "language_model.model.", "model.language_model.")
# the digest a dump records of the tensor each left-out state is rebuilt from: sha256 of
# ``digest_head`` and the tensor's raw bytes (the overlay's ``weights.DIGEST_TAG``/``digest_head``,
# held to each other by tests/test_rebuild_identity.py)
DIGEST_TAG = b"eaglepatch-rebuild-weights/1\n"
SOURCES = {"layer.-1": "embedding", "final": "norm"}  # left-out state -> the tensor it is rebuilt from
RECORD_FIELDS = ("dtype", "sha256", "shape", "tensor")  # a ``weights`` record's
DUMMY_RECORD = {"load_format": "dummy"}  # what a server with random weights records instead
STORE_FIX = "EAGLE3_DUMP_REBUILDABLE=store"
_DIGESTS: dict = {}  # (file identity, tensor name) -> record: each checkpoint file hashed once per process
_DIGESTS_LOCK = threading.Lock()


def digest_head(name: str, dtype: str, shape) -> bytes:
    """What the digest hashes before the tensor's bytes: ``DIGEST_TAG``, then name, dtype (as the
    safetensors header spells it) and shape as JSON with sorted keys, then a newline."""
    return DIGEST_TAG + json.dumps({"dtype": dtype, "shape": [int(x) for x in shape], "tensor": name},
                                   sort_keys=True).encode() + b"\n"


def quantize_rows(x):
    """(q, scale): ``x`` [R, H] as float8_e4m3fn [R, H] and a float32 scale per row [R, 1], the
    dump writer's arithmetic: in float32, scale = max(amax(|row|) * float32(1/448), 1e-12),
    q = clamp(x / scale, -448, 448) cast to float8_e4m3fn."""
    import torch

    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=SCALE_MIN)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale, dtype):
    """A stored fp8 state as every reader yields it: ``q.to(dtype) * scale.to(dtype)`` (``dtype``:
    the model dtype the file's metadata names; the product is taken in that dtype)."""
    return q.to(dtype) * scale.to(dtype)


def rms_final(pre_norm, weight, eps: float):
    """The final RMSNorm as the dump's ``left_out["final"]`` defines it: in float32,
    ``x * rsqrt(mean(x^2) + eps) * weight``, rounded to ``pre_norm``'s dtype (``weight`` is cast to
    that dtype first: the served model holds its weights in the model dtype)."""
    import torch

    x = pre_norm.float()
    w = weight.to(pre_norm.dtype).float()
    return (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w).to(pre_norm.dtype)


def _bits(t):
    """``t``'s bytes (bit-exact comparison: -0.0 is not 0.0, a NaN equals the same NaN)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def rebuild_error(stored, rebuilt) -> dict:
    """How far ``rebuilt`` is from ``stored`` (both [T, H]): ``max_abs`` (largest absolute
    difference), ``max_rel_row`` (largest ``|rebuilt_t - stored_t| / |stored_t|`` over rows, L2
    norms, as the GPU check measures states), ``bit_exact`` (same dtype, same bits) and ``rows``."""
    import torch

    if tuple(stored.shape) != tuple(rebuilt.shape):
        raise ValueError(f"shape {tuple(rebuilt.shape)} is not the stored {tuple(stored.shape)}")
    s, r = stored.float(), rebuilt.float()
    diff = r - s
    rows = s.shape[0] if s.dim() else 1
    if diff.numel() == 0:
        return {"max_abs": 0.0, "max_rel_row": 0.0, "bit_exact": stored.dtype == rebuilt.dtype, "rows": rows}
    rel = diff.reshape(rows, -1).norm(dim=-1) / s.reshape(rows, -1).norm(dim=-1).clamp_min(1e-20)
    exact = stored.dtype == rebuilt.dtype and torch.equal(_bits(stored), _bits(rebuilt))
    return {"max_abs": float(diff.abs().max()), "max_rel_row": float(rel.max()), "bit_exact": exact, "rows": rows}


class Rebuilder:
    """The target's tensors a reader rebuilds left-out states from, read from the model directory
    ``model_dir``: the embedding (``<prefix>embed_tokens.weight``) and the final norm's weight
    (``<prefix>norm.weight``), with ``<prefix>`` one of ``PREFIXES``. Only the shard(s) that hold
    them are opened (the safetensors index, or a single ``model.safetensors``) and only those two
    tensors loaded, on first use, once (thread-safe); ``check`` refuses a dump whose recorded digest
    of the served tensor is not this directory's. Problems raise ``UsageError``."""

    def __init__(self, model_dir):
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._names: dict | None = None  # tensor name -> shard file, of the two tensors
        self._tensors: dict = {}
        self._records: dict = {}  # which -> the digest record of the tensor loaded (``weights``)

    # ---- finding the tensors -------------------------------------------------------------------
    def _fix(self) -> str:
        return (f"pass the served model's directory with its safetensors weights ({INDEX_FILE} and its shards, or "
                f"{SINGLE_FILE}) as --model")

    def _weight_map(self) -> dict:
        """tensor name -> shard file name, from the index or the single file's header."""
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            try:
                wm = json.loads(index.read_bytes()).get("weight_map")
            except (OSError, ValueError, AttributeError) as exc:
                raise UsageError(f"{index} is not a readable safetensors index ({type(exc).__name__})",
                                 self._fix()) from None
            if not isinstance(wm, dict):
                raise UsageError(f"{index} has no weight_map", self._fix())
            return {str(k): str(v) for k, v in wm.items()}
        if single.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(single), framework="pt") as f:
                    return {k: SINGLE_FILE for k in f.keys()}
            except Exception as exc:
                raise UsageError(f"{single} is not a readable safetensors file ({type(exc).__name__})",
                                 self._fix()) from None
        raise UsageError(f"{self.model_dir} holds no model weights (no {INDEX_FILE} or {SINGLE_FILE}): the dump left "
                         f"states out that are rebuilt from the target's embedding and final norm", self._fix())

    def _locate(self) -> dict:
        if self._names is None:
            wm = self._weight_map()
            for prefix in PREFIXES:
                embed, norm = prefix + "embed_tokens.weight", prefix + "norm.weight"
                if embed in wm:
                    self._names = {"embedding": (embed, wm[embed]), "norm": (norm, wm.get(norm))}
                    break
            else:
                looked = ", ".join(p + "embed_tokens.weight" for p in PREFIXES)
                raise UsageError(f"the weights in {self.model_dir} have no embedding (looked for {looked})",
                                 self._fix())
        return self._names

    def tensor_name(self, which: str) -> str:
        """The checkpoint's name of ``which`` ("embedding" | "norm")."""
        return self._locate()[which][0]

    def _load(self, which: str):
        with self._lock:
            if which in self._tensors:
                return self._tensors[which]
            name, shard = self._locate()[which]
            if shard is None:
                raise UsageError(f"the weights in {self.model_dir} have no {name} (the final norm's weight)",
                                 self._fix())
            path = self.model_dir / shard
            from safetensors import safe_open

            try:
                identity = _file_identity(path, name)
                with safe_open(str(path), framework="pt") as f:
                    t = f.get_tensor(name)
                    dtype = f.get_slice(name).get_dtype()
            except FileNotFoundError:
                raise UsageError(f"{path} (the shard that holds {name}) does not exist", self._fix()) from None
            except Exception as exc:
                raise UsageError(f"cannot read {name} from {path} ({type(exc).__name__}: {str(exc)[:120]})",
                                 self._fix()) from None
            want_dim = 2 if which == "embedding" else 1
            if t.dim() != want_dim or not t.dtype.is_floating_point or t.element_size() < 2:
                raise UsageError(f"{name} in {path} is {t.dtype} {tuple(t.shape)}, not a {want_dim}-d bf16/fp16/fp32 "
                                 f"tensor", self._fix())
            self._records[which] = _record(identity, name, dtype, t)
            self._tensors[which] = t
            return t

    def weights(self, which: str) -> dict:
        """The digest record (``tensor``, ``dtype``, ``shape``, ``sha256``) of the tensor ``which``
        ("embedding" | "norm") this directory rebuilds from, as a dump records the served one's."""
        self._load(which)
        return self._records[which]

    def check(self, state: str, recorded, served: str, file: str) -> None:
        """UsageError (one line) unless ``recorded`` (a dump's ``left_out[state]["weights"]``; None:
        the file has none) is the record of the tensor this directory rebuilds ``state`` from: the
        file's ``served`` model path and this directory must hold the same tensor, bit for bit."""
        if recorded is None:
            raise UsageError(f"{file} leaves out {state} but records no digest of the weights it is rebuilt from "
                             f"(written before eaglepatch recorded one), so nothing ties it to {self.model_dir}",
                             f"dump it again with this checkout's series (python3 tools/apply.py or tools/serve.py), "
                             f"or with {STORE_FIX}")
        if recorded == DUMMY_RECORD:
            raise UsageError(f"{file} was dumped by a server with --load-format dummy (random weights): its left-out "
                             f"{state} cannot be rebuilt from {self.model_dir} or any model directory",
                             f"dump with the checkpoint's weights (--load-format auto), or with {STORE_FIX}")
        mine = self.weights(SOURCES[state])
        if recorded != mine:
            def said(r):
                return f"{r['tensor']} ({r['dtype']} {r['shape']}, sha256 {r['sha256'][:16]})"

            raise UsageError(f"{file} was dumped from {served}, whose {said(recorded)} its {state} is rebuilt from, "
                             f"but {self.model_dir} holds {said(mine)}: another checkpoint, whose rebuilt states would "
                             f"silently differ", f"pass the directory the server loaded ({served}), with the weights it "
                             f"served then, as the model directory (tools/extract.py --model)")

    # ---- rebuilding ----------------------------------------------------------------------------
    def embedding(self, ids, dtype=None, hidden_size: int | None = None):
        """``embed_tokens.weight[ids]`` [T, H] in ``dtype`` (None: the checkpoint's). UsageError when
        an id is past the embedding's rows or ``hidden_size`` is not its width (another model)."""
        import torch

        w = self._load("embedding")
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if hidden_size is not None and w.shape[1] != hidden_size:
            raise UsageError(f"{self.tensor_name('embedding')} in {self.model_dir} is [{w.shape[0]}, {w.shape[1]}] but "
                             f"the dump's hidden size is {hidden_size}", "pass the served model's directory as --model")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w.shape[0]):
            raise UsageError(f"token id {int(ids.max()) if int(ids.min()) >= 0 else int(ids.min())} is outside "
                             f"{self.tensor_name('embedding')} in {self.model_dir} ({w.shape[0]} rows)",
                             "pass the served model's directory as --model")
        out = w.index_select(0, ids)
        return out.to(dtype) if dtype is not None else out

    def final(self, pre_norm, eps: float):
        """The post-norm final state of ``pre_norm`` (the last layer's output [T, H], model dtype):
        ``rms_final`` with the checkpoint's ``norm.weight``, in ``pre_norm``'s dtype."""
        w = self._load("norm")
        if w.shape[0] != pre_norm.shape[-1]:
            raise UsageError(f"{self.tensor_name('norm')} in {self.model_dir} has {w.shape[0]} values but the dump's "
                             f"hidden size is {pre_norm.shape[-1]}", "pass the served model's directory as --model")
        return rms_final(pre_norm, w, eps)


def _file_identity(path: Path, name: str):
    """What names a checkpoint file's tensor in the digest cache: its real path, device, inode, size
    and change time (a file replaced or rewritten is another)."""
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, name)


def _record(identity, name: str, dtype: str, t) -> dict:
    """The digest record of tensor ``t`` (``name``, its safetensors ``dtype``) loaded from the file of
    ``identity``: computed from its bytes once per process and file."""
    import torch

    with _DIGESTS_LOCK:
        got = _DIGESTS.get(identity)
    if got is None:
        shape = [int(x) for x in t.shape]
        h = hashlib.sha256(digest_head(name, dtype, shape))
        h.update(t.contiguous().view(torch.uint8).numpy())
        got = {"tensor": name, "dtype": dtype, "shape": shape, "sha256": h.hexdigest()}
        with _DIGESTS_LOCK:
            _DIGESTS[identity] = got
    return dict(got)


__all__ = ["FP8_MAX", "SCALE_MIN", "quantize_rows", "dequantize", "rms_final", "rebuild_error", "Rebuilder", "digest_head"]
