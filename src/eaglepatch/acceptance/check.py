"""Check a trained EAGLE-3 draft before serving it (issue 32; ``tools/check_draft.py``).

Inputs: the target checkpoint, the draft directory (config.json and weights, as SpecForge or this
project's export writes them), the held-out data the draft's training predicts on (a dataset
directory from ``tools/extract.py``, specforge format), the serving settings (release, steps),
and what is compared with the prediction: the dump files of the held-out conversations with
every layer a reading needs (``--states``: the CPU path replays what the release feeds the draft),
or the figures of a GPU serving run (``--served``).

1. **guard**: the draft's config against the data's layers for that release (``guard.check``).
2. **prediction**: the draft's own forward (SpecForge's TTT, ``train.DraftRun.chain_replay``) over
   the held-out data, greedy chain acceptance (a draft token is accepted when the draft's argmax
   equals the target's next token and every token before it was accepted): per-position accept
   rates, the accept length over the data's answers, and the chain prediction at those answer
   lengths (``language.chain_accept_length_at``).
3. **observed**: ``--served``'s figures; or the draft served on the GPU (``--serve``:
   ``serve_check.Serving``, given to ``check`` as ``serving``: its server starts once every input
   is checked, runs while the prediction is made, and its figures, written in ``--served``'s
   format, are read back from that file); or, without either, the draft replayed on the states
   the release feeds it by its config (guard's served HF indices) read from the dump files,
   reported as ``replayed``: no server loaded the draft.
4. **diagnosis**: the draft replayed on the states of each reading a layer mix-up produces from the
   data's layers (as trained; each aux layer one deeper or one shallower; upstream's capture-index
   convention; the last slot's pre-norm and post-norm states swapped), and which of them the
   prediction and the observed figures match: the reading the draft was trained on and the one
   it is fed, and the mix-up between them.

Exit (``outcome``): 0 guard passes and the observed accept length is within the tolerance of the
predicted (and, with ``lossless``, every served answer equals the held-out data's); 1 otherwise,
with the diagnosis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from . import language as lang_mod
from .verdicts import GPU_LIMITS

TOLERANCE = GPU_LIMITS["served_minus_predicted"]
FINAL = "final"  # the post-norm final state, as a slot of a reading
REPLAYED = ("replayed, not served: no server loaded the draft; its chain acceptance replayed with SpecForge's TTT "
            "forward on the states the release feeds it by its config, read from the dump files")


@dataclass
class Inputs:
    target: Path
    draft: Path
    data: Path
    states: Path | None = None
    served: Path | None = None
    # the release judged for (``guard.judged_release``: --release, else the one that dumped ``data``) and why
    release: str | None = None
    release_from: str = ""
    unpatched: bool = False
    steps: int = 3
    topk: int = 1
    draft_tokens: int = 4
    tolerance: float = TOLERANCE
    device: str = "cpu"
    # the first K tokens of each answer go with its prompt (served) and are no generated token
    # (predicted): answers that start with tokens the user gave (``request_spans``)
    prompt_answer_tokens: int = 0
    # every served answer must equal the held-out data's (data that are the target's greedy output)
    lossless: bool = False


# ---- inputs, checked before anything is loaded or written ------------------------------------------

def _json(path: Path, what: str, fix: str):
    try:
        return json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist", fix) from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror or type(exc).__name__})", fix) from None
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested deeper than Python's stack
        raise UsageError(f"{what} {path} is not readable JSON ({type(exc).__name__})", fix) from None


def _int_field(cfg: dict, key: str, where: str, fix: str) -> int:
    """``cfg[key]`` as a positive integer (not a bool, not a string of digits); a usage error naming the
    file otherwise."""
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UsageError(f"{where} has {key} {v!r}, not a positive integer", fix)
    return v


def check_settings(i: Inputs) -> None:
    """The serving settings the replay models: a chain (topk 1, draft tokens = steps + 1)."""
    import math

    if not isinstance(i.steps, int) or not 1 <= i.steps <= 16:
        raise UsageError(f"--steps {i.steps}: the draft steps per verify are 1 to 16", "pass e.g. --steps 3")
    if i.topk != 1 or i.draft_tokens != i.steps + 1:
        raise UsageError(f"--topk {i.topk} --draft-tokens {i.draft_tokens}: the replay models a chain (topk 1, draft "
                         f"tokens = steps + 1 = {i.steps + 1}), not a tree",
                         f"check with --topk 1 --draft-tokens {i.steps + 1} (the acceptance a tree adds is not "
                         f"predicted here)")
    if not (isinstance(i.tolerance, float) and math.isfinite(i.tolerance) and i.tolerance > 0):
        raise UsageError(f"--tolerance {i.tolerance}: not a positive number", f"pass e.g. --tolerance {TOLERANCE}")
    if not isinstance(i.prompt_answer_tokens, int) or not 0 <= i.prompt_answer_tokens <= 64:
        raise UsageError(f"--prompt-answer-tokens {i.prompt_answer_tokens}: 0 to 64 tokens of each answer sent with "
                         f"its prompt", "pass 0 (answers generated whole) or the length of the part the user gave, "
                         "e.g. 1")


TARGET_FIX = ("pass --target the checkpoint directory the draft was trained for (config.json and its safetensors "
              "weights: model.safetensors.index.json with its shards, or one model.safetensors)")


def target_config(target: Path) -> dict:
    """The target's config.json (its text config for a multimodal checkpoint), with safetensors
    weights beside it: an index (``model.safetensors.index.json``) or a single ``model.safetensors``
    (``head_dir`` gives SpecForge's TargetHead, which finds the LM head through an index, one); a
    one-line usage error otherwise."""
    cfg = _json(Path(target) / "config.json", "the target config", TARGET_FIX)
    if not isinstance(cfg, dict):
        raise UsageError(f"the target config {target}/config.json is no JSON object", TARGET_FIX)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for k in ("num_hidden_layers", "hidden_size", "vocab_size"):
        _int_field(text, k, f"the target config {target}/config.json", TARGET_FIX)
    if not any((Path(target) / f).is_file() for f in (INDEX, SINGLE)):
        raise UsageError(f"{target} has neither {INDEX} nor {SINGLE} (the LM head and the embedding come from the "
                         f"target's weights)", TARGET_FIX)
    return text


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _safetensors_names(path: Path, what: str, fix: str) -> list:
    """The tensor names of the safetensors file ``path`` (its header, read without torch); a one-line
    usage error naming the file when it is no readable safetensors file (empty, truncated, a
    directory, another format)."""
    from .storage_check import header

    try:
        if not path.is_file():
            raise UsageError(f"{what} {path} is not a file", fix)
        size = path.stat().st_size
        start, _, table = header(path)
        ends = [e["data_offsets"][1] for e in table.values()]
        if not isinstance(table, dict) or start + max(ends, default=0) > size:
            raise ValueError("its tensors end past the end of the file")
    except UsageError:
        raise
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror or type(exc).__name__})", fix) from None
    except Exception as exc:  # struct.error (shorter than a header), JSON, a table of other shape
        import struct

        why = ("shorter than a safetensors header" if isinstance(exc, struct.error) else str(exc)[:80]
               if isinstance(exc, ValueError) and "past the end" in str(exc) else type(exc).__name__)
        raise UsageError(f"{what} {path} is no readable safetensors file (empty, truncated or another format: {why})",
                         fix) from None
    return list(table)


def head_dir(target: Path, scratch: Path) -> Path:
    """A directory SpecForge's TargetHead reads the LM head from: ``target`` when it has its index;
    for a single-file checkpoint, ``scratch`` made a view of it (a link to each of its files and
    the index a sharded checkpoint would have, its weight map read from the file's header)."""
    target = Path(target)
    if (target / INDEX).is_file():
        return target
    names = _safetensors_names(target / SINGLE, "the target's weights", TARGET_FIX)
    scratch.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        (scratch / f.name).symlink_to(f.resolve())
    (scratch / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {k: SINGLE for k in names}}))
    return scratch


