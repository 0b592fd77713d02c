"""The patched server's per-request dump files: name, read and validate.

A dump is ``<DIR>/<sha256 of the request's rid>.safetensors`` (format ``eagle3-dump/1``; series
0.5.9-4, 0.5.17-3, 0.5.23-4 and later), written by a background thread after the forward through a
temporary name and a rename, so it appears whole some time after ``/generate`` has answered;
``POST /eagle3_dump/flush`` returns once every request prefilled before it is on disk. The client
sends its own rid (``new_rid``), so it knows the file's name before it asks. The metadata says whose
request the file holds: ``rid``, ``prompt_key`` (sha256 of the stored ids written "1,2,3", the
file name of the series before) and ``input_source``.

Compact files (format ``eagle3-dump/2``, docs/design.md "Compact storage") store states as fp8 with
a scale per row and/or leave out what the target's weights rebuild (the embedding rows of the
vocabulary, the post-norm final state); ``load_dump`` gives the same ``Dump`` for both formats:
dequantised as speculators' hs-connectors does, rebuilt with an ``eaglepatch.storage.Rebuilder``
only when the digest each left-out entry records of the served checkpoint's tensor is that of the
rebuilder's directory (``Rebuilder.check``: another checkpoint, or a file with no digest, is
refused in one line). A value this reader does not know (storage dtype, scale layout, something
left out) is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "eagle3-dump/1"  # every state stored whole, in the model dtype
FORMAT_COMPACT = "eagle3-dump/2"  # fp8 states and/or states left out (docs/design.md, "Compact storage")
FORMATS = (FORMAT, FORMAT_COMPACT)
REQUIRED_META = ("format", "key", "eagle3_layer_ids", "hf_hidden_state_indices", "final", "hidden_size",
                 "num_hidden_layers", "dtype", "num_tokens")
COMPACT_META = ("storage_dtype", "scale_layout", "left_out", "vocab_size")  # every eagle3-dump/2 file's too
IDENTITY_META = ("rid", "prompt_key", "input_source")  # whose request the file holds (series of issue 19 on)
RID_PREFIX = "eaglepatch-"
FP8 = "float8_e4m3fn"
MODEL_DTYPES = ("bfloat16", "float16", "float32")
SCALE_LAYOUTS = {"none": False, "per_token_per_state": True}  # scale_layout -> whether states are fp8
EMBEDDING = "layer.-1"
SCALE_PREFIX, ROWS_PREFIX = "scale.", "rows."
# what a /2 file may leave out: state -> its rebuild kind and the fields of its ``left_out`` entry, besides
# ``weights`` (the served tensor's digest record, ``WEIGHTS``; a file without it is refused by ``Rebuilder.check``)
LEFT_OUT = {EMBEDDING: ("embed_tokens", ("rebuild", "rows")), "final": ("final_norm", ("rebuild", "from", "eps"))}
WEIGHTS = "weights"
REBUILD_FIX = ("pass the served model's directory with its weights (tools/extract.py --model DIR; "
               "load_dump(..., rebuilder=eaglepatch.storage.Rebuilder(DIR)))")


class BadDump(Exception):
    """A dump that must not go into the dataset; the message names the file and the problem."""


def prompt_key(token_ids) -> str:
    """sha256 of the ids written "id0,id1,...": the metadata's ``prompt_key`` (the file's name before
    issue 19)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def new_rid() -> str:
    """A request id of this client's own: one per sample, sent with every try of it on any server."""
    return RID_PREFIX + uuid.uuid4().hex


def rid_key(rid: str) -> str:
    """The dump file's key of the request ``rid``: sha256 of the rid's UTF-8 bytes."""
    return hashlib.sha256(rid.encode("utf-8")).hexdigest()


DIRS_META = "dump_dirs"  # the server's EAGLE3_DUMP_DIR directories, in its order (JSON; the file sink's)


def dump_dirs(directory: Path | str) -> list[Path]:
    """The directories of a dump directory as the server's ``EAGLE3_DUMP_DIR`` names them: one, or
    several separated by ``os.pathsep`` (one per local disk); ``~`` expanded."""
    return [Path(os.path.expanduser(part.strip())) for part in str(directory).split(os.pathsep)]


