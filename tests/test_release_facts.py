"""What the series' hooks outside its hunks rely on in upstream code, checked against the real
source of every release a series covers: the names ``control.UPSTREAM`` and
``identity.REQ_FIELDS`` declare, and the shapes the hooks assume (``ForwardBatch.init_new(cls,
batch, model_runner, ...)``, the batch's ``reqs``, ``lifespan`` starting the warm-up through the
module global ``_wait_and_warmup``, the health probes' request-id prefix). The control: the same
check on a release's source with one of them renamed reports exactly that one."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.fetch import unpacked_release  # noqa: E402
from eaglepatch.overlay import import_package  # noqa: E402
from eaglepatch.series import available_series  # noqa: E402

pkg = import_package("e3c_facts")
control = __import__("e3c_facts.control", fromlist=["UPSTREAM"])
identity = __import__("e3c_facts.identity", fromlist=["REQ_FIELDS"])


def _module_path(root: Path, module: str) -> Path:
    return root / (module.replace(".", "/") + ".py")


def _top(tree: ast.Module) -> dict:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = node
    return out


def _class_names(cls: ast.ClassDef) -> set:
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _self_attributes(fn: ast.FunctionDef) -> set:
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and isinstance(n.ctx, ast.Store)}


def missing_facts(root: Path) -> list:
    """The facts this release's source lacks (an empty list: all hold)."""
    missing = []
    trees = {}
    for module, names in control.UPSTREAM.items():
        path = _module_path(root, module)
        tree = trees[module] = ast.parse(path.read_text())
        top = _top(tree)
        for name in names:
            owner, _, attr = name.partition(".")
            if owner not in top:
                missing.append(f"{module}.{owner}")
            elif attr and (not isinstance(top[owner], ast.ClassDef) or attr not in _class_names(top[owner])):
                missing.append(f"{module}.{name}")
    fbi = _top(trees["sglang.srt.model_executor.forward_batch_info"]).get("ForwardBatch")
    init_new = next((n for n in getattr(fbi, "body", []) if isinstance(n, ast.FunctionDef) and n.name == "init_new"), None)
    if init_new is not None:
        params = [a.arg for a in init_new.args.args[:3]]
        decorated = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in init_new.decorator_list)
        if params != ["cls", "batch", "model_runner"] or not decorated:
            missing.append(f"ForwardBatch.init_new(cls, batch, model_runner) as a classmethod (got {params})")
        if "batch.reqs" not in ast.unparse(init_new) and not _batch_has_reqs(root):
            missing.append("the batch ForwardBatch.init_new takes holds reqs")
    http = _top(trees["sglang.srt.entrypoints.http_server"])
    lifespan = http.get("lifespan")
    if lifespan is not None and "_wait_and_warmup" not in {n.id for n in ast.walk(lifespan) if isinstance(n, ast.Name)}:
        missing.append("lifespan starts the warm-up through the module global _wait_and_warmup")
    app = http.get("app")
    if app is not None and "lifespan=lifespan" not in ast.unparse(app).replace(" ", ""):
        missing.append("app = FastAPI(lifespan=lifespan)")
    src = _module_path(root, "sglang.srt.entrypoints.http_server").read_text()
    consts = root / "sglang/srt/constants.py"
    if not ('rid = f"HEALTH_CHECK_' in src or (consts.exists() and 'HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"' in consts.read_text())):
        missing.append("health probes' request ids start with HEALTH_CHECK")
    fields = [root / "sglang/srt/server_args.py"] + sorted((root / "sglang/srt/arg_groups/fields").glob("*.py"))
    declared = "".join(p.read_text() for p in fields if p.exists())
    missing += [f"ServerArgs.{f}" for f in control.SERVER_ARGS if f"    {f}:" not in declared]
    sb = _top(ast.parse((root / "sglang/srt/managers/schedule_batch.py").read_text()))
    req_init = next((n for n in sb["Req"].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    assigned = _self_attributes(req_init) if req_init else set()
    missing += [f"Req.{f}" for f in identity.REQ_FIELDS if f not in assigned]
    if "hash" not in _class_names(sb["MultimodalDataItem"]):
        missing.append("MultimodalDataItem.hash")
    if "mm_items" not in _class_names(sb["MultimodalInputs"]):
        missing.append("MultimodalInputs.mm_items")
    return missing


def _batch_has_reqs(root: Path) -> bool:
    sb = _top(ast.parse((root / "sglang/srt/managers/schedule_batch.py").read_text()))
    return all("reqs" in _class_names(sb[c]) for c in ("ScheduleBatch", "ModelWorkerBatch") if c in sb)


@pytest.mark.parametrize("release", sorted(available_series()))
def test_every_covered_release_has_what_the_hooks_rely_on(release):
    assert missing_facts(unpacked_release(release, quiet=True)) == []


@pytest.mark.parametrize("release", sorted(available_series()))
def test_the_declared_request_id_carrier_is_the_release_s(release):
    """identity.CARRIES_RIDS says, per release, whether ForwardBatch has a rids field (set from
    the batch's requests): the writer then finds its requests by id, because such releases may
    hand the model a dataclasses.replace copy of the ForwardBatch."""
    root = unpacked_release(release, quiet=True)
    path = _module_path(root, "sglang.srt.model_executor.forward_batch_info")
    fbi = _top(ast.parse(path.read_text()))["ForwardBatch"]
    has = "rids" in _class_names(fbi)
    assert identity.CARRIES_RIDS[release] is has
    if has:
        assert "rids=[req.rid for req in batch.reqs]" in path.read_text()


@pytest.mark.parametrize("what, old, new, reported", [
    ("engine", "    def shutdown(self", "    def shut_down(self", "sglang.srt.entrypoints.engine.Engine.shutdown"),
    ("http", "target=_wait_and_warmup", "target=_warmup_later", "lifespan starts the warm-up"),
    ("req", "self.lora_id = lora_id", "self.adapter = lora_id", "Req.lora_id"),
    ("tm", "    kill_process_tree,\n", "    kill_process_tree as kill_tree,\n", "tokenizer_manager.kill_process_tree"),
])
def test_the_check_reports_a_release_that_lacks_one(tmp_path, what, old, new, reported):
    import shutil

    root = tmp_path / "tree"
    src = unpacked_release("0.5.9", quiet=True)
    files = {"engine": "sglang/srt/entrypoints/engine.py", "http": "sglang/srt/entrypoints/http_server.py",
             "req": "sglang/srt/managers/schedule_batch.py", "tm": "sglang/srt/managers/tokenizer_manager.py"}
    for module in list(control.UPSTREAM) + ["sglang.srt.managers.schedule_batch", "sglang.srt.server_args"]:
        rel = module.replace(".", "/") + ".py"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    target = root / files[what]
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new))
    got = missing_facts(root)
    assert len(got) == 1 and reported in got[0], got