def draft_config(draft: Path, target: dict) -> dict:
    """The draft's config.json, which builds its LlamaForCausalLMEagle3 (SpecForge's layout); a
    speculators draft or one of another size is a one-line usage error."""
    fix = "pass --draft the directory SpecForge (or tools/acceptance.py) wrote: config.json and model.safetensors"
    cfg = _json(Path(draft) / "config.json", "the draft config", fix)
    if not isinstance(cfg, dict):
        raise UsageError(f"the draft config {draft}/config.json is no JSON object", fix)
    if "speculators_model_type" in cfg:
        raise UsageError(f"{draft} is a speculators draft: its weights are not replayed by this tool (it replays "
                         f"SpecForge's LlamaForCausalLMEagle3)", "check its layers with tools/guard.py; " + fix)
    where = f"the draft config {draft}/config.json"
    if _int_field(cfg, "hidden_size", where, fix) != target["hidden_size"]:
        raise UsageError(f"the draft's hidden_size {cfg['hidden_size']} is not the target's {target['hidden_size']}",
                         "pass the draft trained for this target")
    return cfg


# what a served-figures file may add (``serve_check.served_figures`` writes them all), kept in the
# report's ``observed`` as given
SERVED_EXTRA = ("at_least", "verify_ct", "tokens_after_prefill", "per_position_how", "answers_equal_to_data",
                "requests_compared", "first_difference_at", "server")


def read_served(path: Path, steps: int, lossless: bool = False) -> dict:
    """A GPU serving run's figures: ``accept_length`` (sum(C-1)/sum(V) over the responses'
    meta_info) and optionally ``per_position`` (the rate of each draft position given the ones
    before it accepted, ``steps`` numbers), ``requests``, ``how``, and ``SERVED_EXTRA``.
    ``lossless``: the file must say how many served answers equal the data's
    (``answers_equal_to_data`` of ``requests_compared``, as ``--serve`` writes it)."""
    fix = ('write it as {"accept_length": 3.1, "per_position": [0.9, 0.8, 0.7], "requests": 128, "how": "served ..."}'
           " (docs/check-draft.md)")
    d = _json(path, "--served", fix)
    a = d.get("accept_length") if isinstance(d, dict) else None
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 1.0 <= a <= steps + 1:
        raise UsageError(f"--served {path}: accept_length {a!r} is not a number from 1 to {steps + 1}", fix)
    pp = d.get("per_position")
    if pp is not None and (not isinstance(pp, list) or len(pp) != steps or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in pp)):
        raise UsageError(f"--served {path}: per_position is not {steps} rates from 0 to 1", fix)
    eq, n = d.get("answers_equal_to_data"), d.get("requests_compared")
    counts = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (eq, n)) and eq <= n
    if (eq is not None or n is not None or lossless) and not counts:
        raise UsageError(f"--served {path}: answers_equal_to_data {eq!r} of requests_compared {n!r} are not two "
                         f"counts (the served answers equal to the held-out data's, of those compared)",
                         "write both (tools/check_draft.py --serve does), or drop --lossless")
    out = {"accept_length": float(a), "per_position": pp, "requests": d.get("requests"),
           "how": str(d.get("how") or f"served (figures from {path})"), "source": str(path)}
    out.update({k: d[k] for k in SERVED_EXTRA if k in d})
    return out


