"""Smoke tests of a patched SGLang tree on CPU, with real SGLang code.

``run_smoke(level, package_parent, series, checks=None) -> list[Result]``

- ``package_parent``: a directory holding an already patched ``sglang/`` (the tree under test,
  with the test-only smoke patches applied too).
- ``series``: the series that patched it (an ``eaglepatch.series.Series``, a series directory, or
  None); names the test-only smoke patches in the output, and gives the release when the tree
  has no ``sglang/_version.py``.
- ``level``: ``import`` (import the patched modules in the CPU environment and check the series'
  symbols) or ``functional`` (checks a-e: EAGLE-3 capture vs a Hugging Face reference, the dump
  through ``sglang.Engine`` for DeepSeek-V3 and Kimi-K2.5, dump on/off equality, refusals).
- ``checks``: for ``functional``, a subset of the worker groups ``runner`` (a, d, e in ModelRunner
  init) and ``engine`` (e at a real Engine start, b, c); ``GROUP:letters`` (e.g. ``runner:a``) runs
  only those checks of a group; default all.

Every check runs in a subprocess of the cached CPU environment of the tree's release
(``eaglepatch.cpuenv.requirements_for``) with ``PYTHONPATH=<package_parent>:<stubs>`` and
``SGLANG_USE_CPU_ENGINE=1``; sglang is not installed there, so the tree under test is what runs.
The workers drive each release through its own one-batch benchmark module (``_rt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .. import cpuenv
from . import _common, tinyconfig

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
LEVELS = ("import", "functional")
GROUPS = ("runner", "engine")

# expected result names per worker group: a group that dies early still reports every check
EXPECTED = {
    "runner": [_common.A_NAME, _common.D_NAME, _common.DECODE_NAME, _common.G_NAME, _common.E_RUNNER_NAME],
    "engine": [_common.B_NAME, _common.C_NAME, _common.H_NAME, _common.E_ENGINE_NAME, _common.E_LAUNCH_NAME],
}
IMPORT_EXPECTED = [
    "import sglang.srt.eagle3_capture",
    "import sglang.srt.models.deepseek_v2",
    "import sglang.srt.models.kimi_k25",
    "import sglang.srt.model_executor.model_runner",
    "import: series symbols and hooks present",
    "import: test-only smoke patch routes torch_native DeepSeek attention to MLA",
]
GROUP_TIMEOUT_S = {"runner": 900, "engine": 1200, "import": 300, "build": 300}


@dataclass
class Result:
    name: str
    passed: bool
    figure: str
    detail: str = ""


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: whole lines while tools/test.py builds several environments at once
    sys.stderr.flush()


def series_hook_lines(series) -> dict:
    """{module: [lines]} the series' product patches add to upstream files (new files apart)."""
    from ..series import Series, load_series

    if series is None:
        return {}
    if not isinstance(series, Series):
        series = load_series(getattr(series, "dir", series))
    created = {fp.path for p in series.patches for fp in p.files if fp.is_new}
    out: dict = {}
    for p in series.patches:
        for fp in p.files:
            if fp.path in created or not fp.path.endswith(".py"):
                continue
            module = fp.path[:-3].replace("/", ".")
            for h in fp.hunks:
                out.setdefault(module, []).extend(v.decode("utf-8") for t, v in h.ops if t == "+")
    return out


def _smoke_patch_names(series) -> list[str]:
    if series is None:
        return []
    smoke = getattr(series, "smoke", None)
    if smoke is not None:
        return [getattr(p, "name", str(p)) for p in smoke]
    d = Path(getattr(series, "dir", series))
    f = d / "smoke.series"
    if not f.is_file():
        return []
    return [ln.split("#", 1)[0].strip() for ln in f.read_text().splitlines() if ln.split("#", 1)[0].strip()]


_PYCACHE: list = []


