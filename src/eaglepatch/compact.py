"""Training straight from a compact dataset (``tools/extract.py --format compact``).

A compact sample holds what the dump stored (fp8 states with a scale per token and state, no state
the target's weights rebuild; ``extract.writers`` module doc), so the dataset costs what the dumps
cost. ``CompactDataset`` reads it with the model directory (an ``eaglepatch.storage.Rebuilder``:
the embedding and the final norm's weight) and yields, tensor for tensor (same keys, shapes,
dtypes and bits), what the trainers' own readers yield for the same sample extracted in their
format, so it stands in for them:

- ``yields="specforge"``: SpecForge 0.2.0's ``OfflineEagle3Dataset`` (``build_offline_eagle3_dataset``)
  on ``--format specforge``: items in its order (the sample paths sorted), each
  ``process_data``'s dict: ``input_ids``, ``loss_mask`` (its last position zeroed),
  ``attention_mask`` [1, T], ``hidden_state`` (the aux layers concatenated) [1, T, L*H] and
  ``target`` (the post-norm final state) [1, T, H], cut to ``max_len``;
- ``yields="speculators"``: speculators 0.9.0's ``ArrowDataset`` on ``--format speculators``, read
  through hs-connectors' ``FP8Transfer`` (``--hidden-states-backend fp8``; states dequantised to
  ``dequantize_dtype``, bfloat16 as there) or, from a bf16 dump, ``FileTransfer``: items in the
  table's row order (the manifest's ``files``), each ``hidden_states`` [T, L*H],
  ``verifier_last_hidden_states`` [T, H] (layer N-1, pre-norm), ``input_ids``, ``loss_mask``,
  ``lengths`` [1] and ``position_ids`` [T].

tests/test_compact.py compares both, sample by sample, with the readers' own code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import UsageError
from .extract.writers import Layout, load_compact, specforge_sample, speculators_states
from .storage import Rebuilder, dequantize

YIELDS = ("specforge", "speculators")
MANIFEST = "manifest.json"


class CompactDataset(torch.utils.data.Dataset):
    """A compact dataset directory ``datapath`` (its ``manifest.json`` lists the samples) read with the
    model directory ``model_dir`` (or a ``storage.Rebuilder``), yielding as SpecForge's or speculators'
    reader does (module doc). ``aux``: the aux layers (EAGLE-3 ids, any the dumps hold; default the
    dataset's, ``--aux-layers``); ``max_len``: SpecForge's cut (speculators' reader does not cut);
    ``dequantize_dtype``: FP8Transfer's (bfloat16). Problems raise ``UsageError`` (one line, a fix)."""

    def __init__(self, datapath, model_dir, yields: str = "specforge", aux=None, max_len: int = 2048,
                 dequantize_dtype=torch.bfloat16):
        if yields not in YIELDS:
            raise UsageError(f"CompactDataset(yields={yields!r}) is not known", f"use one of {', '.join(YIELDS)}")
        self.root = Path(datapath)
        man = _manifest(self.root)
        n = man["model"]["num_hidden_layers"]
        dumped = man.get("dump_layer_ids") or []
        aux = sorted(set(aux)) if aux is not None else list(man["eagle3_layer_ids"])
        missing = [k for k in aux if k not in dumped]
        if missing:
            raise UsageError(f"aux layers {missing} are not in the compact dataset {self.root} (its dumps hold "
                             f"EAGLE-3 ids {dumped})", f"pass aux= with layers among {dumped}")
        if yields == "speculators" and n - 1 not in dumped:
            raise UsageError(f"speculators' view needs the last decoder layer's pre-norm output (EAGLE-3 id {n - 1}) "
                             f"but the dumps of {self.root} hold {dumped}",
                             "read it with yields='specforge', or extract from dumps of layer N-1 too")
        if yields == "specforge" and man.get("dump_provenance", {}).get("final") == "none":
            raise UsageError(f"SpecForge's view needs the final (post-norm) state but the dumps of {self.root} hold "
                             f"none", "read it with yields='speculators', or extract from dumps with a final state")
        self.yields = yields
        self.layout = Layout(yields, tuple(aux), n - 1 if yields == "speculators" else None, n)
        files = [str(f) for f in man["files"]]
        # SpecForge sorts the paths it walks; speculators' rows are the manifest's order (publish_speculators)
        self.files = sorted(files) if yields == "specforge" else files
        self.rebuilder = model_dir if isinstance(model_dir, Rebuilder) else Rebuilder(model_dir)
        self.max_len = max_len
        self.dequantize_dtype = dequantize_dtype

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        dump, mask = load_compact(self.root / self.files[index], self.rebuilder)
        if self.yields == "specforge":
            return _specforge_item(specforge_sample(self.layout, dump, mask), self.max_len)
        hs, scales = speculators_states(self.layout, dump)
        if scales is not None:  # FP8Transfer._dequantize: dequantize_fp8_tensor(hs, scales, dtype)
            hs = dequantize(hs, scales, self.dequantize_dtype)
        return _speculators_item(hs, dump.input_ids, mask)


def _specforge_item(data: dict, max_len: int) -> dict:
    """SpecForge 0.2.0's ``OfflineEagle3Dataset.process_data`` (no transform) on a ``.ckpt`` dict."""
    loss_mask = data["loss_mask"][:max_len][None, :]
    loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask,
            "target": data["hidden_state"].squeeze(0)[:max_len][None, :],
            "hidden_state": data["aux_hidden_state"].squeeze(0)[:max_len][None, :],
            "input_ids": data["input_ids"][:max_len][None, :]}


def _speculators_item(hs, ids, mask) -> dict:
    """speculators 0.9.0's ``ArrowDataset._get_raw_data`` + ``BaseDataset.__getitem__`` on a sample's
    ``hidden_states`` [T, L+1, H] (as the transfer yields it), ids and the table's loss mask."""
    T = ids.shape[0]
    return {"hidden_states": hs[:, :-1].flatten(1), "input_ids": ids, "verifier_last_hidden_states": hs[:, -1],
            "loss_mask": mask, "lengths": torch.tensor([T], dtype=torch.long),
            "position_ids": torch.arange(T, dtype=torch.long)}


def _manifest(root: Path) -> dict:
    fix = "pass a directory written by tools/extract.py --format compact (run it to completion)"
    try:
        man = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {root / MANIFEST} ({type(exc).__name__})", fix) from None
    if not isinstance(man, dict) or man.get("dataset_format") != "compact":
        what = man.get("dataset_format") if isinstance(man, dict) else None
        raise UsageError(f"{root} is not a compact dataset (dataset_format {what!r})", fix)
    if man.get("eagle3_layer_ids") is None or not isinstance(man.get("files"), list):
        raise UsageError(f"{root / MANIFEST} lists no samples or layers", fix)
    return man