def dump_index(states: Path) -> dict:
    """input_ids tuple -> dump file, over the ``*.safetensors`` files of ``states`` (headers only)."""
    from .storage_check import _ids, header

    out = {}
    for p in sorted(Path(states).glob("*.safetensors")):
        try:
            start, _, table = header(p)
            out.setdefault(tuple(_ids(p, start, table["input_ids"])), p)
        except (OSError, ValueError, KeyError):
            continue
    if not out:
        raise UsageError(f"--states {states} holds no dump file (*.safetensors with input_ids)",
                         "pass the directory of the held-out conversations' dump files (tools/extract.py "
                         "--keep-dumps against a server dumping every layer the readings need)")
    return out


# ---- readings ---------------------------------------------------------------------------------------

def with_final_last(src: Path, dest: Path) -> None:
    """Copy the specforge dataset ``src`` to ``dest`` with each sample's last aux slot replaced by its
    post-norm final state (``hidden_state``): what a trainer that took the post-norm state for 'the
    last layer' writes. The GPU proof (``benchmarks/check_draft_gpu.py``) builds its post-norm
    draft's data with it, as ``tests/test_check_draft.py`` builds the CPU toy's (a test there checks
    the two constructions give the same files)."""
    import shutil

    import torch

    shutil.copytree(src, dest)
    for p in sorted(Path(dest).rglob("*.ckpt")):
        d = torch.load(p, map_location="cpu", weights_only=True)
        H = d["hidden_state"].shape[-1]
        d["aux_hidden_state"][..., -H:] = d["hidden_state"]
        torch.save(d, p)


def slot_name(h) -> str:
    """A reading's slot: HF index h (0 = embedding output, N = the last layer before the norm) or FINAL."""
    return FINAL if h == FINAL else f"HF {h}"


def state_key(h) -> str:
    """The dump tensor of a slot: ``layer.<h-1>`` (layer-output id) or ``final``."""
    return FINAL if h == FINAL else f"layer.{h - 1}"


def readings(trained: list, n: int, config_hf: list | None, upstream_rule: str, series_rule: str,
             release: str) -> list:
    """The readings a layer mix-up produces from the data's HF indices ``trained`` (ascending) on an
    ``n``-layer target, each {"names", "kinds", "slots"}, equal slot lists merged: as trained;
    every aux layer one deeper (k read as k + 1) and one shallower; upstream's capture-index
    convention both ways (output-of-layer ids read as capture indices by unpatched ``release``, and
    capture indices read k + 1 by the series); the last slot's pre-norm state (HF N) and the
    post-norm final state swapped; and ``config_hf``, what the release reads the draft's config as."""
    from .. import conventions

    cands = [("as_trained", "as trained (the data's layers)", list(trained))]
    cands.append(("off_by_one_deeper", "off by one: each aux layer read one deeper (k as k+1)",
                  [h + 1 for h in trained]))
    cands.append(("off_by_one_shallower", "off by one: each aux layer read one shallower (k as k-1)",
                  [h - 1 for h in trained]))
    up = sorted(conventions.capture(upstream_rule, [h - 1 for h in trained]))
    cands.append(("upstream_convention", f"upstream's capture-index convention: output-of-layer ids "
                  f"{[h - 1 for h in trained]} read by unpatched sglang {release} as capture indices {up}", up))
    sr = sorted(conventions.capture(series_rule, list(trained)))
    cands.append(("upstream_convention", f"upstream's capture-index convention the other way: capture indices "
                  f"{list(trained)} written as ids, read by sglang {release} with the series as {sr}", sr))
    if trained and trained[-1] == n:
        cands.append(("norm_swapped", f"pre-norm and post-norm last state swapped: the post-norm final state where "
                      f"the data holds layer {n - 1}'s output before the norm (HF {n})", list(trained[:-1]) + [FINAL]))
    if config_hf is not None:
        cands.append(("config", f"the draft's config as sglang {release} reads it", list(config_hf)))
    out = []
    for kind, name, slots in cands:
        if not all(s == FINAL or 0 <= s <= n for s in slots) or len(set(slots)) != len(slots):
            continue
        same = next((r for r in out if r["slots"] == slots), None)
        if same is None:
            out.append({"kinds": [kind], "names": [name], "slots": slots})
        elif name not in same["names"]:
            same["kinds"].append(kind)
            same["names"].append(name)
    return out


def relation(trained: list, fed: list, n: int) -> tuple[str, str]:
    """(cause, sentence) of the mix-up that feeds a draft trained on the slots ``trained`` the slots ``fed``."""
    t, f = [slot_name(s) for s in trained], [slot_name(s) for s in fed]
    if trained == fed:
        return "none", "the draft is fed the states it was trained on: no layer mix-up explains the gap"
    if len(trained) == len(fed) and FINAL not in trained + fed:
        d = {b - a for a, b in zip(trained, fed)}
        if d == {1}:
            return "off_by_one_deeper", (f"off by one: the draft is fed each aux layer one deeper than it was trained "
                                         f"on ({f} where it learned {t})")
        if d == {-1}:
            return "off_by_one_shallower", (f"off by one: the draft is fed each aux layer one shallower than it was "
                                            f"trained on ({f} where it learned {t})")
    if len(trained) == len(fed) and trained[:-1] == fed[:-1] and {trained[-1], fed[-1]} == {n, FINAL}:
        if trained[-1] == FINAL:
            return "norm_swapped", (f"pre-norm vs post-norm: the draft's last slot was trained on the post-norm final "
                                    f"state and is fed layer {n - 1}'s output before the final norm (HF {n})")
        return "norm_swapped", (f"pre-norm vs post-norm: the draft's last slot was trained on layer {n - 1}'s output "
                                f"before the final norm (HF {n}) and is fed the post-norm final state")
    return "other_layers", f"a layer mix-up: the draft is fed {f} where it learned {t}"


