"""tools/check_draft.py on the CPU toy: the prediction and diagnosis path (replay; no server loads
a draft on CPU: sglang 0.5.9 runs no EAGLE-3 decoding there).

The inputs are made as a user makes them: the toy target of tests/data/acceptance-toy-target
(the acceptance test's), greedy conversations from the patched sglang 0.5.9 CPU server with the
dump on for every layer, datasets extracted by tools/extract.py (specforge format), the held-out
conversations' dump files kept (every layer and the post-norm final state: the states the
diagnosis replays), and EAGLE-3 drafts trained with SpecForge 0.2.0's own classes
(``acceptance.train.DraftRun``), 150 steps each:

- ``correct``: trained on HF indices [0, 2, 3] (ids [-1, 1, 2]), config as trained;
- ``shifted``: the same weights, its config's ids shifted to [0, 2, 3] (HF [1, 3, 4]);
- ``postnorm``: trained on [0, 2, final]: its last slot held the post-norm final state where its
  config (ids [-1, 1, 3], HF [0, 2, 4]) and the series feed the pre-norm output of layer 3; its
  held-out data is the [0, 2, 4] extraction with the same mistake (the last slot replaced by the
  final state), as the pipeline that trained it would have written it.

Each check runs the real command line. Nothing is stubbed: every figure is the drafts' own
forward over the extracted data.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOY_TARGET = REPO / "tests" / "data" / "acceptance-toy-target"
TOOL = REPO / "tools" / "check_draft.py"
# the acceptance test's toy settings (tests/test_acceptance.py TOY_SETTINGS): the language the toy
# target was trained on, and draft settings under which a one-layer draft learns the lookup
TOY_SETTINGS = dict(language="copy", symbols=16, alphabet=32, answer_len=12, lead=0, train_prompts=256,
                    heldout_prompts=32, gate_prompts=16, draft_fc_norm="true", draft_batch=64, draft_lr=2e-3,
                    draft_max_steps=150)
CORRECT_HF, LAST_HF = [0, 2, 3], [0, 2, 4]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_final_last(src: Path, dest: Path) -> None:
    """Copy the specforge dataset ``src`` to ``dest`` with each sample's last aux slot replaced by its
    post-norm final state (``hidden_state``): what a trainer that took the post-norm state for
    'the last layer' writes."""
    import shutil

    import torch

    shutil.copytree(src, dest)
    for p in sorted(dest.rglob("*.ckpt")):
        d = torch.load(p, map_location="cpu", weights_only=True)
        H = d["hidden_state"].shape[-1]
        d["aux_hidden_state"][..., -H:] = d["hidden_state"]
        torch.save(d, p)


def build(work: Path, say=print) -> dict:
    """The toy inputs under ``work`` (each step reused when its output is there): target gates,
    greedy data from the patched CPU server, the extractions, the kept held-out dumps, the drafts."""
    import torch

    from eaglepatch.acceptance import pipeline, train

    work = Path(work)
    done = work / "inputs.json"
    if done.is_file():
        return json.loads(done.read_text())
    sets = pipeline.parse_sets("cpu", [f"{k}={v}" for k, v in TOY_SETTINGS.items()])

    class DataRun(pipeline.Run):
        def datasets_needed(self):
            return [("train@correct", CORRECT_HF), ("heldout@correct", CORRECT_HF), ("heldout@last", LAST_HF)]

    run = DataRun(pipeline.Options(work=work, scale="cpu", target=TOY_TARGET, release="0.5.9", budget_s=0,
                                   overrides=sets, port=_free_port(), say=say))
    run.servers = {}
    run.do_target()
    run.do_data()
    data = Path(run.data["dir"])
    kept = data / "kept-dumps"
    assert len(list(kept.glob("*.safetensors"))) == TOY_SETTINGS["heldout_prompts"], list(kept.iterdir())[:3]
    post_train, post_held = data / "ds-train@postnorm", data / "ds-heldout@postnorm"
    if not post_train.is_dir():
        _with_final_last(data / "ds-train@correct", post_train)
    if not post_held.is_dir():
        _with_final_last(data / "ds-heldout@last", post_held)
    p = run.p
    drafts = {}
    for name, files, ids in (("correct", data / "ds-train@correct", [-1, 1, 2]),
                             ("postnorm", post_train, [-1, 1, 3])):
        dest = work / "drafts" / name
        if not (dest / "model.safetensors").is_file():
            cfg = train.draft_config(run.cfg, ids, p["dtype"], p["draft_fc_norm"])
            d = train.DraftRun(TOY_TARGET, cfg, pipeline.NUM_STEPS, "cpu", seed=0)
            d.train(train.sample_files(files), p["draft_epochs"], p["draft_batch"], p["draft_lr"], None, 0, say,
                    max_steps=p["draft_max_steps"])
            d.export(dest, p["dtype"])
        drafts[name] = str(dest)
    # the same weights, the ids in its config shifted: the release reads them one layer deeper
    shifted = work / "drafts" / "shifted"
    shifted.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(drafts["correct"]) / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (shifted / "config.json").write_text(json.dumps(cfg, indent=2))
    (shifted / "model.safetensors").write_bytes((Path(drafts["correct"]) / "model.safetensors").read_bytes())
    drafts["shifted"] = str(shifted)
    out = {"drafts": drafts, "heldout": str(data / "ds-heldout@correct"), "heldout_postnorm": str(post_held),
           "states": str(kept), "gates": run.res["target"]["gates"]}
    done.write_text(json.dumps(out, indent=2))
    del torch
    return out


if __name__ == "__main__":  # build the inputs into a directory, to look at them
    sys.path.insert(0, str(REPO / "src"))
    print(json.dumps(build(Path(sys.argv[1])), indent=2))
