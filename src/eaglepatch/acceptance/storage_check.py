"""What the compact dump (issue 30: ``dump_dtype=fp8``, ``rebuildable=omit``) costs and saves, as
the acceptance run measures it: the bytes of the data phase's dump files and datasets, the row
error of the states a reader yields from them against the same conversations' states stored
as computed, and the comparison of two runs' accept lengths (``compare``; ``benchmarks/fp8_accept.py``).

- ``census(dump_dir, datasets)``: each dataset's dump files (the extraction's requests, found by
  their ``input_ids``: one file per sample), with their bytes per tensor: ``input_ids``, each
  ``layer.<k>``, ``final``, the fp8 scales (``scale.*``) and the stored rows of a state left out in
  part (``rows.*``). ``state_bytes`` is everything but ``input_ids`` and the header: on a toy model
  the int64 ids and the safetensors header weigh as much as the states, so a file-bytes ratio says
  little about the states'. ``state_values``: elements of the stored states (what a bf16 store of
  them costs is 2 bytes each). Headers are read without torch.
- ``row_errors(dir, reference_dir, model_dir)``: per state, |x_t - ref_t| / |ref_t| over the rows
  of the dumps both directories hold for the same ids (``kept-dumps``: the held-out
  conversations' files the data phase keeps), each read through ``eaglepatch.extract.dumps``
  (dequantised, rebuilt from the model directory where left out).
- ``dataset_bytes(dir)``: a dataset directory's bytes (every file, and the sample files alone).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

KEPT = "kept-dumps"  # under a data directory: the held-out conversations' dump files, named by their ids
ACCEPT_GOAL = 0.03  # issue 30: |mean accept length fp8 - bf16| on the GPU
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U8": 1, "BOOL": 1}


def header(path: Path) -> tuple[int, dict, dict]:
    """(bytes before the data, metadata, tensor table name -> {dtype, shape, data_offsets}) of a
    safetensors file, read without torch."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        table = json.loads(f.read(n))
    meta = table.pop("__metadata__", None) or {}
    return 8 + n, meta, table


