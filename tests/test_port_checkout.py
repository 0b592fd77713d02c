"""The upgrade journey with a conflicting port, on the real releases: `tools/port.py --from 0.5.9
--to 0.5.10` conflicts and names the --checkout command; that command makes a git checkout of
0.5.10 with every merging patch committed and the conflicts marked in place; a resolution and
--continue (twice) commit the rest; the printed export and verify commands, run as printed from
another directory, make a series that apply, verify and the overlay gate accept."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, one_line_error, python3_in, run_tool

from eaglepatch.fetch import make_git_checkout
from eaglepatch.series import load_series

DS = "python/sglang/srt/models/deepseek_v2.py"
ENGINE = "python/sglang/srt/entrypoints/engine.py"
REGION = re.compile(r"<<<<<<< old patched\n(.*?)\|\|\|\|\|\|\| old upstream\n(.*?)=======\n(.*?)>>>>>>> new upstream\n",
                    re.S)


@pytest.fixture
def shell(tmp_path):
    """Run a printed command line as a user would paste it into bash (`python3` = this interpreter)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    python3_in(bindir)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    def run(cmd: str, cwd) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True)
    return run


def git(repo, *a) -> str:
    return subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True).stdout


def printed(stdout: str, label: str, then: int = 0) -> str:
    """The command the output names at the line that starts with `label`: the rest of that line
    when it is a command, else the line after it (`then` lines further on), numbering stripped."""
    lines = [ln.strip() for ln in stdout.splitlines()]
    i = next(k for k, ln in enumerate(lines) if ln.startswith(label))
    rest = lines[i][len(label):].strip()
    if rest.startswith(("python3 ", "git ")) and not then:
        return rest
    return re.sub(r"^\d\.\s+", "", lines[i + 1 + then])


def take_new_upstream(text: str, fix=lambda s: s) -> str:
    """Resolve every conflict region to its 'new upstream' side (then `fix` it)."""
    return REGION.sub(lambda m: fix(m.group(3)), text)


