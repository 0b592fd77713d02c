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

``dump_settings`` reads the dump's other settings (``EAGLE3_DUMP_MAX_PENDING_MB``, ``_FINAL``,
``_DRAIN_S``, ``_MAX_WAIT_S``) from serve.py's flags, else from the user's environment, and checks
them before anything starts.

``run(plan)`` starts the server in its own process group, says when it answers, stops it with
SIGTERM on Ctrl-C, SIGTERM or SIGHUP, gives the dump writer its drain (``EAGLE3_DUMP_DRAIN_S``)
plus ``STOP_MARGIN_S`` before SIGKILL, and leaves no process of it behind.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shlex
import shutil
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
# SIGTERM to the server's process group: the dump writer drains its queue for at most
# EAGLE3_DUMP_DRAIN_S seconds, then exits; run() waits that long plus STOP_MARGIN_S (the rest of
# SGLang's shutdown) before SIGKILL
STOP_MARGIN_S = 30.0
DEFAULT_DRAIN_S = 20.0  # the dump's own default (eagle3_capture.settings.DEFAULT_DRAIN_S)


@dataclass(frozen=True)
class DumpSetting:
    """One of the dump's settings that serve.py passes on: its flag, variable, the dump's default
    and what its value is (``seconds``/``MiB``: a positive finite number; ``1/0``: a boolean);
    ``most``: a number's upper bound, where the dump has one."""

    flag: str
    var: str
    default: str
    unit: str
    most: float | None = None


MAX_GIL_SWITCH_MS = 100.0  # eagle3_capture.settings.MAX_GIL_SWITCH_MS
DUMP_SETTINGS = (
    DumpSetting("--max-pending-mb", "EAGLE3_DUMP_MAX_PENDING_MB", "4096", "MiB"),
    DumpSetting("--final", "EAGLE3_DUMP_FINAL", "1", "1/0"),
    DumpSetting("--drain-s", "EAGLE3_DUMP_DRAIN_S", f"{DEFAULT_DRAIN_S:g}", "seconds"),
    DumpSetting("--max-wait-s", "EAGLE3_DUMP_MAX_WAIT_S", "120", "seconds"),
    DumpSetting("--dump-dtype", "EAGLE3_DUMP_DTYPE", "bf16", "bf16|fp8"),
    DumpSetting("--rebuildable", "EAGLE3_DUMP_REBUILDABLE", "store", "store|omit"),
    # "auto": the server's default (the CPUs its rank may use, at most 4; printed in its start line)
    DumpSetting("--dump-writers", "EAGLE3_DUMP_WRITERS", "auto", "threads"),
    # no default: Python's own 5 ms unless given (eagle3_capture.settings.MAX_GIL_SWITCH_MS at most)
    DumpSetting("--dump-gil-switch-ms", "EAGLE3_DUMP_GIL_SWITCH_MS", "", "milliseconds", MAX_GIL_SWITCH_MS),
    DumpSetting("--sink", "EAGLE3_DUMP_SINK", "file", "file|mooncake"),
    # the Mooncake sink's (docs/online.md); no default: passed only when given
    DumpSetting("--mooncake-master", "EAGLE3_DUMP_MOONCAKE_MASTER", "", "host:port"),
    DumpSetting("--mooncake-metadata", "EAGLE3_DUMP_MOONCAKE_METADATA", "", "metadata"),
    DumpSetting("--mooncake-protocol", "EAGLE3_DUMP_MOONCAKE_PROTOCOL", "", "tcp|rdma"),
    DumpSetting("--mooncake-device", "EAGLE3_DUMP_MOONCAKE_DEVICE", "", "text"),
    DumpSetting("--mooncake-host", "EAGLE3_DUMP_MOONCAKE_HOST", "", "text"),
    DumpSetting("--mooncake-segment-mb", "EAGLE3_DUMP_MOONCAKE_SEGMENT_MB", "", "MiB"),
    DumpSetting("--mooncake-buffer-mb", "EAGLE3_DUMP_MOONCAKE_BUFFER_MB", "", "MiB"),
    DumpSetting("--mooncake-ttl-s", "EAGLE3_DUMP_MOONCAKE_TTL_S", "", "seconds"),
    # SpecForge's capture protocol (docs/online.md "Online with SpecForge"): its aux ids, off when not given
    DumpSetting("--specforge-ids", "EAGLE3_DUMP_SPECFORGE_IDS", "", "ids"),
)
MAX_WRITERS = 64  # eagle3_capture.settings.MAX_WRITERS
# what the dump reads as a boolean (eagle3_capture.settings._parse_bool)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


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


