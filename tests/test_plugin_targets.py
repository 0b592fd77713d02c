"""The plugin's hook targets (issue 47 items 3 and 5): ``sglang-plugin/targets.py`` checks every
target BY MEANING on the real source of 0.5.17 and 0.5.23, and ``tools/verify.py --plugin`` reports
it. The controls: on a copy of each release with one target renamed (each in turn) or one meaning
broken (the pipeline guard removed, load_model moved after init_attention_backends, the
``self.model(...)`` call changed, ...), verify --plugin exits 1 naming exactly that target and no
other. The command line: one line and exit 2 for bad input (a release the plugin does not cover
names what to use), no traceback, nothing written but --json, a warning when SGLANG_PLUGINS would
keep sglang from loading the plugin."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, copy_installed, hashes, one_line_error, run_tool, series_files

from eaglepatch.fetch import unpacked_release
from eaglepatch.plugin_check import load_targets

targets = load_targets()
RELEASES = list(targets.RELEASES)
MODULES = [targets.SERVER_ARGS, targets.ENGINE, targets.MODEL_RUNNER, targets.DEEPSEEK, targets.KIMI,
           targets.PLUGINS + ".__init__", targets.HOOK_REGISTRY, targets.SCHEDULER]
FILES = [m.replace(".", "/") + ".py" for m in MODULES]


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param, unpacked_release(request.param, quiet=True)


def _copy(src: Path, dest: Path) -> Path:
    """The release's dist-info, top-level files, the target modules and every model file."""
    models = sorted(str(p.relative_to(src)) for p in (src / "sglang/srt/models").glob("*.py"))
    return copy_installed(src, dest, FILES + models)


# ---------------------------------------------------------------------------------------------
# edits located with ast on the release's own source (line numbers differ between releases)

def _file(root: Path, module: str) -> Path:
    p = root.joinpath(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _node(root: Path, module: str, cls: str | None, name: str):
    tree = ast.parse(_file(root, module).read_text())
    scope = tree.body
    if cls:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name][-1]


def _lines(root, module):
    return _file(root, module).read_text().split("\n")


def _write(root, module, lines):
    _file(root, module).write_text("\n".join(lines))


def rename_def(module, cls, name, new):
    def edit(root):
        node = _node(root, module, cls, name)
        lines = _lines(root, module)
        assert f"def {name}(" in lines[node.lineno - 1]
        lines[node.lineno - 1] = lines[node.lineno - 1].replace(f"def {name}(", f"def {new}(")
        _write(root, module, lines)
    return edit


def rename_attr_in_class(module, cls, attr, new):
    def edit(root):
        node = _node(root, module, None, cls)
        lines = _lines(root, module)
        for i in range(node.lineno - 1, node.end_lineno):
            lines[i] = re.sub(rf"\bself\.{attr}\b", f"self.{new}", lines[i])
        _write(root, module, lines)
    return edit


def _statement(root, module, cls, fn, pick):
    """The first statement of fn (in cls) for which pick(stmt) holds, walking nested blocks."""
    node = _node(root, module, cls, fn)
    return next(s for s in ast.walk(node) if isinstance(s, ast.stmt) and s is not node and pick(s))


def _is_call_stmt(name, on="self"):
    def pick(s):
        return (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, (ast.Attribute, ast.Name))
                and (s.value.func.attr if isinstance(s.value.func, ast.Attribute) else s.value.func.id) == name)
    return pick


def remove_statement(module, cls, fn, pick):
    def edit(root):
        s = _statement(root, module, cls, fn, pick)
        lines = _lines(root, module)
        indent = lines[s.lineno - 1][:len(lines[s.lineno - 1]) - len(lines[s.lineno - 1].lstrip())]
        lines[s.lineno - 1: s.end_lineno] = [indent + "pass"]
        _write(root, module, lines)
    return edit


def insert_before(module, cls, fn, pick, code):
    def edit(root):
        s = _statement(root, module, cls, fn, pick)
        lines = _lines(root, module)
        indent = lines[s.lineno - 1][:len(lines[s.lineno - 1]) - len(lines[s.lineno - 1].lstrip())]
        lines.insert(s.lineno - 1, indent + code)
        _write(root, module, lines)
    return edit


def move_load_model_after_backends(root):
    """load_model leaves initialize() and becomes the last statement of init_attention_backends()."""
    mr = targets.MODEL_RUNNER
    backends = _node(root, mr, "ModelRunner", "init_attention_backends")
    lines = _lines(root, mr)
    last = backends.body[-1]
    indent = lines[last.lineno - 1][:len(lines[last.lineno - 1]) - len(lines[last.lineno - 1].lstrip())]
    lines.insert(last.end_lineno, indent + "self.load_model()")
    _write(root, mr, lines)
    remove_statement(mr, "ModelRunner", "initialize", _is_call_stmt("load_model"))(root)


