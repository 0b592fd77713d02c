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
  The export is written for one speculators ``--hidden-states-backend`` (``Layout.backend``,
  ``tools/extract.py --hidden-states-backend``): ``file`` (the default, speculators' too) holds the
  states in the model dtype (an fp8 dump's dequantised, left-out states rebuilt), which every
  backend reads as they are; ``fp8`` holds ``hidden_states`` float8_e4m3fn [T, L+1, H] and
  ``hidden_states_scales`` float32 [T, L+1, 1] (hs-connectors' ``SCALES_KEY``; one scale per token
  and state, an fp8 dump's own passed on untouched; other states, the rebuilt embedding or a bf16
  dump's, quantised with ``storage.quantize_rows``), half the bytes, which only speculators'
  ``--hidden-states-backend fp8`` reads right: its ``FP8Transfer`` yields ``q.to(bf16) *
  scale.to(bf16)``, broadcast over the hidden size, while its default ``file`` backend hands the raw
  fp8 codes (up to 448) to training, unscaled and without an error. No layout of the file can make
  the ``file`` backend refuse it (both backends load the same file with the same ``load_file``; the
  fp8 one only multiplies ``hidden_states`` by ``hidden_states_scales`` afterwards), so fp8 is
  written only when asked for, and the run, the manifest and the README name the flag. The
  SpecForge export is always in the model dtype (its reader cannot dequantise): the dump's
  states dequantised and rebuilt.
- ``compact`` (``eaglepatch.compact.CompactDataset``, with the model directory): each sample a
  safetensors file holding exactly what the dump stores (fp8 states and their ``scale.<name>``,
  ``rows.layer.-1``, no state the reader rebuilds), every dumped layer, plus ``loss_mask`` int64
  [T]; its metadata is the dump's (storage, layers, provenance), ``format`` = ``COMPACT_FORMAT``
  (the dump's own in ``dump_format``). The dataset costs what the dumps cost; the reader yields,
  tensor for tensor, what SpecForge's or speculators' reader yields for the other two formats.
- ``dflash`` / ``dspark`` (SpecForge 0.2.0's offline DFlash and DSpark readers walk OUT for
  ``*.ckpt``; ``specforge.algorithms.common.dflash_family_data`` normalises them): a ``torch.save``
  dict of plain tensors: ``input_ids`` int64 [T], ``loss_mask`` int64 [T], ``hidden_states`` [T, L*H]
  (the draft's layers, ascending: the order SGLang feeds them to a DFlash/DSpark draft; which layers
  ``drafts`` decides), and for ``dspark`` ``target_last_hidden_states`` [T, H]: the final, post-norm
  state of every token (SpecForge's DSpark objective applies the target's LM head to it directly, the
  state at t giving the target's distribution of token t+1). Model dtype: an fp8 dump's states
  dequantised, left-out states rebuilt.
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

FORMATS = ("specforge", "speculators", "compact")  # EAGLE-3 datasets
DRAFT_FORMATS = ("dflash", "dspark")  # DFlash and DSpark datasets (SpecForge 0.2.0's offline samples; ``drafts``)
ALL_FORMATS = FORMATS + DRAFT_FORMATS
# SpecForge 0.2.0's offline normaliser of each (specforge.algorithms.common.dflash_family_data)
DRAFT_NORMALIZER = {"dflash": "dflash_family_offline_v1", "dspark": "dspark_offline_v1"}
BACKENDS = ("file", "fp8")  # speculators' --hidden-states-backend values an export is written for
SAMPLES_DIR = "samples"
SAMPLE_EXT = {"specforge": "ckpt", "speculators": "safetensors", "compact": "safetensors", "dflash": "ckpt",
              "dspark": "ckpt"}  # sample file suffix
COMPACT_FORMAT = "eaglepatch-compact/1"  # a compact sample's metadata "format"
FP8 = "float8_e4m3fn"
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY (hs-connectors 0.9.0)
PER_TOKEN_PER_STATE = "per_token_per_state"  # a scale per (token, state): [T, L+1, 1] in a speculators file
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
_STAGING = ".publish"


class LayoutError(UsageError):
    """The dump cannot give what the format needs; ``fix`` says what to change (exit 2)."""


@dataclass(frozen=True)
class Layout:
    """Which dumped tensors a sample holds. Layer ids are EAGLE-3 ids (-1 = embedding output,
    k = output of decoder layer k); ``last`` is N-1 for speculators (its last slot), else None. A
    compact sample holds every dumped layer: ``aux`` is the aux layers its reader yields by default,
    ``last`` N-1 when it is dumped (the speculators view's last slot), else None. ``backend``
    (speculators): the ``--hidden-states-backend`` the export is written for, ``file`` (model-dtype
    states) or ``fp8`` (fp8 states and scales); None: as the dump stores them (fp8 from an fp8 dump),
    the view ``eaglepatch.compact.CompactDataset`` yields."""

    format: str
    aux: tuple  # ascending
    last: int | None
    num_layers: int
    backend: str | None = None

    @property
    def aux_hf(self) -> list:
        return [k + 1 for k in self.aux]

    def slots(self) -> list:
        names = [f"eagle3:{k}" for k in self.aux]
        return names + ([f"eagle3:{self.last}:pre_norm"] if self.format == "speculators" else [])

    def to_json(self) -> dict:
        d = {"format": self.format, "aux": list(self.aux), "last": self.last, "num_layers": self.num_layers}
        if self.backend is not None:
            d["backend"] = self.backend
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        return cls(d["format"], tuple(d["aux"]), d["last"], d["num_layers"], d.get("backend"))

    def fp8(self, dump_storage: str) -> bool:
        """Whether a speculators sample holds fp8 states and scales (from a dump stored in ``dump_storage``)."""
        return self.backend == "fp8" or (self.backend is None and dump_storage == FP8)


def layout_problem(d) -> str:
    """Why ``d`` (a layout as the settings file records it, ``Layout.to_json``) is not one, or ''."""
    def ints(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

    if not isinstance(d, dict):
        return "its layout is not an object"
    if d.get("format") not in ALL_FORMATS:
        return f"its layout's format {str(d.get('format'))[:40]!r} is not one of {', '.join(ALL_FORMATS)}"
    if not ints(d.get("aux")) or not d["aux"] or min(d["aux"]) < -1:
        return f"its layout's aux {str(d.get('aux'))[:60]} is not a list of layer ids (-1 or more)"
    n = d.get("num_layers")
    if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
        return f"its layout's num_layers {str(n)[:40]} is not a positive integer"
    last = d.get("last")
    if last is not None and not (isinstance(last, int) and not isinstance(last, bool) and last == n - 1):
        return f"its layout's last {str(last)[:40]} is not null or {n - 1}"
    if d.get("backend") not in (None, *BACKENDS):
        return f"its layout's backend {str(d.get('backend'))[:40]!r} is not one of {', '.join(BACKENDS)}"
    return ""


def check_backend(fmt: str, backend: str) -> None:
    """UsageError for a ``--hidden-states-backend`` that is not speculators' or not for ``fmt``."""
    if backend not in BACKENDS:
        raise UsageError(f"--hidden-states-backend {backend!r} is not known", f"use one of {', '.join(BACKENDS)}")
    if backend != "file" and fmt != "speculators":
        raise UsageError(f"--hidden-states-backend {backend} is speculators' and --format is {fmt}",
                         "drop it, or pass --format speculators")


def speculators_train_flags(manifest: dict, out) -> str:
    """The speculators training flags that read the speculators dataset ``out`` (its ``manifest``) right."""
    import shlex

    sp = manifest.get("speculators") or {}
    ids = " ".join(map(str, sp.get("target_layer_ids") or []))
    return (f"--data-path {shlex.quote(str(out))} --hidden-states-backend {sp.get('hidden_states_backend') or 'file'}"
            + (f" --target-layer-ids {ids}" if ids else ""))


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


def specforge_trains(out_ids) -> bool:
    """Whether SpecForge 0.2.0 trains an offline draft on the output-of-layer ids ``out_ids``: exactly
    three distinct layers (its draft's fc takes exactly 3 x hidden). Offline it never reads the ids
    (``training/assembly.py`` resolves them for online runs only), so -1 (the embedding) trains too;
    its online capture alone refuses negative ids (tools/guard.py says so)."""
    return len(set(out_ids)) == 3


def specforge_pick(rule: str, candidates) -> list | None:
    """Three of ``candidates`` (output-of-layer ids) that SpecForge trains: the highest such, or None."""
    from itertools import combinations

    picks = [list(c) for c in combinations(sorted(set(candidates)), 3) if specforge_trains(c)]
    return picks[-1] if picks else None


def resolve_layout(fmt: str, dump_ids: list, has_final: bool, num_layers: int, aux=None,
                   rule: str = conventions.PLUS_ONE, asked=None, backend: str | None = None) -> Layout:
    """The layout for ``fmt`` from the layers the server dumps; ``aux`` (output-of-layer ids)
    defaults to every dumped layer except the last decoder layer N-1, which for ``specforge`` must be
    three layers (``specforge_trains``; refused otherwise, naming three it does train). ``asked``: the ``--aux-layers`` ids as typed (read by ``rule``, the server's
    reading), named in the errors; ``rule`` also writes the ``tools/serve.py --layers`` a fix
    proposes. A fix never names a layer the model lacks. ``backend``: the speculators export's
    (``Layout.backend``)."""
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
    if fmt == "compact":  # every dumped layer is kept: a reader picks SpecForge's or speculators' view
        return Layout(fmt, tuple(chosen), last if last in dumped else None, num_layers)
    if fmt == "speculators" and last not in dumped:
        raise LayoutError(f"--format speculators needs the last decoder layer's output before the final norm "
                          f"(EAGLE-3 id {last}, HF index {num_layers}) but the server dumps layers {dumped}",
                          f"restart the server dumping layer {last} too: {restart_with(rule, dumped + [last])}")
    if fmt == "specforge" and not has_final:
        raise LayoutError("--format specforge needs the final (post-norm) state but the server dumps none",
                          "restart the server with python3 tools/serve.py --final 1 ... (EAGLE3_DUMP_FINAL=1 when you "
                          "start sglang yourself)")
    if fmt == "specforge" and aux is None and not specforge_trains(chosen):
        pick = specforge_pick(rule, [k for k in dumped if k != last])
        ids = conventions.ids_for(rule, [k + 1 for k in chosen])
        written = f" (a draft config names them {ids} on this server's release)" if ids is not None else ""
        usual = sorted({1, num_layers // 2 - 1, num_layers - 4})  # SGLang's default capture indices 2, N/2, N-3
        if pick is not None:
            fix = (f"pass --aux-layers={layers_arg(rule, pick)} (three of the layers it dumps that SpecForge trains) "
                   f"or the three the draft names")
        elif len(usual) == 3 and usual[0] >= 0 and usual[-1] < last and specforge_trains(usual):
            fix = (f"restart the server dumping three layers SpecForge trains, e.g. SGLang's default ones: "
                   f"{restart_with(rule, sorted(set(dumped) | set(usual)))}, and pass "
                   f"--aux-layers={layers_arg(rule, usual)}")
        else:
            fix = ("restart the server dumping three layers SpecForge trains (python3 tools/serve.py --layers=...) "
                   "and pass them as --aux-layers=")
        raise LayoutError(f"--format specforge without --aux-layers takes every dumped layer but the last "
                          f"(EAGLE-3 id {last}): {chosen}{written}; SpecForge 0.2.0's draft trains on exactly three "
                          f"aux layers, so its trainer would refuse the dataset", fix)
    return Layout(fmt, tuple(chosen), last if fmt == "speculators" else None, num_layers,
                  backend if fmt == "speculators" else None)


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


def specforge_sample(layout: Layout, dump, loss_mask) -> dict:
    """The dict a SpecForge ``.ckpt`` holds (module doc), from ``dump``'s dequantised, rebuilt states."""
    import torch

    aux = [dump.layers[f"layer.{k}"] for k in layout.aux]
    return {"input_ids": dump.input_ids.to(torch.int64).clone(),
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int64),
            "hidden_state": dump.final.contiguous().unsqueeze(0),
            "aux_hidden_state": torch.cat(aux, dim=-1).contiguous().unsqueeze(0)}


def draft_sample(layout: Layout, dump, loss_mask) -> dict:
    """The dict a DFlash or DSpark ``.ckpt`` holds (module doc), from ``dump``'s dequantised, rebuilt
    states: the layout's layers ascending, and for DSpark the post-norm final state."""
    import torch

    data = {"input_ids": dump.input_ids.to(torch.int64).clone(),
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int64),
            "hidden_states": torch.cat([dump.layers[f"layer.{k}"] for k in layout.aux], dim=-1).contiguous()}
    if layout.format == "dspark":
        data["target_last_hidden_states"] = dump.final.contiguous()
    return data


def speculators_states(layout: Layout, dump) -> tuple:
    """(hidden_states [T, L+1, H], scales [T, L+1, 1] or None): the aux layers ascending, then layer
    ``layout.last`` (N-1, pre-norm). For the fp8 backend (``Layout.fp8``): float8_e4m3fn states with
    float32 scales: each state the dump stores whole as fp8 passes on as stored (``dump.encoded``);
    the others (rebuilt: the embedding; a bf16 dump's) are quantised from the reader's rows
    (``storage.quantize_rows``). Otherwise the model-dtype states (dequantised, rebuilt) and no
    scales."""
    import torch

    names = [f"layer.{k}" for k in layout.aux] + [f"layer.{layout.last}"]
    if not layout.fp8(dump.storage):
        return torch.stack([dump.layers[n] for n in names], dim=1).contiguous(), None
    from ..storage import quantize_rows

    pairs = [dump.encoded[n] if n in dump.encoded else quantize_rows(dump.layers[n]) for n in names]
    return (torch.stack([q for q, _ in pairs], dim=1).contiguous(),
            torch.stack([s.to(torch.float32) for _, s in pairs], dim=1).contiguous())


def speculators_sample(layout: Layout, dump, sample_id: str) -> tuple:
    """(tensors, metadata) of a speculators sample file (module doc)."""
    import torch

    hs, scales = speculators_states(layout, dump)
    tensors = {"token_ids": dump.input_ids.to(torch.int64).clone(), "hidden_states": hs}
    if scales is not None:
        tensors[SCALES_KEY] = scales
    meta = {"sample_id": sample_id, "hidden_states_slots": json.dumps(layout.slots()),
            "hf_hidden_state_indices": json.dumps(layout.aux_hf + [layout.num_layers]), "last_slot": "pre_norm",
            "hidden_states_dtype": str(hs.dtype).replace("torch.", ""),
            "scale_layout": PER_TOKEN_PER_STATE if scales is not None else "none"}
    return tensors, meta


def compact_sample(layout: Layout, dump, sample_id: str) -> tuple:
    """(tensors, metadata) of a compact sample file: the dump file's tensors as stored and its
    metadata, with ``format`` = ``COMPACT_FORMAT`` (the dump's in ``dump_format``), ``sample_id`` and
    ``aux_layer_ids`` (the layout's aux layers: what a reader yields by default)."""
    meta = dict(dump.meta, format=COMPACT_FORMAT, dump_format=dump.meta["format"], sample_id=sample_id,
                aux_layer_ids=json.dumps(list(layout.aux)))
    return stored_tensors(dump), meta


def stored_tensors(dump) -> dict:
    """The tensors ``dump``'s file holds, as it holds them: read again from ``dump.path`` (``load_dump``
    keeps only the decoded states), refused (OSError) unless its metadata is still the one decoded."""
    from safetensors import safe_open

    with safe_open(str(dump.path), framework="pt") as f:
        if dict(f.metadata() or {}) != dump.meta:
            raise OSError(f"the dump {Path(dump.path).name} changed after it was read")
        return {k: f.get_tensor(k) for k in f.keys()}


def no_zip_crcs():
    """A context in which this thread's ``torch.save`` leaves out the zip CRC-32 of each tensor
    (torch >= 2.6's ``torch.utils.serialization.config.save.compute_crc32``, restored on exit); a
    context that changes nothing where this torch has no such switch (its files then carry CRCs: the
    same tensors, written slower).

    Why: ``torch.load`` never checks these CRCs (a byte changed inside a tensor loads without an error
    either way: tests/test_extract_path.py shows it on the installed torch), so computing them protects
    no reader of the dataset, and it took half of ``torch.save``'s time on a 7168-wide sample
    (``benchmarks/extract_path.py``). The switch is the calling thread's own (a value set in one
    thread is not seen by another), so ``write_sample`` holds this context around each ``torch.save``."""
    import contextlib

    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(getattr(config, "save", None), "compute_crc32"):
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


def write_sample(layout: Layout, out_dir: Path, rel: str, sample_id: str, dump, loss_mask) -> int:
    """Write one sample at ``out_dir/rel`` (temporary name, then rename); returns its size."""
    import torch

    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    try:
        if layout.format in ("specforge", *DRAFT_FORMATS):
            data = (specforge_sample if layout.format == "specforge" else draft_sample)(layout, dump, loss_mask)
            # closed here even when the disk is full (no fd kept by the error); torch's switch is per thread
            with open(tmp, "wb") as fh, no_zip_crcs():
                torch.save(data, fh)
        else:
            from safetensors.torch import save_file

            if layout.format == "speculators":
                tensors, meta = speculators_sample(layout, dump, sample_id)
            else:
                tensors, meta = compact_sample(layout, dump, sample_id)
            tensors["loss_mask"] = torch.as_tensor(loss_mask, dtype=torch.int64)
            save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def load_compact(path: Path, rebuilder=None) -> tuple:
    """(``dumps.Dump``, loss_mask int64 [T]) of the compact sample file ``path``: its dump part decoded
    as ``dumps.load_dump`` decodes a dump (``dumps.decode``: fp8 dequantised, left-out states rebuilt
    with ``rebuilder``, an ``eaglepatch.storage.Rebuilder`` of the model). UsageError (one line)
    for a file that is not a compact sample or does not decode."""
    from safetensors import safe_open

    from . import dumps

    path = Path(path)
    fix = "re-extract the dataset with tools/extract.py --format compact"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise UsageError(f"cannot read the compact sample {path} ({type(exc).__name__}: {str(exc)[:120]})",
                         fix) from None
    if meta.get("format") != COMPACT_FORMAT or "loss_mask" not in tensors:
        raise UsageError(f"{path} is not a compact sample (format {meta.get('format')!r})", fix)
    mask = tensors.pop("loss_mask")
    try:  # decoded as the dump it was
        return dumps.decode(path, dict(meta, format=meta.get("dump_format", "")), tensors, rebuilder), mask
    except dumps.BadDump as exc:
        raise UsageError(f"compact sample {path}: {exc}", fix) from None


def read_sample(fmt: str, path: Path, rebuilder=None) -> dict:
    """A sample back as {input_ids, loss_mask, aux [T, L*H], last [T, H]} (for checks); ``last`` is the
    post-norm final state (specforge) or the pre-norm last-layer output (speculators; fp8 states
    dequantised as speculators' FP8Transfer does, to bfloat16). A compact sample (``rebuilder``: an
    ``eaglepatch.storage.Rebuilder`` of the model, for the states it rebuilds) gives its metadata's
    aux layers, ``last`` the pre-norm layer N-1 (None when not dumped) and ``final`` the post-norm
    state (None when not dumped). A DFlash/DSpark sample gives its ``hidden_states`` as ``aux`` and
    ``target_last_hidden_states`` (DSpark; None for DFlash) as ``last``."""
    import torch

    if fmt in DRAFT_FORMATS:
        d = torch.load(str(path), weights_only=True)
        return {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"], "aux": d["hidden_states"],
                "last": d.get("target_last_hidden_states")}
    if fmt == "specforge":
        d = torch.load(str(path), weights_only=True)
        return {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"],
                "aux": d["aux_hidden_state"].squeeze(0), "last": d["hidden_state"].squeeze(0)}
    if fmt == "compact":
        dump, mask = load_compact(path, rebuilder)
        aux = json.loads(dump.meta["aux_layer_ids"])
        return {"input_ids": dump.input_ids, "loss_mask": mask,
                "aux": torch.cat([dump.layers[f"layer.{k}"] for k in aux], dim=-1),
                "last": dump.layers.get(f"layer.{int(dump.meta['num_hidden_layers']) - 1}"), "final": dump.final}
    from safetensors.torch import load_file

    from ..storage import dequantize

    d = load_file(str(path))
    hs = d["hidden_states"]
    if SCALES_KEY in d:
        hs = dequantize(hs, d[SCALES_KEY], torch.bfloat16)
    return {"input_ids": d["token_ids"], "loss_mask": d["loss_mask"],
            "aux": hs[:, :-1, :].reshape(hs.shape[0], -1), "last": hs[:, -1, :]}


def manifest_storage(fmt: str, dump_meta: dict, backend: str | None = None) -> dict:
    """The manifest's ``storage``: how the dataset's sample files hold the states, from the dataset's
    dump metadata (``dump_meta``: the first dump's ``storage_dtype``, ``scale_layout``, ``left_out``,
    ``dtype``; absent in an ``eagle3-dump/1`` dump). ``dtype``: the stored states' dtype;
    ``scale_layout``; ``left_out`` (states the reader rebuilds from the model directory);
    ``needs_model_dir``; ``speculators_backend``: the ``--hidden-states-backend`` speculators must
    train with (``fp8``: hs-connectors' FP8Transfer dequantises; None for other formats), the
    export's ``backend`` (``Layout.backend``; None: as the dump stores them);
    ``reader``: what reads it (``tools/guard.py`` refuses a dataset the draft's trainer cannot)."""
    model = dump_meta.get("dtype")
    stored = dump_meta.get("storage_dtype") or model
    fp8 = backend == "fp8" or (backend is None and stored == FP8)
    left_out = dump_meta.get("left_out") or {}
    if isinstance(left_out, str):  # the dump's metadata holds JSON text
        try:
            left_out = json.loads(left_out)
        except ValueError:
            left_out = {}
    if fmt == "compact":
        return {"dtype": stored, "scale_layout": dump_meta.get("scale_layout") or "none", "left_out": left_out,
                "needs_model_dir": bool(left_out), "speculators_backend": None,
                "reader": "eaglepatch.compact.CompactDataset(OUT, MODEL_DIR, yields='specforge'|'speculators')"}
    if fmt == "speculators":
        return {"dtype": FP8 if fp8 else model, "scale_layout": PER_TOKEN_PER_STATE if fp8 else "none", "left_out": {},
                "needs_model_dir": False, "speculators_backend": "fp8" if fp8 else "file",
                "reader": "speculators ArrowDataset, --hidden-states-backend " + ("fp8" if fp8 else "file")}
    reader = (f"SpecForge 0.2.0 offline {'DFlash' if fmt == 'dflash' else 'DSpark'} reader ({DRAFT_NORMALIZER[fmt]})"
              if fmt in DRAFT_FORMATS else "SpecForge OfflineEagle3Dataset")
    return {"dtype": model, "scale_layout": "none", "left_out": {}, "needs_model_dir": False,
            "speculators_backend": None, "reader": reader}


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
