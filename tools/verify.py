#!/usr/bin/env python3
"""Verify the EAGLE-3 capture series against an SGLang tree: a verdict per hunk, the series
footprint, then smoke tests on a patched temporary copy (the tree itself is never written).

  python tools/verify.py ROOT [--series DIR] [--json FILE] [--smoke none|static|import|functional]
  python tools/verify.py --plugin [ROOT] [--json FILE] [--smoke none|functional [--smoke-work DIR]]

A release without a series of its own is verified against the nearest older series (and the
port command is named).

--plugin: instead of the series, whether the eaglepatch-capture plugin can hook this installed
sglang (default: the one this Python imports; ROOT: a site-packages dir or checkout holding
sglang/), with the plugin's own checks (sglang-plugin/targets.py, the ones its register() runs):
the release is one the plugin covers, and every hook target is there with the shape and the call
sites the plugin relies on (a line per target: ok, or drifted and why). A release the plugin does
not cover is refused in one line naming what to use. A warning says when SGLANG_PLUGINS is set
without eaglepatch_capture (sglang then loads none of the plugin, without an error).
--smoke functional then builds the plugin wheel from this checkout into a temporary directory and
runs the smoke's engine checks on the unmodified tree through sglang's own plugin loader (the
cached CPU environment of that release). The tree is only read.

Exit: 0 every hunk exact/offset (with --plugin: every target holds) and smoke passed, 1 drift or
smoke failure (or refused: no series at all, a pending transaction, a patched tree under --plugin),
2 usage or input error (a release the plugin does not cover; Ctrl-C or SIGTERM too: the temporary
copy is removed).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("verify.py", __doc__)
    ap.add_argument("root", metavar="ROOT", nargs="?",
                    help="SGLang git checkout or site-packages dir holding sglang/ (with --plugin, default: the "
                         "sglang this Python imports)")
    ap.add_argument("--plugin", action="store_true",
                    help="check the eaglepatch-capture plugin's hook targets on this installed sglang instead of "
                         "a series")
    ap.add_argument("--series", type=Path, metavar="DIR",
                    help="series dir (default: patches/sglang-<detected release>, else the nearest older one)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    ap.add_argument("--smoke", choices=["none", "static", "import", "functional"],
                    help="smoke level run on a patched temporary copy (default: static); with --plugin: none or "
                         "static (the target checks only, the default there) or functional (the smoke's engine "
                         "checks through the plugin)")
    ap.add_argument("--smoke-work", type=Path, metavar="DIR",
                    help="with --plugin --smoke functional: keep the smoke's work directory (the wheel, its install, "
                         "each check's dump files and logs) in DIR, which must not exist yet")
    a = ap.parse_args(argv)
    if a.smoke_work is not None and not a.plugin:
        ap.error("argument --smoke-work: only with --plugin")
    if a.root is None and not a.plugin:
        ap.error("the following arguments are required: ROOT")
    if a.plugin and a.series is not None:
        ap.error("argument --series: not allowed with --plugin (the plugin carries no series)")

    def body() -> int:
        if not a.plugin:  # the plugin's checks read source with the standard library only
            a.smoke = a.smoke or "static"
            cli.require("verify.py", "unidiff", *(["pyflakes"] if a.smoke != "none" else []))  # pyflakes: static smoke
        import signal
        import threading

        # SIGTERM as Ctrl-C (as tools/extract.py takes it): the temporary copy is removed on the way out
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
        try:
            return verify_plugin() if a.plugin else verify()
        finally:
            if main:
                signal.signal(signal.SIGTERM, before)

    def verify() -> int:
        from eaglepatch.outputs import check_output_file
        from eaglepatch.report import verify_tree, write_json
        from eaglepatch.lock import lock_timeout
        from eaglepatch.tree import resolve_series

        lock_timeout()  # a bad EAGLEPATCH_LOCK_TIMEOUT: one line, exit 2, before anything is read or written
        if a.json is not None:
            check_output_file(a.json, "--json")
        pick = resolve_series(a.root, a.series, nearest=True)
        rep = verify_tree(pick.tree, pick.series, a.smoke, say=lambda m: print(m, file=sys.stderr),
                          notes=[pick.note] if pick.note else None)
        if a.json:
            write_json(a.json, rep)
        print(rep.human())
        return rep.exit_code

    def verify_plugin() -> int:
        from eaglepatch import plugin_check
        from eaglepatch.outputs import check_output_file, write_atomic

        plugin_check.check_smoke_level(a.smoke)
        plugin_check.check_keep(a.smoke_work, a.smoke)
        if a.json is not None:
            check_output_file(a.json, "--json")
        rep = plugin_check.check(a.root)
        if rep.env_warning:
            print(f"warning: {rep.env_warning}", file=sys.stderr)
        if a.smoke in ("import", "functional") and not rep.drifted and not rep.patched:
            rep.smoke = plugin_check.smoke(rep, a.smoke, say=lambda m: print(m, file=sys.stderr), keep=a.smoke_work)
        if a.json:
            import json

            write_atomic(a.json, json.dumps(rep.as_dict(), indent=2, sort_keys=True) + "\n", "--json")
        print(rep.human())
        if rep.patched:
            raise plugin_check.patched_refusal(rep)
        return rep.exit_code

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
