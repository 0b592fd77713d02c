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

Draft configs come in families, each with its own convention (``read_draft``):

- ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang and SpecForge): EAGLE-3 ids, which
  SGLang maps through the semantics of a release (``release_semantics``) or of the sglang tree it
  will serve with (``tree_semantics``, read from ``set_eagle3_layers_to_capture`` in
  ``srt/models/deepseek_v2.py`` with ``ast``); no ids: SGLang's default capture indices;
- speculators (``speculators_model_type``; ids top-level): HF indices (0 = embedding output, N =
  the last layer before the final norm), which vLLM reads as such; SGLang reads only
  ``eagle_config`` and does not serve this family;
- top-level ids without either: vLLM reads them as HF indices, SGLang ignores them and captures
  its defaults; both readings are checked;
- no ids at all: every server's defaults (HF [2, N//2, N-3]);
- DFlash and DSpark (``dflash_config.target_layer_ids``, else ``target_layer_ids``; DSpark's
  ``dspark_target_layer_ids`` first; none: sglang's ``build_target_layer_ids``): read through the
  readings table (``conventions.draft_rule``: release x family x model file, from the series
  manifests) on the model file serving the target (``data_cell``); ``check_block`` gives their
  verdict, ``readings`` the table of what every release and model file feeds the draft. A config
  with fields of two families is refused (``config_family``; ``--family`` names one).

``judged_release`` says which release a verdict is for (``--release``, else the one the dataset's
manifest records, which must have a series here, else the newest series, said so); tools/guard.py
and tools/check_draft.py print it first.

``check`` compares, per server, the HF indices it would feed the draft with those the dataset's
manifest (its aux layers) or a dump file (every dumped layer) records, and warns where the
family's trainer cannot train the ids. ``check_storage`` refuses a dataset whose files that trainer's
reader cannot read (a compact dataset, fp8 states: the manifest's ``storage``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import conventions
from .conventions import IDENTITY, PLUS_ONE, PLUS_ONE_IF_FIRST_IS_ONE, PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE, RULES
from .errors import RefusedError, UsageError

__all__ = ["IDENTITY", "PLUS_ONE", "PLUS_ONE_IF_FIRST_IS_ONE", "PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE", "RULES"]

KNOWN_RELEASES = {"0.5.9": PLUS_ONE}


def _read_json(path: Path, what: str, fix: str):
    try:
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror or type(exc).__name__})", fix) from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{what} {path} is not JSON ({str(exc)[:80]})", fix) from None


@dataclass
class Semantics:
    rule: str
    source: str  # where the rule was read
    series: bool = False  # the tree carries this project's eagle3_capture package
    embed_ok: bool | None = True  # capture index 0 (embedding output) works; None = unknown

    @property
    def last_ok(self) -> bool:
        """Capture index N (the last layer's output before the final norm): only the series has it."""
        return self.series

    def capture(self, ids: list) -> list:
        return conventions.capture(self.rule, ids)

    def ids_for(self, hf: list) -> list | None:
        """Draft ids that this release serves as ``hf`` (HF indices), or None if none can."""
        return conventions.ids_for(self.rule, hf)


# ---- semantics from a release or a tree -------------------------------------------------------

def release_semantics(release: str, patches_root: Path | None = None, unpatched: bool = False) -> Semantics:
    """How sglang ``release`` with the series (or, ``unpatched``, without it) reads draft ids, from
    the release's series manifest (``conventions.release_rule``)."""
    if unpatched:
        cs = conventions.capture_semantics(release, patches_root)
        rule = conventions.rule_of(release, cs, unpatched=True)
        # where upstream captures in DeepseekV2Model.forward's loop (0.5.9: no capture_site recorded,
        # 'model_loop'), index 0 fails (the residual is None at layer 0); in the decoder layers it works
        site = cs.get("capture_site", "model_loop")
        return Semantics(rule, f"unpatched sglang {release} (series manifest)", series=False,
                         embed_ok=site == "decoder_layer")
    try:
        rule = conventions.release_rule(release, patches_root=patches_root)
    except UsageError:
        if release not in KNOWN_RELEASES:
            raise
        rule = KNOWN_RELEASES[release]
    return Semantics(rule, f"sglang {release} with the series (series manifest)", series=True, embed_ok=True)


def judged_release(data: "DatasetLayers", given: str | None, flag: str = "--release") -> tuple[str, str]:
    """(release, where it came from, for a sentence) of the sglang release a draft is judged for:
    ``given`` (``--release``) wins; else the release that dumped ``data``, as its manifest (or dump
    file) records it, which must be a release with a series here; else, when nothing is recorded,
    the newest series, said so. A release the manifest records that is no release number, or one
    without a series, is a usage error (never read by another release's rule without saying so)."""
    from .series import RELEASE_RE, available_series, check_release

    have = available_series()
    rec = data.release
    valid = isinstance(rec, str) and bool(RELEASE_RE.match(rec))
    if given is not None:
        check_release(given, flag)
        if rec is None or rec == given:
            return given, flag + ("" if rec is None else "; the dataset was dumped by it too")
        was = f"sglang {rec}" if valid else f"a release recorded as {rec!r}"
        return given, (f"{flag}, not the release that dumped the dataset ({was}): the dataset's layers stay what "
                       f"they are, {flag} decides how the draft's ids are read")
    if rec is not None and not valid:
        raise UsageError(f"{data.path} records sglang_release {rec!r}, which is no release number",
                         f"pass {flag} R (the sglang release that serves the draft, e.g. {flag} "
                         f"{list(have)[-1] if have else '0.5.9'})")
    if rec is not None:
        if rec not in have and rec not in KNOWN_RELEASES:
            raise UsageError(f"the dataset was dumped by sglang {rec}, and no series here says how {rec} reads "
                             f"draft ids (series: {', '.join(have) or 'none'})",
                             f"pass {flag} R, the sglang release that serves the draft")
        return rec, "the release that dumped the dataset, as its manifest records"
    newest = list(have)[-1] if have else "0.5.9"
    return newest, (f"the newest series: the dataset records no release; pass {flag} R for the release that "
                    f"serves the draft")


def release_line(release: str, why: str, unpatched: bool = False) -> str:
    """The line a verdict starts with: which release it was judged for, and why that one."""
    return f"release: sglang {release} {'unpatched' if unpatched else 'with the series'} ({why})"


def _package_parent(root: Path) -> Path:
    root = Path(root)
    for pp in (root / "python", root):
        if (pp / "sglang" / "srt" / "models" / "deepseek_v2.py").is_file():
            return pp
    raise UsageError(f"{root} holds no sglang/srt/models/deepseek_v2.py",
                     "pass an sglang git checkout (ROOT/python/sglang) or the directory that holds sglang/")


def _source(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path} ({getattr(exc, 'strerror', None) or type(exc).__name__})",
                         "fix or re-fetch the sglang tree") from None


def _parse(path: Path, src: str | None = None) -> ast.AST:
    try:
        return ast.parse(_source(path) if src is None else src, str(path))
    except (SyntaxError, ValueError) as exc:
        raise UsageError(f"{path} does not parse ({getattr(exc, 'msg', exc)})", "fix or re-fetch the sglang tree") from None


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
    """The series' rule in a patched tree: from the upstream convention its ``release.py`` declares."""
    release = pp / "sglang" / "srt" / "eagle3_capture" / "release.py"
    if not release.is_file():
        raise UsageError(f"{pp}/sglang/srt/models/deepseek_v2.py calls eagle3_capture.set_eagle3_layers but "
                         f"{release} is missing", "apply the whole series (tools/apply.py) or use a clean tree")
    tree = _parse(release)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "UPSTREAM_EAGLE_ID_MAPPING" and isinstance(node.value, ast.Constant)):
            rule = conventions.SERIES_RULE.get(node.value.value)
            if rule:
                return rule
    raise UsageError(f"cannot read the upstream id convention (UPSTREAM_EAGLE_ID_MAPPING) from {release}",
                     "pass --release instead, or update eaglepatch for this series")


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
    src = _source(path)
    tree = _parse(path, src)
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

