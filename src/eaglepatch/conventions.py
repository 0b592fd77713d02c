"""How each sglang release reads an EAGLE-3 draft's layer ids: the one table the tools share.

Every convention names the same residual stream. Capture index i (what SGLang's
``layers_to_capture`` holds) is the residual stream entering decoder layer i, which is the Hugging
Face ``output_hidden_states`` index i: 0 = embedding output, i = output of decoder layer i - 1,
N (``num_hidden_layers``) = the last layer's output before the final norm. The project's datasets
and dump files name a layer by its layer-output id k = i - 1 (-1 = embedding output).

A draft config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (and ``EAGLE3_DUMP_LAYERS``,
which the series reads the same way) maps to capture indices by a rule of the release:

- ``plus_one`` (sglang 0.5.9 .. 0.5.13, and the series on them): id k -> index k + 1, every list.
- ``plus_one_if_first_is_one`` (unpatched sglang 0.5.14+, PR #25454): k + 1 when the first id is
  1, else the ids are capture indices.
- ``plus_one_if_first_is_one_or_minus_one`` (the series on 0.5.14+): as upstream, and a list
  that holds -1 reads k + 1 throughout ([-1, 1, 2] -> [0, 2, 3]); upstream serves no such list.
- ``identity``: the ids are capture indices.

SGLang feeds the draft the captured states in layer order (ascending index) whatever the order
of the ids, so what a draft receives is ``sorted(capture indices)``. Which indices a tree can
capture is a property of the tree: unpatched 0.5.9 fails at index 0 (DeepSeek's residual is None
at layer 0); only the series captures index N. ``release_rule`` reads a release's rules from its
series manifest (``capture_semantics``), the one place each release declares them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UsageError

PLUS_ONE = "plus_one"
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE = "plus_one_if_first_is_one_or_minus_one"
IDENTITY = "identity"
RULES = {
    PLUS_ONE: "EAGLE-3 id k -> capture index k+1",
    PLUS_ONE_IF_FIRST_IS_ONE: "EAGLE-3 id k -> capture index k+1 only when the first id is 1, else k",
    PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE: "EAGLE-3 id k -> capture index k+1 when the first id is 1 or an id "
                                           "is -1, else k",
    IDENTITY: "EAGLE-3 id k -> capture index k",
}
# upstream's rule -> the series' rule on that release (the series agrees wherever upstream serves)
SERIES_RULE = {PLUS_ONE: PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE: PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE}


def capture(rule: str, ids: list) -> list:
    """Capture indices of ``ids`` under ``rule``, in the order given."""
    if rule == PLUS_ONE:
        return [k + 1 for k in ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        return [k + 1 for k in ids] if ids and ids[0] == 1 else list(ids)
    if rule == PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE:
        return [k + 1 for k in ids] if ids and (ids[0] == 1 or -1 in ids) else list(ids)
    if rule == IDENTITY:
        return list(ids)
    raise UsageError(f"unknown layer-id rule {rule!r}", f"use one of {sorted(RULES)}")


def ids_for(rule: str, hf: list) -> list | None:
    """Draft ids that ``rule`` reads as exactly the HF indices ``hf`` (ascending, distinct), written
    so that unpatched sglang of the same release reads them alike where it can: capture indices
    on 0.5.14+ (with an index other than 1 first), output-of-layer ids on 0.5.9. None: no list can."""
    hf = sorted(set(hf))
    if not hf:
        return None
    if rule == PLUS_ONE:
        cand = [h - 1 for h in hf]
    elif rule in (PLUS_ONE_IF_FIRST_IS_ONE, PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE):
        cand = hf[1:] + hf[:1] if hf[0] == 1 else list(hf)  # a first id of 1 would be read k + 1
    else:
        cand = list(hf)
    return cand if sorted(capture(rule, cand)) == hf and len(set(capture(rule, cand))) == len(cand) else None


def _manifest(release: str, patches_root: Path | None) -> dict | None:
    root = patches_root or Path(__file__).resolve().parents[2] / "patches"
    path = root / f"sglang-{release}" / "manifest.json"
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the series manifest {path} ({type(exc).__name__})",
                         "restore the series files (git checkout patches/)") from None
    return m if isinstance(m, dict) else None


def capture_semantics(release: str, patches_root: Path | None = None) -> dict:
    """The ``capture_semantics`` the series manifest of ``release`` declares ({} without a series)."""
    m = _manifest(release, patches_root)
    cs = (m or {}).get("capture_semantics")
    return dict(cs) if isinstance(cs, dict) else {}


def rule_of(release: str, cs: dict, unpatched: bool = False) -> str:
    """The rule ``capture_semantics`` ``cs`` of ``release`` declares for the series (or, ``unpatched``,
    for the release itself); a release without one refuses."""
    rule = cs.get("upstream_eagle_id_to_capture_index" if unpatched else "eagle_id_to_capture_index")
    if rule not in RULES or cs.get("capture_index_to_hf_index", "identity") != "identity":
        raise UsageError(f"no layer-id rule is declared for sglang {release}",
                         "use a release that has a series (patches/sglang-<release>/) or pass --sglang ROOT")
    return rule


def release_rule(release: str, unpatched: bool = False, patches_root: Path | None = None) -> str:
    """The rule the series on ``release`` (or, ``unpatched``, that release itself) reads draft ids by."""
    return rule_of(release, capture_semantics(release, patches_root), unpatched)


def dump_rule(meta: dict) -> str:
    """The rule a dump's ``EAGLE3_DUMP_LAYERS`` was read by (``layer_id_reading`` in its metadata).
    Dumps written before the field existed were read ``plus_one`` on every series."""
    rule = meta.get("layer_id_reading") or PLUS_ONE
    if rule not in RULES:
        raise UsageError(f"the dump reads its layer ids by an unknown rule {rule!r}",
                         "update eaglepatch to a version that knows the series that wrote it")
    return rule


def layer_output_ids(rule: str, ids: list) -> list:
    """The layer-output ids (-1 = embedding output, k = output of layer k; capture index - 1) that
    ``ids`` names under ``rule``, in the order given."""
    return [i - 1 for i in capture(rule, list(ids))]


def draft_eagle_config(rule: str, hf: list) -> dict | None:
    """The ``eagle_config`` a draft trained on HF indices ``hf`` needs to be fed them by sglang
    reading ids by ``rule`` (None: no list can name them there)."""
    ids = ids_for(rule, hf)
    if ids is None:
        return None
    return {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}


# ---- draft families and model files ---------------------------------------------------------------
# Three draft families read a target's hidden states, each by ids in its own config: EAGLE-3
# (``eagle_config.eagle_aux_hidden_state_layer_ids``), DFlash and DSpark (``dflash_config.target_layer_ids``,
# else a top-level ``target_layer_ids``; DSpark's top-level ``dspark_target_layer_ids`` wins over both;
# none: sglang's ``build_target_layer_ids``). Which states a list names depends on the family, the
# release and the model file that serves the target: ``draft_rule`` is the one table, in HF indices
# (the same vocabulary as above: a rule of RULES maps an id to the HF ``output_hidden_states`` index
# of the state the server feeds for it): a rule for each cell a release serves, refusal for every
# other. EAGLE-3 cells come from the release's own rule (``capture_semantics``); DFlash/DSpark cells
# from the manifest's ``capture_semantics.draft_readings`` ({family: {cell: rule}}), which
# tests/test_id_conventions.py and tests/test_draft_families.py check against each release's source:
# the release's own setter run on a stand-in model, and where its forward captures (``ast``).
#
# Why every served DFlash/DSpark cell but one is ``plus_one`` although sglang's words differ: the
# vocabulary. deepseek_v2.py's ``set_dflash_layers_to_capture`` writes k + 1 into ``layers_to_capture``,
# whose index i is sglang's capture index (the stream entering layer i = the output of layer i - 1):
# id k names the output of layer k, HF index k + 1. kimi_k3.py and deepseek_v4.py keep the ids "without
# the usual +1 shift" because their taps are not capture indices: tap k is captured as the stream
# layer k hands on (kimi_k3: at the next layer's input, or the final norm's input, before the norm, for
# the last layer; deepseek_v4: after layer k, the mean of its hyper-connection streams), the output of
# layer k again, HF index k + 1. The one exception: deepseek_v4.py on a target whose
# ``hc_pre_from_prev_sublayer`` is true (sglang 0.5.23's DeepSeek-V4.1 default) captures tap k at the
# start of layer k ("the attention input of its target layers", after layer k's Engram where it has
# one): the input of layer k, HF index k, ``identity``; that path is the cell ``deepseek_v41``.
EAGLE3, DFLASH, DSPARK = "eagle3", "dflash", "dspark"
FAMILIES = (EAGLE3, DFLASH, DSPARK)
FAMILY_NAMES = {EAGLE3: "EAGLE-3", DFLASH: "DFlash", DSPARK: "DSpark"}
# the server flag that serves each family (--speculative-algorithm)
ALGORITHMS = {EAGLE3: "EAGLE3", DFLASH: "DFLASH", DSPARK: "DSPARK"}
# target architecture -> the sglang model file that serves it (DeepseekV41ForCausalLM: sglang 0.5.23
# normalises a DeepSeek-V4.1 config to DeepseekV4ForCausalLM, configs/deepseek_v41.py)
MODEL_FILES = {
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v2",
    "DeepseekV32ForCausalLM": "deepseek_v2", "KimiK25ForConditionalGeneration": "kimi_k25",
    "KimiK3ForConditionalGeneration": "kimi_k3", "KimiK3LinearForCausalLM": "kimi_k3",
    "DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV41ForCausalLM": "deepseek_v4",
}
DEEPSEEK_V41 = "deepseek_v41"
# the table's columns ("cells"): each model file, and deepseek_v4.py's hc_pre_from_prev_sublayer path
CELLS = ("deepseek_v2", "kimi_k25", "kimi_k3", "deepseek_v4", DEEPSEEK_V41)
CELL_NAMES = {c: f"{c}.py" for c in CELLS[:-1]}
CELL_NAMES[DEEPSEEK_V41] = "deepseek_v4.py (V4.1: hc_pre_from_prev_sublayer)"
# the model files the series patches (its dump and its EAGLE-3 reading live there)
SERIES_MODEL_FILES = ("deepseek_v2", "kimi_k25")
# whether a cell's DFlash/DSpark capture reaches the last layer's output (HF index N): deepseek_v2.py
# captures at the input of layers 0..N-1 only (an id N-1, capture index N, is never captured: the
# packer counts one state short); kimi_k3.py at the final norm's input; deepseek_v4.py after the last
# layer; the V4.1 path reads inputs, and its ids (< N) name HF indices below N anyway
DRAFT_REACHES_LAST = {"deepseek_v2": False, "kimi_k25": False, "kimi_k3": True, "deepseek_v4": True,
                      DEEPSEEK_V41: False}


def reaches_last(cell: str, patched: bool = True) -> bool:
    """Whether a DFlash/DSpark capture on ``cell`` reaches the last layer's output before the final
    norm (an id N-1): ``DRAFT_REACHES_LAST`` as released; on the files it patches the series takes it
    at the final norm (its follow of the release's DFlash setter), so there it does with the series."""
    return DRAFT_REACHES_LAST[cell] or (patched and cell in SERIES_MODEL_FILES)


def model_file(architectures) -> str:
    """The sglang model file that serves a target of these ``architectures`` (its config's list)."""
    archs = [a for a in (architectures or []) if isinstance(a, str)]
    for a in archs:
        if a in MODEL_FILES:
            return MODEL_FILES[a]
    raise UsageError(f"no covered sglang model file serves the architecture {archs[0] if archs else None!r}",
                     f"use a target of {', '.join(sorted(MODEL_FILES))}, or name its model file with --model-file "
                     f"({', '.join(CELLS)})")


def target_cell(architectures, model_type=None, hc_pre_from_prev_sublayer=None) -> str:
    """The table's cell of a target: its model file, and for deepseek_v4.py the V4.1 path
    (``deepseek_v41``) where the config's ``hc_pre_from_prev_sublayer`` is true, or absent on a
    ``deepseek_v41`` model (sglang 0.5.23's DeepseekV41Config defaults it to true) or a
    DeepseekV41ForCausalLM architecture."""
    f = model_file(architectures)
    if f != "deepseek_v4":
        return f
    if hc_pre_from_prev_sublayer is not None:
        return DEEPSEEK_V41 if hc_pre_from_prev_sublayer is True else f
    v41 = model_type == "deepseek_v41" or "DeepseekV41ForCausalLM" in [a for a in architectures or []]
    return DEEPSEEK_V41 if v41 else f


def config_cell(cfg: dict) -> str:
    """``target_cell`` of a target's config.json (its text config for a multimodal one)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    flag = text.get("hc_pre_from_prev_sublayer", cfg.get("hc_pre_from_prev_sublayer"))
    return target_cell(cfg.get("architectures"), cfg.get("model_type"), flag if isinstance(flag, bool) else None)


def check_cell(cell: str, flag: str = "--model-file") -> str:
    if cell not in CELLS:
        raise UsageError(f"{flag} {cell!r} is no model file the readings table covers",
                         f"pass one of {', '.join(CELLS)}")
    return cell


def draft_rule(release: str, family: str, model_file_name: str, patched: bool = True,
               patches_root: Path | None = None) -> str:
    """The rule (RULES, in HF indices) by which sglang ``release`` (with the series, or ``patched``
    False: as released) reads a ``family`` draft's ids on the cell ``model_file_name``; UsageError
    where the release does not serve that family there, or the cell is not declared. The series
    feeds DFlash/DSpark drafts what the release feeds them (it routes, never rereads, their ids), so
    those cells do not depend on ``patched``."""
    if family not in FAMILIES:
        raise UsageError(f"unknown draft family {family!r}", f"use one of {', '.join(FAMILIES)}")
    check_cell(model_file_name, "model file")
    name = FAMILY_NAMES[family]
    cs = capture_semantics(release, patches_root)
    if not cs:
        raise UsageError(f"no series here declares how sglang {release} reads draft layer ids",
                         f"use a release with a series ({', '.join(known_releases(patches_root))})")
    if family == EAGLE3:
        if model_file_name not in SERIES_MODEL_FILES:
            raise UsageError(f"sglang {release} serves no EAGLE-3 draft on {CELL_NAMES[model_file_name]} (it has no "
                             f"set_eagle3_layers_to_capture)", "use a DFlash or DSpark draft for this target")
        return rule_of(release, cs, unpatched=not patched)
    cells = (cs.get("draft_readings") or {}).get(family) or {}
    rule = cells.get(model_file_name)
    if rule is None:
        served = ", ".join(sorted(cells)) or "no model file"
        raise UsageError(f"sglang {release} serves no {name} draft on {CELL_NAMES[model_file_name]} (it serves {name} "
                         f"on {served})", f"use a release and target that serve {name} drafts")
    if rule not in RULES:
        raise UsageError(f"the series of sglang {release} declares an unknown {name} reading {rule!r}",
                         "update eaglepatch")
    return rule


def draft_hf_indices(release: str, family: str, model_file_name: str, ids: list, patched: bool = True,
                     patches_root: Path | None = None) -> list:
    """The HF indices (0 = embedding, k + 1 = output of layer k) a ``family`` draft's ``ids`` name on
    that release and model file, in the order given."""
    return capture(draft_rule(release, family, model_file_name, patched, patches_root), list(ids))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """The DFlash/DSpark ids sglang picks when a draft's config names none (its
    ``dflash_utils.build_target_layer_ids``, over the runtime target's layers and the draft's
    ``num_hidden_layers``; SpecForge's and z-lab's ``dflash`` use the same formula over the draft
    config's ``num_target_layers``). A ValueError where sglang raises one."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ValueError("num_target_layers and num_draft_layers must be positive")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash layer selection requires num_target_layers >= 4, got {num_target_layers}")
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def known_releases(patches_root: Path | None = None) -> list:
    root = patches_root or Path(__file__).resolve().parents[2] / "patches"
    found = [p.name[len("sglang-"):] for p in root.glob("sglang-*") if (p / "manifest.json").is_file()]
    return sorted(found, key=lambda r: tuple(int(x) if x.isdigit() else 0 for x in r.split(".")))
