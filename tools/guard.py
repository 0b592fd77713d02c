#!/usr/bin/env python3
"""Layer-convention guard: check that a draft config reads the hidden states its dataset holds.

  python tools/guard.py --draft-config DRAFT/config.json --dataset OUT [--release 0.5.9 | --sglang ROOT]

Recognises the draft config's family and reads its layer ids in that family's convention:
eagle_config (SGLang/SpecForge: EAGLE-3 ids, mapped through the capture semantics of the sglang
release the series targets, default the newest series, or of the tree at --sglang ROOT);
speculators (speculators_model_type: top-level HF indices, as vLLM reads them); top-level ids
without either (vLLM reads them, SGLang ignores them); none (every server's defaults). The Hugging
Face hidden_states indices each server would feed the draft are compared with the dataset's
manifest (or a dump file). Warns where SpecForge or speculators cannot train the ids.
Exit: 0 match, 1 mismatch (both lists printed in both conventions), 2 usage error.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eaglepatch import cli  # noqa: E402
from eaglepatch.errors import run_main  # noqa: E402


def main(argv=None) -> int:
    ap = cli.parser("guard.py", __doc__)
    ap.add_argument("--draft-config", required=True, type=Path, help="the EAGLE-3 draft's config.json (or its dir)")
    ap.add_argument("--dataset", required=True, type=Path,
                    help="dataset dir from tools/extract.py (its manifest.json), or one dump .safetensors file")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--release", help="sglang release whose semantics to use (default: the newest series)")
    g.add_argument("--sglang", type=Path, metavar="ROOT", help="read the semantics from this sglang tree")
    ap.add_argument("--json", action="store_true", help="print the verdict as JSON")
    a = ap.parse_args(argv)

    def body() -> int:
        from eaglepatch import guard

        if a.sglang:
            sem = guard.tree_semantics(a.sglang)
        else:
            release = a.release
            if release is None:
                from eaglepatch.series import available_series

                have = available_series()
                release = list(have)[-1] if have else "0.5.9"
            sem = guard.release_semantics(release)
        draft = guard.read_draft(a.draft_config)
        v = guard.check(draft, guard.read_dataset(a.dataset), sem)
        if a.json:
            print(json.dumps({"ok": v.ok, "rule": sem.rule, "source": sem.source, "series": sem.series,
                              "family": draft.family, "servers": v.servers,
                              "served_hf_indices": v.served_hf, "lines": v.lines}, indent=2))
        else:
            print(v.text())
        return 0 if v.ok else 1

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