def _check_setting(st: DumpSetting, raw: str, from_flag: bool) -> str:
    """``raw`` (stripped) as the variable's value, or a UsageError naming where it came from."""
    value = str(raw).strip()
    boolean = st.unit == "1/0"
    choices = st.unit.split("|") if "|" in st.unit else None
    threads = st.unit == "threads"
    if boolean:
        ok = value.lower() in _TRUE + _FALSE
    elif st.unit == "host:port":
        host, sep, port = value.rpartition(":")
        ok = bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
    elif st.unit == "metadata":
        ok = value == "P2PHANDSHAKE" or value.startswith(("http://", "etcd://"))
    elif st.unit == "text":
        ok = bool(value) and not any(c.isspace() for c in value)
    elif st.unit == "ids":
        parts = value.split(",")
        ok = all(p.strip().isdigit() for p in parts) and len({int(p) for p in parts}) == len(parts)
        value = ",".join(str(int(p)) for p in parts) if ok else value
    elif threads:
        ok = value.isdigit() and 1 <= int(value) <= MAX_WRITERS
    elif choices:
        value = value.lower()
        ok = value in choices
    else:
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        ok = math.isfinite(number) and number > 0 and (st.most is None or number <= st.most)
    if ok:
        return value
    what = ("1 or 0" if boolean else " or ".join(choices) if choices else {
        "host:port": "host:port", "metadata": "http://host:port/metadata, etcd://... or P2PHANDSHAKE",
        "text": "one word", "ids": "distinct layer ids >= 0, comma-separated"}.get(st.unit) or (
            f"a whole number of threads from 1 to {MAX_WRITERS}" if threads else
            f"a number of {st.unit} above 0, at most {st.most:g}" if st.most is not None else
            f"a positive finite number of {st.unit}"))
    example = ("1 or 0" if boolean else what if choices else "e.g. 4" if threads else
               {"host:port": "e.g. 127.0.0.1:50051", "metadata": "e.g. http://127.0.0.1:8080/metadata",
                "text": "one word", "MiB": "e.g. 4096", "seconds": "e.g. 600", "ids": "e.g. 1,29,57",
                "milliseconds": "e.g. 1"}.get(st.unit) if not st.default else "e.g. " + st.default)
    if from_flag:
        raise UsageError(f"{st.flag} {raw!r} is not {what}",
                         f"pass e.g. {st.flag} 4" if threads else
                         f"pass {st.flag} {example.removeprefix('e.g. ')}" if not st.default else
                         f"pass e.g. {st.flag} {st.default}" if not (boolean or choices) else
                         f"pass {st.flag} 1 or {st.flag} 0" if boolean else f"pass {st.flag} {example}")
    raise UsageError(f"{st.var}={raw!r} (from the environment) is not {what}",
                     f"set it to {example}, unset it, or pass {st.flag}")


def dump_settings(flags: dict, environ=None) -> tuple[dict, list]:
    """(variables, notes): ``EAGLE3_DUMP_MAX_PENDING_MB``, ``_FINAL``, ``_DRAIN_S`` and ``_MAX_WAIT_S``
    for the server. ``flags`` maps a setting's flag (``--drain-s``) to the value given, or None:
    a flag wins over the user's environment, which is kept (not dropped) when no flag is given.
    ``EAGLE3_DUMP_DRAIN_S`` is always passed (its default when neither says), so the server drains
    for as long as ``run`` waits; the others only when given (the dump's default otherwise). Every
    value is checked here, before anything starts (UsageError: one line)."""
    environ = os.environ if environ is None else environ
    env, used = {}, []
    for st in DUMP_SETTINGS:
        if flags.get(st.flag) is not None:
            env[st.var] = _check_setting(st, flags[st.flag], True)
            used.append(f"{st.var}={env[st.var]} ({st.flag})")
        elif environ.get(st.var, "").strip():
            env[st.var] = _check_setting(st, environ[st.var], False)
            used.append(f"{st.var}={env[st.var]} (from the environment)")
        elif st.default:
            if st.var == "EAGLE3_DUMP_DRAIN_S":
                env[st.var] = st.default
            used.append(f"{st.var}={st.default} (default)")
    mooncake = [st for st in DUMP_SETTINGS if st.var.startswith("EAGLE3_DUMP_MOONCAKE_") and st.var in env]
    if env.get("EAGLE3_DUMP_SINK") == "mooncake" and "EAGLE3_DUMP_MOONCAKE_MASTER" not in env:
        raise UsageError("--sink mooncake needs the store's master", "pass --mooncake-master HOST:PORT "
                         "(and --mooncake-metadata http://HOST:PORT/metadata; docs/online.md)")
    if "EAGLE3_DUMP_SPECFORGE_IDS" in env and env.get("EAGLE3_DUMP_SINK") != "mooncake":
        raise UsageError("--specforge-ids needs the Mooncake sink (SpecForge reads its states from the store)",
                         "pass --sink mooncake --mooncake-master HOST:PORT --mooncake-metadata URL")
    if mooncake and env.get("EAGLE3_DUMP_SINK") != "mooncake":
        raise UsageError(f"{mooncake[0].flag} is set but the sink is file",
                         "pass --sink mooncake, or leave the Mooncake settings out")
    return env, ["dump settings: " + ", ".join(used)]


