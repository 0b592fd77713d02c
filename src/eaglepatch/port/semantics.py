"""How a draft-config EAGLE-3 id maps to a captured layer, read from a release's deepseek_v2.py (ast),
for both releases of a port and for the ported series (recorded in its manifest)."""

from __future__ import annotations

import ast

from ..conventions import SERIES_RULE
from .result import PortResult

DEEPSEEK = "sglang/srt/models/deepseek_v2.py"


def _func(tree: ast.AST, cls: str, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    return None


def detect_capture_semantics(deepseek_source: bytes | None) -> dict:
    """What `DeepseekV2ForCausalLM.set_eagle3_layers_to_capture` of this file does with draft ids.

    eagle_id_to_capture_index: 'plus_one' (capture index = id + 1, id -1 = embedding output),
    'plus_one_if_first_is_one' (+1 only when the first id is 1, else the ids are capture indices),
    'identity', 'eagle3_capture' (delegated to the series' package), or 'unknown'.
    capture_site: 'model_loop' (DeepseekV2Model.forward appends hidden + residual) or
    'decoder_layer' (the layer's boundary captures into captured_last_layer_outputs)."""
    if deepseek_source is None:
        return {"eagle_id_to_capture_index": "unknown", "capture_site": "unknown"}
    try:
        tree = ast.parse(deepseek_source)
    except SyntaxError:
        return {"eagle_id_to_capture_index": "unknown", "capture_site": "unknown"}
    fn = _func(tree, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture")
    mapping = "unknown"
    if fn is not None:
        # only the statements before an unconditional `return <call>` can run
        body_nodes = []
        for stmt in fn.body:
            body_nodes.append(stmt)
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                break
        delegated = plus_one = first_is_one = identity = False
        for stmt in body_nodes:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "set_eagle3_layers" and "eagle3_capture" in ast.unparse(node.func):
                    delegated = True
                if isinstance(node, ast.ListComp) and isinstance(node.elt, ast.BinOp) and \
                        isinstance(node.elt.op, ast.Add) and isinstance(node.elt.right, ast.Constant) and \
                        node.elt.right.value == 1:
                    plus_one = True
                if isinstance(node, ast.Compare) and "layer_ids[0]" in ast.unparse(node) and \
                        any(isinstance(c, ast.Constant) and c.value == 1 for c in node.comparators):
                    first_is_one = True
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list" \
                        and node.args and ast.unparse(node.args[0]) == "layer_ids":
                    identity = True
        if delegated:
            mapping = "eagle3_capture"
        elif plus_one and first_is_one:
            mapping = "plus_one_if_first_is_one"
        elif plus_one:
            mapping = "plus_one"
        elif identity:
            mapping = "identity"
    site = "unknown"
    fwd = _func(tree, "DeepseekV2Model", "forward")
    if fwd is not None:
        src = ast.unparse(fwd)
        if "captured_last_layer_outputs" in src:
            site = "decoder_layer"
        elif "aux_hidden_states.append" in src:
            site = "model_loop"
    return {"eagle_id_to_capture_index": mapping, "capture_site": site}


def series_semantics(upstream: dict, patched: dict, old_semantics: dict | None,
                     draft_readings: dict | None = None) -> dict:
    """capture_semantics of a ported series: the patched mapping (what users get), the mapping of
    the unpatched release, where capture happens, and capture index -> HF index (identity: both
    count the residual stream entering layer i, index 0 = embedding output)."""
    old = dict(old_semantics or {})
    up_mapping = upstream.get("eagle_id_to_capture_index", "unknown")
    if up_mapping == "eagle3_capture":  # the new release's own file already calls the series' package
        up_mapping = old.get("upstream_eagle_id_to_capture_index", old.get("eagle_id_to_capture_index", "unknown"))
    mapping = patched.get("eagle_id_to_capture_index")
    if mapping == "eagle3_capture":  # the package reads ids as upstream does, plus -1 and index N
        mapping = SERIES_RULE.get(up_mapping, "unknown")
    out = {"eagle_id_to_capture_index": mapping or "unknown",
           "capture_index_to_hf_index": old.get("capture_index_to_hf_index", "identity"),
           "upstream_eagle_id_to_capture_index": up_mapping,
           "capture_site": upstream.get("capture_site", "unknown")}
    if draft_readings is not None:
        out["draft_readings"] = draft_readings
    return out


def declared_semantics(old, to_release: str) -> dict | None:
    """The capture_semantics the destination release's series beside ``old`` (same patches root)
    declares, or None where that release has no series yet."""
    from ..conventions import capture_semantics

    return capture_semantics(to_release, old.dir.parent) or None


def draft_readings_for(res: PortResult, old_semantics: dict | None, declared: dict | None) -> dict | None:
    """The DFlash/DSpark readings the ported series declares: the destination release's own
    declaration where its series already exists (``declared``: checked against that release's code
    by the tests), else the old series' carried over with a note that they are unchecked for the
    new release. None where neither series declares any."""
    if declared is not None and "draft_readings" in declared:
        return declared["draft_readings"]
    carried = (old_semantics or {}).get("draft_readings")
    if carried:
        res.notes.append(
            f"the DFlash/DSpark readings (manifest.json capture_semantics.draft_readings) are sglang "
            f"{res.from_release}'s, carried over unchecked: compare each (family, model file) with sglang "
            f"{res.to_release}'s setters and capture sites (tests/test_id_conventions.py) and edit the manifest "
            f"where they differ")
    return carried


def record_semantics(res: PortResult, old_semantics: dict | None, old_read, trees, up_new: dict,
                     declared: dict | None = None) -> None:
    """Fill res.upstream_semantics / res.semantics and add a note where upstream changed them
    (`up_new`: what detect_capture_semantics found in the new release's own DEEPSEEK file)."""
    from_release, to_release = res.from_release, res.to_release
    up_old = detect_capture_semantics(old_read(DEEPSEEK))
    res.upstream_semantics = {from_release: up_old, to_release: up_new}
    if res.clean:
        patched_new = detect_capture_semantics(trees.new_state.get(DEEPSEEK, trees.new_upstream.get(DEEPSEEK)))
    else:
        patched_new = {"eagle_id_to_capture_index": "unknown"}
    res.semantics = series_semantics(up_new, patched_new, old_semantics,
                                     draft_readings_for(res, old_semantics, declared))
    if up_old.get("eagle_id_to_capture_index") != up_new.get("eagle_id_to_capture_index"):
        mine = (f"the ported series maps them '{res.semantics['eagle_id_to_capture_index']}' (recorded in "
                f"manifest.json capture_semantics)" if res.clean else
                "decide the mapping of the new series when resolving the conflicts, and record it in its "
                "manifest.json capture_semantics")
        res.notes.append(
            f"upstream changed how draft-config ids map to captured layers: sglang {from_release} "
            f"'{up_old.get('eagle_id_to_capture_index')}', sglang {to_release} "
            f"'{up_new.get('eagle_id_to_capture_index')}'; {mine}")
    if up_old.get("capture_site") != up_new.get("capture_site"):
        res.notes.append(f"upstream moved the capture: '{up_old.get('capture_site')}' in sglang {from_release}, "
                         f"'{up_new.get('capture_site')}' in sglang {to_release}; review the capture hooks")
