#!/usr/bin/env python3
"""Check your own EAGLE-3 draft before serving it: does it accept at the rate its training predicts on
this release, and if not, which layer mix-up explains it?

  python3 tools/check_draft.py --target TARGET --draft DRAFT --data HELDOUT --states DUMPS \
      [--release R] --out REPORT.json [--served SERVED.json | --serve [--site SITE --patched-files DIR]]

TARGET: the checkpoint the draft was trained for (config.json and its safetensors weights, sharded
with model.safetensors.index.json or one model.safetensors: the LM head and embedding come from
it). DRAFT: the draft directory (config.json with eagle_config.eagle_aux_hidden_state_layer_ids,
model.safetensors), as SpecForge writes it. HELDOUT: held-out data the draft's training predicts
on, a specforge-format dataset from tools/extract.py. DUMPS: the dump files of the same
conversations (tools/extract.py --keep-dumps against a server dumping every layer the readings
need, with the final state). The release judged for (R below) is --release, else the one that
dumped HELDOUT, as its manifest records it and tools/guard.py reads it (one that no series here
reads is refused); the output's first line and the report name it and why. Steps: guard (the
draft's config against the data's layers on R); the prediction (the draft's own forward over
HELDOUT, greedy chain acceptance per position, and the chain at the answer lengths); the observed
figures (--serve: the draft served on this GPU by sglang R, with the series unless --unpatched,
with EAGLE-3 and these settings, one greedy request per held-out answer, the accept length read
from the responses' meta_info and written to --served-out, REPORT.served.json by default, in the
format --served reads; --served: such a file; without either the draft is replayed on the states R
feeds it by its config, read from DUMPS, and reported as replayed: no server loads a draft then);
the diagnosis (the draft replayed on each reading a layer mix-up produces: as trained, each aux
layer one deeper or shallower, upstream's capture-index convention, the last slot's pre-norm and
post-norm states swapped; which reading the prediction and the observed figures match). Writes
REPORT.json and a PNG beside it (REPORT.png) of the per-position acceptance, predicted vs observed
(the report says when no PNG could be made). Without --serve it runs in the CPU environment
(tools/acceptance.py --cpu's) by itself; --serve needs a CUDA GPU (sglang's EAGLE-3 decoding runs
CUDA and Triton kernels) and is refused without one.

DFlash and DSpark drafts (their config's family, read as tools/guard.py reads it): the layer
verdict alone, for the release judged as above and the model file of --target's architectures
(tools/guard.py's table), with the readings of every release and model file; nothing is replayed or
served (the replay runs SpecForge's EAGLE-3 draft only), the report says so, and the measured part's
flags (--states, --served, --serve, ...) are refused. --target needs only its config.json then.

Exit: 0 guard passes and the observed accept length is within --tolerance of the predicted (with
--lossless, every served answer equals the data's too), 1 it is not or guard fails (the diagnosis on
the last line), or the server failed, 2 usage error (one line, nothing written).
"""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import UsageError, run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("check_draft.py", __doc__)
    ap.add_argument("--target", required=True, type=Path, help="the target checkpoint directory")
    ap.add_argument("--draft", required=True, type=Path, help="the draft directory (config.json, model.safetensors)")
    ap.add_argument("--data", required=True, type=Path, help="held-out dataset (tools/extract.py --format specforge)")
    ap.add_argument("--states", type=Path, help="the held-out conversations' dump files (every layer the readings "
                                               "need, and the final state): the replays read them")
    ap.add_argument("--served", type=Path, help="a GPU serving run's figures (JSON: accept_length, per_position; "
                                               "--serve writes them); without it or --serve the observed figures "
                                               "are the replay on --states")
    ap.add_argument("--release", help="the sglang release that serves the draft (default: the release that dumped "
                                      "--data, as its manifest records; the report and the first line say which "
                                      "release was judged for, and why)")
    ap.add_argument("--unpatched", action="store_true", help="the release without the series serves it")
    ap.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    ap.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (the replay models 1: a chain)")
    ap.add_argument("--draft-tokens", type=int, help="--speculative-num-draft-tokens (default: steps + 1)")
    ap.add_argument("--tolerance", type=float, default=0.15, help="|observed - predicted| accept length that passes")
    ap.add_argument("--prompt-answer-tokens", type=int, default=0, metavar="K",
                    help="the first K tokens of each answer go with its prompt (served) and are not predicted: "
                         "answers that start with tokens the user gave (the acceptance toy's copy answers start "
                         "with the symbol to copy from)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="where the draft replays (default: cuda with --serve, "
                                                             "else cpu)")
    ap.add_argument("--out", required=True, type=Path, help="the JSON report (the PNG goes beside it, .png)")
    g = ap.add_argument_group("serving on this GPU (--serve)")
    g.add_argument("--serve", action="store_true", help="serve the draft with sglang --release and EAGLE-3 on this "
                                                       "GPU, one greedy request per held-out answer")
    g.add_argument("--site", type=Path, help="the release's site directory (sh .gpu-bundle/unpack.sh SITE); without "
                                            "it and --sglang-parent, the sglang this Python imports")
    g.add_argument("--patched-files", type=Path, help="the series' patched files, laid over a copy of --site's sglang "
                                                     "(python3 tools/gpucheck.py --make-patched-files)")
    g.add_argument("--sglang-parent", type=Path, help="a directory holding the sglang package to serve with")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (--tp-size)")
    g.add_argument("--port", type=int, default=30000, help="the server's port on 127.0.0.1")
    g.add_argument("--server-args", help="more sglang.launch_server flags, one string (e.g. '--mem-fraction-static "
                                         "0.8 --context-length 8192')")
    g.add_argument("--serve-timeout-s", type=float, default=900.0, help="seconds for the server's start and every "
                                                                        "request")
    g.add_argument("--served-out", type=Path, help="where the served figures go (default: REPORT.served.json)")
    g.add_argument("--lossless", action="store_true",
                   help="every served answer must equal the held-out data's (data that are the target's greedy output "
                        "on this release, as tools/acceptance.py makes them), else exit 1")

    def error(message):
        raise UsageError(message, "see tools/check_draft.py --help")

    ap.error = error

    def body() -> int:
        a = ap.parse_args(argv)
        from eaglepatch import guard
        from eaglepatch.acceptance import check
        from eaglepatch.outputs import check_output_file

        i = check.Inputs(target=a.target, draft=a.draft, data=a.data, states=a.states, served=a.served,
                         release=a.release, unpatched=a.unpatched, steps=a.steps, topk=a.topk,
                         draft_tokens=a.steps + 1 if a.draft_tokens is None else a.draft_tokens,
                         tolerance=float(a.tolerance), device=a.device or ("cuda" if a.serve else "cpu"),
                         prompt_answer_tokens=a.prompt_answer_tokens, lossless=a.lossless)
        # everything a run can be refused for, before the environment is entered or anything loaded
        check.check_settings(i)
        if a.release is not None:
            guard.release_semantics(a.release, unpatched=a.unpatched)
        out = check_output_file(a.out, "--out")
        png = out.with_suffix(".png")
        check_output_file(png, "--out's PNG")
        for flag, p in (("--target", a.target), ("--draft", a.draft), ("--data", a.data), ("--states", a.states)):
            if p is not None and not p.is_dir():
                raise UsageError(f"{flag} {p} is not a directory",
                                 f"pass {flag} a directory (tools/check_draft.py --help)")
        cfg = check.target_text_config(a.target)
        check.draft_config(a.draft, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg)
        draft = guard.read_draft(a.draft)
        if draft.family in (guard.DFLASH, guard.DSPARK):
            return run_block(a, i, draft, cfg, out)
        # an EAGLE-3 draft: its target's model file must serve EAGLE-3 drafts (deepseek_v2.py, kimi_k25.py)
        cell = guard.conventions.config_cell(cfg)
        if cell not in guard.conventions.SERIES_MODEL_FILES:
            raise UsageError(f"sglang serves no EAGLE-3 draft on {guard.conventions.CELL_NAMES[cell]} (the model file "
                             f"of --target {a.target}: it has no set_eagle3_layers_to_capture)",
                             "check a DFlash or DSpark draft for this target")
        tcfg = check.target_config(a.target)
        check.draft_config(a.draft, tcfg)
        # the release judged for: --release, else the one that dumped --data (its manifest), as guard.py judges
        i.release, i.release_from = guard.judged_release(guard.read_dataset(a.data), a.release)
        guard.release_semantics(i.release, unpatched=a.unpatched)
        if a.serve and a.served:
            raise UsageError("--serve and --served both give served figures", "pass one of them")
        given = [f for f, v in (("--site", a.site), ("--patched-files", a.patched_files),
                                ("--sglang-parent", a.sglang_parent), ("--server-args", a.server_args),
                                ("--served-out", a.served_out)) if v is not None]
        if given and not a.serve:
            raise UsageError(f"{', '.join(given)}: settings of --serve, which is not given",
                             "add --serve, or drop them")
        if a.lossless and not (a.serve or a.served):
            raise UsageError("--lossless compares served answers with the held-out data's, and nothing is served",
                             "add --serve (GPU) or --served FILE, or drop --lossless")
        if a.served:
            check.read_served(a.served, a.steps, a.lossless)
        elif a.states is None and not a.serve:
            raise UsageError("nothing to compare the prediction with", "pass --states DIR (the held-out conversations' "
                             "dump files), --served FILE (a GPU serving run's figures) or --serve (serve it on "
                             "the GPU)")
        plan = None
        if a.serve:
            from eaglepatch.acceptance import serve_check

            served_out = check_output_file(a.served_out or out.with_suffix(".served.json"), "--served-out")
            log = check_output_file(out.with_suffix(".server.log"), "--out's server log")
            if served_out in (out, png, log):
                raise UsageError(f"--served-out {served_out} is the report, its PNG or its server log",
                                 "pass --served-out another file")
            plan = serve_check.plan(i.release, a.unpatched, a.site, a.patched_files, a.sglang_parent, a.tp, a.port,
                                    a.server_args, a.serve_timeout_s, served_out, log)
        try:
            return run_check(i, argv, out, png, plan)
        finally:
            if plan is not None:
                plan.cleanup()

    return run_main(body)


def run_block(a, i, draft, cfg: dict, out: Path) -> int:
    """A DFlash/DSpark draft: guard's layer verdict for the release judged (as for EAGLE-3 drafts) on the
    target's model file, the readings table, and what is not checked; the report at ``out`` (no PNG:
    nothing is measured). The measured part's flags are refused: nothing would read them."""
    from eaglepatch import conventions, guard
    from eaglepatch.acceptance import check
    from eaglepatch.outputs import write_atomic

    name = conventions.FAMILY_NAMES[draft.family]
    given = [f for f, v in (("--states", a.states), ("--served", a.served), ("--serve", a.serve),
                            ("--lossless", a.lossless), ("--prompt-answer-tokens", a.prompt_answer_tokens),
                            ("--device", a.device), ("--site", a.site), ("--patched-files", a.patched_files),
                            ("--sglang-parent", a.sglang_parent), ("--server-args", a.server_args),
                            ("--served-out", a.served_out)) if v]
    if given:
        raise UsageError(f"{', '.join(given)}: the measured check (the replay, serving) is EAGLE-3-only; for a {name} "
                         f"draft check_draft gives the layer verdict alone", f"drop {', '.join(given)}")
    data = guard.read_dataset(a.data)
    i.release, i.release_from = guard.judged_release(data, a.release)
    guard.release_semantics(i.release, unpatched=a.unpatched)
    guard.check_storage(draft, data)  # RefusedError (exit 1): a dataset the draft's trainer cannot read
    res = check.check_block(i, draft, data, cfg)
    code, line = check.block_outcome(res)
    res.update(exit=code, verdict=line, png={"path": None, "why": f"no PNG: nothing is measured for a {name} draft"})
    write_atomic(out, json.dumps(res, indent=2) + "\n", "--out")
    print("\n".join([res["release"]["line"], f"model file: {conventions.CELL_NAMES[res['model_file']]} (--target's "
                                                 f"architectures {res['target']['architectures']})"]
                    + res["guard"]["lines"] + [""] + res["readings_lines"] + [f"not checked: {res['not_checked']}"]))
    print(line, file=sys.stderr)
    return code


def run_check(i, argv, out: Path, png: Path, plan) -> int:
    """The checked run: re-run in the CPU environment when a CPU replay lacks torch or SpecForge
    here; else ``check.check`` (serving as ``plan`` says, after the prediction), the report, the
    PNG and the outcome."""
    from eaglepatch.acceptance import check

    if i.device == "cpu" and os.environ.get("EAGLEPATCH_CHECK_ENV") != "1":
        import importlib.util

        if not all(importlib.util.find_spec(m) for m in ("torch", "specforge")):
            # run in the CPU environment (torch, transformers, SpecForge 0.2.0)
            from eaglepatch import cpuenv

            try:
                py = cpuenv.ensure_env()
            except RuntimeError as exc:
                raise UsageError(f"the CPU environment could not be built ({' '.join(str(exc).split())[:200]})",
                                 "fix what the log names and rerun") from None
            import subprocess

            env = dict(os.environ, EAGLEPATCH_CHECK_ENV="1", PYTHONPATH=os.pathsep.join(
                [str(REPO / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
            return subprocess.call([str(py), __file__, *(argv if argv is not None else sys.argv[1:])], env=env)

    def say(m):
        print(m, file=sys.stderr, flush=True)

    serving = None
    if plan is not None:
        from eaglepatch.acceptance import serve_check

        serving = serve_check.Serving(plan, i, say)
    res = check.check(i, say=say, serving=serving)
    try:
        res["png"] = {"path": str(png), "drawn_with": check.plot(res, png)}
    except ImportError:
        res["png"] = {"path": None, "why": "no PNG: neither matplotlib nor PIL is installed in this environment"}
    code, line = check.outcome(res)
    res.update(exit=code, verdict=line)
    from eaglepatch.outputs import write_atomic

    write_atomic(out, json.dumps(res, indent=2) + "\n", "--out")
    print(summary(res))
    print(line, file=sys.stderr)
    return code


def summary(res: dict) -> str:
    """What stdout shows: guard, predicted and observed per position, each reading, the diagnosis."""
    p, o = res["predicted"], res["observed"]
    fmt = lambda xs: " ".join("-" if x is None else "%.3f" % x for x in (xs or []))  # noqa: E731
    lines = [res["release"]["line"], "guard: %s" % ("OK" if res["guard"]["ok"] else "MISMATCH"),
             "%-28s accept length %.3f   per position %s" % ("predicted", p["accept_length"], fmt(p["per_position"])),
             "%-28s accept length %.3f   per position %s" % (o["kind"], o["accept_length"], fmt(o.get("per_position")))]
    for r in res.get("readings", []):
        if "accept_length" in r:
            lines.append("  reading %-20s %s: %.3f   per position %s" % (
                "/".join(r["kinds"]), r["hf"], r["accept_length"], fmt(r["per_position"])))
        else:
            lines.append("  reading %-20s %s: not replayed (%s)" % ("/".join(r["kinds"]), r["hf"], r["not_replayed"]))
    if o.get("answers_equal_to_data") is not None:
        lines.append("served answers equal to the held-out data's: %d of %d" % (o["answers_equal_to_data"],
                                                                               o["requests_compared"]))
    lines.append("diagnosis: " + res["diagnosis"]["text"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
