"""Layer-convention guard: does a draft config read the hidden states its dataset holds?

Every convention names the same residual stream (see docs/design.md):

- HF ``output_hidden_states`` index h: 0 = embedding output, k+1 = output of decoder layer k;
- SGLang capture index i (the residual stream entering layer i) = HF index h (DeepSeek models);
- EAGLE-3 draft config id k: mapped to a capture index by the serving release:
  ``plus_one`` (sglang 0.5.9 and this series): i = k + 1 always;
  ``plus_one_if_first_is_one`` (newer upstream, sglang PR #25454): i = k + 1 when ids[0] == 1,
  else i = k; ``identity``: i = k.

SGLang concatenates the captured states in layer order (ascending capture index), whatever the
order of the ids in the config, so the served list is ``sorted(set(capture indices))``.

The guard maps the draft's ``eagle_aux_hidden_state_layer_ids`` through the semantics of a
release (``release_semantics``) or of an sglang tree it will serve with (``tree_semantics``,
read from ``set_eagle3_layers_to_capture`` in ``srt/models/deepseek_v2.py`` with ``ast``) and
compares the HF indices with those the dataset's manifest (or a dump file) records.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

PLUS_ONE = "plus_one"
PLUS_ONE_IF_FIRST_IS_ONE = "plus_one_if_first_is_one"
IDENTITY = "identity"
RULES = {
    PLUS_ONE: "EAGLE-3 id k -> capture index k+1",
    PLUS_ONE_IF_FIRST_IS_ONE: "EAGLE-3 id k -> capture index k+1 only when the first id is 1, else k",
    IDENTITY: "EAGLE-3 id k -> capture index k",
}
KNOWN_RELEASES = {"0.5.9": PLUS_ONE}


@dataclass
class Semantics:
    rule: str
    source: str  # where the rule was read
    series: bool = False  # the tree carries this project's eagle3_capture package
    embed_ok: bool | None = True  # capture index 0 (embedding output) works; None = unknown

    def capture(self, ids: list) -> list:
        if self.rule == PLUS_ONE:
            return [k + 1 for k in ids]
        if self.rule == PLUS_ONE_IF_FIRST_IS_ONE:
            return [k + 1 for k in ids] if ids and ids[0] == 1 else list(ids)
        return list(ids)

    def ids_for(self, hf: list) -> list | None:
        """Draft ids that this release serves as ``hf`` (HF indices), or None if none can."""
        if self.rule == PLUS_ONE:
            cand = [h - 1 for h in hf]
        elif self.rule == PLUS_ONE_IF_FIRST_IS_ONE:
            cand = [h - 1 for h in hf] if hf and hf[0] == 2 else list(hf)
        else:
            cand = list(hf)
        return cand if sorted(set(self.capture(cand))) == list(hf) else None


# ---- semantics from a release or a tree -------------------------------------------------------

def release_semantics(release: str, patches_root: Path | None = None) -> Semantics:
    root = patches_root or Path(__file__).resolve().parents[2] / "patches"
    man = root / f"sglang-{release}" / "manifest.json"
    if man.is_file():
        cs = json.loads(man.read_text()).get("capture_semantics") or {}
        rule = cs.get("eagle_id_to_capture_index")
        if rule in RULES and cs.get("capture_index_to_hf_index", "identity") == "identity":
            return Semantics(rule, f"series manifest {man}", series=True, embed_ok=True)
    if release in KNOWN_RELEASES:
        return Semantics(KNOWN_RELEASES[release], f"sglang {release} (built-in table)", series=True, embed_ok=True)
    raise UsageError(f"no capture semantics known for sglang {release}",
                     "pass --sglang ROOT to read them from the tree you serve with")


def _package_parent(root: Path) -> Path:
    root = Path(root)
    for pp in (root / "python", root):
        if (pp / "sglang" / "srt" / "models" / "deepseek_v2.py").is_file():
            return pp
    raise UsageError(f"{root} holds no sglang/srt/models/deepseek_v2.py",
                     "pass an sglang git checkout (ROOT/python/sglang) or the directory that holds sglang/")


def _find_def(tree: ast.AST, cls: str | None, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (cls is None or node.name == cls):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    return None


def _parents(root: ast.AST) -> dict:
    parents = {}
    for node in ast.walk(root):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value == value and not isinstance(node.value, bool)


def _first_is_one_test(test: ast.AST) -> bool:
    """``layer_ids[0] == 1`` (or ``1 == layer_ids[0]``, ``!=``) anywhere in a condition."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            sides = [node.left, node.comparators[0]]
            sub = [s for s in sides if isinstance(s, ast.Subscript) and _is_const(s.slice, 0)]
            one = [s for s in sides if _is_const(s, 1)]
            if sub and one:
                return True
    return False


