#!/usr/bin/env python3
"""Layer-convention guard: check that a draft config reads the hidden states its dataset holds.

  python tools/guard.py --draft-config DRAFT/config.json --dataset OUT [--release R [--unpatched] | --sglang ROOT]
                        [--model-file FILE] [--family eagle3|dflash|dspark]

Recognises the draft config's family and reads its layer ids in that family's convention:
eagle_config (SGLang/SpecForge: EAGLE-3 ids, mapped through the capture semantics of the sglang
release the series targets, default the newest series, or of the tree at --sglang ROOT);
speculators (speculators_model_type: top-level HF indices, as vLLM reads them); top-level ids
without either (vLLM reads them, SGLang ignores them); none (every server's defaults); DFlash and
DSpark (SpecForge's and z-lab's dflash field names: dflash_config.target_layer_ids, else
target_layer_ids, DSpark's dspark_target_layer_ids first; none: the ids sglang's
build_target_layer_ids picks), read by the release and model file that serve the target
(deepseek_v2, kimi_k25, kimi_k3, deepseek_v4, deepseek_v41: the file serving the architecture the
dataset records, or --model-file) as the series manifests' table declares. A config that holds
fields of two families is refused (--family names the one the server runs). The Hugging Face
hidden_states indices each server would feed the draft are compared with the dataset's manifest
(or a dump file), and a table says what every release and model file feeds it and whether the
dataset holds that. With --release R both readings are printed: R with the series (it decides
the exit code) and R unpatched (--unpatched makes that one decide). Warns where SpecForge or
speculators cannot train the ids. Refuses, in one line, a dataset whose files the draft's trainer
cannot read (its manifest's format and storage): a compact dataset (unless --compact-reader: the
trainer reads it through eaglepatch.compact.CompactDataset), fp8 states for SpecForge (eagle_config,
id-less, DFlash and DSpark drafts), fp8 states for speculators without --hidden-states-backend fp8
(speculators' own flag, default file, as there).
Exit: 0 match, 1 mismatch (both lists printed in both conventions), a draft the release does not
serve on that model file, or a dataset refused, 2 usage error.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import UsageError, run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("guard.py", __doc__)
    ap.add_argument("--draft-config", required=True, type=Path, help="the draft's config.json (or its dir)")
    ap.add_argument("--dataset", required=True, type=Path,
                    help="dataset dir from tools/extract.py (its manifest.json), or one dump .safetensors file")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--release", help="sglang release whose reading to use (default: the release that dumped the "
                                     "dataset, as its manifest records, else the newest series)")
    g.add_argument("--sglang", type=Path, metavar="ROOT", help="read the (EAGLE-3) semantics from this sglang tree")
    ap.add_argument("--unpatched", action="store_true",
                    help="with --release: the release WITHOUT the series decides the exit code (default: with it; "
                         "both readings are printed)")
    ap.add_argument("--model-file", metavar="FILE",
                    help="the sglang model file serving the target (deepseek_v2, kimi_k25, kimi_k3, deepseek_v4, "
                         "deepseek_v41 = deepseek_v4.py on a DeepSeek-V4.1 target); default: the one serving the "
                         "architecture the dataset records")
    ap.add_argument("--family", choices=["eagle3", "dflash", "dspark"],
                    help="the draft family (sglang's --speculative-algorithm); default: from the config's fields")
    ap.add_argument("--hidden-states-backend", choices=["file", "fp8"], default="file",
                    help="speculators drafts: the --hidden-states-backend speculators trains with (default: file, "
                         "speculators' own default; an fp8 dataset needs fp8)")
    ap.add_argument("--compact-reader", action="store_true",
                    help="the trainer reads a compact dataset through eaglepatch.compact.CompactDataset")
    ap.add_argument("--json", action="store_true", help="print the verdict as JSON")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch import guard

        if a.unpatched and a.sglang:
            raise UsageError("--unpatched goes with --release (a tree at --sglang is read as it is)",
                             "drop --unpatched, or pass --release R instead of --sglang")
        other = None
        data = guard.read_dataset(a.dataset)
        draft = guard.read_draft(a.draft_config, a.family)
        block = draft.family in (guard.DFLASH, guard.DSPARK)
        cell, cell_from = guard.data_cell(data, a.model_file)
        if block and a.sglang:
            raise UsageError("--sglang reads a tree's EAGLE-3 reading; DFlash and DSpark readings come from the "
                             "series manifests' table", "pass --release R instead of --sglang")
        if block and cell is None:
            raise UsageError(f"{data.path} records no target architecture, and which states a "
                             f"{guard.conventions.FAMILY_NAMES[draft.family]} draft is fed depends on the model file",
                             "pass --model-file (deepseek_v2, kimi_k25, kimi_k3, deepseek_v4, deepseek_v41)")
        if a.sglang:
            sem = guard.tree_semantics(a.sglang)
            release, why = None, f"the tree at --sglang {a.sglang}"
            judged = f"release: the sglang tree at --sglang {a.sglang} (its own reading of draft ids)"
        else:
            # --release, else the release that dumped the dataset (its manifest), else the newest series, said so
            release, why = guard.judged_release(data, a.release)
            judged = guard.release_line(release, why, a.unpatched)
            patched = guard.release_semantics(release)
            unpatched = guard.release_semantics(release, unpatched=True)
            sem, other = (unpatched, patched) if a.unpatched else (patched, unpatched)
        guard.check_storage(draft, data, a.hidden_states_backend, a.compact_reader)  # RefusedError: exit 1
        if cell is not None:
            judged += f"\nmodel file: {guard.conventions.CELL_NAMES[cell]} ({cell_from})"
        w = None
        if block:
            v = guard.check_block(draft, data, release, cell, a.unpatched)
            other = None
        elif cell is not None and cell not in guard.conventions.SERIES_MODEL_FILES and draft.family != guard.SPECULATORS:
            v = guard.not_served(draft, data, f"sglang serves no EAGLE-3 draft on {guard.conventions.CELL_NAMES[cell]} "
                                              f"(it has no set_eagle3_layers_to_capture): serve a DFlash or DSpark draft")
            other = None
        else:
            v = guard.check(draft, data, sem)
            w = guard.check(draft, data, other) if other is not None else None
        table, rows = guard.readings(draft, data, (release, cell or "deepseek_v2", a.unpatched)
                                     if release is not None else None)
        if a.json:
            rule, source = sem.rule, sem.source
            if block:  # the family's reading on that model file (the series manifest's draft_readings), if served
                feed = guard.block_feed(draft, data.num_layers, release, cell)
                rule, source = feed.rule, f"sglang {release} series manifest, capture_semantics.draft_readings"
            doc = {"ok": v.ok, "release": release, "release_from": why, "model_file": cell, "model_file_from": cell_from,
                   "rule": rule, "source": source, "series": sem.series,
                   "family": draft.family, "servers": v.servers,
                   "served_hf_indices": v.served_hf, "lines": v.lines, "readings": rows}
            if w is not None:
                doc["patched" if a.unpatched else "unpatched"] = {
                    "ok": w.ok, "rule": other.rule, "source": other.source, "servers": w.servers,
                    "served_hf_indices": w.served_hf, "lines": w.lines}
            text = json.dumps(doc, indent=2)
        else:
            text = judged + "\n" + v.text()
            if w is not None:
                text += (f"\n\nalso {other.source.split(' (')[0]} (this reading does not decide the exit code):\n"
                         + "\n".join("  " + ln for ln in w.lines[2:]))
            if table:
                text += "\n\n" + "\n".join(table)
        guard.write_out(text)  # a closed stdout (| head -1) ends it quietly: the exit code stands
        return 0 if v.ok else 1

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
