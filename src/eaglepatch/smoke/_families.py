"""What a DFlash or DSpark draft is fed by the target, through the release's own setters (run
inside a release's CPU environment by file path, on an unpatched or a patched tree).

usage: python _families.py CKPT_DIR WORK_DIR OUT_DIR FAMILY:IDS[:dump] ...

For each ``FAMILY:IDS`` (dflash or dspark; IDS the draft config's ``target_layer_ids``, comma
separated; ``:dump`` with the dump on, EAGLE3_DUMP_DIR=WORK_DIR/dump-<n>) a config-only draft is
written, a target ModelRunner with ``speculative_algorithm`` DFLASH or DSPARK is built the way the
release builds one (its ``configure_aux_hidden_state_capture`` calls the model's setter), one
prefill of the smoke prompts runs with CaptureHiddenMode.FULL, and what the draft receives
(``LogitsProcessorOutput.hidden_states``) is saved to OUT_DIR/<n>.pt with the model's
``layers_to_capture`` after the setter, and each prompt's rows are compared with the HF residual
stream at the indices the family's reading names (output of layer k: HF index k + 1) and at the
shifted ones (index k: the layer's input), so the worker tells a right feed from one off by one.
The test compares the saved tensors across trees bit for bit (tests/test_draft_capture.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import _hf
import _rt
import tinyconfig
from _common import Dumping, log

ALGORITHMS = {"dflash": "DFLASH", "dspark": "DSPARK"}


def draft_config(family: str, ids) -> dict:
    """A config-only DFlash (or DSpark) draft of the tiny target, as sglang's parsers read it."""
    c = tinyconfig.DEEPSEEK_V3
    cfg = dict(tinyconfig.draft_config(None), architectures=["DFlashDraftModel"], model_type="qwen3",
               num_hidden_layers=len(ids), head_dim=c["hidden_size"] // c["num_attention_heads"],
               dflash_config={"target_layer_ids": list(ids), "block_size": 4, "mask_token_id": c["vocab_size"] - 1,
                              "num_target_layers": c["num_hidden_layers"]})
    if family == "dspark":  # DSpark's own section (sglang's parse_dspark_draft_config requires a Markov head)
        cfg["dspark_config"] = {"markov_rank": 1, "markov_head_type": "vanilla"}
    return cfg


def _server_args(ckpt, over: dict):
    """The release's ServerArgs with a DFLASH/DSPARK draft. Releases accept those on accelerators
    only; the target ModelRunner reads the draft's layers the same way on any device, so the
    device check alone is passed: through the platform's own answer where the release asks its
    platform (0.5.23), else by setting the fields past the release's read-only guard (0.5.17)."""
    try:
        return _rt.server_args(ckpt, **over)
    except ValueError as exc:
        log("the release refuses %s on CPU (%s): passing its device check" % (over["speculative_algorithm"], exc))
    try:
        from sglang.srt.platforms import current_platform
    except ImportError:
        current_platform = None
    if current_platform is not None and hasattr(current_platform, "supports_speculative_algorithm"):
        answers = {"is_out_of_tree": lambda: True, "supports_speculative_algorithm": lambda algorithm: True,
                   # the draft worker's backend (this process builds the target only)
                   "get_default_speculative_draft_attention_backend": lambda *a, **k: "torch_native",
                   "supports_speculative_draft_attention_backend": lambda *a, **k: True}
        saved = {k: current_platform.__dict__.get(k) for k in answers}
        for k, v in answers.items():
            setattr(current_platform, k, v)
        try:
            return _rt.server_args(ckpt, **over)
        finally:
            for k, v in saved.items():
                if v is None:
                    delattr(current_platform, k)
                else:
                    setattr(current_platform, k, v)
    sa = _rt.server_args(ckpt)
    for name, value in over.items():
        object.__setattr__(sa, name, value)
    return sa


