"""The plugin's hook targets in SGLang, declared per release, and their checks BY MEANING.

HookRegistry resolves its targets by dotted path when the hooks are applied and only logs one it
cannot resolve: a renamed or reshaped target gives a running server without our hook, and so no
dump and no error. So every target the plugin relies on is declared here with what the plugin
needs of it, and checked on the release's SOURCE (ast; no target module is ever imported to
check it): that the method exists with the shape the hook needs, and that the code around it
still calls it where and when the capture needs it to run.

Stdlib only: this module ships in the plugin wheel (``eaglepatch_capture.targets``, called by
``register()`` in every process that loads the plugin) and runs from the repository
(``tools/verify.py --plugin``).

  ``TARGETS``                          the declared targets (path, kind, hook, what is required)
  ``TARGETS_BY_RELEASE``               release -> its targets (the releases the plugin covers)
  ``problems_installed()``             one line per missing/drifted target of the importable sglang
  ``problems_in_tree(package_parent)`` the same for the ``sglang/`` under a directory
  ``check_tree(package_parent, release)`` -> [(Target, [problems])], a verdict per target
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

PLUGIN_GROUP = "sglang.srt.plugins"  # the entry-point group sglang's load_plugins() reads
ENTRY_POINT = "eaglepatch_capture"  # our entry point's name: what SGLANG_PLUGINS must list when set

SERVER_ARGS = "sglang.srt.server_args"
ENGINE = "sglang.srt.entrypoints.engine"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
DEEPSEEK = "sglang.srt.models.deepseek_v2"
KIMI = "sglang.srt.models.kimi_k25"
PLUGINS = "sglang.srt.plugins"
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry"
SCHEDULER = "sglang.srt.managers.scheduler"


@dataclass(frozen=True)
class Target:
    """One place in SGLang the plugin hooks or relies on.

    path: the dotted path (for ``after``/``around``, the string given to HookRegistry.register);
    kind: ``after`` / ``around`` (HookRegistry hook types), ``forward hook`` (a torch module hook
    the overlay registers on an instance), ``delegates`` (reached through another target),
    ``loader`` (what makes the hooks run at all); hook: the overlay function it runs;
    requires: what the check below requires, in words."""

    path: str
    kind: str
    hook: Optional[str]
    requires: str
    check: Callable = field(default=None, repr=False, compare=False)  # (Source) -> [problem lines]

    def label(self) -> str:
        return f"{self.path} ({self.kind}{' -> ' + self.hook if self.hook else ''})"


# --------------------------------------------------------------------------------------------
# reading the release's source

class Source:
    """The modules of one sglang tree, parsed once each (never imported)."""

    def __init__(self, package_parent: Path):
        self.pp = Path(package_parent)
        self._trees: dict = {}

    def path(self, module: str) -> Path:
        p = self.pp.joinpath(*module.split("."))
        return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")

    def module(self, module: str) -> ast.Module:
        """The parsed module; raises Missing naming it when absent or unparsable."""
        if module not in self._trees:
            p = self.path(module)
            try:
                text = p.read_bytes()
            except OSError:
                self._trees[module] = Missing(f"module {module} is missing ({p.relative_to(self.pp)} not found)")
            else:
                try:
                    self._trees[module] = ast.parse(text, filename=str(p))
                except (SyntaxError, ValueError) as exc:
                    self._trees[module] = Missing(f"module {module} does not parse ({exc.__class__.__name__})")
        tree = self._trees[module]
        if isinstance(tree, Missing):
            raise tree
        return tree

    def cls(self, module: str, name: str) -> ast.ClassDef:
        for node in _top_level(self.module(module)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise Missing(f"{module}.{name} is missing (no class {name})")

    def function(self, module: str, name: str) -> ast.FunctionDef:
        for node in _top_level(self.module(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise Missing(f"{module}.{name} is missing (no function {name})")

    def method(self, module: str, cls: str, name: str, plain: bool = True) -> ast.FunctionDef:
        """The method ``name`` defined in the class body; plain: an instance method (no
        staticmethod, classmethod or property) whose first parameter is self."""
        c = self.cls(module, cls)
        defs = [n for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        if not defs:
            raise Missing(f"{module}.{cls}.{name} is missing (no method {name} in class {cls})")
        fn = defs[-1]  # the last definition wins, as in the class
        if plain:
            decos = {_name(d) for d in fn.decorator_list}
            if decos & {"staticmethod", "classmethod", "property"}:
                raise Missing(f"{module}.{cls}.{name} is a {sorted(decos & {'staticmethod', 'classmethod', 'property'})[0]}"
                              ", not a method of the instance")
            if _params(fn)[:1] != ["self"]:
                raise Missing(f"{module}.{cls}.{name} does not take self first (takes {_params(fn)})")
        return fn


class Missing(Exception):
    """A target or what it needs is not in the source: the message is the problem line."""


def _top_level(tree: ast.Module):
    """Module-level statements, including those under a top-level if/try (release guards)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, ast.If):
            stack[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack[:0] = node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]