def _ids(path: Path, start: int, entry: dict) -> tuple:
    a, b = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + a)
        raw = f.read(b - a)
    if entry["dtype"] != "I64":
        raise ValueError(f"{path.name}: input_ids is {entry['dtype']}")
    return struct.unpack("<%dq" % (len(raw) // 8), raw)


def ids_key(ids) -> str:
    """The file name a kept dump gets: sha256 of its ids written "1,2,3" (the dump's prompt_key)."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def _category(name: str) -> str:
    for prefix in ("scale.", "rows."):
        if name.startswith(prefix):
            return prefix + "*"
    return name


def _sample_ids(ds: Path) -> list:
    import torch

    out = []
    for p in sorted(Path(ds).rglob("*.ckpt")):
        out.append(tuple(int(t) for t in torch.load(p, map_location="cpu", weights_only=True, mmap=True)["input_ids"]))
    return out


def census(dump_dir: Path, datasets: dict) -> tuple[dict, dict]:
    """(figures, files): per dataset name, the dump files of its samples and their bytes; ``files``:
    dataset name -> {ids key: path}. Also ``all_files`` (every dump file in the directory: the
    greedy generation's requests too, when the run made them)."""
    by_ids: dict = {}
    info = {}
    total_files = total_bytes = 0
    for p in sorted(Path(dump_dir).glob("*.safetensors")):
        try:
            start, meta, table = header(p)
            ids = _ids(p, start, table["input_ids"])
        except (OSError, ValueError, KeyError, struct.error):
            continue
        size = p.stat().st_size
        total_files += 1
        total_bytes += size
        by_ids.setdefault(ids, p)
        info[p] = (size, start, meta, table)
    out = {"all_files": {"files": total_files, "file_bytes": total_bytes}}
    files = {}
    for name, ds in datasets.items():
        samples = _sample_ids(ds)
        rec = {"samples": len(samples), "files": 0, "unmatched_samples": 0, "tokens": 0, "file_bytes": 0,
               "header_bytes": 0, "state_bytes": 0, "state_values": 0, "tensor_bytes": {}, "storage_dtype": [],
               "formats": [], "left_out": []}
        files[name] = {}
        for ids in samples:
            p = by_ids.get(ids)
            if p is None:
                rec["unmatched_samples"] += 1
                continue
            size, start, meta, table = info[p]
            files[name][ids_key(ids)] = p
            rec["files"] += 1
            rec["tokens"] += len(ids)
            rec["file_bytes"] += size
            rec["header_bytes"] += start
            for t, e in table.items():
                a, b = e["data_offsets"]
                cat = _category(t)
                rec["tensor_bytes"][cat] = rec["tensor_bytes"].get(cat, 0) + (b - a)
                if t != "input_ids":
                    rec["state_bytes"] += b - a
                if t == "final" or t.startswith("layer."):
                    n = 1
                    for d in e["shape"]:
                        n *= d
                    rec["state_values"] += n
            for key, value in (("storage_dtype", meta.get("storage_dtype") or meta.get("dtype")),
                               ("formats", meta.get("format")), ("left_out", meta.get("left_out", "{}"))):
                if value not in rec[key]:
                    rec[key].append(value)
        out[name] = rec
    return out, files


def keep(files: dict, dest: Path) -> int:
    """Move ``files`` (ids key -> path) to ``dest/<key>.safetensors``; how many."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for key, p in files.items():
        shutil.move(str(p), str(dest / f"{key}.safetensors"))
    return len(files)


def dataset_bytes(ds: Path) -> dict:
    total = samples = n = 0
    for p in Path(ds).rglob("*"):
        if p.is_file():
            s = p.stat().st_size
            total += s
            if p.suffix == ".ckpt":
                samples += s
                n += 1
    return {"bytes": total, "sample_bytes": samples, "samples": n}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def target_sha256(target: Path) -> str:
    """sha256 over the target's safetensors files (name and content): two runs that compare their
    data must have served the same weights."""
    h = hashlib.sha256()
    for p in sorted(Path(target).glob("*.safetensors")):
        h.update(p.name.encode() + b"\0" + file_sha256(p).encode())
    return h.hexdigest()


# ---- row error ------------------------------------------------------------------------------------

def read_states(path: Path, rebuilder) -> dict:
    """name -> float32 tensor [T, H] of every state a dump file yields through the project's reader
    (``eaglepatch.extract.dumps.load_dump``: fp8 dequantised, left-out states rebuilt with
    ``rebuilder``, an ``eaglepatch.storage.Rebuilder`` of the served model's directory)."""
    from ..extract import dumps

    start, meta, table = header(Path(path))
    ids = _ids(Path(path), start, table["input_ids"])
    d = dumps.load_dump(Path(path), list(ids), key=meta.get("key"), rid=meta.get("rid"), rebuilder=rebuilder)
    out = {name: t.float() for name, t in d.layers.items()}
    if d.final is not None:
        out["final"] = d.final.float()
    return out


def row_errors(kept: Path, reference: Path, model_dir: Path) -> dict:
    """Per state, the row error of ``kept``'s dumps against ``reference``'s dumps of the same ids
    (both read through the project's reader): rows, max, mean, p99, and the files compared."""
    import torch

    from ..storage import Rebuilder

    rebuilder = Rebuilder(Path(model_dir))
    errs: dict = {}
    compared = 0
    missing = 0
    for p in sorted(Path(kept).glob("*.safetensors")):
        ref = Path(reference) / p.name
        if not ref.is_file():
            missing += 1
            continue
        a, b = read_states(p, rebuilder), read_states(ref, rebuilder)
        compared += 1
        for name, rb in b.items():
            ra = a.get(name)
            if ra is None:
                continue
            e = (ra - rb).norm(dim=-1) / rb.norm(dim=-1).clamp(min=1e-30)
            errs.setdefault(name, []).append(e)
    out = {"files": compared, "files_without_reference": missing, "states": {}}
    for name in sorted(errs, key=lambda n: (n == "final", int(n.split(".")[1]) if n.startswith("layer.") else 0)):
        e = torch.cat(errs[name])
        out["states"][name] = {"rows": int(e.numel()), "max": round(float(e.max()), 6), "mean": round(float(e.mean()), 6),
                               "p99": round(float(e.quantile(0.99)) if e.numel() > 1 else float(e.max()), 6)}
    return out


# ---- two runs compared ----------------------------------------------------------------------------

def _figures(res: dict) -> tuple[str, dict]:
    """(how, {seed: accept length}) of a run's correct drafts."""
    how = "served" if "served" in res else "replayed"
    figs = res.get(how) or {}
    out = {}
    for name, d in (res.get("drafts") or {}).items():
        if name.split("@")[0] != "correct":
            continue
        fig = figs.get(name) or {}
        a = fig.get("accept_length")
        if a is not None:
            out[int(d.get("seed", res.get("settings", {}).get("draft_seed") or 0))] = {
                "accept_length": a, "predicted": (d.get("heldout") or {}).get("predicted_accept_length"),
                "step_accuracies": (d.get("heldout") or {}).get("step_accuracies"),
                "steps": (d.get("training") or {}).get("steps"),
                "verifies": "%s verifies for %s tokens" % (fig.get("verify_ct"), fig.get("tokens_after_prefill"))}
    return how, out


def compare(ref: dict, var: dict, goal: float = ACCEPT_GOAL) -> dict:
    """Two acceptance results, the reference (``dump_dtype=bf16``) and the variant (e.g. fp8 +
    omit) of the same target and prompts: per draft seed both accept lengths (served on the GPU,
    replayed on CPU) and their difference, the means, the mean difference against ``goal``, the
    dump's bytes and the row errors the variant's run measured. Refuses (ValueError) runs that did
    not serve the same target or build the same conversations."""
    how_r, fr = _figures(ref)
    how_v, fv = _figures(var)
    if how_r != how_v:
        raise ValueError(f"the reference's figures are {how_r}, the variant's {how_v}")
    sr, sv = ref.get("storage") or {}, var.get("storage") or {}
    ta, tb = (ref.get("target") or {}).get("sha256"), (var.get("target") or {}).get("sha256")
    same_target = ta is not None and ta == tb
    same_conv = sr.get("greedy_sha256") is not None and sr.get("greedy_sha256") == sv.get("greedy_sha256")
    if not same_target or not same_conv:
        raise ValueError("the two runs did not %s" % " and ".join(
            w for w, ok in (("serve the same target (target.sha256)", same_target),
                            ("build the same conversations (storage.greedy_sha256)", same_conv)) if not ok))
    seeds = sorted(set(fr) & set(fv))
    per = {s: {"reference": round(fr[s]["accept_length"], 4), "variant": round(fv[s]["accept_length"], 4),
               "difference": round(fv[s]["accept_length"] - fr[s]["accept_length"], 4),
               "predicted": {"reference": fr[s]["predicted"], "variant": fv[s]["predicted"]},
               "step_accuracies": {"reference": fr[s]["step_accuracies"], "variant": fv[s]["step_accuracies"]},
               "steps": {"reference": fr[s]["steps"], "variant": fv[s]["steps"]},
               "verifies": {"reference": fr[s]["verifies"], "variant": fv[s]["verifies"]}} for s in seeds}
    out = {"how": how_r, "storage": {"reference": {k: sr.get(k) for k in ("dump_dtype", "rebuildable")},
                                     "variant": {k: sv.get(k) for k in ("dump_dtype", "rebuildable")}},
           "seeds": seeds, "per_seed": per}
    if seeds:
        mr = sum(fr[s]["accept_length"] for s in seeds) / len(seeds)
        mv = sum(fv[s]["accept_length"] for s in seeds) / len(seeds)
        diffs = [fv[s]["accept_length"] - fr[s]["accept_length"] for s in seeds]
        out.update(mean_reference=round(mr, 4), mean_variant=round(mv, 4), mean_difference=round(mv - mr, 4),
                   goal=goal, within_goal=abs(mv - mr) <= goal,
                   seed_spread={"reference": round(max(fr[s]["accept_length"] for s in seeds)
                                                   - min(fr[s]["accept_length"] for s in seeds), 4),
                                "variant": round(max(fv[s]["accept_length"] for s in seeds)
                                                 - min(fv[s]["accept_length"] for s in seeds), 4),
                                "difference": round(max(diffs) - min(diffs), 4)},
                   predicted_mean_difference=round(sum((fv[s]["predicted"] or 0) - (fr[s]["predicted"] or 0)
                                                       for s in seeds) / len(seeds), 4))
    dr, dv = (sr.get("dump") or {}).get("train@correct"), (sv.get("dump") or {}).get("train@correct")
    if dr and dv and dr.get("state_bytes"):
        out["bytes"] = {"reference": {k: dr[k] for k in ("files", "tokens", "file_bytes", "state_bytes", "state_values")},
                        "variant": {k: dv[k] for k in ("files", "tokens", "file_bytes", "state_bytes", "state_values")},
                        "state_bytes_ratio": round(dv["state_bytes"] / dr["state_bytes"], 4),
                        "state_bytes_vs_bf16_store": round(dv["state_bytes"] / (2 * dr["state_values"]), 4),
                        "file_bytes_ratio": round(dv["file_bytes"] / dr["file_bytes"], 4),
                        "reference_storage_dtype": dr.get("storage_dtype"),
                        "dataset_bytes": {"reference": (sr.get("datasets") or {}).get("train@correct"),
                                          "variant": (sv.get("datasets") or {}).get("train@correct")}}
    out["row_error"] = sv.get("row_error_vs_reference")
    return out


def summary_lines(c: dict) -> list:
    """``compare``'s result in a few lines of text."""
    r, v = c["storage"]["reference"], c["storage"]["variant"]
    lines = ["%s accept length, correct draft, per seed (reference %s/%s, variant %s/%s):"
             % (c["how"], r.get("dump_dtype"), r.get("rebuildable"), v.get("dump_dtype"), v.get("rebuildable"))]
    for s in c["seeds"]:
        p = c["per_seed"][s]
        lines.append("  seed %d: %.4f vs %.4f (difference %+.4f; %s vs %s; held-out predicted %s vs %s)"
                     % (s, p["reference"], p["variant"], p["difference"], p["verifies"]["reference"],
                        p["verifies"]["variant"], p["predicted"]["reference"], p["predicted"]["variant"]))
    if c["seeds"]:
        lines.append("  mean: %.4f vs %.4f, difference %+.4f (goal |d| <= %s: %s); predicted: mean difference %+.4f"
                     % (c["mean_reference"], c["mean_variant"], c["mean_difference"], c["goal"],
                        "met" if c["within_goal"] else "NOT met", c["predicted_mean_difference"]))
    b = c.get("bytes")
    if b:
        lines.append("dump state bytes (train set, %d files, %d tokens): %d vs %d = %.4f (%.4f of a bf16 store); "
                     "file bytes %d vs %d = %.4f"
                     % (b["variant"]["files"], b["variant"]["tokens"], b["reference"]["state_bytes"],
                        b["variant"]["state_bytes"], b["state_bytes_ratio"], b["state_bytes_vs_bf16_store"],
                        b["reference"]["file_bytes"], b["variant"]["file_bytes"], b["file_bytes_ratio"]))
    re_ = c.get("row_error") or {}
    for name, e in (re_.get("states") or {}).items():
        lines.append("row error %s: max %.4g, mean %.4g, p99 %.4g (%d rows, %d files)"
                     % (name, e["max"], e["mean"], e["p99"], e["rows"], re_.get("files", 0)))
    return lines