# ---- figures ------------------------------------------------------------------------------------------

def answer_spans(ids: list, loss_mask: list) -> list:
    """(P, T) of each answer in a sample: a run of loss-masked positions P..T-1 is the assistant's
    answer to the prompt ids[:P] (the prefill's token at P). SpecForge's reader masks the sample's
    last position, so an answer at the end loses that token (its end-of-turn)."""
    out, start = [], None
    for j, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            if j - start >= 2:
                out.append((start, j))
            start = None
    return out


def request_spans(ids: list, loss_mask: list, prompt_answer_tokens: int = 0) -> list:
    """The requests a sample's answers make, (P, T) each: prompt ids[:P], generated ids[P:T] (the
    first of them by the prefill). With ``prompt_answer_tokens`` K the first K tokens of each
    answer (``answer_spans``) go with the prompt: answers that start with tokens the user gave (the
    acceptance run's copy language starts each answer with the symbol to copy from; its data
    server was prompted with it). The prediction replays exactly these requests and ``--serve``
    sends exactly these (``serve_check.requests_of``); an answer left with fewer than two
    generated tokens is dropped by both."""
    k = prompt_answer_tokens
    return [(P + k, T) for P, T in answer_spans(ids, loss_mask) if T - P - k >= 2]


def figures(metas: list, steps: int) -> dict:
    """The chain figures of replayed requests (``chain_replay``'s metas): accept length
    sum(C-1)/sum(V); per position k the rate of draft token k accepted given tokens 1..k-1 were
    and there was room for it (``per_position``), and the share of verifies that accepted at least
    k (``at_least``); the chain prediction at these answer lengths from the per-position rates."""
    acc = [a for m in metas for a in m["accepted"]]
    room = [r for m in metas for r in m["room"]]
    base = lang_mod.served_accept_length(metas)
    per, at_least = [], []
    for k in range(1, steps + 1):
        tried = sum(1 for a, r in zip(acc, room) if a >= k - 1 and r >= k)
        got = sum(1 for a in acc if a >= k)
        per.append(round(got / tried, 4) if tried else None)
        at_least.append(round(got / len(acc), 4) if acc else None)
    rates = [x if x is not None else 0.0 for x in per]
    tokens = [m["completion_tokens"] - 1 for m in metas if m["completion_tokens"] > 1]
    verifies = sum(t / lang_mod.chain_accept_length_at(rates, t) for t in tokens if rates and
                   lang_mod.chain_accept_length_at(rates, t) > 0)
    return {"accept_length": round(base["accept_length"], 4) if base["accept_length"] else None,
            "per_position": per, "at_least": at_least, "requests": base["requests"], "verify_ct": base["verify_ct"],
            "tokens_after_prefill": base["tokens_after_prefill"],
            "chain_at_answer_lengths": round(sum(tokens) / verifies, 4) if verifies else None,
            "chain_unbounded": round(lang_mod.chain_accept_length(rates), 4)}


SAMPLE_FIX = "pass a specforge-format dataset written by tools/extract.py (its samples as it wrote them)"


