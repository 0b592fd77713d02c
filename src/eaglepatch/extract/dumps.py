"""The patched server's per-request dump files: name, read and validate.

A dump is ``<DIR>/<sha256 of the request's rid>.safetensors`` (format ``eagle3-dump/1``; series
0.5.9-4, 0.5.17-3, 0.5.23-4 and later), written by a background thread after the forward through a
temporary name and a rename, so it appears whole some time after ``/generate`` has answered;
``POST /eagle3_dump/flush`` returns once every request prefilled before it is on disk. The client
sends its own rid (``new_rid``), so it knows the file's name before it asks. The metadata says whose
request the file holds: ``rid``, ``prompt_key`` (sha256 of the stored ids written "1,2,3", the
file name of the series before) and ``input_source``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

FORMAT = "eagle3-dump/1"
REQUIRED_META = ("format", "key", "eagle3_layer_ids", "hf_hidden_state_indices", "final", "hidden_size",
                 "num_hidden_layers", "dtype", "num_tokens")
IDENTITY_META = ("rid", "prompt_key", "input_source")  # whose request the file holds (series of issue 19 on)
RID_PREFIX = "eaglepatch-"


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


def dump_path(directory: Path | str, key: str) -> Path:
    return Path(directory) / f"{key}.safetensors"


def read_metadata(path: Path) -> dict:
    """The file's safetensors metadata (read without torch: framework numpy loads no tensor here)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return dict(f.metadata() or {})


def any_server_dumps(directory: Path) -> list[Path]:
    """Dump files in ``directory`` (any key) that carry this format's metadata."""
    found = []
    for p in sorted(Path(directory).glob("*.safetensors"))[:50]:
        try:
            if read_metadata(p).get("format") == FORMAT:
                found.append(p)
        except Exception:
            continue
    return found


@dataclass
class Dump:
    path: Path
    meta: dict
    layer_ids: list  # EAGLE-3 ids, in the order stored (the metadata's HF indices are checked to be these plus one)
    layers: dict  # "layer.<k>" -> tensor [T, H]
    final: object  # tensor [T, H] or None
    input_ids: object  # int64 [T]


def _json_list(meta: dict, name: str, path: Path) -> list:
    try:
        v = json.loads(meta[name])
    except (ValueError, TypeError):
        raise BadDump(f"{path.name}: metadata {name}={meta.get(name)!r} is not a JSON list") from None
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        raise BadDump(f"{path.name}: metadata {name}={meta.get(name)!r} is not a list of integers")
    return v


def load_dump(path: Path, sent_ids, hidden_size: int | None = None, need_final: bool = True,
              key: str | None = None, rid: str | None = None) -> Dump:
    """Read ``path`` and check it against what was sent; raises BadDump naming the file.

    With ``rid`` (the request's id, as sent): the file is that request's, by the contract of issue 19:
    ``key`` = ``rid_key(rid)``, metadata ``rid`` = ``rid``, ``prompt_key`` = ``prompt_key(sent_ids)``,
    ``input_source`` = ``input_ids``. Without it, a file of the series before: ``key`` (default
    ``prompt_key(sent_ids)``) is the sent ids' key."""
    import torch
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in names}
    except FileNotFoundError:
        raise BadDump(f"{path.name}: the dump file vanished before it could be read") from None
    except Exception as exc:
        raise BadDump(f"{path.name}: truncated or corrupt safetensors file ({type(exc).__name__}: "
                      f"{str(exc)[:120]})") from None
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise BadDump(f"{path.name}: metadata lacks {missing}")
    if meta["format"] != FORMAT:
        raise BadDump(f"{path.name}: format {meta['format']!r}, expected {FORMAT!r}")
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
    want_dtype = meta["dtype"]
    layers = {}
    expected = {f"layer.{k}" for k in layer_ids} | {"input_ids"}
    final = None
    if meta["final"] == "post_norm":
        expected.add("final")
    elif need_final:
        raise BadDump(f"{path.name}: the dump has no final hidden state (final={meta['final']!r}); "
                      f"the server runs with EAGLE3_DUMP_FINAL=0")
    if names != expected:
        raise BadDump(f"{path.name}: tensors {sorted(names)} do not match the metadata (expected {sorted(expected)})")
    for name in sorted(expected - {"input_ids"}):
        t = tensors[name]
        if tuple(t.shape) != (T, H):
            raise BadDump(f"{path.name}: {name} has shape {tuple(t.shape)}, expected [{T}, {H}]")
        if str(t.dtype).replace("torch.", "") != want_dtype:
            raise BadDump(f"{path.name}: {name} is {t.dtype}, metadata says {want_dtype}")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise BadDump(f"{path.name}: {name} holds {bad} non-finite values")
        if name == "final":
            final = t
        else:
            layers[name] = t
    return Dump(path, meta, layer_ids, {f"layer.{k}": layers[f"layer.{k}"] for k in layer_ids}, final, ids)


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


def no_dump_message(dump_dir: Path, what: str) -> tuple[str, str]:
    """(problem, fix) when /generate answered and the server flushed its dumps but the first request's
    file is not there; ``what`` names the request (rid, key) and the server."""
    others = any_server_dumps(Path(dump_dir))
    if others:
        return (f"/generate answered and the server flushed its dumps but no dump file appeared for {what} "
                f"in {dump_dir}, although the directory holds {len(others)} other dump(s)",
                "look for 'EAGLE3_DUMP_DIR: dump ... failed' in the server log (a full disk?) and rerun")
    return (f"/generate answered and the server flushed its dumps but no dump file appeared for {what} in "
            f"{dump_dir}: the server runs without EAGLE3_DUMP_DIR, or writes to a directory that is not "
            f"{dump_dir} on this machine",
            "start the patched server with EAGLE3_DUMP_DIR=<dir> and pass that same directory, as this "
            "machine sees it, with --dump-dir")
