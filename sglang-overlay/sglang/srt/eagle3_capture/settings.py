"""Environment settings of the hidden-state dump and the checks that guard them."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import uuid
from typing import List, Optional, Sequence

from .release import SERIES_RELEASE, SERIES_VERSION, UPSTREAM_EAGLE_ID_MAPPING
from .storage import DTYPES, REBUILDABLE, Storage

__all__ = ["SERIES_RELEASE", "SERIES_VERSION"]  # re-exported for the package

ENV_DIR = "EAGLE3_DUMP_DIR"
ENV_LAYERS = "EAGLE3_DUMP_LAYERS"
ENV_FINAL = "EAGLE3_DUMP_FINAL"
ENV_MAX_PENDING_MB = "EAGLE3_DUMP_MAX_PENDING_MB"
ENV_LAUNCH = "EAGLE3_DUMP_LAUNCH_ID"  # one id per launch: set by the launch check, inherited by the workers
ENV_DRAIN_S = "EAGLE3_DUMP_DRAIN_S"
ENV_MAX_WAIT_S = "EAGLE3_DUMP_MAX_WAIT_S"
ENV_DTYPE = "EAGLE3_DUMP_DTYPE"  # bf16 (default) | fp8: how states are stored (storage.py)
ENV_REBUILDABLE = "EAGLE3_DUMP_REBUILDABLE"  # store (default) | omit: states a trainer rebuilds
ENV_WRITERS = "EAGLE3_DUMP_WRITERS"  # threads writing files at once (commits.py); default from the CPUs
# the writing process's GIL switch interval (sys.setswitchinterval), milliseconds; unset: Python's 5 ms.
# The dump's threads share the GIL with SGLang's scheduler thread, which runs Python all the time: each
# time one of them needs the GIL it waits up to this long (docs/peers.md, session 16)
ENV_GIL_SWITCH_MS = "EAGLE3_DUMP_GIL_SWITCH_MS"
MAX_GIL_SWITCH_MS = 100.0
ENV_READING = "EAGLE3_DUMP_READING"  # eagle3 (default) | dflash | dspark: whose reading EAGLE3_DUMP_LAYERS follows
FAMILIES = ("eagle3", "dflash", "dspark")
MAX_WRITERS = 64
ENV_SINK = "EAGLE3_DUMP_SINK"  # file (default) | mooncake: where each request's states go (sinks.py)
SINKS = ("file", "mooncake")
ENV_MC_MASTER = "EAGLE3_DUMP_MOONCAKE_MASTER"  # host:port of mooncake_master
ENV_MC_METADATA = "EAGLE3_DUMP_MOONCAKE_METADATA"  # http://host:port/metadata, or P2PHANDSHAKE
ENV_MC_PROTOCOL = "EAGLE3_DUMP_MOONCAKE_PROTOCOL"  # tcp (default) | rdma
ENV_MC_DEVICE = "EAGLE3_DUMP_MOONCAKE_DEVICE"  # RDMA device names (rdma only)
ENV_MC_HOST = "EAGLE3_DUMP_MOONCAKE_HOST"  # this node's address the store's peers reach
ENV_MC_SEGMENT_MB = "EAGLE3_DUMP_MOONCAKE_SEGMENT_MB"  # memory this client gives the store
ENV_MC_BUFFER_MB = "EAGLE3_DUMP_MOONCAKE_BUFFER_MB"  # this client's transfer buffer
ENV_MC_TTL_S = "EAGLE3_DUMP_MOONCAKE_TTL_S"  # an object nobody deleted is removed this long after its commit
MOONCAKE_VARS = (ENV_MC_MASTER, ENV_MC_METADATA, ENV_MC_PROTOCOL, ENV_MC_DEVICE, ENV_MC_HOST, ENV_MC_SEGMENT_MB,
                 ENV_MC_BUFFER_MB, ENV_MC_TTL_S)
DEFAULT_MC_SEGMENT_MB = 4096
DEFAULT_MC_BUFFER_MB = 2048
DEFAULT_MC_TTL_S = 600.0
REACH_TIMEOUT_S = 5.0
DUMP_VARS = ("EAGLE3_DUMP_DIR", "EAGLE3_DUMP_LAYERS", "EAGLE3_DUMP_READING", "EAGLE3_DUMP_FINAL", "EAGLE3_DUMP_MAX_PENDING_MB",
             "EAGLE3_DUMP_DRAIN_S", "EAGLE3_DUMP_MAX_WAIT_S", "EAGLE3_DUMP_DTYPE", "EAGLE3_DUMP_REBUILDABLE", "EAGLE3_DUMP_WRITERS",
             "EAGLE3_DUMP_GIL_SWITCH_MS", "EAGLE3_DUMP_SINK", "EAGLE3_DUMP_MOONCAKE_MASTER",
             "EAGLE3_DUMP_MOONCAKE_METADATA",
             "EAGLE3_DUMP_MOONCAKE_PROTOCOL", "EAGLE3_DUMP_MOONCAKE_DEVICE", "EAGLE3_DUMP_MOONCAKE_HOST",
             "EAGLE3_DUMP_MOONCAKE_SEGMENT_MB", "EAGLE3_DUMP_MOONCAKE_BUFFER_MB", "EAGLE3_DUMP_MOONCAKE_TTL_S",
             "EAGLE3_DUMP_SPECFORGE_IDS")
# SIGTERM to the writing process: how long it writes what is queued before it exits (docker stop
# waits 10 s, Slurm's KillWait and Kubernetes 30 s, systemd 90 s: set the runtime's grace above it)
DEFAULT_DRAIN_S = 20.0
# how long a forward waits for room in the host arena (a hung dump disk) before its rows are failed
DEFAULT_MAX_WAIT_S = 120.0
# the host arena's size: one 30K-token Kimi-K2.5 prefill of 4 layers + final (30000 x 7168 x 2 x 5
# bytes = 2051 MiB) fits with room beside it for the next forwards (README: sizing the arena)
DEFAULT_MAX_PENDING_MB = 4096


class DumpConfigError(ValueError):
    """A setting under which the dump would be wrong; the message names the fix."""


# How a draft-config id list (eagle_aux_hidden_state_layer_ids) reads, per upstream convention
# (release.UPSTREAM_EAGLE_ID_MAPPING, the one release difference in draft ids): where unpatched
# sglang serves a list, the series reads it the same way; it adds only what upstream cannot serve:
# -1 (the embedding output) and capture index N (the last layer's output before the final norm).
#   "plus_one" (sglang 0.5.9 .. 0.5.13): id k -> capture index k + 1 for every list.
#   "plus_one_if_first_is_one" (0.5.14+, PR #25454): k -> k + 1 when the first id is 1, otherwise
#       the ids are capture indices. The series reads a list holding -1 as k -> k + 1 too
#       ([-1, 1, 2] -> [0, 2, 3]); upstream captures nothing at index -1, so it serves no such list.
# EAGLE3_DUMP_LAYERS is read by the same rule, so one id list means the same layers in the dump
# and in a draft config on every release.
READINGS = {
    "plus_one": "plus_one",
    "plus_one_if_first_is_one": "plus_one_if_first_is_one_or_minus_one",
}


def reading(family: str = "eagle3") -> str:
    """The series' reading of a ``family`` draft's config ids on this release (a key of the tools'
    table, ``eaglepatch.conventions.RULES``): EAGLE-3's by the release's convention, DFlash's and
    DSpark's as the release's facts declare them (``draft_readings``)."""
    if family != "eagle3":
        rule = release_facts()["draft_readings"].get(family)
        if rule is None:
            raise DumpConfigError(
                f"{ENV_READING}={family}: sglang {SERIES_RELEASE} serves no {family} draft on the model files the "
                f"series covers; unset {ENV_READING} (on this release {ENV_LAYERS} is read as output-of-layer ids)")
        return rule
    try:
        return READINGS[UPSTREAM_EAGLE_ID_MAPPING]
    except KeyError:
        raise DumpConfigError(
            f"eagle3_capture for sglang {SERIES_RELEASE} declares an unknown upstream id convention "
            f"{UPSTREAM_EAGLE_ID_MAPPING!r}; regenerate the series with tools/export.py --overlay"
        ) from None


def capture_indices(layer_ids: Sequence[int], num_layers: int, what: str, family: str = "eagle3") -> List[int]:
    """The capture indices (= Hugging Face ``output_hidden_states`` indices: 0 = embedding output,
    i = output of layer i - 1, ``num_layers`` = the last layer's output before the final norm) that
    ``layer_ids`` names on this release, read as a ``family`` draft's are, in the order given;
    refuses lists no release serves."""
    ids = [int(k) for k in layer_ids]
    if not ids:
        raise DumpConfigError(f"{what} is empty; name at least one layer, e.g. {what}=[1, 29, 57]")
    if reading(family) == "plus_one" or ids[0] == 1 or -1 in ids:
        indices = [k + 1 for k in ids]
        convention = "id k = output of decoder layer k, -1 = embedding output"
    else:
        indices = list(ids)
        convention = ("ids are capture indices (the first id is not 1 and none is -1): 0 = embedding "
                      "output, i = output of decoder layer i-1")
    bad = [k for k, i in zip(ids, indices) if not 0 <= i <= num_layers]
    if bad:
        raise DumpConfigError(
            f"{what} {ids}: ids {bad} are out of range for a {num_layers}-layer model on sglang "
            f"{SERIES_RELEASE} ({convention}; capture index {num_layers} is the last layer's output "
            f"before the final norm)"
        )
    if len(set(indices)) != len(indices):
        raise DumpConfigError(
            f"{what} {ids} names capture indices {indices} on sglang {SERIES_RELEASE} ({convention}): "
            f"a layer twice; name each layer once"
        )
    return indices


def default_capture_indices(num_layers: int) -> List[int]:
    """What SGLang captures when a draft names no ids (upstream's default), ascending, once each
    (small models repeat a default index)."""
    return sorted({2, num_layers // 2, num_layers - 3})


def layer_output_id(index: int) -> int:
    """Capture index -> the release-independent layer-output id (-1 = embedding output, k = output
    of decoder layer k): the name of a dumped layer (``layer.<k>``) and the dump's
    ``eagle3_layer_ids``."""
    return index - 1


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise DumpConfigError(f"{name}={raw!r} is not a boolean; use 1 or 0")


MAX_SECONDS = 7 * 24 * 3600.0  # a week: the longest any wait of the dump may be set to (longer is a typo)


def memory_mib() -> int:
    """This machine's physical memory, MiB."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20


def _positive(env, name: str, default: float, unit: str, most: Optional[float] = None,
              most_why: str = "") -> float:
    """A positive finite number from ``env[name]`` (``default`` when unset), at most ``most``
    (None: ``MAX_SECONDS`` for seconds, this machine's memory for MiB)."""
    raw = env.get(name, "").strip() or repr(default)
    try:
        value = float(raw) if raw.isascii() else float("nan")
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise DumpConfigError(f"{name}={raw!r} must be a positive finite number of {unit}; "
                              f"use e.g. {name}={default:g}")
    if most is None:
        most, most_why = ((MAX_SECONDS, "a week") if unit == "seconds" else
                          (memory_mib(), "this machine's memory"))
    if value > most:
        raise DumpConfigError(f"{name}={raw!r} is more than {most:g} {unit} ({most_why}); "
                              f"use e.g. {name}={min(default, most):g}")
    return value


def _count(env, name: str, most: int) -> Optional[int]:
    """A whole number 1..``most`` from ``env[name]``; None when unset (the default applies)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= most):
        raise DumpConfigError(f"{name}={raw!r} must be a whole number from 1 to {most}; use e.g. {name}=4, "
                              f"or unset it for the default")
    return int(raw)


def _gil_switch_ms(env) -> Optional[float]:
    """``EAGLE3_DUMP_GIL_SWITCH_MS``: milliseconds above 0, at most ``MAX_GIL_SWITCH_MS``; None when unset."""
    if not env.get(ENV_GIL_SWITCH_MS, "").strip():
        return None
    return _positive(env, ENV_GIL_SWITCH_MS, 1.0, "milliseconds", MAX_GIL_SWITCH_MS,
                     "a thread waiting for the GIL would wait that long")


def _choice(env, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` from ``env[name]`` (the first when unset)."""
    raw = env.get(name, "").strip()
    value = raw.lower() or choices[0]
    if value not in choices:
        raise DumpConfigError(f"{name}={raw!r} is not one of {', '.join(choices)}; use e.g. {name}={choices[-1]}")
    return value


def _host_port(name: str, raw: str) -> tuple:
    host, sep, port = raw.strip().rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise DumpConfigError(f"{name}={raw!r} is not host:port; use e.g. {name}=127.0.0.1:50051")
    return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    """The Mooncake Store client of the writing rank (``EAGLE3_DUMP_MOONCAKE_*``)."""

    master: str
    metadata_server: str
    protocol: str = "tcp"
    device: str = ""
    local_host: str = "127.0.0.1"
    segment_bytes: int = DEFAULT_MC_SEGMENT_MB << 20
    buffer_bytes: int = DEFAULT_MC_BUFFER_MB << 20
    ttl_s: float = DEFAULT_MC_TTL_S  # objects not deleted by then are removed by the writing rank (sinks.py)

    @classmethod
    def from_env(cls, env) -> "MooncakeSettings":
        master = env.get(ENV_MC_MASTER, "").strip()
        if not master:
            raise DumpConfigError(f"{ENV_SINK}=mooncake needs {ENV_MC_MASTER} (the mooncake_master's host:port); "
                                  f"set e.g. {ENV_MC_MASTER}=127.0.0.1:50051")
        _host_port(ENV_MC_MASTER, master)
        metadata = env.get(ENV_MC_METADATA, "").strip() or "P2PHANDSHAKE"
        if metadata != "P2PHANDSHAKE" and not metadata.startswith(("http://", "etcd://")):
            raise DumpConfigError(f"{ENV_MC_METADATA}={metadata!r} is neither P2PHANDSHAKE nor an http:// or etcd:// "
                                  f"address; use e.g. {ENV_MC_METADATA}=http://127.0.0.1:8080/metadata")
        return cls(master, metadata, _choice(env, ENV_MC_PROTOCOL, ("tcp", "rdma")),
                   env.get(ENV_MC_DEVICE, "").strip(), env.get(ENV_MC_HOST, "").strip() or "127.0.0.1",
                   int(_positive(env, ENV_MC_SEGMENT_MB, DEFAULT_MC_SEGMENT_MB, "MiB") * (1 << 20)),
                   int(_positive(env, ENV_MC_BUFFER_MB, DEFAULT_MC_BUFFER_MB, "MiB") * (1 << 20)),
                   _positive(env, ENV_MC_TTL_S, DEFAULT_MC_TTL_S, "seconds"))

    def check_reachable(self) -> None:
        """The master (and an http metadata server) accept a connection, or the launch ends."""
        import socket

        targets = [(ENV_MC_MASTER, self.master)]
        if self.metadata_server.startswith("http://"):
            targets.append((ENV_MC_METADATA, self.metadata_server[len("http://"):].split("/", 1)[0]))
        for name, address in targets:
            host, port = _host_port(name, address)
            try:
                socket.create_connection((host, port), timeout=REACH_TIMEOUT_S).close()
            except OSError as exc:
                raise DumpConfigError(f"{name}={address!r} cannot be reached ({exc.strerror or exc}); start "
                                      f"mooncake_master there (--enable_http_metadata_server=true for an http "
                                      f"metadata server) or point {name} at it") from None


@dataclasses.dataclass(frozen=True)
class DumpSettings:
    directory: str
    layer_ids: Optional[List[int]]  # as given (the release's draft-id reading); None: the default
    final: bool
    max_pending_bytes: int
    drain_s: float = DEFAULT_DRAIN_S  # SIGTERM: the longest the writing process writes before it exits
    max_wait_s: float = DEFAULT_MAX_WAIT_S  # the longest a forward waits for room in the arena
    storage: Storage = Storage()  # EAGLE3_DUMP_DTYPE, EAGLE3_DUMP_REBUILDABLE
    writers: Optional[int] = None  # EAGLE3_DUMP_WRITERS; None: commits.default_writers()
    gil_switch_ms: Optional[float] = None  # EAGLE3_DUMP_GIL_SWITCH_MS; None: the interpreter's own
    family: str = "eagle3"  # EAGLE3_DUMP_READING: whose reading layer_ids follow
    sink: str = "file"  # EAGLE3_DUMP_SINK
    mooncake: Optional[MooncakeSettings] = None  # EAGLE3_DUMP_MOONCAKE_*, with the mooncake sink
    specforge_ids: Optional[tuple] = None  # EAGLE3_DUMP_SPECFORGE_IDS: SpecForge's capture protocol (specforge.py)

    @classmethod
    def from_env(cls, env=None) -> Optional["DumpSettings"]:
        env = os.environ if env is None else env
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            return None
        layer_ids = None
        raw_layers = env.get(ENV_LAYERS, "").strip()
        if raw_layers:
            parts = [part.strip() for part in raw_layers.split(",") if part.strip()]
            if not all(re.fullmatch(r"[-+]?[0-9]{1,6}", part) for part in parts):
                raise DumpConfigError(
                    f"{ENV_LAYERS}={raw_layers!r} is not a comma-separated list of "
                    f"integers; use e.g. {ENV_LAYERS}=-1,2,30"
                )
            layer_ids = [int(part) for part in parts]
            if not layer_ids:
                raise DumpConfigError(
                    f"{ENV_LAYERS}={raw_layers!r} names no layer; use e.g. {ENV_LAYERS}=-1,2,30"
                )
        final = _parse_bool(ENV_FINAL, env.get(ENV_FINAL, "1"))
        # the arena is allocated (and page-locked on CUDA) whole at start: half the memory at most
        cap_mb = _positive(env, ENV_MAX_PENDING_MB, DEFAULT_MAX_PENDING_MB, "MiB", memory_mib() // 2,
                           "half of this machine's memory: the arena is allocated and page-locked whole at start")
        dirs = _directories(directory)
        sink = _sink(env)
        if len(dirs) > 1 and sink["sink"] != "file":
            raise DumpConfigError(f"{ENV_DIR}={directory!r} names {len(dirs)} directories, which spread dump files, "
                                  f"but {ENV_SINK}={sink['sink']} writes none (only its stop ledger goes to "
                                  f"{ENV_DIR}); give one directory")
        return cls(os.pathsep.join(dirs), layer_ids, final, int(cap_mb * (1 << 20)),
                   drain_s=_positive(env, ENV_DRAIN_S, DEFAULT_DRAIN_S, "seconds"),
                   max_wait_s=_positive(env, ENV_MAX_WAIT_S, DEFAULT_MAX_WAIT_S, "seconds"),
                   storage=Storage(_choice(env, ENV_DTYPE, tuple(DTYPES)), _choice(env, ENV_REBUILDABLE, REBUILDABLE)),
                   writers=_count(env, ENV_WRITERS, MAX_WRITERS), gil_switch_ms=_gil_switch_ms(env),
                   family=_choice(env, ENV_READING, FAMILIES),
                   specforge_ids=_specforge_ids(env, sink["sink"]), **sink)

    @property
    def directories(self) -> List[str]:
        """``directory``'s directories: one, or several (files spread by key, ``sinks.spread``)."""
        return dump_directories(self.directory)

    def capture_indices(self, num_layers: int) -> List[int]:
        """The capture indices the dump writes, ascending: the ids read as a draft's are on this
        release (``capture_indices``), or upstream's default."""
        if self.layer_ids is None:
            return default_capture_indices(num_layers)
        return sorted(capture_indices(self.layer_ids, num_layers, ENV_LAYERS, self.family))


def _specforge_ids(env, sink: str) -> Optional[tuple]:
    """EAGLE3_DUMP_SPECFORGE_IDS: the aux ids SpecForge's ``spec_capture`` requests get (None: the
    protocol is off); its objects go to a Mooncake Store only."""
    from .specforge import ENV_IDS, parse_ids

    raw = env.get(ENV_IDS, "").strip()
    if not raw:
        return None
    try:
        ids = parse_ids(raw)
    except ValueError as exc:
        raise DumpConfigError(str(exc)) from None
    if sink != "mooncake":
        raise DumpConfigError(f"{ENV_IDS} is set but {ENV_SINK} is {sink!r}; SpecForge reads its states from a "
                              f"Mooncake Store: set {ENV_SINK}=mooncake (serve.py --sink mooncake)")
    return ids


def _sink(env) -> dict:
    sink = _choice(env, ENV_SINK, SINKS)
    if sink == "mooncake":
        return {"sink": sink, "mooncake": MooncakeSettings.from_env(env)}
    given = [v for v in MOONCAKE_VARS if env.get(v, "").strip()]
    if given:  # a store configured and never written to: say so rather than write files silently
        raise DumpConfigError(f"{', '.join(given)} set but {ENV_SINK} is {sink!r}; set {ENV_SINK}=mooncake or "
                              f"unset them")
    return {"sink": sink}


def dump_directories(value: str) -> List[str]:
    """The directories of an ``EAGLE3_DUMP_DIR`` value: one, or several separated by ``os.pathsep``
    (one per local disk; ``sinks.spread`` picks each file's)."""
    return [part.strip() for part in value.split(os.pathsep)]


def _directories(value: str) -> List[str]:
    """``dump_directories``, refused when an entry is empty or names a directory already listed."""
    dirs = dump_directories(value)
    if not all(dirs):
        raise DumpConfigError(f"{ENV_DIR}={value!r} has an empty entry; name one directory, or several "
                              f"separated by {os.pathsep!r} (one per disk)")
    seen = {}
    for d in dirs:
        norm = os.path.normpath(os.path.abspath(d))
        if norm in seen:
            raise DumpConfigError(f"{ENV_DIR}={value!r} names {norm} twice ({seen[norm]!r} and {d!r}); "
                                  f"list each directory once")
        seen[norm] = d
    return dirs


def _joined_name(value: str) -> Optional[str]:
    """An existing path that neighbouring entries of the directory list ``value`` name together
    (``a:b`` split at its ``:``), or None."""
    parts = value.split(os.pathsep)
    for i in range(len(parts)):
        for j in range(i + 1, len(parts)):
            joined = os.pathsep.join(parts[i:j + 1]).strip()
            if os.path.lexists(joined):
                return joined
    return None


def check_directory(directory: str, value: Optional[str] = None) -> None:
    """The dump directory (one entry of the ``EAGLE3_DUMP_DIR`` list ``value``) must exist and
    take a file; nothing is left behind."""
    if not os.path.isdir(directory):
        value = directory if value is None else value
        joined = _joined_name(value) if os.pathsep in value else None
        if joined is not None:
            raise DumpConfigError(
                f"{ENV_DIR}={value!r}: {joined!r} is one directory whose name holds {os.pathsep!r}, which "
                f"separates dump directories; rename it, or point {ENV_DIR} at a symbolic link to it whose "
                f"path has no {os.pathsep!r}")
        if os.pathsep in value:
            raise DumpConfigError(
                f"{ENV_DIR}={value!r} names {directory!r}, which is not an existing directory ({os.pathsep!r} "
                f"separates the directories of the list); create each directory of the list, or point "
                f"{ENV_DIR} elsewhere")
        raise DumpConfigError(
            f"{ENV_DIR}={directory!r} is not an existing directory; create it "
            f"(mkdir -p {directory}) or point {ENV_DIR} elsewhere"
        )
    probe = os.path.join(directory, f".eagle3-probe-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(probe, "wb") as handle:
            handle.write(b"probe")
    except OSError as exc:
        raise DumpConfigError(
            f"{ENV_DIR}={directory!r} is not writable ({exc.strerror}); make it "
            f"writable for the server's user or point {ENV_DIR} elsewhere"
        ) from None
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def resolved(args):
    """The values the release decided: releases that resolve server arguments keep the raw
    input apart (0.5.23: ``chunked_prefill_size`` is None raw, 4096 resolved) behind the view
    their facts name (``resolving_view``); others write the results back into the fields."""
    where = release_facts()["resolving_view"]
    if where is None:
        return args
    module, _, name = where.rpartition(".")
    try:
        view = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError) as exc:
        raise DumpConfigError(
            f"sglang {SERIES_RELEASE} lacks {where} ({exc}), which the series reads resolved server "
            f"arguments through; use the release the series was made for or port the series"
        ) from None
    return view(args)


def _prefill_graph(args) -> Optional[str]:
    """The prefill CUDA-graph backend in force, or None when prefill runs eagerly."""
    if getattr(args, "disable_cuda_graph", False) or getattr(args, "disable_prefill_cuda_graph", False):
        return None
    backend = None
    config = getattr(args, "cuda_graph_config", None)
    if config is not None:
        phase = config.get("prefill") if isinstance(config, dict) else getattr(config, "prefill", None)
        backend = phase.get("backend") if isinstance(phase, dict) else getattr(phase, "backend", None)
    backend = backend or getattr(args, "cuda_graph_backend_prefill", None)
    backend = getattr(backend, "value", backend)
    if backend in (None, "disabled"):
        return None
    return str(backend)


def _attention_dp(args) -> Optional[int]:
    """The attention data-parallel width in force (> 1), or None. Releases spell it
    ``--attn-dp-size N`` or (older, and deprecated where both exist) ``--enable-dp-attention``
    with ``--dp-size N``; 0.5.23 resolves the old spelling into ``attn_dp_size``."""
    size = getattr(args, "attn_dp_size", None) or 1
    if getattr(args, "enable_dp_attention", False):
        size = max(size, getattr(args, "dp_size", None) or 1, 2)
    return size if size > 1 else None


# What the launch rules need to know of each release, in this one place (smoke check e reads it
# too). A release not listed refuses every launch with a dump or a draft: declare it here when
# porting the series.
#   absent_fields: ServerArgs fields some rule reads (or a launch sets with one, like
#       --cp-strategy with --enable-prefill-cp) that the release does not have (the rule cannot
#       fire there; smoke check e confirms each is absent and fails on any other rule it cannot
#       exercise).
#   moe_dense_tp1_scatters_capture: with --moe-dense-tp-size 1 at TP > 1 the dense layers' rows
#       are scattered across ranks and the release's layer-loop capture does not gather them.
#   draft_setters: the target model's methods other than set_eagle3_layers_to_capture that set
#       layers_to_capture for a draft (DFlash/DSpark on deepseek_v2.py); with a dump the package
#       wraps each (``__init__._follow_draft_setters``): upstream reads the ids, the package takes
#       what it set as the draft's capture and routes the dump beside it.
#   draft_readings: how those drafts' ids read on the model files the series covers (a rule of
#       the tools' table: "plus_one" = id k names the output of layer k); the tools' own table
#       (the series manifest's capture_semantics.draft_readings) must agree.
#   draft_ids_on_runner: ModelRunner keeps the draft's ids itself (eagle_use_aux_hidden_state,
#       eagle_aux_hidden_state_layer_ids) and sets them only after device graphs: the series
#       configures them before (later releases configure them before graphs themselves).
#   allreduce_fusion_mark: the tensor attribute by which a layer leaves its MLP all-reduce to the
#       next layer's fused norm (FlashInfer's fusion at TP > 1), None where the release's capture
#       does not go through residual_stream.
#   resolving_view: "module.function" returning the resolved view of ServerArgs, None where the
#       release writes resolved values back into the fields.
# tests/test_release_facts.py checks every fact against the release's own source; check_launch
# checks absent_fields against the ServerArgs it is given.
RELEASE_FACTS = {
    "0.5.9": {
        "absent_fields": ("disable_prefill_cuda_graph", "cuda_graph_config", "cuda_graph_backend_prefill",
                          "attn_dp_size", "enable_prefill_cp", "cp_strategy"),
        "moe_dense_tp1_scatters_capture": True,
        "draft_setters": (),
        "draft_readings": {},
        "draft_ids_on_runner": True,
        "allreduce_fusion_mark": "_sglang_needs_allreduce_fusion",
        "resolving_view": None,
    },
    "0.5.17": {
        "absent_fields": ("enable_piecewise_cuda_graph", "attn_dp_size", "enable_nsa_prefill_context_parallel"),
        "moe_dense_tp1_scatters_capture": False,
        "draft_setters": ("set_dflash_layers_to_capture",),
        "draft_readings": {"dflash": "plus_one", "dspark": "plus_one"},
        "draft_ids_on_runner": False,
        "allreduce_fusion_mark": "_sglang_needs_allreduce_fusion",
        "resolving_view": None,
    },
    "0.5.23": {
        "absent_fields": ("enable_piecewise_cuda_graph", "enable_nsa_prefill_context_parallel"),
        "moe_dense_tp1_scatters_capture": False,
        "draft_setters": ("set_dflash_layers_to_capture",),
        "draft_readings": {"dflash": "plus_one", "dspark": "plus_one"},
        "draft_ids_on_runner": False,
        "allreduce_fusion_mark": None,
        "resolving_view": "sglang.srt.arg_groups.model_override_base.resolving_view",
    },
}


def check_absent_fields(args) -> None:
    """The fields this release's facts declare absent must be absent from its ServerArgs (a
    release whose fields moved under the series would let a rule read a default instead)."""
    present = [f for f in release_facts()["absent_fields"] if hasattr(args, f)]
    if present:
        raise DumpConfigError(
            f"eagle3_capture's facts for sglang {SERIES_RELEASE} declare ServerArgs.{', '.join(present)} absent, "
            f"but this sglang has them: its launch rules cannot be trusted here; use sglang {SERIES_RELEASE} "
            f"as released or port the series (RELEASE_FACTS in sglang-overlay/)"
        )


def release_facts(release: Optional[str] = None) -> dict:
    """The launch rules' facts of this series' release; a release without them refuses."""
    release = SERIES_RELEASE if release is None else release
    try:
        return RELEASE_FACTS[release]
    except KeyError:
        raise DumpConfigError(
            f"eagle3_capture declares no launch-rule facts for sglang {release}, so its settings cannot be "
            f"checked; add sglang {release} to RELEASE_FACTS in sglang/srt/eagle3_capture/settings.py "
            f"(sglang-overlay/) and regenerate the series"
        ) from None


def _algorithm(args) -> str:
    value = getattr(args, "speculative_algorithm", None)
    value = getattr(value, "name", value)
    return str(value).upper() if value else ""


def check_draft_args(args) -> None:
    """Refuse an EAGLE-3 draft (dump on or off) whose captured rows would be wrong."""
    if _algorithm(args) != "EAGLE3":  # no draft asked for: nothing to check, on any release
        return
    args = resolved(args)
    if _algorithm(args) != "EAGLE3":
        return
    facts = release_facts()
    tp_size = getattr(args, "tp_size", 1) or 1
    if facts["moe_dense_tp1_scatters_capture"] and tp_size > 1 and getattr(args, "moe_dense_tp_size", None) == 1:
        raise DumpConfigError(
            f"--speculative-algorithm EAGLE3 with --moe-dense-tp-size 1 at --tp-size {tp_size}: the dense "
            f"layers' rows are scattered across ranks and sglang {SERIES_RELEASE}'s capture does not gather "
            f"them, so the draft would get partial rows; drop --moe-dense-tp-size"
        )


def check_server_args(args) -> None:
    """Refuse server settings under which dumped rows would be incomplete or wrong. Argument
    names differ between releases: each rule reads the names its release has."""
    args = resolved(args)

    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    tp_size = arg("tp_size", 1)
    attn_dp = _attention_dp(args)
    attn_cp = arg("attn_cp_size", 1)
    a2a = arg("moe_a2a_backend", "none")
    a2a = str(getattr(a2a, "value", a2a) or "none")
    graph = _prefill_graph(args)
    facts = release_facts()
    algorithm = _algorithm(args)
    rules = [
        (
            not arg("disable_radix_cache", False),
            "the radix cache is on (prefix-cache hits skip rows); add --disable-radix-cache",
        ),
        (
            arg("enable_mixed_chunk", False),
            "--enable-mixed-chunk puts decode tokens into prefill batches; drop it",
        ),
        (
            arg("enable_two_batch_overlap", False),
            "--enable-two-batch-overlap runs layers outside the capture loop; drop it",
        ),
        (
            arg("enable_piecewise_cuda_graph", False),
            "--enable-piecewise-cuda-graph would bake the dump into a graph; drop it",
        ),
        (
            graph is not None,
            f"a prefill CUDA graph (--cuda-graph-backend-prefill {graph}) would bake the dump into "
            f"a graph; add --disable-prefill-cuda-graph",
        ),
        # context parallelism before the settings a release derives from it (DeepSeek MLA / DSA:
        # --enable-prefill-cp turns on DP attention, --moe-a2a-backend deepep and
        # --moe-dense-tp-size 1): the refusal names what the user set
        (
            arg("enable_nsa_prefill_context_parallel", False),
            "--enable-nsa-prefill-context-parallel splits prefill tokens across ranks; drop it",
        ),
        (
            arg("enable_prefill_cp", False) or attn_cp > 1,
            "prefill context parallelism (--enable-prefill-cp / --attn-cp-size) splits prefill "
            "tokens across ranks; drop it",
        ),
        (
            attn_dp is not None,
            f"DP attention (--attn-dp-size / --enable-dp-attention, {attn_dp} attention ranks) splits "
            f"requests across attention ranks; drop it",
        ),
        (
            attn_dp is None and args.dp_size > 1,
            f"--dp-size {args.dp_size} runs {args.dp_size} data-parallel replicas, each with its own dump "
            f"writer, and a flush reaches only one of them (the others' files are lost at the stop); run "
            f"one server per replica (--dp-size 1) behind a router",
        ),
        (
            arg("pp_size", 1) > 1,
            f"--pp-size {arg('pp_size', 1)} puts capture layers on other pipeline stages; use --pp-size 1",
        ),
        (
            a2a != "none",
            f"--moe-a2a-backend {a2a} scatters hidden states across ranks; use --moe-a2a-backend none",
        ),
        (
            arg("enable_attn_tp_input_scattered", False) and tp_size > 1,
            "--enable-attn-tp-input-scattered splits prefill tokens across ranks; drop it",
        ),
        (
            arg("enable_pdmux", False),
            "--enable-pdmux splits prefills across forwards; drop it",
        ),
        (
            facts["moe_dense_tp1_scatters_capture"] and tp_size > 1 and arg("moe_dense_tp_size") == 1,
            f"--moe-dense-tp-size 1 at --tp-size {tp_size} scatters the dense layers' rows across ranks "
            f"and sglang {SERIES_RELEASE}'s capture does not gather them; drop --moe-dense-tp-size",
        ),
        (
            algorithm in ("DFLASH", "DSPARK") and "set_dflash_layers_to_capture" not in facts["draft_setters"],
            f"--speculative-algorithm {algorithm} sets the captured layers behind the dump on sglang "
            f"{SERIES_RELEASE}; use EAGLE3 or no draft with the dump, or unset {ENV_DIR}",
        ),
    ]
    for broken, message in rules:
        if broken:
            raise DumpConfigError(f"{ENV_DIR} is set but {message}")


def text_config(hf_config):
    """The text model's config of a model or of a multimodal wrapper (``text_config``)."""
    return getattr(hf_config, "text_config", None) or hf_config


SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
)


def check_model(architectures: Sequence[str], num_layers: int, settings: "DumpSettings") -> List[int]:
    """The dump's capture indices for this model, or a refusal naming the fix."""
    arch = (list(architectures) or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise DumpConfigError(
            f"{ENV_DIR} is set but {arch} is not supported; the dump covers DeepSeek-V2/V3 and "
            f"Kimi-K2.5 models: unset {ENV_DIR}"
        )
    return settings.capture_indices(num_layers)


def _model_config(server_args):
    """The model config as the launch will build it: releases with a resolving view build it
    through their ``model_config_of`` beside it, the others through ``ServerArgs.get_model_config``."""
    where = release_facts()["resolving_view"]
    if where is None:
        return server_args.get_model_config()
    module = where.rpartition(".")[0]
    return __import__(module, fromlist=["model_config_of"]).model_config_of(server_args)


def check_specforge(settings: "DumpSettings", indices: Sequence[int]) -> None:
    """SpecForge's protocol needs every id's state captured, stored whole (its reader takes no fp8)."""
    if settings.specforge_ids is None:
        return
    from .specforge import ENV_IDS, missing_layers

    missing = missing_layers(settings.specforge_ids, indices)
    if missing:
        raise DumpConfigError(f"{ENV_IDS} names layers {missing} that {ENV_LAYERS} does not dump; add them to "
                              f"{ENV_LAYERS} (serve.py --specforge-ids adds them)")
    if settings.storage.fp8 or settings.storage.omit:
        raise DumpConfigError(f"{ENV_IDS} is set and the dump stores fp8 or leaves states out; SpecForge's reader "
                              f"takes whole states: unset {ENV_DTYPE} and {ENV_REBUILDABLE}")


def check_launch(server_args) -> None:
    """Called by the launching process (``launch_server`` and ``Engine``) before any worker
    starts or any weight loads: a setting under which the dump would be wrong ends the launch
    with one line (``SystemExit``: no traceback) and a non-zero exit."""
    try:
        check_absent_fields(server_args)
        check_draft_args(server_args)
        settings = DumpSettings.from_env()
        if settings is None:
            return
        check_server_args(server_args)
        hf_config = _model_config(server_args).hf_config
        num_layers = text_config(hf_config).num_hidden_layers
        indices = check_model(getattr(hf_config, "architectures", None) or [], num_layers, settings)
        check_specforge(settings, indices)
        from .weights import check_launch as check_weights

        check_weights(server_args, settings, indices, num_layers)  # omit: weights readers can check
        for directory in settings.directories:
            check_directory(directory, settings.directory)
        if settings.mooncake is not None:
            from .sinks import check_mooncake_importable

            check_mooncake_importable()  # the sink's package, before any weight loads
            settings.mooncake.check_reachable()
        from .control import install_launcher_hooks

        install_launcher_hooks(server_args, settings.drain_s)
    except DumpConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
