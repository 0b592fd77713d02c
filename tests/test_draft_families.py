"""tools/guard.py and tools/check_draft.py on DFlash and DSpark drafts (issue 44 item 3).

The drafts' configs are written as SpecForge 0.2.0 writes them (its repo configs for our targets:
Kimi-K2.7 DFlash reading [1, 12, 24, 35, 47, 58] of 61 layers, block 8; Kimi-K3 DSpark reading
[7, 23, 51, 67, 83] of 93, block 7; DeepSeek-V4-Flash DSpark reading [40, 41, 42] of 43) and as
z-lab's ``dflash`` package reads them (ids at the top level, or none: the default). The datasets are
manifests in the shape tools/extract.py writes for its dflash/dspark formats (the stored layers as
``eagle3_layer_ids``/``hf_hidden_state_indices``, and a ``draft`` block with the family, its ids and
the model file they were read on).

The truth every verdict is checked against is each release's own code, never the table under test:
``sglang``'s own config parsing and id resolution (``_resolve_dflash_aux_hidden_state`` with
``parse_dflash_draft_config``/``parse_dspark_draft_config`` and ``build_target_layer_ids``, taken from the
released files with ``ast`` and run on the configs) and its own dispatch and setters
(``test_id_conventions.release_feeds``: what the layers the release feeds that draft are).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, one_line_error, run_tool

sys.path.insert(0, str(REPO / "src"))

from eaglepatch import conventions, fetch, guard  # noqa: E402
from test_id_conventions import PACKAGE, module_defs, release_feeds  # noqa: E402

SERVING = ["0.5.17", "0.5.23"]  # the releases with a DFlash/DSpark worker

# ---- the drafts, as their trainers write them -----------------------------------------------------------

K27_DFLASH = {  # SpecForge configs/kimi-k2.7-code-dflash.json (the fields that matter here)
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 8,
    "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]}, "hidden_size": 7168,
    "head_dim": 128, "intermediate_size": 18432, "layer_types": ["full_attention"] * 6, "mask_token_id": 163838,
    "model_type": "qwen3", "num_attention_heads": 64, "num_hidden_layers": 6, "num_key_value_heads": 8,
    "num_target_layers": 61, "rms_norm_eps": 1e-05, "vocab_size": 163840}
K3_DSPARK = {  # SpecForge configs/kimi-k3-dspark.json
    "architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"}, "block_size": 7,
    "dflash_config": {"attention_mode": "gqa", "confidence_head_alpha": 1.0, "confidence_head_with_markov": True,
                      "enable_confidence_head": True, "markov_head_type": "vanilla", "markov_rank": 256,
                      "mask_token_id": 163824, "projector_type": "dspark", "target_layer_ids": [7, 23, 51, 67, 83]},
    "hidden_size": 7168, "head_dim": 64, "intermediate_size": 14336, "model_type": "qwen3",
    "num_attention_heads": 64, "num_hidden_layers": 5, "num_key_value_heads": 16, "num_target_layers": 93,
    "vocab_size": 163840}
V4_DSPARK = {  # SpecForge configs/deepseek-v4-flash-dspark-official.json
    "architectures": ["DSparkV4DraftModel"], "model_type": "deepseek_v4_dspark_draft", "block_size": 5,
    "dflash_config": {"markov_head_type": "vanilla", "markov_rank": 256, "mask_token_id": 128799,
                      "projector_type": "dspark_v4", "target_layer_ids": [40, 41, 42]},
    "hidden_size": 4096, "num_hidden_layers": 3, "num_target_layers": 43, "vocab_size": 129280}
ZLAB_TOP = {  # z-lab's dflash reads dflash_config first, then the top level (its _draft_value)
    "architectures": ["DFlashDraftModel"], "block_size": 16, "mask_token_id": 163838, "target_layer_ids": [2, 20, 40],
    "hidden_size": 7168, "num_hidden_layers": 3, "num_target_layers": 61, "model_type": "qwen3"}
ZLAB_DEFAULT = {  # no ids: every reader builds them (sglang from the runtime target, the trainers from num_target_layers)
    "architectures": ["DFlashDraftModel"], "block_size": 16, "dflash_config": {"mask_token_id": 163838},
    "hidden_size": 7168, "num_hidden_layers": 5, "num_target_layers": 61, "model_type": "qwen3"}
DSPARK_PREFIXED = dict(K3_DSPARK, dspark_target_layer_ids=[10, 30, 50, 70, 90])  # DSpark's own key wins
DSPARK_OWN_SECTION = dict(  # markov fields where sglang 0.5.17 reads them (dspark_config): it starts on 0.5.17 too
    {k: v for k, v in K3_DSPARK.items() if k != "dflash_config"},
    dflash_config={"mask_token_id": 163824, "target_layer_ids": [7, 23, 51, 67, 83]},
    dspark_config={"markov_rank": 256, "markov_head_type": "vanilla"})
SHAPES = {"k27-dflash": (K27_DFLASH, 61), "k3-dspark": (K3_DSPARK, 93), "v4-dspark": (V4_DSPARK, 43),
          "zlab-top": (ZLAB_TOP, 61), "zlab-default": (ZLAB_DEFAULT, 61), "dspark-prefixed": (DSPARK_PREFIXED, 93),
          "dspark-own-section": (DSPARK_OWN_SECTION, 93)}
ARCH = {"deepseek_v2": "DeepseekV3ForCausalLM", "kimi_k25": "KimiK25ForConditionalGeneration",
        "kimi_k3": "KimiK3ForConditionalGeneration", "deepseek_v4": "DeepseekV4ForCausalLM",
        "deepseek_v41": "DeepseekV41ForCausalLM"}


def write_draft(tmp: Path, name: str, cfg: dict) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def write_dataset(tmp: Path, name: str, family: str, hf: list, n: int, cell: str, release: str,
                  draft_ids=None, architecture=True) -> Path:
    """A dataset manifest in the shape tools/extract.py writes for --format dflash|dspark."""
    d = tmp / name
    d.mkdir()
    m = {"format": "eaglepatch-hidden-states/2", "dataset_format": family, "samples": 3,
         "eagle3_layer_ids": [h - 1 for h in hf], "hf_hidden_state_indices": list(hf),
         "model": {"num_hidden_layers": n, "hidden_size": 7168,
                   **({"architecture": ARCH[cell]} if architecture else {})},
         "sglang_release": release, "final": "post_norm" if family == "dspark" else None,
         "draft": {"family": family, "target_layer_ids": draft_ids, "hf_hidden_state_indices": list(hf),
                   "reading": {"sglang_release": release, "model_file": cell}}}
    (d / "manifest.json").write_text(json.dumps(m))
    return d


# ---- sglang's own config reading, run on the configs ------------------------------------------------------

def sglang_resolves(release: str, family: str, cfg: dict, n: int, monkeypatch):
    """The ids sglang ``release`` captures for a draft of config ``cfg`` served by
    --speculative-algorithm ``family`` with an ``n``-layer target: its own
    ``_resolve_dflash_aux_hidden_state`` (and the parsers it imports), or the text of what it raises."""
    from transformers import PretrainedConfig

    root = fetch.unpacked_release(release, quiet=True)
    spec = root / PACKAGE / "srt/speculative"
    dflash = module_defs(spec / "dflash_utils.py", ["parse_dflash_draft_config", "build_target_layer_ids"])
    dspark = module_defs(spec / "dspark_components/dspark_config.py", ["parse_dspark_draft_config"],
                         {"parse_dflash_draft_config": dflash["parse_dflash_draft_config"]})
    for name, ns in (("dflash_utils", dflash), ("dspark_components.dspark_config", dspark)):
        monkeypatch.setitem(sys.modules, f"sglang.srt.speculative.{name}", SimpleNamespace(**ns))
    hf_config = PretrainedConfig(**cfg)
    draft_path = SimpleNamespace(speculative_draft_model_path="draft", speculative_draft_model_revision=None)
    env = {"__name__": "spec_aux_hidden_state",
           "ModelConfig": SimpleNamespace(from_server_args=lambda *a, **k: SimpleNamespace(hf_config=hf_config)),
           "get_spec": lambda: draft_path, "is_deepseek_v4": lambda c: False}
    resolve = module_defs(root / PACKAGE / "srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
                          ["_resolve_dflash_aux_hidden_state"], env)["_resolve_dflash_aux_hidden_state"]
    out = SimpleNamespace()
    target = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=n),
                             hf_config=SimpleNamespace(model_type="deepseek_v3", architectures=[ARCH["deepseek_v2"]]))
    algo = SimpleNamespace(is_dflash_family=lambda: True, is_dspark=lambda: family == "dspark")
    try:
        resolve(config=out, server_args=draft_path, model_config=target, spec_algorithm=algo, is_draft_worker=False)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return list(out.dflash_target_layer_ids)


_made = itertools.count()


def guard_resolves(tmp: Path, family: str, cfg: dict, n: int):
    d = read(tmp, f"g-{family}-{next(_made)}", cfg, family)
    ids, how, problems = guard.block_ids(d, n)
    refused = [p for p in problems if p.startswith("sglang refuses to start")]
    return refused[0] if refused else ids


def read(tmp: Path, name: str, cfg: dict, family: str | None = None) -> guard.Draft:
    return guard.read_draft(write_draft(tmp, name, cfg), family)


@pytest.mark.parametrize("release", SERVING)
def test_ids_are_read_as_sglang_reads_them(release, tmp_path, monkeypatch):
    """guard's ids for each config shape (SpecForge's, z-lab's, DSpark's own key, none at all) are the
    ones sglang's own resolution captures, on each serving release; where sglang refuses the ids at
    start (out of range), guard says it refuses. A DSpark config sglang refuses for another reason
    (0.5.17 reads markov_rank only from dspark_config or the top level, not from dflash_config where
    SpecForge writes it) is listed: guard checks layers, not whether the server starts."""
    out_of_range = dict(K27_DFLASH, dflash_config={"target_layer_ids": [1, 12, 61]})
    cases = [(f, name, cfg, n) for name, (cfg, n) in SHAPES.items()
             for f in (["dspark"] if "dspark" in name else ["dflash"])]
    cases += [("dflash", "out-of-range", out_of_range, 61), ("dflash", "k3-as-dflash", K3_DSPARK, 93),
              ("dflash", "zlab-default-small", ZLAB_DEFAULT, 6), ("dflash", "k27-on-more-layers", K27_DFLASH, 93)]
    refused_for_markov, compared = [], 0
    for family, name, cfg, n in cases:
        want = sglang_resolves(release, family, cfg, n, monkeypatch)
        got = guard_resolves(tmp_path, family, cfg, n)
        if isinstance(want, str) and "markov" in want:
            refused_for_markov.append(name)
            continue
        if isinstance(want, str):
            assert isinstance(got, str) and got.startswith("sglang refuses to start"), (name, want, got)
        else:
            assert got == want, (release, name, want, got)
            compared += 1
    assert compared >= 7
    assert refused_for_markov == (["k3-dspark", "v4-dspark", "dspark-prefixed"] if release == "0.5.17" else [])
    # the default sglang picks is its own build_target_layer_ids, over the runtime target's layers
    assert sglang_resolves(release, "dflash", ZLAB_DEFAULT, 61, monkeypatch) == \
        conventions.build_target_layer_ids(61, 5) == [1, 15, 30, 44, 58]
    assert conventions.build_target_layer_ids(61, 6) == K27_DFLASH["dflash_config"]["target_layer_ids"]


def test_the_default_matches_specforge_s():
    """SpecForge 0.2.0's build_target_layer_ids (the trainer's default for a config without ids) is the
    formula guard uses for sglang's; they differ only in the layer count they are given."""
    from specforge.modeling.draft.dflash import build_target_layer_ids

    for n in (4, 6, 43, 61, 93):
        for k in (1, 2, 3, 5, 6, 8):
            assert conventions.build_target_layer_ids(n, k) == build_target_layer_ids(n, k), (n, k)