def _plus_one_comps(fn: ast.AST) -> list:
    """``[v + 1 for v in ...]`` comprehensions (and ``v + 1`` in ``map(lambda v: v + 1, ...)``)."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)) and len(node.generators) == 1:
            tgt = node.generators[0].target
            e = node.elt
            if (isinstance(tgt, ast.Name) and isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add)
                    and ((isinstance(e.left, ast.Name) and e.left.id == tgt.id and _is_const(e.right, 1))
                         or (isinstance(e.right, ast.Name) and e.right.id == tgt.id and _is_const(e.left, 1)))):
                found.append(node)
        elif isinstance(node, ast.Lambda) and isinstance(node.body, ast.BinOp) and isinstance(node.body.op, ast.Add):
            if _is_const(node.body.right, 1) or _is_const(node.body.left, 1):
                found.append(node)
    return found


def _delegates_to_series(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "set_eagle3_layers"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "eagle3_capture"):
            return True
    return False


def _series_rule(pp: Path) -> str:
    settings = pp / "sglang" / "srt" / "eagle3_capture" / "settings.py"
    if not settings.is_file():
        raise UsageError(f"{pp}/sglang/srt/models/deepseek_v2.py calls eagle3_capture.set_eagle3_layers but "
                         f"{settings} is missing", "apply the whole series (tools/apply.py) or use a clean tree")
    tree = ast.parse(settings.read_text(), str(settings))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "capture_index":
            rets = [n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            if len(rets) == 1:
                v = rets[0].value
                if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and _is_const(v.right, 1):
                    return PLUS_ONE
                if isinstance(v, ast.Name):
                    return IDENTITY
    raise UsageError(f"cannot read the capture rule from capture_index() in {settings}",
                     "pass --release instead, or update eaglepatch.guard for this series")


def _embed_ok(tree: ast.AST, src: str) -> bool | None:
    """Can DeepseekV2Model capture index 0? 0.5.9 appends ``hidden_states + residual`` at the top
    of layer i, and residual is still None at layer 0 (TypeError)."""
    fwd = _find_def(tree, "DeepseekV2Model", "forward")
    if fwd is None:
        return None
    seen_capture = False
    for node in ast.walk(fwd):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and any(
                isinstance(op, ast.In) for op in node.test.ops):
            if "layers_to_capture" not in ast.get_source_segment(src, node.test):
                continue
            seen_capture = True
            block = ast.Module(body=node.body, type_ignores=[])
            for n in ast.walk(block):
                if (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and isinstance(n.left, ast.Name)
                        and isinstance(n.right, ast.Name) and {n.left.id, n.right.id} == {"hidden_states", "residual"}):
                    text = ast.get_source_segment(src, node) or ""
                    if "residual is None" not in text and "residual is not None" not in text:
                        return False
    return True if seen_capture else None


def tree_semantics(root: Path | str) -> Semantics:
    pp = _package_parent(Path(root))
    path = pp / "sglang" / "srt" / "models" / "deepseek_v2.py"
    src = path.read_text()
    try:
        tree = ast.parse(src, str(path))
    except SyntaxError as exc:
        raise UsageError(f"{path} does not parse ({exc.msg} at line {exc.lineno})", "fix or re-fetch the tree") from None
    fn = _find_def(tree, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture") or _find_def(
        tree, None, "set_eagle3_layers_to_capture")
    if fn is None:
        raise UsageError(f"{path} has no set_eagle3_layers_to_capture (no EAGLE-3 capture for DeepSeek)",
                         "serve with an sglang release that supports EAGLE-3 on DeepSeek (>= 0.5.9)")
    where = f"{path}:{fn.lineno} set_eagle3_layers_to_capture"
    if _delegates_to_series(fn):
        return Semantics(_series_rule(pp), where + " -> eagle3_capture (this series)", series=True, embed_ok=True)
    comps = _plus_one_comps(fn)
    embed = _embed_ok(tree, src)
    if not comps:
        return Semantics(IDENTITY, where, embed_ok=embed)
    parents = _parents(fn)
    for comp in comps:
        node = comp
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.If, ast.IfExp)) and _first_is_one_test(node.test):
                return Semantics(PLUS_ONE_IF_FIRST_IS_ONE, where, embed_ok=embed)
            if node is fn:
                break
    return Semantics(PLUS_ONE, where, embed_ok=embed)


# ---- the draft and the dataset ----------------------------------------------------------------

@dataclass
class Draft:
    path: str
    layer_ids: list | None  # None: the release's default
    use_aux: bool


def read_draft(path: Path | str) -> Draft:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"draft config {path} does not exist", "pass the draft model's config.json with --draft-config")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise UsageError(f"draft config {path} is not JSON ({exc})", "pass the draft model's config.json") from None
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    use_aux = eagle.get("use_aux_hidden_state", cfg.get("use_aux_hidden_state", True))
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(k, int) and not isinstance(k, bool)
                                                                   for k in ids) or not ids):
        raise UsageError(f"{path}: eagle_aux_hidden_state_layer_ids={ids!r} is not a list of integers",
                         "write it as e.g. [-1, 1, 29]")
    return Draft(str(path), ids, bool(use_aux))


@dataclass
class DatasetLayers:
    path: str
    layer_ids: list
    hf: list
    num_layers: int
    final: str = "post_norm"


def read_dataset(path: Path | str) -> DatasetLayers:
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise UsageError(f"{path} does not exist", "pass the dataset directory written by tools/extract.py (or a dump file)")
    if path.suffix == ".safetensors":
        from .extract.dumps import read_metadata

        try:
            m = read_metadata(path)
            return DatasetLayers(str(path), json.loads(m["eagle3_layer_ids"]), json.loads(m["hf_hidden_state_indices"]),
                                 int(m["num_hidden_layers"]), m.get("final", "post_norm"))
        except Exception as exc:
            raise UsageError(f"{path} is not a readable eagle3 dump ({type(exc).__name__})",
                             "pass a dataset directory or a dump file") from None
    try:
        m = json.loads(path.read_text())
    except ValueError:
        raise UsageError(f"{path} is not JSON", "pass the dataset directory written by tools/extract.py") from None
    ids, hf = m.get("eagle3_layer_ids"), m.get("hf_hidden_state_indices")
    n = (m.get("model") or {}).get("num_hidden_layers", m.get("num_hidden_layers"))
    if ids is None or hf is None or n is None:
        raise UsageError(f"{path} records no layer ids (no sample was extracted yet?)",
                         "run tools/extract.py to completion first")
    return DatasetLayers(str(path), list(ids), list(hf), int(n), m.get("final", "post_norm"))


# ---- the check ------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    lines: list = field(default_factory=list)
    served_hf: list | None = None

    def text(self) -> str:
        return "\n".join(self.lines)


def _ids_of(hf: list) -> list:
    return [h - 1 for h in hf]


def check(draft: Draft, data: DatasetLayers, sem: Semantics) -> Verdict:
    n = data.num_layers
    head = [f"semantics: {RULES[sem.rule]} (from {sem.source})",
            f"draft:   {draft.path}",
            f"dataset: {data.path} ({n} decoder layers)"]
    ds = (f"dataset: EAGLE-3 ids (output of layer k, -1 = embedding) {data.layer_ids} -> "
          f"HF hidden_states indices {data.hf}")
    if not draft.use_aux:
        return Verdict(False, head + [
            "MISMATCH: the draft sets use_aux_hidden_state=false, so SGLang feeds it only the final hidden "
            "state, but the dataset's training inputs are aux layers", ds,
            "fix: set eagle_config.use_aux_hidden_state=true in the draft config"])
    if draft.layer_ids is None:
        capture = [2, n // 2, n - 3]
        how = f"(none configured: the default capture indices [2, {n}//2, {n}-3])"
    else:
        capture = sem.capture(draft.layer_ids)
        how = ""
    problems = []
    bad = [i for i in capture if not 0 <= i <= n - 1]
    if bad:
        problems.append(f"capture indices {bad} match no layer of a {n}-layer model: SGLang captures fewer states "
                        f"than the draft expects (only indices 0..{n - 1} exist)")
    if 0 in capture and sem.embed_ok is False:
        problems.append("capture index 0 (the embedding output) fails in this tree: DeepSeek's residual is None "
                        "at layer 0 (TypeError at serving time); serve with the patched tree (this series)")
    served = sorted({i for i in capture if 0 <= i <= n - 1})
    if len(served) != len(capture) and not bad:
        problems.append(f"capture indices {capture} repeat a layer: SGLang captures it once")
    draft_ids = draft.layer_ids if draft.layer_ids is not None else _ids_of(capture)
    dl = (f"draft:   EAGLE-3 ids {draft_ids}{' ' + how if how else ''} -> capture indices {capture} -> served HF "
          f"hidden_states indices {served} (= EAGLE-3 output-of-layer ids {_ids_of(served)})")
    if served != list(data.hf):
        problems.insert(0, "the draft would be served other hidden states than it was trained on")
    if problems:
        fix_ids = sem.ids_for(list(data.hf))
        fix = (f"fix: set eagle_aux_hidden_state_layer_ids to {fix_ids} in the draft config (under this release's "
               f"convention), or re-extract with EAGLE3_DUMP_LAYERS={','.join(map(str, _ids_of(served)))}"
               if fix_ids is not None else
               "fix: no draft config can request these layers under this release; re-extract with "
               f"EAGLE3_DUMP_LAYERS={','.join(map(str, _ids_of(served)))}")
        return Verdict(False, head + ["MISMATCH: " + p for p in problems] + [dl, ds, fix], served)
    return Verdict(True, head + ["OK: the draft is served the hidden states it was trained on", dl, ds], served)