def call_model_forward(root):
    """DeepseekV2ForCausalLM.forward calls self.model.forward(...) instead of self.model(...)."""
    node = _node(root, targets.DEEPSEEK, "DeepseekV2ForCausalLM", "forward")
    lines = _lines(root, targets.DEEPSEEK)
    i = next(i for i in range(node.lineno - 1, node.end_lineno) if "= self.model(" in lines[i])
    lines[i] = lines[i].replace("= self.model(", "= self.model.forward(")
    _write(root, targets.DEEPSEEK, lines)


def override_in_subclass(root):
    """DeepseekV3ForCausalLM defines its own set_eagle3_layers_to_capture."""
    node = _node(root, targets.DEEPSEEK, None, "DeepseekV3ForCausalLM")
    lines = _lines(root, targets.DEEPSEEK)
    lines.insert(node.end_lineno, "\n    def set_eagle3_layers_to_capture(self, layer_ids=None):\n"
                                  "        self.model.layers_to_capture = list(layer_ids or [])\n")
    _write(root, targets.DEEPSEEK, lines)


def _is_guard(s):
    return isinstance(s, ast.If) and "is_last_rank" in ast.unparse(s.test)


def _is_unpack(s):
    return isinstance(s, ast.Assign) and any(isinstance(t, ast.Tuple) for t in s.targets) \
        and isinstance(s.value, ast.Name)