def _dir_identity(path: str):
    """What makes two names one directory: its device and inode where it exists (a symlink, a bind
    mount), else its real path."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def dump_dir_entries(value) -> list[Path]:
    """``dump_dirs`` of a ``--dump-dir`` value as given (``tools/serve.py`` and ``tools/extract.py``),
    ``~`` expanded, refused (``UsageError``) when an entry is empty (``Path("")`` would be the working
    directory) or names a directory already listed, as itself or through a link (the server would
    spread files over one directory twice, and the client look for half of them in the wrong one)."""
    from ..errors import UsageError

    parts = [part.strip() for part in str(value).split(os.pathsep)]
    if not all(parts):
        raise UsageError(f"--dump-dir {str(value)!r} has an empty entry",
                         f"pass one directory, or several separated by {os.pathsep!r} (one per disk), as the "
                         f"server's EAGLE3_DUMP_DIR")
    parts = [os.path.expanduser(part) for part in parts]
    norm = [os.path.normpath(os.path.abspath(part)) for part in parts]
    once = "list each directory once, as the server's EAGLE3_DUMP_DIR"
    seen: dict = {}
    for i, n in enumerate(norm):
        if n in norm[:i]:
            raise UsageError(f"--dump-dir names {n} twice", once)
        ident = _dir_identity(n)
        if ident in seen:
            raise UsageError(f"--dump-dir names {seen[ident]} and {n}, which are the same directory "
                             f"({os.path.realpath(n)})", once)
        seen[ident] = n
    return [Path(part) for part in parts]


def spread(key: str, count: int) -> int:
    """Which of ``count`` dump directories holds the file of ``key``: the server's ``sinks.spread``
    (the first 8 bytes of the key's sha256, big-endian, modulo ``count``; tests/test_dump_dirs.py
    holds the two to each other)."""
    if count == 1:
        return 0
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % count


def dump_path(directory: Path | str, key: str) -> Path:
    dirs = dump_dirs(directory)
    return dirs[spread(key, len(dirs))] / f"{key}.safetensors"


def read_metadata(path: Path) -> dict:
    """The file's safetensors metadata (read without torch: framework numpy loads no tensor here)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return dict(f.metadata() or {})


def any_server_dumps(directory: Path) -> list[Path]:
    """Dump files in ``directory`` (any key; each of its directories) that carry one of these
    formats' metadata."""
    found = []
    for p in [p for d in dump_dirs(directory) for p in sorted(d.glob("*.safetensors"))[:50]]:
        try:
            if read_metadata(p).get("format") in FORMATS:
                found.append(p)
        except Exception:
            continue
    return found


@dataclass
class Dump:
    """A dump as every reader sees it: ``layers`` and ``final`` are model-dtype tensors [T, H]
    whatever the file's layout (fp8 states dequantised, left-out states rebuilt)."""
    path: Path
    meta: dict
    layer_ids: list  # EAGLE-3 ids, in the order stored (the metadata's HF indices are checked to be these plus one)
    layers: dict  # "layer.<k>" -> tensor [T, H]
    final: object  # tensor [T, H] or None
    input_ids: object  # int64 [T]
    storage: str = ""  # the dtype states are stored in: the model dtype, or float8_e4m3fn
    # fp8 states stored with every row: name -> (q float8_e4m3fn [T, H], scale float32 [T, 1]), as the
    # file holds them (an fp8 export passes them on untouched)
    encoded: dict = field(default_factory=dict)
    rebuilt: dict = field(default_factory=dict)  # name -> rebuild kind, of the states rebuilt from weights


def storage_meta(meta: dict) -> dict:
    """The storage layout ``meta`` (a dump's metadata, or a dataset's recorded ``dump_meta``) names:
    ``storage_dtype``, ``scale_layout``, ``left_out`` (JSON text); where a field is absent (an
    ``eagle3-dump/1`` file) the plain layout: the model dtype, no scales, nothing left out."""
    plain = {"storage_dtype": meta.get("dtype"), "scale_layout": "none", "left_out": "{}"}
    return {k: meta.get(k, v) for k, v in plain.items()}


