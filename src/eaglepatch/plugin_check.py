"""`tools/verify.py --plugin [ROOT]`: can the eaglepatch-capture plugin hook this installed sglang?

The checks are the plugin's own (``sglang-plugin/targets.py``, the module the wheel ships and
``register()`` runs in every process): every hook target of the release, by meaning, on the
tree's source. This module finds the tree (default: the sglang this Python imports), refuses a
release the plugin does not cover (naming what to use), reports a line per target, and warns when
``SGLANG_PLUGINS`` would keep sglang from loading the plugin at all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RefusedError, UsageError


def load_targets():
    """sglang-plugin/targets.py, the module the wheel ships (loaded by path: stdlib only, not part
    of this package)."""
    from .plugin import targets_module

    return targets_module()


@dataclass
class PluginReport:
    where: str
    release: str
    package_parent: Path
    results: list  # [(Target, [problems])]
    patched: bool = False
    env_warning: str | None = None
    smoke: list = field(default_factory=list)  # eaglepatch.smoke.Result

    @property
    def drifted(self) -> list:
        return [(t, p) for t, p in self.results if p]

    @property
    def exit_code(self) -> int:
        return 1 if self.drifted or self.patched or any(not r.passed for r in self.smoke) else 0

    def human(self) -> str:
        out = [f"plugin hook targets of {self.where}:"]
        for t, problems in self.results:
            out.append(f"  {t.label()}: " + ("ok" if not problems else "drifted: " + "; ".join(problems)))
        n = len(self.results) - len(self.drifted)
        verdict = ("the plugin can hook this sglang" if not self.drifted else
                   "the plugin refuses to load on this sglang (its register() runs the same checks)")
        out.append(f"{n} of {len(self.results)} targets hold: {verdict}")
        for r in self.smoke:
            out.append(f"  smoke {r.name}: {'ok' if r.passed else 'FAILED'} {r.figure}"
                       + (f" - {r.detail}" if r.detail and not r.passed else ""))
        return "\n".join(out)

    def as_dict(self) -> dict:
        return {
            "mode": "plugin", "where": self.where, "release": self.release,
            "package_parent": str(self.package_parent), "patched": self.patched,
            "sglang_plugins_warning": self.env_warning, "exit_code": self.exit_code,
            "targets": [{"path": t.path, "kind": t.kind, "hook": t.hook, "requires": t.requires,
                         "ok": not problems, "problems": problems} for t, problems in self.results],
            "smoke": [{"name": r.name, "passed": r.passed, "figure": r.figure, "detail": r.detail}
                      for r in self.smoke],
        }


def installed_root(targets) -> Path:
    pp = targets.installed_package_parent()
    if pp is None:
        raise UsageError(f"no sglang is importable by {sys.executable}",
                         "pass ROOT (the site-packages dir that holds sglang/), or run with the Python of the "
                         "server's environment")
    return pp


def uncovered(release: str | None, root: Path, covered) -> UsageError:
    """The one line for a release the plugin does not cover, naming what to use instead."""
    from .series import available_series, port_hint, tool_command

    have = available_series()
    names, either = " and ".join(covered), " or ".join(covered)
    if release is None:
        return UsageError(f"cannot tell the sglang release of {root} (no version.py, _version.py or dist-info)",
                          f"pass the site-packages dir of an installed sglang {either}")
    if release in have:
        fix = f"use its patch series {have[release].name}: {tool_command('apply', root)}"
    else:
        fix = f"install sglang {either}, or patch a pinned checkout: {port_hint(release)}"
    return UsageError(f"sglang {release} is not a release the plugin covers (it declares hook targets for "
                      f"sglang {names})", fix)


def check(root: Path | str | None) -> PluginReport:
    """The target report of ROOT (default: the sglang this Python imports); raises the one-line
    usage error for a tree that is not sglang or a release the plugin does not cover."""
    from .tree import UpstreamTree

    targets = load_targets()
    given = root is not None
    tree = UpstreamTree.open(root if given else installed_root(targets))
    if tree.release not in targets.TARGETS_BY_RELEASE:
        raise uncovered(tree.release, tree.root, targets.RELEASES)
    where = tree.describe() if given else f"the sglang {sys.executable} imports: {tree.describe()}"
    results = targets.check_tree(tree.package_parent, tree.release)
    patched = (tree.package_parent / "sglang" / "srt" / "eagle3_capture").exists()
    return PluginReport(where, tree.release, tree.package_parent, results, patched,
                        targets.plugins_env_problem(os.environ))


def patched_refusal(rep: PluginReport) -> RefusedError:
    return RefusedError(f"{rep.package_parent}/sglang is patched with an eaglepatch series (sglang/srt/eagle3_capture/ "
                        "is there), and the plugin refuses to load beside it",
                        "use one delivery: for the series run tools/verify.py ROOT without --plugin; for the plugin "
                        "install an unmodified sglang")


def check_smoke_level(level: str | None) -> None:
    """--smoke with --plugin: none, static (the target checks only) or functional."""
    if level == "import":
        raise UsageError("--smoke import does not run through the plugin (only the functional level's engine "
                         "checks start sglang's plugin loader)", "pass --smoke functional, or --smoke none")


def check_keep(keep: Path | None, level: str | None) -> None:
    """--smoke-work DIR: only with --smoke functional, and DIR must not exist (nothing is written over)."""
    if keep is None:
        return
    if level != "functional":
        raise UsageError("--smoke-work keeps the functional smoke's work directory", "pass --smoke functional with it")
    if keep.exists() or keep.is_symlink():
        raise UsageError(f"--smoke-work {keep} already exists", "pass a path that does not exist yet")
    if not keep.parent.is_dir():
        raise UsageError(f"--smoke-work {keep}: its parent directory does not exist", "create it first")


def smoke(rep: PluginReport, level: str, say=print, keep: Path | None = None) -> list:
    """The smoke through the plugin on rep's tree: the wheel built from this checkout and installed
    into a temporary directory, then eaglepatch.smoke's engine checks on the unmodified release
    with that directory on PYTHONPATH (sglang's own loader installs the capture). Only the
    functional level's engine group runs through the plugin (the other workers build sglang's
    parts without its plugin loader). ``keep``: the work directory to use and leave behind (the
    wheel, its install, each check's dump files and logs under smoke/), created; default a
    temporary one, removed."""
    import shutil
    import tempfile

    from . import plugin
    from .smoke import run_smoke

    check_smoke_level(level)
    check_keep(keep, level)
    if keep is not None:
        keep.mkdir()
    work = keep if keep is not None else Path(tempfile.mkdtemp(prefix="eaglepatch-plugin-smoke-"))
    try:
        say(f"smoke: building the eaglepatch-capture wheel into {work}")
        site = plugin.install(plugin.build_wheel(work / "dist"), work / "site")
        # only sglang and its dist-info on the path (links: the tree is never written; byte code goes
        # to the runner's PYTHONPYCACHEPREFIX, or nowhere under PYTHONDONTWRITEBYTECODE), not the rest of a
        # server's site-packages
        view = work / "sglang-view"
        view.mkdir()
        for p in [rep.package_parent / "sglang", *sorted(rep.package_parent.glob("sglang-*.dist-info"))]:
            (view / p.name).symlink_to(p, target_is_directory=True)
        return run_smoke(level, view, checks=["engine"], work_dir=work / "smoke", plugin=site)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


# ---- parity with the series: two runs' dump files, bit for bit ------------------------------------

RUN_FIELDS = ("launch_id", "dump_dirs")  # dump metadata that names the run, not the data


def _raw(t) -> bytes:
    """A tensor's bytes as stored (any dtype, bfloat16 too)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def dump_differences(series_dir: Path, plugin_dir: Path, own_dirs: bool = True, run_fields=RUN_FIELDS) -> list:
    """What differs between two dump directories of the same requests (the series' and the plugin's):
    file names, any tensor's dtype, shape or bytes, any metadata but ``run_fields`` (the fields that
    name the run itself); one launch id must hold for all of a run's files, and with ``own_dirs``
    each run's dump_dirs must name its own directory (off for a directory moved after the run)."""
    import json

    from safetensors import safe_open

    out = []
    names = sorted(p.name for p in series_dir.iterdir())
    other = sorted(p.name for p in plugin_dir.iterdir())
    if names != other or not names:
        return [f"file names differ: series {names}, plugin {other}"]
    launches = {"series": set(), "plugin": set()}
    for name in names:
        read = {}
        for side, d in (("series", series_dir), ("plugin", plugin_dir)):
            with safe_open(str(d / name), framework="pt") as f:
                meta = dict(f.metadata() or {})
                read[side] = (meta, {k: f.get_tensor(k) for k in f.keys()})
            if own_dirs and json.loads(meta.get("dump_dirs", "null")) != [str(d)]:
                out.append(f"{name}: {side} dump_dirs {meta.get('dump_dirs')!r}, not its own directory")
            launches[side].add(meta.get("launch_id"))
        (ms, ts), (mp, tp) = read["series"], read["plugin"]
        if sorted(ts) != sorted(tp):
            out.append(f"{name}: tensors {sorted(ts)} vs {sorted(tp)}")
        for k in sorted(set(ts) & set(tp)):
            a, b = ts[k], tp[k]
            if a.dtype != b.dtype or a.shape != b.shape or _raw(a) != _raw(b):
                out.append(f"{name}: tensor {k} differs ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})")
        for k in sorted((set(ms) | set(mp)) - set(run_fields)):
            if ms.get(k) != mp.get(k):
                out.append(f"{name}: metadata {k}: series {ms.get(k)!r}, plugin {mp.get(k)!r}")
    for side, ids in launches.items():
        if len(ids) != 1 or None in ids:
            out.append(f"{side}: launch ids {sorted(map(str, ids))}, want one per run")
    return out
