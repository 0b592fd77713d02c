"""SpecForge's online capture protocol: the patched server as the capture server of SpecForge 0.2.0's
``server_capture`` adapter (issue 46).

SpecForge sends one ``/generate`` per batch of prompts: ``input_ids`` (a list per prompt),
``sampling_params`` with ``max_new_tokens`` 0 (1 on its main branch), a fresh ``extra_key`` per
prompt and ``spec_capture``, one payload per prompt::

    {"store_id": str, "sample_id": str, "gen": 1, "replace": bool,
     "features": {"aux": name, "last_hidden": name},            # each key only when its trainer reads it
     "passthrough": [{"name": str, "data": [int, ...], "shape": [1, L], "dtype": "int64"}, ...]}

and reads ``meta_info["spec_capture"]`` of each answer, in order. This server writes one hard-pinned
Mooncake object per tensor at ``{store_id}/{sample_id}/g{gen}/{name}`` (raw C-order bytes, no
header: SpecForge's ``MooncakeFeatureStore`` layout) and answers, once every object is put::

    {"sample_id", "store_id", "gen", "aux_layer_ids": [the launch's ids],
     "features": {name: {"shape": [...], "dtype": "bfloat16"}, ...}}     # every object written

or ``{"sample_id", "store_id", "gen", "error": why}`` (SpecForge retries it, ``replace`` true) when
the request could not be captured: a full store, a master that does not answer, a stop, rows the
writer never saw. (A prefix-cache hit, which would leave a capture short, cannot happen: the dump
refuses the radix cache at launch.) Nothing is answered before its objects are readable, and a
failed write leaves none of its objects behind.

What SpecForge's trainers read: ``aux`` = the launch's ids' states concatenated on the last
dimension, ``[1, L, len(ids) * H]``; id k is the output of decoder layer k (Hugging Face
``hidden_states[k + 1]``), as SpecForge and SGLang's ``set_eagle3_layers_to_capture`` read it;
``last_hidden`` = the post-norm final state ``[1, L, H]`` (what the LM head takes); passthrough
tensors as sent, int64. The ids are fixed at launch (``EAGLE3_DUMP_SPECFORGE_IDS``, SpecForge's
``--spec-capture-aux-layer-ids``); the request carries none, SpecForge compares the answer's with its
own. States are the dump's, in the model's dtype: the dump's fp8 or left-out storage is refused at
launch (SpecForge's reader takes no fp8).

This module holds the protocol only (parse, check, name, shape); the writer (``dump``) puts the
objects through its Mooncake sink, the launching process (``control``) reads the payloads from the
HTTP body and answers.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

ENV_IDS = "EAGLE3_DUMP_SPECFORGE_IDS"  # SpecForge's aux layer ids (output of layer k), comma-separated
FEATURES = ("aux", "last_hidden")  # the payload's feature kinds: the aux states, the post-norm final state
PAYLOAD_KEYS = {"store_id", "sample_id", "gen", "replace", "features", "passthrough"}
PASSTHROUGH_KEYS = {"name", "data", "shape", "dtype"}
PASSTHROUGH_DTYPES = ("int64",)  # SpecForge 0.2.0 sends int64 only
NAME_MAX = 512
HANDLE = "specforge"  # meta_info["eagle3_dump"]["sink"] of a request captured for SpecForge


class ProtocolError(ValueError):
    """A ``spec_capture`` request this server cannot take: one line naming the field and the fix."""


def parse_ids(raw: str) -> Tuple[int, ...]:
    """``EAGLE3_DUMP_SPECFORGE_IDS``: SpecForge's ids, in its order; ValueError naming the fix."""
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not parts or not all(re.fullmatch(r"[0-9]{1,6}", p) for p in parts):
        raise ValueError(f"{ENV_IDS}={raw!r} is not a comma-separated list of layer ids >= 0 (SpecForge's "
                         f"--spec-capture-aux-layer-ids, e.g. {ENV_IDS}=1,29,57)")
    ids = tuple(int(p) for p in parts)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{ENV_IDS}={raw!r} names a layer twice; SpecForge's ids are unique")
    return ids