D, MR, K = targets.DEEPSEEK, targets.MODEL_RUNNER, targets.KIMI
RENAMED = {  # each declared target renamed in turn
    targets.TARGETS[0].path: rename_def(targets.PLUGINS, None, "load_plugins", "load_general_plugins"),
    targets.TARGETS[1].path: rename_def(targets.SERVER_ARGS, "ServerArgs", "check_server_args", "validate"),
    targets.TARGETS[2].path: rename_def(MR, "ModelRunner", "load_model", "load_model_weights"),
    targets.TARGETS[3].path: rename_def(D, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture", "set_aux_layers"),
    targets.TARGETS[4].path: rename_def(D, "DeepseekV2ForCausalLM", "forward", "forward_model"),
    targets.TARGETS[5].path: rename_attr_in_class(D, "DeepseekV2Model", "norm", "final_layernorm"),
    targets.TARGETS[6].path: rename_def(K, "KimiK25ForConditionalGeneration", "set_eagle3_layers_to_capture",
                                        "set_aux_layers"),
}
BROKEN = {  # meaning broken, the name kept: (edit, the target that must be reported)
    "pp guard removed": (remove_statement(D, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture", _is_guard),
                         targets.TARGETS[3].path),
    "init_attention_backends before load_model": (
        insert_before(MR, "ModelRunner", "initialize", _is_call_stmt("load_model"), "self.init_attention_backends()"),
        targets.TARGETS[2].path),
    "load_model moved after init_attention_backends": (move_load_model_after_backends, targets.TARGETS[2].path),
    "self.model.forward(...) instead of self.model(...)": (call_model_forward, targets.TARGETS[4].path),
    "result of self.model(...) no longer unpacked": (
        remove_statement(D, "DeepseekV2ForCausalLM", "forward", _is_unpack), targets.TARGETS[4].path),
    "a subclass overrides set_eagle3_layers_to_capture": (override_in_subclass, targets.TARGETS[3].path),
    "check_server_args before load_plugins in the launcher": (
        remove_statement(targets.ENGINE, "Engine", "_launch_subprocesses", _is_call_stmt("load_plugins")),
        targets.TARGETS[1].path),
    "scheduler loads no plugins": (
        remove_statement(targets.SCHEDULER, None, "run_scheduler_process", _is_call_stmt("load_plugins")),
        targets.TARGETS[0].path),
}


def test_every_declared_target_has_a_rename_control():
    assert sorted(RENAMED) == sorted(t.path for t in targets.TARGETS)
    assert {t.kind for t in targets.TARGETS} <= {"after", "around", "forward hook", "delegates", "loader"}
    assert all(t.check is not None and t.requires for t in targets.TARGETS)


def test_the_targets_hold_on_the_real_releases(release):
    rel, root = release
    results = targets.check_tree(root, rel)
    assert [(t.path, p) for t, p in results if p] == []
    assert [t.path for t, _ in results] == [t.path for t in targets.TARGETS]
    assert targets.problems_in_tree(root) == []  # the release read from the tree itself
    r = run_tool("verify", "--plugin", root)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert sum(ln.endswith(": ok") for ln in lines) == len(targets.TARGETS), r.stdout
    assert f"{len(targets.TARGETS)} of {len(targets.TARGETS)} targets hold" in r.stdout and r.stderr == ""


def test_the_installed_sglang_is_the_default(release, tmp_path):
    """No ROOT: the sglang this Python imports (found, never imported); problems_installed() is
    what the plugin's register() calls there."""
    rel, src = release
    site = _copy(src, tmp_path / "site")
    env = {"PYTHONPATH": str(site)}
    r = run_tool("verify", "--plugin", env=env)
    assert r.returncode == 0 and f"sglang {rel}" in r.stdout and "imports" in r.stdout, r.stdout + r.stderr
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import targets; print(targets.problems_installed()); "
            "print('sglang' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, str(REPO / "sglang-plugin")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(site)))
    assert p.stdout.split() == ["[]", "False"], p.stdout + p.stderr


def _drifted(r) -> list:
    return [ln.strip().split(" (", 1)[0] for ln in r.stdout.splitlines() if ": drifted: " in ln]


@pytest.mark.parametrize("target", sorted(RENAMED))
def test_a_renamed_target_is_reported_alone(release, tmp_path, target):
    rel, src = release
    root = _copy(src, tmp_path / "tree")
    before = hashes(root)
    RENAMED[target](root)
    assert hashes(root) != before
    r = run_tool("verify", "--plugin", root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert _drifted(r) == [target], r.stdout
    assert "Traceback" not in r.stderr and "error:" not in r.stderr


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_meaning_is_reported_alone(release, tmp_path, what):
    rel, src = release
    root = _copy(src, tmp_path / "tree")
    edit, target = BROKEN[what]
    edit(root)
    for f in FILES:  # the edit leaves valid Python: the check must see the meaning, not a parse error
        ast.parse((root / f).read_text())
    r = run_tool("verify", "--plugin", root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert _drifted(r) == [target], r.stdout
    problems = targets.problems_in_tree(root)
    assert len(problems) >= 1 and all(p.startswith(target + ": ") for p in problems), problems


def test_the_json_report(release, tmp_path):
    rel, src = release
    root = _copy(src, tmp_path / "tree")
    RENAMED[targets.TARGETS[2].path](root)
    out = tmp_path / "r.json"
    r = run_tool("verify", "--plugin", root, "--json", out)
    assert r.returncode == 1
    rep = json.loads(out.read_text())
    assert rep["mode"] == "plugin" and rep["release"] == rel and rep["exit_code"] == 1
    bad = [t for t in rep["targets"] if not t["ok"]]
    assert [t["path"] for t in bad] == [targets.TARGETS[2].path] and bad[0]["kind"] == "after"
    assert bad[0]["hook"] == "configure_runner" and "load_model" in bad[0]["problems"][0]


# ---------------------------------------------------------------------------------------------
# the command line

@pytest.fixture(scope="module")
def covered(tmp_path_factory):
    return _copy(unpacked_release(RELEASES[-1], quiet=True), tmp_path_factory.mktemp("cov") / "site")


def _quiet_run(tmp_path, *args, env=None):
    """verify in an empty working directory: what it writes is what appears there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    r = run_tool("verify", *args, env=env, cwd=cwd)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return r, sorted(p.name for p in cwd.iterdir())


@pytest.mark.parametrize("case", ["0.5.9", "0.5.10", "missing", "a file", "no sglang", "series", "json dir",
                                  "json missing dir", "smoke bogus", "smoke import", "work exists",
                                  "work without functional", "work without plugin"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, covered, release_059, release_0510, case):
    before = hashes(covered)
    args = {
        "0.5.9": [release_059], "0.5.10": [release_0510], "missing": [tmp_path / "nope"],
        "a file": [REPO / "README.md"], "no sglang": [tmp_path],
        "series": [covered, "--series", REPO / "patches" / f"sglang-{RELEASES[-1]}"],
        "json dir": [covered, "--json", tmp_path], "json missing dir": [covered, "--json", tmp_path / "no" / "r.json"],
        "smoke bogus": [covered, "--smoke", "bogus"], "smoke import": [covered, "--smoke", "import"],
        "work exists": [covered, "--smoke", "functional", "--smoke-work", tmp_path],
        "work without functional": [covered, "--smoke-work", tmp_path / "w"],
        "work without plugin": [],
    }[case]
    if case == "work without plugin":
        r, made = _quiet_run(tmp_path, covered, "--smoke-work", tmp_path / "w")
    else:
        r, made = _quiet_run(tmp_path, "--plugin", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    if case in ("series", "smoke bogus", "work without plugin"):  # argparse's usage error
        assert r.stderr.startswith("usage:") and r.stderr.count("error:") == 1, r.stderr
    else:
        line = one_line_error(r)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
        if case == "0.5.9":
            assert "sglang 0.5.9 is not a release the plugin covers" in line and "sglang-0.5.9" in line
            assert "apply.py" in line, line
        if case in ("smoke import", "work without functional"):
            assert "--smoke functional" in line, line
        if case == "work exists":
            assert "already exists" in line, line
        if case == "0.5.10":
            assert "port.py --from 0.5.9 --to 0.5.10" in line and " or ".join(RELEASES) in line, line
    assert made == [] and hashes(covered) == before


def test_no_importable_sglang_is_one_line(tmp_path):
    r, made = _quiet_run(tmp_path, "--plugin", env={"PYTHONPATH": ""})
    if "is importable" not in r.stderr and r.returncode == 0:
        pytest.skip("this test environment imports an sglang")
    assert r.returncode == 2 and "no sglang is importable" in one_line_error(r) and made == []


def test_a_patched_tree_is_refused(tmp_path):
    """The plugin refuses to load beside a series (two deliveries at once): verify says so, exit 1."""
    rel = RELEASES[0]
    series = REPO / "patches" / f"sglang-{rel}"
    src = unpacked_release(rel, quiet=True)
    root = copy_installed(src, tmp_path / "tree", sorted(set(FILES + series_files(series))))
    assert run_tool("apply", root, "--series", series).returncode == 0
    r, made = _quiet_run(tmp_path, "--plugin", root)
    assert r.returncode == 1 and "patched with an eaglepatch series" in one_line_error(r), r.stderr
    assert made == []


@pytest.mark.parametrize("value, warned", [("", False), ("eaglepatch_capture", False),
                                           ("other, eaglepatch_capture", False), ("other", True),
                                           (",", True), ("eaglepatch-capture", True)])
def test_sglang_plugins_without_ours_is_warned(tmp_path, covered, value, warned):
    """sglang loads only the entry points SGLANG_PLUGINS names when it is set (and non-empty):
    our name missing means no hook and no dump, with only an INFO log from sglang."""
    r, made = _quiet_run(tmp_path, "--plugin", covered, env={"SGLANG_PLUGINS": value})
    assert r.returncode == 0 and made == [], r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == int(warned), r.stderr
    if warned:
        assert "eaglepatch_capture" in warnings[0] and "unset SGLANG_PLUGINS" in warnings[0]
        assert targets.plugins_env_problem({"SGLANG_PLUGINS": value}) in warnings[0]


def test_a_drifted_tree_runs_no_smoke(tmp_path, covered):
    """The smoke goes through the plugin only where its register() would let it load."""
    root = tmp_path / "tree"
    shutil.copytree(covered, root)
    RENAMED[targets.TARGETS[3].path](root)
    r, made = _quiet_run(tmp_path, "--plugin", root, "--smoke", "functional")
    assert r.returncode == 1 and _drifted(r) == [targets.TARGETS[3].path], r.stdout + r.stderr
    assert "smoke" not in r.stdout + r.stderr and made == []


def test_the_smoke_runs_through_the_plugin(plugin_cli_smoke):
    """--smoke functional: the wheel built from this checkout, installed in a temporary directory,
    and the smoke's engine checks (sglang.Engine and launch_server, DeepSeek-V3 and Kimi-K2.5,
    against the Hugging Face reference) on the unmodified release through sglang's own loader;
    the tree is only read, nothing appears in the working directory, and --smoke-work keeps the
    work directory (tests/test_plugin.py compares its dump files with the series')."""
    run = plugin_cli_smoke
    r = run.proc
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-3000:]
    rep = json.loads(run.json.read_text())
    names = [s["name"] for s in rep["smoke"]]
    assert len(names) >= 4 and all(s["passed"] for s in rep["smoke"]), rep["smoke"]
    assert any("Kimi-K2.5" in n for n in names) and any("launch_server" in n for n in names), names
    assert sum(ln.startswith("  smoke ") for ln in r.stdout.splitlines()) == len(names)
    assert run.made == [] and run.tree_unchanged
    assert (run.work / "smoke" / "engine").is_dir() and list((run.work / "site").glob("eaglepatch_capture*"))


def test_it_runs_with_a_python_that_has_no_dependencies(tmp_path, covered):
    """The check reads source with the standard library only: the server environment's Python can
    run it before (or without) pip install -e . of this checkout."""
    from test_cli_properties import _venv

    py = _venv(tmp_path / "venv")
    p = subprocess.run([str(py), str(REPO / "tools" / "verify.py"), "--plugin", str(covered)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and f"{len(targets.TARGETS)} of {len(targets.TARGETS)} targets hold" in p.stdout, p.stderr


def test_series_mode_is_unchanged_without_root(tmp_path):
    r, _ = _quiet_run(tmp_path)
    assert r.returncode == 2 and "the following arguments are required: ROOT" in r.stderr


def test_the_targets_module_is_stdlib_only():
    """It runs inside the server's environment: no eaglepatch, no third-party import."""
    tree = ast.parse((REPO / "sglang-plugin" / "targets.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], "relative import"
