"""tools/port.py on the real sglang releases: 0.5.9 -> 0.5.23 (conflicts, nothing written) and a
clean port onto a real 0.5.9 tree that moved code and already carries one patch."""

import json
import shutil
import subprocess

import pytest
from conftest import REAL, copy_installed, hashes, one_line_error, run_tool

from eaglepatch import port
from eaglepatch.fetch import unpacked_release
from eaglepatch.series import load_series, split_lines
from eaglepatch.verdicts import check_series

DS = "sglang/srt/models/deepseek_v2.py"
MR = "sglang/srt/model_executor/model_runner.py"


@pytest.fixture(scope="module")
def release_0523():
    return unpacked_release("0.5.23", quiet=True)


def test_port_0_5_9_to_0_5_23_reports_conflicts_with_both_sides_and_writes_nothing(tmp_path, release_059,
                                                                                   release_0523):
    out = tmp_path / "patches" / "sglang-0.5.23"
    r = run_tool("port", "--from", "0.5.9", "--to", "0.5.23", "--out", out, "--json", tmp_path / "p.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert not out.exists() and not list((tmp_path / "patches").glob("*")) if (tmp_path / "patches").exists() \
        else not out.exists()
    res = json.loads((tmp_path / "p.json").read_text())
    by = {(h["patch"].split("-", 1)[0], h["file"], h["hunk"]): h for h in res["hunks"]}
    # the capture loop moved into the decoder layers: the 0.5.9 hunk has no place left
    loop = by[("0002", DS, 1)]
    assert loop["status"] == "conflict" and loop["anchor"] == "DeepseekV2Model.forward"
    assert "eagle3_capture.residual_stream(hidden_states, residual)" in loop["sides"]["old patched"]
    assert "aux_hidden_states.append(hidden_states + residual)" in loop["sides"]["old upstream"]
    assert loop["sides"]["new upstream"] == ""
    # Kimi delegation is upstream since 0.5.10: dropped by its Drop-When, not merged
    assert {by[("0004", "sglang/srt/models/kimi_k25.py", i)]["status"] for i in (0, 1)} == {"dropped"}
    assert by[("0002", DS, 3)]["status"] == "merged"  # set_eagle3_layers_to_capture hook still merges
    assert res["upstream_capture_semantics"]["0.5.23"] == {"eagle_id_to_capture_index": "plus_one_if_first_is_one",
                                                          "capture_site": "decoder_layer"}
    assert res["upstream_capture_semantics"]["0.5.9"] == {"eagle_id_to_capture_index": "plus_one",
                                                         "capture_site": "model_loop"}
    assert "CONFLICT 0002-" in r.stdout and "--- new upstream" in r.stdout and "nothing written" in r.stdout
    assert "4: 0004-kimi" in r.stdout and "< -: dropped" in r.stdout
    assert "upstream changed how draft-config ids map" in r.stdout


def _moved_tree(tmp_path, release_059, series):
    """A real 0.5.9 install where upstream moved code (12 lines added at the top of model_runner.py
    and deepseek_v2.py) and already carries the deepseek_v2 hooks of the series."""
    new = copy_installed(release_059, tmp_path / "new", series.files(smoke=True))
    for rel in (MR, DS):
        p = new / rel
        p.write_bytes(b"".join([f"# upstream note {i}\n".encode() for i in range(12)]) + p.read_bytes())
    p2 = next(p for p in series.patches if p.name.startswith("0002-"))
    p1 = next(p for p in series.patches if p.name.startswith("0001-"))
    env = {"GIT_CEILING_DIRECTORIES": str(tmp_path)}
    for p in (p1, p2):
        r = subprocess.run(["git", "apply", "-", "--whitespace=nowarn"], input=p.body, cwd=new, capture_output=True,
                           env={**__import__("os").environ, **env})
        assert r.returncode == 0, r.stderr
    # the package file stays out of the "upstream": the port must carry it
    shutil.rmtree(new / "sglang" / "srt" / "eagle3_capture")
    for d in new.glob("sglang-*.dist-info"):
        shutil.rmtree(d)
    (new / "sglang" / "_version.py").write_text('__version__ = version = "0.5.9.1"\n')
    return new


def test_clean_port_drops_hunks_upstream_has_moves_the_rest_and_writes_an_exact_series(tmp_path, release_059):
    series = load_series(REAL)
    new = _moved_tree(tmp_path, release_059, series)
    out = tmp_path / "out" / "sglang-0.5.9"
    r = run_tool("port", "--from-tree", new, "--to-tree", new, "--out", out)
    assert r.returncode == 2 and "there is no series for sglang 0.5.9.1" in one_line_error(r)
    r = run_tool("port", "--from-tree", release_059, "--to-tree", release_059, "--out", out)
    assert r.returncode == 2 and "--from and --to are both 0.5.9" in one_line_error(r)
    r = run_tool("port", "--series", REAL, "--from-tree", release_059, "--to-tree", new, "--to", "0.5.9.1",
                 "--out", out, "--date", "2026-12-01")
    assert r.returncode == 0, r.stdout + r.stderr
    ported = load_series(out)
    names = [p.name for p in ported.patches]
    assert not any("deepseek-v2" in n for n in names), names  # every 0002 hunk is upstream: patch dropped
    assert "every hunk is already in the new release" in r.stdout
    assert any(n.startswith("0001-") for n in names) and any("model-runner" in n for n in names)
    assert [p.name for p in ported.smoke] and ported.smoke[0].subject.startswith("smoke:")
    assert ported.manifest["release"] == "0.5.9.1" and ported.manifest["series_version"] == "0.5.9.1-1"
    assert ported.manifest["capture_semantics"]["eagle_id_to_capture_index"] == "plus_one"
    settings = next(p for p in ported.patches if p.name.startswith("0001-")).data
    assert b'+SERIES_VERSION = "0.5.9.1-1"' in settings  # the package is stamped with the new release
    runner = next(p for p in ported.patches if "model-runner" in p.name)
    assert b"Last-Update: 2026-12-01" in runner.data
    # the package patch keeps the overlay's own header (export --overlay --check compares it byte for byte)
    from eaglepatch.overlay import header
    assert ported.patches[0].header == header() and b"Last-Update: 2026-12-01" not in ported.patches[0].data
    # the hunks that remain land exactly on the new tree, 12 lines lower than before
    from eaglepatch.tree import UpstreamTree
    tree = UpstreamTree("installed", new, new, "0.5.9.1", None)
    chk = check_series(tree.read, ported.patches + ported.smoke, ported)
    assert chk.all_ok and all(v.verdict == "exact" for v in chk.verdicts), [v.as_dict() for v in chk.verdicts]
    mr = [h for p in ported.patches for h in p.hunks() if h.file == MR]
    old_mr = [h for p in series.patches for h in p.hunks() if h.file == MR]
    assert [h.source_start for h in mr] == [h.source_start + 12 for h in old_mr]
    assert "review:" in r.stdout and "1: 0001-add-the-eagle3-capture-package.patch !" in r.stdout
    assert '+SERIES_VERSION = "0.5.9.1-1"' in r.stdout  # the interdiff shows the stamp
    # a second run refuses to overwrite; nothing changes
    before = hashes(out)
    r2 = run_tool("port", "--series", REAL, "--from-tree", release_059, "--to-tree", new, "--to", "0.5.9.1",
                  "--out", out)
    assert r2.returncode == 1 and "already exists" in one_line_error(r2)
    assert hashes(out) == before


ENGINE = "sglang/srt/entrypoints/engine.py"


def test_a_conflict_is_named_by_the_def_that_encloses_its_markers(tmp_path, release_059, release_0510):
    """0.5.9 -> 0.5.10: the engine hunk that sat in `_launch_subprocesses` conflicts with code
    upstream moved; its markers land in `_calculate_rank_ranges`, ~600 lines away, and that is
    the def the report names (the old one is in the detail), at the marker's line of the file
    `--checkout` writes."""
    r = run_tool("port", "--from", "0.5.9", "--to", "0.5.10", "--out", tmp_path / "out", "--json", tmp_path / "p.json")
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads((tmp_path / "p.json").read_text())
    by = {(h["patch"].split("-", 1)[0], h["file"], h["hunk"]): h for h in res["hunks"]}
    eng = by[("0005", ENGINE, 1)]
    assert eng["status"] == "conflict" and eng["anchor"] == "_calculate_rank_ranges", eng
    assert "in sglang 0.5.9 it was in _launch_subprocesses" in eng["detail"]
    assert f"hunk 1 [_calculate_rank_ranges] near line {eng['line']} of the merge" in r.stdout
    assert "pp_size_per_node" in eng["sides"]["new upstream"]
    assert "eagle3_capture.check_launch(server_args)" in eng["sides"]["old patched"]
    assert by[("0005", ENGINE, 0)]["anchor"] == "<module>" and by[("0005", ENGINE, 0)]["line"] < eng["line"]
    # the 0.5.23 conflict stays where it was (its new-upstream side is empty: the line before counts)
    assert by[("0002", DS, 1)]["anchor"] == "DeepseekV2Model.forward"


def test_marker_anchor_reads_the_file_as_written():
    marked = (b"class A:\n"
              b"    def moved(self):\n"
              b"        x = 1\n"
              b"<<<<<<< old patched\n"
              b"        hook()\n"
              b"        y = 2\n"
              b"||||||| old upstream\n"
              b"        y = 2\n"
              b"=======\n"
              b"        y = 3\n"
              b">>>>>>> new upstream\n"
              b"        return y\n"
              b"\n"
              b"def other():\n"
              b"<<<<<<< old patched\n"
              b"    hook()\n"
              b"||||||| old upstream\n"
              b"=======\n"
              b">>>>>>> new upstream\n"
              b"    pass\n")
    assert port.merge.marker_anchor(marked, 4) == "A.moved"
    assert port.merge.marker_anchor(marked, 15) == "other"  # an empty new-upstream side: the line before
    assert port.merge.marker_anchor(marked, 5) is None  # no marker there


def test_merge_file_conflict_regions_are_parsed_per_side():
    base = b"a\nb\nc\n"
    n, merged = port.merge_file(b"a\nB1\nc\n", base, b"a\nB2\nc\n")
    assert n == 1
    (reg,) = port.conflict_regions(merged)
    assert (reg["old patched"], reg["old upstream"], reg["new upstream"]) == ("B1\n", "b\n", "B2\n")
    n, merged = port.merge_file(b"x\na\nb\nc\n", base, b"a\nb\nc\ny\n")
    assert n == 0 and split_lines(merged) == [b"x\n", b"a\n", b"b\n", b"c\n", b"y\n"]


def test_unknown_series_and_missing_arguments_are_usage_errors(tmp_path):
    r = run_tool("port", "--from", "0.5.8", "--to", "0.5.9", "--out", tmp_path / "o")
    assert r.returncode == 2 and "there is no series for sglang 0.5.8" in one_line_error(r)
    r = run_tool("port", "--from", "0.5.9")
    assert r.returncode == 2 and "--to is missing" in one_line_error(r)


def test_port_hint_names_the_nearest_older_series():
    assert port.nearest_older_series("0.5.15")[0] == "0.5.9"
    assert port.nearest_older_series("0.5.23")[0] == "0.5.23"
    assert "tools/port.py --from 0.5.9 --to 0.5.15" in port.port_hint("0.5.15")
    assert port.nearest_older_series("0.5.8") is None


# ---- context-only conflicts: relocated by neighbouring statements, listed for review ---------------

def _hunk(before: str, after: str):
    """The one hunk of a diff between two versions of a file (zero-fuzz matcher input)."""
    import difflib

    from eaglepatch.series import parse_patch

    body = "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "a/sglang/x.py",
                                        "b/sglang/x.py", n=3))
    p = parse_patch(b"Subject: t\n---\ndiff --git a/sglang/x.py b/sglang/x.py\n" + body.encode(), "t")
    (h,) = p.files[0].hunks
    return h, h.source_start - 1