EAGLE_CONFIG, SPECULATORS, TOP_LEVEL, NO_IDS = "eagle_config", "speculators", "top-level", "none"
DFLASH, DSPARK = conventions.DFLASH, conventions.DSPARK
FAMILIES = {
    EAGLE_CONFIG: "SGLang/SpecForge eagle_config: EAGLE-3 ids, read by SGLang through its release's capture rule",
    SPECULATORS: "speculators (speculators_model_type): top-level HF indices (0 = embedding output, k = output of "
                 "layer k-1, N = last layer before the final norm), read as such by vLLM; SGLang reads only "
                 "eagle_config",
    TOP_LEVEL: "top-level eagle_aux_hidden_state_layer_ids without eagle_config: vLLM reads them as HF indices, "
               "SGLang ignores them and captures its defaults",
    NO_IDS: "no layer ids: every server captures its defaults",
    DFLASH: "DFlash (SpecForge's and z-lab's dflash fields: dflash_config.target_layer_ids, else target_layer_ids; "
            "none: sglang's build_target_layer_ids): served by sglang --speculative-algorithm DFLASH",
    DSPARK: "DSpark (dspark_target_layer_ids, else dflash_config.target_layer_ids, else target_layer_ids; none: "
            "sglang's build_target_layer_ids): served by sglang --speculative-algorithm DSPARK",
}
# the --family names: conventions' families; eagle3 is every EAGLE-3 config shape above
FAMILY_CHOICES = conventions.FAMILIES


def table_family(family: str) -> str:
    """The readings table's family of a config family (EAGLE-3 for every eagle shape)."""
    return family if family in (DFLASH, DSPARK) else conventions.EAGLE3


@dataclass
class Draft:
    path: str
    layer_ids: list | None  # as written; None: the servers' defaults
    use_aux: bool
    family: str = EAGLE_CONFIG
    # DFlash/DSpark: where the ids were read, the draft's layers (its default ids), what the config says
    # of its target and blocks (read, shown, not compared), and the ids sglang checks at start
    ids_field: str | None = None
    draft_layers: int | None = None
    num_target_layers: int | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    checked_ids: list | None = None  # the dflash_config/target_layer_ids list sglang range-checks at start


def _int_list(v, where: str) -> list:
    if not isinstance(v, list) or not v or not all(isinstance(k, int) and not isinstance(k, bool) for k in v):
        raise UsageError(f"{where}={v!r} is not a list of integers", "write it as e.g. [-1, 1, 29]")
    return v


# what only a draft's config holds: an eagle_config (SGLang/SpecForge), speculators' own fields, ids at the
# top level (vLLM), a draft vocabulary (SpecForge and ModelOpt templates), DFlash/DSpark fields, or a draft
# architecture
DRAFT_FIELDS = ("eagle_config", "speculators_model_type", "speculators_config", "eagle_aux_hidden_state_layer_ids",
                "draft_vocab_size", "dflash_config", "dspark_config", "dspark_target_layer_ids")
DRAFT_ARCHITECTURE = re.compile(r"eagle|speculator|dflash|dspark", re.I)
EAGLE_ARCHITECTURE = re.compile(r"eagle|speculator", re.I)
DSPARK_PREFIXED = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")


def _refuse_target_config(cfg: dict, path: Path) -> None:
    """A usage error for a config that holds nothing of a draft's (``DRAFT_FIELDS``, an Eagle,
    speculator, DFlash or DSpark architecture): most likely the target model's own config.json,
    whose layers would otherwise be read as "none configured"."""
    if any(k in cfg for k in DRAFT_FIELDS):
        return
    archs = cfg.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any(DRAFT_ARCHITECTURE.search(a) for a in archs):
        return
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = text.get("num_hidden_layers", cfg.get("num_hidden_layers"))
    what = ", ".join(([f"architectures {archs}"] if archs else [])
                     + ([f"{n} decoder layers"] if isinstance(n, int) and not isinstance(n, bool) else []))
    looks = f"it looks like a target model's config ({what})" if what else "it is no draft's config"
    raise UsageError(f"draft config {path}: {looks}: it has no eagle_config, no speculators_model_type, no "
                     f"eagle_aux_hidden_state_layer_ids, no dflash_config and no draft architecture",
                     "pass the draft's config.json: a draft's config names a draft architecture (e.g. "
                     "LlamaForCausalLMEagle3, DFlashDraftModel, DSparkDraftModel) and the target's layers it reads, in "
                     "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang, SpecForge), as "
                     "eagle_aux_hidden_state_layer_ids beside speculators_model_type (speculators, vLLM) or in "
                     "dflash_config.target_layer_ids (DFlash, DSpark)")


def _markov_rank(cfg: dict) -> int:
    """The largest markov_rank the config names anywhere sglang or SpecForge looks (DSpark's head)."""
    spots = [cfg.get("dspark_markov_rank"), cfg.get("markov_rank")]
    for nested in ("dflash_config", "dspark_config", "text_config"):
        if isinstance(cfg.get(nested), dict):
            spots.append(cfg[nested].get("markov_rank"))
    return max([v for v in spots if isinstance(v, int) and not isinstance(v, bool)], default=0)


def family_markers(cfg: dict) -> dict:
    """{family: [what in the config says so]} for EAGLE-3 (eagle3), DFlash and DSpark: what a config
    holds of each family. DSpark drafts nest their fields under dflash_config (SpecForge, sglang 0.5.23),
    so dflash_config alone says "DFlash or DSpark"; a DSpark marker decides between them."""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)] \
        if isinstance(cfg.get("architectures"), list) else []
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    eagle = [f"architecture {a}" for a in archs if EAGLE_ARCHITECTURE.search(a)]
    eagle += [k for k in ("eagle_config", "speculators_model_type", "eagle_aux_hidden_state_layer_ids") if k in cfg]
    dspark = [f"architecture {a}" for a in archs if re.search("dspark", a, re.I)]
    if isinstance(dc.get("projector_type"), str) and dc["projector_type"].startswith("dspark"):
        dspark.append(f"dflash_config.projector_type {dc['projector_type']!r}")
    if _markov_rank(cfg) > 0:
        dspark.append(f"markov_rank {_markov_rank(cfg)}")
    dspark += [k for k in ("dspark_config",) + DSPARK_PREFIXED if k in cfg]
    dflash = [f"architecture {a}" for a in archs if re.search("dflash", a, re.I)]
    if "dflash_config" in cfg:
        dflash.append("dflash_config")
    return {conventions.EAGLE3: eagle, DFLASH: dflash, DSPARK: dspark}


def config_family(cfg: dict, path: Path, given: str | None = None) -> str:
    """The family a draft config belongs to (``conventions.FAMILIES``): ``given`` (--family) when
    the config can be that; else what its fields say; a one-line usage error where they say two
    (pass --family: the --speculative-algorithm the draft is served with)."""
    m = family_markers(cfg)
    dflash_arch = [x for x in m[DFLASH] if x.startswith("architecture")]
    if given is not None:
        if given not in FAMILY_CHOICES:
            raise UsageError(f"--family {given!r} is no draft family", f"pass one of {', '.join(FAMILY_CHOICES)}")
        return given
    said = {f: why for f, why in ((conventions.EAGLE3, m[conventions.EAGLE3]), (DSPARK, m[DSPARK]),
                                  (DFLASH, dflash_arch if m[DSPARK] else m[DFLASH])) if why}
    if len(said) > 1:
        what = "; ".join(f"{conventions.FAMILY_NAMES[f]}: {', '.join(w)}" for f, w in said.items())
        raise UsageError(f"draft config {path} reads as more than one draft family ({what})",
                         f"pass --family ({', '.join(said)}), the --speculative-algorithm sglang serves the draft with")
    return next(iter(said), conventions.EAGLE3)