def test_a_conflicting_port_goes_through_a_checkout_to_an_accepted_series(tmp_path, shell, release_0510):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    out = tmp_path / "series" / "sglang-0.5.10"
    # 1. the plain port conflicts, writes nothing, and names the next step with absolute paths
    r = run_tool("port", "--from", "0.5.9", "--to", "0.5.10", "--out", out, cwd=work)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nothing written" in r.stdout and not out.exists()
    assert "backwards" not in r.stderr
    cmd = printed(r.stdout, "next: get a git checkout")
    dest = work / "sglang-0.5.10-port"
    assert cmd == (f"python3 {REPO}/tools/port.py --from 0.5.9 --to 0.5.10 --out {out} --checkout {dest}"), cmd
    # 2. that command, from another directory: 0001 committed, 0002 stopped with its conflict marked
    r = shell(cmd, elsewhere)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "committed 0001-add-the-eagle3-capture-package.patch" in r.stdout
    assert "stopped at 0002-deepseek-v2-capture-hooks" in r.stdout
    assert git(dest, "describe", "--tags", "--exact-match", "HEAD~1").strip() == "v0.5.10"
    assert git(dest, "rev-parse", "--abbrev-ref", "HEAD").strip() == "eaglepatch/sglang-0.5.10"
    assert git(dest, "status", "--porcelain").splitlines() == [f" M {DS}"]
    text = (dest / DS).read_text()
    (region,) = REGION.findall(text)
    assert "eagle3_capture.residual_stream(hidden_states, residual), dim=0" in region[0]
    assert "tensor_model_parallel_all_gather(\n                            hidden_states + residual" in region[1]
    assert "get_attention_tp_group().all_gather(" in region[2]
    line = text[:text.index("<<<<<<< old patched")].count("\n") + 1
    assert f"{dest / DS} line {line}: hunk 1 [DeepseekV2Model.forward]" in r.stdout
    # the hunks of 0002 that merged are applied (uncommitted); HEAD has none of them
    assert "hidden_states = eagle3_capture.after_model(self, hidden_states, forward_batch)" in text
    assert "eagle3_capture" not in git(dest, "show", f"HEAD:{DS}")
    # 3. --continue refuses while a marker is left, and commits nothing
    head = git(dest, "rev-parse", "HEAD")
    cont = printed(r.stdout, "2. ")
    assert cont == f"python3 {REPO}/tools/port.py --continue {dest}"
    r = shell(cont, elsewhere)
    assert r.returncode == 1 and f"{dest / DS} line" in one_line_error(r)
    assert git(dest, "rev-parse", "HEAD") == head
    # 4. resolve as a user would: new upstream's call with the hook's argument
    (dest / DS).write_text(take_new_upstream(text, lambda s: s.replace(
        "hidden_states + residual, dim=0", "eagle3_capture.residual_stream(hidden_states, residual), dim=0")))
    r = shell(cont, elsewhere)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "committed 0002-deepseek-v2-capture-hooks-for-layer-1-configured-ids.patch (resolved)" in r.stdout
    assert "committed 0003-model-runner" in r.stdout and "dropped 0004-kimi-k25" in r.stdout
    assert "stopped at 0005-engine-refuse-dump-settings" in r.stdout
    text = (dest / ENGINE).read_text()
    assert len(REGION.findall(text)) == 2
    # each conflict is named by the def its markers sit in, in the file as written (issue 29, item
    # 18): the launch hunk's markers are in _calculate_rank_ranges, ~600 lines from where 0.5.9 had it
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("<<<<<<< old patched")]
    defs = [m.group(1) for ln in lines[:starts[1]] if (m := re.match(r"\s*(?:async\s+)?def (\w+)", ln))]
    assert defs[-1] == "_calculate_rank_ranges"
    assert (f"{dest / ENGINE} lines {starts[0] + 1}, {starts[1] + 1}: hunk 0 [<module>] " in r.stdout
            and "; hunk 1 [_calculate_rank_ranges] " in r.stdout
            and "(in sglang 0.5.9 it was in _launch_subprocesses)" in r.stdout), r.stdout
    # the engine's launch moved into a class upstream: keep upstream, put the two hook lines back
    text = take_new_upstream(text).replace(
        "from sglang.srt.elastic_ep.", "from sglang.srt import eagle3_capture\nfrom sglang.srt.elastic_ep.", 1)
    assert text.count("        server_args.check_server_args()\n") == 1
    (dest / ENGINE).write_text(text.replace("        server_args.check_server_args()\n",
                                            "        server_args.check_server_args()\n"
                                            "        eagle3_capture.check_launch(server_args)\n"))
    r = shell(printed(r.stdout, "2. "), elsewhere)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "committed 0006-smoke-route" in r.stdout and "every patch is ported" in r.stdout
    assert git(dest, "status", "--porcelain") == ""
    # 5. the printed export and verify commands, as printed, from another directory
    export = printed(r.stdout, "next:")
    assert export == f"python3 {REPO}/tools/export.py {dest} --base v0.5.10 --out {out}"
    e = shell(export, elsewhere)
    assert e.returncode == 0, e.stdout + e.stderr
    worktree, verify = printed(r.stdout, "2. check it"), printed(r.stdout, "2. check it", then=1)
    assert worktree.startswith(f"git -C {dest} worktree add") and verify.startswith(f"python3 {REPO}/tools/verify.py")
    assert shell(worktree, elsewhere).returncode == 0
    v = shell(verify, elsewhere)
    assert v.returncode == 0 and "verify: CLEAN" in v.stdout, v.stdout + v.stderr
    # the series: the old patches (Kimi's dropped), in order, smoke last, semantics of the port
    new, old = load_series(out), load_series(REPO / "patches" / "sglang-0.5.9")
    assert [p.subject for p in new.patches] == [p.subject for p in old.patches if "kimi" not in p.name]
    assert [p.subject for p in new.smoke] == [p.subject for p in old.smoke]
    assert new.manifest["release"] == "0.5.10" and new.manifest["series_version"] == "0.5.10-1"
    assert new.manifest["capture_semantics"]["upstream_eagle_id_to_capture_index"] == "plus_one"
    assert new.manifest["capture_semantics"]["capture_site"] == "model_loop"
    # apply accepts it on a fresh 0.5.10 checkout; the overlay gate and export --check agree
    fresh = make_git_checkout("0.5.10", tmp_path / "fresh", quiet=True)
    a = run_tool("apply", fresh, "--check", "--series", out, cwd=elsewhere)
    assert a.returncode == 0 and "applies cleanly" in a.stdout, a.stdout + a.stderr
    assert run_tool("export", "--overlay", "--check", "--out", out).returncode == 0
    assert run_tool("export", dest, "--base", "v0.5.10", "--out", out, "--check").returncode == 0
    # a finished port has nothing to continue
    r = shell(cont, elsewhere)
    assert r.returncode == 0 and "nothing to continue" in r.stdout


