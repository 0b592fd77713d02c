"""Stage 1 of the run: the options, and everything read before anything is written.

``check_options`` refuses bad flags and directories; ``read_inputs`` reads the model's sizes
(``config.json``), the conversations, the tokenizer, the settings a dataset in OUT was started
with and the samples it already holds. All of it raises ``UsageError`` (exit 2) on bad input.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .. import conventions
from ..errors import UsageError
from . import record as rec_mod
from .data import load_conversations
from .dumps import dump_dir_entries
from .tokenize import ChatTokenizer
from .writers import ALL_FORMATS, DRAFT_FORMATS


@dataclass
class Options:
    servers: list  # SGLang server or router URLs; requests are spread over them (``client``)
    model: Path
    data: Path
    dump_dir: Path | None  # the servers' EAGLE3_DUMP_DIR; not used (None allowed) with the Mooncake Store
    out: Path
    format: str = "specforge"
    tokenizer: Path | None = None
    max_len: int = 2048
    concurrency: int = 4
    processes: int = 1  # worker processes the --concurrency threads are dealt over (``procs``); 1: this process
    dump_timeout: float = 60.0  # seconds a server may take to flush its dumps (POST /eagle3_dump/flush)
    request_timeout: float = 600.0
    retries: int = 5
    max_attempts: int = 3
    keep_dumps: bool = False
    limit: int | None = None
    mask: str = "auto"
    # EAGLE-3 ids (dflash/dspark: the draft's target_layer_ids); None: the dumped layers except N-1
    aux_layers: list | None = None
    draft_config: Path | None = None  # --format dflash|dspark: the draft's directory (or config.json) naming its layers
    hidden_states_backend: str = "file"  # --format speculators: the speculators backend the export is for
    trust_remote_code: bool = False
    progress: bool | None = None  # None: only on a terminal
    log_every: float = 30.0  # without the bar: a progress line (samples, tokens/s, seconds per stage) this often
    # the Mooncake Store the servers' sink puts each request's states in (both or neither): read each answer's
    # object (its handle, meta_info["eagle3_dump"]) instead of a dump file
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None


@dataclass
class Inputs:
    cfg: dict
    all_convs: list  # the whole input file
    convs: list  # after --limit
    tok: ChatTokenizer
    done: dict
    pending: list
    settings: rec_mod.Settings
    draft: object = None  # --format dflash|dspark: the draft's ``drafts.DraftSpec``


def model_config(model_dir: Path) -> dict:
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{cfg_path} does not exist", "pass the served model's directory (with config.json) as --model")
    try:
        cfg = json.loads(cfg_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{cfg_path} is not readable JSON ({type(exc).__name__})",
                         "pass the served model's directory as --model") from None
    text = cfg.get("text_config") or cfg if isinstance(cfg, dict) else None  # multimodal: the text model's sizes
    if not isinstance(text, dict):
        raise UsageError(f"{cfg_path} is not a model config (a JSON object)", "pass the served model's directory as --model")
    out = {}
    for k in ("vocab_size", "hidden_size", "num_hidden_layers"):
        v = text.get(k, cfg.get(k))
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UsageError(f"{cfg_path} has no positive integer {k}", "pass the served model's directory as --model")
        out[k] = v
    archs = cfg.get("architectures")
    out["architecture"] = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return out


def url_problem(url: str) -> str:
    """Why ``url`` cannot name an HTTP server (empty when it can): scheme, host, port, host labels."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError on a port that is not a number in range
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "no http:// or https:// scheme"
    host = parts.hostname
    if not host:
        return "no host"
    if ":" not in host:  # not an IPv6 literal: every DNS label must encode
        try:
            host.encode("idna")
        except UnicodeError:
            return f"host {host!r} has an empty or over-long label"
    return ""


