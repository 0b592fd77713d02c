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