def _json_list(meta: dict, name: str, path: Path) -> list:
    try:
        v = json.loads(meta[name])
    except (ValueError, TypeError):
        raise BadDump(f"{path.name}: metadata {name}={meta.get(name)!r} is not a JSON list") from None
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        raise BadDump(f"{path.name}: metadata {name}={meta.get(name)!r} is not a list of integers")
    return v


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _expect(path: Path, name: str, t, shape: tuple, dtype: str, source: str = "metadata says") -> None:
    """BadDump unless tensor ``name`` has ``shape`` and ``dtype`` (a name, e.g. "bfloat16")."""
    if tuple(t.shape) != tuple(shape):
        raise BadDump(f"{path.name}: {name} has shape {tuple(t.shape)}, expected [{', '.join(map(str, shape))}]")
    if _dtype_name(t) != dtype:
        raise BadDump(f"{path.name}: {name} is {t.dtype}, {source} {dtype}")


def _no_match(path: Path, names, expected, together=()) -> BadDump:
    both = f"; {sorted(together)} all or none" if together else ""
    return BadDump(f"{path.name}: tensors {sorted(names)} do not match the metadata (expected {sorted(expected)}{both})")


def _plain_states(path: Path, meta: dict, tensors: dict, state_names: list, T: int, H: int) -> dict:
    """``eagle3-dump/1``: every state whole, [T, H] in the model dtype."""
    if meta["dtype"] not in MODEL_DTYPES:
        raise BadDump(f"{path.name}: format {FORMAT} with dtype {meta['dtype']!r}, but {FORMAT} files hold their "
                      f"states in the model dtype ({', '.join(MODEL_DTYPES)}; fp8 states are {FORMAT_COMPACT})")
    expected = set(state_names) | {"input_ids"}
    if set(tensors) != expected:
        raise _no_match(path, tensors, expected)
    for name in state_names:
        _expect(path, name, tensors[name], (T, H), meta["dtype"])
    return {name: tensors[name] for name in state_names}


@dataclass
class _Compact:
    """A ``/2`` file's storage metadata, checked: every value one this reader knows."""
    dtype: object  # the model dtype (torch), what the reader yields
    storage: str
    fp8: bool
    left_out: dict
    vocab_size: int


