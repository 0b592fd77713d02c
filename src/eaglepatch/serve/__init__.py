"""Serve a patched SGLang tree with the hidden-state dump on: what ``tools/serve.py`` runs.

Two plans, each a ``Plan`` (the ``launch_server`` command line and the variables it runs with):

- ``production_plan``: ``python -m sglang.launch_server`` for a user's model on the machine's
  accelerators: the patched tree first on ``PYTHONPATH`` (``--sglang ROOT``), or the installed
  sglang when it is patched in place; ``EAGLE3_DUMP_DIR`` and ``EAGLE3_DUMP_LAYERS`` set; and the
  flags the dump needs (``dump_flags``: every other setting the dump refuses is off by default).
- ``cpu_demo_plan``: the same on any machine's CPU with a tiny built-in model (``demo``): the cached
  CPU environment (``eaglepatch.cpuenv``), sglang 0.5.9 with the series and its test-only smoke
  patch built once in the cache (or ``--sglang ROOT`` copied, plus the smoke patch), the import
  stubs, ``SGLANG_USE_CPU_ENGINE=1`` and the CPU flags (``cpu_flags``).

``run(plan)`` starts the server in its own process group, says when it answers, forwards Ctrl-C
and SIGTERM to it and leaves no process of it behind.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .. import PINNED_RELEASE
from ..errors import UsageError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
# The launch_server flags the dump needs on top of SGLang's defaults (``dump_flags``): the radix cache
# is on by default, and from 0.5.17 on so are prefill CUDA graphs under CUDA (the "breakable" backend).
# Every other setting eagle3_capture.settings.check_server_args refuses (mixed chunk, two-batch
# overlap, piecewise CUDA graphs, DP attention, pipeline parallelism, an all-to-all MoE backend, ...)
# is off unless asked for, and asking for one ends the launch with one line naming it.
DUMP_FLAGS = ("--disable-radix-cache",)
PREFILL_GRAPH_FLAG = "--disable-prefill-cuda-graph"
STOP_GRACE_S = 15.0


def cpu_flags(model, tokenizer=None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> list:
    """``launch_server`` flags of a CPU server with the dump on (the CPU demo's and the extract
    tests'): torch_native attention, float32, no CUDA graph, every prompt prefilled in one forward,
    no overlap schedule, small pools, a fixed seed; ``--sleep-on-idle``: an idle scheduler waits on
    its sockets instead of spinning a core."""
    return ["--model-path", str(model), "--tokenizer-path", str(tokenizer or model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--dtype", "float32",
            *DUMP_FLAGS, "--chunked-prefill-size", "-1", "--disable-overlap-schedule",
            "--max-total-tokens", "4096", "--context-length", "1024", "--max-running-requests", "8",
            "--random-seed", "0", "--mem-fraction-static", "0.5", "--grammar-backend", "none", "--sleep-on-idle",
            "--port", str(port), "--host", host]


def dump_flags(package_parent) -> list:
    """``DUMP_FLAGS``, and ``--disable-prefill-cuda-graph`` where the tree's release has that setting
    (0.5.17 and later: prefill CUDA graphs, on by default under CUDA, would bake the dump into a graph)."""
    srt = Path(package_parent) / "sglang" / "srt"
    sources = [srt / "server_args.py", *sorted((srt / "arg_groups").rglob("*.py"))]
    has = any("disable_prefill_cuda_graph" in f.read_text(encoding="utf-8", errors="replace")
              for f in sources if f.is_file())
    return list(DUMP_FLAGS) + ([PREFILL_GRAPH_FLAG] if has else [])


def parse_layers(text: str) -> list:
    """``EAGLE3_DUMP_LAYERS`` as a list of EAGLE-3 ids (-1 = embedding output, k = output of layer k)."""
    try:
        ids = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--layers {text!r} is not a comma list of integers", "pass EAGLE-3 ids, e.g. --layers=-1,1,29,60") \
            from None
    if any(k < -1 for k in ids) or len(set(ids)) != len(ids):
        raise UsageError(f"--layers {text!r}: ids are distinct, -1 (embedding output) or >= 0",
                         "pass EAGLE-3 ids, e.g. --layers=-1,1,29,60")
    return ids


@dataclass
class Plan:
    """A server to start: ``argv`` with ``env`` set on top of this process's environment (less any
    EAGLE3_DUMP_* variable it does not set itself); ``mkdirs`` are created first."""

    argv: list
    env: dict
    url: str
    tree: Path | None = None  # the sglang package parent that serves (None: the installed sglang)
    notes: list = field(default_factory=list)
    mkdirs: list = field(default_factory=list)
    after_ready: list = field(default_factory=list)  # lines printed once the server answers
    info_file: Path | None = None  # the CPU demo's serve.json (gets the server's pid at start)

    def environ(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
        env.update(self.env)
        return env

    def shell(self) -> str:
        """The command as one shell line (the variables, then the command line)."""
        return " ".join([f"{k}={shlex.quote(str(v))}" for k, v in self.env.items()] + [shlex.join(map(str, self.argv))])


# ---- the tree that serves ------------------------------------------------------------------------

def patched_tree_at(root, series_dir=None):
    """(UpstreamTree, Series, notes) of the sglang tree at ``root``, which must carry the series: an
    unpatched or partly patched tree is a usage error naming the apply command; a patched tree edited
    since is served as it is, with a warning."""
    from ..tree import resolve_series

    pick = resolve_series(root, series_dir)
    tree, series = pick.tree, pick.series
    state = tree.state(series)
    has_capture = (tree.package_parent / "sglang" / "srt" / "eagle3_capture" / "__init__.py").is_file()
    notes = []
    if state == "upstream" or not has_capture:
        raise UsageError(f"{tree.root} is sglang {tree.release} without the EAGLE-3 series (it has no dump)",
                         f"patch it first: python3 tools/apply.py {tree.root}")
    if state == "partial":
        raise UsageError(f"{tree.root} is partly patched with {series.name}",
                         f"finish it: python3 tools/apply.py {tree.root}")
    if state == "modified":
        notes.append(f"warning: {tree.root} differs from the patched files recorded in {series.name}/manifest.json "
                     f"(local edits?); serving it as it is")
    return tree, series, notes


def _probe_python(python: str) -> dict:
    """Where ``python`` finds sglang (without importing it) and the installed sglang's version."""
    code = ("import importlib.util as u, importlib.metadata as m, json\n"
            "s = u.find_spec('sglang')\n"
            "try:\n    v = m.version('sglang')\nexcept Exception:\n    v = None\n"
            "print(json.dumps({'origin': s.origin if s else None, 'version': v}))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        raise UsageError(f"cannot run {python} to find its sglang",
                         "pass --python PY: the interpreter of the environment that has sglang's dependencies") from None