def check_samples(files: list, target: dict, aux_layers: int) -> None:
    """Each specforge sample of ``files`` as the replay reads it (``train.read_sample``): a torch.save
    dict of ``input_ids`` [T] (token ids of the target's vocabulary), ``loss_mask`` [T],
    ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, aux_layers * H], H the target's
    hidden size; a one-line usage error naming the first file that is not (unreadable, another
    format, another model's width). Read memory-mapped: the states are not loaded."""
    import torch

    H, V = target["hidden_size"], target["vocab_size"]
    for f in files:
        try:
            try:
                d = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # a file torch.save wrote without its zip format cannot be mapped
                if "mmap" not in str(exc):
                    raise
                d = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle, zip and torch's own errors: whatever the bytes are, one line
            raise UsageError(f"--data sample {f} is not a readable torch.save file ({type(exc).__name__})",
                             SAMPLE_FIX) from None
        t = {k: d.get(k) for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")} \
            if isinstance(d, dict) else {}
        if not t or not all(isinstance(v, torch.Tensor) for v in t.values()):
            lack = [k for k, v in t.items() if not isinstance(v, torch.Tensor)] if t else ["a dict of tensors"]
            raise UsageError(f"--data sample {f} holds no {', '.join(lack)}", SAMPLE_FIX)
        ids, mask, hs, aux = t["input_ids"], t["loss_mask"], t["hidden_state"], t["aux_hidden_state"]
        T = ids.shape[0] if ids.dim() == 1 else -1
        want = {"input_ids": (ids, (T,)), "loss_mask": (mask, (T,)), "hidden_state": (hs, (1, T, H)),
                "aux_hidden_state": (aux, (1, T, aux_layers * H))}
        for k, (v, shape) in want.items():
            if T < 1 or tuple(v.shape) != shape:
                raise UsageError(f"--data sample {f}: {k} is {list(v.shape)}, not {list(shape)} (T tokens; a "
                                 f"{H}-wide target, {aux_layers} aux layers as the manifest records)", SAMPLE_FIX)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise UsageError(f"--data sample {f}: input_ids are not token ids of the target's {V}-token vocabulary",
                             SAMPLE_FIX)
        if not (hs.dtype.is_floating_point and aux.dtype.is_floating_point):
            raise UsageError(f"--data sample {f}: the states are {hs.dtype} and {aux.dtype}, not floating point",
                             SAMPLE_FIX)


class Replayer:
    """The draft built from its directory (``train.DraftRun`` with the trained weights), replaying
    samples: the data's own, or ones whose aux states are a reading's slots read from dump files.
    Samples and dumps are read one at a time as the replay goes (a real target's states do not
    fit in memory at once)."""

    def __init__(self, i: Inputs, cfg: dict, target: dict, aux_layers: int, scratch: Path):
        from . import train

        self.i = i
        self.data_files = train.sample_files(Path(i.data))
        if not self.data_files:
            raise UsageError(f"--data {i.data} holds no sample (*.ckpt)", "pass a specforge-format dataset directory "
                             "written by tools/extract.py")
        check_samples(self.data_files, target, aux_layers)
        self._dumps = dump_index(i.states) if i.states else None
        self._held = {}
        fix = "pass a directory as SpecForge or this project's export writes it (config.json and model.safetensors)"
        for f in sorted(Path(i.draft).glob("*.safetensors")):
            _safetensors_names(f, "the draft's weights", fix)
        try:
            self.run = train.DraftRun(head_dir(Path(i.target), scratch / "target"), cfg, i.steps, i.device)
        except (TypeError, ValueError, KeyError, AttributeError, AssertionError) as exc:
            raise UsageError(f"the draft config {i.draft}/config.json does not build SpecForge's "
                             f"LlamaForCausalLMEagle3 ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})",
                             "pass the config.json the draft was trained with") from None
        self.loaded = self.run.load_weights(Path(i.draft))

    def replay(self, samples) -> dict:
        k = self.i.prompt_answer_tokens
        return figures(self.run.chain_replay(samples, None, self.i.steps,
                                             spans=lambda ids, mask: request_spans(ids, mask, k)), self.i.steps)

    def predicted(self) -> dict:
        return self.replay(self.data_files)

    def _dump_of(self, ids: tuple) -> Path | None:
        p = self._dumps.get(ids)
        if p is None:  # a sample cut at max_len: the dump of the whole conversation starts with its ids
            p = next((q for k, q in self._dumps.items() if k[:len(ids)] == ids), None)
        return p

    def _holds(self, p: Path) -> set:
        """The states a dump file yields (its metadata: every dumped layer, and the final state when
        it was dumped; states a compact file left out are rebuilt by the reader)."""
        from .storage_check import header

        if p not in self._held:
            meta = header(p)[1]
            ids = json.loads(meta.get("eagle3_layer_ids") or "[]")
            self._held[p] = {f"layer.{k}" for k in ids} | ({FINAL} if meta.get("final") == "post_norm" else set())
        return self._held[p]

    def reading_samples(self, slots: list) -> tuple[object, str | None]:
        """(samples, None): the data's samples with their aux states replaced by ``slots`` and the
        target (post-norm final) read from the dump files, yielded one at a time; (None, why not)
        when a dump or a state is missing (found from the files' metadata before any replay)."""
        import torch

        from . import train

        need = [state_key(h) for h in slots] + [FINAL]
        pairs = []
        for f in self.data_files:
            ids = tuple(torch.load(f, map_location="cpu", weights_only=True, mmap=True)["input_ids"][:2048].tolist())
            p = self._dump_of(ids)
            if p is None:
                return None, f"no dump file holds the conversation of {len(ids)} tokens starting {list(ids[:6])}"
            lack = [k for k in need if k not in self._holds(p)]
            if lack:
                return None, f"the dump files hold no {', '.join(lack)} (dumped: {', '.join(sorted(self._holds(p)))})"
            pairs.append((f, p))

        def gen():
            from ..storage import Rebuilder
            from .storage_check import read_states

            rebuilder = Rebuilder(Path(self.i.target))
            for f, p in pairs:
                s = train.read_sample(f)
                st = read_states(p, rebuilder)
                T = s["input_ids"].shape[1]
                aux = torch.cat([st[state_key(h)][:T] for h in slots], -1)
                yield dict(s, hidden_state=aux[None], target=st[FINAL][:T][None])

        return gen(), None


def _close(a: dict, b: dict) -> float | None:
    if a.get("accept_length") is None or b.get("accept_length") is None:
        return None
    return round(abs(a["accept_length"] - b["accept_length"]), 4)


def _nearest(rs: list, key: str, tol: float) -> dict | None:
    ok = [r for r in rs if r.get(key) is not None and r[key] <= tol]
    return min(ok, key=lambda r: r[key]) if ok else None


def diagnose(rs: list, gap_ok: bool, n: int, tol: float) -> dict:
    """From the replayed readings ``rs`` (each with ``minus_predicted`` and ``minus_observed``: the
    distance of its accept length from the prediction's and the observed one's): the reading the
    draft was trained on (nearest the prediction, within ``tol``), the one it is fed (nearest the
    observed figures), and the mix-up between them."""
    trained = _nearest(rs, "minus_predicted", tol)
    fed = _nearest(rs, "minus_observed", tol)
    out = {"trained_reading": trained and trained["names"], "fed_reading": fed and fed["names"]}
    also = [r["names"][0] for r in rs if fed is not None and r is not fed and r.get("minus_observed") is not None
            and r["minus_observed"] <= tol]
    if also:
        out["fed_reading_also_within_tolerance"] = also
    if gap_ok:
        out.update(cause="none", text="the observed accept length is within the tolerance of the prediction")
    elif trained is None:
        out.update(cause="unexplained", text="the prediction matches none of the replayed readings within %s: the held-out "
                   "data holds states the dump files do not (a reading outside the ones replayed)" % tol)
    elif fed is None:
        near = min((r for r in rs if r.get("minus_observed") is not None), key=lambda r: r["minus_observed"],
                   default=None)
        out.update(cause="unexplained", text="no replayed reading accepts what was observed within %s%s: the gap is no "
                   "layer mix-up replayed here (the tree settings, numerics, the server's own draft code)"
                   % (tol, "" if near is None else " (nearest: %s, %.3f off)" % (near["names"][0], near["minus_observed"])))
    else:
        cause, text = relation(trained["slots"], fed["slots"], n)
        same = [nm for k, nm in zip(fed["kinds"][1:], fed["names"][1:]) if k != "config"]
        if cause != "none" and "as_trained" not in fed["kinds"] and same:  # other mix-ups that feed these states
            text += " (the same states as: %s)" % "; ".join(same)
        out.update(cause=cause, text=text)
    return out


def outcome(res: dict) -> tuple[int, str]:
    """(exit code, the one line): 0 guard passes and the observed accept length is within the
    tolerance of the prediction; 1 otherwise, naming each cause and the diagnosis."""
    bad = []
    if not res["guard"]["ok"]:
        rel = res.get("release") or {}
        on = ("sglang %s %s" % (rel["release"], "unpatched" if rel.get("unpatched") else "with the series")
              if rel.get("release") else "this release")
        bad.append("guard: the draft's config does not read the data's layers on %s" % on)
    o, p = res["observed"]["accept_length"], res["predicted"]["accept_length"]
    head = "%s %.3f vs predicted %.3f" % (res["observed"]["kind"], o, p)
    if not res["within_tolerance"]:
        bad.append("%s: differs by %.3f > %s; %s" % (head, abs(o - p), res["tolerance"], res["diagnosis"]["text"]))
    ob = res["observed"]
    eq, n = ob.get("answers_equal_to_data"), ob.get("requests_compared")
    same = "" if eq is None else "; %d of %d served answers equal the held-out data's" % (eq, n)
    if res["inputs"].get("lossless") and eq is not None and eq < n:
        firsts = sorted(d["at"] for d in ob.get("first_difference_at") or [])[:5]
        bad.append("lossless: %d of %d served answers differ from the held-out data's, which are the target's greedy "
                   "output (speculative decoding changed them; first differences at answer tokens %s)"
                   % (n - eq, n, firsts))
    if bad:
        return 1, "failed: " + "; ".join(bad) + ("" if "lossless" in bad[-1] else same)
    return 0, "passed: %s (within %s)%s" % (head, res["tolerance"], same)


def check(i: Inputs, say=print, serving=None) -> dict:
    """Every step in turn (see the module docstring); the result the report is written from.
    ``serving`` (``serve_check.Serving``): started once the inputs are checked and the draft's
    weights loaded (its server starts while the prediction runs), finished after the prediction
    (the path of the figures it wrote, read back as ``--served``'s are), stopped whatever happens.
    A scratch directory (``head_dir``'s view of a single-file target) is removed at the end."""
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="eaglepatch-check-draft-"))
    try:
        return _check(i, say, serving, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if serving is not None:
            serving.stop()


def _check(i: Inputs, say, serving, scratch: Path) -> dict:
    from .. import conventions, guard

    import warnings

    warnings.filterwarnings("ignore", message="flash_attn is not found")  # SpecForge's; the replay runs sdpa
    tcfg = target_config(i.target)
    dcfg = draft_config(i.draft, tcfg)
    n = tcfg["num_hidden_layers"]
    draft = guard.read_draft(i.draft)
    data = guard.read_dataset(i.data)
    if i.release is None:  # the library called without a release: as the tool judges it
        i.release, i.release_from = guard.judged_release(data, None)
    release = {"release": i.release, "from": i.release_from, "unpatched": i.unpatched,
               "line": guard.release_line(i.release, i.release_from, i.unpatched)}
    if data.dataset_format not in (None, "specforge"):
        raise UsageError(f"--data {i.data} is a {data.dataset_format} dataset; the replay reads specforge-format "
                         f"samples", "extract the held-out conversations with tools/extract.py --format specforge")
    if i.served and serving is not None:
        raise UsageError("--serve and --served both give served figures", "pass one of them")
    served = read_served(i.served, i.steps, i.lossless) if i.served else None
    if served is None and serving is None and i.states is None:
        raise UsageError("nothing to compare the prediction with", "pass --states DIR (the held-out conversations' "
                         "dump files: the draft is replayed on what the release feeds it), --served FILE (a GPU "
                         "serving run's figures) or --serve (serve it on the GPU)")
    if i.lossless and served is None and serving is None:
        raise UsageError("--lossless compares served answers with the held-out data's, and nothing is served",
                         "add --serve (GPU) or --served FILE, or drop --lossless")
    sem = guard.release_semantics(i.release, unpatched=i.unpatched)
    guard.check_storage(draft, data)
    gv = guard.check(draft, data, sem)
    if len(data.layer_ids) != 3:
        raise UsageError(f"--data {i.data} holds {len(data.layer_ids)} aux layers (EAGLE-3 ids {data.layer_ids}); "
                         f"SpecForge's draft, which the replay runs, takes exactly three",
                         "extract the held-out conversations with three --aux-layers, the draft's")
    res = {"release": release, "inputs": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(i).items()},
           "target": {"num_hidden_layers": n, "hidden_size": tcfg["hidden_size"]},
           "guard": {"ok": gv.ok, "served_hf": gv.served_hf, "lines": gv.lines, "reading": sem.source},
           "data": {"hf": data.hf, "layer_ids": data.layer_ids, "format": data.dataset_format}}
    rep = Replayer(i, dcfg, tcfg, len(data.layer_ids), scratch)
    if serving is not None:  # the inputs are checked and the draft's weights fit: the server starts
        serving.start()      # while the readings are checked and the prediction runs
    res["draft"] = {"config_ids": draft.layer_ids, "family": draft.family, "weights": rep.loaded}
    config_hf = gv.served_hf if draft.family == guard.EAGLE_CONFIG else None
    series_rule = conventions.release_rule(i.release) if not i.unpatched else sem.rule
    try:
        upstream_rule = conventions.release_rule(i.release, unpatched=True)
    except UsageError:
        upstream_rule = sem.rule
    # which readings the dump files can give, from their metadata: refused before any replay when
    # the one the release feeds the draft is not among them (and no --served figures stand in)
    rs = readings(data.hf, n, config_hf, upstream_rule, series_rule, i.release) if i.states else []
    todo = {}
    for k, r in enumerate(rs):
        r["hf"] = [slot_name(s) for s in r["slots"]]
        samples, why = rep.reading_samples(r["slots"])
        if why:
            r["not_replayed"] = why
        else:
            todo[k] = samples
    cfg_r = next((r for r in rs if "config" in r["kinds"]), None)
    if served is None and serving is None and (cfg_r is None or cfg_r.get("not_replayed")):
        why = (cfg_r or {}).get("not_replayed") or "it reads the draft's config as no layers the target has"
        raise UsageError(f"the draft cannot be replayed on what sglang {i.release} feeds it ({why})",
                         "dump the layers it is fed and the final state (tools/serve.py --layers, --final 1) or "
                         "pass --served FILE")
    say(release["line"])  # every input checked: from here on a refusal is no usage error
    pred = rep.predicted()
    if pred["accept_length"] is None:
        raise UsageError(f"--data {i.data} holds no answer of two tokens or more (loss-masked runs) to replay",
                         "pass held-out conversations with assistant answers")
    pred["how"] = ("the draft's own TTT forward over the held-out data (%d samples), greedy chain acceptance"
                   % len(rep.data_files))
    res["predicted"] = pred
    say("guard: " + ("OK" if gv.ok else "MISMATCH") + " (%s): data HF %s, draft served HF %s"
        % (sem.source, data.hf, gv.served_hf))
    say("predicted: accept length %.3f, per position %s (chain at the answer lengths %s)"
        % (pred["accept_length"], pred["per_position"], pred["chain_at_answer_lengths"]))
    if serving is not None:
        served = read_served(serving.finish(), i.steps, i.lossless)
    for k, samples in todo.items():
        rs[k].update(rep.replay(samples))
        rs[k]["minus_predicted"] = _close(rs[k], pred)
    if served is not None:
        observed = dict(served, kind="served")
    else:
        observed = {k: cfg_r.get(k) for k in ("accept_length", "per_position", "at_least", "requests", "verify_ct",
                                               "tokens_after_prefill")}
        observed.update(kind="replayed", how=REPLAYED, hf=cfg_r["hf"])
    res["observed"] = observed
    for r in rs:
        if "accept_length" in r:
            r["minus_observed"] = _close(r, observed)
    res["readings"] = rs
    gap = round(observed["accept_length"] - pred["accept_length"], 4)
    res.update(observed_minus_predicted=gap, tolerance=i.tolerance, within_tolerance=abs(gap) <= i.tolerance)
    say("%s: accept length %.3f, per position %s" % (observed["kind"], observed["accept_length"],
                                                      observed.get("per_position")))
    res["diagnosis"] = diagnose([r for r in rs if "accept_length" in r], res["within_tolerance"], n, i.tolerance)
    if not rs:
        res["diagnosis"]["note"] = "no reading replayed: pass --states with the held-out conversations' dump files"
    return res


