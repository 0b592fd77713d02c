#!/usr/bin/env python3
"""Acceptance, end to end: train a context-dependent DeepSeek-V3 target, extract its hidden states from
the patched SGLang with tools/extract.py, train an EAGLE-3 draft on them with SpecForge 0.2.0, and serve it
with its controls (off-by-one ids, a floor draft with zeroed aux inputs, upstream-convention ids on
unpatched SGLang), checking each with tools/guard.py first.

  python3 tools/acceptance.py --cpu --work DIR [--out RESULT.json]          # the toy, on CPU
  python3 tools/acceptance.py --work DIR --site SITE --patched-files DIR --out RESULT.json   # GPU

--cpu runs the toy of tests/test_acceptance.py in the cached CPU environment with sglang 0.5.9 (patched
tree from the cache). No server loads a draft there (sglang runs no EAGLE-3 decoding on CPU): each
control's accept length is replayed from the extracted data and reported as `replayed`, which shows what
a layer mix-up costs, not that serving works. The GPU run serves sglang 0.5.17 from SITE (an unpacked
.gpu-bundle) with the series' patched files laid over a copy, and reports `served`.
Phases: target, data, drafts, guard, then serve (GPU) or replay (CPU); each is timed in the result, and
long ones print progress at least every 30 s. --budget-s stops starting phases when the time is spent
(0: no budget); the same --work resumes (target and data are reused). The target trains until its gates
pass (checked whenever its token accuracy reaches target_done_acc), within --budget-s (and
--target-budget-s, where given); a call whose budget ends first saves the training state (weights,
optimizer, step, RNG, history) as WORK/target-training.pt and exits 3 with one line naming the steps,
the token accuracy, each failing gate and how far it is, and the command to continue: the same command,
same --work, goes on at the saved step (a state of another seed, scale or setting is refused). A target
that passed with less than later_phases_s of the budget left also exits 3; the next call reuses it.
Drafts the budget cut short are not measured: the run reports no accept length and ends with `not
measured: drafts trained N of M steps (budget)`. Settings, --out, the ports and a given --target are
checked before anything is trained.
Compact dump (issue 30): --set dump_dtype=fp8 --set rebuildable=omit runs the data server with
EAGLE3_DUMP_DTYPE=fp8 and EAGLE3_DUMP_REBUILDABLE=omit; its data, drafts and server logs go to
WORK/data-fp8-omit, drafts-fp8-omit and logs-fp8-omit beside the default ones, its conversations are
WORK/data's when both are of the same prompts, so one --work compares the two on one target. --set controls=correct --set draft_seeds=3 trains (and serves) only the correct
draft, once per draft seed (seeds draft_seed, +1, ...; draft_seed defaults to --seed).
benchmarks/fp8_accept.py compares two such results (docs/acceptance.md, "Compact dump").
Exit: 0 done and every verdict passed, 1 a verdict failed or the figures were not measured (a taken port
too), 2 usage error or a refused target, 3 incomplete: the budget ended before the target passed its gates
(or left the later phases too little); what was done is under --work: run the same command again.
"""
import json
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import UsageError, run_main  # noqa: E402


def again_command(a, args: list) -> str:
    """This call's command, to run it again (an incomplete call names it): python3, this script as
    given (relative to the working directory where it lies below it) and the same arguments; for
    the GPU run with the PYTHONPATH it had (the bundle's site)."""
    script = os.path.relpath(__file__)
    script = script if not script.startswith("..") else __file__
    pp = os.environ.get("PYTHONPATH")
    env = f"PYTHONPATH={shlex.quote(pp)} " if pp and not a.cpu else ""
    return env + shlex.join(["python3", script, *args])