# ---- the Mooncake sink (docs/online.md) -----------------------------------------------------------

MOONCAKE_BINDS = ("warning: Mooncake listens on every address whatever it is told: the server's store client "
                  "opens two TCP ports on 0.0.0.0 and :: (no setting binds them; --mooncake-host only names the "
                  "address other clients reach it at), and mooncake_master's HTTP metadata server binds 0.0.0.0 "
                  "despite --http_metadata_server_host (its RPC port follows --rpc_address, its metrics server "
                  "--metrics_host); measured with mooncake-transfer-engine-non-cuda 0.3.13.post1. Keep these ports "
                  "behind a firewall where the network is not trusted")


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host, port


def mooncake_notes(settings: dict) -> list:
    """With the Mooncake sink (``settings``: ``dump_settings``' variables): where the states go, the
    ``mooncake_master`` command that binds what the settings name where it has a flag for it, where
    the package and the master come from, and what Mooncake binds whatever it is told. [] otherwise."""
    from ..mooncake import INSTALL

    if settings.get("EAGLE3_DUMP_SINK") != "mooncake":
        return []
    master = settings["EAGLE3_DUMP_MOONCAKE_MASTER"]
    metadata = settings.get("EAGLE3_DUMP_MOONCAKE_METADATA") or "P2PHANDSHAKE"
    host, port = _host_port(master)
    cmd = f"mooncake_master --rpc_address={host} --port={port} --metrics_host={host}"
    if metadata.startswith("http://"):
        mhost, mport = _host_port(metadata[len("http://"):].split("/", 1)[0])
        cmd += (f" --enable_http_metadata_server=true --http_metadata_server_host={mhost} "
                f"--http_metadata_server_port={mport}")
    return [f"Mooncake sink: each request's states go to the store of the mooncake_master at {master} (metadata "
            f"{metadata}), not to files (the dump directory keeps the stop ledger); each answer's "
            f"meta_info[\"eagle3_dump\"] names its object. Start the master first ({cmd}); it and the package the "
            f"server imports come from the package index: {INSTALL}",
            MOONCAKE_BINDS]


