#!/usr/bin/env python3
"""How fast the acceptance target (tools/acceptance.py's trained DeepSeek-V3) learns its language,
for several settings side by side: each setting trains in its own process on the same device for
the same seconds, then the gates are measured (train.measure). Used to pick the GPU scale's
language settings (docs/acceptance.md); the figures say how many steps each setting needed.

  PYTHONPATH=/tmp/site:src python3 benchmarks/acceptance_target.py --out $OUT/target-probe.json \\
      --budget-s 150 --setting symbols=16,alphabet=64,answer_len=15 --setting symbols=24,target_lr=0.002

A setting is KEY=VALUE pairs over the GPU scale's keys (pipeline.SCALES["gpu"]); the rest are
the scale's. --cpu trains the CPU toy's target on CPU instead (seconds; for a smoke run).
Exit: 0 every setting ran, 1 one failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def parse_setting(text: str, scale: dict) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, val = item.partition("=")
        if not eq or key not in scale:
            raise SystemExit(f"error: setting {item!r}: not KEY=VALUE with a key of the scale; use one of "
                             + ", ".join(sorted(scale)))
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
    return out


def draft_probe(model, lg, p: dict, cfg: dict, target_dir: Path, seed: int, draft: dict, say) -> dict:
    """Whether a SpecForge draft learns to use the aux states at these draft settings: the target's
    own states (transformers' output_hidden_states: indices 0, 2, 3; the post-norm last one as the
    teacher) written as a ``--format specforge`` dataset, a draft trained on it and one with its aux
    inputs zeroed for the same steps, held-out step accuracies of both. A diagnostic of the draft
    settings only: the acceptance run itself takes its data from the server through
    tools/extract.py."""
    import random

    import torch
    from eaglepatch.acceptance import train

    rng = random.Random(seed + 11)
    dev = next(model.parameters()).device
    sets = {}
    for name, n in (("train", draft["train_prompts"]), ("heldout", 128)):
        d = target_dir / f"ds-{name}"
        d.mkdir(parents=True, exist_ok=True)
        samples = [lg.sample(rng) for _ in range(n)]
        by_len = {}
        for i, smp in enumerate(samples):
            by_len.setdefault(len(lg.full_ids(smp)), []).append(i)
        for idx in by_len.values():  # rows of one length batched (no padding)
            for k in range(0, len(idx), 64):
                rows = idx[k:k + 64]
                ids = torch.tensor([lg.full_ids(samples[i]) for i in rows], device=dev)
                with torch.no_grad():
                    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
                for r, i in enumerate(rows):
                    P = len(lg.prompt_ids(samples[i]))
                    aux = torch.cat([hs[j][r] for j in (0, 2, 3)], -1).to(torch.bfloat16).cpu()
                    torch.save({"input_ids": ids[r].cpu(), "loss_mask": torch.tensor([0] * P + [1] * (ids.shape[1] - P)),
                                "hidden_state": hs[-1][r][None].to(torch.bfloat16).cpu(), "aux_hidden_state": aux[None]},
                               d / f"{i:05d}.ckpt")
        sets[name] = train.sample_files(d)
    return train_drafts(cfg, target_dir, sets["train"], sets["heldout"], p["device"], seed, draft, say)


def train_drafts(cfg: dict, target_dir: Path, files: list, held: list, device: str, seed: int, draft: dict,
                 say) -> dict:
    """The correct draft and the floor (aux zeroed, the same steps) on ``files``; held-out figures."""
    from eaglepatch.acceptance import train

    dcfg = train.draft_config(cfg, [-1, 1, 2], "bfloat16", bool(draft.get("fc_norm")))
    out, steps = {}, None
    for name, zero in (("correct", False), ("floor", True)):
        run = train.DraftRun(target_dir, dcfg, 3, device, zero_aux=zero, seed=seed)
        hist = run.train(files, 10**6, draft["batch"], draft["lr"], draft["budget_s"] * (3 if steps else 1),
                         seed, say, max_steps=steps or draft.get("max_steps"))
        steps = hist["steps"]
        out[name] = {"training": {k: v for k, v in hist.items() if k != "history"}, "history": hist["history"][-4:],
                     "heldout": run.evaluate(held)}
    return out


def drafts_on_work(work: Path, device: str, seed: int, draft: dict) -> dict:
    """train_drafts on a tools/acceptance.py work directory's target and extracted datasets (what
    the tool's drafts train on), e.g. to compare draft settings on one data set."""
    from eaglepatch.acceptance import train

    work = Path(work)
    cfg = json.loads((work / "target" / "config.json").read_text())
    files = train.sample_files(work / "data" / "ds-train@correct")
    held = train.sample_files(work / "data" / "ds-heldout@correct")
    if not files or not held:
        raise SystemExit(f"error: {work} holds no extracted datasets (data/ds-train@correct, data/ds-heldout@correct); "
                         "pass the --work of a tools/acceptance.py run that finished its data phase")
    return dict(train_drafts(cfg, work / "target", files, held, device, seed, draft, lambda m: None),
                settings=draft, work=str(work))