def main(argv=None) -> int:
    ap = cli.parser("acceptance.py", __doc__)
    ap.add_argument("--work", required=True, type=Path,
                    help="work directory (created; reused to resume: the trained target, the data, and the target's "
                         "training state a call that exits 3 leaves there)")
    ap.add_argument("--out", type=Path, help="write the result JSON here (default: WORK/result.json)")
    ap.add_argument("--cpu", action="store_true", help="the CPU toy (cached CPU environment, sglang 0.5.9)")
    ap.add_argument("--target", type=Path, help="your own DeepSeek-V3 checkpoint instead of training one (it must "
                                               "use the chat tokenizer of eaglepatch.serve.tinychat; the gates still apply)")
    ap.add_argument("--site", type=Path, help="GPU: the unpacked bundle's site directory (sh .gpu-bundle/unpack.sh SITE)")
    ap.add_argument("--patched-files", type=Path, help="GPU: the series' patched files (gpucheck.py --make-patched-files)")
    ap.add_argument("--sglang-parent", type=Path, help="a patched sglang package parent (instead of --patched-files)")
    ap.add_argument("--release", help="the serving release whose reading guard checks (default: 0.5.9 with --cpu, "
                                      "else 0.5.17)")
    ap.add_argument("--budget-s", type=float, default=570.0,
                    help="wall-clock budget; 0: none (default: %(default)s)")
    ap.add_argument("--target-steps", type=int, help="target training steps (default: the scale's)")
    ap.add_argument("--target-budget-s", type=float, help="target training seconds at most in one call (default: no cap "
                                                         "of its own: the target trains until its gates pass, within "
                                                         "--budget-s)")
    ap.add_argument("--draft-budget-s", type=float, help="seconds of the correct draft's training, where draft_max_steps "
                                                        "is 0 (default: the scale's)")
    ap.add_argument("--accept-failed-gates", action="store_true",
                    help="go on when the target fails a gate (to try the pipeline's plumbing: the figures then do "
                         "not measure layer choice, and the exit code is 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one setting of the scale (e.g. --set symbols=16 --set target_lr=0.002; the keys "
                         "are the result's `settings`)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the language, weights and prompts (default: 0)")
    ap.add_argument("--port", type=int, default=31000, help="first server port (default: %(default)s)")
    a = ap.parse_args(argv)
    args = list(argv if argv is not None else sys.argv[1:])

    def body() -> int:
        from eaglepatch.acceptance.pipeline import Options, check_options, parse_sets

        if a.cpu and (a.site or a.patched_files):
            raise UsageError("--site and --patched-files are for the GPU run", "drop them with --cpu")
        scale = "cpu" if a.cpu else "gpu"
        overrides = parse_sets(scale, a.set)
        for flag, key, v in (("--target-steps", "target_steps", a.target_steps),
                             ("--target-budget-s", "target_budget_s", a.target_budget_s),
                             ("--draft-budget-s", "draft_budget_s", a.draft_budget_s)):
            if v is not None:
                if not v >= 0 or v == float("inf"):
                    raise UsageError(f"{flag} {v}: not a number >= 0", f"e.g. {flag} 100")
                overrides[key] = v
        if not a.cpu:
            if a.site is None:
                raise UsageError("the GPU run needs --site SITE (the unpacked bundle)", "sh .gpu-bundle/unpack.sh SITE")
            if a.sglang_parent is None and a.patched_files is None:
                raise UsageError("the GPU run needs the patched sglang", "pass --patched-files DIR or --sglang-parent DIR")
        out = a.out or a.work / "result.json"
        o = Options(work=a.work, scale=scale, out=out, target=a.target,
                    release=a.release or ("0.5.9" if a.cpu else "0.5.17"), sglang_parent=a.sglang_parent,
                    unpatched_parent=a.site, site=a.site, budget_s=a.budget_s, seed=a.seed, overrides=overrides,
                    port=a.port, accept_failed_gates=a.accept_failed_gates,
                    again=(a.cpu and os.environ.get("EAGLEPATCH_ACCEPTANCE_ENV") == "1"
                           and os.environ.get("EAGLEPATCH_ACCEPTANCE_AGAIN")) or again_command(a, args))
        check_options(o)  # before any work: nothing built, copied, trained or written yet
        if a.cpu and os.environ.get("EAGLEPATCH_ACCEPTANCE_ENV") != "1":
            from eaglepatch import cpuenv

            try:
                py = cpuenv.ensure_env()
            except RuntimeError as exc:
                raise UsageError(f"the CPU environment could not be built ({' '.join(str(exc).split())[:200]})",
                                 "fix what the log names and rerun") from None
            env = dict(os.environ, EAGLEPATCH_ACCEPTANCE_ENV="1",
                       EAGLEPATCH_ACCEPTANCE_AGAIN=again_command(a, args),  # the user's command, not the child's
                       PYTHONPATH=os.pathsep.join([str(REPO / "src")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
            import subprocess

            return subprocess.call([str(py), __file__, *args], env=env)
        from eaglepatch.acceptance.pipeline import SCALES, Run
        from eaglepatch.acceptance.verdicts import outcome

        if dict(SCALES[scale], **overrides)["device"] == "cuda":  # the process that trains: torch is here
            import torch

            if not torch.cuda.is_available():
                raise UsageError(f"device=cuda, and torch {torch.__version__} here sees no CUDA device",
                                 "drop --set device=cuda (the CPU toy trains on cpu)" if a.cpu else
                                 "run on a machine with a CUDA GPU, or pass --cpu for the CPU toy")
        if not a.cpu and o.sglang_parent is None:
            from eaglepatch.gpucheck.patched_files import lay_patched_files

            o.sglang_parent = lay_patched_files(a.patched_files, a.site, a.work.absolute() / "patched").resolve()
        a.work.mkdir(parents=True, exist_ok=True)
        res = Run(o).run()
        code, line = outcome(res)
        if line.startswith("not measured"):  # no figure to show: the one line says why
            print(line, file=sys.stderr)
            return code
        print(json.dumps({"verdicts": res["verdicts"], "phases": res["phases"], "out": str(out)}, indent=2))
        print(line, file=sys.stderr)
        return code

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