def _pycache_prefix() -> str:
    """One bytecode dir per process, outside the trees: a read-only or cached tree stays untouched."""
    if not _PYCACHE:
        import atexit
        import shutil

        d = tempfile.mkdtemp(prefix="eaglepatch-pyc-")
        atexit.register(shutil.rmtree, d, True)
        _PYCACHE.append(d)
    return _PYCACHE[0]


def tree_release(package_parent: Path, series=None) -> str:
    """The sglang release of a tree: its _version.py, else the series', else the pinned one."""
    from .. import PINNED_RELEASE
    from ..tree import version_from_version_py

    return (version_from_version_py(Path(package_parent)) or getattr(series, "release", None)
            or PINNED_RELEASE)


def _pinned(requirements: Path, name: str) -> str | None:
    for raw in requirements.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.lower().startswith(name + "=="):
            return line.split("==", 1)[1]
    return None


def stubs_for(requirements: Path, work: Path) -> Path:
    """The import stubs for an environment. transformers 5 reads torchvision's version from its
    metadata (found through the distribution's top_level.txt) and fails on none, so there the stub
    gets a 0.0.0 dist-info (older than any real release: transformers then uses none of its
    features); transformers 4 must see no metadata."""
    major = int((_pinned(requirements, "transformers") or "4").split(".")[0])
    if major < 5:
        return STUBS
    import shutil

    dest = work / "stubs"
    if not dest.exists():
        shutil.copytree(STUBS, dest, ignore=shutil.ignore_patterns("__pycache__"))
        meta = dest / "torchvision-0.0.0.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.0\n")
        (meta / "top_level.txt").write_text("torchvision\n")  # transformers maps import names through it
    return dest


def smoke_plugin_dir(work: Path) -> Path:
    """A directory holding the test-only ``eaglepatch_smoke`` plugin (smoke_plugin.py as a package,
    with a dist-info naming its entry point), for a smoke run of an unmodified release with the
    eaglepatch-capture plugin."""
    from .smoke_plugin import ENTRY_POINT

    dest = Path(work) / "smoke-plugin"
    pkg = dest / ENTRY_POINT
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_bytes((HERE / "smoke_plugin.py").read_bytes())
    meta = dest / ("%s-0.0.0.dist-info" % ENTRY_POINT)
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: 0.0.0\n" % ENTRY_POINT)
    (meta / "entry_points.txt").write_text("[sglang.srt.plugins]\n%s = %s:register\n" % (ENTRY_POINT, ENTRY_POINT))
    return dest


def worker_env(package_parent: Path, stubs: Path = STUBS, plugin_paths: Iterable[Path] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
    if not env.get("PYTHONDONTWRITEBYTECODE"):
        # where bytecode is written, it goes to a dir of this process's, never into the trees; where none is
        # written (PYTHONDONTWRITEBYTECODE), no prefix: a prefix would hide the installed packages' own
        # __pycache__ and every worker and engine process would compile torch & co. from source (~15 s each)
        env["PYTHONPYCACHEPREFIX"] = _pycache_prefix()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(package_parent).resolve())]
                                        + [str(Path(p).resolve()) for p in plugin_paths] + [str(stubs)])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # No NCCL on CPU: torch from the package index is a CUDA build whose libnccl loads on a machine with
    # no GPU, and SGLang's pynccl (every release pinned) then sets itself up on the CPU device and fails a
    # launch of TP 2 ("Expected a cuda device, but got: cpu"); a library path that loads nothing disables it
    env["SGLANG_NCCL_SO_PATH"] = os.devnull
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONHOME", None)
    return env


