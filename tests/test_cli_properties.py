"""Property tests over the command lines of apply, verify, export, port and drift (hypothesis):
random flags, paths (missing, a file, a directory, `~`, empty), damaged series (patch files cut,
CRLF, stray bytes, wrong hunk counts; series lists; manifests of any JSON shape) and damaged
target files (CRLF, deleted, cut, a directory, a dangling link, partly patched, a symlinked file
or directory that lives outside the tree, a FIFO, socket or device), series files that are
FIFOs, trees named through an alias (`alias/sglang` a link to the tree's package) and output
paths that are a symlink, FIFO, socket or device, on the real sglang 0.5.9 files. For every run: the exit code is 0, 1 or 2; stderr has no traceback and at
most one `error:` line; a run that refuses (or only checks) leaves the tree and whatever its links
point to byte-identical; a special output path is never replaced; no transaction or staging file
is ever left.

The tools run in this process (their `main(argv)`), with EAGLEPATCH_DEBUG=1 so that anything
`run_main` would report as an internal error fails the test with its traceback instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import BASIC, REPO, copy_installed, hashes, series_files
from txnkit import git, small_checkout

pytest.importorskip("hypothesis", reason="hypothesis is pinned in src/eaglepatch/cpu-requirements.txt; "
                    "run the tests with python3 tools/test.py")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TARGETS = sorted(series_files(BASIC))
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _load(tool: str):
    spec = importlib.util.spec_from_file_location(f"eaglepatch_tool_{tool}", REPO / "tools" / f"{tool}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


TOOLS = {t: _load(t) for t in ("apply", "verify", "export", "port", "drift")}


def run(tool: str, argv: list, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run a tool's main(argv) here, in `cwd` (where a default --fetch DEST would go)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd or REPO):
        try:
            rc = TOOLS[tool]([str(a) for a in argv])
        except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def check_result(tool, argv, rc, out, err) -> None:
    where = f"{tool} {argv}\nexit {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert rc in (0, 1, 2), where
    assert "Traceback" not in err and "internal error" not in err, where
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) <= 1, where
    if rc == 2 and not err.startswith("usage:"):  # exit 1 may be a report (drift, conflicts, --check differs)
        assert errors and "; " in errors[0], where


def leftovers(*roots) -> list:
    return [str(p) for r in roots if Path(r).exists() for p in Path(r).rglob("*")
            if ".eaglepatch-" in p.name or p.name == ".eaglepatch-txn"]


# ------------------------------------------------------------------------------------------
# the world the tools run in (built once), and a fresh copy of it per example

@pytest.fixture(scope="module")
def world(release_059, release_0510):
    base = Path(tempfile.mkdtemp(prefix="eaglepatch-props-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK)
                                 else None))
    up = copy_installed(release_059, base / "upstream", TARGETS)
    patched = base / "patched"
    shutil.copytree(up, patched)
    assert run("apply", [patched, "--series", BASIC])[0] == 0
    newer = copy_installed(release_059, base / "newer", TARGETS)
    v = newer / "sglang" / "_version.py"
    v.write_text(v.read_text().replace("0.5.9", "0.5.9.1"))
    co = small_checkout(release_059, base / "co", TARGETS)
    committed = base / "committed"
    shutil.copytree(co, committed, symlinks=True)
    assert run("apply", [committed, "--series", BASIC, "--commit"])[0] == 0
    patches = base / "patches"
    shutil.copytree(BASIC, patches / BASIC.name)
    old_env = {k: os.environ.get(k) for k in ("EAGLEPATCH_PATCHES", "EAGLEPATCH_DEBUG", "EAGLEPATCH_LOCK_TIMEOUT",
                                              "EAGLEPATCH_CACHE", "HOME")}
    from eaglepatch.fetch import cache_root
    os.environ.update(EAGLEPATCH_PATCHES=str(patches), EAGLEPATCH_DEBUG="1", EAGLEPATCH_LOCK_TIMEOUT="5",
                      EAGLEPATCH_CACHE=str(cache_root().parent), HOME=str(base))
    yield {"base": base, "upstream": up, "patched": patched, "newer": newer, "co": co, "committed": committed,
           "hashes": {"upstream": hashes(up), "patched": hashes(patched)}}
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(base, ignore_errors=True)


class Scratch:
    """A per-example directory: a fresh tree, a series copy, an output dir, a file, a missing path."""

    def __init__(self, world, tree="upstream"):
        self.dir = Path(tempfile.mkdtemp(dir=world["base"]))
        self.tree = self.dir / "tree"
        shutil.copytree(world[tree], self.tree, symlinks=True)
        self.series = self.dir / "sglang-0.5.9"
        shutil.copytree(BASIC, self.series)
        self.out = self.dir / "out"
        self.afile = self.dir / "afile"
        self.afile.write_text("not a directory\n")
        self.missing = self.dir / "missing"
        self.elsewhere = self.dir / "elsewhere"  # where a tree's symlinks point (tree_damage)
        self.elsewhere.mkdir()
        self.alias = self.dir / "alias"  # alias/sglang: a link to the tree's package
        self.alias.mkdir()
        pkg = self.tree / "sglang" if (self.tree / "sglang").is_dir() else self.tree / "python" / "sglang"
        (self.alias / "sglang").symlink_to(pkg)
        self.specials = special_files(self.dir / "special")

    def path(self, key: str):
        if key in self.specials:
            return self.specials[key]
        return {"tree": self.tree, "tree/sglang": self.tree / "sglang", "series": self.series, "out": self.out,
                "out.json": self.out / "r.json", "r.json": self.dir / "r.json", "afile": self.afile,
                "afile/x": self.afile / "x",
                "missing": self.missing, "missing/x": self.missing / "x", "dir": self.dir, "empty": "",
                "tilde": "~/nothing-here", "basic": BASIC, "basic/series": BASIC / "series", "alias": self.alias}[key]

    def outside(self) -> dict:
        """What a run must never change besides the tree: the files its links point to, and the
        special output paths (same type, same inode)."""
        st = {k: (stat.S_IFMT(os.lstat(p).st_mode), os.lstat(p).st_ino) for k, p in self.specials.items()}
        return {"elsewhere": hashes(self.elsewhere), "specials": st,
                "theirs": (self.dir / "special" / "theirs.txt").read_bytes()}

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def special_files(d: Path) -> dict:
    """A symlink to someone's file, a FIFO, a socket and (as root) a device, as output paths."""
    d.mkdir()
    (d / "theirs.txt").write_text("someone's file\n")
    out = {"link.json": d / "link.json", "fifo": d / "fifo", "socket": d / "socket"}
    out["link.json"].symlink_to(d / "theirs.txt")
    os.mkfifo(out["fifo"])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(out["socket"]))  # the socket file stays after close
    sock.close()
    (d / "theirs-dir").mkdir()
    out["linkdir"] = d / "linkdir"  # a link to a directory, as an output dir
    out["linkdir"].symlink_to(d / "theirs-dir")
    if os.geteuid() == 0:
        out["device"] = d / "device"
        os.mknod(out["device"], stat.S_IFCHR | 0o666, os.makedev(1, 7))  # what /dev/full is
    return out


