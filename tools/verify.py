#!/usr/bin/env python3
"""Verify the EAGLE-3 capture series against an SGLang tree: a verdict per hunk, the series
footprint, then smoke tests on a patched temporary copy (the tree itself is never written).

  python tools/verify.py ROOT [--series DIR] [--json FILE] [--smoke none|static|import|functional]

A release without a series of its own is verified against the nearest older series (and the
port command is named). Exit: 0 every hunk exact/offset and smoke passed, 1 drift or smoke failure
(or refused: no series at all, a pending transaction), 2 usage or input error (Ctrl-C or SIGTERM too:
the temporary copy is removed).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("verify.py", __doc__)
    ap.add_argument("root", metavar="ROOT", help="SGLang git checkout or site-packages dir holding sglang/")
    ap.add_argument("--series", type=Path, metavar="DIR",
                    help="series dir (default: patches/sglang-<detected release>, else the nearest older one)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    ap.add_argument("--smoke", choices=["none", "static", "import", "functional"], default="static",
                    help="smoke level run on a patched temporary copy (default: static)")
    a = ap.parse_args(argv)

    def body() -> int:
        cli.require("verify.py", "unidiff", *(["pyflakes"] if a.smoke != "none" else []))  # pyflakes: the static smoke
        import signal
        import threading

        # SIGTERM as Ctrl-C (as tools/extract.py takes it): the temporary copy is removed on the way out
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
        try:
            return verify()
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

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
