"""Drafts keep their meaning: on every release with a series, the patched tree feeds an EAGLE-3
draft exactly the hidden states unpatched SGLang of that release feeds it, wherever upstream
serves the id list, and the documented reading (eaglepatch.conventions) where it does not.

Both sides run the real code of the release: ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``
taken with ``ast`` from the release's own ``deepseek_v2.py`` (fetched from the package index), and
the same method of the patched file (``git apply`` of the series), which calls the series'
``eagle3_capture`` package as the series adds it to that release. Which indices upstream's capture
can reach is read from the release's code too (index 0 fails where DeepseekV2Model.forward adds
``hidden_states + residual`` with the residual still None; index N is never in the layer loop).
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "src"))

torch = pytest.importorskip("torch")

from eaglepatch import conventions, fetch, guard, overlay  # noqa: E402
from eaglepatch.applier import git_apply  # noqa: E402
from eaglepatch.series import PACKAGE, available_series, load_series  # noqa: E402

RELEASES = sorted(available_series(), key=lambda r: tuple(int(x) for x in r.split(".")))
DEEPSEEK = f"{PACKAGE}/srt/models/deepseek_v2.py"
N_BIG = 61  # Kimi-K2.5 / DeepSeek-V3


def _method(source: bytes, env: dict):
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture")
    ns = dict(env)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "deepseek_v2.py", "exec"), ns)
    return ns[fn.name]


class Release:
    """One release: its upstream method, its patched method and what upstream's capture reaches."""

    _count = 0

    def __init__(self, release: str, pkg_root: Path, upstream_mapping: str | None = None):
        root = fetch.unpacked_release(release, quiet=True)
        series = load_series(REPO / "patches" / f"sglang-{release}")
        originals = {}
        for rel in series.files():
            p = root / rel
            originals[rel] = p.read_bytes() if p.is_file() else None
        res = git_apply(originals, series.patches)
        assert res.error is None, res.error
        patched = res.final
        self.release = release
        self.upstream_source = originals[DEEPSEEK]
        # the series' package as the series adds it to this release (optionally with another
        # upstream convention declared: the controls below)
        Release._count += 1
        for rel, data in patched.items():
            if data is not None and rel.startswith(f"{PACKAGE}/srt/eagle3_capture/"):
                if upstream_mapping is not None and rel.endswith("/release.py"):
                    data = data.replace(b'UPSTREAM_EAGLE_ID_MAPPING = "plus_one_if_first_is_one"',
                                        f'UPSTREAM_EAGLE_ID_MAPPING = "{upstream_mapping}"'.encode())
                (pkg_root / rel).parent.mkdir(parents=True, exist_ok=True)
                (pkg_root / rel).write_bytes(data)
        self.pkg = overlay.import_package(f"e3c_ids_{Release._count}", root=pkg_root)
        env = {"Optional": typing.Optional, "List": typing.List}
        self.upstream = _method(self.upstream_source, env)
        self.patched = _method(patched[DEEPSEEK], dict(env, eagle3_capture=self.pkg))
        site = conventions.capture_semantics(release).get("capture_site", "model_loop")
        self.embed_ok = site == "decoder_layer"
        self._check_capture_site(root, site)

    def _check_capture_site(self, root: Path, site: str) -> None:
        """The declared capture site against the release's code: index 0 works exactly where the
        capture reads the residual after the layer's input norm made it (decoder_layer)."""
        sem = guard.tree_semantics(root)
        if site == "model_loop":
            assert sem.embed_ok is False  # hidden_states + residual with residual None at layer 0
        else:  # the layer's boundary captures the residual its input step made (the embedding at 0)
            found = []
            for path in sorted((root / PACKAGE / "srt" / "layers").rglob("*.py")):
                for fn in ast.walk(ast.parse(path.read_bytes())):
                    if not isinstance(fn, ast.FunctionDef):
                        continue
                    text = ast.unparse(fn)
                    prepare = re.search(r"self\._?prepare\w*\(", text)
                    for call in ("captured_last_layer_outputs.append(", "capture_gathered.capture("):
                        if call in text and prepare:
                            assert prepare.start() < text.index(call), (path, fn.name)
                            found.append(fn.name)
            assert found, f"no decoder-layer capture found in sglang {self.release}'s layers/"

    @staticmethod
    def _model(n):
        return SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                               config=SimpleNamespace(num_hidden_layers=n),
                               model=SimpleNamespace(layers_to_capture=[], norm=torch.nn.Identity()),
                               capture_aux_hidden_states=False)

    def upstream_feeds(self, ids, n):
        """The capture indices unpatched sglang feeds the draft, in order, or None: it cannot serve
        the list (an index its capture never reaches, or a layer twice: the draft's fc expects
        len(ids) states; 0.5.17+'s packer asserts the count)."""
        m = self._model(n)
        self.upstream(m, None if ids is None else list(ids))
        lt = list(m.model.layers_to_capture)
        lo = 0 if self.embed_ok else 1
        reach = [i for i in range(n) if i >= lo]
        captured = [i for i in reach if i in lt]
        if ids is not None and (len(captured) != len(ids) or len(set(lt)) != len(lt)):
            return None
        return captured

    def patched_feeds(self, ids, n):
        """What the patched tree feeds the draft (capture indices in order), or the refusal's text."""
        m = self._model(n)
        try:
            self.patched(m, None if ids is None else list(ids))
        except self.pkg.DumpConfigError as exc:
            return str(exc)
        state = m._eagle3_capture_state
        order = state.eagle_order
        assert m.model.layers_to_capture == [i for i in order if i < n]
        assert bool(m.model.norm._forward_hooks) == (n in order)
        assert m.capture_aux_hidden_states
        return order


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Release objects by name, made once per module (their packages under pytest's tmp dir)."""
    made = {}

    def get(r: str) -> Release:
        if r not in made:
            made[r] = Release(r, tmp_path_factory.mktemp(f"ids-{r}"))
        return made[r]

    return get


def documented(rule: str, ids, n):
    """The documented reading (conventions' table): sorted capture indices, or None (refused)."""
    idx = conventions.capture(rule, list(ids))
    if not idx or len(set(idx)) != len(idx) or not all(0 <= i <= n for i in idx):
        return None
    return sorted(idx)


def exhaustive_lists(lo=-2, hi=7, max_len=3):
    for length in range(1, max_len + 1):
        yield from itertools.product(range(lo, hi + 1), repeat=length)


def random_lists(n, count, seed):
    rnd = random.Random(seed)
    for _ in range(count):
        length = rnd.choice([1, 2, 3, 3, 3, 4, 5])
        pool = [-1, 0, 1, 2, n // 2, n - 3, n - 2, n - 1, n, n + 1] + list(range(-2, n + 2))
        yield tuple(rnd.choice(pool) for _ in range(length))


def mismatches(rel: Release, lists, n):
    """(ids, upstream, patched) wherever the patched tree departs from upstream or the table."""
    rule = conventions.release_rule(rel.release)
    bad, served = [], 0
    for ids in lists:
        up = rel.upstream_feeds(ids, n)
        got = rel.patched_feeds(ids, n)
        if up is not None:
            served += 1
            if got != up:
                bad.append((ids, up, got))
        else:
            want = documented(rule, ids, n)
            if (want is None) != isinstance(got, str) or (want is not None and got != want):
                bad.append((ids, want, got))
    return bad, served


@pytest.mark.parametrize("r", RELEASES)
def test_patched_feeds_what_upstream_feeds_wherever_upstream_serves(r, release):
    rel = release(r)
    small = list(exhaustive_lists())  # 1110 lists on a 6-layer model
    big = list(random_lists(N_BIG, 2000, seed=sum(map(ord, r))))
    named = [(2, 30, 58), (1, 29, 57), (-1, 2, 30), (-1, 1, 2), (0, 2, 3), (3, 31, 59), (2, 31, 59),
             (1, 30, 58), (29, 1, 57), (60,), (2, 30, 61), (1, 29, 60)]
    bad_small, served_small = mismatches(rel, small, 6)
    bad_big, served_big = mismatches(rel, big + named, N_BIG)
    print(f"sglang {r}: upstream serves {served_small}/{len(small)} lists (6 layers), "
          f"{served_big}/{len(big) + len(named)} (61 layers); departures {len(bad_small) + len(bad_big)}")
    assert not bad_small and not bad_big, (bad_small + bad_big)[:5]
    assert served_small > 50 and served_big > 500  # the property covers lists upstream really serves
    # no ids: upstream's default [2, N//2, N-3] on both
    assert rel.patched_feeds(None, N_BIG) == rel.upstream_feeds(None, N_BIG) == [2, 30, 58]


def test_the_documented_readings(release):
    """The README's table, row by row, on the real methods (61 layers)."""
    want = {  # release -> ids -> (upstream, patched); None: not served / refused
        "0.5.9": {(1, 29, 57): ([2, 30, 58], [2, 30, 58]), (2, 30, 58): ([3, 31, 59], [3, 31, 59]),
                  (-1, 1, 2): (None, [0, 2, 3]), (1, 29, 60): (None, [2, 30, 61]), (0, 2, 3): ([1, 3, 4], [1, 3, 4])},
        "0.5.17": {(1, 29, 57): ([2, 30, 58], [2, 30, 58]), (2, 30, 58): ([2, 30, 58], [2, 30, 58]),
                   (-1, 1, 2): (None, [0, 2, 3]), (1, 29, 60): (None, [2, 30, 61]), (0, 2, 3): ([0, 2, 3], [0, 2, 3]),
                   (2, 30, 61): (None, [2, 30, 61])},
    }
    want["0.5.23"] = want["0.5.17"]
    for r, rows in want.items():
        rel = release(r)
        for ids, (up, pa) in rows.items():
            assert rel.upstream_feeds(ids, N_BIG) == up, (r, ids)
            assert rel.patched_feeds(ids, N_BIG) == pa, (r, ids)


def test_the_old_reading_fails_the_property(tmp_path):
    """Control: the series as it read ids before (k -> k + 1 for every list on 0.5.14+) departs
    from unpatched 0.5.17 on lists upstream serves, [2, 30, 58] among them."""
    old = Release("0.5.17", tmp_path, upstream_mapping="plus_one")
    bad, _ = mismatches(old, list(random_lists(N_BIG, 300, seed=7)) + [(2, 30, 58)], N_BIG)
    assert ((2, 30, 58), [2, 30, 58], [3, 31, 59]) in bad
    assert len(bad) > 50


@pytest.mark.parametrize("r", RELEASES)
def test_round_trip_dataset_draft_config_served(r, release):
    """Dataset layers H (HF indices) on release R -> the draft ids written for R -> what patched R
    feeds that draft == H; unpatched R feeds it H too wherever its capture reaches H. The dump
    reads EAGLE3_DUMP_LAYERS by the same rule, so dumping with those ids writes H."""
    rel = release(r)
    rule = conventions.release_rule(r)
    up_rule = conventions.release_rule(r, unpatched=True)
    sets = [tuple(c) for k in (1, 2, 3) for c in itertools.combinations(range(0, 7), k)]
    rnd = random.Random(3)
    sets += [tuple(sorted(rnd.sample(range(0, N_BIG + 1), 3))) for _ in range(300)]
    for hf in sets:
        n = 6 if max(hf) <= 6 else N_BIG
        ids = conventions.ids_for(rule, list(hf))
        if ids is None:
            assert hf == (1,), hf  # the only set no list names on 0.5.14+ (a lone 1 reads as 2)
            continue
        assert rel.patched_feeds(ids, n) == list(hf), (r, hf, ids)
        settings = rel.pkg.settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d",
                                                            "EAGLE3_DUMP_LAYERS": ",".join(map(str, ids))})
        assert settings.capture_indices(n) == list(hf)
        reachable = all((i >= 1 or rel.embed_ok) and i <= n - 1 for i in hf)
        if reachable:
            assert rel.upstream_feeds(ids, n) == list(hf), (r, hf, ids)
            assert conventions.ids_for(up_rule, list(hf)) == ids  # one list serves both trees