SPECIAL_OUT = ["@link.json", "@fifo", "@socket"] + (["@device"] if os.geteuid() == 0 else [])
PATHS = st.sampled_from(["tree", "tree/sglang", "series", "out", "out.json", "afile", "afile/x", "missing",
                         "missing/x", "dir", "empty", "tilde", "basic", "basic/series", "alias"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                    max_leaves=6)


@st.composite
def damage(draw):
    """A function that damages a series dir in one of the ways a hostile world does (or not at all)."""
    kind = draw(st.sampled_from(["none"] * 12 + [
        "cut", "insert", "crlf", "hunk-count", "no-separator", "not-utf8", "empty", "series-list", "smoke-list",
        "manifest-json", "manifest-files", "manifest-hunks", "no-manifest", "fifo"]))
    fifo_at = draw(st.sampled_from(["series", "smoke.series", "manifest.json", "patch"]))
    frac = draw(st.floats(0, 1))
    blob = draw(st.binary(max_size=12))
    text = draw(st.text(max_size=20))
    any_json = draw(JSON)

    def apply(d: Path) -> None:
        patches = sorted(d.glob("*.patch"))
        p = patches[int(frac * (len(patches) - 1))]
        data = p.read_bytes()
        at = int(frac * len(data))
        if kind == "cut":
            p.write_bytes(data[:at])
        elif kind == "insert":
            p.write_bytes(data[:at] + blob + data[at:])
        elif kind == "crlf":
            p.write_bytes(data.replace(b"\n", b"\r\n"))
        elif kind == "hunk-count":
            p.write_bytes(data.replace(b"@@ -", b"@@ -1", 1))
        elif kind == "no-separator":
            p.write_bytes(data.replace(b"\n---\n", b"\n", 1))
        elif kind == "not-utf8":
            p.write_bytes(data[:at] + b"\xff\xfe" + data[at:])
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "series-list":
            (d / "series").write_text(text)
        elif kind == "smoke-list":
            (d / "smoke.series").write_bytes(blob)
        elif kind == "manifest-json":
            (d / "manifest.json").write_text(json.dumps(any_json))
        elif kind == "manifest-files":
            m = json.loads((d / "manifest.json").read_text())
            m["files"][sorted(m["files"])[int(frac * (len(m["files"]) - 1))]] = any_json
            (d / "manifest.json").write_text(json.dumps(m))
        elif kind == "manifest-hunks":
            m = json.loads((d / "manifest.json").read_text())
            m["patches"][0]["hunks"] = any_json
            (d / "manifest.json").write_text(json.dumps(m))
        elif kind == "no-manifest":
            (d / "manifest.json").unlink()
        elif kind == "fifo":  # a FIFO where a series file is read: refused, never opened (it would block)
            f = p if fifo_at == "patch" else d / fifo_at
            f.unlink()
            os.mkfifo(f)

    apply.kind = kind
    return apply


@st.composite
def tree_damage(draw):
    kind = draw(st.sampled_from(["none"] * 8 + ["crlf", "delete", "cut", "garbage", "a-directory", "dangling-link",
                                 "partly-patched", "local-edit"] + ["linked-dir", "linked-file"] * 2 + ["fifo", "socket"]
                                + (["device"] if os.geteuid() == 0 else [])))
    rel = draw(st.sampled_from(TARGETS))
    frac = draw(st.floats(0, 1))

    def apply(tree: Path, world, elsewhere: Path) -> None:
        p = tree / rel
        if kind == "none" or (not p.exists() and kind != "a-directory"):
            return
        if kind == "linked-dir":  # the target's directory lives outside the tree
            away = elsewhere / p.parent.name
            shutil.move(p.parent, away)
            p.parent.symlink_to(away)
        elif kind == "linked-file":
            shutil.move(p, elsewhere / p.name)
            p.symlink_to(elsewhere / p.name)
        elif kind == "fifo":
            p.unlink()
            os.mkfifo(p)
        elif kind == "socket":
            p.unlink()
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(p))
            sock.close()
        elif kind == "device":
            p.unlink()
            os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 3))  # what /dev/null is
        if kind == "crlf":
            p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
        elif kind == "delete":
            p.unlink()
        elif kind == "cut":
            p.write_bytes(p.read_bytes()[: int(frac * p.stat().st_size)])
        elif kind == "garbage":
            p.write_bytes(os.urandom(64))
        elif kind == "a-directory":
            if p.exists():
                p.unlink()
            p.mkdir(parents=True)
        elif kind == "dangling-link":
            p.unlink()
            p.symlink_to(tree / "no-such-file")
        elif kind == "partly-patched":
            src = world["patched"] / rel
            if src.exists():
                shutil.copy(src, p)
        elif kind == "local-edit":
            p.write_bytes(p.read_bytes() + b"# a local edit\n")

    apply.kind = kind
    return apply