def missing_layers(ids: Sequence[int], indices: Sequence[int]) -> List[int]:
    """The ids whose state the dump does not capture (id k = capture index k + 1)."""
    return [k for k in ids if k + 1 not in set(indices)]


def _name(value, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > NAME_MAX or not value.isprintable() or "/" in value:
        raise ProtocolError(f"spec_capture {what} {value!r} must be a printable string of 1-{NAME_MAX} "
                            f"characters without '/'")
    return value


def _ints(value, what: str) -> List[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"spec_capture {what} must be a list of integers")
    return value


def check_payload(payload, length: int, where: str = "") -> dict:
    """One prompt's payload, checked against its prompt of ``length`` tokens; a normalised copy."""
    at = f"[{where}]" if where != "" else ""
    if not isinstance(payload, dict):
        raise ProtocolError(f"spec_capture{at} must be an object with store_id, sample_id, gen, features")
    unknown = sorted(set(payload) - PAYLOAD_KEYS)
    if unknown:
        raise ProtocolError(f"spec_capture{at} has unknown fields {unknown}; this server speaks SpecForge 0.2.0's "
                            f"protocol ({', '.join(sorted(PAYLOAD_KEYS))})")
    for need in ("store_id", "sample_id", "features"):
        if need not in payload:
            raise ProtocolError(f"spec_capture{at} has no {need}")
    store_id = _name(payload["store_id"], f"{at}.store_id")
    sample_id = _name(payload["sample_id"], f"{at}.sample_id")
    gen = payload.get("gen", 1)
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 1:
        raise ProtocolError(f"spec_capture{at}.gen {gen!r} must be an integer >= 1")
    replace = payload.get("replace", False)
    if not isinstance(replace, bool):
        raise ProtocolError(f"spec_capture{at}.replace {replace!r} must be true or false")
    features = payload["features"]
    if not isinstance(features, dict) or not features or set(features) - set(FEATURES):
        raise ProtocolError(f"spec_capture{at}.features {features!r} must map some of {list(FEATURES)} to "
                            f"tensor names")
    names = {kind: _name(n, f"{at}.features.{kind}") for kind, n in features.items()}
    passthrough = []
    raw_pass = payload.get("passthrough", [])
    if not isinstance(raw_pass, list):
        raise ProtocolError(f"spec_capture{at}.passthrough must be a list")
    for i, item in enumerate(raw_pass):
        if not isinstance(item, dict) or set(item) != PASSTHROUGH_KEYS:
            raise ProtocolError(f"spec_capture{at}.passthrough[{i}] must have exactly the fields "
                                f"{sorted(PASSTHROUGH_KEYS)}")
        name = _name(item["name"], f"{at}.passthrough[{i}].name")
        data = _ints(item["data"], f"{at}.passthrough[{i}].data")
        shape = _ints(item["shape"], f"{at}.passthrough[{i}].shape")
        if item["dtype"] not in PASSTHROUGH_DTYPES:
            raise ProtocolError(f"spec_capture{at}.passthrough[{i}].dtype {item['dtype']!r} is not one of "
                                f"{list(PASSTHROUGH_DTYPES)}")
        count = 1
        for dim in shape:
            count *= dim
        if len(shape) < 2 or shape[0] != 1 or shape[1] != length or any(d < 1 for d in shape) or count != len(data):
            raise ProtocolError(f"spec_capture{at}.passthrough[{i}] ({name}) has shape {shape} and {len(data)} values; "
                                f"it must be [1, {length}, ...] (the prompt's {length} tokens) holding every value")
        passthrough.append({"name": name, "data": data, "shape": shape, "dtype": item["dtype"]})
    every = list(names.values()) + [p["name"] for p in passthrough]
    if len(set(every)) != len(every):
        raise ProtocolError(f"spec_capture{at} names a tensor twice ({every}); each object needs its own name")
    return {"store_id": store_id, "sample_id": sample_id, "gen": gen, "replace": replace, "features": names,
            "passthrough": passthrough}


def payloads(body, prompts: List[int]) -> Optional[List[dict]]:
    """The checked payloads of a ``/generate`` body (None: it asks for no capture), one per prompt
    (``prompts``: each prompt's token count, in order)."""
    if not isinstance(body, dict) or body.get("spec_capture") is None:
        return None
    raw = body["spec_capture"]
    if "text" in body and body.get("text") is not None:
        raise ProtocolError("spec_capture needs the prompts as input_ids (SpecForge sends token ids), not text")
    given = raw if isinstance(raw, list) else [raw]
    if len(given) != len(prompts):
        raise ProtocolError(f"spec_capture has {len(given)} payloads for {len(prompts)} prompts; send one per prompt, "
                            f"in the order of input_ids")
    out = [check_payload(p, n, str(i) if isinstance(raw, list) else "") for i, (p, n) in enumerate(zip(given, prompts))]
    seen = [(p["store_id"], p["sample_id"], p["gen"]) for p in out]
    if len(set(seen)) != len(seen):
        raise ProtocolError("spec_capture names the same store_id/sample_id/gen twice in one request; their objects "
                            "would overwrite each other")
    return out


def prompt_lengths(body) -> List[int]:
    """Each prompt's token count from a body's ``input_ids`` (one list, or a list per prompt)."""
    ids = body.get("input_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("spec_capture needs input_ids: a list of token ids, or a list of them per prompt")
    rows = ids if isinstance(ids[0], list) else [ids]
    if not all(isinstance(r, list) and r and all(isinstance(t, int) and not isinstance(t, bool) for t in r)
               for r in rows):
        raise ProtocolError("spec_capture needs input_ids: a list of token ids, or a list of them per prompt")
    return [len(r) for r in rows]


def object_key(payload: dict, name: str) -> str:
    """Where SpecForge's ``MooncakeFeatureStore`` reads tensor ``name`` of the payload's sample."""
    return f"{payload['store_id']}/{payload['sample_id']}/g{payload['gen']}/{name}"


def refusal(payload: dict, ids: Optional[Sequence[int]], layer_ids: Sequence[int], final: bool,
            whole: bool, sink: str) -> Optional[str]:
    """Why this writer cannot capture ``payload`` (None: it can)."""
    if ids is None:
        return (f"this server was started without {ENV_IDS} (SpecForge's --spec-capture-aux-layer-ids); restart it "
                f"with the ids of the run")
    if sink != "mooncake":
        return "this server's sink is not mooncake; restart it with EAGLE3_DUMP_SINK=mooncake (serve.py --sink mooncake)"
    if not whole:
        return ("this server stores fp8 or leaves states out (EAGLE3_DUMP_DTYPE/EAGLE3_DUMP_REBUILDABLE) and "
                "SpecForge reads whole states; restart it without them")
    if "last_hidden" in payload["features"] and not final:
        return "the trainer asks for the post-norm final state and this server dumps none; restart it with EAGLE3_DUMP_FINAL=1"
    missing = [k for k in ids if k not in set(layer_ids)]
    if missing and "aux" in payload["features"]:
        return f"the dump captures no layer {missing} of {ENV_IDS}"
    return None


def tensors(payload: dict, rows: dict, ids: Sequence[int]) -> Dict[str, "object"]:
    """name -> the tensor SpecForge reads, from one request's dump rows (``layer.<k>``, ``final``)."""
    import torch

    out = {}
    names = payload["features"]
    if "aux" in names:
        out[names["aux"]] = torch.cat([rows[f"layer.{k}"] for k in ids], dim=-1).unsqueeze(0).contiguous()
    if "last_hidden" in names:
        out[names["last_hidden"]] = rows["final"].unsqueeze(0).contiguous()
    for item in payload["passthrough"]:
        out[item["name"]] = torch.tensor(item["data"], dtype=torch.int64).reshape(item["shape"])
    return out


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def result(payload: dict, ids: Sequence[int], written: dict) -> dict:
    """``meta_info["spec_capture"]`` of a captured prompt: every object written, with shape and dtype."""
    return {"sample_id": payload["sample_id"], "store_id": payload["store_id"], "gen": payload["gen"],
            "aux_layer_ids": list(ids),
            "features": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in written.items()}}


def error(payload: dict, why: str) -> dict:
    """``meta_info["spec_capture"]`` of a prompt not captured: SpecForge retries it."""
    return {"sample_id": payload["sample_id"], "store_id": payload["store_id"], "gen": payload["gen"],
            "error": why}