def mooncake_next_steps(url: str, settings: dict, python: str, extract: str | None = None) -> list:
    """What to run once a server with the Mooncake sink answers: a request, then its object read from
    the store with ``eaglepatch.mooncake.StoreReader``; then ``extract`` (a ``tools/extract.py``
    command line that reads the store: ``--mooncake-master``/``--mooncake-metadata``, see
    ``mooncake_extract``) where given."""
    src = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join([src] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    q = json.dumps  # the code holds double-quoted strings only: one single-quoted shell word
    code = ("import json, urllib.request as u; from eaglepatch.mooncake import StoreReader; "
            f"a = json.load(u.urlopen(u.Request({q(url + '/generate')}, json.dumps({{\"text\": \"Hello\", "
            "\"sampling_params\": {\"max_new_tokens\": 1}}).encode(), {\"Content-Type\": \"application/json\"}))); "
            f"t, m = StoreReader({q(settings['EAGLE3_DUMP_MOONCAKE_MASTER'])}, "
            f"{q(settings.get('EAGLE3_DUMP_MOONCAKE_METADATA') or 'P2PHANDSHAKE')}).tensors("
            "a[\"meta_info\"][\"eagle3_dump\"], timeout=30, delete=True); "
            "print({k: tuple(v.shape) for k, v in t.items()}, m[\"eagle3_layer_ids\"])")
    out = ["# each answer's meta_info[\"eagle3_dump\"] is its object's handle: one request, its states read from "
           "the store and deleted (docs/online.md, \"Reading\")",
           f"PYTHONPATH={shlex.quote(pythonpath)} {shlex.quote(python)} -c {shlex.quote(code)}"]
    if extract:
        out += ["# conversations to a dataset, read from the store (the mooncake package in that Python)", extract]
    return out


def mooncake_extract(extract_py: str, url: str, settings: dict, model: str, data: str, out: str) -> str:
    """The ``tools/extract.py`` line that reads this server's Mooncake store into a dataset."""
    q = shlex.quote
    return (f"python3 {q(extract_py)} --server {q(url)} --model {q(model)} --data {q(data)} --out {q(out)} "
            f"--mooncake-master {q(settings['EAGLE3_DUMP_MOONCAKE_MASTER'])} --mooncake-metadata "
            f"{q(settings.get('EAGLE3_DUMP_MOONCAKE_METADATA') or 'P2PHANDSHAKE')}")


def check_mooncake(plan: "Plan") -> None:
    """With the Mooncake sink: the server's interpreter imports the store's package with the
    environment it will run with, before the server starts (else the writing rank fails after the
    weights load); UsageError (one line: why, where the package comes from) otherwise."""
    from ..mooncake import INSTALL

    if plan.env.get("EAGLE3_DUMP_SINK") != "mooncake":
        return
    python = str(plan.argv[0])
    try:
        r = subprocess.run([python, "-c", "import mooncake.store"], capture_output=True, text=True,
                           env=plan.environ(), timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"--sink mooncake: cannot run {python} to look for the mooncake package ({exc})",
                         "pass --python PY: the interpreter of the server's environment") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[-1]
        raise UsageError(f"--sink mooncake but {python} cannot import the mooncake package the sink needs ({why})",
                         INSTALL)


def stop_grace_s(env: dict) -> float:
    """How long ``run`` waits, after its SIGTERM, before it kills the server: the dump's drain
    (``EAGLE3_DUMP_DRAIN_S`` as passed to the server, its default when not) plus ``STOP_MARGIN_S``."""
    try:
        drain = float(env.get("EAGLE3_DUMP_DRAIN_S") or DEFAULT_DRAIN_S)
    except ValueError:
        drain = DEFAULT_DRAIN_S
    if not (math.isfinite(drain) and drain > 0):
        drain = DEFAULT_DRAIN_S
    return drain + STOP_MARGIN_S


def check_host(host: str) -> str:
    """``--host`` as launch_server takes it: an IPv6 address given in brackets (``[::1]``) loses
    them; an empty host is refused."""
    h = str(host).strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if not h or any(c.isspace() or c in "[]/" for c in h):
        raise UsageError(f"--host {host!r} is not an address to listen on",
                         "pass an IP address or host name, e.g. --host 127.0.0.1 or --host ::1")
    if ":" in h:
        try:
            ipaddress.IPv6Address(h)
        except ValueError:
            raise UsageError(f"--host {host!r} is not an IPv6 address", "pass e.g. --host ::1") from None
    return h


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
    quiet: bool = False  # --quiet: serve.py says only the ready line, what follows it, warnings and the stop

    def stop_grace_s(self) -> float:
        return stop_grace_s(self.env)

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


def refuse_separator_in_a_name(value, flag: str = "--dump-dir") -> None:
    """A usage error when ``value`` (a list of directories separated by ``os.pathsep``) holds an
    existing path whose own name contains the separator (``a:b``, or ``/data/x:y/dumps`` where
    ``/data/x:y`` exists): split, it would name other directories (``a`` and ``b``), which serving
    would create, and the server splits ``EAGLE3_DUMP_DIR`` the same way, so no such name can be
    passed. Nothing is created or read beyond a stat of each candidate."""
    text = str(value)
    parts = text.split(os.pathsep)
    for k in range(len(parts) - 1):
        head = parts[k + 1].split(os.sep)[0]
        for i in range(k + 1):
            joined = os.pathsep.join(parts[i:k + 1]) + os.pathsep + head
            if os.path.lexists(os.path.expanduser(joined)):
                link = f"/tmp/dumps-{os.getpid()}"
                raise UsageError(
                    f"{flag} {text!r}: {joined!r} exists, and a name holding {os.pathsep!r} cannot be used: "
                    f"{os.pathsep!r} separates dump directories (serve.py and the server split "
                    f"EAGLE3_DUMP_DIR there)",
                    f"rename it, or pass a symbolic link to it whose path has no {os.pathsep!r} "
                    f"(ln -s {shlex.quote(os.path.abspath(os.path.expanduser(joined)))} {link}; {flag} {link})")


def dump_dir_list(value) -> list:
    """``--dump-dir``: one directory, or several separated by ``os.pathsep`` (``EAGLE3_DUMP_DIR=A:B``,
    one per local disk; the server spreads the files by key and ``tools/extract.py --dump-dir A:B``
    reads them all). Each absolute; any that is missing is created at start. An existing directory
    whose name holds the separator is refused first (``refuse_separator_in_a_name``)."""
    from ..extract.dumps import dump_dir_entries

    refuse_separator_in_a_name(value)
    dirs = [d.expanduser().absolute() for d in dump_dir_entries(value)]
    for d in dirs:
        if d.exists() and not d.is_dir():
            raise UsageError(f"--dump-dir {d} is a file", "pass a directory (it is created when missing)")
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
            raise UsageError(f"--dump-dir {d} is not writable", "pass a directory the server can write")
    return dirs


@dataclass
class DraftDump:
    """What a draft config makes the dump capture (``draft_dump``)."""

    family: str  # eagle3 | dflash | dspark (the readings table's families)
    ids: list | None  # the ids as the draft names them (None: the release's EAGLE-3 default)
    how: str  # where they come from
    path: str

    def apply(self, settings: dict, notes: list) -> list | None:
        """Set the dump's reading in ``settings`` (EAGLE3_DUMP_READING), say so in ``notes``; the
        layers to dump (EAGLE3_DUMP_LAYERS, in the draft's own reading)."""
        from ..conventions import FAMILY_NAMES

        if self.family != "eagle3":
            settings["EAGLE3_DUMP_READING"] = self.family
        if self.family == "dspark" and settings.get("EAGLE3_DUMP_FINAL", "1").strip() in ("0", "false", "no", "off"):
            raise UsageError("--draft-config names a DSpark draft, which trains on the post-norm final state, and the "
                             "final state is not dumped", "drop --final 0 (and EAGLE3_DUMP_FINAL=0)")
        notes.append(f"dumping what the {FAMILY_NAMES[self.family]} draft {self.path} reads: ids "
                     f"{self.ids if self.ids is not None else 'none (the release default)'} ({self.how}), read as the "
                     f"served release reads {FAMILY_NAMES[self.family]} ids"
                     + (" (EAGLE3_DUMP_READING=" + self.family + ")" if self.family != "eagle3" else "")
                     + ("; and the post-norm final state its trainer needs" if self.family == "dspark" else ""))
        return self.ids


def draft_dump(draft_config, model_dir, demo=None) -> DraftDump:
    """The layers the draft at ``draft_config`` reads, for the dump: an EAGLE-3 draft's ids as written;
    a DFlash/DSpark draft's ids (or, where it names none, the ids sglang picks for this target:
    ``guard.block_ids``); the family's reading goes to the server (EAGLE3_DUMP_READING), which reads
    them as the release reads that family's ids. A draft SGLang does not serve is refused."""
    from .. import guard

    draft = guard.read_draft(draft_config)
    family = guard.table_family(draft.family)
    if draft.family == guard.SPECULATORS:
        raise UsageError(f"--draft-config {draft.path} is a speculators (vLLM) draft, which SGLang does not serve",
                         "name the layers to dump with --layers (N-1 for the last slot speculators reads)")
    if family == "eagle3":
        return DraftDump(family, list(draft.layer_ids) if draft.layer_ids is not None else None,
                         "eagle_config.eagle_aux_hidden_state_layer_ids" if draft.layer_ids is not None else
                         "none configured: the release's default", draft.path)
    if demo is not None:  # the CPU demo's built-in model (its directory may not be made yet)
        from ..smoke.tinyconfig import DEEPSEEK_V3

        n = DEEPSEEK_V3["num_hidden_layers"]
    else:
        n = _target_layers(model_dir)
    ids, how, problems = guard.block_ids(draft, n)
    if problems or not ids:
        raise UsageError(f"--draft-config {draft.path}: {problems[0] if problems else 'it names no layers'}",
                         "fix the draft config (its target_layer_ids are ids of this target's layers)")
    return DraftDump(family, ids, how or (draft.ids_field or "target_layer_ids"), draft.path)


def _target_layers(model_dir) -> int:
    """The decoder layers of the target at ``model_dir`` (its config.json, or its text_config)."""
    cfg_path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
        cfg = cfg.get("text_config") or cfg
        return int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"cannot read the target's num_hidden_layers from {cfg_path} ({type(exc).__name__}: {exc})",
                         "pass --model-path a local model directory (a DFlash/DSpark draft's default layers depend "
                         "on the target's)") from None


