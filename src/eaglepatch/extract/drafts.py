"""DFlash and DSpark datasets (``tools/extract.py --format dflash|dspark``): which dumped layers a
draft of those families reads, and the refusals when the dump cannot give them.

The draft's layers come from its config (``--draft-config``) or by hand (``--aux-layers``: the ids
as the draft's config would hold them). They are read as SGLang reads that family's ids on the
release that dumped and the model file that serves the target (``conventions.draft_hf_indices``,
the one table; the dump's ``sglang_version`` and ``architecture`` say which), never by the EAGLE-3
reading of that release: on sglang 0.5.17+ an EAGLE-3 list [0, 2] names the inputs of layers 0
and 2, a DFlash list [0, 2] their outputs.

The config is read by ``guard.read_draft`` (the one reader of draft configs: the fields sglang
0.5.17/0.5.23's ``parse_dflash_draft_config`` / ``parse_dspark_draft_config`` read, SpecForge 0.2.0
and z-lab's dflash package write; the family its fields tell, which must be the ``--format``'s).
On top, for a dataset SpecForge trains on: a config without ids is refused (SGLang would pick its
default layers, SpecForge 0.2.0's ``resolve_dflash_capture_layers`` refuses it), and so is a DSpark
config whose ``dspark_target_layer_ids`` (what SGLang feeds) differ from its
``dflash_config.target_layer_ids`` (what SpecForge trains). Ids must name layers 0..N-1, each once;
an id whose state the model file never captures for the family (``conventions.DRAFT_REACHES_LAST``:
deepseek_v2.py's capture stops at the last layer's input) is refused.

SGLang feeds the draft its layers in layer order (it captures them in its layer loop, whatever
the order of the ids), so a sample's ``hidden_states`` holds them ascending.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import conventions
from ..errors import UsageError
from .writers import DRAFT_FORMATS, DRAFT_NORMALIZER, Layout, LayoutError

BY_HAND = "--aux-layers"


@dataclass(frozen=True)
class DraftSpec:
    """A DFlash or DSpark draft's layers as its config (or ``--aux-layers``) names them."""

    family: str  # conventions.DFLASH | conventions.DSPARK
    ids: tuple  # as named, in the config's order
    source: str  # the field the ids come from, or BY_HAND
    config: str | None = None  # the config file read (None: --aux-layers)
    block_size: int | None = None
    mask_token_id: int | None = None
    num_target_layers: int | None = None

    @property
    def name(self) -> str:
        return conventions.FAMILY_NAMES[self.family]


@dataclass(frozen=True)
class DraftLayers:
    """A draft's ids read on the release and model file that dumped: HF indices (0 = embedding,
    k + 1 = output of layer k) and the project's layer-output ids (HF index - 1), in the ids' order."""

    spec: DraftSpec
    release: str
    model_file: str
    rule: str  # conventions.RULES key
    hf: tuple
    out_ids: tuple

    @property
    def ascending(self) -> list:
        return sorted(set(self.out_ids))

    def describe(self) -> str:
        ids = list(self.spec.ids)
        where = f"{self.spec.source} of {self.spec.config}" if self.spec.config else BY_HAND
        return (f"{self.spec.name} target_layer_ids {ids} ({where}), read on sglang {self.release} "
                f"{conventions.CELL_NAMES[self.model_file]} as {_reading(self.rule, ids)}: layer-output ids "
                f"{list(self.out_ids)} (HF hidden-state indices {list(self.hf)})")


def _reading(rule: str, ids: list) -> str:
    """What id k names under ``rule`` for this list, in words."""
    hf = conventions.capture(rule, ids)
    if hf == [k + 1 for k in ids]:
        return "id k = output of layer k (HF index k+1)"
    return "id k = input of layer k (HF index k)" if hf == list(ids) else conventions.RULES[rule]


