"""The checkpoint tensors readers rebuild left-out states from, tied to each file by a digest.

``EAGLE3_DUMP_REBUILDABLE=omit`` leaves out states a reader rebuilds from the target's weights
(``storage``): ``layer.-1`` from the embedding (``<prefix>embed_tokens.weight``), the post-norm
``final`` from the final norm's weight (``<prefix>norm.weight``); ``<prefix>`` is the first of
``PREFIXES`` the checkpoint has an embedding under (Kimi-K2.5's wrapper: ``language_model.model.``).
A reader is handed a model directory, and only this digest ties that directory to the weights the
server ran: each ``left_out`` entry records ``weights``, the tensor's name in the checkpoint, its
dtype and shape as its safetensors header states them, and ``sha256`` of ``DIGEST_TAG``, those three
as JSON (``digest_head``) and the tensor's raw bytes. It is computed here from the safetensors files
of the model path the server loaded (a file holds whole tensors, so tensor parallelism does not
matter; the sharded layout's ``model.safetensors.index.json`` or a single ``model.safetensors``);
``eaglepatch.storage.Rebuilder`` computes the same from the directory it is given and refuses
another.

Only weights a reader can hash as the server did qualify: the model path a local directory with
those files, loaded from them (``--load-format auto`` or ``safetensors``). Anything else refuses
omit at launch (``check_launch``: headers only) with one line. ``--load-format dummy`` (random
weights, for benchmarks) records ``{"load_format": "dummy"}`` instead of a digest: every reader
refuses such a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from typing import Dict, List, Optional, Tuple

from .settings import ENV_REBUILDABLE, DumpConfigError, resolved
from .storage import EMBEDDING, left_out_states

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# where a checkpoint keeps its text model, in the order readers look (eaglepatch.storage.PREFIXES)
PREFIXES = ("model.", "language_model.model.", "model.language_model.")
SOURCES = {EMBEDDING: "embed_tokens.weight", "final": "norm.weight"}  # left-out state -> tensor (after the prefix)
LOAD_FORMATS = ("auto", "safetensors")  # the weights come from the model path's safetensors files
# the (resolved) ServerArgs fields read here: every covered release declares them
# (tests/test_rebuild_identity.py checks each release's source)
SERVER_ARGS = ("model_path", "load_format")
DUMMY = "dummy"
DIGEST_TAG = b"eaglepatch-rebuild-weights/1\n"
HEADER_MAX = 100 << 20
CHUNK = 64 << 20  # bytes hashed per read


def digest_head(name: str, dtype: str, shape) -> bytes:
    """What the digest hashes before a tensor's bytes (``eaglepatch.storage.Rebuilder`` hashes the same)."""
    return DIGEST_TAG + json.dumps({"dtype": dtype, "shape": [int(x) for x in shape], "tensor": name},
                                   sort_keys=True).encode() + b"\n"


def _refuse(problem: str, fix: str) -> DumpConfigError:
    return DumpConfigError(f"{ENV_REBUILDABLE}=omit: {problem}; {fix}, or unset {ENV_REBUILDABLE} (store)")