def production_plan(model_path: str, dump_dir, layers=None, sglang=None, series_dir=None, python=None,
                    host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, extra=(), settings=None) -> Plan:
    """``launch_server`` for ``model_path`` on this machine's accelerators with the dump on;
    ``settings``: the dump variables of ``dump_settings`` (default: from the environment)."""
    settings = dump_settings({})[0] if settings is None else settings
    python = str(python or sys.executable)
    dump_dirs = dump_dir_list(dump_dir)
    probe = _probe_python(python)
    env = {"EAGLE3_DUMP_DIR": os.pathsep.join(map(str, dump_dirs))}
    if layers is not None:
        env["EAGLE3_DUMP_LAYERS"] = ",".join(map(str, layers))
    env.update(settings)
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
    notes += mooncake_notes(settings)
    after = ([f"[serve] next, from another shell in {os.getcwd()}:"]
             + ["  " + c for c in mooncake_next_steps(
                 _url(host, port), settings, python,
                 mooncake_extract(str(Path(__file__).resolve().parents[3] / "tools" / "extract.py"), _url(host, port),
                                  settings, str(model_path), "CONVERSATIONS.jsonl", "DATASET"))]
             if settings.get("EAGLE3_DUMP_SINK") == "mooncake" else [])
    return Plan(argv, env, _url(host, port), pp if sglang is not None else None, notes, dump_dirs, after)