def check_store_flags(master, metadata, dump_dir) -> None:
    """The Mooncake flags go together, and without them --dump-dir is required (UsageError)."""
    if (master is None) != (metadata is None):
        given, missing = ("--mooncake-master", "--mooncake-metadata") if metadata is None else \
            ("--mooncake-metadata", "--mooncake-master")
        raise UsageError(f"{given} without {missing}: the two name one Mooncake Store",
                         "pass both --mooncake-master HOST:PORT and --mooncake-metadata http://HOST:PORT/metadata (the "
                         "server's EAGLE3_DUMP_MOONCAKE_MASTER and EAGLE3_DUMP_MOONCAKE_METADATA), or neither to read "
                         "dump files from --dump-dir")
    if master is None:
        if dump_dir is None:
            raise UsageError("--dump-dir is required to read dump files",
                             "pass the servers' EAGLE3_DUMP_DIR with --dump-dir, or --mooncake-master and "
                             "--mooncake-metadata to read a server with the Mooncake sink")
        return
    host, _, port = str(master).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--mooncake-master {master!r} is not HOST:PORT",
                         "pass the server's EAGLE3_DUMP_MOONCAKE_MASTER, e.g. 127.0.0.1:50051")
    why = url_problem(str(metadata))
    if why:
        raise UsageError(f"--mooncake-metadata {metadata!r} is not a URL ({why})",
                         "pass the server's EAGLE3_DUMP_MOONCAKE_METADATA, e.g. http://127.0.0.1:8080/metadata")


