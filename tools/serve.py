#!/usr/bin/env python3
"""Serve a patched SGLang with the EAGLE-3 hidden-state dump on, for tools/extract.py.

  python3 tools/serve.py --model-path MODEL --dump-dir DIR [--layers IDS] [--sglang ROOT] [DUMP FLAGS]
                         [-- SGLANG FLAGS...]
  python3 tools/serve.py --cpu-demo DIR [--sglang ROOT] [DUMP FLAGS]

Production (--model-path): runs `python -m sglang.launch_server` for MODEL on this machine's
accelerators with EAGLE3_DUMP_DIR=DIR, EAGLE3_DUMP_LAYERS=IDS and --disable-radix-cache (the one
flag the dump needs; the settings it refuses are off unless asked for), serving the patched tree
ROOT (first on PYTHONPATH; a git checkout from `tools/apply.py --fetch` or a directory holding
sglang/), or the installed sglang when it is patched in place. Flags after `--` go to
launch_server as they are (--tp 8, --context-length 65536, ...).

CPU demo (--cpu-demo DIR): the same on any machine's CPU, with a tiny built-in model: the cached CPU
environment (built the first time, ~3 minutes, 2.4 GB), sglang 0.5.9 with the series and its
test-only smoke patch (fetched and patched into the cache, or ROOT plus the smoke patch), the
seeded tiny DeepSeek-V3 with a chat tokenizer in DIR/model, conversations in
DIR/conversations.jsonl, the dumps in DIR/dumps, a draft config per trainer in DIR/draft-*, and
the extract, load and guard commands to run next (printed once the server answers; also in
DIR/serve.json).

Dump flags (--max-pending-mb, --final, --drain-s, --max-wait-s, --dump-dtype, --rebuildable) set the dump's other variables; without
one, the variable from your environment is kept (one line says which value is used and from where),
else the dump's default applies.

The server runs in the foreground until Ctrl-C (or SIGTERM), which sends SIGTERM to it and every
process it started: the dump writer writes its queue for at most EAGLE3_DUMP_DRAIN_S seconds, and
serve.py waits that long plus 30 s before it kills what is left. The server runs with a temporary
directory of its own (TMPDIR: SGLang's IPC sockets and the files it makes there), removed at the
stop. "[serve] ready at URL" is said once, when the server answers /health, and nowhere before.
--quiet: the server logs warnings and errors only, and serve.py says only the ready line and what
follows it, warnings and the stop. --print prints the command instead of running it.

Exit: 0 stopped by Ctrl-C or SIGTERM (and --print), 1 (or the server's own status) the server failed,
2 usage error.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import UsageError, run_main  # noqa: E402
from eaglepatch.serve import DEFAULT_HOST, DEFAULT_PORT, DUMP_SETTINGS, STOP_MARGIN_S  # noqa: E402
from eaglepatch.serve.demo import DEMO_LAYERS  # noqa: E402

QUIET_FLAGS = ["--log-level", "warning"]  # --quiet: launch_server's logging (its HTTP log follows it)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = cli.parser("serve.py", __doc__, whole_doc=True)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model-path", metavar="MODEL",
                      help="production: the model to serve (a directory or a Hugging Face id), on this machine's GPUs")
    mode.add_argument("--cpu-demo", type=Path, metavar="DIR",
                      help="CPU demo: serve the tiny built-in model on CPU; DIR holds the model, conversations, dumps "
                           "and draft configs (created; reused by a later run)")
    ap.add_argument("--dump-dir", type=Path, metavar="DIR",
                    help="EAGLE3_DUMP_DIR, created when missing (required in production; CPU demo default: DIR/dumps); "
                         "several separated by ':' (one per local disk) spread the files by key")
    ap.add_argument("--layers", metavar="IDS",
                    help="EAGLE3_DUMP_LAYERS: layer ids to dump, read as the served release reads a draft's (README "
                         "'Layer ids'; in a list holding -1: -1 = embedding output, k = output of layer k, N-1 = the "
                         "last layer before the final norm, which speculators needs), e.g. --layers=-1,1,29,60 "
                         "(production default: upstream's capture indices 2,N/2,N-3; CPU demo default: "
                         f"{','.join(map(str, DEMO_LAYERS))})")
    ap.add_argument("--draft-config", type=Path, metavar="DIR",
                    help="dump the layers this draft reads (an EAGLE-3, DFlash or DSpark config: its directory or "
                         "config.json), read exactly as the served release reads that family's ids "
                         "(EAGLE3_DUMP_LAYERS and EAGLE3_DUMP_READING); instead of --layers")
    ap.add_argument("--sglang", type=Path, metavar="ROOT",
                    help="the patched sglang tree to serve (default: production: the installed sglang, which must be "
                         "patched in place; CPU demo: sglang 0.5.9 fetched and patched into the cache)")
    ap.add_argument("--series", type=Path, metavar="DIR",
                    help="the series the tree carries (default: patches/sglang-<its release>)")
    ap.add_argument("--python", metavar="PY",
                    help="production: the interpreter whose environment has sglang's dependencies (default: this one, "
                         f"{sys.executable})")
    dump = {st.var: st for st in DUMP_SETTINGS}
    ap.add_argument("--max-pending-mb", metavar="MB",
                    help="EAGLE3_DUMP_MAX_PENDING_MB: the host arena for rows not yet written, in MiB (README "
                         "'Sizing the host arena'; default: $EAGLE3_DUMP_MAX_PENDING_MB, else "
                         f"{dump['EAGLE3_DUMP_MAX_PENDING_MB'].default})")
    ap.add_argument("--final", metavar="1|0",
                    help="EAGLE3_DUMP_FINAL: 1 also stores the final (post-norm) hidden state, 0 does not "
                         f"(default: $EAGLE3_DUMP_FINAL, else {dump['EAGLE3_DUMP_FINAL'].default})")
    ap.add_argument("--drain-s", metavar="S",
                    help="EAGLE3_DUMP_DRAIN_S: on stop (SIGTERM) the dump writer writes its queue for at most S "
                         f"seconds; serve.py waits S + {STOP_MARGIN_S:g} s before it kills the server (default: "
                         f"$EAGLE3_DUMP_DRAIN_S, else {dump['EAGLE3_DUMP_DRAIN_S'].default})")
    ap.add_argument("--max-wait-s", metavar="S",
                    help="EAGLE3_DUMP_MAX_WAIT_S: how long a forward waits for room in the host arena before its "
                         "rows are failed, in seconds (default: $EAGLE3_DUMP_MAX_WAIT_S, else "
                         f"{dump['EAGLE3_DUMP_MAX_WAIT_S'].default})")
    ap.add_argument("--dump-dtype", metavar="bf16|fp8",
                    help="EAGLE3_DUMP_DTYPE: fp8 stores each state as float8_e4m3fn with a float32 scale per token "
                         "and state, quantised on the GPU before the copy (half the bytes; tools/extract.py "
                         "dequantises) (default: $EAGLE3_DUMP_DTYPE, else bf16)")
    ap.add_argument("--rebuildable", metavar="store|omit",
                    help="EAGLE3_DUMP_REBUILDABLE: omit leaves out what tools/extract.py rebuilds from the model's "
                         "weights: embedding rows of vocabulary tokens, and the final state when layer N-1 is "
                         "dumped (default: $EAGLE3_DUMP_REBUILDABLE, else store)")
    ap.add_argument("--specforge-ids", metavar="K,K,...",
                    help="EAGLE3_DUMP_SPECFORGE_IDS: answer SpecForge's online capture requests (its spec_capture "
                         "protocol) with these aux layer ids, SpecForge's --spec-capture-aux-layer-ids (k = output of "
                         "layer k); needs --sink mooncake and the layers in the dump (docs/online.md)")
    ap.add_argument("--dump-writers", metavar="N",
                    help="EAGLE3_DUMP_WRITERS: threads writing dump files at once, each file committed whole "
                         "(default: $EAGLE3_DUMP_WRITERS, else the CPUs the server's rank may use, at most 4)")
    ap.add_argument("--dump-gil-switch-ms", metavar="MS",
                    help="EAGLE3_DUMP_GIL_SWITCH_MS: the writing process's GIL switch interval in milliseconds "
                         "(sys.setswitchinterval, above 0, at most 100): the dump's threads wait at most this long "
                         "for the GIL that SGLang's scheduler thread holds; smaller writes files sooner and takes "
                         "the scheduler more often (docs/peers.md) (default: $EAGLE3_DUMP_GIL_SWITCH_MS, else "
                         "Python's 5)")
    ap.add_argument("--sink", metavar="file|mooncake",
                    help="EAGLE3_DUMP_SINK: mooncake puts each request's states into a Mooncake Store instead of a "
                         "file (docs/online.md; needs --mooncake-master, and the mooncake package in the server's "
                         "environment: pip install mooncake-transfer-engine, -cuda13 or -non-cuda, which also "
                         "installs mooncake_master; checked before the server starts) (default: $EAGLE3_DUMP_SINK, "
                         "else file)")
    for flag, what in (("--mooncake-master", "HOST:PORT of mooncake_master (started by you: mooncake_master "
                                             "--rpc_address=HOST --port=PORT ...; serve.py prints the command)"),
                       ("--mooncake-metadata", "http://HOST:PORT/metadata (the master's HTTP metadata server), "
                                               "etcd://..., or P2PHANDSHAKE (the default)"),
                       ("--mooncake-protocol", "tcp (default) or rdma"),
                       ("--mooncake-device", "RDMA device names, with --mooncake-protocol rdma"),
                       ("--mooncake-host", "this node's address the store's other clients reach (default 127.0.0.1)"),
                       ("--mooncake-segment-mb", "MiB of memory this server gives the store; its objects live "
                                                 "there (default 4096)"),
                       ("--mooncake-buffer-mb", "MiB of the store client's transfer buffer (default 2048)"),
                       ("--mooncake-ttl-s", "seconds after its commit that an object no reader deleted is removed "
                                            "by the server, logged and counted (default 600)")):
        var = "EAGLE3_DUMP_" + flag[2:].upper().replace("-", "_")
        ap.add_argument(flag, metavar=flag[len("--mooncake-"):].upper().replace("-", "_"),
                        help=f"{var}: {what} (default: ${var})")
    ap.add_argument("--host", default=DEFAULT_HOST,
                    help="address to listen on, IPv4 or IPv6 (e.g. ::1) (default: %(default)s)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default: %(default)s)")
    ap.add_argument("--print", action="store_true", dest="print_only",
                    help="print the command (and prepare the CPU demo) instead of running it")
    ap.add_argument("--quiet", action="store_true",
                    help=f"the server logs warnings and errors only (launch_server {' '.join(QUIET_FLAGS)}: no line "
                         "per batch or request), and serve.py says only the ready line, the commands after it, "
                         "warnings, errors and the stop")
    a = ap.parse_args(argv)

    def body() -> int:
        cli.require("serve.py", "unidiff")  # the tree's series is read before anything starts
        from eaglepatch import serve

        if not 0 < a.port < 65536:
            raise UsageError(f"--port {a.port} is out of range", "pass a port from 1 to 65535")
        layers = serve.parse_layers(a.layers) if a.layers is not None else None
        draft = None
        if a.draft_config is not None:
            if a.layers is not None:
                raise UsageError("--layers and --draft-config both name the layers to dump",
                                 "pass one: the draft's config, whose layers are read as the served release reads them, "
                                 "or the layer ids by hand")
            draft = serve.draft_dump(a.draft_config, a.model_path, demo=a.cpu_demo)
        host = serve.check_host(a.host)
        if a.quiet:
            given = [f for f in extra if f.split("=", 1)[0] in ("--log-level", "--log-level-http")]
            if given:
                raise UsageError(f"--quiet sets launch_server's {' '.join(QUIET_FLAGS)}, and {given[0]} is given "
                                 "after --", "drop --quiet or that flag")
            extra[:0] = QUIET_FLAGS
        if not a.print_only:  # an address or port the server cannot listen on: refused before anything is made
            serve.refuse_taken_port(host, a.port)
        settings, setting_notes = serve.dump_settings(
            {st.flag: getattr(a, st.flag[2:].replace("-", "_")) for st in serve.DUMP_SETTINGS})
        if draft is not None:
            layers = draft.apply(settings, setting_notes)
        if a.cpu_demo is not None:
            if a.python:
                raise UsageError("--python is for production serving; the CPU demo runs in the cached CPU environment",
                                 "drop --python")
            from eaglepatch.serve.demo import cpu_demo_plan

            plan = cpu_demo_plan(a.cpu_demo, sglang=a.sglang, series_dir=a.series,
                                 layers=layers if layers is not None else DEMO_LAYERS, dump_dir=a.dump_dir,
                                 host=host, port=a.port, extra=extra, settings=settings,
                                 **({"say": lambda m: None} if a.quiet else {}))
        else:
            if a.dump_dir is None:
                raise UsageError("--dump-dir is missing", "pass the directory the server writes its dumps to "
                                 "(EAGLE3_DUMP_DIR; on a shared filesystem for several replicas)")
            plan = serve.production_plan(a.model_path, a.dump_dir, layers, a.sglang, a.series, a.python,
                                         host, a.port, extra, settings)
        plan.quiet = a.quiet
        for line in plan.notes + setting_notes:
            if line.startswith("warning: ") or not a.quiet:
                print(("" if line.startswith("warning: ") else "[serve] ") + line, file=sys.stderr)
        if a.print_only:
            print(plan.shell())
            for line in plan.after_ready:
                print(line, file=sys.stderr)
            return 0
        if not a.quiet:
            print("+ " + plan.shell(), file=sys.stderr, flush=True)
        return serve.run(plan)

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