# ---- DFlash and DSpark drafts: the layer verdict only ------------------------------------------------------

# what check_draft does not check for a DFlash/DSpark draft, said in its report and on its last line
BLOCK_NOT_CHECKED = ("the accept length: check_draft replays EAGLE-3 drafts only (SpecForge's LlamaForCausalLMEagle3 "
                     "forward over the held-out data); a DFlash/DSpark draft's block prediction is not replayed and "
                     "nothing is served, so no prediction, observed figure or diagnosis is made; its block_size, "
                     "mask_token_id and weights are read or left as they are, not checked")
# the flags of the measured part, refused for a DFlash/DSpark draft (nothing would read them)
MEASURED_FLAGS = ("--states", "--served", "--serve", "--lossless", "--prompt-answer-tokens")


def target_text_config(target: Path) -> dict:
    """The target's config.json as a dict (a one-line usage error otherwise); its weights are not needed."""
    cfg = _json(Path(target) / "config.json", "the target config", TARGET_FIX)
    if not isinstance(cfg, dict):
        raise UsageError(f"the target config {target}/config.json is no JSON object", TARGET_FIX)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for k in ("num_hidden_layers", "hidden_size"):
        _int_field(text, k, f"the target config {target}/config.json", TARGET_FIX)
    return cfg