def _compact_settings(path: Path, meta: dict, layer_ids: list, has_final: bool) -> _Compact:
    import torch

    lacks = [k for k in COMPACT_META if k not in meta]
    if lacks:
        raise BadDump(f"{path.name}: format {FORMAT_COMPACT} but the metadata lacks {lacks}")
    model = meta["dtype"]
    if model not in MODEL_DTYPES:
        raise BadDump(f"{path.name}: model dtype {model!r} is not one this reader knows ({', '.join(MODEL_DTYPES)})")
    storage, layout = meta["storage_dtype"], meta["scale_layout"]
    if storage not in (model, FP8):
        raise BadDump(f"{path.name}: storage_dtype {storage!r} is not one this reader knows (the model dtype {model!r} "
                      f"or {FP8!r}); read it with the eaglepatch of the server's series, or serve with "
                      f"EAGLE3_DUMP_DTYPE=bf16 or fp8")
    if layout not in SCALE_LAYOUTS:
        raise BadDump(f"{path.name}: scale_layout {layout!r} is not one this reader knows ({', '.join(SCALE_LAYOUTS)}); "
                      f"read it with the eaglepatch of the server's series")
    if SCALE_LAYOUTS[layout] != (storage == FP8):
        raise BadDump(f"{path.name}: scale_layout {layout!r} does not go with storage_dtype {storage!r} "
                      f"({FP8} states have per_token_per_state scales, others none)")
    try:
        left_out = json.loads(meta["left_out"])
        vocab, n_layers = int(meta["vocab_size"]), int(meta["num_hidden_layers"])
    except (ValueError, TypeError):
        raise BadDump(f"{path.name}: metadata left_out={meta['left_out']!r} is not JSON, or vocab_size="
                      f"{meta['vocab_size']!r} / num_hidden_layers={meta['num_hidden_layers']!r} not integers") from None
    if not isinstance(left_out, dict) or vocab < 1:
        raise BadDump(f"{path.name}: metadata left_out={meta['left_out']!r} is not a JSON object or vocab_size "
                      f"{vocab} is not positive")
    for name, entry in left_out.items():
        if name not in LEFT_OUT:
            raise BadDump(f"{path.name}: left_out names {name!r}, which this reader cannot rebuild (it rebuilds "
                          f"{', '.join(LEFT_OUT)}); read it with the eaglepatch of the server's series")
        kind, fields = LEFT_OUT[name]
        got = entry.get("rebuild") if isinstance(entry, dict) else None
        if got != kind:
            raise BadDump(f"{path.name}: left_out[{name!r}] has rebuild kind {got!r}, this reader knows {kind!r}; "
                          f"read it with the eaglepatch of the server's series")
        if sorted(set(entry) - {WEIGHTS}) != sorted(fields):
            raise BadDump(f"{path.name}: left_out[{name!r}] has fields {sorted(entry)}, this reader knows "
                          f"{list(fields) + [WEIGHTS]}")
        if WEIGHTS in entry and not _weights_record(entry[WEIGHTS]):
            raise BadDump(f"{path.name}: left_out[{name!r}][{WEIGHTS!r}]={entry[WEIGHTS]!r} is not a record of a "
                          f"checkpoint tensor this reader knows; read it with the eaglepatch of the server's series")
    emb, fin = left_out.get(EMBEDDING), left_out.get("final")
    if emb is not None and (emb["rows"] != "vocab" or -1 not in layer_ids):
        raise BadDump(f"{path.name}: left_out[{EMBEDDING!r}]={emb} (rows 'vocab' of a dumped layer.-1 is what this "
                      f"reader knows; the file's layers are {layer_ids})")
    if fin is not None:
        eps = fin["eps"]
        last = f"layer.{n_layers - 1}"
        if not has_final or fin["from"] != last or n_layers - 1 not in layer_ids:
            raise BadDump(f"{path.name}: left_out['final'] rebuilds from {fin['from']!r}, but this reader rebuilds the "
                          f"final state only from the dumped {last} of a file with final=post_norm")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise BadDump(f"{path.name}: left_out['final'] eps={eps!r} is not a positive number")
    return _Compact(getattr(torch, model), storage, storage == FP8, left_out, vocab)


def _weights_record(r) -> bool:
    """Whether ``r`` is a ``weights`` record this reader knows: a checkpoint tensor's name, dtype,
    shape and sha256 (``eaglepatch.storage.RECORD_FIELDS``), or the dummy-weights marker."""
    from ..storage import DUMMY_RECORD, RECORD_FIELDS

    if r == DUMMY_RECORD:
        return True
    return (isinstance(r, dict) and sorted(r) == sorted(RECORD_FIELDS) and isinstance(r["tensor"], str)
            and isinstance(r["dtype"], str) and isinstance(r["shape"], list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in r["shape"])
            and isinstance(r["sha256"], str) and re.fullmatch("[0-9a-f]{64}", r["sha256"]) is not None)


