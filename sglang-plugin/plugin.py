"""The eaglepatch-capture plugin's entry point: ``register()`` (group ``sglang.srt.plugins``, name
``eaglepatch_capture``).

SGLang's ``load_plugins()`` calls ``register()`` in every process that loads plugins (the
launcher, each scheduler; on 0.5.23 also the detokenizer and the DP controller), then applies the
registered hooks once. ``register()`` first refuses, with ``SystemExit(2)`` and one line (an
``Exception`` would only be logged by the loader and the server would start without capture):

- a patched tree (the series' ``sglang.srt.eagle3_capture`` is importable): two deliveries at once;
- a release the plugin does not cover (``release.PLUGIN_RELEASES``), naming the series to use;
- any hook target that drifted in the installed sglang (``targets.problems_installed()``).

Then it registers the hooks that do what the series' hunks in upstream files do (the capture
logic itself is the package's, the same files the series adds):

- AFTER ``ServerArgs.check_server_args``: ``check_launch`` (0004: the launcher refuses bad dump
  settings and installs its flush and stop hooks);
- AFTER ``ModelRunner.load_model``: ``configure_runner`` (0003);
- AROUND ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``: the pipeline's last-rank guard,
  then ``set_eagle3_layers`` (0002 h3).

The targets, their kinds and their checks are declared once, in ``targets.py``.

0002 h2 (``after_model`` in ``DeepseekV2ForCausalLM.forward``) is a torch forward hook on the
decoder stack instance, registered by the package's capture state when ``release.DELIVERY`` is
"plugin" (never a registry hook on ``DeepseekV2Model.forward``, which piecewise CUDA graphs
compile whole).
"""

from __future__ import annotations

import sys

# What each registry hook does, by the overlay function targets.TARGETS names for it (targets.py
# declares the target, the hook kind and the checks; this module only what the hook runs).

def after_check_server_args(result, server_args, *args, **kwargs):
    """0004: the launcher's check right after ServerArgs.check_server_args()."""
    from . import check_launch

    check_launch(server_args)


def after_load_model(result, runner, *args, **kwargs):
    """0003: configure capture (and start the dump) once the model is loaded, before the
    attention backends and device graphs (the series' call is two statements later, after
    prepare_moe_topk, which only attaches MoE balancers)."""
    from . import configure_runner

    configure_runner(runner)


def around_set_eagle3_layers_to_capture(original, model, layer_ids=None):
    """0002 h3: upstream's first statement returns on every pipeline rank but the last."""
    if not model.pp_group.is_last_rank:
        return original(model, layer_ids)
    from . import set_eagle3_layers

    return set_eagle3_layers(model, layer_ids)


# targets.TARGETS' (kind, hook) -> the function registered
HOOKS = {
    ("after", "check_launch"): after_check_server_args,
    ("after", "configure_runner"): after_load_model,
    ("around", "set_eagle3_layers"): around_set_eagle3_layers_to_capture,
}


def registry_hooks(release: str) -> list:
    """[(target path, kind, function)] registered for the release; a declared registry target
    without a function here is an error (nothing may be declared and silently not hooked)."""
    from . import targets

    out = []
    for t in targets.TARGETS_BY_RELEASE[release]:
        if t.kind not in ("after", "around"):
            continue  # forward hooks (the package registers them), delegates, the loader
        fn = HOOKS.get((t.kind, t.hook))
        if fn is None:
            raise RuntimeError(f"eaglepatch_capture.targets declares a {t.kind} hook {t.hook} on {t.path} "
                               "that plugin.py does not implement")
        out.append((t.path, t.kind, fn))
    return out


def refuse(problem: str, fix: str):
    """One line on stderr, then SystemExit(2): it passes through SGLang's plugin loader (an
    Exception would only be logged) and ends the process with exit code 2."""
    print(" ".join(f"error: eaglepatch-capture plugin: {problem}; {fix}".split()), file=sys.stderr, flush=True)
    raise SystemExit(2)


def refusal() -> tuple[str, str] | None:
    """(problem, fix) when this plugin must not capture in this sglang, else None."""
    from importlib.util import find_spec

    from . import release

    try:
        patched = find_spec("sglang.srt.eagle3_capture") is not None
    except (ImportError, ValueError):
        patched = False
    if patched:
        return ("this sglang is already patched with an eaglepatch series (sglang.srt.eagle3_capture is installed), "
                "and the plugin would capture a second time",
                "use one delivery: uninstall the plugin (pip uninstall eaglepatch-capture) or install an "
                "unmodified sglang")
    installed = release.SERIES_RELEASE
    covered = " or ".join(release.PLUGIN_RELEASES)
    if installed is None:
        return ("cannot read the installed sglang's version (it has no distribution metadata)",
                f"install sglang {covered} (the releases this plugin covers)")
    if installed not in release.PLUGIN_RELEASES:
        if installed in release.SERIES:
            return (f"sglang {installed} is not a release this plugin covers ({covered}: the releases with a "
                    "plugin loader)", f"use the patch series patches/sglang-{installed} with tools/apply.py, "
                                      f"or install sglang {covered}")
        series = ", ".join(f"patches/sglang-{r}" for r in release.SERIES)
        return (f"sglang {installed} is not a release this plugin covers ({covered})",
                f"install sglang {covered}, or patch a pinned checkout of a release a series covers "
                f"({series}) with tools/apply.py")
    from . import targets

    problems = targets.problems_installed()
    if problems:
        return (f"sglang {installed} differs from what the plugin hooks: " + "; ".join(problems),
                f"install an unmodified sglang {installed}, or check it with tools/verify.py --plugin")
    return None


def register() -> None:
    """The entry point: refuse (SystemExit(2), one line), or register the capture hooks."""
    why = refusal()
    if why is not None:
        refuse(*why)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import release

    for target, kind, fn in registry_hooks(release.SERIES_RELEASE):
        HookRegistry.register(target, fn, HookType[kind.upper()])