def target_cell(cfg: dict, data, target: Path) -> str:
    """The readings table's cell of the target (its config's architectures), which must be the one the
    dataset records where it records one."""
    from .. import conventions

    cell = conventions.config_cell(cfg)
    rec = conventions.target_cell([data.architecture]) if data.architecture else data.model_file
    if rec is not None and rec != cell:
        raise UsageError(f"--data {data.path} was dumped from a target served by {conventions.CELL_NAMES[rec]}, "
                         f"--target {target} is served by {conventions.CELL_NAMES[cell]}",
                         "pass the target the dataset was dumped from")
    return cell


def check_block(i: Inputs, draft, data, cfg: dict) -> dict:
    """The report for a DFlash/DSpark draft: guard's layer verdict (``guard.check_block``) for the
    release judged (as for EAGLE-3 drafts) on the target's model file, the readings table, and what
    is not checked (``BLOCK_NOT_CHECKED``)."""
    from .. import conventions, guard

    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = text["num_hidden_layers"]
    if data.num_layers != n:
        raise UsageError(f"--data {data.path} records {data.num_layers} decoder layers, the target {n}",
                         "pass the dataset dumped from this target")
    cell = target_cell(cfg, data, i.target)
    release = {"release": i.release, "from": i.release_from, "unpatched": i.unpatched,
               "line": guard.release_line(i.release, i.release_from, i.unpatched)}
    v = guard.check_block(draft, data, i.release, cell, i.unpatched)
    table, rows = guard.readings(draft, data, (i.release, cell, i.unpatched))
    served = v.servers["sglang"]
    return {"release": release, "family": draft.family, "model_file": cell,
            "inputs": {k: (str(v_) if isinstance(v_, Path) else v_) for k, v_ in vars(i).items()},
            "target": {"num_hidden_layers": n, "hidden_size": text["hidden_size"],
                       "architectures": cfg.get("architectures")},
            "guard": {"ok": v.ok, "served_hf": served.get("served_hf"), "lines": v.lines,
                      "reading": f"sglang {i.release} {conventions.CELL_NAMES[cell]}, series manifest draft_readings",
                      **({"not_served": served["not_served"]} if served.get("not_served") else {})},
            "data": {"hf": data.hf, "layer_ids": data.layer_ids, "format": data.dataset_format,
                     "family": data.family},
            "draft": {"config_ids": draft.layer_ids, "ids_from": draft.ids_field, "family": draft.family,
                      "block_size": draft.block_size, "mask_token_id": draft.mask_token_id},
            "readings": rows, "readings_lines": table, "not_checked": BLOCK_NOT_CHECKED}