def read_draft_config(path, fmt: str) -> DraftSpec:
    """The ``fmt`` (dflash | dspark) draft's spec from its config (a directory holding config.json,
    or the file), read by ``guard.read_draft`` (the fields sglang's parsers read, the family its
    fields tell); UsageError (one line) for a config of another family, or naming its layers
    ambiguously or not at all."""
    from .. import guard

    d = guard.read_draft(path)
    name = conventions.FAMILY_NAMES[fmt]
    family = d.family if d.family in DRAFT_FORMATS else conventions.EAGLE3
    if family != fmt:
        other = ("--format specforge or speculators with --aux-layers= (EAGLE-3)" if family == conventions.EAGLE3
                 else f"--format {family}")
        theirs = conventions.FAMILY_NAMES[family]
        raise UsageError(f"draft config {d.path} is {'an' if theirs[0] in 'AEIOU' else 'a'} {theirs} draft, not a "
                         f"{name} one", f"pass {other}, or the {name} draft's config")
    if d.layer_ids is None:
        raise UsageError(f"draft config {d.path} names no layers (no dflash_config.target_layer_ids): SGLang would "
                         f"feed it layers of its own choosing and SpecForge 0.2.0 refuses the config",
                         "write the draft's layers into dflash_config.target_layer_ids, or pass them with "
                         "--aux-layers=")
    if d.checked_ids is not None and list(d.checked_ids) != list(d.layer_ids):  # DSpark's own list wins in sglang
        raise UsageError(f"draft config {d.path} names two layer lists: {d.ids_field}={list(d.layer_ids)} (what SGLang "
                         f"feeds the draft) and target_layer_ids={list(d.checked_ids)} (what SpecForge 0.2.0 trains)",
                         "keep one list in the config: the layers the draft was trained on")
    return DraftSpec(fmt, tuple(d.layer_ids), d.ids_field, d.path, d.block_size, d.mask_token_id, d.num_target_layers)


def spec_by_hand(fmt: str, ids) -> DraftSpec:
    return DraftSpec(fmt, tuple(ids), BY_HAND)


def options_spec(fmt: str, draft_config, aux_layers) -> DraftSpec:
    """The draft spec of ``--format dflash|dspark``: from ``--draft-config`` or ``--aux-layers``
    (exactly one of them)."""
    name = conventions.FAMILY_NAMES[fmt]
    if draft_config is not None and aux_layers is not None:
        raise UsageError(f"--format {fmt} got both --draft-config and --aux-layers",
                         "pass one: the draft's directory (its layers are read from its config), or its "
                         "target_layer_ids by hand")
    if draft_config is None and aux_layers is None:
        raise UsageError(f"--format {fmt} needs the {name} draft's layers",
                         "pass --draft-config DIR (the draft's config.json holds them) or --aux-layers=IDS (its "
                         "dflash_config.target_layer_ids)")
    return read_draft_config(draft_config, fmt) if draft_config is not None else spec_by_hand(fmt, aux_layers)


def check_spec(spec: DraftSpec, num_layers: int, model) -> None:
    """The draft's ids name layers of the ``num_layers``-layer ``model`` (0..N-1, as SGLang requires
    of DFlash/DSpark ids), each once, and the draft was made for a target of that depth."""
    where = spec.config or BY_HAND
    ids = list(spec.ids)
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise UsageError(f"the {spec.name} draft's target_layer_ids {ids} ({where}) name {bad}, not a layer of the "
                         f"{num_layers}-layer model {model} (0..{num_layers - 1})",
                         "pass the draft made for this target, or its ids (--aux-layers=)")
    twice = sorted({k for k in ids if ids.count(k) > 1})
    if twice:
        raise UsageError(f"the {spec.name} draft's target_layer_ids {ids} ({where}) name layer {twice[0]} twice "
                         f"(SGLang captures it once; the draft's fc takes one state per id)",
                         "name each layer once")
    if spec.num_target_layers is not None and spec.num_target_layers != num_layers:
        raise UsageError(f"the {spec.name} draft {where} was made for a {spec.num_target_layers}-layer target "
                         f"(num_target_layers) but --model {model} has {num_layers} layers",
                         "pass the draft made for this target, or the served model's directory as --model")


def dump_release(meta: dict) -> str:
    """The sglang release that wrote a dump (its ``sglang_version``; a version no series here knows
    falls back to the release of its ``series_version``, e.g. 0.5.17-3)."""
    version = str(meta.get("sglang_version") or "")
    known = conventions.known_releases()
    if version in known:
        return version
    series = str(meta.get("series_version") or "")
    release = series.rsplit("-", 1)[0] if "-" in series else ""
    return release if release in known else version


def draft_layers(spec: DraftSpec, meta: dict) -> DraftLayers:
    """``spec``'s ids read as its family reads them on the release and model file of the dump
    whose metadata is ``meta`` (a dump's, or the dataset's recorded provenance); UsageError where
    that release does not serve the family on that model file, or the draft names a state it never
    captures there."""
    release = dump_release(meta)
    cell = conventions.target_cell([meta.get("architecture")])
    rule = conventions.draft_rule(release, spec.family, cell)
    hf = conventions.draft_hf_indices(release, spec.family, cell, list(spec.ids))
    n = int(meta.get("num_hidden_layers") or 0)
    # the dump comes from the series, whose capture reaches the last layer on the files it patches
    last = [k for k, h in zip(spec.ids, hf) if h >= n] if not conventions.reaches_last(cell) else []
    if n and last:
        raise UsageError(f"the {spec.name} draft's target_layer_ids {list(spec.ids)} name {last[0]}, the output of the "
                         f"last layer (HF index {n}), which sglang {release} never feeds a {spec.name} draft on "
                         f"{conventions.CELL_NAMES[cell]} (its capture stops at the input of layer {n - 1})",
                         f"use a draft whose layers are 0..{n - 2} on this target")
    return DraftLayers(spec, release, cell, rule, tuple(hf), tuple(h - 1 for h in hf))