def _opt_int(v, where: str, lo: int = 0) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UsageError(f"{where}={v!r} is not an integer >= {lo}", "write a plain JSON integer")
    return v


def _read_block_draft(cfg: dict, path: Path, family: str) -> Draft:
    """A DFlash or DSpark draft config, read where sglang's ``parse_dflash_draft_config`` /
    ``parse_dspark_draft_config`` read it (the same fields SpecForge 0.2.0 and z-lab's ``dflash``
    write): ids from ``dflash_config.target_layer_ids`` (the key present wins, even as null), else a
    top-level ``target_layer_ids``; DSpark: a top-level ``dspark_target_layer_ids`` wins over both.
    The draft's ``num_hidden_layers`` (its text config's, where it has one) is required: sglang
    refuses a DFlash/DSpark draft without it, and it picks the default ids."""
    dc = cfg.get("dflash_config", {})
    if dc is None:
        dc = {}
    if not isinstance(dc, dict):
        raise UsageError(f"{path}: dflash_config is a {type(dc).__name__}, not an object",
                         'write it as {"target_layer_ids": [...], "mask_token_id": ...}')
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = _opt_int(text.get("num_hidden_layers"), f"{path}: num_hidden_layers", 1)
    if layers is None:
        raise UsageError(f"draft config {path} has no num_hidden_layers (sglang refuses a "
                         f"{conventions.FAMILY_NAMES[family]} draft without it)",
                         "pass the draft's own config.json as its trainer wrote it")
    key = "target_layer_ids"
    field, ids = (f"dflash_config.{key}", dc[key]) if key in dc else (key, cfg.get(key))
    checked = None
    if ids is not None:
        checked = ids = _int_list(ids, f"{path}: {field}")
    else:
        field = None
    if family == DSPARK and cfg.get("dspark_target_layer_ids") is not None:
        field, ids = "dspark_target_layer_ids", _int_list(cfg["dspark_target_layer_ids"],
                                                          f"{path}: dspark_target_layer_ids")
    block = dc.get("block_size", cfg.get("block_size"))
    if family == DSPARK and cfg.get("dspark_block_size") is not None:
        block = cfg["dspark_block_size"]
    return Draft(str(path), ids, True, family, ids_field=field, draft_layers=layers,
                 num_target_layers=_opt_int(dc.get("num_target_layers", cfg.get("num_target_layers")),
                                            f"{path}: num_target_layers", 1),
                 block_size=_opt_int(block, f"{path}: block_size", 1),
                 mask_token_id=_opt_int(dc.get("mask_token_id", cfg.get("mask_token_id")), f"{path}: mask_token_id"),
                 checked_ids=checked)


def read_draft(path: Path | str, family: str | None = None) -> Draft:
    """The draft config at ``path`` (a file or its directory), its family told by its fields (or
    ``family``, --family: eagle3, dflash, dspark)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"draft config {path} does not exist", "pass the draft model's config.json with --draft-config")
    fix = "pass the draft model's config.json"
    cfg = _read_json(path, "draft config", fix)
    if not isinstance(cfg, dict):
        raise UsageError(f"draft config {path} is a JSON {type(cfg).__name__}, not an object", fix)
    key = "eagle_aux_hidden_state_layer_ids"
    top = cfg.get(key)
    _refuse_target_config(cfg, path)
    fam = config_family(cfg, path, family)
    if fam in (DFLASH, DSPARK):
        return _read_block_draft(cfg, path, fam)
    if "eagle_config" in cfg and "speculators_model_type" not in cfg:
        eagle = cfg["eagle_config"]
        if not isinstance(eagle, dict):
            raise UsageError(f"{path}: eagle_config is a {type(eagle).__name__}, not an object",
                             'write it as {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": true}')
        ids = eagle.get(key)
        use_aux = eagle.get("use_aux_hidden_state", True)
        if not isinstance(use_aux, bool):
            raise UsageError(f"{path}: eagle_config.use_aux_hidden_state={use_aux!r} is not true/false",
                             "write true or false")
        return Draft(str(path), _int_list(ids, f"{path}: eagle_config.{key}") if ids is not None else None,
                     use_aux, EAGLE_CONFIG)
    family = SPECULATORS if "speculators_model_type" in cfg else TOP_LEVEL if top is not None else NO_IDS
    return Draft(str(path), _int_list(top, f"{path}: {key}") if top is not None else None, True, family)


@dataclass
class DatasetLayers:
    path: str
    layer_ids: list  # layer-output ids of the draft's aux layers (-1 = embedding; a dump: every dumped layer)
    num_layers: int
    kind: str = "dataset"  # dataset | dump
    dataset_format: str | None = None
    release: str | None = None  # the sglang release that dumped it, where recorded
    storage: dict = field(default_factory=dict)  # the manifest's "storage": how the sample files hold the states
    family: str | None = None  # the draft family the dataset was written for, where recorded (eagle3, dflash, dspark)
    architecture: str | None = None  # the target's architecture, where recorded
    draft_ids: list | None = None  # the draft-config ids the dataset records for its family, where it does
    model_file: str | None = None  # the model file its draft ids were read on, where recorded (a cell of the table)

    @property
    def hf(self) -> list:
        """The HF hidden_states indices of ``layer_ids`` (output of layer k = index k + 1)."""
        return [k + 1 for k in self.layer_ids]


def _positive_int(v, where: str) -> int:
    """``v`` (an int, or a string of ASCII digits) as a positive integer; a usage error naming ``where``
    (the file and the field) otherwise. ``str.isdigit`` is not the test: it takes "²", which ``int``
    refuses."""
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not re.fullmatch(r"[0-9]+", str(v)) or int(v) < 1:
        raise UsageError(f"{where}={v!r} is not a positive integer", "pass a dataset written by tools/extract.py")
    return int(v)


def _layer_ids_in_range(ids: list, n: int, where: str) -> None:
    """A usage error naming ``where`` for layer-output ids a dataset of an ``n``-layer model cannot
    hold: each is -1 (the embedding output) to n-1 (the last layer's output before the final norm),
    and none twice."""
    bad = [k for k in ids if not -1 <= k <= n - 1]
    if bad or len(set(ids)) != len(ids):
        what = (f"{bad} name no layer of a {n}-layer model (-1 = embedding output .. {n - 1} = the last layer)"
                if bad else "name a layer twice")
        raise UsageError(f"{where}={ids}: {what}", "pass a dataset written by tools/extract.py (its manifest is "
                         "damaged or hand-edited)")


DAMAGED = "pass a dataset written by tools/extract.py (its manifest is damaged or hand-edited)"
# where a manifest (or a dump's metadata) may record the draft family it was written for, and that
# family's own draft ids (the DFlash/DSpark datasets record both readings: the draft's ids and the HF indices)
FAMILY_KEYS = ("draft_family", "family")
DRAFT_ID_KEYS = ("draft_layer_ids", "target_layer_ids", "dflash_target_layer_ids")


def _manifest_layers(m: dict, where: str) -> list | None:
    """The dataset's layers as layer-output ids, from ``eagle3_layer_ids`` (layer-output ids) and/or
    ``hf_hidden_state_indices`` (HF indices, = ids + 1): whichever is recorded; both must agree."""
    ids, hf = m.get("eagle3_layer_ids"), m.get("hf_hidden_state_indices")
    if ids is not None:
        ids = _int_list(ids, f"{where}: eagle3_layer_ids")
    if hf is not None:
        hf = _int_list(hf, f"{where}: hf_hidden_state_indices")
        if ids is not None and [k + 1 for k in ids] != hf:
            raise UsageError(f"{where}: eagle3_layer_ids {ids} and hf_hidden_state_indices {hf} name other layers "
                             f"(HF index = layer-output id + 1)", DAMAGED)
        ids = [h - 1 for h in hf] if ids is None else ids
    return ids


def _recorded_family(m: dict, where: str) -> tuple[str | None, list | None, str | None]:
    """(family, its draft ids, the model file it was read on) a manifest records, each None where it
    records none: tools/extract.py's DFlash/DSpark datasets keep them in ``draft`` (``family``,
    ``target_layer_ids``, ``reading.model_file``); top-level ``draft_family``/``family`` are read too."""
    block = m.get("draft") if isinstance(m.get("draft"), dict) else {}
    fam = next((v for v in [block.get("family")] + [m.get(k) for k in FAMILY_KEYS] if v is not None), None)
    if fam is not None and fam not in conventions.FAMILIES:
        raise UsageError(f"{where}: draft family {fam!r} is none of {', '.join(conventions.FAMILIES)}", DAMAGED)
    ids = next((v for v in [block.get("target_layer_ids")] + [m.get(k) for k in DRAFT_ID_KEYS] if v is not None), None)
    reading = block.get("reading") if isinstance(block.get("reading"), dict) else {}
    cell = reading.get("model_file")
    if cell is not None and cell not in conventions.CELLS:
        raise UsageError(f"{where}: draft.reading.model_file {cell!r} is no model file of the readings table "
                         f"({', '.join(conventions.CELLS)})", DAMAGED)
    return fam, (_int_list(ids, f"{where}: draft ids") if ids is not None else None), cell


def read_dataset(path: Path | str) -> DatasetLayers:
    """The layers a dataset directory's manifest (tools/extract.py: EAGLE-3, DFlash and DSpark
    datasets alike) or a dump file records, in layer-output ids; the release, format, storage,
    draft family and target architecture where recorded."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise UsageError(f"{path} does not exist", "pass the dataset directory written by tools/extract.py (or a dump file)")
    if path.suffix == ".safetensors":
        from .extract.dumps import read_metadata

        try:
            m = read_metadata(path)
            meta = {k: json.loads(m[k]) for k in ("eagle3_layer_ids", "hf_hidden_state_indices") if k in m}
            ids = _manifest_layers(meta, str(path))
            if ids is None:
                raise KeyError("eagle3_layer_ids")
            n = _positive_int(m["num_hidden_layers"], f"{path}: num_hidden_layers")
            _layer_ids_in_range(ids, n, f"{path}: eagle3_layer_ids")
        except ImportError:
            raise UsageError("reading a dump file needs the Python package 'safetensors'",
                             "pip install -e '.[guard]' (safetensors and numpy), or pass the dataset directory") from None
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"{path} is not a readable eagle3 dump ({type(exc).__name__})",
                             "pass a dataset directory or a dump file") from None
        arch = m.get("architecture") if isinstance(m.get("architecture"), str) else None
        return DatasetLayers(str(path), ids, n, "dump", release=m.get("sglang_version"), architecture=arch)
    m = _read_json(path, "dataset manifest", "pass the dataset directory written by tools/extract.py")
    if not isinstance(m, dict):
        raise UsageError(f"{path} is a JSON {type(m).__name__}, not a manifest", "pass the dataset directory written by "
                         "tools/extract.py")
    model = m.get("model") if isinstance(m.get("model"), dict) else {}
    n = model.get("num_hidden_layers", m.get("num_hidden_layers"))
    ids = _manifest_layers(m, str(path))
    if ids is None or n is None:
        raise UsageError(f"{path} records no layer ids (no sample was extracted yet?)",
                         "run tools/extract.py to completion first")
    n = _positive_int(n, f"{path}: num_hidden_layers")
    _layer_ids_in_range(ids, n, f"{path}: eagle3_layer_ids")
    fmt = m.get("dataset_format") if isinstance(m.get("dataset_format"), str) else None
    release = m.get("sglang_release")
    release = release if release is None or isinstance(release, str) else json.dumps(release)  # judged_release refuses it
    storage = m.get("storage") if isinstance(m.get("storage"), dict) else {}
    family, draft_ids, cell = _recorded_family(m, str(path))
    arch = model.get("architecture")
    return DatasetLayers(str(path), ids, n, "dataset", fmt, release, storage, family,
                         arch if isinstance(arch, str) else None, draft_ids, cell)