def _run_worker(py: Path, script: str, args: list, env: dict, log_path: Path, timeout: float,
                expected: Iterable[str] = ()) -> list[Result]:
    """Run one worker; stream its progress lines; parse its @@RESULT lines."""
    from .. import shm

    cmd = [str(py), str(HERE / script)] + [str(a) for a in args]
    results: list[Result] = []
    shm_before = shm.snapshot()
    with open(log_path, "w") as log:
        log.write("$ %s\n" % " ".join(cmd))
        log.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                start_new_session=True)
        expired = threading.Event()

        def on_timeout():
            expired.set()
            _kill_group(proc)

        timer = threading.Timer(timeout, on_timeout)
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("@@RESULT "):
                    rec = json.loads(line[len("@@RESULT "):])
                    r = Result(rec["name"], bool(rec["passed"]), rec["figure"], rec.get("detail", ""))
                    results.append(r)
                    _say("  %s %s: %s" % ("PASS" if r.passed else "FAIL", r.name, r.figure))
                elif line.startswith("[smoke"):
                    _say("  " + line.rstrip())
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
        rc = proc.wait()
        timed_out = expired.is_set()
        _kill_group(proc)  # engine processes the worker left behind (a dead or killed worker's above all)
        _wait_group_gone(proc.pid)
        # SGLang's Engine.shutdown() SIGKILLs its children, multiprocessing's resource tracker
        # too: the semaphores of its spawned workers stay in /dev/shm unless removed here
        swept = shm.sweep(shm_before)
        if swept:
            log.write("# removed %d semaphore/shared-memory file(s) the worker's processes left in /dev/shm: %s\n"
                      % (len(swept), " ".join(swept)))
    got = {r.name for r in results}
    missing = [n for n in expected if n not in got]
    if missing or (rc != 0 and not timed_out and not results):
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-25:])
        why = ("timed out after %.0f s" % timeout) if timed_out else ("worker exited %d" % rc)
        for n in missing or ["%s worker" % script]:
            r = Result(n, False, why, "no result from %s (log %s); last lines:\n%s" % (script, log_path, tail))
            results.append(r)
            _say("  FAIL %s: %s" % (n, why))
    return results


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Wait until no live (non-zombie) process is left in process group `pgid`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return
        for pid in pids:
            try:
                stat = Path("/proc/%s/stat" % pid).read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


def _kill_group(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and the engine processes it spawned
    except (ProcessLookupError, PermissionError):
        proc.kill()


def checkpoint_dir(kind: str, requirements: Path | None = None) -> Path:
    key = tinyconfig.checkpoint_key(kind, cpuenv.env_key(requirements))
    return cpuenv.cache_dir() / "smoke-checkpoints" / ("%s-%s" % (kind, key))


def ensure_checkpoints(py: Path, work: Path, requirements: Path | None = None, stubs: Path = STUBS) -> dict:
    """The tiny DeepSeek-V3 and Kimi-K2.5 checkpoints of an environment (built once with its
    transformers, cached by config and environment)."""
    dirs = {k: checkpoint_dir(k, requirements) for k in ("deepseek_v3", "kimi_k25")}
    if not all((d / ".complete").is_file() for d in dirs.values()):
        _say("smoke: building the tiny checkpoints under %s ..." % dirs["deepseek_v3"].parent)
        env = worker_env(work, stubs)  # no sglang needed
        log = work / "build-checkpoints.log"
        cmd = [str(py), str(HERE / "_build.py"), str(dirs["deepseek_v3"]), str(dirs["kimi_k25"])]
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=GROUP_TIMEOUT_S["build"])
        if proc.returncode != 0 or not all((d / ".complete").is_file() for d in dirs.values()):
            raise RuntimeError("error: building the smoke checkpoints failed (log %s):\n%s; fix and rerun"
                               % (log, log.read_text(errors="replace")[-3000:]))
    return dirs


def _group_specs(checks) -> list:
    """[(group, sub-check letters or "")] in run order; "runner:ad" runs only checks a and d of that group."""
    if checks is None:
        return [(g, "") for g in GROUPS]
    specs = {}
    for c in checks:
        g, _, sub = str(c).partition(":")
        if g not in GROUPS:
            raise ValueError("error: unknown check group %r; use %s (optionally GROUP:letters)" % (g, ", ".join(GROUPS)))
        specs[g] = sub
    return [(g, specs[g]) for g in GROUPS if g in specs]