def dump_layers_value(out_ids) -> str:
    """An ``EAGLE3_DUMP_LAYERS`` value naming the layer-output ids ``out_ids``: -1 among them, so every
    series reads the list as layer-output ids (k -> HF k + 1) whatever its EAGLE-3 reading."""
    return ",".join(map(str, sorted({-1, *out_ids})))


def restart_fix(dl: DraftLayers, need_final: bool) -> str:
    """How to restart the server dumping what ``dl``'s dataset needs."""
    value = dump_layers_value(dl.out_ids)
    final = " EAGLE3_DUMP_FINAL=1" if need_final else ""
    if dl.spec.config:
        serve = f"python3 tools/serve.py --draft-config {Path(dl.spec.config).parent} ..."
    else:
        serve = f"python3 tools/serve.py --layers={value}{' --final 1' if need_final else ''} ..."
    return (f"restart the server dumping them: {serve} (EAGLE3_DUMP_LAYERS={value}{final} when you start sglang "
            f"yourself: with -1 in the list every series reads the ids as layer outputs)")


def resolve_layout(fmt: str, dl: DraftLayers, dump_ids, has_final: bool, num_layers: int) -> Layout:
    """The layout of a ``fmt`` dataset: the draft's layers (ascending) from a dump holding
    ``dump_ids`` (and the post-norm final state, for DSpark); LayoutError naming what to dump."""
    need = dl.ascending
    missing = [k for k in need if k not in dump_ids]
    need_final = fmt == conventions.DSPARK and not has_final
    if missing or need_final:
        what = []
        if missing:
            what.append(f"layer-output ids {missing}")
        if need_final:
            what.append("the post-norm final state (DSpark's target_last_hidden_states)")
        raise LayoutError(f"the {dl.describe()}; the server dumps layers {sorted(dump_ids)}"
                          f"{' and no final state' if need_final else ''}, without {' and '.join(what)}",
                          restart_fix(dl, fmt == conventions.DSPARK))
    return Layout(fmt, tuple(need), None, num_layers)


def manifest_block(dl: DraftLayers) -> dict:
    """The manifest's ``draft``: the family, its ids and both readings, its config's settings."""
    s = dl.spec
    block = {
        "family": s.family,
        "target_layer_ids": list(s.ids),
        "ids_from": s.source,
        "config": s.config,
        "block_size": s.block_size,
        "mask_token_id": s.mask_token_id,
        "num_target_layers": s.num_target_layers,
        # how the release that dumped reads these ids on the target's model file (conventions.draft_rule)
        "reading": {"sglang_release": dl.release, "model_file": dl.model_file, "rule": dl.rule,
                    "meaning": _reading(dl.rule, list(s.ids))},
        "hf_hidden_state_indices": list(dl.hf),
        "layer_output_ids": list(dl.out_ids),
        "hidden_states_order": "ascending layer (the order SGLang feeds the draft)",
        "specforge": {"strategy": s.family, "normalizer": DRAFT_NORMALIZER[s.family],
                      "data.hidden_states_path": "."},
    }
    if s.family == conventions.DSPARK:
        block["target_last_hidden_states"] = {"state": "final", "norm": "post_norm", "tokens": "every token"}
    return block


def sglang_draft_config(dl: DraftLayers) -> dict:
    """The manifest's ``sglang_draft_config`` of a DFlash/DSpark dataset: the ids a draft trained on
    it needs on the release that dumped (``conventions.ids_for`` of the family's reading)."""
    ids = conventions.ids_for(dl.rule, list(dl.hf))
    return {"dflash_config": {"target_layer_ids": ids}, "sglang_release": dl.release, "model_file": dl.model_file,
            "family": dl.spec.family, "layer_id_reading": dl.rule}


def has_two_consecutive(mask) -> bool:
    """Whether ``mask`` supervises two consecutive tokens (SpecForge 0.2.0's DFlash-family readers
    refuse a sample that does not: ``has_consecutive_supervised_tokens``)."""
    return any(a and b for a, b in zip(mask, mask[1:]))


assert set(DRAFT_FORMATS) == {conventions.DFLASH, conventions.DSPARK}