def _name(node) -> str:
    """The last name of a decorator / callee: ``x``, ``a.b.x`` and ``x(...)`` -> ``x``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _params(fn) -> list:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


def _is_self_attr(node, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _calls(fn):
    """Every call inside fn (nested defs excluded), in source order."""
    out = []

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Call):
                out.append(child)
            walk(child)

    walk(fn)
    return sorted(out, key=lambda c: (c.lineno, c.col_offset))


def _self_calls(fn, name: str) -> list:
    """Calls ``self.name(...)`` in fn."""
    return [c for c in _calls(fn) if _is_self_attr(c.func, name)]


def _body(fn) -> list:
    """fn's statements without a leading docstring."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _self_assigns(fn, attr: str) -> list:
    """Values assigned to ``self.attr`` in fn (nested defs excluded)."""
    out = []

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Assign) and any(_is_self_attr(t, attr) for t in child.targets):
                out.append(child.value)
            elif isinstance(child, ast.AnnAssign) and _is_self_attr(child.target, attr) and child.value is not None:
                out.append(child.value)
            walk(child)

    walk(fn)
    return out


# --------------------------------------------------------------------------------------------
# the checks, one per target: each returns its problems (an empty list: the target holds)

def _check_server_args(src: Source) -> list:
    problems = []
    src.method(SERVER_ARGS, "ServerArgs", "check_server_args")
    launch = src.method(ENGINE, "Engine", "_launch_subprocesses", plain=False)
    calls = _calls(launch)
    checks = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "check_server_args"]
    loads = [c for c in calls if _name(c) == "load_plugins"]
    if len(checks) != 1:
        problems.append(f"{ENGINE}.Engine._launch_subprocesses calls server_args.check_server_args() "
                        f"{len(checks)} times, not once (the launcher's check_launch runs there)")
    elif not loads or (loads[0].lineno, loads[0].col_offset) > (checks[0].lineno, checks[0].col_offset):
        problems.append(f"{ENGINE}.Engine._launch_subprocesses no longer calls load_plugins() before "
                        "check_server_args() (the hook would not be applied yet in the launcher)")
    others = _callers_elsewhere(src, "check_server_args", skip=ENGINE)
    if others:
        problems.append("check_server_args() is also called from " + ", ".join(others)
                        + " (check_launch must run once, in the launching process)")
    return problems


def _callers_elsewhere(src: Source, method: str, skip: str) -> list:
    """Modules under sglang/ other than `skip` that call ``<x>.method(`` (text first, then ast)."""
    needle = f".{method}(".encode()
    pkg = src.pp / "sglang"
    out = []
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if needle not in data:
                continue
            module = ".".join(p.relative_to(src.pp).with_suffix("").parts)
            if module == skip:
                continue
            try:
                tree = ast.parse(data)
            except (SyntaxError, ValueError):
                continue
            if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == method
                   for c in ast.walk(tree)):
                out.append(module)
    return out


# what must not run before the runner's capture is configured: set_eagle3_layers_to_capture is
# reached through configure_aux_hidden_state_capture (init_attention_backends), and graphs after it
_BEFORE_BACKENDS = ("init_attention_backends", "configure_aux_hidden_state_capture", "init_device_graphs")


