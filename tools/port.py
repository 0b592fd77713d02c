#!/usr/bin/env python3
"""Port the series to another SGLang release with a 3-way merge per patched file.

  python tools/port.py --from 0.5.9 --to 0.5.23 [--out DIR] [--force] [--dry-run] [--json FILE]
  python tools/port.py --from-tree OLD_ROOT --to-tree NEW_ROOT [--series DIR] [--to RELEASE]
  python tools/port.py [--from 0.5.9] --to 0.5.10 --checkout [DIR]    (then: --continue DIR)

Releases are fetched from the package index and cached; --from-tree/--to-tree take local trees
(git checkouts or dirs holding sglang/). Without --from (and --from-tree, --series) the nearest
series is ported: the newest one older than --to, else the oldest one. A --to older than --from
is a backwards port (legal; said on stderr). Writes patches/sglang-<new>/ (series, smoke.series,
patches, manifest.json) in one step only when every hunk merges; otherwise prints a per-hunk
conflict report with both sides, writes nothing, and names the --checkout command.

--checkout makes a git checkout of the --to release (branch eaglepatch/sglang-<to> on tag
v<to>) and ports patch by patch, like git rebase: each patch that merges is committed; at a
patch that conflicts it stops, with that patch's merging hunks applied and each conflicting hunk
marked in place (<<<<<<< old patched / ||||||| old upstream / ======= / >>>>>>> new upstream),
uncommitted. Resolve, then --continue DIR commits the resolution and ports the rest; when every
patch is committed, tools/export.py DIR --base v<to> writes the new series (the commands to run
are printed, with absolute paths).

Exit: 0 ported (or --dry-run clean; --checkout/--continue: every patch committed), 1 conflicts
(nothing written; --checkout/--continue: stopped at a conflict, resolve it) or refused,
2 usage error.
"""
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402

CHECKOUT_DEFAULT = object()


def main(argv=None) -> int:
    ap = cli.parser("port.py", __doc__, whole_doc=True)
    ap.add_argument("--from", dest="from_release", metavar="RELEASE",
                    help="release of the series to port (default: the nearest series to --to)")
    ap.add_argument("--to", dest="to_release", metavar="RELEASE", help="release to port to")
    ap.add_argument("--from-tree", type=Path, metavar="ROOT", help="local tree of the old release")
    ap.add_argument("--to-tree", type=Path, metavar="ROOT", help="local tree of the new release")
    ap.add_argument("--series", type=Path, help="series to port (default: patches/sglang-<from>)")
    ap.add_argument("--out", type=Path, help="new series dir (default: patches/sglang-<to>); with --checkout: "
                                             "where the printed export command writes it")
    ap.add_argument("--force", action="store_true", help="replace an existing --out dir")
    ap.add_argument("--dry-run", action="store_true", help="merge and review; write nothing")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON to FILE")
    ap.add_argument("--date", help="Last-Update of the ported patches (default: today, UTC)")
    ap.add_argument("--series-version", metavar="VERSION",
                    help="series version of the new series (default: <to>-1; raise it when regenerating a series, "
                         "e.g. 0.5.17-2)")
    ap.add_argument("--checkout", nargs="?", const=CHECKOUT_DEFAULT, type=Path, metavar="DIR",
                    help="make a git checkout of the --to release at DIR (default: ./sglang-<to>-port) with "
                         "every patch that merges committed and the first conflicting one marked in place")
    ap.add_argument("--continue", dest="continue_dir", type=Path, metavar="DIR",
                    help="in a --checkout DIR whose conflicts are resolved: commit them and port the rest")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch.errors import UsageError
        from eaglepatch.lock import lock_timeout

        lock_timeout()  # a bad EAGLEPATCH_LOCK_TIMEOUT: one line, exit 2, before anything is read or written
        if a.continue_dir is not None:
            others = [f for f, v in (("--from", a.from_release), ("--to", a.to_release), ("--from-tree", a.from_tree),
                                      ("--to-tree", a.to_tree), ("--series", a.series), ("--out", a.out),
                                      ("--force", a.force), ("--dry-run", a.dry_run), ("--json", a.json),
                                      ("--date", a.date), ("--checkout", a.checkout),
                                      ("--series-version", a.series_version)) if v]
            if others:
                raise UsageError(f"--continue takes only the checkout, not {', '.join(others)}",
                                 "run: port.py --continue DIR (the port keeps its settings in DIR)")
            from eaglepatch.port import checkout
            return report_checkout(checkout.resume(a.continue_dir))
        return port_body(a)

    return run_main(body)