# ---- storage: can the trainer's reader take the dataset's files? -------------------------------

FP8 = "float8_e4m3fn"


def check_storage(draft: Draft, data: DatasetLayers, backend: str = "file", compact_reader: bool = False) -> None:
    """RefusedError (one line: the problem, then the fix) for a dataset whose files the reader that
    trains this draft family cannot take, from the manifest's ``dataset_format`` and ``storage``
    (``writers.manifest_storage``). The reader: SpecForge's OfflineEagle3Dataset for eagle_config
    and id-less drafts (bf16 ``.ckpt`` files only), speculators' ArrowDataset through its
    ``--hidden-states-backend`` ``backend`` for the others, or, with ``compact_reader``,
    ``eaglepatch.compact.CompactDataset``. Refused: a ``compact`` dataset (or any with states left
    out) unless ``compact_reader``; fp8 states for SpecForge; fp8 states for speculators' ``file``
    backend (it would train on the raw fp8 codes, unscaled). A dump file is checked for its layers only."""
    if data.kind != "dataset" or compact_reader:
        return
    fmt, dtype = data.dataset_format, data.storage.get("dtype")
    left_out = sorted(data.storage.get("left_out") or {})
    specforge = draft.family in (EAGLE_CONFIG, NO_IDS, DFLASH, DSPARK)  # SpecForge trains (and writes) these
    trainer = ("specforge" if draft.family in (EAGLE_CONFIG, NO_IDS) else draft.family if specforge
               else "speculators")
    reader = ("SpecForge's OfflineEagle3Dataset, which reads bf16 .ckpt files only" if trainer == "specforge"
              else f"SpecForge 0.2.0's {conventions.FAMILY_NAMES[draft.family]} offline reader (dflash_family_data), "
                   f"which reads the states as stored, without per-row scales" if specforge
              else f"speculators' ArrowDataset (--hidden-states-backend {backend})")
    again = (f"re-extract into a new --out with --format {trainer}" if trainer in ("specforge", "speculators")
             else f"re-extract into a new --out in the {conventions.FAMILY_NAMES[draft.family]} format")
    if fmt == "compact" or left_out:
        raise RefusedError(f"{data.path} is a {fmt or 'compact'} dataset (states as the dump stores them: "
                           f"{dtype or 'model dtype'}, {', '.join(left_out) or 'nothing'} left out, rebuilt from the "
                           f"model directory), which {reader} cannot read",
                           f"{again}, or train through eaglepatch.compact.CompactDataset(OUT, MODEL_DIR, "
                           f"yields={trainer!r}) and pass --compact-reader")
    if dtype != FP8:
        return
    if specforge:
        raise RefusedError(f"{data.path} holds {FP8} hidden states with per-row scales, which {reader} cannot read",
                           f"{again} (bf16, dequantised and rebuilt from the same dumps)")
    if backend != "fp8":
        raise RefusedError(f"{data.path} holds {FP8} hidden states with per-row scales (hidden_states_scales), which "
                           f"{reader} would train on as raw fp8 codes without their scales",
                           "train with speculators' --hidden-states-backend fp8 (hs-connectors' FP8Transfer "
                           "dequantises them) and pass --hidden-states-backend fp8 here")


# ---- the check ------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    lines: list = field(default_factory=list)
    servers: dict = field(default_factory=dict)  # server -> {"ok", "served_hf", "fix"}, the first reader first

    @property
    def served_hf(self) -> list | None:
        """What the first reader of the draft (SGLang, or vLLM for speculators drafts) serves it."""
        return next(iter(self.servers.values()), {}).get("served_hf")

    def text(self) -> str:
        return "\n".join(self.lines)