def _check_load_model(src: Source) -> list:
    problems = []
    src.method(MODEL_RUNNER, "ModelRunner", "load_model")
    init = src.method(MODEL_RUNNER, "ModelRunner", "initialize")
    loads = _self_calls(init, "load_model")
    if len(loads) != 1:
        problems.append(f"{MODEL_RUNNER}.ModelRunner.initialize calls self.load_model() {len(loads)} times, not once")
    ctor = src.method(MODEL_RUNNER, "ModelRunner", "__init__")
    if not _self_calls(ctor, "initialize"):
        problems.append(f"{MODEL_RUNNER}.ModelRunner.__init__ no longer calls self.initialize()")
    # the construction order, self.method() calls expanded depth first: nothing that configures
    # the capture's layers or records graphs may come before load_model
    cls = src.cls(MODEL_RUNNER, "ModelRunner")
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    order: list = []
    seen = set()

    def expand(fn):
        for c in _calls(fn):
            name = _name(c)
            if isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name) and c.func.value.id == "self" \
                    and name in methods:
                order.append(name)
                if name not in seen and name != "load_model":
                    seen.add(name)
                    expand(methods[name])
            elif name in _BEFORE_BACKENDS:
                order.append(name)

    expand(ctor)
    if "load_model" in order:
        early = [n for n in order[:order.index("load_model")] if n in _BEFORE_BACKENDS]
        if early:
            problems.append(f"{MODEL_RUNNER}.ModelRunner calls {early[0]}() before load_model() while it is built "
                            "(configure_runner must run before the capture's layers are set and graphs recorded)")
    elif loads:
        problems.append(f"{MODEL_RUNNER}.ModelRunner.__init__ no longer reaches load_model() through initialize()")
    return problems


def _check_set_eagle3(src: Source) -> list:
    problems = []
    fn = src.method(DEEPSEEK, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture")
    if _params(fn)[:2] != ["self", "layer_ids"]:
        problems.append(f"{DEEPSEEK}.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture takes {_params(fn)}, "
                        "not (self, layer_ids, ...)")
    body = _body(fn)
    first = body[0] if body else None
    guard = (isinstance(first, ast.If) and not first.orelse
             and isinstance(first.test, ast.UnaryOp) and isinstance(first.test.op, ast.Not)
             and isinstance(first.test.operand, ast.Attribute) and first.test.operand.attr == "is_last_rank"
             and _is_self_attr(first.test.operand.value, "pp_group")
             and len(first.body) == 1 and isinstance(first.body[0], ast.Return)
             and (first.body[0].value is None
                  or (isinstance(first.body[0].value, ast.Constant) and first.body[0].value.value is None)))
    if not guard:
        problems.append(f"{DEEPSEEK}.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture no longer starts with "
                        "`if not self.pp_group.is_last_rank: return` (the pipeline guard the around hook keeps)")
    over = _overrides(src, "DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture")
    if over:
        problems.append(f"{', '.join(over)} override(s) set_eagle3_layers_to_capture (the hook on "
                        "DeepseekV2ForCausalLM would not run for them)")
    return problems


_CLASS_RE = re.compile(rb"^class\s+(\w+)\s*\(([^)]*)\)\s*:", re.M)


def _overrides(src: Source, base: str, method: str) -> list:
    """Classes under sglang/srt/models/ deriving from `base` (by name, transitively) that define
    `method` themselves. Class headers are read from the text of every model file; only the files
    that name `method` are parsed."""
    key = ("overrides", base, method)
    if key in src._trees:
        return src._trees[key]
    models = src.pp / "sglang" / "srt" / "models"
    bases, holders = {}, []  # class -> base names; files that mention the method
    for p in sorted(models.glob("*.py")) if models.is_dir() else ():
        try:
            data = p.read_bytes()
        except OSError:
            continue
        for m in _CLASS_RE.finditer(data):
            names = [b.strip().split(b"[")[0].rsplit(b".", 1)[-1].decode("ascii", "replace")
                     for b in m.group(2).split(b",") if b.strip() and b"=" not in b]
            bases.setdefault(m.group(1).decode("ascii", "replace"), names)
        if method.encode() in data:
            holders.append((p, data))
    derived = {base}
    changed = True
    while changed:
        changed = False
        for name, bs in bases.items():
            if name not in derived and derived.intersection(bs):
                derived.add(name)
                changed = True
    out = []
    for p, data in holders:
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef) and node.name in derived - {base} and any(
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method for n in node.body):
                out.append(f"sglang.srt.models.{p.stem}.{node.name}")
    src._trees[key] = sorted(out)
    return src._trees[key]