# ---- DFlash and DSpark: the table's cells against each release's own setters and forwards -----------------
#
# conventions.draft_rule (the series manifests' capture_semantics.draft_readings) says, per release, family
# and model file, which state a DFlash/DSpark id names. Checked here on each release's released source:
# ``configure_aux_hidden_state_capture`` (attention_backend_setup.py, which picks the setter: DSpark's when
# the model has one, else DFlash's, else ValueError) runs on a stand-in of the class that serves the cell,
# carrying that class's real ``set_*_layers_to_capture`` methods (taken with ``ast``); what the setter stores
# is then read by what the model's forward does with it (``CAPTURED``: a capture index of deepseek_v2.py is
# the input of that layer; a tap of kimi_k3.py / deepseek_v4.py is the output of that layer, or, on
# deepseek_v4.py's hc_pre_from_prev_sublayer path, its input), which ``test_where_each_model_file_captures``
# proves on the same source with ``ast``: a release that moves a capture fails there.

import __future__  # noqa: E402
import functools  # noqa: E402

MODELS = f"{PACKAGE}/srt/models"
# the class serving each cell, the language model it delegates to (if any), and the attribute the ids land in
CELL_CLASSES = {
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM", None),
    "kimi_k25": ("kimi_k25", "KimiK25ForConditionalGeneration", "deepseek_v2"),
    "kimi_k3": ("kimi_k3", "KimiK3ForConditionalGeneration", "kimi_k3_lm"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM", None),
    "deepseek_v41": ("deepseek_v4", "DeepseekV4ForCausalLM", None),
}
LANGUAGE_MODELS = {"deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"), "kimi_k3_lm": ("kimi_k3", "KimiK3LinearForCausalLM")}
# what an entry the setter stores names, as HF index, per cell (the forward's capture, proven by ast below):
# deepseek_v2.py: capture index i = the input of layer i (HF i), captured in the layer loop only (i < N);
# kimi_k3.py / deepseek_v4.py: tap k = the output of layer k (HF k + 1); the V4.1 path: the input of layer k (HF k)
CAPTURED = {"deepseek_v2": (0, False), "kimi_k25": (0, False), "kimi_k3": (1, True), "deepseek_v4": (1, True),
            "deepseek_v41": (0, True)}