def _header(path: str) -> Tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= HEADER_MAX:
            raise ValueError(f"header length {n}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + n


def _weight_map(model_dir: str, fix: str) -> Dict[str, str]:
    """tensor name -> file name, from the index or the single file's header."""
    index, single = os.path.join(model_dir, INDEX_FILE), os.path.join(model_dir, SINGLE_FILE)
    try:
        if os.path.isfile(index):
            with open(index, "rb") as f:
                wm = json.load(f).get("weight_map")
            if not isinstance(wm, dict):
                raise ValueError("no weight_map")
            return {str(k): str(v) for k, v in wm.items()}
        if os.path.isfile(single):
            return {k: SINGLE_FILE for k in _header(single)[0] if k != "__metadata__"}
    except (OSError, ValueError, AttributeError) as exc:
        raise _refuse(f"the safetensors weights of {model_dir} cannot be read ({type(exc).__name__}: {exc})",
                      fix) from None
    raise _refuse(f"{model_dir} holds no {INDEX_FILE} or {SINGLE_FILE}, the files readers rebuild the left-out "
                  f"states from and check them against", fix)


def _source(args, states: List[str]) -> Optional[Tuple[str, Dict[str, Tuple[str, str]]]]:
    """(model directory, left-out state -> (tensor name, file path)) of the weights this server
    loads (``args``: its resolved server arguments), or None with dummy weights; DumpConfigError
    when readers could not hash what it serves."""
    fmt = str(args.load_format)
    if fmt == DUMMY:
        return None
    if fmt not in LOAD_FORMATS:
        raise _refuse(f"the server loads its weights with --load-format {fmt}, but readers rebuild the left-out "
                      f"states from the model directory's safetensors files and check them against their digest",
                      "serve with --load-format auto")
    model_dir = str(args.model_path)
    if not os.path.isdir(model_dir):
        raise _refuse(f"--model-path {model_dir!r} is not a directory on this machine (a hub id or a remote path), "
                      f"so no reader can be handed the weights the left-out states are rebuilt from, or check them",
                      f"download it (huggingface-cli download {model_dir} --local-dir DIR) and serve --model-path DIR")
    fix = "serve a model directory with its safetensors weights"
    wm = _weight_map(model_dir, fix)
    prefix = next((p for p in PREFIXES if p + SOURCES[EMBEDDING] in wm), None)
    if prefix is None:
        raise _refuse(f"the weights in {model_dir} have no embedding (looked for "
                      f"{', '.join(p + SOURCES[EMBEDDING] for p in PREFIXES)})", fix)
    out = {}
    for state in states:
        name = prefix + SOURCES[state]
        if name not in wm:
            raise _refuse(f"the weights in {model_dir} have no {name}, which {state} is rebuilt from", fix)
        path = os.path.join(model_dir, wm[name])
        if not os.path.isfile(path):
            raise _refuse(f"{path} (the file {INDEX_FILE} names for {name}) does not exist", fix)
        out[state] = (name, path)
    return model_dir, out


def record(name: str, path: str) -> dict:
    """The ``weights`` record of tensor ``name`` in the safetensors file ``path``: name, dtype,
    shape and the digest of ``digest_head`` and its raw bytes, read from the file."""
    header, start = _header(path)
    spec = header.get(name)
    if not isinstance(spec, dict):
        raise ValueError(f"{path} has no tensor {name}")
    begin, end = (int(x) for x in spec["data_offsets"])
    dtype, shape = str(spec["dtype"]), [int(x) for x in spec["shape"]]
    h = hashlib.sha256(digest_head(name, dtype, shape))
    buf = bytearray(min(CHUNK, max(end - begin, 1)))
    view = memoryview(buf)
    with open(path, "rb") as f:
        f.seek(start + begin)
        left = end - begin
        while left:
            got = f.readinto(view[: min(len(buf), left)])
            if not got:
                raise ValueError(f"{path} ends inside {name}")
            h.update(view[:got])
            left -= got
    return {"tensor": name, "dtype": dtype, "shape": shape, "sha256": h.hexdigest()}


def served_weights(args, states: List[str]) -> Dict[str, dict]:
    """Left-out state -> the ``weights`` record of the tensor readers rebuild it from, read from the
    files this server loaded (``args``: its resolved server arguments); DumpConfigError (one line)
    when readers could not check them."""
    source = _source(args, states)
    if source is None:
        logger.warning("%s=omit with --load-format %s: the dump files' left-out states (%s) cannot be rebuilt (random "
                       "weights); every reader refuses them", ENV_REBUILDABLE, DUMMY, ", ".join(states))
        return {state: {"load_format": DUMMY} for state in states}
    model_dir, where = source
    started = time.monotonic()
    out = {}
    for state, (name, path) in where.items():
        try:
            out[state] = record(name, path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _refuse(f"cannot read {name} from {path} ({type(exc).__name__}: {exc})",
                          "serve a model directory with its safetensors weights") from None
    logger.info("%s=omit: left-out states rebuilt from %s (%s), digest taken in %.1f s", ENV_REBUILDABLE, model_dir,
                ", ".join(f"{s}: {r['tensor']} sha256 {r['sha256'][:16]}" for s, r in out.items()),
                time.monotonic() - started)
    return out


def check_launch(server_args, settings, indices: List[int], num_layers: int) -> None:
    """Refuse (DumpConfigError), before any weight loads, an omit whose left-out states readers
    could not check against the weights served (``_source``; headers only)."""
    states = left_out_states(settings.storage, indices, settings.final, num_layers)
    if states:
        _source(resolved(server_args), states)