def port_body(a) -> int:
    from eaglepatch import port
    from eaglepatch.errors import RefusedError, UsageError
    from eaglepatch.lock import tree_locks
    from eaglepatch.outputs import check_output_file
    from eaglepatch.series import (available_series, check_release, default_patches_root, load_series,
                                   nearest_series_to, tool_command, version_key)

    if a.checkout is not None:
        bad = [f for f, v in (("--to-tree", a.to_tree), ("--force", a.force), ("--dry-run", a.dry_run),
                              ("--json", a.json)) if v]
        if bad:
            raise UsageError(f"--checkout does not take {', '.join(bad)}",
                             "run: port.py [--from RELEASE] --to RELEASE --checkout [DIR] (the checkout is of the "
                             "--to release from the package index)")
        if not a.to_release:
            raise UsageError("--checkout needs --to", "pass --to RELEASE (the release to check out)")
    if a.json is not None:
        check_output_file(a.json, "--json")
    given = None  # --series alone names the release it was made for
    if a.series is not None and a.from_release is None and a.from_tree is None:
        given = load_series(a.series)
        a.from_release = given.release
    if a.to_release is not None:
        check_release(a.to_release, "--to")
    if a.from_release is None and a.from_tree is None and a.series is None and (a.to_release or a.to_tree):
        to_known = a.to_release
        if to_known is None:
            to_known = port.open_release_tree(a.to_tree, None, "to")[1]
        if to_known in available_series():
            raise UsageError(f"sglang {to_known} has a series of its own ({available_series()[to_known]})",
                             "pass --from RELEASE to port another series onto it")
        near = nearest_series_to(to_known)
        if near is None:
            raise UsageError("--from is missing and there is no series to port", "pass --from RELEASE or --series DIR")
        a.from_release = near[0]
        print(f"port: no --from given: porting sglang-{near[0]}, the nearest series ({near[1]} than sglang "
              f"{to_known}; pass --from to pick another)", file=sys.stderr)
    old = given
    if old is None and a.from_tree is None and a.from_release is not None:  # before any download
        old = port.load_old_series(check_release(a.from_release, "--from"), a.series)
    old_tree, from_rel = port.open_release_tree(a.from_tree, a.from_release, "from")
    if a.checkout is not None:
        new_tree, to_rel = None, a.to_release
    else:
        new_tree, to_rel = port.open_release_tree(a.to_tree, a.to_release, "to")
    old = old or port.load_old_series(from_rel, a.series)
    if old.release and old.release != from_rel:
        raise UsageError(f"{old.dir} was made for sglang {old.release}, not {from_rel}",
                         f"pass --from {old.release}")
    if from_rel == to_rel:
        raise UsageError(f"--from and --to are both {to_rel}", "pass the release to port to as --to")
    if version_key(to_rel) < version_key(from_rel):
        print(f"port: sglang {to_rel} is older than {from_rel}: this is a backwards port (it works the same "
              f"way; pass --from with an older series to port forwards)", file=sys.stderr)
    out = (a.out or default_patches_root() / f"sglang-{to_rel}").absolute()

    def checkout_command(dest) -> str:
        src = ["--from-tree", Path(a.from_tree).absolute()] if a.from_tree else ["--from", from_rel]
        if a.series is not None:
            src += ["--series", Path(a.series).absolute()]
        extra = ["--out", out] if a.out else []
        return tool_command("port", *src, "--to", to_rel, *extra, "--checkout", Path(dest).absolute())

    version = a.series_version or f"{to_rel}-1"
    if not re.fullmatch(re.escape(to_rel) + r"-[1-9][0-9]*", version):
        raise UsageError(f"--series-version {version!r} is not {to_rel}-<n>", f"pass e.g. --series-version {to_rel}-2")
    if a.checkout is not None:
        from eaglepatch.port import checkout
        dest = Path.cwd() / f"sglang-{to_rel}-port" if a.checkout is CHECKOUT_DEFAULT else Path(a.checkout)
        stop = checkout.start(old, old_tree, from_rel, to_rel, dest, out, from_tree=a.from_tree, date=a.date,
                              restart=checkout_command(dest), series_version=version)
        return report_checkout(stop)
    if out.exists() and not (a.force or a.dry_run):
        raise RefusedError(f"{out} already exists", "pass --force to replace it, --out DIR, or --dry-run")
    with tree_locks(old_tree.package_parent, new_tree.package_parent):
        res = port.port_series(old, old_tree.read, new_tree.read, from_rel, to_rel, date=a.date,
                               series_version=version)
    if a.json:
        port.write_json(a.json, res)
    print(port.hunk_table(res))
    print()
    print(port.review(res))
    if not res.clean:
        print()
        print(port.conflict_report(res))
        print(f"port: CONFLICT ({res.conflict_count} hunk(s)); nothing written (exit 1)")
        print(f"next: get a git checkout of sglang {to_rel} with every patch that merges committed and the "
              "conflicts marked in place, then resolve them there and export:")
        print(f"  {checkout_command(Path.cwd() / f'sglang-{to_rel}-port')}")
        return 1
    if a.dry_run:
        print(f"port: clean; --dry-run, nothing written (would write {out})")
        return 0
    port.write_series(out, res.files, force=a.force)
    kept = [p for p in res.patches if p.status == "ported"]
    print(f"port: wrote {out} ({len(kept)} patch(es), {len(res.files)} files); "
          f"check it with: {tool_command('verify')} <an unpatched sglang {to_rel} tree> --series {shlex.quote(str(out))}")
    return 0


def report_checkout(stop) -> int:
    from eaglepatch.port import checkout

    st = stop.state
    n = checkout.commit_count(stop.root, st) if stop.root.is_dir() else 0
    if stop.done and n == 0:
        print(f"port: nothing of the series is left for sglang {st['to']} (every patch was dropped); no series is "
              f"needed for that release ({stop.root} holds the release as it is)")
        return 0
    if stop.done:
        print(f"port: every patch is ported: {n} commit(s) on branch {st['branch']} after tag v{st['to']} "
              f"in {stop.root}")
    else:
        print(f"port: {n} commit(s) on branch {st['branch']} after tag v{st['to']} in {stop.root}; "
              f"stopped at {st['stopped']['patch']} (exit 1)")
    for ln in checkout.next_steps(stop):
        print(ln)
    return 0 if stop.done else 1


if __name__ == "__main__":
    sys.exit(main())