# ---- the verdict: right layers pass, layers shifted by one fail, on each release's own source --------------

def _cases():
    out = []
    for release in SERVING:
        for family, cfg, n in (("dflash", K27_DFLASH, 61), ("dspark", K3_DSPARK, 93)):
            for cell in conventions.CELLS:
                out.append((release, family, cell, cfg, n))
    return out


def test_shifted_layers_fail_and_right_ones_pass_on_each_release(tmp_path):
    """For each serving release, family (the Kimi-K2.7 DFlash and Kimi-K3 DSpark layouts) and model
    file: the layers the release's own setters feed the draft (``release_feeds``) make a dataset the
    guard passes; the same layers shifted one deeper or one shallower fail it, naming the mismatch; a
    model file the release serves no such draft on is NOT SERVED. None of the truth comes from the
    table under test."""
    checked = {"pass": 0, "shifted": 0, "not served": 0}
    for release, family, cell, cfg, n in _cases():
        root = fetch.unpacked_release(release, quiet=True)
        draft = read(tmp_path, f"d-{release}-{family}-{cell}", cfg)
        assert draft.family == family
        ids = draft.layer_ids
        truth = release_feeds(root, family, cell, ids, n)
        if isinstance(truth, str):
            data = guard.DatasetLayers("ds", [k for k in ids], n)
            v = guard.check_block(draft, data, release, cell)
            assert not v.ok and v.lines[2].startswith("NOT SERVED (SGLang): sglang"), (release, family, cell, v.lines)
            checked["not served"] += 1
            continue
        ok = guard.check_block(draft, guard.DatasetLayers("ds", [h - 1 for h in truth], n), release, cell)
        assert ok.ok, (release, family, cell, ok.lines)
        assert ok.served_hf == truth
        checked["pass"] += 1
        for d in (1, -1):
            shifted = [h + d for h in truth]
            if not all(0 <= h <= n for h in shifted):
                continue
            v = guard.check_block(draft, guard.DatasetLayers("ds", [h - 1 for h in shifted], n), release, cell)
            assert not v.ok, (release, family, cell, d)
            assert "MISMATCH (SGLang): the draft would be served other hidden states than it was trained on" in v.lines
            fix = next(x for x in v.lines if x.startswith("fix: "))
            want = [k + d for k in ids] if conventions.draft_rule(release, family, cell) == "plus_one" else None
            assert want is None or f"to {want} in the draft config" in fix, fix
            checked["shifted"] += 1
    assert checked["pass"] >= 10 and checked["shifted"] >= 20 and checked["not served"] >= 5, checked


