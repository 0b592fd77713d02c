"""Dataset writers: one file per sample, written to a temporary name and renamed.

- ``specforge``: ``rows_<a>-<b>/data_<i>.ckpt``, a ``torch.save`` dict of plain tensors (loads with
  ``torch.load(weights_only=True)``) as SpecForge's offline EAGLE-3 dataset reads it:
  ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``hidden_state`` [1, T, H] (the final,
  post-norm state), ``aux_hidden_state`` [1, T, L*H] (the aux layers concatenated in ascending
  layer order, the order SGLang concatenates them when serving).
- ``speculators``: ``rows_<a>-<b>/data_<i>.safetensors`` with ``token_ids`` int64 [T],
  ``hidden_states`` [T, L+1, H] (the aux layers in ascending order, then the final post-norm
  state) and ``loss_mask`` int64 [T]; the header metadata names each slot of the L axis.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

ROWS_PER_DIR = 5000
FORMATS = ("specforge", "speculators")


def rel_path(fmt: str, index: int) -> str:
    a = index // ROWS_PER_DIR * ROWS_PER_DIR
    ext = "ckpt" if fmt == "specforge" else "safetensors"
    return f"rows_{a}-{a + ROWS_PER_DIR}/data_{index}.{ext}"


def _tmp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_sample(fmt: str, out_dir: Path, index: int, sample_id: str, dump, loss_mask) -> tuple[str, int]:
    """Write one sample; returns (path relative to out_dir, bytes on disk)."""
    import torch

    rel = rel_path(fmt, index)
    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    ids = dump.input_ids.to(torch.int64).clone()
    mask = torch.tensor(loss_mask, dtype=torch.int64)
    aux = [dump.layers[f"layer.{k}"] for k in dump.layer_ids]
    try:
        if fmt == "specforge":
            data = {
                "input_ids": ids,
                "loss_mask": mask,
                "hidden_state": dump.final.contiguous().unsqueeze(0),
                "aux_hidden_state": torch.cat(aux, dim=-1).contiguous().unsqueeze(0),
            }
            with open(tmp, "wb") as fh:  # closed here even when the disk is full (no fd kept by the error)
                torch.save(data, fh)
        elif fmt == "speculators":
            from safetensors.torch import save_file

            slots = [f"eagle3:{k}" for k in dump.layer_ids] + ["final:post_norm"]
            stacked = torch.stack(aux + [dump.final], dim=1).contiguous()
            meta = {
                "sample_id": sample_id,
                "hidden_states_layers": json.dumps(slots),
                "eagle3_layer_ids": json.dumps(dump.layer_ids),
                "hf_hidden_state_indices": json.dumps(dump.hf_indices),
                "final": "post_norm",
            }
            save_file({"token_ids": ids, "hidden_states": stacked, "loss_mask": mask}, str(tmp), metadata=meta)
        else:
            raise ValueError(f"unknown format {fmt!r}")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return rel, path.stat().st_size


def read_sample(fmt: str, path: Path) -> dict:
    """Read a sample back as {input_ids, loss_mask, aux [T, L*H], final [T, H]} (for checks)."""
    import torch

    if fmt == "specforge":
        d = torch.load(str(path), weights_only=True)
        return {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"],
                "aux": d["aux_hidden_state"].squeeze(0), "final": d["hidden_state"].squeeze(0)}
    from safetensors.torch import load_file

    d = load_file(str(path))
    hs = d["hidden_states"]
    return {"input_ids": d["token_ids"], "loss_mask": d["loss_mask"],
            "aux": hs[:, :-1, :].reshape(hs.shape[0], -1), "final": hs[:, -1, :]}
