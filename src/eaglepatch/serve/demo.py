"""The CPU demo: the patched sglang 0.5.9 serving a tiny built-in model on any machine's CPU.

``cpu_demo_plan(DIR)`` prepares, then returns the ``Plan`` of, a server that runs in the cached CPU
environment (``eaglepatch.cpuenv``: built the first time, ~3 minutes) on

- the tree: sglang 0.5.9 from the package index with the series and its test-only smoke patch
  (torch_native DeepSeek attention through MLA: upstream's MHA prefill on torch_native is silently
  wrong on CPU), built once under ``${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}/serve/``; or, with
  ``--sglang ROOT``, a copy of that patched tree plus the smoke patch at ``DIR/sglang-tree``;
- ``DIR/model``: the seeded tiny DeepSeek-V3 checkpoint of the smoke tests (4 layers, hidden 256,
  vocabulary 1024) with a word-level chat tokenizer whose template marks assistant turns;
- ``DIR/conversations.jsonl`` (``DEMO_CONVERSATIONS`` synthetic chats, OpenAI and ShareGPT form),
  ``DIR/dumps`` (``EAGLE3_DUMP_DIR``), and one draft config per trainer, naming the layers its
  dataset holds in that trainer's convention (``DIR/draft-specforge``: ``eagle_config`` EAGLE-3
  ids; ``DIR/draft-speculators``: speculators' HF indices), for ``tools/guard.py``;
- ``DIR/serve.json``: those paths, the URL, the tree, the server's pid and the next commands.

Rerunning with the same DIR reuses what is there (the model is rebuilt when the checkpoint's key
changes); a non-empty DIR that is not a demo directory is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import PINNED_RELEASE, cpuenv
from ..errors import UsageError
from ..outputs import build_beside
from . import (DEFAULT_HOST, DEFAULT_PORT, Plan, _url, cpu_flags, dump_dir_list, dump_settings, mooncake_extract,
               mooncake_next_steps,
               mooncake_notes, patched_tree_at, tinychat)

# EAGLE3_DUMP_LAYERS of the demo (4 decoder layers): the embedding output and layers 0-2 (aux layers:
# speculators takes all four, SpecForge's draft three: the non-negative ones, which its online mode
# takes too), then N-1 = 3, the last layer before the final norm (speculators' last slot; SGLang
# cannot feed it to a draft)
DEMO_LAYERS = (-1, 0, 1, 2, 3)
DEMO_CONVERSATIONS = 16
MARKER = ".eaglepatch-demo"
MODEL_MARKER = ".eaglepatch-demo-model"
TOKENIZER_VERSION = "1"  # bump when tinychat's default tokenizer changes
SRC = Path(__file__).resolve().parents[2]  # the directory holding the eaglepatch package


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _demo_dir(path) -> Path:
    d = Path(path).expanduser().absolute()
    if d.exists() and not d.is_dir():
        raise UsageError(f"--cpu-demo {d} is a file", "pass a new or empty directory (or one an earlier demo made)")
    if d.is_dir() and not (d / MARKER).is_file() and any(d.iterdir()):
        raise UsageError(f"--cpu-demo {d} is not empty and was not made by the demo",
                         "pass a new or empty directory (or one an earlier demo made)")
    return d


def _series_key(series) -> str:
    h = hashlib.sha256()
    for p in list(series.patches) + list(series.smoke):
        h.update(p.name.encode() + b"\0" + Path(p.path).read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cached_tree(series_dir=None, say=_say) -> Path:
    """The package parent of sglang 0.5.9 + the series + its smoke patches, built once in the cache."""
    from ..fetch import unpacked_release
    from ..series import default_patches_root, load_series
    from ..smoke.tree import patched_tree

    series = load_series(series_dir or default_patches_root() / f"sglang-{PINNED_RELEASE}")
    if series.release != PINNED_RELEASE:
        raise UsageError(f"--series {series.dir} is a series for sglang {series.release}; the CPU demo runs sglang "
                         f"{PINNED_RELEASE}", f"pass a series of {PINNED_RELEASE}, or leave --series out")
    series.require_patches()
    dest = cpuenv.cache_dir() / "serve" / f"sglang-{PINNED_RELEASE}-{_series_key(series)}"
    if (dest / ".complete").is_file():
        return dest
    release = unpacked_release(PINNED_RELEASE)  # downloaded from the package index the first time
    say(f"[serve] building sglang {PINNED_RELEASE} + {series.name} + its smoke patch at {dest} ...")

    def make(tmp: Path) -> None:
        patched_tree(release, series.dir, tmp, smoke=True)
        (tmp / ".complete").write_text(f"{series.dir}\n")

    build_beside(dest, make)  # where another run renamed its tree in first, theirs is kept
    return dest


def tree_copy(root, demo_dir: Path, series_dir=None, say=_say) -> tuple[Path, list]:
    """``demo_dir/sglang-tree``: a copy of the patched 0.5.9 tree at ``root`` plus the smoke patches."""
    from ..smoke.tree import patched_tree

    tree, series, notes = patched_tree_at(root, series_dir)
    if tree.release != PINNED_RELEASE:
        raise UsageError(f"{tree.root} is sglang {tree.release}; the CPU demo runs sglang {PINNED_RELEASE}",
                         f"pass a patched {PINNED_RELEASE} tree (python3 tools/apply.py --fetch), or leave --sglang out")
    dest = demo_dir / "sglang-tree"
    say(f"[serve] copying {tree.root} to {dest} and adding the smoke patch ...")
    try:
        patched_tree(tree.package_parent, series.dir, dest, smoke=True, product=False)
    except RuntimeError as exc:
        raise UsageError(f"the smoke patch does not apply to {tree.root} ({str(exc).splitlines()[0]})",
                         "serve an unedited patched tree, or leave --sglang out") from None
    return dest, notes


def _offline_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONHOME", None)
    return env


def demo_model(py: Path, demo_dir: Path, say=_say) -> Path:
    """``demo_dir/model``: the tiny DeepSeek-V3 checkpoint (the smoke tests' cached one) and the
    tinychat tokenizer, in one directory (what --model-path and the extract client's --model read)."""
    from ..smoke import checkpoint_dir, ensure_checkpoints

    model = demo_dir / "model"
    key = json.dumps({"checkpoint": checkpoint_dir("deepseek_v3").name, "tokenizer": TOKENIZER_VERSION})
    if (model / MODEL_MARKER).is_file() and (model / MODEL_MARKER).read_text() == key:
        return model
    with tempfile.TemporaryDirectory(prefix=".model-", dir=demo_dir) as work:
        work = Path(work)
        ckpt = ensure_checkpoints(py, work)["deepseek_v3"]
        tmp = work / "model"
        tmp.mkdir()
        for f in ckpt.iterdir():
            if f.is_file() and not f.name.startswith("."):
                shutil.copyfile(f, tmp / f.name)
        say("[serve] building the demo's chat tokenizer ...")
        env = dict(_offline_env(), PYTHONPATH=str(SRC))
        r = subprocess.run([str(py), "-m", "eaglepatch.serve.tinychat", str(tmp)], env=env, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise UsageError(f"building the demo tokenizer failed ({(r.stderr.strip().splitlines() or ['?'])[-1]})",
                             "rerun; if it fails again, remove the CPU environment under ~/.cache/eaglepatch")
        (tmp / MODEL_MARKER).write_text(key)
        if model.exists():
            shutil.rmtree(model)
        os.rename(tmp, model)
    return model


def _write_if_changed(path: Path, text: str) -> None:
    if not (path.is_file() and path.read_text() == text):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _drafts(demo_dir: Path, layers: list, num_layers: int) -> dict:
    """One draft config per trainer whose layers the dataset of the README's commands holds:
    SpecForge (eagle_config: the three highest dumped EAGLE-3 ids from 0 to N-2: SpecForge 0.2.0's
    draft takes three aux layers, non-negative ids suit its online mode as well as its training from
    a dataset, and SGLang serves a draft no id above N-2) and speculators
    (speculators_model_type: HF indices = every dumped id but N-1, plus one; its last slot is N-1).
    A trainer whose layers the dump cannot give gets none."""
    from ..smoke.tinyconfig import draft_config

    out = {}
    last = num_layers - 1
    three = sorted(k for k in layers if 0 <= k < last)[-3:]
    if len(three) == 3:
        d = demo_dir / "draft-specforge"
        d.mkdir(exist_ok=True)
        _write_if_changed(d / "config.json", json.dumps(draft_config(three), indent=2) + "\n")
        out["specforge"] = {"dir": str(d), "aux_layers": three}
    aux = sorted(k for k in layers if k != last)
    if last in layers and aux:
        d = demo_dir / "draft-speculators"
        d.mkdir(exist_ok=True)
        cfg = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [k + 1 for k in aux]}
        _write_if_changed(d / "config.json", json.dumps(cfg, indent=2) + "\n")
        out["speculators"] = {"dir": str(d), "aux_layers": aux}
    return out


def tool(name: str) -> str:
    """``tools/<name>`` as a path that works from the current directory."""
    p = SRC.parent / "tools" / name
    rel = os.path.relpath(p)
    return rel if not rel.startswith("..") else str(p)


def next_commands(url: str, demo_dir: Path, dump_dir: Path, drafts: dict, default_aux: list) -> list:
    """The README's extract, load and guard commands for this demo (one shell line each);
    ``default_aux``: the aux layers extract.py takes without --aux-layers."""
    import shlex

    d = shlex.quote(str(demo_dir))
    ex = (f"python3 {tool('extract.py')} --server {shlex.quote(url)} --model {d}/model --data {d}/conversations.jsonl "
          f"--dump-dir {shlex.quote(str(dump_dir))}")
    cmds = []
    for fmt in ("specforge", "speculators"):
        if fmt in drafts:
            aux = drafts[fmt]["aux_layers"]
            cmds.append(f"{ex} --out {d}/ds-{fmt} --format {fmt}"
                        + (f" --aux-layers={','.join(map(str, aux))}" if aux != list(default_aux) else ""))
    if "specforge" in drafts:
        cmds.append("python3 -c \"from specforge.data.preprocessing import build_offline_eagle3_dataset as load; "
                    f"ds = load({str(demo_dir / 'ds-specforge')!r}, max_len=2048); "
                    "print(len(ds), 'SpecForge samples, aux state', tuple(ds[0]['hidden_state'].shape))\"")
    if "speculators" in drafts:
        cmds.append("python3 -c \"from speculators.train.data import ArrowDataset; "
                    f"ds = ArrowDataset(max_len=2048, datapath={str(demo_dir / 'ds-speculators')!r}, on_missing='raise'); "
                    "print(len(ds), 'speculators samples, aux state', tuple(ds[0]['hidden_states'].shape))\"")
    for fmt in ("specforge", "speculators"):
        if fmt in drafts:
            cmds.append(f"python3 {tool('guard.py')} --draft-config {d}/draft-{fmt} --dataset {d}/ds-{fmt} "
                        f"--release {PINNED_RELEASE}")
    return cmds


def cpu_demo_plan(demo_dir, sglang=None, series_dir=None, layers=DEMO_LAYERS, dump_dir=None,
                  host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, extra=(), say=_say, settings=None) -> Plan:
    """Prepare the demo directory, the CPU environment and the tree; the server's Plan. ``settings``:
    the dump variables of ``dump_settings`` (default: from the environment)."""
    settings = dump_settings({})[0] if settings is None else settings
    from ..smoke import STUBS
    from ..smoke.tinyconfig import DEEPSEEK_V3

    demo_dir = _demo_dir(demo_dir)
    layers = list(layers)
    n = DEEPSEEK_V3["num_hidden_layers"]
    bad = [k for k in layers if not -1 <= k < n]
    if bad:
        raise UsageError(f"--layers {bad} out of range: the demo model has {n} decoder layers",
                         f"pass EAGLE-3 ids from -1 to {n - 1} (default {','.join(map(str, DEMO_LAYERS))})")
    dump_dirs = dump_dir_list(dump_dir) if dump_dir else [demo_dir / "dumps"]
    dump_dir = os.pathsep.join(map(str, dump_dirs))  # EAGLE3_DUMP_DIR and extract's --dump-dir
    demo_dir.mkdir(parents=True, exist_ok=True)
    (demo_dir / MARKER).write_text("made by tools/serve.py --cpu-demo\n")
    say("[serve] the CPU environment (built the first time: ~3 minutes, 2.4 GB) ...")
    try:
        py = cpuenv.ensure_env()
    except RuntimeError as exc:
        raise UsageError(f"the CPU environment could not be built ({' '.join(str(exc).split())[:300]})",
                         "fix what the log names and rerun") from None
    notes = []
    if sglang is None:
        tree = cached_tree(series_dir, say)
        notes.append(f"serving sglang {PINNED_RELEASE} + the series + its test-only smoke patch from {tree}")
    else:
        tree, notes = tree_copy(sglang, demo_dir, series_dir, say)
        notes.append(f"serving {sglang} + its test-only smoke patch from {tree}")
    model = demo_model(py, demo_dir, say)
    data = demo_dir / "conversations.jsonl"
    _write_if_changed(data, "".join(json.dumps(r) + "\n" for r in tinychat.conversations(DEMO_CONVERSATIONS)))
    drafts = _drafts(demo_dir, layers, n)
    url = _url(host, port)
    cmds = (mooncake_next_steps(url, settings, str(py),
                                mooncake_extract(tool("extract.py"), url, settings, str(demo_dir / "model"), str(data),
                                                 str(demo_dir / "ds-specforge")))
            if settings.get("EAGLE3_DUMP_SINK") == "mooncake" else
            next_commands(url, demo_dir, dump_dir, drafts, sorted(k for k in layers if k != n - 1)))
    env = {"SGLANG_USE_CPU_ENGINE": "1", "EAGLE3_DUMP_DIR": str(dump_dir), "EAGLE3_DUMP_LAYERS": ",".join(map(str, layers)),
           # the caller's PYTHONPATH after the tree (as production serving keeps it): a package installed
           # beside the environment (the Mooncake sink's) stays importable
           "PYTHONPATH": os.pathsep.join([str(tree), str(STUBS)] + ([os.environ["PYTHONPATH"]]
                                                                     if os.environ.get("PYTHONPATH") else [])),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **settings}
    argv = [str(py), "-m", "sglang.launch_server", *cpu_flags(model, model, host, port), *extra]
    info = {"url": url, "tree": str(tree), "python": str(py), "model": str(model), "data": str(data),
            "dump_dir": str(dump_dir), "layers": layers, "drafts": drafts, "commands": cmds}
    info_file = demo_dir / "serve.json"
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    after = ["[serve] next, from another shell in " + os.getcwd() + ":"] + ["  " + c for c in cmds]
    notes.append(f"model {model}, conversations {data}, dumps {dump_dir} (EAGLE3_DUMP_LAYERS={env['EAGLE3_DUMP_LAYERS']})")
    notes += mooncake_notes(settings)
    return Plan(argv, env, url, tree, notes, dump_dirs, after, info_file)
