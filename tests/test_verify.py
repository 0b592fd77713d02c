"""tools/verify.py: per-hunk verdicts (built cases for each), drift on the real 0.5.10, smoke levels."""

import json
import sys

import pytest
from conftest import BASIC, REAL, git, hashes, one_line_error, run_tool

from eaglepatch.export import build_export, write_export
from eaglepatch.report import verify_tree
from eaglepatch.series import load_series
from eaglepatch.tree import UpstreamTree
from eaglepatch.verdicts import check_series

DS = "sglang/srt/models/deepseek_v2.py"
P2 = "0002-record-the-capture-layers-in-deepseekv2model.patch"
HUNK = b"        self.layers_to_capture = []\n"


def verdict_of(pp, series, patch=P2, file=DS):
    tree = UpstreamTree.open(pp)
    chk = check_series(tree.read, series.patches, series)
    [v] = [v for v in chk.verdicts if v.patch == patch and v.file == file]
    return v, chk


def edit(pp, rel, fn):
    p = pp / rel
    p.write_bytes(fn(p.read_bytes()))


def test_clean_release_is_all_exact_with_static_smoke(installed_059, tmp_path):
    before = hashes(installed_059)
    out = tmp_path / "v.json"
    r = run_tool("verify", installed_059, "--series", BASIC, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test-only smoke patches" in r.stdout and "0003-smoke-mark-the-smoke-build.patch" in r.stdout
    assert "PASS py_compile" in r.stdout and "PASS pyflakes" in r.stdout
    rep = json.loads(out.read_text())
    assert [v["verdict"] for v in rep["verdicts"]] == ["exact"] * 6
    assert rep["footprint"]["upstream_lines_added"] == 4 and rep["footprint"]["new_files"] == 1
    assert rep["smoke"]["smoke_patches_applied"] == ["0003-smoke-mark-the-smoke-build.patch"]
    assert hashes(installed_059) == before  # verify never writes the tree


def test_offset(installed_059):
    edit(installed_059, DS, lambda b: b"# 1\n# 2\n# 3\n# 4\n# 5\n" + b)
    v, chk = verdict_of(installed_059, load_series(BASIC))
    assert (v.verdict, v.offset, v.label) == ("offset", 5, "offset +5")
    assert chk.all_ok
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 0 and "offset +5" in r.stdout
    # apply agrees with git apply's own offset report (it refuses when they differ)
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 0, r.stderr
    assert "1 at an offset" in r.stdout
    assert b"        self.eagle3_capture_layers = None\n" in (installed_059 / DS).read_bytes()


def test_context_changed(installed_059):
    # a context line two lines above the change is edited; the changed lines are intact
    edit(installed_059, DS, lambda b: b.replace(b"            )\n" + HUNK, b"            )  # edited\n" + HUNK, 1))
    v, _ = verdict_of(installed_059, load_series(BASIC))
    assert v.verdict == "context changed"
    r = run_tool("verify", installed_059, "--series", BASIC)
    assert r.returncode == 1 and "context changed" in r.stdout and "DRIFT" in r.stdout


def test_conflict(installed_059):
    edit(installed_059, DS, lambda b: b.replace(HUNK, b"        self.layers_to_capture = list()\n", 1))
    v, _ = verdict_of(installed_059, load_series(BASIC))
    assert v.verdict == "conflict"


def test_already_applied(installed_059, tmp_path):
    scratch = tmp_path / "scratch"
    import shutil
    shutil.copytree(installed_059, scratch)
    assert run_tool("apply", scratch, "--series", BASIC).returncode == 0
    (installed_059 / DS).write_bytes((scratch / DS).read_bytes())  # only deepseek_v2.py is patched
    v, chk = verdict_of(installed_059, load_series(BASIC))
    assert v.verdict == "already applied"
    assert [x.verdict for x in chk.verdicts if x.file != DS] == ["exact"] * 5
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 1 and "already applied" in r.stdout


def test_ambiguous(installed_059):
    s = load_series(BASIC)
    [h] = [h for p in s.patches if p.name == P2 for f in p.files if f.path == DS for h in f.hunks]
    edit(installed_059, DS, lambda b: b + b"".join(h.old))
    v, _ = verdict_of(installed_059, s)
    assert v.verdict == "ambiguous" and "2629" in v.detail
    before = hashes(installed_059)
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 1 and "ambiguous" in r.stderr  # git apply would silently pick one
    assert hashes(installed_059) == before


def test_anchor_drift(installed_059):
    # the body of DeepseekV2Model.__init__ changes far from the hunk: it applies, but its meaning may not
    def add_line(b):
        cls = b.index(b"class DeepseekV2Model(nn.Module):")
        at = b.index(b"        super().__init__()\n", cls) + len(b"        super().__init__()\n")
        return b[:at] + b"        self.eagle3_note = 1\n" + b[at:]
    edit(installed_059, DS, add_line)
    v, _ = verdict_of(installed_059, load_series(BASIC))
    assert v.verdict == "anchor drift" and v.anchor == "DeepseekV2Model.__init__"
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 1 and "anchor drift" in r.stdout
    r = run_tool("apply", installed_059, "--series", BASIC, "--force")
    assert r.returncode == 0, r.stderr  # --force accepts drift, still zero fuzz


def test_later_patches_see_earlier_ones(installed_059):
    s = load_series(BASIC)
    chk = check_series(UpstreamTree.open(installed_059).read, s.patches, s)
    # 0002 edits the file that 0001 creates: checkable only on the in-memory result of 0001
    v = [v for v in chk.verdicts if v.patch == P2 and v.file.endswith("eagle3_capture/__init__.py")][0]
    assert v.verdict == "exact" and v.anchor == "on_model_runner_init"
    chk2 = check_series(UpstreamTree.open(installed_059).read, s.patches[1:], s)
    v2 = [v for v in chk2.verdicts if v.file.endswith("eagle3_capture/__init__.py")][0]
    assert v2.verdict == "conflict"


@pytest.mark.parametrize("series_dir", [BASIC, REAL], ids=["fixture", "product"])
def test_real_0510_reports_drift_hunk_by_hunk(installed_0510, tmp_path, series_dir):
    if not (series_dir / "series").is_file():
        pytest.skip("the product series is not committed yet")
    out = tmp_path / "v.json"
    r = run_tool("verify", installed_0510, "--series", series_dir, "--json", out)
    assert r.returncode == 1
    rep = json.loads(out.read_text())
    n = sum(len(p.hunks()) for p in load_series(series_dir).patches)
    assert len(rep["verdicts"]) == n  # one verdict per hunk, the failing ones included
    upstream = [v for v in rep["verdicts"] if v["source_start"] > 0]
    assert any(v["verdict"] not in ("exact",) for v in upstream)
    assert rep["tree"]["release"] == "0.5.10"
    assert "0.5.10" in r.stdout and "DRIFT" in r.stdout


def test_verify_on_an_applied_tree_checks_its_unpatched_form(installed_059):
    assert run_tool("apply", installed_059, "--series", BASIC).returncode == 0
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "none")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reversed in memory" in r.stdout