def _check_forward(src: Source) -> list:
    problems = []
    where = f"{DEEPSEEK}.DeepseekV2ForCausalLM"
    init = src.method(DEEPSEEK, "DeepseekV2ForCausalLM", "__init__")
    if not any(_name(v) == "DeepseekV2Model" for v in _self_assigns(init, "model")):
        problems.append(f"{where}.__init__ no longer sets self.model = DeepseekV2Model(...) (the module the "
                        "forward hook is registered on)")
    fn = src.method(DEEPSEEK, "DeepseekV2ForCausalLM", "forward")
    inner = src.method(DEEPSEEK, "DeepseekV2Model", "forward")
    if _params(inner)[:4] != ["self", "input_ids", "positions", "forward_batch"]:
        problems.append(f"{DEEPSEEK}.DeepseekV2Model.forward takes {_params(inner)}, not (self, input_ids, "
                        "positions, forward_batch, ...) (the forward hook reads forward_batch as its third argument)")
    calls = [c for c in _calls(fn) if _is_self_attr(c.func, "model")]
    bypass = [c for c in _calls(fn) if isinstance(c.func, ast.Attribute) and c.func.attr == "forward"
              and _is_self_attr(c.func.value, "model")]
    if bypass:
        problems.append(f"{where}.forward calls self.model.forward(...) (module hooks do not run)")
    if len(calls) != 1:
        problems.append(f"{where}.forward calls self.model(...) {len(calls)} times, not once (the forward hook "
                        "stands for the line after that call)")
        return problems
    call = calls[0]
    fb = (len(call.args) >= 3 and isinstance(call.args[2], ast.Name) and call.args[2].id == "forward_batch") \
        or any(k.arg == "forward_batch" for k in call.keywords)
    if not fb:
        problems.append(f"{where}.forward no longer passes forward_batch to self.model(...) as its third argument")
    # the result is bound to a name and then unpacked (hidden_states, aux = hidden_states)
    assign = next((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.value is call), None)
    bound = assign.targets[0].id if assign and len(assign.targets) == 1 and isinstance(assign.targets[0], ast.Name) \
        else None
    unpacks = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
               and n.value.id == bound and any(isinstance(t, ast.Tuple) for t in n.targets)
               and n.lineno > call.lineno] if bound else []
    if bound is None:
        problems.append(f"{where}.forward no longer binds the result of self.model(...) to a name")
    elif not unpacks:
        problems.append(f"{where}.forward no longer unpacks the result of self.model(...) "
                        f"({bound}, aux = {bound}: what after_model's routing returns)")
    return problems


def _check_norm(src: Source) -> list:
    problems = []
    where = f"{DEEPSEEK}.DeepseekV2Model"
    init = src.method(DEEPSEEK, "DeepseekV2Model", "__init__")
    if not any(_name(v) == "RMSNorm" for v in _self_assigns(init, "norm")):
        problems.append(f"{where}.__init__ no longer sets self.norm = RMSNorm(...) (the final norm whose forward "
                        "hook takes the last layer's output)")
    fn = src.method(DEEPSEEK, "DeepseekV2Model", "forward")
    used = any(_is_self_attr(c.func, "norm") or any(_is_self_attr(a, "norm") for a in c.args)
               or any(_is_self_attr(k.value, "norm") for k in c.keywords) for c in _calls(fn))
    if not used:
        problems.append(f"{where}.forward no longer calls self.norm (or hands it to the call that does)")
    return problems