def _compact_states(path: Path, meta: dict, tensors: dict, state_names: list, T: int, H: int, c: _Compact,
                    rebuilder, encoded: dict, rebuilt: dict) -> dict:
    """``eagle3-dump/2``: the stored states checked and dequantised (whole fp8 ones noted in
    ``encoded``), then the left-out ones rebuilt (noted in ``rebuilt``)."""
    import torch

    from ..storage import dequantize

    def with_scale(names):
        return set(names) | ({SCALE_PREFIX + n for n in names} if c.fp8 else set())

    whole = [n for n in state_names if n not in c.left_out]
    expected = with_scale(whole) | {"input_ids"}
    partial = with_scale([EMBEDDING]) | {ROWS_PREFIX + EMBEDDING} if EMBEDDING in c.left_out else set()
    names = set(tensors)
    if names - partial != expected or (names & partial and names & partial != partial):
        raise _no_match(path, names, expected, partial)

    def decode(name: str, rows: int):
        t = tensors[name]
        if not c.fp8:
            _expect(path, name, t, (rows, H), c.storage, "storage_dtype says")
            return t, None
        s = tensors[SCALE_PREFIX + name]
        _expect(path, name, t, (rows, H), FP8, "storage_dtype says")
        _expect(path, SCALE_PREFIX + name, s, (rows, 1), "float32", "expected")
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            raise BadDump(f"{path.name}: {SCALE_PREFIX + name} holds scales that are not finite positive numbers")
        return dequantize(t, s, c.dtype), (t, s)

    out = {}
    for name in whole:
        out[name], enc = decode(name, T)
        if enc is not None:
            encoded[name] = enc
    if c.left_out and rebuilder is None:
        raise BadDump(f"{path.name}: the dump leaves out {sorted(c.left_out)}, rebuilt from the target's weights, and "
                      f"no model directory was given to rebuild them; {REBUILD_FIX}")
    for name in sorted(c.left_out):  # rebuilt only from the very tensors the server ran (UsageError otherwise)
        rebuilder.check(name, c.left_out[name].get(WEIGHTS), meta.get("model_path", "?"), path.name)
    if EMBEDDING in c.left_out:
        out[EMBEDDING] = _rebuild_embedding(path, tensors, T, H, c, rebuilder, decode)
        rebuilt[EMBEDDING] = LEFT_OUT[EMBEDDING][0]
    if "final" in c.left_out:
        spec = c.left_out["final"]
        out["final"] = rebuilder.final(out[spec["from"]], float(spec["eps"]))
        rebuilt["final"] = LEFT_OUT["final"][0]
    return {name: out[name] for name in state_names}


def _rebuild_embedding(path: Path, tensors: dict, T: int, H: int, c: _Compact, rebuilder, decode):
    """``layer.-1`` [T, H]: the stored rows at ``rows.layer.-1``, every other row
    ``embed_tokens.weight[input_id]``."""
    import torch

    ids = tensors["input_ids"]
    keep = torch.zeros(T, dtype=torch.bool)
    part = None
    rows_name = ROWS_PREFIX + EMBEDDING
    if rows_name in tensors:
        rows = tensors[rows_name]
        if rows.dtype != torch.int64 or rows.dim() != 1 or not 0 < rows.numel() <= T:
            raise BadDump(f"{path.name}: {rows_name} is {rows.dtype} {tuple(rows.shape)}, expected int64 [R] with "
                          f"0 < R <= {T}")
        if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
            raise BadDump(f"{path.name}: {rows_name} is not sorted and unique")
        if int(rows[0]) < 0 or int(rows[-1]) >= T:
            raise BadDump(f"{path.name}: {rows_name} holds positions outside 0..{T - 1}")
        part, _ = decode(EMBEDDING, rows.numel())
        keep[rows] = True
    todo = torch.nonzero(~keep).flatten()
    todo_ids = ids[todo]
    if todo_ids.numel() and int(todo_ids.max()) >= c.vocab_size:
        t = int(todo[int(torch.argmax(todo_ids))])
        raise BadDump(f"{path.name}: {EMBEDDING} row {t} (id {int(ids[t])} >= vocab_size {c.vocab_size}) is neither "
                      f"stored nor rebuildable from the vocabulary")
    out = torch.empty((T, H), dtype=c.dtype)
    out[todo] = rebuilder.embedding(todo_ids, c.dtype, hidden_size=H)
    if part is not None:
        out[keep] = part
    return out