OLD = """import os
from pkg.configs import A
from pkg.dist import divide
from pkg.env import envs


class Runner:
    def init(self):
        self.load()
        prepare(model=self.model, config=self.config)

        self.after()
"""


@pytest.mark.parametrize("case", ["import grew names", "call grew arguments", "indentation changed"])
def test_relocate_places_an_insertion_by_its_neighbouring_statements(case):
    from eaglepatch.port.relocate import relocate

    if case == "import grew names":
        hook_old = OLD.replace("from pkg.dist import divide\n", "from pkg import hook\nfrom pkg.dist import divide\n")
        new = OLD.replace("from pkg.dist import divide\n", "from pkg.dist import (\n    divide,\n    gather,\n)\n")
        want = new.replace("from pkg.dist import (\n", "from pkg import hook\nfrom pkg.dist import (\n")
    elif case == "call grew arguments":
        hook_old = OLD.replace("self.config)\n", "self.config)\n        hook.run(self)\n")
        new = OLD.replace("prepare(model=self.model, config=self.config)\n",
                          "prepare(\n            model=self.model,\n            config=self.config,\n            x=1,\n        )\n")
        want = new.replace("            x=1,\n        )\n", "            x=1,\n        )\n        hook.run(self)\n")
    else:
        hook_old = OLD.replace("self.config)\n", "self.config)\n        hook.run(self)\n")
        new = OLD.replace("    def init(self):\n        self.load()\n        prepare(model=self.model, config=self.config)\n\n        self.after()\n",
                          "    def init(self):\n        if True:\n            self.load()\n            prepare(model=self.model, config=self.config, x=1)\n\n            self.after()\n")
        want = new.replace("x=1)\n", "x=1)\n            hook.run(self)\n")
    h, pos = _hunk(OLD, hook_old)
    moved = relocate(OLD.encode(), h, pos, new.encode())
    assert moved is not None and moved.data.decode() == want
    assert "relocated" in moved.note