def _ids_of(hf: list) -> list:
    return [h - 1 for h in hf]


def _default_hf(n: int) -> list:
    """SGLang's, vLLM's and speculators' default: capture / HF indices [2, N//2, N-3]."""
    return [2, n // 2, n - 3]


def _compare(served: list, data: DatasetLayers) -> str | None:
    """Why the served HF indices do not fit the dataset side, or None."""
    if data.kind == "dump":
        missing = [h for h in served if h not in data.hf]
        return (f"the dump holds no HF hidden_states indices {missing} that the draft would be served"
                if missing else None)
    if served != data.hf:
        return "the draft would be served other hidden states than it was trained on"
    return None


# ---- fixes: each valid for the draft family's trainer and explained where a release's reading shapes it ----

def _dump_rule(sem: Semantics) -> str:
    """The rule the series on this release reads ``EAGLE3_DUMP_LAYERS`` (``tools/serve.py --layers``) and
    ``tools/extract.py --aux-layers`` by: its own on a patched tree, else the series' for that upstream."""
    return sem.rule if sem.series else conventions.SERIES_RULE.get(sem.rule, sem.rule)


def _reader(sem: Semantics) -> str:
    """Who reads the ids, for a sentence: 'sglang 0.5.17 with the series', 'the tree at --sglang'."""
    if "set_eagle3_layers_to_capture" in sem.source:
        return "the sglang tree at --sglang"
    return sem.source.split(" (")[0]


def _reading_note(rule: str, reader: str, ids: list, hf: list) -> str:
    """Why ``ids``, which ``rule`` reads as the HF indices ``hf``, are not simply the output-of-layer ids
    (HF index - 1, ascending); empty when they are."""
    hf = sorted(set(hf))
    if ids == _ids_of(hf):
        return ""
    note = f" ({reader} reads ids by the rule '{RULES[rule]}', so these are capture indices, i.e. HF indices {hf}"
    if ids != sorted(ids):
        note += ("; 1 is not first because a list that starts with 1 is read k+1, and the order changes nothing "
                 "else: SGLang feeds the layers in ascending order")
    return note + ")"


# What SpecForge 0.2.0 trains. Its draft (LlamaForCausalLMEagle3) takes exactly three aux states (its fc
# maps 3 x hidden_size). Training from a dataset (its offline mode, what this project's datasets feed) never
# reads the draft config's ids: a draft of ids [-1, 1, 2] trains as any other (tools/acceptance.py trains
# its drafts so). Only its online mode and its own capture read them, through resolve_eagle_capture_layers,
# which takes exactly three non-negative ids (specforge/algorithms/model_providers.py).
SPECFORGE_AUX = ("SpecForge 0.2.0's draft (LlamaForCausalLMEagle3, its fc over 3 x hidden_size) takes exactly three "
                 "aux layers")
SPECFORGE_ONLINE = ("SpecForge 0.2.0 trains these ids from a dataset, as here (offline; tools/acceptance.py's drafts "
                    "are trained so); its online mode and its own capture take only three non-negative ids")


def _specforge_trains(ids) -> bool:
    """SpecForge 0.2.0 trains a draft of these EAGLE-3 ids from a dataset: exactly three, distinct."""
    return ids is not None and len(ids) == 3 and len(set(ids)) == 3


def _servable(sem: Semantics, hf: list, n: int) -> bool:
    """Whether this tree can capture every HF index of ``hf`` (index N needs the series; index 0
    fails where DeepSeek's residual is None at layer 0)."""
    top = n if sem.last_ok else n - 1
    return bool(hf) and all(0 <= h <= top for h in hf) and not (0 in hf and sem.embed_ok is False)


def _dump_ids(sem: Semantics, hf: list) -> tuple[str, str] | None:
    """(ids, why) of the ``EAGLE3_DUMP_LAYERS`` (= ``tools/serve.py --layers``, ``tools/extract.py
    --aux-layers``) that the series on this release reads as the HF indices ``hf``: the ids written
    out, and why they are written so where its reading decides ('' where they are the plain
    output-of-layer ids); None: no list names them there."""
    ids = conventions.ids_for(_dump_rule(sem), hf)
    if ids is None:
        return None
    arg = ",".join(map(str, ids))
    if ids == _ids_of(sorted(set(hf))):
        return arg, ""
    return arg, f"the series on this release reads these as capture indices, i.e. HF indices {sorted(set(hf))}"


def _dump_clause(sem: Semantics, hf: list) -> str | None:
    """How to dump the HF indices ``hf``: 'python3 tools/serve.py --layers=IDS (EAGLE3_DUMP_LAYERS)'."""
    got = _dump_ids(sem, hf)
    if got is None:
        return None
    ids, note = got
    return f"python3 tools/serve.py --layers={ids} (EAGLE3_DUMP_LAYERS={ids}{'; ' + note if note else ''})"


def _reextract(sem: Semantics, hf: list) -> str | None:
    """'re-extract ...': a dataset of the HF indices ``hf`` (what the draft is served), or None."""
    got = _dump_ids(sem, hf)
    if got is None:
        return None
    ids, note = got
    return (f"re-extract into a new --out with --aux-layers={ids} from a server started with python3 tools/serve.py "
            f"--layers={ids} (EAGLE3_DUMP_LAYERS={ids}{'; ' + note if note else ''})")


def _specforge_layers(draft: Draft, data: DatasetLayers, sem: Semantics, served: list) -> tuple[list, str] | None:
    """(HF indices, whose) of three layers a SpecForge draft can be trained on and served under ``sem``:
    the draft's own layers when its ids qualify ('draft'), else three of the dataset's ('dataset'),
    else SGLang's defaults or the last three layers before N-1 ('other'); None: the model has none."""
    n = data.num_layers

    def ok(hf):
        return len(set(hf)) == 3 and _servable(sem, hf, n) and _specforge_trains(sem.ids_for(hf))

    if (draft.layer_ids is not None and _specforge_trains(draft.layer_ids) and ok(served)
            and sorted(sem.capture(draft.layer_ids)) == served):
        return served, "draft"
    mine = [h for h in data.hf if 1 <= h <= n - 1]
    if len(mine) >= 3 and ok(mine[-3:]):
        return mine[-3:], "dataset"
    for cand in (sorted(set(_default_hf(n))), list(range(1, n))[-3:]):
        if ok(cand):
            return cand, "other"
    return None


def _sglang_fix(draft: Draft, data: DatasetLayers, sem: Semantics, served: list) -> str:
    """The fix line of SGLang's reading. First the one-line config change: the ids this release reads
    as the dataset's layers, the layers a draft trained on the dataset learned (its weights stay
    right; for an off-by-one draft this is the whole fix); where the family's trainer cannot train
    that many layers (SpecForge: three), a dataset of layers it can and the ids that name them.
    Each list is explained where the release's reading decides its values or order."""
    n = data.num_layers
    where = ("eagle_aux_hidden_state_layer_ids" if draft.family == EAGLE_CONFIG
             else "eagle_config.eagle_aux_hidden_state_layer_ids")
    specforge = draft.family in (EAGLE_CONFIG, NO_IDS)  # SpecForge trains (and writes) these configs
    reader = _reader(sem)
    draft_ok = (not specforge or draft.layer_ids is None or _specforge_trains(draft.layer_ids)) and (
        len(served) == 3 or not specforge)
    again = _reextract(sem, served) if draft_ok and _servable(sem, served, n) else None
    if data.kind == "dump":
        dump = _dump_clause(sem, served) if _servable(sem, served, n) else None
        return (f"fix: dump the layers the draft is served ({dump})" if dump else
                f"fix: name layers of the dump (HF indices {data.hf}) in the draft config")
    ids = sem.ids_for(data.hf) if _servable(sem, data.hf, n) else None
    if ids is not None and (not specforge or _specforge_trains(ids)):
        return (f"fix: set {where} to {ids} in the draft config (the dataset's layers, which a draft trained on "
                f"it learned){_reading_note(sem.rule, reader, ids, data.hf)}"
                + (f", or, for a draft not trained yet, {again}" if again else ""))
    if ids is None:
        why = ("index 0, the embedding output, fails in this tree" if 0 in data.hf and sem.embed_ok is False
               else f"index {n}, the last layer before the final norm, needs the series" if n in data.hf
               and not sem.last_ok else "no list of ids is read as them")
        return (f"fix: no draft config makes {reader} serve the dataset's HF indices {data.hf} ({why})"
                + (f"; {again}" if again else "; serve with the series (python3 tools/apply.py)"))
    # the ids that read the dataset's layers are more or fewer than SpecForge's draft takes
    head = (f"fix: {SPECFORGE_AUX}, and the ids {reader} reads as this dataset's {len(data.layer_ids)} layers are "
            f"{ids}")
    pick = _specforge_layers(draft, data, sem, served)
    if pick is None:
        return head + f"; a {n}-layer model has no three layers such ids name under this release"
    hf, whose = pick
    three = sem.ids_for(hf)
    got = _dump_ids(sem, hf)  # HF indices >= 1: the series reads them as this release does
    arg = got[0] if got else ",".join(map(str, three))
    again = _reextract(sem, hf) or f"re-extract into a new --out with --aux-layers={arg}"
    if whose == "draft":
        return head + f": keep the draft's ids {draft.layer_ids} and {again}"
    setting = f"set {where} to {three}{_reading_note(sem.rule, reader, three, hf)}"
    if whose == "dataset":
        return (head + f": re-extract three of its layers (HF indices {hf}) into a new --out with --aux-layers={arg} "
                f"(the server dumps them already) and {setting}")
    return head + f": {again}, and {setting}"


def _sglang(draft: Draft, data: DatasetLayers, sem: Semantics) -> tuple[list, list, list, str | None]:
    """SGLang's reading: (problems, description lines, served HF, the fix line or None)."""
    n = data.num_layers
    if draft.family == EAGLE_CONFIG and draft.layer_ids is not None:
        capture = sem.capture(draft.layer_ids)
        how = ""
    else:
        capture = _default_hf(n)
        how = ("(SGLang reads only eagle_config.eagle_aux_hidden_state_layer_ids: its default capture indices "
               f"[2, {n}//2, {n}-3])" if draft.family != EAGLE_CONFIG else
               f"(none configured: the default capture indices [2, {n}//2, {n}-3])")
    problems = []
    top = n if sem.last_ok else n - 1
    bad = [i for i in capture if not 0 <= i <= top]
    if bad:
        problems.append(f"capture indices {bad} match no layer of a {n}-layer model: SGLang captures fewer states "
                        f"than the draft expects (only indices 0..{top} exist"
                        f"{'' if sem.last_ok else f'; index {n}, the last layer before the norm, needs the series'})")
    if 0 in capture and sem.embed_ok is False:
        problems.append("capture index 0 (the embedding output) fails in this tree: DeepSeek's residual is None "
                        "at layer 0 (TypeError at serving time); serve with the patched tree (this series)")
    served = sorted({i for i in capture if 0 <= i <= top})
    if len(served) != len(capture) and not bad:
        problems.append(f"capture indices {capture} repeat a layer: SGLang captures it once")
    ids = draft.layer_ids if draft.family == EAGLE_CONFIG and draft.layer_ids is not None else _ids_of(capture)
    desc = [f"semantics: {RULES[sem.rule]} (from {sem.source})",
            f"SGLang draft: EAGLE-3 ids {ids}{' ' + how if how else ''} -> capture indices {capture} -> served HF "
            f"hidden_states indices {served} (= EAGLE-3 output-of-layer ids {_ids_of(served)})"]
    why = _compare(served, data)
    if why:
        problems.insert(0, why)
    return problems, desc, served, _sglang_fix(draft, data, sem, served) if problems else None


def _vllm(draft: Draft, data: DatasetLayers, sem: Semantics) -> tuple[list, list, list, str | None]:
    """vLLM's reading of top-level ids (HF indices, the speculators convention): as ``_sglang``."""
    n = data.num_layers
    hf = draft.layer_ids if draft.layer_ids is not None else _default_hf(n)
    how = "" if draft.layer_ids is not None else f" (none configured: the default [2, {n}//2, {n}-3])"
    problems = []
    bad = [h for h in hf if not 0 <= h <= n]
    if bad:
        problems.append(f"HF indices {bad} name no hidden state of a {n}-layer model (0..{n})")
    served = sorted(set(h for h in hf if 0 <= h <= n))
    desc = [f"vLLM draft: HF indices {hf}{how} -> served HF hidden_states indices {served} "
            f"(= EAGLE-3 output-of-layer ids {_ids_of(served)})"]
    why = _compare(served, data)
    if why:
        problems.insert(0, why)
    fix = None
    if problems:
        # speculators trains distinct HF indices 0..N: the dataset's always are
        again = _reextract(sem, served) if served and not bad and len(set(hf)) == len(hf) else None
        fix = (f"fix: set eagle_aux_hidden_state_layer_ids to {data.hf} (HF indices, as speculators and "
               f"vLLM read them)" + (f", or {again}" if again else ""))
    return problems, desc, served, fix


def _training_warnings(draft: Draft, data: DatasetLayers) -> list:
    """Where the trainer of this config family (or of this dataset's format) cannot train the ids."""
    out = []
    n = data.num_layers
    if draft.family == EAGLE_CONFIG and draft.layer_ids is not None and not _specforge_trains(draft.layer_ids):
        out.append(f"warning: {SPECFORGE_AUX}, once each; it cannot train {draft.layer_ids} (speculators can, as "
                   f"HF indices {[k + 1 for k in draft.layer_ids]})")
    elif draft.family == EAGLE_CONFIG and draft.layer_ids is not None and min(draft.layer_ids) < 0:
        out.append(f"note: {draft.layer_ids}: {SPECFORGE_ONLINE}")
    if draft.family in (SPECULATORS, TOP_LEVEL) and draft.layer_ids is not None:
        if min(draft.layer_ids) < 0 or max(draft.layer_ids) > n or len(set(draft.layer_ids)) != len(draft.layer_ids):
            out.append(f"warning: speculators 0.9.0 rejects {draft.layer_ids}: its ids are distinct HF indices "
                       f"0..{n} (0 = embedding output, -1 is not an id)")
    if data.dataset_format == "specforge" and len(data.layer_ids) != 3:
        out.append(f"warning: this specforge-format dataset holds {len(data.layer_ids)} aux layers (EAGLE-3 ids "
                   f"{data.layer_ids}); {SPECFORGE_AUX}")
    return out


def check(draft: Draft, data: DatasetLayers, sem: Semantics) -> Verdict:
    n = data.num_layers
    head = [f"draft:   {draft.path} ({FAMILIES[draft.family]})",
            f"dataset: {data.path} ({n} decoder layers{', ' + data.dataset_format + ' format' if data.dataset_format else ''})"]
    ds = (f"dataset: EAGLE-3 ids (output of layer k, -1 = embedding) {data.layer_ids} -> "
          f"HF hidden_states indices {data.hf}" + (" (every dumped layer)" if data.kind == "dump" else ""))
    if draft.family == EAGLE_CONFIG and not draft.use_aux:
        return Verdict(False, head + [
            "MISMATCH: the draft sets use_aux_hidden_state=false, so SGLang feeds it only the final hidden "
            "state, but the dataset's training inputs are aux layers", ds,
            "fix: set eagle_config.use_aux_hidden_state=true in the draft config"], {"sglang": {"ok": False}})
    readers = {SPECULATORS: ["vllm"], TOP_LEVEL: ["sglang", "vllm"]}.get(draft.family, ["sglang"])
    lines, servers, ok = list(head), {}, True
    for server in readers:
        problems, desc, served, fix = _sglang(draft, data, sem) if server == "sglang" else _vllm(draft, data, sem)
        name = "SGLang" if server == "sglang" else "vLLM"
        verdict = [f"MISMATCH ({name}): {p}" for p in problems] or [
            f"OK ({name}): the draft is served the hidden states {'the dump holds' if data.kind == 'dump' else 'it was trained on'}"]
        lines += verdict + desc
        servers[server] = {"ok": not problems, "served_hf": served, "fix": fix}
        ok = ok and not problems
    lines.append(ds)
    lines += _training_warnings(draft, data)
    lines += [s["fix"] for s in servers.values() if s["fix"]]
    return Verdict(ok, lines, servers)


# ---- model files and the DFlash/DSpark families ------------------------------------------------

def data_cell(data: DatasetLayers, given: str | None, flag: str = "--model-file") -> tuple[str | None, str]:
    """(cell, where it came from) of the model file the verdict is for: ``given`` (--model-file)
    wins; else the one serving the architecture the dataset records (an architecture no covered
    model file serves is a usage error), else the model file its draft ids were read on; None where
    nothing says."""
    if data.architecture:
        rec, what = conventions.target_cell([data.architecture]), f"the dataset's target ({data.architecture})"
    else:
        rec, what = data.model_file, "the dataset's draft reading"
    if given is not None:
        conventions.check_cell(given, flag)
        if rec is None or rec == given:
            return given, flag + ("" if rec is None else f"; {what} is served by it too")
        return given, f"{flag}, not the file of {what}: {rec}"
    if rec is not None:
        return rec, f"the file of {what}, as its manifest records"
    return None, "none recorded"


# the reading of a DFlash/DSpark id, in words, per rule of the table
BLOCK_RULE_TEXT = {conventions.PLUS_ONE: "id k names the output of layer k (HF index k+1)",
                   conventions.IDENTITY: "id k names the input of layer k (HF index k)"}


@dataclass
class Feed:
    """What sglang ``release`` feeds a DFlash/DSpark draft on a model file (a cell of the table)."""
    served: bool
    why: str | None = None  # not served: why
    ids: list = field(default_factory=list)  # the ids sglang resolves (the config's, or its default)
    how: str = ""
    rule: str | None = None
    capture: list = field(default_factory=list)  # HF index of each id, in the config's order
    served_hf: list = field(default_factory=list)  # what the draft is fed: HF indices, ascending (layer order)
    problems: list = field(default_factory=list)


def block_ids(draft: Draft, n: int) -> tuple[list, str, list]:
    """(ids, how they were found, problems) of a DFlash/DSpark draft served with an ``n``-layer target,
    as sglang resolves them (``_resolve_dflash_aux_hidden_state``): the config's ids; none: its
    ``build_target_layer_ids`` over the runtime target's layers and the draft's; the
    dflash_config/target_layer_ids list range-checked at start (0..n-1) even where DSpark's own
    ``dspark_target_layer_ids`` replaces it."""
    problems = []
    if draft.checked_ids is not None:
        bad = [v for v in draft.checked_ids if not 0 <= v < n]
        if bad:
            problems.append(f"sglang refuses to start: target_layer_ids {bad} are out of range for a {n}-layer target "
                            f"(ids are 0..{n - 1})")
    if draft.layer_ids is not None:
        return list(draft.layer_ids), draft.ids_field or "", problems
    how = f"none configured: sglang's build_target_layer_ids({n} target layers, {draft.draft_layers} draft layers)"
    try:
        ids = conventions.build_target_layer_ids(n, draft.draft_layers)
    except ValueError as exc:
        return [], how, problems + [f"sglang refuses to start: {exc}"]
    if draft.num_target_layers is not None and draft.num_target_layers != n:
        try:
            theirs = conventions.build_target_layer_ids(draft.num_target_layers, draft.draft_layers)
        except ValueError:
            theirs = None
        how += (f"; SpecForge and z-lab's dflash build the default from the config's num_target_layers "
                f"{draft.num_target_layers}" + (f": {theirs}" if theirs is not None else ""))
    return ids, how, problems


def block_feed(draft: Draft, n: int, release: str, cell: str, patches_root: Path | None = None,
               patched: bool = True) -> Feed:
    """``Feed`` of a DFlash/DSpark ``draft`` on sglang ``release``'s ``cell`` (an ``n``-layer target),
    read through the table (``conventions.draft_rule``) and what the cell's capture reaches (with the
    series, or ``patched`` False: as released; ``conventions.reaches_last``)."""
    try:
        rule = conventions.draft_rule(release, draft.family, cell, patches_root=patches_root)
    except UsageError as exc:
        return Feed(False, exc.problem)
    ids, how, problems = block_ids(draft, n)
    hf = conventions.capture(rule, ids)
    top = n if conventions.reaches_last(cell, patched) else n - 1
    neg = [k for k in ids if k < 0]
    past = [k for k in ids if k >= n]
    last = [k for k, h in zip(ids, hf) if 0 <= k < n and h > top]
    if neg:
        problems.append(f"ids {neg} name no layer: {conventions.FAMILY_NAMES[draft.family]} ids are layer ids "
                        f"0..{n - 1}, sglang captures nothing for them (fewer states than the draft expects)")
    if past:
        problems.append(f"ids {past} name no layer of a {n}-layer target: sglang captures fewer states than the "
                        f"draft expects")
    if last:
        problems.append(f"id {last[0]} names the output of the last layer (HF {n}), which "
                        f"{conventions.CELL_NAMES[cell]} never captures (it captures at the input of layers "
                        f"0..{n - 1}): sglang captures fewer states than the draft expects")
    good = [h for k, h in zip(ids, hf) if 0 <= k < n and 0 <= h <= top]
    if len(set(good)) != len(good):
        problems.append(f"ids {ids} repeat a layer: sglang captures it once")
    return Feed(True, None, ids, how, rule, hf, sorted(set(good)), problems)


def _block_ids_for(rule: str, hf: list, n: int, cell: str, patched: bool = True) -> list | None:
    """The ids ``rule`` reads on ``cell`` as exactly the HF indices ``hf``, ascending; None: none can."""
    ids = [h - 1 for h in hf] if rule == conventions.PLUS_ONE else list(hf)
    top = n if conventions.reaches_last(cell, patched) else n - 1
    ok = all(0 <= k < n for k in ids) and all(h <= top for h in hf) and len(set(ids)) == len(ids)
    return ids if ok and conventions.capture(rule, ids) == list(hf) else None


def _holds(served: list, data: DatasetLayers) -> str:
    if data.kind == "dump":
        missing = [h for h in served if h not in data.hf]
        return f"the dump lacks HF {missing}" if missing else "the dump holds them"
    if served == data.hf:
        return "the dataset holds them, as trained"
    missing = [h for h in served if h not in data.hf]
    return f"the dataset lacks HF {missing}" if missing else f"the dataset holds them, not as trained ({data.hf})"


def _block_fix(draft: Draft, data: DatasetLayers, feed: Feed, release: str, cell: str, patched: bool = True) -> str:
    n = data.num_layers
    where = draft.ids_field or "dflash_config.target_layer_ids"
    fed = f"HF indices {feed.served_hf} (layer-output ids {_ids_of(feed.served_hf)})"
    if data.kind == "dump":
        return f"fix: dump the layers the draft is fed: {fed}"
    ids = _block_ids_for(feed.rule, data.hf, n, cell, patched)
    again = f"extract a dataset of the layers it is fed: {fed}" if feed.served_hf and not feed.problems[1:] else None
    if ids is not None:
        return (f"fix: set {where} to {ids} in the draft config (the ids sglang {release} reads on "
                f"{conventions.CELL_NAMES[cell]} as the dataset's layers, which a draft trained on it learned)"
                + (f", or, for a draft not trained yet, {again}" if again else ""))
    return (f"fix: no {conventions.FAMILY_NAMES[draft.family]} ids make sglang {release} feed "
            f"{conventions.CELL_NAMES[cell]} the dataset's HF indices {data.hf}"
            + (f"; {again}" if again else ""))


def check_block(draft: Draft, data: DatasetLayers, release: str, cell: str, unpatched: bool = False,
                patches_root: Path | None = None) -> Verdict:
    """The verdict for a DFlash/DSpark draft: the HF indices sglang ``release`` (with the series, or
    ``unpatched``: the same reading) feeds it on ``cell`` against the dataset's layers."""
    n = data.num_layers
    name = conventions.FAMILY_NAMES[draft.family]
    head = [f"draft:   {draft.path} ({name}: {draft.ids_field or 'no ids'}"
            + (f" {draft.layer_ids}" if draft.layer_ids is not None else "")
            + f", {draft.draft_layers} draft layers)",
            f"dataset: {data.path} ({n} decoder layers"
            f"{', ' + data.dataset_format + ' format' if data.dataset_format else ''}"
            f"{', written for ' + conventions.FAMILY_NAMES[data.family] + ' drafts' if data.family else ''})"]
    ds = (f"dataset: layer-output ids (output of layer k, -1 = embedding) {data.layer_ids} -> HF hidden_states "
          f"indices {data.hf}" + (" (every dumped layer)" if data.kind == "dump" else ""))
    feed = block_feed(draft, n, release, cell, patches_root, patched=not unpatched)
    if not feed.served:
        lines = head + [f"NOT SERVED (SGLang): {feed.why}", ds]
        return Verdict(False, lines, {"sglang": {"ok": False, "served_hf": None, "fix": None, "not_served": feed.why}})
    problems = list(feed.problems)
    why = _compare(feed.served_hf, data)
    if why:
        problems.insert(0, why)
    series = ("unpatched" if unpatched else "with the series") + (
        " (the series routes these ids, never rereads them: the same reading without it)"
        if cell in conventions.SERIES_MODEL_FILES else "")
    desc = [f"reading: {name} ids on {conventions.CELL_NAMES[cell]}, sglang {release} {series}: "
            f"{BLOCK_RULE_TEXT[feed.rule]} (series manifest, capture_semantics.draft_readings)",
            f"SGLang draft: {name} ids {feed.ids} ({feed.how}) -> HF hidden_states indices {feed.capture} -> served "
            f"in layer order {feed.served_hf} (= layer-output ids {_ids_of(feed.served_hf)})"]
    lines = head + ([f"MISMATCH (SGLang): {p}" for p in problems] or [
        f"OK (SGLang): the draft is served the hidden states {'the dump holds' if data.kind == 'dump' else 'it was trained on'}"])
    lines += desc + [ds]
    if feed.ids and feed.ids != sorted(feed.ids):
        lines.append(f"note: the config lists its ids as {feed.ids}; sglang feeds the layers in ascending order "
                     f"{feed.served_hf}, which is the order the dataset must hold them in")
    if data.family and data.family != draft.family:
        lines.append(f"warning: the dataset was written for {conventions.FAMILY_NAMES[data.family]} drafts, the draft is "
                     f"a {name} draft: its trainer may not read it")
    not_checked = [f"block_size {draft.block_size}" if draft.block_size is not None else "block_size",
                   f"mask_token_id {draft.mask_token_id}" if draft.mask_token_id is not None else "mask_token_id"]
    lines.append(f"not checked: {', '.join(not_checked)} (read, not compared with anything)"
                 + ("; the samples' target_last_hidden_states (DSpark's training target, which the server does not "
                    "feed the draft)" if draft.family == DSPARK else ""))
    fix = _block_fix(draft, data, feed, release, cell, not unpatched) if problems else None
    if fix:
        lines.append(fix)
    return Verdict(not problems, lines, {"sglang": {"ok": not problems, "served_hf": feed.served_hf, "fix": fix}})


def not_served(draft: Draft, data: DatasetLayers, why: str) -> Verdict:
    """The verdict where the release serves no draft of this family on the dataset's model file."""
    return Verdict(False, [f"draft:   {draft.path} ({FAMILIES[draft.family]})",
                           f"dataset: {data.path} ({data.num_layers} decoder layers)",
                           f"NOT SERVED (SGLang): {why}"],
                   {"sglang": {"ok": False, "served_hf": None, "fix": None, "not_served": why}})


def readings(draft: Draft, data: DatasetLayers, judged: tuple | None = None,
             patches_root: Path | None = None) -> tuple[list, list]:
    """(lines, rows) of the readings table for this draft: per release with a series and per model
    file, the HF indices sglang feeds it (with the series and unpatched where they differ) or that
    it serves no such draft there, and whether the dataset holds them. ``judged``: (release, cell,
    unpatched) of the verdict, marked with '*'. Empty for drafts SGLang does not read (speculators)."""
    fam = table_family(draft.family)
    if draft.family == SPECULATORS:
        return [], []
    n = data.num_layers
    rows = []
    for r in conventions.known_releases(patches_root):
        for cell in conventions.CELLS:
            if fam == conventions.EAGLE3:
                if cell not in conventions.SERIES_MODEL_FILES:
                    rows.append({"release": r, "model_file": cell, "series": None, "served_hf": None})
                    continue
                for unp in (False, True):
                    try:
                        sem = release_semantics(r, patches_root, unpatched=unp)
                    except UsageError:
                        continue
                    served = _sglang(draft, data, sem)[2]
                    rows.append({"release": r, "model_file": cell, "series": not unp, "served_hf": served})
            else:  # the reading is the release's own; with the series the capture also reaches id N-1
                feeds = [block_feed(draft, n, r, cell, patches_root, patched=p) for p in (True, False)]
                served = [f.served_hf if f.served else None for f in feeds]
                for series, hf in ([(None, served[0])] if served[0] == served[1] else zip((True, False), served)):
                    rows.append({"release": r, "model_file": cell, "series": series, "served_hf": hf})
    for row in rows:
        row["dataset"] = _holds(row["served_hf"], data) if row["served_hf"] is not None else None
    lines = [f"readings: the HF hidden_states indices sglang feeds this draft ({conventions.FAMILY_NAMES[fam]}), per "
             f"release and model file (* = this verdict's):"]
    for r in conventions.known_releases(patches_root):
        groups: list = []  # (outcome, [cell labels], judged?)
        for row in (x for x in rows if x["release"] == r):
            label = conventions.CELL_NAMES[row["model_file"]]
            if row["series"] is not None:
                label += " with the series" if row["series"] else " unpatched"
            mine = judged is not None and judged[0] == r and judged[1] == row["model_file"] and (
                row["series"] is None or row["series"] == (not judged[2]))
            out = ("not served" if row["served_hf"] is None else f"{row['served_hf']}: {row['dataset']}")
            key = (out, row["series"])
            g = next((g for g in groups if g[0] == key), None)
            if g is None:
                groups.append((key, [label], [mine]))
            else:
                g[1].append(label)
                g[2].append(mine)
        for k, ((out, _), labels, mine) in enumerate(groups):
            star = "*" if any(mine) else " "
            lines.append(f" {star}{('sglang ' + r + ':') if k == 0 else '':<15} {', '.join(labels)}: {out}")
    return lines, rows


# ---- output ------------------------------------------------------------------------------------

def write_out(text: str) -> None:
    """``text`` and a newline on stdout, flushed. A reader that has closed the pipe (``guard.py ... |
    head -1``) ends the output quietly: stdout goes to /dev/null from then on, so neither this write
    nor the flush at exit reports anything, and the verdict's exit code stands."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
            pass
