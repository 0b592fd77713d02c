"""Dataset writers: one file per sample, named by its conversation id, plus each format's index.

Every sample is written to a temporary name and renamed to ``OUT/samples/<hh>/<id>-<hash>.<ext>``
(``hh``: the first two hex digits of sha256(id), ``<id>`` the id with unsafe characters replaced,
``<hash>`` 12 hex digits of sha256(id)), so an edited input never makes one sample overwrite
another's file.

- ``specforge`` (SpecForge 0.2.0's offline reader walks OUT for ``*.ckpt``): a ``torch.save`` dict of
  plain tensors: ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``hidden_state`` [1, T, H] (the
  final, post-norm state: SpecForge's TargetHead applies the LM head to it directly),
  ``aux_hidden_state`` [1, T, L*H] (the aux layers concatenated in ascending layer order, the
  order SGLang concatenates them when serving).
- ``speculators`` (speculators 0.9.0's ArrowDataset + FileTransfer): each sample a safetensors
  file with ``token_ids`` int64 [T], ``hidden_states`` [T, L+1, H] (the aux layers in ascending
  order, then the output of the last decoder layer BEFORE the final norm: speculators builds
  its targets as ``verifier_lm_head(verifier_norm(hidden_states[:, -1]))``) and ``loss_mask``
  int64 [T]. ``publish_speculators`` then makes OUT what speculators opens: a ``datasets``
  ``save_to_disk`` table (``input_ids``, ``loss_mask``, ``seq_len``, torch format) with one row per
  sample, ``OUT/hidden_states/hs_<row>.safetensors`` (hard links to the sample files) and
  ``OUT/token_freq.pt`` (loss-masked token counts, speculators' vocab-mapping input).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .. import conventions
from ..errors import UsageError

FORMATS = ("specforge", "speculators")
SAMPLES_DIR = "samples"
SAMPLE_EXT = {"specforge": "ckpt", "speculators": "safetensors"}  # sample file suffix per format
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
_STAGING = ".publish"


class LayoutError(UsageError):
    """The dump cannot give what the format needs; ``fix`` says what to change (exit 2)."""


@dataclass(frozen=True)
class Layout:
    """Which dumped tensors a sample holds. Layer ids are EAGLE-3 ids (-1 = embedding output,
    k = output of decoder layer k); ``last`` is N-1 for speculators (its last slot), else None."""

    format: str
    aux: tuple  # ascending
    last: int | None
    num_layers: int

    @property
    def aux_hf(self) -> list:
        return [k + 1 for k in self.aux]

    def slots(self) -> list:
        names = [f"eagle3:{k}" for k in self.aux]
        return names + ([f"eagle3:{self.last}:pre_norm"] if self.format == "speculators" else [])

    def to_json(self) -> dict:
        return {"format": self.format, "aux": list(self.aux), "last": self.last, "num_layers": self.num_layers}

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        return cls(d["format"], tuple(d["aux"]), d["last"], d["num_layers"])


def layers_arg(rule: str, out_ids) -> str:
    """The ``tools/serve.py --layers`` (= ``EAGLE3_DUMP_LAYERS``) value that a server reading ids by
    ``rule`` reads as the output-of-layer ids ``out_ids``: those ids where it reads them so, else the
    list ``conventions.ids_for`` writes (capture indices on 0.5.14+)."""
    out_ids = sorted(set(out_ids))
    if conventions.layer_output_ids(rule, out_ids) == out_ids:
        ids = out_ids
    else:
        ids = conventions.ids_for(rule, [k + 1 for k in out_ids]) or out_ids
    return ",".join(map(str, ids))


def restart_with(rule: str, out_ids) -> str:
    """How to restart the server dumping the output-of-layer ids ``out_ids``, in the flag the user
    typed (``tools/serve.py --layers=``) and the variable it sets."""
    arg = layers_arg(rule, out_ids)
    return f"python3 tools/serve.py --layers={arg} ... (EAGLE3_DUMP_LAYERS={arg} when you start sglang yourself)"


def resolve_layout(fmt: str, dump_ids: list, has_final: bool, num_layers: int, aux=None,
                   rule: str = conventions.PLUS_ONE, asked=None) -> Layout:
    """The layout for ``fmt`` from the layers the server dumps; ``aux`` (output-of-layer ids)
    defaults to every dumped layer except the last decoder layer N-1. ``asked``: the ``--aux-layers``
    ids as typed (read by ``rule``, the server's reading), named in the errors; ``rule`` also writes
    the ``tools/serve.py --layers`` a fix proposes. A fix never names a layer the model lacks."""
    last = num_layers - 1
    dumped = sorted(dump_ids)
    if asked is not None:
        typed = ",".join(map(str, asked))
        flag = f"--aux-layers={typed}" + (f" (read as this server reads ids, {conventions.RULES[rule]}: "
                                          f"output-of-layer ids {sorted(set(aux))})" if aux is not None
                                          and sorted(set(aux)) != sorted(set(asked)) else "")
    else:
        flag = "the aux layers"
    chosen = sorted(set(aux)) if aux is not None else [k for k in dumped if k != last]
    outside = [k for k in chosen if not -1 <= k <= last]
    if outside:
        raise LayoutError(f"{flag} names {outside}, which a {num_layers}-layer model does not have (-1 = embedding "
                          f"output, 0..{last} = output of layer k)",
                          f"pass --aux-layers= with layers the server dumps: {layers_arg(rule, dumped)}")
    missing = [k for k in chosen if k not in dumped]
    if missing:
        raise LayoutError(f"{flag} asks for EAGLE-3 layers {missing} but the server dumps {dumped}",
                          f"pass --aux-layers= with layers it dumps ({layers_arg(rule, dumped)}), or restart it "
                          f"dumping them too: {restart_with(rule, dumped + missing)}")
    if not chosen:
        raise LayoutError(f"no aux layer left: the server dumps only {dumped} (layer {last} is the verifier's "
                          f"last layer)", f"restart the server dumping the draft's layers too: python3 tools/serve.py "
                                          f"--layers=<the draft's ids>,{last} ... (EAGLE3_DUMP_LAYERS)")
    if fmt == "speculators" and last not in dumped:
        raise LayoutError(f"--format speculators needs the last decoder layer's output before the final norm "
                          f"(EAGLE-3 id {last}, HF index {num_layers}) but the server dumps layers {dumped}",
                          f"restart the server dumping layer {last} too: {restart_with(rule, dumped + [last])}")
    if fmt == "specforge" and not has_final:
        raise LayoutError("--format specforge needs the final (post-norm) state but the server dumps none",
                          "restart the server with python3 tools/serve.py --final 1 ... (EAGLE3_DUMP_FINAL=1 when you "
                          "start sglang yourself)")
    return Layout(fmt, tuple(chosen), last if fmt == "speculators" else None, num_layers)


def sample_rel(fmt: str, conv_id: str) -> str:
    h = hashlib.sha256(conv_id.encode()).hexdigest()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", conv_id).strip("._")[:80] or "conv"
    return f"{SAMPLES_DIR}/{h[:2]}/{safe}-{h[:12]}.{SAMPLE_EXT[fmt]}"


def _tmp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def stale_temporaries(out_dir: Path) -> list:
    """Temporary files a killed run left among the samples: ours (``_tmp_for``) and safetensors'
    own (``save_file`` writes ``.tmpXXXXXX`` beside its target, then renames it; a kill between
    the two leaves it there)."""
    d = Path(out_dir)
    return sorted(set(d.glob(f"{SAMPLES_DIR}/*/.*.tmp")) | set(d.glob(f"{SAMPLES_DIR}/*/.tmp*")))


def write_sample(layout: Layout, out_dir: Path, rel: str, sample_id: str, dump, loss_mask) -> int:
    """Write one sample at ``out_dir/rel`` (temporary name, then rename); returns its size."""
    import torch

    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    ids = dump.input_ids.to(torch.int64).clone()
    mask = torch.tensor(loss_mask, dtype=torch.int64)
    aux = [dump.layers[f"layer.{k}"] for k in layout.aux]
    try:
        if layout.format == "specforge":
            data = {
                "input_ids": ids,
                "loss_mask": mask,
                "hidden_state": dump.final.contiguous().unsqueeze(0),
                "aux_hidden_state": torch.cat(aux, dim=-1).contiguous().unsqueeze(0),
            }
            with open(tmp, "wb") as fh:  # closed here even when the disk is full (no fd kept by the error)
                torch.save(data, fh)
        else:
            from safetensors.torch import save_file

            stacked = torch.stack(aux + [dump.layers[f"layer.{layout.last}"]], dim=1).contiguous()
            meta = {"sample_id": sample_id, "hidden_states_slots": json.dumps(layout.slots()),
                    "hf_hidden_state_indices": json.dumps(layout.aux_hf + [layout.num_layers]),
                    "last_slot": "pre_norm"}
            save_file({"token_ids": ids, "hidden_states": stacked, "loss_mask": mask}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_sample(fmt: str, path: Path) -> dict:
    """A sample back as {input_ids, loss_mask, aux [T, L*H], last [T, H]} (for checks); ``last`` is the
    post-norm final state (specforge) or the pre-norm last-layer output (speculators)."""
    import torch

    if fmt == "specforge":
        d = torch.load(str(path), weights_only=True)
        return {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"],
                "aux": d["aux_hidden_state"].squeeze(0), "last": d["hidden_state"].squeeze(0)}
    from safetensors.torch import load_file

    d = load_file(str(path))
    hs = d["hidden_states"]
    return {"input_ids": d["token_ids"], "loss_mask": d["loss_mask"],
            "aux": hs[:, :-1, :].reshape(hs.shape[0], -1), "last": hs[:, -1, :]}


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        os.symlink(os.path.relpath(src, dst.parent), dst)


def publish_speculators(out_dir: Path, rels: list) -> None:
    """Make ``out_dir`` the dataset speculators opens, with row i = ``rels[i]``. Built in a staging
    directory, then moved in: ``hidden_states/`` by two renames, the table's files with
    ``state.json`` last, shards the new table does not list removed. No rows: the table of an
    earlier run is removed (``state.json`` first), so it cannot outlive its samples."""
    out_dir = Path(out_dir)
    if not rels:
        for name in ("state.json", "dataset_info.json", TOKEN_FREQ_FILE):
            (out_dir / name).unlink(missing_ok=True)
        for f in out_dir.glob("data-*.arrow"):
            f.unlink()
        shutil.rmtree(out_dir / HIDDEN_STATES_DIR, ignore_errors=True)
        return
    import datasets
    import torch
    from safetensors import safe_open

    staging = out_dir / _STAGING
    shutil.rmtree(staging, ignore_errors=True)
    (staging / HIDDEN_STATES_DIR).mkdir(parents=True)
    ids_col, mask_col, lens, freq = [], [], [], Counter()
    for i, rel in enumerate(rels):
        src = out_dir / rel
        with safe_open(str(src), framework="pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        ids_col.append(ids.numpy())
        mask_col.append(mask.numpy())
        lens.append(int(ids.shape[0]))
        freq.update(ids[mask.bool()].tolist())
        _link(src, staging / HIDDEN_STATES_DIR / f"hs_{i}.safetensors")
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict({"input_ids": ids_col, "loss_mask": mask_col, "seq_len": lens})
    table.with_format("torch").save_to_disk(str(staging / "table"))
    torch.save(dict(freq), staging / TOKEN_FREQ_FILE)

    old = out_dir / ".hidden_states.old"
    shutil.rmtree(old, ignore_errors=True)
    if (out_dir / HIDDEN_STATES_DIR).exists():
        os.rename(out_dir / HIDDEN_STATES_DIR, old)
    os.rename(staging / HIDDEN_STATES_DIR, out_dir / HIDDEN_STATES_DIR)
    shutil.rmtree(old, ignore_errors=True)
    os.replace(staging / TOKEN_FREQ_FILE, out_dir / TOKEN_FREQ_FILE)
    state = json.loads((staging / "table" / "state.json").read_text())
    keep = {d["filename"] for d in state.get("_data_files", [])}
    for f in sorted((staging / "table").iterdir(), key=lambda p: p.name == "state.json"):
        os.replace(f, out_dir / f.name)
    for f in out_dir.glob("data-*.arrow"):
        if f.name not in keep:
            f.unlink()
    shutil.rmtree(staging, ignore_errors=True)