def _check_kimi(src: Source) -> list:
    problems = []
    where = f"{KIMI}.KimiK25ForConditionalGeneration"
    fn = src.method(KIMI, "KimiK25ForConditionalGeneration", "set_eagle3_layers_to_capture")
    if not any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_eagle3_layers_to_capture"
               and _is_self_attr(c.func.value, "language_model") for c in _calls(fn)):
        problems.append(f"{where}.set_eagle3_layers_to_capture no longer calls "
                        "self.language_model.set_eagle3_layers_to_capture(...)")
    init = src.method(KIMI, "KimiK25ForConditionalGeneration", "__init__")
    made = {_name(v) for v in _self_assigns(init, "language_model")}
    lm = next((n for n in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM") if n in made), None)
    if lm is None:
        problems.append(f"{where}.__init__ no longer sets self.language_model = DeepseekV3ForCausalLM(...)")
    elif not any(isinstance(n, ast.ImportFrom) and n.module == DEEPSEEK and any(a.name == lm and a.asname in (None, lm)
                                                                                  for a in n.names)
                 for n in ast.walk(src.module(KIMI))):
        problems.append(f"{KIMI} no longer takes {lm} from {DEEPSEEK}")
    elif lm != "DeepseekV2ForCausalLM" and not any(_name(b) == "DeepseekV2ForCausalLM"
                                                   for b in src.cls(DEEPSEEK, lm).bases):
        problems.append(f"{DEEPSEEK}.{lm} no longer derives from DeepseekV2ForCausalLM")
    model = [n for n in src.cls(KIMI, "KimiK25ForConditionalGeneration").body
             if isinstance(n, ast.FunctionDef) and n.name == "model"]
    alias = model and "property" in {_name(d) for d in model[-1].decorator_list} and any(
        isinstance(s, ast.Return) and _is_self_attr(s.value, "language_model") for s in _body(model[-1]))
    if not alias:
        problems.append(f"{where}.model is no longer a property returning self.language_model "
                        "(the capture reaches the decoder stack through it)")
    return problems


def _check_loader(src: Source) -> list:
    problems = []
    group = [n for n in _top_level(src.module(PLUGINS)) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "GENERAL_PLUGINS_GROUP" for t in n.targets)]
    if not group or not (isinstance(group[-1].value, ast.Constant) and group[-1].value.value == PLUGIN_GROUP):
        problems.append(f"{PLUGINS}.GENERAL_PLUGINS_GROUP is no longer {PLUGIN_GROUP!r} (our entry point's group)")
    src.function(PLUGINS, "load_plugins")
    src.method(HOOK_REGISTRY, "HookRegistry", "register", plain=False)
    hook_type = src.cls(HOOK_REGISTRY, "HookType")
    kinds = {t.id for n in hook_type.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for k in ("AFTER", "AROUND"):
        if k not in kinds:
            problems.append(f"{HOOK_REGISTRY}.HookType.{k} is missing")
    run = src.function(SCHEDULER, "run_scheduler_process")
    calls = _calls(run)
    loads = [c for c in calls if _name(c) == "load_plugins"]
    builds = [c for c in calls if _name(c) == "Scheduler"]
    if not loads:
        problems.append(f"{SCHEDULER}.run_scheduler_process no longer calls load_plugins() (no hook in the scheduler)")
    elif builds and (builds[0].lineno, builds[0].col_offset) < (loads[0].lineno, loads[0].col_offset):
        problems.append(f"{SCHEDULER}.run_scheduler_process builds Scheduler(...) before load_plugins()")
    return problems


TARGETS = (
    Target(f"{PLUGINS}.load_plugins", "loader", None,
           f"entry-point group {PLUGIN_GROUP!r}; HookRegistry.register with AFTER and AROUND; "
           "run_scheduler_process calls load_plugins() before it builds the Scheduler", _check_loader),
    Target(f"{SERVER_ARGS}.ServerArgs.check_server_args", "after", "check_launch",
           "a method of ServerArgs; Engine._launch_subprocesses calls it once, after load_plugins(); "
           "nothing else in sglang calls it", _check_server_args),
    Target(f"{MODEL_RUNNER}.ModelRunner.load_model", "after", "configure_runner",
           "a method of ModelRunner; initialize() calls it once; nothing that sets the capture's layers "
           "(init_attention_backends, configure_aux_hidden_state_capture) or records graphs comes before it "
           "while the runner is built", _check_load_model),
    Target(f"{DEEPSEEK}.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture", "around", "set_eagle3_layers",
           "(self, layer_ids, ...); first statement `if not self.pp_group.is_last_rank: return`; "
           "no subclass under sglang/srt/models overrides it", _check_set_eagle3),
    Target(f"{DEEPSEEK}.DeepseekV2ForCausalLM.forward", "forward hook", "after_model",
           "self.model = DeepseekV2Model(...); forward calls self.model(input_ids, positions, forward_batch, ...) "
           "once, as a module, binds the result and unpacks it afterwards; DeepseekV2Model.forward takes "
           "(self, input_ids, positions, forward_batch, ...)", _check_forward),
    Target(f"{DEEPSEEK}.DeepseekV2Model.norm", "forward hook", "_keep_last",
           "self.norm = RMSNorm(...) in __init__; forward calls self.norm or hands it to the call that does",
           _check_norm),
    Target(f"{KIMI}.KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture", "delegates",
           "set_eagle3_layers",
           "calls self.language_model.set_eagle3_layers_to_capture(...); language_model is deepseek_v2's "
           "DeepseekV3ForCausalLM; .model is a property returning self.language_model", _check_kimi),
)

# The releases the plugin covers, each with its targets (both have the same ones; a release whose
# targets differ gets its own tuple here). Other releases keep the patch series.
TARGETS_BY_RELEASE = {"0.5.17": TARGETS, "0.5.23": TARGETS}
RELEASES = tuple(TARGETS_BY_RELEASE)


def check_tree(package_parent, release: str) -> list:
    """[(Target, [problem lines])] for the release's targets, read from package_parent/sglang/."""
    src = Source(Path(package_parent))
    out = []
    for t in TARGETS_BY_RELEASE[release]:
        try:
            problems = t.check(src)
        except Missing as exc:
            problems = [str(exc)]
        except Exception as exc:  # a shape no check foresaw is drift too: register() must refuse, not
            # raise (sglang's loader only logs an Exception, and the server would start without capture)
            problems = [f"cannot be checked ({exc.__class__.__name__}: {exc})"]
        out.append((t, problems))
    return out


def release_in_tree(package_parent) -> Optional[str]:
    """The sglang release of package_parent/sglang/ (its dist-info, else sglang/version.py)."""
    pp = Path(package_parent)
    for d in sorted(pp.glob("sglang-*.dist-info")):
        try:
            m = re.search(r"^Version:\s*(\S+)", (d / "METADATA").read_text(encoding="utf-8", errors="replace"), re.M)
        except OSError:
            m = None
        if m:
            return m.group(1)
    for name in ("version.py", "_version.py"):
        try:
            text = (pp / "sglang" / name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        m = re.search(r"""^\s*(?:__version__|version)\s*=\s*['"]([^'"]+)['"]""", text, re.M)
        if m:
            return m.group(1)
    return None


def unknown_release(release: Optional[str]) -> str:
    """The problem line for a release the plugin does not cover."""
    which = f"sglang {release}" if release else "an sglang whose release cannot be read"
    return (f"{which}: the eaglepatch_capture plugin declares hook targets only for sglang "
            f"{' and '.join(RELEASES)}; use the patch series of that release (patches/sglang-<release>, "
            "tools/apply.py)")


def problems_in_tree(package_parent, release: Optional[str] = None) -> list:
    """One line per missing or drifted target of package_parent/sglang/ (the release read from the
    tree unless given); an unknown release is one line. An empty list: every target holds."""
    release = release or release_in_tree(package_parent)
    if release not in TARGETS_BY_RELEASE:
        return [unknown_release(release)]
    return [f"{t.path}: {p}" for t, problems in check_tree(package_parent, release) for p in problems]


def installed_package_parent() -> Optional[Path]:
    """The directory holding the sglang package this interpreter would import (found, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def problems_installed() -> list:
    """problems_in_tree for the sglang this interpreter imports, its release from its metadata."""
    pp = installed_package_parent()
    if pp is None:
        return ["sglang is not importable by this Python; install sglang 0.5.17 or 0.5.23 first"]
    try:
        release = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        release = release_in_tree(pp)
    return problems_in_tree(pp, release)


def plugins_env_problem(environ=None) -> Optional[str]:
    """A warning when SGLANG_PLUGINS is set without our entry point (sglang then loads nothing of
    ours, and says so only at INFO): None when unset, empty or listing it."""
    value = (os.environ if environ is None else environ).get("SGLANG_PLUGINS", "")
    names = [n.strip() for n in value.split(",") if n.strip()]  # as sglang's load_plugins_by_group reads it
    if not value or ENTRY_POINT in names:
        return None
    return (f"SGLANG_PLUGINS={value!r} does not list {ENTRY_POINT}: sglang loads no capture hook and writes no "
            f"dump, without an error; add it (SGLANG_PLUGINS={','.join(names + [ENTRY_POINT])}) or unset SGLANG_PLUGINS")
