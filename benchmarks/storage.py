#!/usr/bin/env python3
"""What the compact dump (issue 30) costs and keeps, measured on real dump files.

Give it a directory of full dump files (``EAGLE3_DUMP_DTYPE=bf16``, ``EAGLE3_DUMP_REBUILDABLE=store``,
every state stored) and the model directory they came from; for every stored state it reports
the row error (``|x'_t - x_t| / |x_t|``, L2 per token row, the GPU check's criterion) of

- fp8 with one scale per (token, state): the dump's layout;
- fp8 with one scale per token shared by the token's layer states (hs-connectors' ``fp8`` layout,
  ``[T, 1, 1]`` over ``hidden_states [T, L+1, H]``);

and the rebuilds against the stored copies: the embedding rows from ``embed_tokens`` (bit for bit),
the post-norm final from the stored pre-norm last layer (and from its fp8 copy). Then bytes per
token: measured from the files as stored and as the compact dump stores them, and the same
arithmetic for DeepSeek-V3 / Kimi-K2.5 (hidden 7168).

  python3 benchmarks/storage.py --dump-dir DIR --model MODEL_DIR [--json OUT.json]

Needs torch and safetensors (the GPU machine has both; here: the CPU test environment).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

HIDDEN_7168 = 7168
ID_BYTES = 8  # int64 input_ids
SCALE_BYTES = 4  # one float32 scale per (token, state)


def per_token_bytes(states: int, hidden: int, fp8: bool) -> int:
    """Bytes per token of ``states`` stored states (+ the id): bf16 2 B a value, fp8 1 B + a scale."""
    return ID_BYTES + states * (hidden + SCALE_BYTES if fp8 else 2 * hidden)


def arithmetic() -> list:
    """Bytes per token at hidden 7168 for the layouts users configure (DeepSeek-V3, Kimi-K2.5)."""
    rows = []
    for what, stored_bf16, stored_compact in (
            ("3 aux (not the embedding) + the final state", 4, 4),
            ("3 aux (not the embedding) + final + N-1 pre-norm (SpecForge and speculators)", 5, 4),
            ("3 aux incl. the embedding (-1) + final + N-1 pre-norm", 5, 3),
            ("3 aux incl. the embedding (-1) + the final state", 4, 3)):
        bf16 = per_token_bytes(stored_bf16, HIDDEN_7168, False)
        compact = per_token_bytes(stored_compact, HIDDEN_7168, True)
        rows.append({"layout": what, "bf16_store_bytes": bf16, "compact_bytes": compact,
                     "compact_states_stored": stored_compact, "ratio": round(compact / bf16, 4),
                     "GB_per_Mtok_bf16": round(bf16 / 1e3, 1), "GB_per_Mtok_compact": round(compact / 1e3, 1)})
    return rows


def _row_error(x, y) -> list:
    x, y = x.float(), y.float()
    return ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-20)).tolist()


def _summary(errs: list) -> dict:
    errs = sorted(errs)
    if not errs:
        return {}
    return {"rows": len(errs), "median": statistics.median(errs), "p99": errs[min(len(errs) - 1, int(0.99 * len(errs)))],
            "max": errs[-1]}


def measure(dump_dir: Path, model: Path) -> dict:
    import torch
    from safetensors import safe_open

    from eaglepatch.storage import Rebuilder, dequantize, quantize_rows, rebuild_error

    rebuilder = Rebuilder(model)
    per_state, shared, files, tokens, file_bytes, compact_bytes = {}, {}, 0, 0, 0, 0
    rebuilds = {"embedding": [], "final_from_bf16": [], "final_from_fp8": []}
    for path in sorted(Path(dump_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "eagle3-dump/1":
                continue
            t = {k: f.get_tensor(k) for k in f.keys()}
        files += 1
        ids = t["input_ids"]
        tokens += ids.numel()
        file_bytes += path.stat().st_size
        layers = [k for k in t if k.startswith("layer.")]
        dtype = t[layers[0]].dtype  # the model dtype the dump stored
        n_layers = int(meta["num_hidden_layers"])
        last = f"layer.{n_layers - 1}"
        for name in layers + (["final"] if "final" in t else []):
            per_state.setdefault(name, []).extend(_row_error(t[name], dequantize(*quantize_rows(t[name]), dtype)))
        stacked = torch.stack([t[n].float() for n in layers], 1)  # [T, L, H], hs-connectors' one scale per token
        scale = (stacked.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
        q = (stacked / scale).to(torch.float8_e4m3fn)
        back = q.to(dtype) * scale.to(dtype)
        for i, name in enumerate(layers):
            shared.setdefault(name, []).extend(_row_error(t[name], back[:, i]))
        stored = [n for n in layers if n != "layer.-1"]  # the embedding of text rows is rebuilt
        if "final" in t and last not in t:
            stored.append("final")
        compact_bytes += ids.numel() * per_token_bytes(len(stored), t[stored[0]].shape[-1], True)
        if "layer.-1" in t:
            rebuilds["embedding"].append(rebuild_error(t["layer.-1"], rebuilder.embedding(ids)))
        if "final" in t and last in t:
            eps = float(json.loads(Path(model, "config.json").read_text()).get("rms_norm_eps"))
            rebuilds["final_from_bf16"].append(rebuild_error(t["final"], rebuilder.final(t[last], eps)))
            rebuilds["final_from_fp8"].append(rebuild_error(
                t["final"], rebuilder.final(dequantize(*quantize_rows(t[last]), dtype), eps)))
    if not files:
        raise SystemExit(f"error: no eagle3-dump/1 file in {dump_dir}; dump with EAGLE3_DUMP_DTYPE=bf16 and "
                         f"EAGLE3_DUMP_REBUILDABLE=store (the defaults)")

    def worst(rs):
        return {"files": len(rs), "bit_exact": all(r["bit_exact"] for r in rs),
                "max_rel_row": max((r["max_rel_row"] for r in rs), default=None),
                "max_abs": max((r["max_abs"] for r in rs), default=None)} if rs else None

    return {"dump_dir": str(dump_dir), "model": str(model), "files": files, "tokens": tokens,
            "bytes_per_token": {"as_stored": file_bytes / tokens, "compact": compact_bytes / tokens},
            "fp8_row_error": {n: {"per_token_per_state": _summary(per_state[n]),
                                  "shared_per_token": _summary(shared.get(n, []))} for n in per_state},
            "rebuild_vs_stored": {k: worst(v) for k, v in rebuilds.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-dir", type=Path, help="full (bf16, every state stored) dump files")
    ap.add_argument("--model", type=Path, help="the model directory they were dumped from (its weights)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    out = {"arithmetic_hidden_7168": arithmetic()}
    if a.dump_dir is not None:
        if a.model is None:
            ap.error("--dump-dir needs --model (the rebuilds read its weights)")
        out["measured"] = measure(a.dump_dir, a.model)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