def test_static_smoke_catches_an_undefined_name(checkout_059, installed_059, tmp_path):
    p = checkout_059 / "python" / DS
    p.write_bytes(p.read_bytes().replace(HUNK, HUNK + b"        eagle3_not_imported(self)\n", 1))
    git(checkout_059, "commit", "-q", "-am", "Call a helper\n\nDescription: x\nWhy: y\nOrigin: eaglepatch\n"
        "Forwarded: no\nLast-Update: 2026-11-29\nDrop-When: never")
    out = tmp_path / "sglang-0.5.9"
    write_export(out, build_export(checkout_059, "v0.5.9"))
    r = run_tool("verify", installed_059, "--series", out, "--smoke", "static")
    assert r.returncode == 1
    assert "FAIL pyflakes undefined names" in r.stdout and "eagle3_not_imported" in r.stdout
    assert "PASS py_compile" in r.stdout


def test_import_level_unavailable_is_said_clearly(installed_059, monkeypatch):
    import types
    import eaglepatch
    empty = types.ModuleType("eaglepatch.smoke")
    monkeypatch.setitem(sys.modules, "eaglepatch.smoke", empty)
    monkeypatch.setattr(eaglepatch, "smoke", empty, raising=False)
    s = load_series(BASIC)
    rep = verify_tree(UpstreamTree.open(installed_059), s, "import", say=lambda m: None)
    assert rep.exit_code == 1
    [r] = [r for r in rep.smoke if r.name == "smoke level import"]
    assert not r.passed and r.figure == "not available" and "run_smoke" in r.detail
    assert "not available" in rep.human()


def test_json_destination_that_takes_no_files_is_refused_before_any_work(installed_059):
    """/proc/nope.json: the permission bits of /proc allow root to write, the filesystem does not.
    One line naming the directory, before the tree is copied for the smoke tests."""
    r = run_tool("verify", installed_059, "--series", BASIC, "--smoke", "static", "--json", "/proc/nope.json")
    assert r.returncode == 2, r.stdout + r.stderr
    err = one_line_error(r)
    assert "/proc does not take new files" in err and "free space" not in err, err
    assert "copying" not in r.stderr and r.stdout == ""
    r = run_tool("verify", installed_059, "--series", BASIC, "--json", "/nonexistent-dir/r.json")
    assert r.returncode == 2 and "/nonexistent-dir does not exist" in one_line_error(r)
    assert "copying" not in r.stderr