def aux_norms(dataset: Path, slots: int = 3, limit: int = 200) -> dict:
    """Mean per-token L2 norm of each aux slot and of the final state over a ``--format specforge``
    dataset's first ``limit`` files: how unequal the inputs a draft's ``fc`` mixes are."""
    import torch
    from eaglepatch.acceptance import train

    files = train.sample_files(dataset)[:limit]
    if not files:
        raise SystemExit(f"error: {dataset} holds no .ckpt files; pass a tools/extract.py --format specforge output")
    tot, fin = torch.zeros(slots), 0.0
    for f in files:
        d = train.read_sample(f)
        a = d["hidden_state"].float()
        h = a.shape[-1] // slots
        tot += a.reshape(-1, slots, h).norm(dim=-1).mean(0)
        fin += float(d["target"].float().reshape(-1, h).norm(dim=-1).mean())
    return {"files": len(files), "aux_slot_norms": [round(float(x) / len(files), 4) for x in tot],
            "final_norm": round(fin / len(files), 4)}


def one(setting: dict, scale_name: str, budget_s: float, seed: int, draft: dict | None = None,
        save: Path | None = None) -> dict:
    from eaglepatch.acceptance import language as lang_mod, pipeline, train

    p = dict(pipeline.SCALES[scale_name], **setting)
    cfg = pipeline.target_config(scale_name)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = train.build_target(cfg, p["device"], seed, Path(tmp), p.get("target_embed_std"))
    lg = lang_mod.Language(p["language"], cfg["vocab_size"], p["symbols"], p["answer_len"], seed,
                           alphabet=p["alphabet"], lead=p["lead"])
    hist = train.train_target(model, lg, p["target_steps"], p["target_batch"], p["target_lr"], budget_s, seed,
                              p["device"], say=lambda m: None)
    t1 = time.monotonic()
    gates = train.measure(model, lg, p["gate_prompts"], seed)
    res = {"setting": setting, "settings": p, "training": hist, "gates": gates,
           "train_s": round(t1 - t0, 1), "measure_s": round(time.monotonic() - t1, 1),
           "gates_passed": not pipeline.gate_failures(gates)}
    if save is not None:  # a target for tools/acceptance.py --target (e.g. the CPU test's, trained on the GPU)
        train.save_target(model, cfg, save, p["dtype"])
        (Path(save) / "acceptance-target.json").write_text(json.dumps(
            {"given": False, "training": hist, "gates": gates, "settings": p}, indent=2) + "\n")
    if draft:
        t2 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            d = train.save_target(model, cfg, Path(tmp) / "target", p["dtype"])
            res["draft_probe"] = dict(draft_probe(model, lg, p, cfg, d, seed, draft, lambda m: print(m, flush=True)),
                                      settings=draft, wall_s=round(time.monotonic() - t2, 1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--setting", action="append", default=[], help="KEY=VALUE[,KEY=VALUE...] (repeatable)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="training seconds per setting (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="the CPU toy's scale")
    ap.add_argument("--draft", help="also probe the draft: JSON of train_prompts, batch, lr, budget_s[, max_steps] "
                                    "(e.g. '{\"train_prompts\": 2048, \"batch\": 64, \"lr\": 0.002, \"budget_s\": 50}')")
    ap.add_argument("--aux-norms", type=Path, metavar="DATASET",
                    help="only report the mean L2 norm of each aux slot of a --format specforge dataset")
    ap.add_argument("--work", type=Path, metavar="WORK",
                    help="with --draft: train the drafts on a tools/acceptance.py work directory's target and "
                         "datasets instead of a fresh target")
    ap.add_argument("--save", type=Path, metavar="DIR",
                    help="save the trained target (one --setting only) where tools/acceptance.py --target reads it")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from eaglepatch.acceptance import pipeline

    scale_name = "cpu" if a.cpu else "gpu"
    if a.aux_norms is not None:
        res = aux_norms(a.aux_norms)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
        print(res)
        return 0
    if a.work is not None:
        if not a.draft:
            raise SystemExit("error: --work needs --draft (the draft settings to train with)")
        res = drafts_on_work(a.work, "cpu" if a.cpu else "cuda", a.seed, json.loads(a.draft))
        a.out.write_text(json.dumps(res, indent=2) + "\n")
        for k in ("correct", "floor"):
            print(k, res[k]["training"]["steps"], "steps:", res[k]["heldout"])
        return 0
    if a.one is not None:
        res = one(json.loads(a.one), scale_name, a.budget_s, a.seed, json.loads(a.draft) if a.draft else None, a.save)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
        return 0
    settings = [parse_setting(s, pipeline.SCALES[scale_name]) for s in (a.setting or [""])]
    if a.save is not None and len(settings) != 1:
        raise SystemExit("error: --save keeps one target; pass one --setting")
    procs = []
    tmp = Path(tempfile.mkdtemp(prefix="acc-probe-"))
    for i, s in enumerate(settings):
        out = tmp / f"{i}.json"
        cmd = [sys.executable, __file__, "--out", str(out), "--budget-s", str(a.budget_s), "--seed", str(a.seed),
               "--one", json.dumps(s)] + (["--cpu"] if a.cpu else []) + (["--draft", a.draft] if a.draft else []) \
            + (["--save", str(a.save.absolute())] if a.save is not None else [])
        log = open(tmp / f"{i}.log", "w")
        procs.append((s, out, tmp / f"{i}.log", subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                                  env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))))
    results, failed = [], 0
    for s, out, log, proc in procs:
        rc = proc.wait()
        if rc == 0 and out.is_file():
            results.append(json.loads(out.read_text()))
        else:
            failed += 1
            results.append({"setting": s, "error": f"exit {rc}", "log_tail": log.read_text(errors="replace")[-2000:]})
    a.out.write_text(json.dumps({"budget_s": a.budget_s, "side_by_side": len(settings), "results": results},
                                indent=2) + "\n")
    for r in results:
        if "error" in r:
            print(r["setting"], r["error"])
            continue
        h = r["training"]["history"]
        print(r["setting"], "steps", r["training"]["steps"], "last acc", h[-1]["acc"] if h else None,
              "gates", {k: r["gates"][k] for k in ("task_accuracy", "bf16_fp32_agreement", "bigram_predictability",
                                                   "loop_rate")}, "passed", r["gates_passed"])
        for k, v in r.get("draft_probe", {}).items():
            if isinstance(v, dict) and "heldout" in v:
                print("  draft", k, v["training"]["steps"], "steps:", v["heldout"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