def exercise(world, tool: str, argv_keys: list, scratch: Scratch) -> None:
    argv = [scratch.path(a[1:]) if isinstance(a, str) and a.startswith("@") else a for a in argv_keys]
    before, outside = hashes(scratch.tree), scratch.outside()
    rc, out, err = run(tool, argv, cwd=scratch.dir)
    check_result(tool, argv, rc, out, err)
    event(f"exit {rc}")
    after = hashes(scratch.tree)
    writes = tool == "apply" and not ({"--check"} & set(map(str, argv)))
    if rc != 0 or not writes:
        assert after == before, f"{tool} {argv} exit {rc} changed the tree\n{out}\n{err}"
        assert scratch.outside() == outside, f"{tool} {argv} exit {rc} wrote outside the tree\n{out}\n{err}"
    else:
        assert scratch.outside()["specials"] == outside["specials"], f"{tool} {argv} replaced a special file"
    assert not leftovers(scratch.tree, scratch.dir), leftovers(scratch.tree, scratch.dir)


# ------------------------------------------------------------------------------------------
# the properties

@settings(max_examples=300, **SETTINGS)
@given(root=st.sampled_from(["tree"] * 10 + ["alias"] * 2) | PATHS,
       flags=st.tuples(st.sampled_from([[], ["--check"]]), st.sampled_from([[], [], ["--reverse"]]),
                       st.sampled_from([[]] * 3 + [["--force"]]), st.sampled_from([[]] * 4 + [["--commit"]]),
                       st.sampled_from([[]] * 19 + [["--bogus"]])).map(lambda t: sum(t, [])),
       series=st.sampled_from([None, "@series"] * 6 + ["@afile", "@missing", "@tilde", "@basic/series", "@empty"]),
       start=st.sampled_from(["upstream", "patched", "co", "committed"]), dmg=damage(), tdmg=tree_damage(),
       fetch=st.sampled_from([None] * 20 + [[], ["abc"], ["0.5.10"], ["0.5.9", "@afile"], ["0.5.9", "@dir"]]))