def test_the_kimi_layouts_through_the_command_line(tmp_path):
    """The two layouts of the issue through tools/guard.py, datasets as tools/extract.py writes them:
    Kimi-K2.7 DFlash on kimi_k25.py (sglang 0.5.17) and Kimi-K3 DSpark on kimi_k3.py (sglang 0.5.23).
    The right dataset exits 0 and its table shows every release and model file; the shifted one exits
    1 with both lists and the config that reads the dataset's layers."""
    k27 = write_draft(tmp_path, "k27", K27_DFLASH)
    right = write_dataset(tmp_path, "k27-right", "dflash", [2, 13, 25, 36, 48, 59], 61, "kimi_k25", "0.5.17",
                          [1, 12, 24, 35, 47, 58])
    r = run_tool("guard", "--draft-config", k27, "--dataset", right)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "release: sglang 0.5.17 with the series (the release that dumped the dataset, as its manifest records)"
    assert lines[1].startswith("model file: kimi_k25.py")
    assert "OK (SGLang): the draft is served the hidden states it was trained on" in lines
    assert any(x.startswith(" *sglang 0.5.17:") and "deepseek_v2.py, kimi_k25.py: [2, 13, 25, 36, 48, 59]: the dataset "
               "holds them, as trained" in x for x in lines), r.stdout
    assert any("sglang 0.5.9:" in x and "not served" in x for x in lines), r.stdout
    shifted = write_dataset(tmp_path, "k27-shifted", "dflash", [1, 12, 24, 35, 47, 58], 61, "kimi_k25", "0.5.17")
    r = run_tool("guard", "--draft-config", k27, "--dataset", shifted)
    assert r.returncode == 1 and "MISMATCH (SGLang)" in r.stdout, r.stdout + r.stderr
    assert "fix: set dflash_config.target_layer_ids to [0, 11, 23, 34, 46, 57] in the draft config" in r.stdout

    k3 = write_draft(tmp_path, "k3", K3_DSPARK)
    hf = [8, 24, 52, 68, 84]
    right = write_dataset(tmp_path, "k3-right", "dspark", hf, 93, "kimi_k3", "0.5.23", [7, 23, 51, 67, 83])
    r = run_tool("guard", "--draft-config", k3, "--dataset", right, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["family"], doc["model_file"], doc["served_hf_indices"]) == ("dspark", "kimi_k3", hf)
    assert {(x["release"], x["model_file"]): x["served_hf"] for x in doc["readings"]}[("0.5.23", "deepseek_v41")] \
        == [7, 23, 51, 67, 83]  # DeepSeek-V4.1's path reads inputs: the same ids name other states there
    for d in (1, -1):
        bad = write_dataset(tmp_path, f"k3-{d}", "dspark", [h + d for h in hf], 93, "kimi_k3", "0.5.23")
        r = run_tool("guard", "--draft-config", k3, "--dataset", bad)
        assert r.returncode == 1 and "MISMATCH (SGLang)" in r.stdout, r.stdout
        assert "not checked: block_size 7, mask_token_id 163824" in r.stdout


