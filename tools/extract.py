#!/usr/bin/env python3
"""Extract draft-training hidden states (EAGLE-3, DFlash, DSpark) from patched SGLang servers into a dataset.

  python tools/extract.py --server http://127.0.0.1:30000 --model MODEL_DIR --data conv.jsonl \
      --dump-dir DIR --out OUT [--format specforge|speculators|compact] [--aux-layers=-1,1,29] [--max-len 2048]
      [--hidden-states-backend file|fp8]
  python tools/extract.py ... --format dflash|dspark --draft-config DRAFT_DIR   (or --aux-layers=IDS)
  python tools/extract.py --server URL --model MODEL_DIR --data conv.jsonl --out OUT \
      --mooncake-master HOST:PORT --mooncake-metadata http://HOST:PORT/metadata   (servers with the Mooncake sink)

--server is one patched SGLang server, SGLang's router in front of several, or several servers
(repeat --server, or a comma list): requests go round robin, a failed server is put aside for a
while and its requests are sent to the others. Every server must run the patched sglang with the
dump on (python3 tools/serve.py --model-path MODEL --dump-dir DIR, which sets EAGLE3_DUMP_DIR=DIR; one
directory shared by all of them; DIR as this machine sees it is --dump-dir). Servers started with the
Mooncake sink (serve.py --sink mooncake: EAGLE3_DUMP_SINK=mooncake) put each request's states into a
Mooncake Store instead: --mooncake-master and --mooncake-metadata (the servers' EAGLE3_DUMP_MOONCAKE_MASTER
and _METADATA) read each answer's object, named by its meta_info["eagle3_dump"], with the same checks
and the same dataset as a file, and delete it once read (--dump-dir is not needed; docs/online.md).
--format speculators
also needs the last decoder layer N-1 in the server's --layers (EAGLE3_DUMP_LAYERS: its output before
the final norm is speculators' last slot). --format compact keeps every dumped state as the server
stored it (EAGLE3_DUMP_DTYPE=fp8, EAGLE3_DUMP_REBUILDABLE=omit) and is read with
eaglepatch.compact.CompactDataset(OUT, MODEL_DIR), which yields SpecForge's or speculators' tensors.
--format dflash and dspark write SpecForge 0.2.0's offline DFlash and DSpark samples (training.strategy
dflash|dspark) for the draft --draft-config names: its dflash_config.target_layer_ids (DSpark: also
dspark_target_layer_ids), read as SGLang reads that family's ids on the release that dumped and the
target's model file (id k = output of layer k on deepseek_v2/kimi_k25), never as EAGLE-3 ids;
DSpark samples also hold the post-norm final state (EAGLE3_DUMP_FINAL=1) (docs/dflash.md).
Rerunning with the same --out resumes: done samples are skipped, edited conversations are extracted
again; dump files of this dataset's requests that no sample used (failed or killed runs) are
reported and removed.
Exit: 0 all samples done, 1 some samples failed (listed in OUT/manifest.json), 2 usage or input error.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import UsageError, run_main  # noqa: E402


def _layer_ids(text: str) -> list:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers (e.g. -1,1,29)") from None
    if any(k < -1 for k in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids are -1 (embedding output) or >= 0")
    return ids


def main(argv=None) -> int:
    from eaglepatch.extract import detached_dash_value

    argv = list(sys.argv[1:] if argv is None else argv)
    detached = detached_dash_value(argv)  # --aux-layers -1,2: argparse would say only "expected one argument"
    if detached is not None:
        def refuse():
            raise detached

        return run_main(refuse)
    ap = cli.parser("extract.py", __doc__)
    ap.add_argument("--server", required=True, action="append", metavar="URL",
                    help="SGLang server or router URL, e.g. http://127.0.0.1:30000; repeat it or give a comma "
                         "list for several servers (requests are spread over them)")
    ap.add_argument("--model", required=True, type=Path,
                    help="the served model's directory (config.json, tokenizer; also its safetensors weights when "
                         "the server leaves rebuildable states out, EAGLE3_DUMP_REBUILDABLE=omit)")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --model)")
    ap.add_argument("--data", required=True, type=Path, help="JSONL conversations (OpenAI messages or ShareGPT)")
    ap.add_argument("--dump-dir", type=Path, help="the servers' EAGLE3_DUMP_DIR as seen from here: one shared directory, or "
                    "the several it names (A:B, one per disk, in its order); required unless --mooncake-master "
                    "(then not used: the states come from the store)")
    ap.add_argument("--mooncake-master", metavar="HOST:PORT",
                    help="read each request's states from the Mooncake Store of the servers' Mooncake sink instead "
                         "of dump files: its mooncake_master (their EAGLE3_DUMP_MOONCAKE_MASTER); needs "
                         "--mooncake-metadata and the mooncake package in this Python (pip install "
                         "mooncake-transfer-engine-non-cuda, or the CUDA builds). Each answer's handle "
                         "(meta_info[\"eagle3_dump\"]) names its object, read within --dump-timeout, checked as a "
                         "file is, deleted once read (kept with --keep-dumps); objects of failed samples are deleted "
                         "too, those of a killed run stay until the server's EAGLE3_DUMP_MOONCAKE_TTL_S")
    ap.add_argument("--mooncake-metadata", metavar="URL",
                    help="with --mooncake-master: the master's HTTP metadata server, http://HOST:PORT/metadata "
                         "(the servers' EAGLE3_DUMP_MOONCAKE_METADATA)")
    ap.add_argument("--out", required=True, type=Path, help="dataset directory (created; reused to resume)")
    ap.add_argument("--format", choices=["specforge", "speculators", "compact", "dflash", "dspark"],
                    default="specforge",
                    help="specforge: torch.save samples SpecForge's OfflineEagle3Dataset reads (bf16); speculators: "
                         "its ArrowDataset (see --hidden-states-backend); compact: the dump's "
                         "states as stored (fp8, rebuildable states left out), read by eaglepatch.compact.CompactDataset "
                         "with the model directory; dflash, dspark: SpecForge 0.2.0's offline DFlash / DSpark samples "
                         "for the draft --draft-config names (the family must be the draft's)")
    ap.add_argument("--draft-config", type=Path, metavar="DIR",
                    help="--format dflash|dspark: the DFlash or DSpark draft's directory (or its config.json); its "
                         "target_layer_ids are read as SGLang reads that family's ids on the release that dumped "
                         "and the target's model file")
    ap.add_argument("--hidden-states-backend", choices=["file", "fp8"], default="file",
                    help="--format speculators: the speculators --hidden-states-backend the export is for. file "
                         "(default, as speculators'): the states in the model dtype (an fp8 dump's dequantised), "
                         "which every backend reads right; fp8: fp8 states with hidden_states_scales (half the "
                         "bytes), which speculators must train with --hidden-states-backend fp8 (its default file "
                         "backend would train on the raw fp8 codes, unscaled, without an error). The run's last "
                         "lines name the speculators flags")
    ap.add_argument("--max-len", type=int, default=2048, help="truncate conversations to this many tokens")
    ap.add_argument("--concurrency", type=int, default=4,
                    help="requests in flight, over all servers (give each replica several)")
    ap.add_argument("--processes", type=int, default=1, metavar="P",
                    help="deal the --concurrency requests over P worker processes, each with its own interpreter "
                         "lock and memory, which read, check and write the samples (this process records them); "
                         "for hosts where one process's Python is the ceiling (default 1: threads in this process)")
    ap.add_argument("--dump-timeout", type=float, default=60.0,
                    help="seconds a server may take to flush its dumps to disk (POST /eagle3_dump/flush, sent when "
                         "a request's file is not there once it answered); with --mooncake-master, to put a "
                         "request's object into the store after it answered")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds to wait for /generate")
    ap.add_argument("--retries", type=int, default=5, help="retries of transient HTTP failures per request")
    ap.add_argument("--max-attempts", type=int, default=3, help="attempts per sample (bad or missing dumps)")
    ap.add_argument("--aux-layers", type=_layer_ids, metavar="IDS",
                    help="EAGLE-3 ids (-1 = embedding output, k = output of layer k) of the draft's aux layers, "
                         "read as the server reads draft ids, e.g. --aux-layers=-1,1,29 (with '=': a value that "
                         "starts with '-') (default: the dumped layers except the last layer N-1); with --format "
                         "dflash|dspark instead of --draft-config: the draft's target_layer_ids, read as that "
                         "family's ids are, e.g. --aux-layers=1,12,24,35,47,58")
    ap.add_argument("--mask", choices=["auto", "generation", "offsets"], default="auto",
                    help="assistant-mask method (auto: {%% generation %%} blocks when the template has them)")
    ap.add_argument("--keep-dumps", action="store_true", help="keep the server's dump files after use (those of requests no sample used are "
                         "listed, not removed); with --mooncake-master, leave the objects in the store")
    ap.add_argument("--limit", type=int, help="extract only the first N conversations (samples done earlier stay)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow custom tokenizer code")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--log-every", type=float, default=30.0, metavar="S",
                    help="without the progress bar (--no-progress, or stderr not a terminal): a progress line with "
                         "the seconds spent per stage every S seconds (default 30)")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch.extract import install_fix, missing_modules
        from eaglepatch.extract.inputs import check_store_flags

        check_store_flags(a.mooncake_master, a.mooncake_metadata, a.dump_dir)  # before the packages are looked for
        missing = missing_modules(a.format)
        if missing:  # before anything is read, sent or written
            raise UsageError(f"extract.py --format {a.format} needs the Python package(s) {', '.join(missing)}, "
                             f"which {'is' if len(missing) == 1 else 'are'} not installed", install_fix(a.format, missing))
        from eaglepatch.extract import Options, extract

        opts = Options(servers=[u for arg in a.server for u in arg.split(",")], model=a.model,
                       tokenizer=a.tokenizer, data=a.data, dump_dir=a.dump_dir, out=a.out, format=a.format,
                       max_len=a.max_len, concurrency=a.concurrency, processes=a.processes,
                       dump_timeout=a.dump_timeout, request_timeout=a.request_timeout, retries=a.retries,
                       max_attempts=a.max_attempts, keep_dumps=a.keep_dumps, limit=a.limit, mask=a.mask,
                       aux_layers=a.aux_layers, draft_config=a.draft_config,
                       hidden_states_backend=a.hidden_states_backend,
                       trust_remote_code=a.trust_remote_code, progress=False if a.no_progress else None,
                       log_every=a.log_every, mooncake_master=a.mooncake_master,
                       mooncake_metadata=a.mooncake_metadata)
        return extract(opts)

    def guarded() -> int:
        import signal
        import threading

        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None  # SIGTERM = Ctrl-C
        try:
            return body()
        except KeyboardInterrupt:
            raise UsageError("interrupted (Ctrl-C or SIGTERM)", "the samples done are kept in --out: run the same "
                             "command again to go on from there") from None
        except ModuleNotFoundError as exc:
            from eaglepatch.extract import install_fix

            raise UsageError(f"extract.py needs the Python package {exc.name!r}, which is not installed",
                             install_fix(a.format, [exc.name])) from None
        finally:
            if main:
                signal.signal(signal.SIGTERM, before)

    return run_main(guarded)


if __name__ == "__main__":
    sys.exit(main())