def load_dump(path: Path, sent_ids, hidden_size: int | None = None, need_final: bool = True,
              key: str | None = None, rid: str | None = None, rebuilder=None) -> Dump:
    """Read ``path`` and check it against what was sent; raises BadDump naming the file.

    With ``rid`` (the request's id, as sent): the file is that request's, by the contract of issue 19:
    ``key`` = ``rid_key(rid)``, metadata ``rid`` = ``rid``, ``prompt_key`` = ``prompt_key(sent_ids)``,
    ``input_source`` = ``input_ids``. Without it, a file of the series before: ``key`` (default
    ``prompt_key(sent_ids)``) is the sent ids' key.

    ``eagle3-dump/1`` and ``/2`` files give the same ``Dump``: a ``/2`` file's fp8 states are
    dequantised, its left-out states rebuilt with ``rebuilder`` (an ``eaglepatch.storage.Rebuilder``
    of the served model's directory: needed only when the file leaves something out; its problems
    raise UsageError). Every value is checked finite after that."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise BadDump(f"{path.name}: the dump file vanished before it could be read") from None
    except Exception as exc:
        raise BadDump(f"{path.name}: truncated or corrupt safetensors file ({type(exc).__name__}: "
                      f"{str(exc)[:120]})") from None
    return request_dump(path, meta, tensors, sent_ids, hidden_size, need_final, key, rid, rebuilder)


def request_dump(path: Path, meta: dict, tensors: dict, sent_ids, hidden_size: int | None = None,
                 need_final: bool = True, key: str | None = None, rid: str | None = None, rebuilder=None) -> Dump:
    """``load_dump``'s checks of a dump against the request it answers, then ``decode``, on metadata
    and tensors however they were read: from a file, or from a Mooncake Store object
    (``eaglepatch.mooncake.StoreReader.tensors``; ``path`` then names the object in messages)."""
    import torch

    path = Path(path)
    _check_header(path, meta)
    sent = [int(t) for t in sent_ids]
    if rid is not None:
        lacks = [k for k in IDENTITY_META if k not in meta]
        if lacks:
            raise BadDump(f"{path.name}: metadata lacks {lacks} (written by a series before 0.5.9-4 / 0.5.17-3 / "
                          f"0.5.23-4, which names files by prompt)")
        if meta["rid"] != rid:
            raise BadDump(f"{path.name}: metadata rid {meta['rid']!r} is not the request's rid {rid!r}")
        if meta["key"] != rid_key(rid):
            raise BadDump(f"{path.name}: metadata key {meta['key'][:16]}... is not sha256 of the rid {rid!r}")
        if meta["input_source"] != "input_ids":
            raise BadDump(f"{path.name}: metadata input_source={meta['input_source']!r}, the request sent input_ids")
        if meta["prompt_key"] != prompt_key(sent):
            raise BadDump(f"{path.name}: metadata prompt_key {meta['prompt_key'][:16]}... is not the key of the "
                          f"{len(sent)} token ids sent")
    elif meta["key"] != (key or prompt_key(sent)):
        raise BadDump(f"{path.name}: metadata key {meta['key'][:16]}... is not the key of the sent ids")
    ids = tensors.get("input_ids")
    if ids is None:
        raise BadDump(f"{path.name}: no input_ids tensor")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise BadDump(f"{path.name}: input_ids is {ids.dtype} {tuple(ids.shape)}, expected int64 [T]")
    if ids.tolist() != sent:
        raise BadDump(f"{path.name}: input_ids differ from the {len(sent)} token ids sent")
    T = len(sent)
    try:
        num_tokens, H = int(meta["num_tokens"]), int(meta["hidden_size"])
    except ValueError:
        raise BadDump(f"{path.name}: num_tokens/hidden_size metadata are not integers") from None
    if num_tokens != T:
        raise BadDump(f"{path.name}: metadata num_tokens={num_tokens}, sent {T} tokens")
    if hidden_size is not None and H != hidden_size:
        raise BadDump(f"{path.name}: hidden_size {H}, the model's config says {hidden_size}")
    layer_ids = _json_list(meta, "eagle3_layer_ids", path)
    hf = _json_list(meta, "hf_hidden_state_indices", path)
    if hf != [k + 1 for k in layer_ids]:
        raise BadDump(f"{path.name}: HF indices {hf} are not the EAGLE-3 ids {layer_ids} plus one")
    if meta["final"] != "post_norm" and need_final:
        raise BadDump(f"{path.name}: the dump has no final hidden state (final={meta['final']!r}); "
                      f"the server runs with EAGLE3_DUMP_FINAL=0")
    return decode(path, meta, tensors, rebuilder)


def _check_header(path: Path, meta: dict) -> None:
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise BadDump(f"{path.name}: metadata lacks {missing}")
    if meta["format"] not in FORMATS:
        raise BadDump(f"{path.name}: format {meta['format']!r}, this reader knows {' and '.join(FORMATS)}; read it "
                      f"with the eaglepatch of the server's series")


def all_finite(t) -> bool:
    """Whether every value of the float tensor ``t`` is finite, in one pass over it: a NaN or an
    infinity anywhere makes its minimum or maximum non-finite (``torch.aminmax`` propagates NaN), so
    this is exact. 5-8x faster than ``torch.isfinite(t).all()`` on bf16 states on a CPU
    (``benchmarks/extract_path.py``), which makes a bool tensor and converts every value first."""
    import torch

    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def decode(path: Path, meta: dict, tensors: dict, rebuilder=None) -> Dump:
    """The ``Dump`` of a dump's metadata and tensors (``input_ids`` among them), past ``load_dump``'s
    checks of the request (rid, key, ids sent, token count): the tensor set, shapes and dtypes
    checked against the metadata, a ``/2`` file's storage values checked, its fp8 states
    dequantised and left-out states rebuilt with ``rebuilder``, every state checked finite.
    ``path`` names the file in messages. Raises BadDump."""
    import torch

    path = Path(path)
    _check_header(path, meta)
    ids = tensors.get("input_ids")
    if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
        raise BadDump(f"{path.name}: no input_ids tensor of int64 [T]")
    T = int(ids.shape[0])
    try:
        H = int(meta["hidden_size"])
    except ValueError:
        raise BadDump(f"{path.name}: hidden_size metadata {meta['hidden_size']!r} is not an integer") from None
    layer_ids = _json_list(meta, "eagle3_layer_ids", path)
    has_final = meta["final"] == "post_norm"
    state_names = sorted({f"layer.{k}" for k in layer_ids} | ({"final"} if has_final else set()))
    encoded, rebuilt = {}, {}
    if meta["format"] == FORMAT:
        storage = meta["dtype"]
        states = _plain_states(path, meta, tensors, state_names, T, H)
    else:
        c = _compact_settings(path, meta, layer_ids, has_final)
        storage = c.storage
        states = _compact_states(path, meta, tensors, state_names, T, H, c, rebuilder, encoded, rebuilt)
    for name in state_names:
        t = states[name]
        if not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            how = " after dequantising" if storage == FP8 and name not in rebuilt else ""
            raise BadDump(f"{path.name}: {name} holds {bad} non-finite values{how}")
    return Dump(path, meta, layer_ids, {f"layer.{k}": states[f"layer.{k}"] for k in layer_ids}, states.get("final"),
                ids, storage, encoded, rebuilt)


RID_PATTERN = re.compile(RID_PREFIX + "[0-9a-f]{32}")


@dataclass
class Sweep:
    """What ``sweep_unused`` found: files removed, files left (``--keep-dumps``, or not removable),
    and the requests to look for again (no file yet: it may still be written)."""
    removed: list
    left: list
    pending: list


def sweep_unused(entries, used, keep_files: bool, now: float, keep_s: float) -> Sweep:
    """The dump files of this client's own requests (``entries``: {"rid", "dir", "t"} as
    ``record.note_request`` wrote them) that no sample used (``used``: rids of done samples): removed,
    or only listed with ``keep_files``. Only a file named sha256(rid) whose metadata names that same
    rid is touched: a rid of another form, or a file of another request at that name, is never
    another client's file to remove. A request whose file is not there is looked for again until
    ``keep_s`` seconds after it was sent (a server may write it late)."""
    out = Sweep([], [], [])
    seen = set()
    for e in entries:
        rid, where = e.get("rid"), e.get("dir")
        if not (isinstance(rid, str) and RID_PATTERN.fullmatch(rid) and isinstance(where, str)) or rid in used \
                or rid in seen:
            continue
        seen.add(rid)
        path = dump_path(where, rid_key(rid))
        try:
            regular = stat.S_ISREG(os.lstat(path).st_mode)
        except OSError:
            regular = False
        if not regular:
            t = e.get("t")
            if isinstance(t, (int, float)) and now - t < keep_s:
                out.pending.append(e)
            continue
        try:
            mine = read_metadata(path).get("rid") == rid
        except Exception:  # not a safetensors file this client can read: not touched
            mine = False
        if not mine:
            continue
        if keep_files:
            out.left.append(path)
            out.pending.append(e)
            continue
        try:
            os.unlink(path)
            out.removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            out.left.append(path)
            out.pending.append(e)
    return out


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


EXACT_DIRS_FIX = ("pass the server's EAGLE3_DUMP_DIR exactly, every directory in its order (as this machine sees "
                  "them), with --dump-dir")


def server_dirs(meta: dict) -> list | None:
    """The server's dump directories a dump's metadata names (``DIRS_META``; None: not named, a
    series before it or another sink)."""
    try:
        dirs = json.loads(meta[DIRS_META])
    except (KeyError, TypeError, ValueError):
        return None
    return dirs if isinstance(dirs, list) and dirs and all(isinstance(d, str) for d in dirs) else None


def dirs_problem(meta: dict, dump_dir, key: str | None = None) -> tuple[str, str] | None:
    """(problem, fix) when the server that wrote a dump (its ``meta``) spreads its files over another
    number of directories than ``dump_dir`` lists: the client looks for most files where they are not
    (with fewer, those of the directories left out are never found). ``key``: the file looked for."""
    theirs, mine = server_dirs(meta), dump_dirs(dump_dir)
    if theirs is None or len(theirs) == len(mine):
        return None
    home = f" (the file of key {key[:16]}... is in its {theirs[spread(key, len(theirs))]})" if key else ""
    return (f"the server spreads its dump files by key over {len(theirs)} directories (its EAGLE3_DUMP_DIR="
            f"{os.pathsep.join(theirs)}) but --dump-dir {dump_dir} lists {len(mine)}{home}", EXACT_DIRS_FIX)


def check_dump_dirs(meta: dict, dump_dir) -> None:
    """UsageError (one line) when ``dirs_problem`` finds one: a run that goes on would miss files."""
    from ..errors import UsageError

    problem = dirs_problem(meta, dump_dir)
    if problem:
        raise UsageError(*problem)


def no_dump_message(dump_dir: Path, what: str, key: str | None = None) -> tuple[str, str]:
    """(problem, fix) when /generate answered and the server flushed its dumps but the first request's
    file is not there; ``what`` names the request (rid, key ``key``) and the server."""
    dirs = dump_dirs(dump_dir)
    elsewhere = [d for d in dirs if key and (d / f"{key}.safetensors").is_file()]
    if elsewhere:  # several directories, listed in another order (or another number) than the server's
        return (f"the dump file of {what} is in {elsewhere[0]}, but with --dump-dir {dump_dir} it belongs in "
                f"{dump_path(dump_dir, key).parent}: the server spreads files over its EAGLE3_DUMP_DIR's "
                f"directories in their order", EXACT_DIRS_FIX)
    others = any_server_dumps(Path(dump_dir))
    metas = []
    for p in others:
        try:
            metas.append(read_metadata(p))
        except Exception:
            continue
    for meta in metas:  # the server's own directories, as its files name them
        problem = dirs_problem(meta, dump_dir, key)
        if problem:
            return (f"no dump file appeared for {what} in {dump_dir}: {problem[0]}", problem[1])
    if others:
        named = any(server_dirs(m) for m in metas)  # the other dumps say the directories are the server's
        return (f"/generate answered and the server flushed its dumps but no dump file appeared for {what} "
                f"in {dump_dir}, although the directory holds {len(others)} other dump(s)",
                "look for 'EAGLE3_DUMP_DIR: dump ... failed' in the server log (a full disk?) and rerun"
                + ("" if named else "; if the server's EAGLE3_DUMP_DIR lists more directories than --dump-dir, "
                   + EXACT_DIRS_FIX))
    return (f"/generate answered and the server flushed its dumps but no dump file appeared for {what} in "
            f"{dump_dir}: the server runs without EAGLE3_DUMP_DIR, writes to a directory that is not "
            f"{dump_dir} on this machine, or spreads its files over more directories than --dump-dir lists",
            "start the patched server with EAGLE3_DUMP_DIR=<dir> and " + EXACT_DIRS_FIX)