def test_apply_cli(world, root, flags, series, start, dmg, tdmg, fetch):
    s = Scratch(world, start)
    try:
        dmg(s.series)
        tdmg(s.tree if start in ("upstream", "patched") else s.tree / "python", world, s.elsewhere)
        event(f"tree damage {tdmg.kind}")
        event(f"series damage {dmg.kind}")
        argv = [] if (fetch is not None and root != "tree") else [f"@{root}"]
        argv += flags + (["--series", series] if series else [])
        if fetch is not None:
            argv += ["--fetch", *fetch]
        exercise(world, "apply", argv, s)
    finally:
        s.close()


@settings(max_examples=150, **SETTINGS)
@given(root=st.sampled_from(["tree"] * 10 + ["alias"] * 2) | PATHS,
       series=st.sampled_from([None, "@series"] * 6 + ["@afile", "@missing", "@tilde", "@basic/series"]),
       json_out=st.sampled_from([None, "@r.json"] * 4 + ["@afile/x", "@missing/x", "@dir", "@empty", "@afile"]
                                + SPECIAL_OUT),
       smoke=st.sampled_from([None, "none", "static"] * 3 + ["bogus"]),
       start=st.sampled_from(["upstream", "patched", "newer"]),
       dmg=damage(), tdmg=tree_damage())
def test_verify_cli(world, root, series, json_out, smoke, start, dmg, tdmg):
    s = Scratch(world, start)
    try:
        s.out.mkdir()
        dmg(s.series)
        tdmg(s.tree, world, s.elsewhere)
        event(f"tree damage {tdmg.kind}")
        event(f"root {root}, --json {json_out}")
        argv = [f"@{root}"] + (["--series", series] if series else []) + (["--json", json_out] if json_out else [])
        argv += ["--smoke", smoke] if smoke else ["--smoke", "none"]
        exercise(world, "verify", argv, s)
    finally:
        s.close()


@settings(max_examples=80, **SETTINGS)
@given(repo=st.sampled_from(["committed"] * 12 + ["co", "tree", "missing", "afile"]),
       base=st.sampled_from(["v0.5.9"] * 6 + ["v9.9.9", "HEAD", "", "main", "v"]),
       branch=st.sampled_from([None] * 12 + ["HEAD", "eaglepatch/sglang-0.5.9", "nope", "-x"]),
       out=st.sampled_from(["@series", "@out"] * 6 + ["@afile", "@afile/x", "@missing/x", "@dir"]),
       check=st.booleans(), version=st.sampled_from([None] * 4 + ["0.5.9-2", "", "x y"]), dmg=damage())
def test_export_cli(world, repo, base, branch, out, check, version, dmg):
    s = Scratch(world, "committed" if repo in ("committed", "tree") else "co")
    try:
        dmg(s.series)
        root = {"committed": s.tree, "co": s.tree, "tree": s.tree / "python", "missing": s.missing,
                "afile": s.afile}[repo]
        argv = [root, "--base", base, "--out", out] + (["--branch", branch] if branch else [])
        argv += (["--check"] if check else []) + (["--series-version", version] if version is not None else [])
        head = git(s.tree, "rev-parse", "HEAD")
        exercise(world, "export", argv, s)
        assert git(s.tree, "rev-parse", "HEAD") == head and git(s.tree, "status", "--porcelain") == ""
    finally:
        s.close()