SAFE_IMPORTS = {"typing", "dataclasses", "numbers", "logging", "json", "msgspec", "collections", "math", "enum",
                "functools", "re"}


def _compile(nodes: list, name: str, env: dict) -> dict:
    ns = dict(env)
    code = compile(ast.Module(body=nodes, type_ignores=[]), name, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, ns)
    return ns


def module_defs(path: Path, names, env: dict | None = None) -> dict:
    """A namespace holding the top-level definitions ``names`` of the module at ``path`` and every
    top-level definition they use, transitively (functions, classes, simple assignments), with the
    module's standard-library imports: the release's own code, without importing sglang."""
    tree = ast.parse(path.read_bytes())
    defs, imports = {}, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            for t in node.targets:
                defs[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defs[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if mod and mod.split(".")[0] in SAFE_IMPORTS:
                imports.append(node)
    want, todo = [], list(names)
    while todo:
        n = todo.pop()
        node = defs.get(n)
        if node is None or node in want:
            continue
        want.append(node)
        todo += [x.id for x in ast.walk(node) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)]
    order = [n for n in tree.body if n in want]
    return _compile(imports + order, str(path), env or {})


@functools.lru_cache(maxsize=None)
def _class_methods(root: Path, file: str, cls: str) -> dict:
    """The ``set_*_layers_to_capture`` methods of ``cls`` in the release's ``file``, as functions."""
    tree = ast.parse((root / MODELS / f"{file}.py").read_bytes())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fns = [n for n in node.body if isinstance(n, ast.FunctionDef) and re.fullmatch(r"set_\w+_layers_to_capture", n.name)]
    ns = _compile(fns, f"{file}.py", {"Optional": typing.Optional, "List": typing.List})
    return {f.name: ns[f.name] for f in fns}


def stand_in(root: Path, file: str, cls: str, n: int):
    """An object of a new class carrying only ``cls``'s real setters (``hasattr`` sees what the
    release's class has), with the attributes they read."""
    kind = type(f"StandIn{cls}", (), _class_methods(root, file, cls))
    obj = kind()
    obj.pp_group = SimpleNamespace(is_last_rank=True, world_size=1)
    obj.config = SimpleNamespace(num_hidden_layers=n)
    obj.capture_aux_hidden_states = False
    obj.model = SimpleNamespace(layers_to_capture=[], dspark_layers_to_capture=None, carries_bank_slices=False)
    return obj


@functools.lru_cache(maxsize=None)
def configure(root: Path):
    """The release's own ``configure_aux_hidden_state_capture`` (None where the release has none)."""
    path = root / PACKAGE / "srt/model_executor/model_runner_components/attention_backend_setup.py"
    if not path.is_file():
        return None
    return module_defs(path, ["configure_aux_hidden_state_capture"])["configure_aux_hidden_state_capture"]


def release_feeds(root: Path, family: str, cell: str, ids, n: int):
    """The HF indices (ascending) the release feeds a ``family`` draft of ``ids`` on ``cell``'s class
    (an ``n``-layer target), by its own dispatch and setters; a string (the exception) where it
    serves none."""
    conf = configure(root)
    if conf is None:
        return "no configure_aux_hidden_state_capture"
    if cell == "deepseek_v41" and not (root / PACKAGE / "srt/configs/deepseek_v41.py").is_file():
        return "no DeepSeek-V4.1 config (configs/deepseek_v41.py): the target does not load"
    file, cls, lm = CELL_CLASSES[cell]
    obj = stand_in(root, file, cls, n)
    inner = obj
    if lm is not None:
        inner = obj.language_model = stand_in(root, *LANGUAGE_MODELS[lm], n)
    try:
        conf(model=obj, eagle_use_aux_hidden_state=False, eagle_aux_hidden_state_layer_ids=None,
             dflash_use_aux_hidden_state=True, dflash_target_layer_ids=list(ids), is_dspark=family == "dspark")
    except (ValueError, AttributeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    shift, taps = CAPTURED[cell]
    stored = inner.model.dspark_layers_to_capture if taps else inner.model.layers_to_capture
    assert stored is not None and inner.capture_aux_hidden_states, (cell, ids)
    if taps:
        assert inner.model.layers_to_capture == []  # a tap model stores no capture indices
    hf = [k + shift for k in stored if 0 <= k < n]  # a tap / capture index the layer loop reaches
    if cell in ("deepseek_v2", "kimi_k25"):
        hf = [i for i in stored if 0 <= i < n]
    return sorted(set(hf))


def table_feeds(release: str, family: str, cell: str, ids, n: int):
    """What the readings table says the release feeds (conventions + guard's reach), or 'not served'."""
    try:
        rule = conventions.draft_rule(release, family, cell)
    except guard.UsageError as exc:
        return "not served: " + exc.problem
    top = n if conventions.DRAFT_REACHES_LAST[cell] else n - 1
    return sorted({h for k, h in zip(ids, conventions.capture(rule, list(ids))) if 0 <= k < n and 0 <= h <= top})


def _id_lists(n: int, count: int, seed: int):
    rnd = random.Random(seed)
    yield from ([k] for k in range(n))  # every single layer, the last one among them
    for _ in range(count):
        ids = rnd.sample(range(n), rnd.choice([1, 2, 3, 5, 6]))
        yield ids if rnd.random() < 0.7 else sorted(ids)


@pytest.mark.parametrize("r", RELEASES)
def test_dflash_and_dspark_cells_match_the_release_s_setters(r):
    """Every (family, model file) cell of the table against the release's own dispatch and setters:
    served exactly where the release serves, and then the same HF indices for 2,000+ id lists per
    cell (every single layer of a 6- and a 61-layer target, the last one among them, and random
    lists in and out of order)."""
    root = fetch.unpacked_release(r, quiet=True)
    bad, served = [], set()
    for family in ("dflash", "dspark"):
        for cell in conventions.CELLS:
            for n in (6, N_BIG):
                for ids in _id_lists(n, 200 if n == 6 else 400, seed=n):
                    got = release_feeds(root, family, cell, ids, n)
                    want = table_feeds(r, family, cell, ids, n)
                    if isinstance(got, str) != isinstance(want, str) or (not isinstance(got, str) and got != want):
                        bad.append((family, cell, n, ids, got, want))
                    if not isinstance(got, str):
                        served.add((family, cell))
    assert not bad, bad[:5]
    declared = {(f, c) for f, cells in conventions.capture_semantics(r)["draft_readings"].items() for c in cells}
    assert served == declared
    print(f"sglang {r} serves DFlash/DSpark on {sorted(served)}")
    assert r == "0.5.9" or len(served) >= 6


def _calls(node, pred) -> list:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and pred(c)]


def _is_layer_call(c: ast.Call) -> bool:
    """``self.layers[i](...)``, ``layer(...)`` or ``self.layers[i].forward_hc_pre_from_prev(...)``."""
    f = c.func
    if isinstance(f, ast.Attribute) and f.attr == "forward_hc_pre_from_prev":
        f = f.value
    return ((isinstance(f, ast.Subscript) and ast.unparse(f.value) == "self.layers")
            or (isinstance(f, ast.Name) and f.id == "layer"))


def _captures_in(stmt, lists: tuple) -> bool:
    """``stmt`` holds an ``if ... i in <list>:`` whose body stores a captured state (``.append``,
    ``.extend``, ``mhc_stream_mean``): a capture after or before the layer, not a materialisation."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.If) and any(
                isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.In) and ast.unparse(c.left) == "i"
                and ast.unparse(c.comparators[0]) in lists for c in ast.walk(node.test)):
            body = ast.Module(body=node.body, type_ignores=[])
            if _calls(body, lambda c: (isinstance(c.func, ast.Name) and c.func.id == "mhc_stream_mean") or (
                    isinstance(c.func, ast.Attribute) and c.func.attr in ("append", "extend")
                    and "aux" in ast.unparse(c.func.value))):
                return True
    return False


def loop_order(fn, lists: tuple) -> list:
    """For each ``for i in range(...)`` loop of ``fn`` that calls a layer: the order, among its
    top-level statements, of the layer call and the capture ('layer', 'capture')."""
    out = []
    for loop in ast.walk(fn):
        if not (isinstance(loop, ast.For) and ast.unparse(loop.target) == "i"):
            continue
        seq = []
        for stmt in loop.body:
            if _calls(stmt, _is_layer_call) and "layer" not in seq:
                seq.append("layer")
            if _captures_in(stmt, lists):
                seq.append("capture")
        if "layer" in seq:
            out.append(seq)
    return out


def _class_def(tree, cls: str, name: str):
    c = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
    return None if c is None else next((f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name), None)


@pytest.mark.parametrize("r", [r for r in RELEASES if conventions.capture_semantics(r).get("draft_readings")])
def test_where_each_model_file_captures(r):
    """Where each model file captures what its DFlash/DSpark setter stored (``CAPTURED``), read from the
    release's forward with ``ast``: deepseek_v2.py hands layer i its capture (the layer's input,
    checked in the layers' own code by ``Release._check_capture_site``) only in the loop over its
    layers, so capture index N (the last layer's output) is never captured; kimi_k3.py and
    deepseek_v4.py capture tap k after layer k runs (or, kimi_k3 0.5.23's standard path, at the
    next layer's input, and for the last layer at the final norm's input); deepseek_v4.py's
    hc_pre_from_prev_sublayer path (0.5.23: DeepSeek-V4.1's default) captures tap k before layer k runs."""
    root = fetch.unpacked_release(r, quiet=True)
    Release._check_capture_site(SimpleNamespace(release=r), root, "decoder_layer")
    models = root / MODELS
    ds = ast.parse((models / "deepseek_v2.py").read_bytes())
    fwd = _class_def(ds, "DeepseekV2Model", "forward")
    uses = [c for c in ast.walk(fwd) if isinstance(c, ast.Attribute) and c.attr == "layers_to_capture"]
    tests = [c for c in ast.walk(fwd) if isinstance(c, ast.Compare) and ast.unparse(c) == "i in self.layers_to_capture"]
    assert len(tests) == 1 and len([u for u in uses if isinstance(u.ctx, ast.Load)]) == 2, ast.unparse(fwd)[:300]
    kw = [k for c in _calls(fwd, _is_layer_call) for k in c.keywords if k.arg == "captured_last_layer_outputs"]
    assert len(kw) == 1 and "i in self.layers_to_capture" in ast.unparse(kw[0].value)
    k25 = ast.parse((models / "kimi_k25.py").read_bytes())
    body = ast.unparse(_class_def(k25, "KimiK25ForConditionalGeneration", "set_dflash_layers_to_capture"))
    assert "self.language_model.set_dflash_layers_to_capture(layer_ids)" in body
    assert _class_def(k25, "KimiK25ForConditionalGeneration", "set_dspark_layers_to_capture") is None

    k3 = ast.parse((models / "kimi_k3.py").read_bytes())
    fwd = _class_def(k3, "KimiK3LinearModel", "forward")
    text = ast.unparse(fwd)
    if "captures_at_input" in text:  # 0.5.23: the standard path at the next layer's input, the bank path after
        assert "captures = self.dspark_layers_to_capture or ()" in text
        layer_kw = [k for c in _calls(fwd, _is_layer_call) for k in c.keywords if k.arg == "capture_gathered"]
        assert len(layer_kw) == 1 and "captures_at_input and i - 1 in captures" in ast.unparse(layer_kw[0].value)
        norm = [k for c in _calls(fwd, lambda c: ast.unparse(c.func).endswith("final_norm")) for k in c.keywords
                if k.arg == "capture"]
        assert len(norm) == 1 and "self.end_layer - 1 in captures" in ast.unparse(norm[0].value)
        assert loop_order(fwd, ("captures",)) == [["layer", "capture"]]  # the bank path: after layer i
        layer = _class_def(k3, "KimiK3DecoderLayer", "forward")
        first = layer.body[0] if not isinstance(layer.body[0], ast.Expr) else layer.body[1]
        assert "self.attn_boundary.prepare(hidden_states, forward_batch, capture_gathered=capture_gathered)" in \
            ast.unparse(first)  # the layer's first step: what it reads in (the stream layer i-1 handed on)
    else:  # 0.5.17: after layer i, the stream it hands on
        assert loop_order(fwd, ("self.dspark_layers_to_capture",)) == [["layer", "capture"]]
        cap = ast.unparse(_class_def(k3, "KimiK3LinearModel", "_dspark_capture_stream"))
        assert "return hidden_states if residual is None else hidden_states + residual" in cap

    v4 = ast.parse((models / "deepseek_v4.py").read_bytes())
    fwd = _class_def(v4, "DeepseekV4Model", "forward")
    impl = _class_def(v4, "DeepseekV4Model", "_forward_impl")
    if impl is not None:  # 0.5.23: forward runs _forward_impl on every path
        assert len(_calls(fwd, lambda c: ast.unparse(c.func) == "self._forward_impl")) == 2
        fwd = impl
    assert loop_order(fwd, ("self.dspark_layers_to_capture",)) == [["layer", "capture"]]
    pre = _class_def(v4, "DeepseekV4Model", "_forward_layers_hc_pre_from_prev")
    readings = conventions.capture_semantics(r)["draft_readings"]["dspark"]
    if pre is None:
        assert "hc_pre_from_prev_sublayer" not in ast.unparse(fwd) and "deepseek_v41" not in readings
    else:
        assert loop_order(pre, ("self.dspark_layers_to_capture",)) == [["capture", "layer"]]
        branch = [n for n in ast.walk(fwd) if isinstance(n, ast.If) and ast.unparse(n.test) == "self.hc_pre_from_prev_sublayer"]
        calls = lambda node: _calls(node, lambda c: ast.unparse(c.func) == "self._forward_layers_hc_pre_from_prev")  # noqa: E731
        # the hc_pre_from_prev path runs exactly when the target's config sets hc_pre_from_prev_sublayer
        assert len(calls(fwd)) == 1 and sum(len(calls(ast.Module(body=b.body, type_ignores=[]))) for b in branch) == 1
        v41 = ast.parse((root / PACKAGE / "srt/configs/deepseek_v41.py").read_bytes())
        cfg = next(n for n in ast.walk(v41) if isinstance(n, ast.ClassDef) and n.name == "DeepseekV41Config")
        assert any(isinstance(s, ast.Assign) and ast.unparse(s) == "hc_pre_from_prev_sublayer = True" for s in cfg.body)
        assert conventions.target_cell(["DeepseekV41ForCausalLM"]) == "deepseek_v41"
        assert conventions.config_cell({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41"}) \
            == "deepseek_v41"
    # EAGLE-3 is no cell of kimi_k3.py or deepseek_v4.py: neither class has its setter
    for file, cls in (("kimi_k3", "KimiK3ForConditionalGeneration"), ("deepseek_v4", "DeepseekV4ForCausalLM")):
        assert "set_eagle3_layers_to_capture" not in _class_methods(root, file, cls)