def test_refusals_are_one_line(tmp_path):
    """An ambiguous config (fields of two families), an unknown model file or release, and a DFlash
    dataset that records no target: one line each, exit 2, naming the fix. A release or model file
    that serves no such draft is a verdict (exit 1, NOT SERVED), not a usage error."""
    ds = write_dataset(tmp_path, "ds", "dflash", [2, 13, 25, 36, 48, 59], 61, "kimi_k25", "0.5.17")
    both = write_draft(tmp_path, "both", dict(K27_DFLASH, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}))
    r = run_tool("guard", "--draft-config", both, "--dataset", ds)
    line = one_line_error(r)
    assert r.returncode == 2 and "reads as more than one draft family" in line and "pass --family" in line, line
    r = run_tool("guard", "--draft-config", both, "--dataset", ds, "--family", "dflash")
    assert r.returncode == 0, r.stdout + r.stderr
    dfl_arch_dspark_fields = write_draft(tmp_path, "mixed", dict(K27_DFLASH, dspark_target_layer_ids=[1, 2]))
    assert "pass --family" in one_line_error(run_tool("guard", "--draft-config", dfl_arch_dspark_fields, "--dataset", ds))
    k27 = write_draft(tmp_path, "k27", K27_DFLASH)
    for args, says in ((["--model-file", "llama"], "--model-file 'llama' is no model file"),
                       (["--release", "0.5.11"], "no layer-id rule is declared for sglang 0.5.11"),
                       (["--sglang", tmp_path], "--sglang reads a tree's EAGLE-3 reading")):
        r = run_tool("guard", "--draft-config", k27, "--dataset", ds, *args)
        assert r.returncode == 2 and says in one_line_error(r), (args, r.stderr)
    llama = tmp_path / "llama"
    llama.mkdir()
    m = json.loads((ds / "manifest.json").read_text())
    m["model"]["architecture"] = "LlamaForCausalLM"
    (llama / "manifest.json").write_text(json.dumps(m))
    r = run_tool("guard", "--draft-config", k27, "--dataset", llama)
    assert r.returncode == 2 and "no covered sglang model file serves the architecture 'LlamaForCausalLM'" in \
        one_line_error(r)
    bare = write_dataset(tmp_path, "bare", "dflash", [2, 13, 25, 36, 48, 59], 61, "kimi_k25", "0.5.17",
                         architecture=False)
    m = json.loads((bare / "manifest.json").read_text())
    del m["draft"]
    (bare / "manifest.json").write_text(json.dumps(m))
    r = run_tool("guard", "--draft-config", k27, "--dataset", bare)
    assert r.returncode == 2 and "pass --model-file" in one_line_error(r)
    assert run_tool("guard", "--draft-config", k27, "--dataset", bare, "--model-file", "kimi_k25").returncode == 0
    # verdicts: no DFlash worker in 0.5.9; no DFlash setter on deepseek_v4.py; no EAGLE-3 setter on kimi_k3.py
    r = run_tool("guard", "--draft-config", k27, "--dataset", ds, "--release", "0.5.9")
    assert r.returncode == 1 and "NOT SERVED (SGLang): sglang 0.5.9 serves no DFlash draft" in r.stdout, r.stdout
    r = run_tool("guard", "--draft-config", k27, "--dataset", ds, "--model-file", "deepseek_v4")
    assert r.returncode == 1 and "serves no DFlash draft on deepseek_v4.py" in r.stdout, r.stdout
    eagle = write_draft(tmp_path, "eagle", {"architectures": ["LlamaForCausalLMEagle3"],
                                            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 12, 24]}})
    r = run_tool("guard", "--draft-config", eagle, "--dataset", ds, "--model-file", "kimi_k3")
    assert r.returncode == 1 and "NOT SERVED (SGLang): sglang serves no EAGLE-3 draft on kimi_k3.py" in r.stdout