@settings(max_examples=80, **SETTINGS)
@given(frm=st.sampled_from([None] * 12 + ["0.5.9", "0.5.10", "abc", ""]),
       to=st.sampled_from([None] * 6 + ["0.5.9", "0.5.9.1", "abc"]),
       from_tree=st.sampled_from(["tree"] * 5 + ["alias", None, "missing", "afile"]),
       to_tree=st.sampled_from(["newer"] * 6 + [None, "tree", "missing", "afile"]),
       series=st.sampled_from(["@series"] * 6 + [None, "@afile", "@missing"]),
       out=st.sampled_from(["@out"] * 6 + ["@afile", "@afile/x", "@dir", "@linkdir"]),
       json_out=st.sampled_from([None, "@r.json"] * 3 + ["@afile/x", "@dir", "@out.json"] + SPECIAL_OUT),
       flags=st.lists(st.sampled_from(["--dry-run", "--force"]), unique=True), dmg=damage())
def test_port_cli(world, frm, to, from_tree, to_tree, series, out, json_out, flags, dmg):
    if to_tree is None and to not in (None, "0.5.9") or from_tree is None and frm not in (None, "0.5.9", "0.5.10",
                                                                                           "abc", ""):
        return  # a release without a local tree would be downloaded: only cached ones are used here
    s = Scratch(world)
    try:
        dmg(s.series)
        trees = {"tree": s.tree, "alias": s.alias, "newer": world["newer"], "missing": s.missing, "afile": s.afile}
        argv = []
        for flag, val in (("--from", frm), ("--to", to), ("--series", series), ("--json", json_out)):
            if val is not None:
                argv += [flag, val]
        for flag, key in (("--from-tree", from_tree), ("--to-tree", to_tree)):
            if key is not None:
                argv += [flag, trees[key]]
        argv += ["--out", out] + flags
        newer = hashes(world["newer"])
        exercise(world, "port", argv, s)
        assert hashes(world["newer"]) == newer
    finally:
        s.close()


@settings(max_examples=30, **SETTINGS)
@given(releases=st.sampled_from([None, "0.5.9", "0.5.9,0.5.10", "x", ",", "0.5.10,abc"]),
       out=st.sampled_from(["@r.json"] * 4 + ["@afile", "@afile/x", "@dir", "@missing/x"] + SPECIAL_OUT),
       flags=st.lists(st.sampled_from(["--strict", "--pinned"]), unique=True))
def test_drift_cli(world, releases, out, flags):
    if releases is None and "--pinned" not in flags:
        return  # every release on the package index: not here
    s = Scratch(world)
    try:
        s.out.mkdir()
        argv = (["--releases", releases] if releases is not None else []) + ["--out", out] + flags
        exercise(world, "drift", argv, s)
    finally:
        s.close()


def test_the_damage_is_seen(world):
    """The properties are not vacuous: damaged inputs do reach the tools' refusals."""
    s = Scratch(world)
    try:
        p = next(s.series.glob("0002-*.patch"))
        p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
        rc, out, err = run("apply", [s.tree, "--series", s.series])
        assert rc == 2 and "CRLF" in err
        (s.tree / TARGETS[-1]).write_bytes(b"garbage\n")
        rc, out, err = run("apply", [s.tree, "--series", BASIC])
        assert rc == 1 and "local edits" in err
    finally:
        s.close()


# ------------------------------------------------------------------------------------------
# issue 43 items 14 and 17: the tools in a Python without the project's dependencies, and in one with
# exactly the declared ones (what `python3 -m venv .venv && pip install -e .` makes, docs/gpu.md)

def _venv(where: Path) -> Path:
    """A virtual environment of the base Python, without pip and without any package: what a user
    has before `pip install -e .`. Returns its python."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    return where / "bin" / "python"


def _declared() -> list:
    """The names of pyproject.toml's [project] dependencies."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in deps]


def _with_declared(py: Path) -> None:
    """Copy into the venv of ``py`` the installed files of each declared dependency and of what they
    require in turn (as this environment installed them): the venv pip would make from pyproject's
    [project] dependencies, without the package index."""
    import importlib.metadata as md
    import subprocess

    from packaging.requirements import Requirement

    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    todo, done = list(_declared()), set()
    while todo:
        name = todo.pop()
        dist = md.distribution(name)
        key = dist.metadata["Name"].lower()
        if key in done:
            continue
        done.add(key)
        for f in dist.files or []:
            src = Path(dist.locate_file(f))
            if src.is_file() and ".." not in Path(f).parts:
                (site / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, site / f)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)