def block_outcome(res: dict) -> tuple[int, str]:
    """(exit code, the one line) of a DFlash/DSpark report: the layer verdict alone decides."""
    from .. import conventions

    rel = res["release"]
    on = "sglang %s %s on %s" % (rel["release"], "unpatched" if rel.get("unpatched") else "with the series",
                                 conventions.CELL_NAMES[res["model_file"]])
    name = conventions.FAMILY_NAMES[res["family"]]
    if res["guard"]["ok"]:
        return 0, (f"passed: guard: the {name} draft's config reads the data's layers on {on} (the layers only: the "
                   f"accept length is not checked for {name} drafts)")
    why = res["guard"].get("not_served") or "the draft's config does not read the data's layers"
    return 1, f"failed: guard: {why} ({on}; the accept length is not checked for {name} drafts)"


# ---- the picture ----------------------------------------------------------------------------------------

def plot(res: dict, path: Path) -> str:
    """A PNG of the per-position accept rates, predicted vs observed, each replayed reading faint
    beside them; matplotlib when it is installed, else PIL's drawing. Returns what drew it; raises
    ImportError when neither is installed."""
    steps = len(res["predicted"]["per_position"])
    xs = list(range(1, steps + 1))
    lines = [("predicted", res["predicted"]["per_position"], (31, 119, 180), 3),
             (res["observed"]["kind"], res["observed"].get("per_position"), (214, 39, 40), 3)]
    for r in res.get("readings", []):
        if r.get("per_position") and "config" not in r["kinds"]:
            lines.append((r["kinds"][0], r["per_position"], (150, 150, 150), 1))
    lines = [(n, [None if y is None else float(y) for y in ys], c, w) for n, ys, c, w in lines if ys]
    title = "per-position acceptance: predicted %.3f vs %s %.3f" % (
        res["predicted"]["accept_length"], res["observed"]["kind"], res["observed"]["accept_length"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for n, ys, c, w in lines:
            ax.plot(xs, ys, marker="o", color=tuple(v / 255 for v in c), linewidth=w, label=n)
        ax.set(xlabel="draft position k", ylabel="accepted | 1..k-1 accepted", ylim=(0, 1.05), title=title)
        ax.set_xticks(xs)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, format="png")
        plt.close(fig)
        return "matplotlib"
    except ImportError:
        pass
    from PIL import Image, ImageDraw

    W, H, L, R, T, B = 640, 420, 60, 150, 40, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), title, fill="black")
    d.rectangle([L, T, W - R, H - B], outline="black")

    def at(k, y):
        x = L + (W - R - L) * ((k - 1) / max(steps - 1, 1) if steps > 1 else 0.5)
        return x, T + (H - B - T) * (1 - y / 1.05)

    for y in (0, 0.25, 0.5, 0.75, 1.0):
        d.text((L - 35, at(1, y)[1] - 5), "%.2f" % y, fill="black")
    for k in xs:
        d.text((at(k, 0)[0] - 3, H - B + 5), str(k), fill="black")
    d.text((L + 100, H - 20), "draft position k (accepted given 1..k-1 accepted)", fill="black")
    for j, (n, ys, c, w) in enumerate(sorted(lines, key=lambda t: t[3])):
        pts = [at(k, y) for k, y in zip(xs, ys) if y is not None]
        if len(pts) > 1:
            d.line(pts, fill=c, width=w)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
    for j, (n, ys, c, w) in enumerate(lines):
        d.line([W - R + 10, T + 15 * j + 6, W - R + 30, T + 15 * j + 6], fill=c, width=w)
        d.text((W - R + 35, T + 15 * j), n[:18], fill="black")
    img.save(path, format="PNG")
    return "PIL"
