#!/usr/bin/env python3
"""Apply the pinned EAGLE-3 capture series to an SGLang tree (zero fuzz, all or nothing).

  python tools/apply.py ROOT [--check] [--reverse] [--force] [--commit] [--series DIR]
  python tools/apply.py --fetch [RELEASE [DEST]]

ROOT is an SGLang git checkout (python/sglang/...) or a dir holding the installed sglang/ package.
The tree is locked while the tool runs; a change is one transaction (an interrupted one is
finished or undone by the next run that writes the tree; --check writes nothing).
Exit: 0 applied / already applied, 1 refused (tree untouched), 2 usage or input error.
"""
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import PINNED_RELEASE  # noqa: E402
from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("apply.py", __doc__)
    ap.add_argument("root", nargs="?", metavar="ROOT", help="SGLang git checkout or site-packages dir holding sglang/")
    ap.add_argument("--series", type=Path, metavar="DIR", help="series dir (default: patches/sglang-<detected release>)")
    ap.add_argument("--check", action="store_true", help="write nothing; print per-patch and per-hunk results")
    ap.add_argument("--reverse", action="store_true", help="remove the series, restoring the original bytes")
    ap.add_argument("--force", action="store_true", help="apply over local edits / anchor drift (still zero fuzz)")
    ap.add_argument("--commit", action="store_true",
                    help="git checkouts: one commit per patch on branch eaglepatch/sglang-<release> (with --force: "
                         "replacing an existing one, whose old commit is printed)")
    ap.add_argument("--fetch", nargs="*", metavar="[RELEASE [DEST]]",
                    help=f"download RELEASE (default: the pinned release, {PINNED_RELEASE}) into a new git repo "
                         "DEST (default: ./sglang-RELEASE) and apply there with --commit; a DEST it made before is "
                         "accepted as it is, or, reversed since, patched again")
    a = ap.parse_args(argv)
    command = " ".join(shlex.quote(x) for x in ["python3", "tools/apply.py", *(sys.argv[1:] if argv is None
                                                                                else argv)])

    def body() -> int:
        # GitPython: the commits of --commit and --fetch
        cli.require("apply.py", "unidiff", *(["git"] if a.commit or a.fetch is not None else []))
        from eaglepatch.applier import apply_series, fetch_and_apply
        from eaglepatch.errors import UsageError
        from eaglepatch.lock import lock_timeout

        lock_timeout()  # a bad EAGLEPATCH_LOCK_TIMEOUT: one line, exit 2, before anything is read or written
        from eaglepatch.series import available_series, check_release, load_series
        from eaglepatch.tree import resolve_series

        if a.fetch is not None:
            if a.root or len(a.fetch) > 2:
                raise UsageError("--fetch takes at most RELEASE and DEST and no ROOT",
                                 "run: apply.py --fetch [RELEASE [DEST]]")
            if a.check or a.reverse:
                raise UsageError("--fetch makes a new patched checkout; --check and --reverse do not apply",
                                 "drop --check / --reverse")
            release = check_release(a.fetch[0], "--fetch") if a.fetch else PINNED_RELEASE
            given = load_series(a.series) if a.series is not None else None
            have = {given.release: a.series} if given else available_series()
            if not have:
                raise UsageError("no series under patches/", "pass --series DIR")
            dest = Path(a.fetch[1]) if len(a.fetch) > 1 else Path.cwd() / f"sglang-{release}"
            if release not in have:
                from eaglepatch.series import nearest_series_to, tool_command
                near = nearest_series_to(release) if given is None else (given.release, "")
                port = tool_command("port", *(["--series", a.series.absolute()] if given else []),
                                    "--from", near[0], "--to", release, "--checkout", dest.absolute())
                raise UsageError(f"no series for sglang {release} (series that exist: "
                                 + ", ".join(f"sglang-{r}" for r in have) + ")",
                                 f"fetch one of those, e.g. --fetch {list(have)[-1]}, or get sglang {release} with "
                                 f"sglang-{near[0]} ported as far as it merges (conflicts marked) into DEST: {port}")
            tree = fetch_and_apply(release, dest, given or load_series(have[release]), command=command)
            print(f"patched sglang {release} is in {tree.root} (package parent {tree.package_parent})")
            return 0
        if not a.root:
            raise UsageError("ROOT is missing", "pass an SGLang checkout or site-packages dir, or use --fetch")
        pick = resolve_series(a.root, a.series, recover=not a.check, what="apply --check")
        apply_series(pick.tree, pick.series, check=a.check, reverse=a.reverse, force=a.force, commit=a.commit,
                     command=command)
        return 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