def production_plan(model_path: str, dump_dir, layers=None, sglang=None, series_dir=None, python=None,
                    host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, extra=()) -> Plan:
    """``launch_server`` for ``model_path`` on this machine's accelerators with the dump on."""
    python = str(python or sys.executable)
    dump_dir = Path(dump_dir).expanduser().absolute()
    if dump_dir.exists() and not dump_dir.is_dir():
        raise UsageError(f"--dump-dir {dump_dir} is a file", "pass a directory (it is created when missing)")
    if dump_dir.is_dir() and not os.access(dump_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--dump-dir {dump_dir} is not writable", "pass a directory the server can write")
    probe = _probe_python(python)
    env = {"EAGLE3_DUMP_DIR": str(dump_dir)}
    if layers is not None:
        env["EAGLE3_DUMP_LAYERS"] = ",".join(map(str, layers))
    if sglang is not None:
        tree, series, notes = patched_tree_at(sglang, series_dir)
        env["PYTHONPATH"] = os.pathsep.join([str(tree.package_parent)] + ([os.environ["PYTHONPATH"]]
                                                                          if os.environ.get("PYTHONPATH") else []))
        rel = tree.release
        if probe["version"] is None:
            notes.append(f"warning: {python} has no sglang installed; the server needs sglang {rel}'s dependencies "
                         f"(pip install sglang=={rel}: the patched tree still goes first)")
        elif probe["version"] != rel:
            notes.append(f"warning: {python} has sglang {probe['version']} installed and the tree is {rel}: install "
                         f"the dependencies of {rel} (pip install sglang=={rel}; the patched tree still goes first)")
        pp = tree.package_parent
    else:
        if not probe["origin"]:
            raise UsageError(f"{python} has no sglang to serve",
                             "pass --sglang ROOT (a patched tree, e.g. from python3 tools/apply.py --fetch), or "
                             "pip install sglang==0.5.9 and patch it in place: python3 tools/apply.py <its site-packages>")
        pp = Path(probe["origin"]).resolve().parent.parent
        tree, series, notes = patched_tree_at(pp, series_dir)
    flags = [f for f in dump_flags(pp) if f not in extra]
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), *flags,
            "--host", host, "--port", str(port), *extra]
    notes.insert(0, f"serving {tree.describe()}, {series.name} applied")
    return Plan(argv, env, _url(host, port), pp if sglang is not None else None, notes, [dump_dir])