@pytest.mark.parametrize("case", ["neighbour twice in its scope", "neighbours moved apart", "removes a line",
                                  "neighbour gone"])
def test_relocate_leaves_what_is_not_safe_a_conflict(case):
    from eaglepatch.port.relocate import relocate

    hook_old = OLD.replace("self.config)\n", "self.config)\n        hook.run(self)\n")
    if case == "neighbour twice in its scope":
        new = OLD.replace("prepare(model=self.model, config=self.config)\n",
                          "prepare(model=self.model, config=1)\n        prepare(model=self.model, config=2)\n")
        new = new.replace("\n        self.after()\n", "\n        self.after()\n        self.after()\n")
    elif case == "neighbours moved apart":
        new = OLD.replace("prepare(model=self.model, config=self.config)\n",
                          "prepare(model=self.model, config=self.config, x=1)\n        self.other()\n")
    elif case == "removes a line":
        hook_old = OLD.replace("        self.load()\n", "        hook.load(self)\n")
        new = OLD.replace("self.load()", "self.load(x=1)")
    else:
        new = OLD.replace("        prepare(model=self.model, config=self.config)\n\n        self.after()\n",
                          "        self.other()\n")
    h, pos = _hunk(OLD, hook_old)
    assert relocate(OLD.encode(), h, pos, new.encode()) is None