# ---- check_draft: the layer verdict, said to be the only check ---------------------------------------------

def _kimi_target(tmp: Path, cls: str, n: int) -> Path:
    """A target directory as Kimi's checkpoints hold their config (a text_config inside); no weights:
    check_draft's layer verdict reads only the config."""
    d = tmp / f"target-{cls}-{n}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": [cls], "model_type": "kimi_k25",
        "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": n,
                        "hidden_size": 7168, "vocab_size": 163840}}))
    return d


def test_check_draft_gives_block_drafts_the_layer_verdict(tmp_path):
    """tools/check_draft.py on the Kimi-K2.7 DFlash and Kimi-K3 DSpark layouts: the release judged as
    for EAGLE-3 drafts (the dataset's), the model file from --target's architectures, exit 0 on the
    right layers and 1 on layers shifted by one, the report naming what is not checked (the accept
    length); the measured part's flags refused in one line, nothing written."""
    k25 = _kimi_target(tmp_path, "KimiK25ForConditionalGeneration", 61)
    k27 = write_draft(tmp_path, "k27", K27_DFLASH)
    right = write_dataset(tmp_path, "right", "dflash", [2, 13, 25, 36, 48, 59], 61, "kimi_k25", "0.5.17")
    shifted = write_dataset(tmp_path, "shifted", "dflash", [1, 12, 24, 35, 47, 58], 61, "kimi_k25", "0.5.17")
    r = run_tool("check_draft", "--target", k25, "--draft", k27, "--data", right, "--out", tmp_path / "ok.json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "ok.json").read_text())
    assert rep["release"]["release"] == "0.5.17" and rep["model_file"] == "kimi_k25" and rep["guard"]["ok"]
    assert rep["guard"]["served_hf"] == [2, 13, 25, 36, 48, 59] and rep["exit"] == 0
    assert "the accept length" in rep["not_checked"] and "predicted" not in rep and rep["png"]["path"] is None
    assert r.stdout.splitlines()[0].startswith("release: sglang 0.5.17 with the series")
    assert r.stderr.strip().splitlines()[-1].startswith("passed: guard: the DFlash draft's config reads the data's "
                                                        "layers on sglang 0.5.17 with the series on kimi_k25.py")
    r = run_tool("check_draft", "--target", k25, "--draft", k27, "--data", shifted, "--out", tmp_path / "bad.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("failed: guard: the draft's config does not read the data's "
                                                        "layers (sglang 0.5.17 with the series on kimi_k25.py")
    assert json.loads((tmp_path / "bad.json").read_text())["guard"]["ok"] is False

    k3t = _kimi_target(tmp_path, "KimiK3ForConditionalGeneration", 93)
    k3 = write_draft(tmp_path, "k3", K3_DSPARK)
    ds = write_dataset(tmp_path, "k3ds", "dspark", [8, 24, 52, 68, 84], 93, "kimi_k3", "0.5.23")
    r = run_tool("check_draft", "--target", k3t, "--draft", k3, "--data", ds, "--out", tmp_path / "k3.json")
    assert r.returncode == 0 and json.loads((tmp_path / "k3.json").read_text())["model_file"] == "kimi_k3", r.stderr
    r = run_tool("check_draft", "--target", k3t, "--draft", k3, "--data", ds, "--out", tmp_path / "k3-17.json",
                 "--release", "0.5.17")
    assert r.returncode == 0 and "release: sglang 0.5.17 with the series (--release, not the release that dumped" \
        in r.stdout, r.stdout + r.stderr
    # the measured part is EAGLE-3's: its flags are refused, nothing written
    (tmp_path / "states").mkdir()
    r = run_tool("check_draft", "--target", k25, "--draft", k27, "--data", right, "--out", tmp_path / "m.json",
                 "--states", tmp_path / "states")
    assert r.returncode == 2 and "--states: the measured check (the replay, serving) is EAGLE-3-only" in one_line_error(r)
    assert not (tmp_path / "m.json").exists()
    # a target whose model file is not the one the dataset was dumped from
    r = run_tool("check_draft", "--target", _kimi_target(tmp_path, "KimiK3ForConditionalGeneration", 61), "--draft",
                 k27, "--data", right, "--out", tmp_path / "x.json")
    assert r.returncode == 2 and "pass the target the dataset was dumped from" in one_line_error(r)
