"""Existing DFlash and DSpark drafts keep their meaning with the series applied (issue 44 item 4):
through each release's own target ModelRunner and its own ``configure_aux_hidden_state_capture``
(which calls the model's ``set_dflash_layers_to_capture``; DSpark falls back to it on
deepseek_v2.py), what the draft receives (``LogitsProcessorOutput.hidden_states`` of a prefill) is
bit for bit what the release unpatched feeds it, with the dump off and with the dump on, and it is
the HF residual stream at the output of each named layer (HF index k + 1), not at its input.

Each tree runs ``eaglepatch/smoke/_families.py`` in the release's cached CPU environment: the
unpatched tree is the release wheel with only the test-only smoke patch (torch_native attention
routed to MLA on CPU, in both trees), the patched one has the series too. Before the series
followed the release's DFlash setter, a dump beside a DFlash or DSpark draft was refused at launch
(and without the refusal it would have fed the draft the dump's layers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cpuenv  # noqa: E402
from eaglepatch.fetch import unpacked_release  # noqa: E402
from eaglepatch.series import available_series  # noqa: E402
from eaglepatch.smoke import HERE as SMOKE_DIR, ensure_checkpoints, stubs_for, worker_env  # noqa: E402
from eaglepatch.smoke.tree import patched_tree  # noqa: E402

SERIES = available_series()
RELEASES = sorted(r for r in SERIES if r != "0.5.9")  # 0.5.9 serves neither family
IDS = "0,2"  # layers whose outputs (HF 1 and 3) the release captures unpatched: the two can be compared
UNPATCHED = ["dflash:" + IDS, "dspark:" + IDS]
PATCHED = ["dflash:" + IDS, "dflash:%s:dump" % IDS, "dspark:%s:dump" % IDS]
LAST = "dflash:1,3"  # id N-1 (the last layer's output, before the final norm): upstream's loop never reaches it
TOL = 1e-4


def _run(release: str, tree: Path, work: Path, specs: list) -> tuple:
    import torch

    req = cpuenv.requirements_for(release)
    py = cpuenv.ensure_env(req)
    stubs = stubs_for(req, work)
    ckpt = ensure_checkpoints(py, work, req, stubs)["deepseek_v3"]
    out = work / "out"
    p = subprocess.run([str(py), str(SMOKE_DIR / "_families.py"), str(ckpt), str(work), str(out), *specs],
                       env=worker_env(tree, stubs), capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    records = json.loads((out / "records.json").read_text())
    tensors = [torch.load(out / f"{n}.pt") for n in range(len(specs))]
    return {r["spec"]: (r, t) for r, t in zip(records, tensors)}


@pytest.mark.parametrize("release", RELEASES)
def test_dflash_and_dspark_drafts_are_fed_what_unpatched_sglang_feeds_them(release, tmp_path):
    import torch

    src = unpacked_release(release, quiet=True)
    plain = _run(release, patched_tree(src, SERIES[release], tmp_path / "plain", product=False), tmp_path / "w-plain",
                 UNPATCHED)
    ours = _run(release, patched_tree(src, SERIES[release], tmp_path / "ours"), tmp_path / "w-ours", PATCHED + [LAST])
    for spec, (rec, _) in {**plain, **ours}.items():
        # the worker can tell the right layers from their neighbours (with the series, also the last
        # layer's output a DFlash id N-1 names: upstream captures nothing there)
        assert rec["max_diff_right"] < TOL < 0.1 < rec["min_diff_shifted"], rec
    for family in ("dflash", "dspark"):
        base_rec, base = plain[f"{family}:{IDS}"]
        assert base_rec["layers_to_capture"] == [int(k) + 1 for k in IDS.split(",")], base_rec
        for spec in [s for s in PATCHED if s.startswith(family)]:
            rec, got = ours[spec]
            assert torch.equal(got["hidden_states"], base["hidden_states"]), (
                f"{spec}: the draft's rows differ from unpatched sglang {release}'s (max "
                f"{(got['hidden_states'] - base['hidden_states']).abs().max().item():.3g})")
            if rec["dump"]:
                assert rec["files_written"] == rec["prompts"], rec  # each prompt's file, beside the draft
            else:
                assert rec["layers_to_capture"] == base_rec["layers_to_capture"], rec