def _configure_as_dspark(runner, draft: Path, ids) -> None:
    """The release's DSpark capture path on a built target runner (see ``run``)."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

    cfg = parse_dspark_draft_config(draft_hf_config=json.loads((draft / "config.json").read_text()))
    target_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids is not None else list(ids)
    configure_aux_hidden_state_capture(model=runner.model, eagle_use_aux_hidden_state=False,
                                       eagle_aux_hidden_state_layer_ids=None, dflash_use_aux_hidden_state=True,
                                       dflash_target_layer_ids=target_ids, is_dspark=True)


def run(ckpt: Path, work: Path, out: Path, spec: str, n: int, ref) -> dict:
    family, ids_text, *rest = spec.split(":")
    ids = [int(x) for x in ids_text.split(",")]
    dump = bool(rest and rest[0] == "dump")
    draft = work / f"draft-{n}"
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps(draft_config(family, ids), indent=2) + "\n")
    sa_over = dict(speculative_algorithm=ALGORITHMS[family], speculative_draft_model_path=str(draft),
                   speculative_num_draft_tokens=4)
    path = "the runner's own configure_aux_hidden_state_capture"
    with Dumping(work / f"dump-{n}" if dump else None, layers=[-1, 1, 3] if dump else None):
        try:
            sa = _server_args(ckpt, sa_over)
        except ValueError as exc:
            if family != "dspark":
                raise
            # a release that refuses DSPARK on a CPU device past its platform's answers (0.5.23 checks
            # the device itself): the runner is built for DFLASH, then its capture configured again
            # through the release's own DSpark path (configure_aux_hidden_state_capture with
            # is_dspark=True and the ids the release's parse_dspark_draft_config resolves)
            log("DSPARK on CPU refused (%s): built as DFLASH, configured through the DSpark path" % exc)
            sa = _server_args(ckpt, dict(sa_over, speculative_algorithm="DFLASH"))
            path = "configure_aux_hidden_state_capture(is_dspark=True) on a DFLASH-built runner"
        runner = _rt.make_runner(sa)
        try:
            model = runner.model
            if path.startswith("configure_aux"):
                _configure_as_dspark(runner, draft, ids)
            from_setter = list(getattr(getattr(model, "model", model), "layers_to_capture", []))
            prompts = tinyconfig.prompts()
            hs = _rt.extend(runner, prompts, capture_full=True).hidden_states
            state = getattr(model, "_eagle3_capture_state", None)
            written = 0
            if state is not None and state.writer is not None:
                state.writer.flush()
                written = state.writer.written
        finally:
            _rt.release(runner)
    H = tinyconfig.DEEPSEEK_V3["hidden_size"]
    diffs = {"right": 0.0, "shifted": float("inf")}
    start = 0
    for p in prompts:
        r = ref.run(p)
        rows = hs[start:start + len(p)].float()
        for j, k in enumerate(sorted(set(ids))):
            got = rows[:, j * H:(j + 1) * H]
            diffs["right"] = max(diffs["right"], (got - r.stream[k + 1]).abs().max().item())
            diffs["shifted"] = min(diffs["shifted"], (got - r.stream[k]).abs().max().item())
        start += len(p)
    torch.save({"hidden_states": hs.clone(), "layers_to_capture": from_setter}, out / f"{n}.pt")
    rec = {"spec": spec, "family": family, "ids": ids, "dump": dump, "layers_to_capture": from_setter,
           "prompts": len(prompts),
           "shape": list(hs.shape), "max_diff_right": diffs["right"], "min_diff_shifted": diffs["shifted"],
           "files_written": written, "path": path}
    log("%s: %s" % (spec, rec))
    return rec


def main() -> int:
    ckpt, work, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    ref = _hf.Reference(ckpt)
    records = [run(ckpt, work, out, spec, n, ref) for n, spec in enumerate(sys.argv[4:])]
    (out / "records.json").write_text(json.dumps(records, indent=1) + "\n")
    print("@@FAMILIES " + json.dumps(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