def test_port_0_5_23_to_0_5_17_resolves_context_only_conflicts(tmp_path, release_0523):
    """The newest series ported to the GPU release: every hunk merges or is relocated (none
    conflicts), the package is the overlay's for 0.5.17, and the result is the committed series."""
    out = tmp_path / "patches" / "sglang-0.5.17"
    r = run_tool("port", "--from", "0.5.23", "--to", "0.5.17", "--out", out, "--json", tmp_path / "p.json",
                 "--date", "2026-12-01", "--series-version", "0.5.17-3")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "p.json").read_text())
    status = {(h["patch"].split("-", 1)[0], h["file"], h["hunk"]): h["status"] for h in res["hunks"]}
    assert "conflict" not in status.values()
    assert status[("0003", MR, 1)] == "relocated" and status[("0002", DS, 0)] == "relocated"
    reviews = [ln for ln in r.stdout.splitlines() if ln.startswith("  review:") and "relocated" in ln]
    assert len(reviews) == 3, r.stdout
    for f in (REAL.parent / "sglang-0.5.17").iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert not [n for n in res["notes"] if "draft_readings" in n], res["notes"]  # 0.5.17 declares its own


def test_a_port_to_a_release_without_a_series_carries_the_draft_readings_and_says_so(tmp_path, release_0523):
    """Where the destination release has no series yet, nothing declares its DFlash/DSpark readings:
    the port carries the old series' and says, in a note, that they are unchecked for the new
    release (never dropped in silence, never presented as checked)."""
    root = tmp_path / "only"
    shutil.copytree(REAL.parent / "sglang-0.5.23", root / "sglang-0.5.23")
    out = tmp_path / "patches" / "sglang-0.5.17"
    r = run_tool("port", "--series", root / "sglang-0.5.23", "--to", "0.5.17", "--out", out, "--json",
                 tmp_path / "p.json", "--date", "2026-12-01", "--series-version", "0.5.17-3")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "p.json").read_text())
    carried = json.loads((root / "sglang-0.5.23" / "manifest.json").read_text())["capture_semantics"]["draft_readings"]
    assert json.loads((out / "manifest.json").read_text())["capture_semantics"]["draft_readings"] == carried
    notes = [n for n in res["notes"] if "draft_readings" in n]
    assert len(notes) == 1 and "sglang 0.5.23's, carried over unchecked" in notes[0], res["notes"]
    assert notes[0] in r.stdout + r.stderr