def check_options(o: Options) -> None:
    if o.format not in ALL_FORMATS:
        raise UsageError(f"--format {o.format!r} is not known", f"use one of {', '.join(ALL_FORMATS)}")
    if o.draft_config is not None and o.format not in DRAFT_FORMATS:
        raise UsageError(f"--draft-config reads a DFlash or DSpark draft's layers and --format is {o.format}",
                         "pass --format dflash or dspark, or name an EAGLE-3 draft's layers with --aux-layers=")
    nums = {"--max-len": o.max_len, "--concurrency": o.concurrency, "--max-attempts": o.max_attempts,
            "--log-every": o.log_every,
            "--dump-timeout": o.dump_timeout, "--request-timeout": o.request_timeout}
    bad = [k for k, v in nums.items() if not (v > 0 and v != float("inf"))]
    if bad or o.retries < 0 or (o.limit is not None and o.limit < 1):
        raise UsageError(f"{', '.join(bad) or '--retries/--limit'} out of range",
                         "pass positive finite --max-len, --concurrency, --max-attempts, --log-every, --dump-timeout, "
                         "--request-timeout, --limit and a non-negative --retries")
    if not isinstance(o.processes, int) or o.processes < 1 or o.processes > o.concurrency:
        raise UsageError(f"--processes {o.processes} is out of range (--concurrency {o.concurrency})",
                         "pass --processes between 1 and --concurrency (each process runs at least one request)")
    if isinstance(o.servers, str):
        o.servers = [o.servers]
    if not o.servers or any(not isinstance(u, str) or not u.strip() for u in o.servers):
        raise UsageError("--server names no server (an empty URL)",
                         "pass --server http://HOST:PORT, repeated or as a comma list for several servers")
    o.servers = [u.strip().rstrip("/") for u in o.servers]
    for u in o.servers:
        why = url_problem(u)
        if why:
            raise UsageError(f"--server {u!r} is not a server URL ({why})",
                             "pass --server http://HOST:PORT (an SGLang server or router)")
    twice = sorted({u for u in o.servers if o.servers.count(u) > 1})
    if twice:
        raise UsageError(f"--server names {twice[0]} more than once", "name each server once")
    check_store_flags(o.mooncake_master, o.mooncake_metadata, o.dump_dir)
    for d in (dump_dir_entries(o.dump_dir) if o.mooncake_master is None else []):  # one, or the server's several (EAGLE3_DUMP_DIR=A:B, one per disk)
        if not d.is_dir():
            raise UsageError(f"dump directory {d} is not visible on this machine (not an existing directory)",
                             "pass the server's EAGLE3_DUMP_DIR as this machine sees it (a shared mount) with "
                             "--dump-dir, every directory it names, in its order")
        if not os.access(d, os.R_OK | os.X_OK):
            raise UsageError(f"dump directory {d} is not readable by this user",
                             "make it readable or run as a user who can read it")
        if not os.access(d, os.W_OK) and not o.keep_dumps:
            raise UsageError(f"dump directory {d} is not writable by this user (used dumps are removed)",
                             "make it writable or pass --keep-dumps")
    out = Path(o.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory", "pass a new or existing dataset directory")


def check_aux_range(o: Options, num_layers: int) -> None:
    """``--aux-layers`` ids that name no layer of the model under any reading: an id is an
    output-of-layer id (-1..N-1) or, where the server reads ids as capture indices, an index 0..N;
    anything above N is no layer (refused before any request; the reading is checked at the first
    dump, ``writers.resolve_layout``)."""
    if o.aux_layers is None:
        return
    bad = sorted({k for k in o.aux_layers if k > num_layers})
    if bad:
        typed = ",".join(map(str, o.aux_layers))
        raise UsageError(f"--aux-layers={typed} names layer {', '.join(map(str, bad))}, which the {num_layers}-layer "
                         f"model {o.model} does not have (ids are -1 for the embedding output and 0..{num_layers - 1} "
                         f"for the output of layer k; at most {num_layers} where the server reads ids as capture "
                         f"indices)", "pass --aux-layers= with layers of that model")


def template_sha256(tok: ChatTokenizer) -> str:
    """The chat template's sha256, as the dataset's settings record it (and ``procs`` checks it)."""
    return hashlib.sha256(tok.template.encode()).hexdigest()


def read_inputs(o: Options, check_server=None) -> Inputs:
    """Stage 1. ``check_server`` (no argument) runs once the conversations to extract are known, when
    there are any, before the tokenizer loads: an unreachable server is named without waiting for
    transformers to import."""
    cfg = model_config(o.model)
    draft = None
    if o.format in DRAFT_FORMATS:  # the draft's layers, checked before any request
        from . import drafts

        draft = drafts.options_spec(o.format, o.draft_config, o.aux_layers)
        drafts.check_spec(draft, cfg["num_hidden_layers"], o.model)
    else:
        check_aux_range(o, cfg["num_hidden_layers"])
    all_convs = load_conversations(o.data)
    convs = all_convs[: o.limit] if o.limit is not None else all_convs
    done = rec_mod.load_done(Path(o.out), all_convs)
    pending = [c for c in convs if c.id not in done]
    if pending and check_server is not None:  # a finished dataset reruns without a server
        check_server()
    tok = ChatTokenizer(o.tokenizer or o.model, trust_remote_code=o.trust_remote_code, mask_method=o.mask)
    if len(tok) > cfg["vocab_size"]:
        raise UsageError(f"the tokenizer in {tok.path} has {len(tok)} tokens but the model's vocab_size is "
                         f"{cfg['vocab_size']} (tokenizer/model mismatch)",
                         "pass the served model's own tokenizer with --tokenizer")
    want = {"format": o.format, "max_len": o.max_len, "mask_method": tok.mask_method,
            "chat_template_sha256": template_sha256(tok),
            "model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}}
    settings = rec_mod.Settings(Path(o.out), want)
    lay = settings.data.get("layout")
    if lay and draft is not None:
        check_resumed_draft(o, draft, settings, lay)
    elif lay and o.aux_layers is not None:
        # --aux-layers reads as the dataset's server read draft ids (recorded from its first dump)
        rule = conventions.dump_rule(settings.data.get("dump_meta") or {})
        asked = sorted(set(conventions.layer_output_ids(rule, o.aux_layers)))
        if asked != lay.get("aux"):
            raise UsageError(f"{o.out} holds aux layers (output-of-layer ids) {lay.get('aux')}, --aux-layers "
                             f"{','.join(map(str, o.aux_layers))} asks {asked} ({conventions.RULES[rule]})",
                             "rerun with the dataset's --aux-layers (or none) to resume, or pass a new --out")
    return Inputs(cfg, all_convs, convs, tok, done, pending, settings, draft)


def check_resumed_draft(o: Options, draft, settings, lay: dict) -> None:
    """A resumed DFlash/DSpark dataset: the draft's layers, read on the release and model file of the
    dataset's dumps, must be the ones it holds."""
    from . import drafts

    dl = drafts.draft_layers(draft, settings.data.get("dump_meta") or {})
    if dl.ascending != lay.get("aux"):
        raise UsageError(f"{o.out} holds layer-output ids {lay.get('aux')}, this run's {dl.describe()}",
                         "rerun with the dataset's draft to resume, or pass a new --out")
