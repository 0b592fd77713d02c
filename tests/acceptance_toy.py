"""The CPU acceptance toy that tests/test_acceptance.py and tests/test_check_draft.py both start from:
the toy target, its settings, and what both make of them alike, made once.

Both make, from the same target, settings and seed (0), the same greedy conversations (the patched
sglang 0.5.9 CPU server's), the same two extractions of them on the correct layers (HF [0, 2, 3]:
``ds-train@correct``, ``ds-heldout@correct``), the held-out conversations' dump files
(``kept-dumps``), and the same correct draft (``acceptance.train.DraftRun``, seed 0, 150 steps, the
config ``train.draft_config`` gives). The acceptance run (``tools/acceptance.py``, which that test
runs whole) leaves them in its work directory; ``publish`` copies them to the cache under
``share_key``, and the check-draft toy's build starts from them (``shared``) instead of making them
again. What each makes beyond them (the acceptance run's off-by-one data and floor draft, the
check-draft toy's [0, 2, 4] data and post-norm draft) each still makes itself."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_TARGET = REPO / "tests" / "data" / "acceptance-toy-target"
# the language the toy target was trained on, and draft settings under which a one-layer draft
# learns the lookup from the aux states: 150 steps (about 45 s here), by steps and not by seconds,
# and the run without a budget (--budget-s 0): a busy machine takes longer, it does not train the
# drafts less (a 240 s cap stopped one at 17 of 150 steps on a loaded 2-core machine)
TOY_SETTINGS = dict(language="copy", symbols=16, alphabet=32, answer_len=12, lead=0, train_prompts=256,
                    heldout_prompts=32, gate_prompts=16, draft_fc_norm="true", draft_batch=64, draft_lr=2e-3,
                    draft_max_steps=150)
# under an acceptance work directory: what the check-draft toy's build makes alike
SHARED_DATA = ("greedy.json", "train.jsonl", "heldout.jsonl", "ds-train@correct", "ds-heldout@correct", "kept-dumps")
SHARED_DRAFT = "drafts/correct"


def share_key() -> str:
    """What the shared inputs are made from: the sglang 0.5.9 series (the data server), the project's
    code, tools/acceptance.py and tools/extract.py, the target, the settings and the environment."""
    h = hashlib.sha256()
    files = sorted((REPO / "patches" / "sglang-0.5.9").rglob("*")) + sorted((REPO / "src" / "eaglepatch").rglob("*.py"))
    files += [REPO / "tools" / "acceptance.py", REPO / "tools" / "extract.py"] + sorted(TOY_TARGET.iterdir())
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps([TOY_SETTINGS, sys.executable]).encode())
    return h.hexdigest()[:16]


def _root() -> Path:
    from eaglepatch import cpuenv

    return cpuenv.cache_dir() / "acceptance-toy-share"


def shared() -> Path | None:
    """The shared inputs of this ``share_key`` (a directory holding ``data/...`` and
    ``drafts/correct`` as an acceptance work directory does), or None where no acceptance run of
    this key published them."""
    d = _root() / share_key()
    return d if (d / "published.json").is_file() else None


def made_once(root: Path, key: str, marker: str, make) -> Path:
    """``root/key``: where it holds no ``marker`` yet, made by ``make(tmp)`` in a temporary directory
    beside it and renamed in when whole (``eaglepatch.outputs.build_beside``: where another run
    renamed its own in first, theirs is kept), other keys' directories under ``root`` removed then."""
    from eaglepatch.outputs import build_beside

    dest = Path(root) / key
    if not (dest / marker).is_file():
        build_beside(dest, make)
        for old in dest.parent.iterdir():
            if old != dest and not old.name.startswith(".build-"):
                shutil.rmtree(old, ignore_errors=True)
    return dest


def publish(work: Path) -> None:
    """Copy what the check-draft toy makes alike out of a finished acceptance run's work directory
    (its drafts trained all their steps) to the cache under ``share_key`` (``made_once``)."""
    work = Path(work)

    def copy(tmp: Path) -> None:
        (tmp / "data").mkdir()
        for name in SHARED_DATA:
            src = work / "data" / name
            if src.is_dir():
                shutil.copytree(src, tmp / "data" / name)
            else:
                shutil.copy2(src, tmp / "data" / name)
        shutil.copytree(work / SHARED_DRAFT, tmp / SHARED_DRAFT)
        (tmp / "published.json").write_text(json.dumps({"from": str(work)}))

    made_once(_root(), share_key(), "published.json", copy)
