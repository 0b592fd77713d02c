"""tools/guard.py: draft layer ids vs the dataset's, through a release's or a tree's semantics.

Trees: the real sglang 0.5.9 release (eaglepatch.fetch), the same with this series applied, and
0.5.9 with set_eagle3_layers_to_capture rewritten to the newer upstream rule (+1 only when the
first id is 1). The datasets are manifests as tools/extract.py writes them (61 layers, like
DeepSeek-V3/Kimi-K2.5); test_extract.py runs the guard on a real extracted dataset.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import guard  # noqa: E402

GUARD = REPO / "tools" / "guard.py"
UPSTREAM_LINE = "self.model.layers_to_capture = [val + 1 for val in layer_ids]"
NEWER_BLOCK = (
    "if layer_ids and layer_ids[0] == 1:\n"
    "                self.model.layers_to_capture = [val + 1 for val in layer_ids]\n"
    "            else:\n"
    "                self.model.layers_to_capture = list(layer_ids)"
)


def run_guard(*args):
    p = subprocess.run([sys.executable, str(GUARD), *map(str, args)], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def manifest(tmp: Path, name: str, ids, n=61, fmt=None, release=None) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({
        "format": "eaglepatch-hidden-states/2", "eagle3_layer_ids": ids, "hf_hidden_state_indices": [k + 1 for k in ids],
        "model": {"num_hidden_layers": n}, "final": "post_norm", "samples": 3, "dataset_format": fmt,
        **({"sglang_release": release} if release is not None else {})}))
    return d


def draft(tmp: Path, name: str, ids, use_aux=True, nested=True) -> Path:
    p = tmp / f"{name}.json"
    eagle = {"use_aux_hidden_state": use_aux}
    if ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **({"eagle_config": eagle} if nested else eagle)}
    p.write_text(json.dumps(cfg))
    return p


@pytest.fixture(scope="session")
def upstream_059():
    from eaglepatch.fetch import unpacked_release

    return unpacked_release("0.5.9", quiet=True)


@pytest.fixture(scope="session")
def patched_059(upstream_059, tmp_path_factory):
    from eaglepatch.smoke.tree import patched_tree

    return patched_tree(upstream_059, REPO / "patches" / "sglang-0.5.9", tmp_path_factory.mktemp("patched") / "pp",
                        smoke=False)


@pytest.fixture(scope="session")
def newer_tree(upstream_059, tmp_path_factory):
    """0.5.9 with the newer upstream rule; only deepseek_v2.py is needed by the guard."""
    pp = tmp_path_factory.mktemp("newer")
    models = pp / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    src = (upstream_059 / "sglang" / "srt" / "models" / "deepseek_v2.py").read_text()
    assert src.count(UPSTREAM_LINE) == 1
    (models / "deepseek_v2.py").write_text(src.replace(UPSTREAM_LINE, NEWER_BLOCK))
    return pp


def test_semantics_read_from_trees(upstream_059, patched_059, newer_tree):
    up = guard.tree_semantics(upstream_059)
    assert (up.rule, up.series, up.embed_ok) == (guard.PLUS_ONE, False, False)
    pa = guard.tree_semantics(patched_059)
    assert (pa.rule, pa.series, pa.embed_ok) == (guard.PLUS_ONE, True, True)
    nw = guard.tree_semantics(newer_tree)
    assert (nw.rule, nw.series) == (guard.PLUS_ONE_IF_FIRST_IS_ONE, False)
    # a git-checkout layout (ROOT/python/sglang) is found too
    co = newer_tree.parent / "checkout"
    shutil.copytree(newer_tree, co / "python")
    assert guard.tree_semantics(co).rule == guard.PLUS_ONE_IF_FIRST_IS_ONE


def test_release_semantics_from_series_manifest():
    s = guard.release_semantics("0.5.9")
    assert s.rule == guard.PLUS_ONE and "manifest" in s.source
    assert s.capture([-1, 1, 29]) == [0, 2, 30]
    nw = guard.Semantics(guard.PLUS_ONE_IF_FIRST_IS_ONE, "t")
    assert nw.capture([1, 29, 57]) == [2, 30, 58] and nw.capture([2, 30, 58]) == [2, 30, 58]


def test_matching_draft_passes(tmp_path):
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d", [-1, 1, 29]), "--dataset", ds)
    assert rc == 0, out + err
    assert "OK" in out and "[0, 2, 30]" in out


def test_capture_index_style_ids_fail_with_both_conventions(tmp_path):
    """The project's motivating failure: trained on cat([embed, L2, L30])-style ids, the draft names
    [2, 30, 58] and is served other layers."""
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d", [2, 30, 58]), "--dataset", ds, "--release", "0.5.9")
    assert rc == 1, out + err
    assert "MISMATCH" in out
    assert "EAGLE-3 ids [2, 30, 58]" in out and "HF hidden_states indices [3, 31, 59]" in out
    assert "EAGLE-3 ids (output of layer k, -1 = embedding) [-1, 1, 29]" in out and "indices [0, 2, 30]" in out
    # the fix a trained draft takes is its config: [-1, 1, 29] read the dataset's layers (issue 43 item 15:
    # SpecForge trains these from a dataset); re-extracting to its ids is the alternative before training
    line = fix_line(out)
    assert line.startswith("fix: set eagle_aux_hidden_state_layer_ids to [-1, 1, 29] in the draft config"), line
    assert "for a draft not trained yet, re-extract into a new --out with --aux-layers=2,30,58" in line


def test_order_of_ids_does_not_matter_but_duplicates_do(tmp_path):
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    assert run_guard("--draft-config", draft(tmp_path, "a", [29, -1, 1]), "--dataset", ds)[0] == 0
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "b", [-1, 1, 1]), "--dataset", ds)
    assert rc == 1 and "repeat a layer" in out


def test_minus_one_on_trees(tmp_path, upstream_059, patched_059, newer_tree):
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    d = draft(tmp_path, "d", [-1, 1, 29])
    # the series tree captures the embedding output
    rc, out, err = run_guard("--draft-config", d, "--dataset", ds, "--sglang", patched_059)
    assert rc == 0, out + err
    # plain 0.5.9 maps -1 to index 0 but DeepSeek's residual is None there
    rc, out, _ = run_guard("--draft-config", d, "--dataset", ds, "--sglang", upstream_059)
    assert rc == 1 and "residual is None" in out
    # the newer rule applies no +1 when the first id is -1: index -1 matches no layer
    rc, out, _ = run_guard("--draft-config", d, "--dataset", ds, "--sglang", newer_tree)
    assert rc == 1 and "capture indices [-1] match no layer" in out


def test_newer_rule_serves_both_conventions(tmp_path, newer_tree):
    ds = manifest(tmp_path, "ds", [1, 29, 57])  # HF [2, 30, 58]
    for ids in ([1, 29, 57], [2, 30, 58]):
        rc, out, err = run_guard("--draft-config", draft(tmp_path, f"d{ids[0]}", ids), "--dataset", ds, "--sglang", newer_tree)
        assert rc == 0, out + err
    # the same [2, 30, 58] draft under 0.5.9 is served layers 3, 31, 59
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "old", [2, 30, 58]), "--dataset", ds, "--release", "0.5.9")
    assert rc == 1 and "[3, 31, 59]" in out and "set eagle_aux_hidden_state_layer_ids to [1, 29, 57]" in out


def test_defaults_out_of_range_and_use_aux(tmp_path):
    ds = manifest(tmp_path, "ds", [1, 29, 57])
    # no ids: SGLang's default capture indices [2, N//2, N-3] = HF [2, 30, 58] for 61 layers
    assert run_guard("--draft-config", draft(tmp_path, "none", None), "--dataset", ds)[0] == 0
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "far", [1, 29, 61]), "--dataset", ds)
    assert rc == 1 and "capture indices [62] match no layer" in out
    # id N-1 (index N: the last layer's output before the final norm) is the series' own: it is served
    # other states than this dataset's, and unpatched sglang cannot capture it at all
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "last", [1, 29, 60]), "--dataset", ds, "--release", "0.5.17")
    assert rc == 1 and "served HF hidden_states indices [2, 30, 61]" in out
    assert "unpatched sglang 0.5.17" in out and "capture indices [61] match no layer" in out
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "noaux", [1, 29, 57], use_aux=False), "--dataset", ds)
    assert rc == 1 and "use_aux_hidden_state=false" in out
    # top-level ids without eagle_config: vLLM reads them as HF indices, SGLang ignores them (its defaults)
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "flat", [1, 29, 57], nested=False), "--dataset", ds)
    assert rc == 1 and "OK (SGLang)" in out and "MISMATCH (vLLM)" in out and "SGLang ignores them" in out
    assert run_guard("--draft-config", draft(tmp_path, "flat2", [2, 30, 58], nested=False), "--dataset", ds)[0] == 0


def speculators_draft(tmp: Path, name: str, ids) -> Path:
    """A speculators 0.9.0 Eagle3 config as speculators writes it: ids top-level, HF indices."""
    p = tmp / f"{name}.json"
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 32000,
           "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1},
           "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "moonshotai/Kimi-K2.5"}}}
    if ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    p.write_text(json.dumps(cfg))
    return p


def test_speculators_drafts_are_read_as_hf_indices(tmp_path):
    """The issue's case: a speculators draft [2, 30, 58] and a 61-layer dataset of EAGLE-3 ids [1, 29, 57]
    name the same layers (HF 2, 30, 58): MATCH, read the way vLLM reads it."""
    ds = manifest(tmp_path, "ds", [1, 29, 57])
    rc, out, err = run_guard("--draft-config", speculators_draft(tmp_path, "s", [2, 30, 58]), "--dataset", ds)
    assert rc == 0, out + err
    assert "OK (vLLM)" in out and "vLLM draft: HF indices [2, 30, 58]" in out and "SGLang" not in out.split("\n", 2)[2]
    assert "speculators (speculators_model_type)" in out and "MISMATCH" not in out
    # the same ids read in sglang 0.5.9's convention are a mismatch: the family and the release decide
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e", [2, 30, 58]), "--dataset", ds, "--release", "0.5.9")
    assert rc == 1 and "MISMATCH (SGLang)" in out
    # a speculators draft one layer off is caught, and the fix is in its own convention
    rc, out, _ = run_guard("--draft-config", speculators_draft(tmp_path, "off", [1, 29, 57]), "--dataset", ds)
    assert rc == 1 and "MISMATCH (vLLM)" in out
    assert "set eagle_aux_hidden_state_layer_ids to [2, 30, 58] (HF indices" in out
    # no ids: speculators' and vLLM's default HF [2, N//2, N-3]
    rc, out, _ = run_guard("--draft-config", speculators_draft(tmp_path, "none", None), "--dataset", ds)
    assert rc == 0 and "the default [2, 61//2, 61-3]" in out
    # JSON names the family and each server's reading
    rc, out, _ = run_guard("--draft-config", speculators_draft(tmp_path, "j", [2, 30, 58]), "--dataset", ds, "--json")
    j = json.loads(out)
    assert j["family"] == "speculators" and j["servers"]["vllm"]["served_hf"] == [2, 30, 58] and j["ok"]


def test_training_warnings(tmp_path):
    """SpecForge 0.2.0's draft takes exactly three aux layers; from a dataset it trains any three ids
    (-1 too: tools/acceptance.py's drafts are [-1, 1, 2]), only its online mode wants them
    non-negative (a note, not a warning); speculators rejects -1 (its ids are HF indices, the
    embedding is 0)."""
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e", [-1, 1, 29]), "--dataset", ds)
    assert rc == 0 and "\nwarning:" not in out and "cannot train" not in out, out
    assert "note: [-1, 1, 29]: SpecForge 0.2.0 trains these ids from a dataset" in out, out
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e4", [-1, 1, 29, 40]), "--dataset", ds)
    assert "warning: SpecForge 0.2.0's draft (LlamaForCausalLMEagle3, its fc over 3 x hidden_size) takes exactly " \
           "three aux layers, once each; it cannot train [-1, 1, 29, 40] (speculators can, as HF indices " \
           "[0, 2, 30, 41])" in out, out
    rc, out, _ = run_guard("--draft-config", speculators_draft(tmp_path, "s", [-1, 1, 29]), "--dataset", ds)
    assert rc == 1 and "warning: speculators 0.9.0 rejects [-1, 1, 29]" in out
    rc, out, _ = run_guard("--draft-config", speculators_draft(tmp_path, "s0", [0, 2, 30]), "--dataset", ds)
    assert rc == 0 and "\nwarning:" not in out
    sf = manifest(tmp_path, "sf", [-1, 1, 29, 40], fmt="specforge")
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e5", [1, 29, 57]), "--dataset", sf)
    assert "this specforge-format dataset holds 4 aux layers (EAGLE-3 ids [-1, 1, 29, 40])" in out
    sf3 = manifest(tmp_path, "sf3", [-1, 1, 29], fmt="specforge")
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e6", [-1, 1, 29]), "--dataset", sf3)
    assert rc == 0 and "\nwarning:" not in out, out


def test_usage_errors_are_one_line(tmp_path):
    ds = manifest(tmp_path, "ds", [1, 29, 57])
    rc, out, err = run_guard("--draft-config", tmp_path / "missing.json", "--dataset", ds)
    assert rc == 2 and err.startswith("error: ") and "; " in err and len(err.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps({"samples": 0, "eagle3_layer_ids": None}))
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d", [1]), "--dataset", empty)
    assert rc == 2 and "records no layer ids" in err
    bad = draft(tmp_path, "bad", [1])
    bad.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2"}}))
    rc, out, err = run_guard("--draft-config", bad, "--dataset", ds)
    assert rc == 2 and "not a list of integers" in err
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d2", [1]), "--dataset", ds, "--sglang", tmp_path)
    assert rc == 2 and "deepseek_v2.py" in err


@pytest.fixture(scope="session")
def upstream_0523():
    from eaglepatch.fetch import unpacked_release

    return unpacked_release("0.5.23", quiet=True)


def test_real_0523_tree_and_its_series(tmp_path, upstream_0523):
    """sglang 0.5.23 ships the newer rule (PR #25454); the 0.5.23 series reads ids as upstream does and
    a list holding -1 as k -> k + 1."""
    from eaglepatch.smoke.tree import patched_tree

    up = guard.tree_semantics(upstream_0523)
    assert up.rule == guard.PLUS_ONE_IF_FIRST_IS_ONE and not up.series
    pa = guard.tree_semantics(patched_tree(upstream_0523, REPO / "patches" / "sglang-0.5.23", tmp_path / "pp",
                                           smoke=False))
    assert pa.rule == guard.PLUS_ONE_IF_FIRST_IS_ONE_OR_MINUS_ONE and pa.series
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    d = draft(tmp_path, "d", [-1, 1, 29])
    assert run_guard("--draft-config", d, "--dataset", ds, "--sglang", tmp_path / "pp")[0] == 0
    rc, out, _ = run_guard("--draft-config", d, "--dataset", ds, "--sglang", upstream_0523)
    assert rc == 1 and "capture indices [-1] match no layer" in out
    # a [2, 30, 58]-style draft is served HF [2, 30, 58] by upstream 0.5.23, not the dataset's [0, 2, 30]
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "c", [2, 30, 58]), "--dataset", ds, "--sglang", upstream_0523)
    assert rc == 1 and "served HF hidden_states indices [2, 30, 58]" in out
    # ... and by the patched tree alike (the series changes no list upstream serves)
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "c", [2, 30, 58]), "--dataset", ds, "--sglang", tmp_path / "pp")
    assert rc == 1 and "served HF hidden_states indices [2, 30, 58]" in out
    # upstream's convention for the dataset's layers passes on both trees: [0, 2, 30] are capture indices
    for tree in (upstream_0523, tmp_path / "pp"):
        rc, out, err = run_guard("--draft-config", draft(tmp_path, "u", [0, 2, 30]), "--dataset", ds, "--sglang", tree)
        assert rc == 0, out + err


def test_release_prints_patched_and_unpatched_readings(tmp_path):
    """--release R: what R with the series and R unpatched feed the draft; the patched reading decides
    the exit code, --unpatched makes the unpatched one decide."""
    ds = manifest(tmp_path, "ds", [-1, 1, 29])  # HF [0, 2, 30]
    emb = draft(tmp_path, "emb", [-1, 1, 29])
    rc, out, err = run_guard("--draft-config", emb, "--dataset", ds, "--release", "0.5.17")
    assert rc == 0, out + err
    assert "OK (SGLang)" in out and "unpatched sglang 0.5.17" in out and "capture indices [-1] match no layer" in out
    rc, out, _ = run_guard("--draft-config", emb, "--dataset", ds, "--release", "0.5.17", "--unpatched")
    assert rc == 1 and "MISMATCH (SGLang)" in out
    up = draft(tmp_path, "up", [0, 2, 30])  # upstream's convention: capture indices
    for extra in ([], ["--unpatched"]):
        rc, out, err = run_guard("--draft-config", up, "--dataset", ds, "--release", "0.5.17", *extra)
        assert rc == 0, out + err
    # on 0.5.9 the same list is read k + 1 by both trees: HF [1, 3, 31]
    rc, out, _ = run_guard("--draft-config", up, "--dataset", ds, "--release", "0.5.9")
    assert rc == 1 and "served HF hidden_states indices [1, 3, 31]" in out
    rc, out, _ = run_guard("--draft-config", emb, "--dataset", ds, "--release", "0.5.9", "--json")
    v = json.loads(out)
    assert v["ok"] and v["unpatched"]["ok"] is False and v["unpatched"]["rule"] == "plus_one"


def test_malformed_inputs_are_one_line_errors(tmp_path):
    """A config that is a JSON list, an eagle_config that is a string, num_hidden_layers 'sixty', a
    file this user cannot read: one line each, exit 2, no traceback."""
    ds = manifest(tmp_path, "ds", [1, 29, 57])
    ok = draft(tmp_path, "ok", [1, 29, 57])

    def one_line(rc, out, err, *needles):
        assert rc == 2 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], err
        for n in needles:
            assert n in lines[0], lines[0]

    lst = tmp_path / "list.json"
    lst.write_text("[1, 2, 3]")
    one_line(*run_guard("--draft-config", lst, "--dataset", ds), "is a JSON list, not an object")
    s = tmp_path / "str.json"
    s.write_text(json.dumps({"eagle_config": "[1, 29, 57]"}))
    one_line(*run_guard("--draft-config", s, "--dataset", ds), "eagle_config is a str, not an object")
    # a digit str.isdigit() takes and int() refuses: one line naming the field and the file (was an internal error)
    sup = tmp_path / "superscript"
    sup.mkdir()
    (sup / "manifest.json").write_text(json.dumps({"eagle3_layer_ids": [1, 29, 57], "model": {"num_hidden_layers": "²"}}))
    one_line(*run_guard("--draft-config", ok, "--dataset", sup), "num_hidden_layers='²' is not a positive integer",
             str(sup / "manifest.json"))
    sixty = tmp_path / "sixty"
    sixty.mkdir()
    (sixty / "manifest.json").write_text(json.dumps({"eagle3_layer_ids": [1, 29, 57],
                                                     "model": {"num_hidden_layers": "sixty"}}))
    one_line(*run_guard("--draft-config", ok, "--dataset", sixty), "num_hidden_layers='sixty' is not a positive integer")
    lat = tmp_path / "latin1.json"
    lat.write_bytes(b'{"eagle_config": "caf\xe9"}')
    one_line(*run_guard("--draft-config", lat, "--dataset", ds), "is not JSON")
    # a file that cannot be read (the tests run as root, whom permissions do not stop: /proc/self/mem
    # opens, and reading its first page fails with EIO)
    mem = Path("/proc/self/mem")
    assert mem.is_file()
    one_line(*run_guard("--draft-config", mem, "--dataset", ds), "cannot read draft config /proc/self/mem")
    one_line(*run_guard("--draft-config", ok, "--dataset", mem), "/proc/self/mem")


# ---- issue 29 item 16: fixes a trainer can take, the target's config refused, a closed stdout --------

FIX_SET = re.compile(r"set (?:eagle_config\.)?eagle_aux_hidden_state_layer_ids to (\[[^\]]*\])")
FIX_AUX = re.compile(r"--aux-layers=(-?[0-9]+(?:,-?[0-9]+)*)")


def fix_line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("fix: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_suggested_ids_are_trainable_by_specforge(tmp_path):
    """The demo's 4-layer dataset [-1, 0, 1, 2]: the ids that read it on 0.5.9 are [-1, 0, 1, 2], four
    aux layers, which SpecForge's draft (eagle_config drafts) cannot take; the guard proposes three
    layers instead (the draft's own [-1, 1, 2], which the server dumps already; a draft of no usable
    ids: three of the dataset's), and the draft config it proposes passes against the dataset it
    proposes."""
    ds = manifest(tmp_path, "ds", [-1, 0, 1, 2], n=4)
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "d", [-1, 1, 2]), "--dataset", ds, "--release", "0.5.9")
    line = fix_line(out)
    assert rc == 1 and "[-1, 0, 1, 2]" not in FIX_SET.findall(line), line
    assert "SpecForge 0.2.0's draft (LlamaForCausalLMEagle3, its fc over 3 x hidden_size) takes exactly three aux " \
           "layers" in line, line
    assert "keep the draft's ids [-1, 1, 2]" in line and FIX_AUX.findall(line) == ["-1,1,2"], line
    again = manifest(tmp_path, "again", [-1, 1, 2], n=4)
    assert run_guard("--draft-config", draft(tmp_path, "e", [-1, 1, 2]), "--dataset", again, "--release", "0.5.9")[0] == 0
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "n", None), "--dataset", ds, "--release", "0.5.9")
    line = fix_line(out)
    assert FIX_SET.findall(line) == ["[0, 1, 2]"] and FIX_AUX.findall(line) == ["0,1,2"], line
    three = manifest(tmp_path, "three", [0, 1, 2], n=4)
    assert run_guard("--draft-config", draft(tmp_path, "f", [0, 1, 2]), "--dataset", three, "--release", "0.5.9")[0] == 0


def test_release_order_is_explained(tmp_path):
    """sglang 0.5.17 reads [1, ...] k+1 and other lists as capture indices: the guard proposes
    [2, 3, 1] for HF [1, 2, 3] and says why (capture indices; 1 not first)."""
    ds = manifest(tmp_path, "ds", [0, 1, 2], n=4)  # HF [1, 2, 3]
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "d", [1, 2, 3]), "--dataset", ds, "--release", "0.5.17")
    line = fix_line(out)
    assert rc == 1 and FIX_SET.findall(line)[0] == "[2, 3, 1]", line
    assert "capture indices, i.e. HF indices [1, 2, 3]" in line and "a list that starts with 1 is read k+1" in line
    # on 0.5.9 the same layers are plain output-of-layer ids: nothing to explain
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "e", [1, 2, 3]), "--dataset", ds, "--release", "0.5.9")
    line = fix_line(out)
    assert FIX_SET.findall(line) == ["[0, 1, 2]"] and "capture indices" not in line.split(", or ")[0], line


def test_every_suggestion_is_trainable_and_passes():
    """Over datasets, drafts and releases: the fix for an eagle_config draft is first the one-line
    config change when one reads the dataset's layers and SpecForge's draft takes them (three ids,
    -1 included: SpecForge trains those from a dataset), and that config passes against the dataset
    as it is; its alternative (a draft not trained yet: re-extract to the draft's layers) passes
    too. Where no such change exists, the proposal names three distinct ids and layers the model has,
    and the config it proposes passes against the dataset it proposes (the same one, or the
    --aux-layers re-extraction)."""
    datasets = [[-1, 1, 29], [1, 29, 57], [0, 2, 30], [-1, 0, 1, 2], [0, 1, 2], [1, 2, 3], [-1, 1, 2], [2, 30, 60],
                [5, 9, 13, 20], [-1, 59]]
    drafts = [[2, 30, 58], [-1, 1, 29], [1, 29, 57], [0, 2, 30], [-1, 0, 1, 2], [1, 2, 3], [2, 3, 1], [-1, 1, 1],
              [1, 29, 61], None]
    seen = config_changes = 0
    for n in (4, 8, 61):
        for release in ("0.5.9", "0.5.17", "0.5.23"):
            for unpatched in (False, True):
                sem = guard.release_semantics(release, unpatched=unpatched)
                rule = sem.rule if sem.series else guard.conventions.SERIES_RULE.get(sem.rule, sem.rule)

                def extracted(aux):
                    out = sorted(set(guard.conventions.layer_output_ids(rule, [int(k) for k in aux.split(",")])))
                    assert all(-1 <= k < n for k in out), (n, release, ids, d, line)
                    return guard.DatasetLayers("ds", out, n, "dataset", "specforge")

                for ids in datasets:
                    if max(ids) >= n:
                        continue
                    data = guard.DatasetLayers("ds", ids, n, "dataset", "specforge")
                    for d in drafts:
                        dr = guard.Draft("d", d, True, guard.EAGLE_CONFIG if d is not None else guard.NO_IDS)
                        v = guard.check(dr, data, sem)
                        fixes = [x for x in v.lines if x.startswith("fix: ")]
                        if v.ok or not fixes:
                            continue
                        line = fixes[0]
                        sets = [json.loads(x) for x in FIX_SET.findall(line)]
                        auxes = FIX_AUX.findall(line)
                        for s in sets:
                            assert len(s) == 3 and len(set(s)) == 3, (n, release, ids, d, line)
                        if line.startswith("fix: set "):
                            # the config change: what the release reads as the dataset's layers, as it is
                            config_changes += 1
                            assert sets[0] == sem.ids_for(data.hf), (n, release, ids, d, line)
                            assert guard.check(guard.Draft("d", sets[0], True), data, sem).ok, line
                            if auxes:  # the alternative before training: the draft's own layers re-extracted
                                assert guard.check(dr, extracted(auxes[0]), sem).ok, (n, release, ids, d, line)
                            continue
                        if not sets and not auxes:
                            continue
                        seen += 1
                        proposed = dr if not sets else guard.Draft("d", sets[0], True, guard.EAGLE_CONFIG)
                        target = extracted(auxes[0]) if auxes else data
                        assert guard.check(proposed, target, sem).ok, (n, release, unpatched, ids, d, line)
    assert seen > 40 and config_changes > 100, (seen, config_changes)


def test_an_off_by_one_draft_is_fixed_by_its_config(tmp_path):
    """Issue 43 item 15: a draft trained on the toy's [-1, 1, 2] (as tools/acceptance.py trains its
    drafts) whose config says [0, 2, 3] is served one layer deeper on 0.5.9. The fix is the one-line
    config change back to [-1, 1, 2] (was: re-extract the data), no line says SpecForge cannot train
    [-1, 1, 2], and that config passes against the same dataset."""
    from eaglepatch.acceptance.pipeline import Run

    ids = Run.readings_ids({"num_hidden_layers": 4})
    assert ids == [-1, 1, 2]
    ds = manifest(tmp_path, "ds", ids, n=4, fmt="specforge")
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "off", [0, 2, 3]), "--dataset", ds, "--release", "0.5.9")
    line = fix_line(out)
    assert rc == 1 and line.startswith("fix: set eagle_aux_hidden_state_layer_ids to [-1, 1, 2] in the draft config"), line
    assert "cannot train" not in out and "non-negative ids;" not in out, out
    rc, out, _ = run_guard("--draft-config", draft(tmp_path, "fixed", json.loads(FIX_SET.findall(line)[0])), "--dataset", ds,
                           "--release", "0.5.9")
    assert rc == 0 and "\nwarning:" not in out, out


def test_a_target_models_config_is_refused(tmp_path):
    """The target's own config.json (no eagle_config, no draft architecture) is no draft config: one
    line saying so and what a draft config holds, exit 2. A SpecForge template without eagle_config
    (architecture LlamaForCausalLMEagle3: the servers' defaults) is still read."""
    ds = manifest(tmp_path, "ds", [1, 29, 57])
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                                    "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280}))
    rc, out, err = run_guard("--draft-config", target, "--dataset", ds)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert "looks like a target model's config (architectures ['DeepseekV3ForCausalLM'], 61 decoder layers)" in lines[0]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in lines[0] and "LlamaForCausalLMEagle3" in lines[0]
    from eaglepatch.smoke.tinyconfig import draft_config

    template = tmp_path / "template.json"
    template.write_text(json.dumps(draft_config(None)))
    rc, out, err = run_guard("--draft-config", template, "--dataset", ds)
    assert rc == 0 and "no layer ids: every server captures its defaults" in out, out + err


@pytest.mark.parametrize("extra,want", [([], 1), (["--json"], 1), (["--release", "0.5.17"], 0)])
def test_a_closed_stdout_ends_quietly(tmp_path, extra, want):
    """guard.py ... | head -1: the reader is gone before the verdict is printed. The exit code is the
    check's (1 mismatch, 0 match), and nothing is said on stderr (was: exit 2, 'Broken pipe; check
    that path')."""
    ds = manifest(tmp_path, "ds", [-1, 1, 29])
    d = draft(tmp_path, "d", [2, 30, 58] if want else [-1, 1, 29])
    r, w = os.pipe()
    os.close(r)  # no reader: every write fails with EPIPE
    try:
        p = subprocess.run([sys.executable, str(GUARD), "--draft-config", str(d), "--dataset", str(ds), *extra],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (want, ""), p.stderr


# ---- issue 43 items 3 and 17: the release judged for, said; a manifest's release and ids checked ----------

def test_the_release_judged_for_is_printed(tmp_path):
    """The first line names the release the verdict was judged for and why: the dataset's manifest
    (the default), --release (which wins, and says which release dumped the data), or, when nothing
    is recorded, the newest series, said so. JSON carries the same."""
    from eaglepatch.series import available_series

    newest = list(available_series())[-1]
    ds = manifest(tmp_path, "ds", [-1, 1, 2], n=4, fmt="specforge", release="0.5.9")
    off = draft(tmp_path, "off", [0, 2, 3])
    rc, out, _ = run_guard("--draft-config", off, "--dataset", ds)
    assert rc == 1 and out.splitlines()[0] == ("release: sglang 0.5.9 with the series (the release that dumped the "
                                               "dataset, as its manifest records)"), out
    rc, out, _ = run_guard("--draft-config", off, "--dataset", ds, "--release", "0.5.17")
    assert rc == 0 and out.splitlines()[0].startswith("release: sglang 0.5.17 with the series (--release, not the "
                                                      "release that dumped the dataset (sglang 0.5.9)"), out
    rc, out, _ = run_guard("--draft-config", off, "--dataset", ds, "--release", "0.5.9", "--unpatched")
    assert out.splitlines()[0] == "release: sglang 0.5.9 unpatched (--release; the dataset was dumped by it too)", out
    rc, out, _ = run_guard("--draft-config", off, "--dataset", ds, "--json")
    j = json.loads(out)
    assert (j["release"], j["release_from"]) == ("0.5.9", "the release that dumped the dataset, as its manifest "
                                                          "records"), j
    bare = manifest(tmp_path, "bare", [-1, 1, 2], n=4)
    rc, out, _ = run_guard("--draft-config", off, "--dataset", bare)
    assert out.splitlines()[0] == (f"release: sglang {newest} with the series (the newest series: the dataset "
                                   f"records no release; pass --release R for the release that serves the draft)"), out


@pytest.mark.parametrize("release,says", [
    ("../../etc", "records sglang_release '../../etc', which is no release number"),
    ("", "records sglang_release '', which is no release number"),
    ("0.5.12", "the dataset was dumped by sglang 0.5.12, and no series here says how 0.5.12 reads draft ids"),
])
def test_a_manifest_release_without_a_series_is_refused(tmp_path, release, says):
    """A release the manifest records that is no release number, or that no series here reads: one
    line naming it and --release, exit 2 (was: judged for the newest series, without a word)."""
    ds = manifest(tmp_path, "ds", [-1, 1, 2], n=4, release=release)
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d", [-1, 1, 2]), "--dataset", ds)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and says in lines[0] and "--release" in lines[0], err
    # --release says which release serves the draft: the recorded one is then only mentioned
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "e", [-1, 1, 2]), "--dataset", ds, "--release", "0.5.9")
    assert rc == 0 and "not the release that dumped the dataset" in out.splitlines()[0], out + err


@pytest.mark.parametrize("ids,n,says", [
    ([-2, 1, 2], 4, "[-2] name no layer of a 4-layer model"),
    ([1, 2, 4], 4, "[4] name no layer of a 4-layer model"),
    ([-1, 1, 99], 61, "[99] name no layer of a 61-layer model"),
    ([1, 1, 2], 4, "name a layer twice"),
])
def test_dataset_ids_out_of_range_are_refused(tmp_path, ids, n, says):
    """A manifest (or a dump file) whose layer ids name no layer of its model, or one twice: one line,
    exit 2 (was: compared as if they were layers, and a draft 'matched' them)."""
    ds = manifest(tmp_path, "ds", ids, n=n)
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "d", ids), "--dataset", ds, "--release", "0.5.9")
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and says in lines[0] and "eagle3_layer_ids" in lines[0], err
    pytest.importorskip("safetensors")
    import numpy as np
    from safetensors.numpy import save_file

    dump = tmp_path / "x.safetensors"
    save_file({"input_ids": np.zeros(2, dtype=np.int64)}, str(dump),
              metadata={"eagle3_layer_ids": json.dumps(ids), "num_hidden_layers": str(n)})
    rc, out, err = run_guard("--draft-config", draft(tmp_path, "e", ids), "--dataset", dump, "--release", "0.5.9")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and says in lines[0] and str(dump) in lines[0], err