def test_checkout_refusals_change_nothing(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("mine\n")
    r = run_tool("port", "--from", "0.5.9", "--to", "0.5.10", "--checkout", full)
    assert r.returncode == 2 and "already exists" in one_line_error(r)
    assert [p.name for p in full.iterdir()] == ["x"]
    assert not list(tmp_path.glob(".*eaglepatch-port-*"))
    for args, want in ((["--checkout", "--dry-run"], "--checkout does not take --dry-run"),
                       (["--checkout", "--to-tree", tmp_path], "--checkout does not take --to-tree")):
        r = run_tool("port", "--from", "0.5.9", "--to", "0.5.10", *args, cwd=tmp_path)
        assert r.returncode == 2 and want in one_line_error(r)
    r = run_tool("port", "--continue", full, "--from", "0.5.9")
    assert r.returncode == 2 and "--continue takes only the checkout" in one_line_error(r)
    r = run_tool("port", "--continue", full)
    assert r.returncode == 2 and "holds no port made by tools/port.py --checkout" in one_line_error(r)
    assert [p.name for p in full.iterdir()] == ["x"]


def test_without_from_the_nearest_series_is_ported_and_a_backwards_port_is_named(tmp_path):
    from eaglepatch.series import nearest_series_to

    assert nearest_series_to("0.5.10") == ("0.5.9", "older")
    assert nearest_series_to("0.5.20") == ("0.5.17", "older")
    assert nearest_series_to("0.5.23") == ("0.5.17", "older")  # never the release's own series
    assert nearest_series_to("0.5.8") == ("0.5.9", "newer")
    r = run_tool("port", "--to", "0.5.10", "--dry-run", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr  # 0.5.9's series conflicts there
    assert "no --from given: porting sglang-0.5.9, the nearest series (older than sglang 0.5.10" in r.stderr
    assert "review: sglang-0.5.9 (sglang 0.5.9) -> sglang-0.5.10" in r.stdout
    r = run_tool("port", "--to", "0.5.17", "--dry-run", cwd=tmp_path)  # a release with a series of its own
    assert r.returncode == 2 and "sglang 0.5.17 has a series of its own" in one_line_error(r)
    r = run_tool("port", "--from", "0.5.23", "--to", "0.5.17", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    back = [ln for ln in r.stderr.splitlines() if "backwards port" in ln]
    assert back == [ln for ln in back if ln.startswith("port: sglang 0.5.17 is older than 0.5.23")] and len(back) == 1


def test_apply_fetch_of_a_release_without_a_series_names_the_checkout_port(tmp_path):
    dest = tmp_path / "sglang"
    for extra, series in (([], []), (["--series", REPO / "patches" / "sglang-0.5.9"],
                                     ["--series", REPO / "patches" / "sglang-0.5.9"])):
        r = run_tool("apply", "--fetch", "0.5.10", dest, *extra, cwd=tmp_path)
        err = one_line_error(r)
        assert r.returncode == 2 and "no series for sglang 0.5.10" in err
        want = " ".join(["python3", f"{REPO}/tools/port.py", *map(str, series), "--from", "0.5.9", "--to", "0.5.10",
                         "--checkout", str(dest)])
        assert err.endswith(want), err
        assert not dest.exists()


def test_a_clean_port_through_a_checkout_exports_the_committed_series(tmp_path):
    """0.5.23 -> 0.5.17 merges everywhere: --checkout commits every patch and exits 0, and the
    export of that branch is the committed patches/sglang-0.5.17 byte for byte (manifest and its
    capture semantics included, taken from the port's record)."""
    dest, out = tmp_path / "co", tmp_path / "series"
    r = run_tool("port", "--from", "0.5.23", "--to", "0.5.17", "--checkout", dest, "--out", out, "--date", "2026-12-01",
                 "--series-version", "0.5.17-3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every patch is ported: 5 commit(s)" in r.stdout and "relocated" in r.stdout
    assert "backwards port" in r.stderr
    r = run_tool("export", dest, "--base", "v0.5.17", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    committed = REPO / "patches" / "sglang-0.5.17"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in committed.iterdir())
    for f in committed.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def _series(root, release_dir, edits):
    """A series for sglang 0.5.9 under `root`: one patch per (subject, file, old line, new line)."""
    import difflib

    d = root / "sglang-0.5.9"
    d.mkdir(parents=True)
    names = []
    for n, (subject, rel, old, new) in enumerate(edits, 1):
        before = (release_dir / rel).read_text()
        assert before.count(old) == 1
        body = "".join(difflib.unified_diff(before.splitlines(True), before.replace(old, new).splitlines(True),
                                            f"a/{rel}", f"b/{rel}", n=3))
        name = f"{n:04d}-p{n}.patch"
        (d / name).write_text(f"Subject: {subject}\nLast-Update: 2026-01-01\n---\ndiff --git a/{rel} b/{rel}\n{body}")
        names.append(name)
    (d / "series").write_text("".join(f"{x}\n" for x in names))
    return d


def test_a_hunk_on_a_file_the_new_release_lacks_is_left_as_a_rej(tmp_path, release_059):
    """0.5.10 deleted bench_rmsnorm.py: no merge can mark a hunk there, so the port leaves the
    file's diff as a .rej; --continue refuses while it is there; a patch whose resolution leaves
    nothing is dropped and the port goes on to the next patch."""
    gone, kept = "sglang/jit_kernel/benchmark/bench_rmsnorm.py", "sglang/srt/server_args_config_parser.py"
    series = _series(tmp_path / "patches", release_059, [
        ("bench: a comment", gone, "import torch\n", "import torch  # eaglepatch\n"),
        ("parser: a comment", kept, "import argparse\n", "import argparse  # eaglepatch\n")])
    dest = tmp_path / "co"
    r = run_tool("port", "--series", series, "--to", "0.5.10", "--checkout", dest)
    assert r.returncode == 1, r.stdout + r.stderr
    rej = dest / "python" / f"{gone}.rej"
    assert f"{rej}: hunk 0 [<module>] the new release has no such file" in r.stdout
    assert rej.read_text().startswith(f"diff --git a/{gone} b/{gone}\n") and "+import torch  # eaglepatch" in \
        rej.read_text()
    assert not (dest / "python" / gone).exists()
    r = run_tool("port", "--continue", dest)
    assert r.returncode == 1 and f"{rej} still there" in one_line_error(r)
    git(dest, "checkout", "-q", "main")  # --continue only on the port's branch
    r = run_tool("port", "--continue", dest)
    assert r.returncode == 1 and "is on main, not on the port's branch eaglepatch/sglang-0.5.10" in one_line_error(r)
    git(dest, "checkout", "-q", "eaglepatch/sglang-0.5.10")
    rej.unlink()
    r = run_tool("port", "--continue", dest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dropped (the resolution leaves nothing of it)" in r.stdout and "committed 0002-p2.patch" in r.stdout
    assert git(dest, "log", "--format=%s", "v0.5.10..HEAD").splitlines() == ["parser: a comment"]
    assert "import argparse  # eaglepatch" in (dest / "python" / kept).read_text()


def test_continue_refuses_the_half_written_files_of_a_killed_port(tmp_path, release_059):
    """A port killed while it wrote a patch (its record says it did not stop at a conflict) leaves
    uncommitted files: --continue refuses to merge onto them and names the reset."""
    kept = "sglang/srt/server_args_config_parser.py"
    series = _series(tmp_path / "patches", release_059, [("parser: a comment", kept, "import argparse\n",
                                                          "import argparse  # eaglepatch\n")])
    dest = tmp_path / "co"
    assert run_tool("port", "--series", series, "--to", "0.5.10", "--checkout", dest).returncode == 0
    st_path = dest / ".git" / "eaglepatch-port.json"
    st = json.loads(st_path.read_text())
    git(dest, "reset", "-q", "--soft", "HEAD~1")  # as if killed after writing, before the commit
    st.update(done=False, next=0)
    st_path.write_text(json.dumps(st))
    r = run_tool("port", "--continue", dest)
    assert r.returncode == 1 and "did not stop at a conflict" in one_line_error(r) and "reset -q --hard" in r.stderr


def test_a_release_without_a_series_is_refused_before_anything_is_downloaded(tmp_path):
    cache = tmp_path / "cache"
    r = run_tool("port", "--from", "0.5.8", "--to", "0.5.9", "--checkout", tmp_path / "co",
                 env={"EAGLEPATCH_CACHE": str(cache)})
    assert r.returncode == 2 and "there is no series for sglang 0.5.8" in one_line_error(r)
    assert not (cache / "releases" / "0.5.8").exists() and not (tmp_path / "co").exists()