settings_facts = sys.modules["e3c_facts.settings"]


def release_fact_problems(release: str, root: Path) -> list:
    """Where settings.RELEASE_FACTS[release] disagrees with the release's own source."""
    facts = settings_facts.RELEASE_FACTS[release]
    problems = []
    runner = (root / "sglang/srt/model_executor/model_runner.py").read_text()
    on_runner = "self.eagle_use_aux_hidden_state =" in runner and "self.eagle_aux_hidden_state_layer_ids =" in runner
    if facts["draft_ids_on_runner"] != on_runner:
        problems.append(f"draft_ids_on_runner {facts['draft_ids_on_runner']}, the source says {on_runner}")
    mark = facts["allreduce_fusion_mark"]
    layers = "".join(p.read_text() for p in sorted((root / "sglang/srt/layers").rglob("*.py")))
    if mark is not None and f"hidden_states.{mark}" not in layers:
        problems.append(f"allreduce_fusion_mark {mark!r} is not what the release's layers read")
    if mark is None and "hidden_states._sglang_needs_allreduce_fusion" in layers:
        problems.append("allreduce_fusion_mark None, but the release's layers defer all-reduces by a mark")
    view = facts["resolving_view"]
    arg_groups = sorted((root / "sglang/srt/arg_groups").rglob("*.py"))
    defines = {p.relative_to(root).with_suffix("").as_posix().replace("/", ".") + ".resolving_view"
               for p in arg_groups if "\ndef resolving_view(" in p.read_text()}
    if (view is None and defines) or (view is not None and view not in defines):
        problems.append(f"resolving_view {view!r}, the source defines {sorted(defines)}")
    # every draft setter of deepseek_v2.py other than EAGLE-3's is one the package follows (a release
    # adding a family's setter fails here until the package follows it), setting layers_to_capture
    # from the ids as the declared reading says
    model = (root / "sglang/srt/models/deepseek_v2.py").read_text()
    setters = set(re.findall(r"\n    def (set_\w+_layers_to_capture)\(", model)) - {"set_eagle3_layers_to_capture"}
    if setters != set(facts["draft_setters"]):
        problems.append(f"draft_setters {sorted(facts['draft_setters'])}, the source defines {sorted(setters)}")
    body = model.split("def set_dflash_layers_to_capture", 1)[-1].split("\n    def ", 1)[0]
    if setters and "self.model.layers_to_capture = [val + 1 for val in layer_ids]" not in body:
        problems.append("set_dflash_layers_to_capture no longer sets layers_to_capture = [val + 1 ...]")
    if setters and not all(facts["draft_readings"].get(f) == "plus_one" for f in ("dflash", "dspark")):
        problems.append(f"draft_readings {facts['draft_readings']}, deepseek_v2.py's setter sets [val + 1 ...]")
    fields = [root / "sglang/srt/server_args.py"] + sorted((root / "sglang/srt/arg_groups/fields").glob("*.py"))
    declared = "".join(p.read_text() for p in fields if p.exists())
    problems += [f"absent field {f} is declared" for f in facts["absent_fields"] if f"\n    {f}:" in declared]
    return problems


@pytest.mark.parametrize("release", sorted(available_series()))
def test_release_facts_match_the_release_s_source(release):
    assert release_fact_problems(release, unpacked_release(release, quiet=True)) == []


def test_release_facts_check_fails_on_another_release_s_facts(monkeypatch):
    """The control: 0.5.23's facts read against 0.5.9's source disagree on every declared point."""
    facts_059 = settings_facts.RELEASE_FACTS["0.5.9"]
    monkeypatch.setitem(settings_facts.RELEASE_FACTS, "0.5.9", settings_facts.RELEASE_FACTS["0.5.23"])
    got = release_fact_problems("0.5.9", unpacked_release("0.5.9", quiet=True))
    assert {g.split()[0] for g in got} >= {"draft_ids_on_runner", "allreduce_fusion_mark", "resolving_view"}, got
    monkeypatch.setitem(settings_facts.RELEASE_FACTS, "0.5.17", facts_059)
    got = release_fact_problems("0.5.17", unpacked_release("0.5.17", quiet=True))
    assert any(g.startswith("draft_setters") for g in got), got  # 0.5.17 sets DFlash's capture itself