def run_smoke(level: str, package_parent, series=None, checks: Iterable[str] | None = None,
              work_dir: Path | None = None, plugin: Path | None = None) -> list[Result]:
    """``plugin``: a directory the eaglepatch-capture wheel is installed in (``eaglepatch.plugin.install``);
    the checks then run on ``package_parent``, an UNMODIFIED release, with that directory and the
    test-only ``eaglepatch_smoke`` plugin (in place of the smoke patch) on PYTHONPATH: SGLang's own
    plugin loader installs the capture. Only the engine group (checks through ``sglang.Engine``,
    which loads plugins) runs this way."""
    if level not in LEVELS:
        raise ValueError("error: unknown smoke level %r; use one of %s" % (level, ", ".join(LEVELS)))
    if plugin is not None and (level != "functional" or any(str(c).partition(":")[0] != "engine"
                                                            for c in (checks or ["runner"]))):
        raise ValueError("error: a smoke run with the plugin runs the engine group only (the other workers "
                         "build SGLang's parts without its plugin loader); pass checks=['engine'] or "
                         "['engine:LETTERS']")
    package_parent = Path(package_parent).resolve()
    if not (package_parent / "sglang" / "__init__.py").is_file():
        raise FileNotFoundError("error: %s holds no sglang/ package; pass the package parent" % package_parent)
    t0 = time.monotonic()
    release = tree_release(package_parent, series)
    requirements = cpuenv.requirements_for(release)
    py = cpuenv.ensure_env(requirements)
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-smoke-")) if own_work else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stubs = stubs_for(requirements, work)
    plugin_paths = [Path(plugin), smoke_plugin_dir(work)] if plugin is not None else []
    env = worker_env(package_parent, stubs, plugin_paths)
    smoke_patches = _smoke_patch_names(series) if plugin is None else []
    if plugin is not None:
        _say("smoke: the eaglepatch-capture plugin from %s and the test-only smoke plugin eaglepatch_smoke "
             "(DeepSeek attention routed to MLA on torch_native) on an unmodified sglang" % plugin)
    _say("smoke %s: sglang %s from %s (CPU environment %s)" % (level, release, package_parent,
                                                                py.parent.parent.name))
    if smoke_patches:
        _say("smoke: this tree carries the test-only smoke patch(es) %s (torch_native's MHA prefill "
             "reads K/V from the MLA latent pool upstream; DeepSeek attention is routed to MLA)"
             % ", ".join(smoke_patches))
    results: list[Result] = []
    if level == "import":
        hooks = work / "series-hooks.json"
        hooks.write_text(json.dumps(series_hook_lines(series)))
        results += _run_worker(py, "_import.py", [hooks], env, work / "import.log", GROUP_TIMEOUT_S["import"],
                               expected=IMPORT_EXPECTED)
    else:
        specs = _group_specs(checks)
        ck = ensure_checkpoints(py, work, requirements, stubs)
        for g, sub in specs:
            _say("smoke functional: %s ..." % (g if not sub else "%s:%s" % (g, sub)))
            if g == "runner":
                args = [ck["deepseek_v3"], ck["kimi_k25"], work / "runner"] + ([",".join(sub)] if sub else [])
            else:
                args = [ck["deepseek_v3"], ck["kimi_k25"], work / "engine"] + ([",".join(sub)] if sub else [])
            script = {"runner": "_runner.py", "engine": "_engine.py"}[g]
            expected = [n for n in EXPECTED[g] if not sub or n[0] in sub]
            results += _run_worker(py, script, args, env, work / ("%s.log" % g), GROUP_TIMEOUT_S[g],
                                   expected=expected)
    wall = time.monotonic() - t0
    npass = sum(r.passed for r in results)
    _say("smoke %s: %d/%d passed in %.0f s%s" % (level, npass, len(results), wall,
                                                  "" if npass == len(results) else " (logs in %s)" % work))
    if own_work and npass == len(results):
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return results


__all__ = ["Result", "run_smoke", "ensure_checkpoints", "checkpoint_dir", "worker_env", "smoke_plugin_dir", "LEVELS",
           "GROUPS"]