def test_declared_dependencies_are_what_the_tools_import():
    """eaglepatch.cli.DEPENDENCIES (what the tools check they can import) names exactly pyproject's
    [project] dependencies: packaging among them (tools/gpu_bundle.py's wheel names and tags)."""
    from eaglepatch import cli

    assert sorted(n.lower() for n in cli.DEPENDENCIES.values()) == sorted(n.lower() for n in _declared())
    assert "packaging" in cli.DEPENDENCIES


def test_gpu_bundle_runs_in_the_venv_docs_gpu_md_makes(tmp_path):
    """Issue 43 item 14: a venv holding exactly the declared dependencies runs tools/gpu_bundle.py
    past its first step (the pin list read, the wheel cache matched by name, tag and version:
    packaging) instead of "internal error (... No module named 'packaging')". Its pin list here names
    one small wheel made in the test's cache, so no download runs; the build then stops at its own
    refusal (no sgl_kernel/ in the site), exit 1, one line."""
    import subprocess
    import zipfile

    py = _venv(tmp_path / "venv")
    _with_declared(py)
    cache = tmp_path / "wheels"
    cache.mkdir()
    whl = cache / "tiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("tiny/__init__.py", "")
        z.writestr("tiny-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n")
        z.writestr("tiny-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        z.writestr("tiny-1.0.dist-info/RECORD", "")
    pins = tmp_path / "pins.txt"
    pins.write_text("tiny==1.0\n")
    p = subprocess.run([str(py), str(REPO / "tools" / "gpu_bundle.py"), "--pins", str(pins), "--wheel-cache",
                        str(cache), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "1 pins; 1 wheels cached" in p.stderr, p.stderr
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("error: "), p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,names", [
    (["apply", "ROOT", "--check"], "unidiff"),
    (["apply", "ROOT", "--commit"], "unidiff, GitPython"),
    (["verify", "ROOT"], "unidiff, pyflakes"),
    (["verify", "ROOT", "--smoke", "none"], "unidiff"),
    (["serve", "--cpu-demo", "DEMO", "--print"], "unidiff"),
    (["serve", "--model-path", "m", "--dump-dir", "DUMPS", "--print"], "unidiff"),
    (["gpu_bundle", "--out", "OUT"], "packaging"),
    (["gpucheck", "--make-patched-files", "--series", "SERIES", "--patched-files", "OUT"], "unidiff"),
])
def test_tools_before_pip_install_name_what_is_missing(tmp_path, small, argv, names):
    """Issue 43 item 17: apply, verify, serve (and gpu_bundle, gpucheck --make-patched-files) run with a Python that has none of the
    project's dependencies: one line naming the missing packages and `pip install -e .`, exit 2,
    nothing read or written (was: "internal error (ModuleNotFoundError: ...)"), as extract.py names
    what its format misses. --help works there."""
    import subprocess

    py = _venv(tmp_path / "venv")
    before = hashes(small)
    fill = {"ROOT": str(small), "DEMO": str(tmp_path / "demo"), "DUMPS": str(tmp_path / "dumps"),
            "OUT": str(tmp_path / "out"), "SERIES": str(REPO / "patches" / "sglang-0.5.17")}
    tool, *args = argv
    p = subprocess.run([str(py), str(REPO / "tools" / f"{tool}.py"), *[fill.get(a, a) for a in args]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0] == (f"error: {tool}.py needs the Python package(s) {names}, which "
                        f"{'are' if ',' in names else 'is'} not installed; pip install -e . (from the eaglepatch "
                        f"checkout, into the Python that runs the tools)"), lines[0]
    assert hashes(small) == before and sorted(x.name for x in tmp_path.iterdir()) == ["venv"]
    h = subprocess.run([str(py), str(REPO / "tools" / f"{tool}.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert h.returncode == 0 and "exit codes:" in h.stdout, h.stderr


def test_acceptance_on_cuda_without_cuda_is_one_line(tmp_path):
    """Issue 43 item 17: tools/acceptance.py --cpu --set device=cuda where torch sees no CUDA device:
    one line saying so, exit 2, nothing made (was: "internal error (AssertionError: Torch not compiled
    with CUDA enabled)" after WORK, its result.json and target-init were written)."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    work = tmp_path / "work"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "acceptance.py"), "--work", str(work), "--cpu", "--set",
                        "device=cuda"], capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: device=cuda, and torch ") and "sees no CUDA device" in lines[0], lines[0]
    assert "internal error" not in lines[0] and not work.exists()