def _url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on ``host``: a wildcard address by its
    loopback, an IPv6 address in brackets (``http://[::1]:30000``)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


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


def _end_group(pgid: int, grace: float = 5.0, term: bool = True, grace_term: float = 5.0) -> None:
    """Give what is left of the group ``grace`` seconds to finish on its own (the resource tracker
    removes the semaphores it tracks), then (``term``) SIGTERM and ``grace_term`` seconds more,
    then SIGKILL."""
    steps = [(None, grace)] + ([(signal.SIGTERM, grace_term)] if term else []) + [(signal.SIGKILL, 5.0)]
    for sig, wait in steps:
        if sig is not None:
            _kill_group(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def _bind_error(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives (as uvicorn binds), or None when it could."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: connections of an earlier server still in TIME_WAIT do not count, a
        # socket listening there does
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc
    return None


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on because something holds it, or None when it is free
    (or cannot be listened on for another reason: ``refuse_taken_port`` names those). A server
    started on a taken port fails to bind while whatever holds it answers /health in its place: the
    launcher would announce the wrong server, and its data would come from another model."""
    import errno

    exc = _bind_error(host, port)
    return (exc.strerror or str(exc)) if exc is not None and exc.errno == errno.EADDRINUSE else None


def refuse_taken_port(host: str, port: int, who: str = "the server",
                      fix: str = "stop that process or pass another --port") -> None:
    """Nothing when the server can listen on ``host:port``; else one line: a taken port
    (RefusedError: the port, why, ``fix``), a host that names no address (UsageError), one that
    is no address of this machine (UsageError), or another reason the bind gives (RefusedError)."""
    import errno
    import socket

    from ..errors import RefusedError

    exc = _bind_error(host, port)
    if exc is None:
        return
    why = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror):
        raise UsageError(f"--host {host!r} names no address this machine can resolve ({why})",
                         "pass an IP address of this machine or a name that resolves to one, e.g. --host 127.0.0.1")
    if exc.errno == errno.EADDRNOTAVAIL:
        raise UsageError(f"--host {host} is no address of this machine ({why}): {who} could not listen there",
                         "pass one of this machine's addresses, e.g. --host 127.0.0.1 or --host 0.0.0.0")
    if exc.errno == errno.EADDRINUSE:
        raise RefusedError(f"port {port} on {host} is taken ({why}): {who} could not listen there, and whatever "
                           "does would answer in its place", fix)
    raise RefusedError(f"{who} could not listen on {host} port {port} ({why})",
                       "pass a port this user may listen on (1024 and above unless root) or another --host")


def run(plan: Plan, say=None) -> int:
    """Start the server in its own process group and wait for it. Ctrl-C, SIGTERM and SIGHUP send
    SIGTERM to that group (the signal the dump writer drains on), and the group gets
    ``plan.stop_grace_s()`` (the drain plus ``STOP_MARGIN_S``) to end before SIGKILL; whatever of it
    is left when the launcher ends is killed. Returns the server's exit status (0 when it ended
    because it was asked to). A taken port is refused first (RefusedError)."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    from urllib.parse import urlsplit

    u = urlsplit(plan.url)
    refuse_taken_port(u.hostname, u.port)
    check_mooncake(plan)
    for d in plan.mkdirs:
        Path(d).mkdir(parents=True, exist_ok=True)
    if not plan.quiet:  # the ready line's own words are not said before it: a log watcher waits for them
        say("[serve] starting the server (its own log follows; until the ready line, warnings, an "
            "openai_harmony traceback and \"/health ... 503\" lines are its warm-up, not a failure)")
    env, tmp = launch_environ(plan)
    try:
        return _run(plan, env, say)
    finally:
        # what SGLang leaves in its temp dir (the ZMQ IPC sockets of its processes, files it made with
        # delete=False) goes with this launch; its processes are gone by now
        shutil.rmtree(tmp, ignore_errors=True)


def launch_environ(plan: Plan) -> tuple[dict, str]:
    """(the server's environment, the temp dir made for this launch): ``plan.environ()`` with TMPDIR
    a new directory in this process's temp dir (SGLang 0.5.9's ``PortArgs`` names each ZMQ IPC
    socket after a ``NamedTemporaryFile(delete=False)`` there, and removes none), which ``run``
    removes at the stop; torch's compile cache keeps its usual place in the user's temp dir
    (TORCHINDUCTOR_CACHE_DIR, unless set), so it outlives the launch."""
    import getpass
    import tempfile

    env = plan.environ()
    tmp = tempfile.mkdtemp(prefix="eaglepatch-serve-")
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    env["TMPDIR"] = tmp
    return env, tmp


def _run(plan: Plan, env: dict, say) -> int:
    """``run`` from the start of the server in ``env`` to its stop."""
    proc = subprocess.Popen([str(a) for a in plan.argv], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    if plan.info_file is not None:
        info = json.loads(plan.info_file.read_text())
        info["server_pid"] = proc.pid
        plan.info_file.write_text(json.dumps(info, indent=2) + "\n")
    asked = []
    grace = plan.stop_grace_s()

    def forward(_sig, _frame):
        asked.append(time.monotonic())
        _kill_group(proc.pid, signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    threading.Thread(target=_announce, args=(proc, plan, say), daemon=True).start()
    told = False
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if asked and not told:
                    told = True
                    say(f"[serve] stopping: waiting up to {grace:g} s for the dump to drain")
                if asked and time.monotonic() - asked[0] > grace:
                    _kill_group(proc.pid, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        # the scheduler, detokenizer and resource tracker it may leave; after a stop, what is left
        # of the drain's time (the writing process may outlive launch_server's own process)
        if asked:
            left = asked[0] + grace - time.monotonic()
            if not told and left > 0 and _group_alive(proc.pid):  # launch_server ended, its writer may not have
                say(f"[serve] stopping: waiting up to {grace:g} s for the dump to drain")
            _end_group(proc.pid, max(0.0, left), term=False)
        else:
            _end_group(proc.pid, grace_term=grace)
    if asked:
        say("[serve] server stopped")
        return 0
    return rc if rc >= 0 else 128 - rc


__all__ = ["Plan", "production_plan", "cpu_flags", "dump_flags", "dump_settings", "check_host", "parse_layers",
           "check_mooncake", "mooncake_notes", "mooncake_next_steps", "mooncake_extract",
           "patched_tree_at", "port_taken", "refuse_taken_port", "run", "stop_grace_s",
           "DUMP_FLAGS", "DUMP_SETTINGS", "STOP_MARGIN_S",
           "DEFAULT_HOST", "DEFAULT_PORT", "PINNED_RELEASE"]