def _url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


# ---- running it ------------------------------------------------------------------------------------

def _answers(url: str) -> bool:
    """Whether the server is past its warm-up: SGLang answers /get_model_info while its warm-up
    request still runs, but /health only 503 until it ends (and tools/extract.py refuses it then)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _announce(proc, plan: Plan, say) -> None:
    t0 = time.monotonic()
    while proc.poll() is None:
        if _answers(plan.url):
            say(f"[serve] ready at {plan.url} ({time.monotonic() - t0:.0f} s); Ctrl-C stops it")
            for line in plan.after_ready:
                say(line)
            return
        time.sleep(1.0)


def _kill_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies waiting for their reaper count
    as gone: /proc tells them apart where there is one)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


def _end_group(pgid: int, grace: float = 5.0) -> None:
    """Give what is left of the group ``grace`` seconds to finish on its own (the resource tracker
    removes the semaphores it tracks), then SIGTERM, then SIGKILL."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            _kill_group(pgid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (something holds it), or None when it is free. A
    server started on a taken port fails to bind while whatever holds it answers /health in its
    place: the launcher would announce the wrong server, and its data would come from another
    model."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: connections of an earlier server still in TIME_WAIT do not count, a
        # socket listening there does
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def refuse_taken_port(host: str, port: int, who: str = "the server",
                      fix: str = "stop that process or pass another --port") -> None:
    """RefusedError (one line: the port, why, ``fix``) when ``port_taken``; nothing otherwise."""
    why = port_taken(host, port)
    if why:
        from ..errors import RefusedError

        raise RefusedError(f"port {port} on {host} is taken ({why}): {who} could not listen there, and whatever "
                           "does would answer in its place", fix)


def run(plan: Plan, say=None) -> int:
    """Start the server in its own process group and wait for it. Ctrl-C, SIGTERM and SIGHUP are
    passed on to that group; whatever of it is left when the launcher ends is killed. Returns the
    server's exit status (0 when it ended because it was asked to). A taken port is refused first
    (RefusedError)."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    from urllib.parse import urlsplit

    u = urlsplit(plan.url)
    refuse_taken_port(u.hostname, u.port)
    for d in plan.mkdirs:
        Path(d).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(a) for a in plan.argv], env=plan.environ(), stdin=subprocess.DEVNULL,
                            start_new_session=True)
    if plan.info_file is not None:
        info = json.loads(plan.info_file.read_text())
        info["server_pid"] = proc.pid
        plan.info_file.write_text(json.dumps(info, indent=2) + "\n")
    asked = []

    def forward(sig, _frame):
        asked.append(time.monotonic())
        _kill_group(proc.pid, signal.SIGTERM if sig == signal.SIGHUP else sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    threading.Thread(target=_announce, args=(proc, plan, say), daemon=True).start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if asked and time.monotonic() - asked[0] > STOP_GRACE_S:
                    _kill_group(proc.pid, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        _end_group(proc.pid)  # the scheduler, detokenizer and resource tracker it may leave
    if asked:
        say("[serve] server stopped")
        return 0
    return rc if rc >= 0 else 128 - rc


__all__ = ["Plan", "production_plan", "cpu_flags", "dump_flags", "parse_layers", "patched_tree_at", "port_taken",
           "refuse_taken_port", "run",
           "DUMP_FLAGS",
           "DEFAULT_HOST", "DEFAULT_PORT", "PINNED_RELEASE"]
