#!/usr/bin/env python3
"""The GPU check of a patched SGLang (checks a-e of docs/gpu.md) on a CUDA machine.

  python3 tools/gpucheck.py --make-patched-files --series patches/sglang-<release> [--release R] [--patched-files DIR]
  python3 tools/gpucheck.py --site DIR (--patched-files DIR | --series DIR | --package-parent DIR | --plugin WHEEL)
                            [--checks abce] [--out FILE] [--logs FILE.tar.gz] [--work DIR] [--budget-s 540]
                            [--unpatched-parent DIR] [--dump-ids=-1,1,2,3] [--new-tokens 16] [--prefill-graph]

--site is the unpacked GPU bundle (tools/gpu_bundle.py; it holds the upstream sglang and what it
needs). The sglang under test is --site's sglang with the series laid over a copy: --patched-files is
the series applied here (--make-patched-files writes it, default .gpu-patched; no git needed on
the GPU machine), --series applies it there with git. a, b, c and e run on one GPU; d needs two
(run it alone: --checks d). --plugin WHEEL checks the unmodified --site sglang with the eaglepatch-capture
plugin (tools/export.py --plugin DIR builds it) in the engines under test; the unpatched engines of e, f
and h run without it. Raw results go to --out as JSON (docs/results/ keeps them).
Exit: 0 every check passed, 1 a check failed, 2 usage error (no CUDA, no sglang, bad arguments).
"""
import argparse
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def _ids(text: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a comma list of integers (e.g. -1,1,2,3)" % text)


def main(argv=None) -> int:
    ap = cli.parser("gpucheck.py", __doc__)
    ap.add_argument("--site", type=Path, help="unpacked GPU bundle (holds the upstream sglang)")
    ap.add_argument("--series", type=Path, help="series applied to a copy of --site's sglang")
    ap.add_argument("--patched-files", type=Path, help="files of the series applied here (--make-patched-files writes them)")
    ap.add_argument("--make-patched-files", action="store_true",
                    help="apply --series to the released wheel here and write --patched-files (default .gpu-patched)")
    ap.add_argument("--release", help="release of --make-patched-files (default: the series directory's name)")
    ap.add_argument("--package-parent", type=Path, help="an already patched package parent (instead of --series)")
    ap.add_argument("--plugin", type=Path, help="the eaglepatch-capture wheel: check the unmodified --site sglang "
                                                "with it (instead of a patched tree)")
    ap.add_argument("--unpatched-parent", type=Path, help="the unpatched sglang for check e (default: --site)")
    ap.add_argument("--e-decode-only", action="store_true",
                    help="check e: decode alone (no prefill benchmark first), the series with the dump off and "
                         "on against unpatched")
    ap.add_argument("--checks", default="abce", help="letters of the checks to run (default abce; d alone on 2 GPUs; f: a draft in upstream's id convention, patched vs unpatched; g: the dump in production settings, overlap off and on; h: a DFlash draft on SGLang's own DFLASH worker, patched (dump off and on) vs unpatched, bit for bit)")
    ap.add_argument("--g-modes", default="off,on,http",
                    help="check g's engines, comma-separated: off (overlap scheduler off), on (overlap on), "
                         "http (overlap on, launch_server over HTTP), fp8 (overlap on, the compact dump: fp8, "
                         "rebuildable states left out); default off,on,http")
    ap.add_argument("--out", type=Path, default=Path("gpucheck-results.json"), help="results JSON")
    ap.add_argument("--logs", type=Path, help="also write the engine logs as one .tar.gz")
    ap.add_argument("--work", type=Path, default=Path("/tmp/eaglepatch-gpucheck"), help="scratch directory")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting engines after this many seconds")
    ap.add_argument("--dump-ids", type=_ids, help="dump layer ids for c/d (default -1,1,2,N-1)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request in a-d")
    ap.add_argument("--prefill-graph", action="store_true", help="keep sglang's prefill CUDA graph in a/b")
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # check c on the CPU smoke env (tests)
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch.errors import UsageError
        from eaglepatch.gpucheck.check import CHECKS, Options, run_check

        if a.make_patched_files:
            cli.require("gpucheck.py", "unidiff")  # --make-patched-files reads the series with unidiff
            from eaglepatch.gpucheck.patched_files import make_patched_files

            if a.series is None:
                raise UsageError("--make-patched-files needs --series", "pass --series patches/sglang-<release>")
            release = a.release or a.series.resolve().name.replace("sglang-", "")
            out = a.patched_files or REPO / ".gpu-patched"
            m = make_patched_files(a.series, release, out)
            print("patched files: %d files of %s for sglang %s in %s" % (len(m["files"]), a.series, release, out))
            return 0
        bad = sorted(set(a.checks) - set(CHECKS))
        if bad or not a.checks:
            raise UsageError("--checks %r has unknown letters %s" % (a.checks, bad), "use letters of %s" % CHECKS)
        bad_modes = sorted(set(a.g_modes.split(",")) - {"off", "on", "http", "fp8"})
        if bad_modes or not a.g_modes:
            raise UsageError("--g-modes %r has unknown modes %s" % (a.g_modes, bad_modes),
                             "use off, on, http and/or fp8")
        if a.new_tokens < 2:
            raise UsageError("--new-tokens %d is too small" % a.new_tokens, "use at least 2 (verify needs decoding)")
        opts = Options(out=a.out, work=a.work, site=a.site, package_parent=a.package_parent, series=a.series,
                       patched_files=a.patched_files,
                       unpatched_parent=a.unpatched_parent, plugin=a.plugin, checks=a.checks, budget_s=a.budget_s,
                       new_tokens=a.new_tokens, dump_ids=a.dump_ids, prefill_graph=a.prefill_graph,
                       cpu=a.cpu, g_modes=a.g_modes, e_decode_only=a.e_decode_only)
        try:
            res = run_check(opts)
        finally:
            if a.logs is not None and a.work.is_dir():
                with tarfile.open(a.logs, "w:gz") as tar:
                    for p in sorted(a.work.glob("stages/*/*")) + sorted(a.work.glob("spy/*/hooks-*.txt")):
                        tar.add(p, arcname=str(p.relative_to(a.work)))
        rows = res.get("results", [])
        for r in rows:
            print("%s %s: %s" % ("PASS" if r["passed"] else "FAIL", r["name"], r["figure"]))
        print("%d passed, %d failed" % (sum(r["passed"] for r in rows), sum(not r["passed"] for r in rows)))
        return 0 if res.get("passed") else 1

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
