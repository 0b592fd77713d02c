"""Reading the spy's records and the dump files, and judging them against the reference.

Pure torch: runs on the GPU machine after the engines stopped, and in the CPU tests.

- ``load_records(dir)``: the spy's records, in the order each process wrote them.
- ``check_capture(records, requests, ref_states, ids)``: target EXTEND records (what the target
  captured for the draft in prefill) per request vs the reference (check a).
- ``check_draft(records, requests, ref_fn, ids)``: target TARGET_VERIFY records (graph-replayed
  verify) vs the reference for the same tokens, and every row the draft received (``draft``
  records) found bit for bit in the target output that preceded it (check b).
- ``check_dump(dir, requests, ref_states, ids, ...)``: one file per request with the right
  tensors and metadata, every state vs the reference (check c).
- ``check_probe(records, requests, ref_states)``: the layer-input probe (0.5.9's capture point)
  with and without the all-reduce completed (check d).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import UsageError
from ..extract.dumps import BadDump, load_dump
from ..storage import Rebuilder
from .criterion import TOL, compare, merge


def load_records(spy_dir: Path) -> list[dict]:
    recs = []
    for p in sorted(Path(spy_dir).glob("*.pt")):
        recs.append(torch.load(p, map_location="cpu", weights_only=False))
    recs.sort(key=lambda r: (r["pid"], r["seq"]))
    return recs


def overlays(recs) -> list:
    """The capture packages the recording processes had loaded (the spy's ``overlay``: '<module>:<DELIVERY>',
    None for none), sorted; "unknown" for a record of a spy before it said."""
    return sorted({r.get("overlay", "unknown") for r in recs}, key=lambda x: (x is not None, str(x)))


def hook_notes(spy_dir: Path) -> dict:
    out = {}
    for p in sorted(Path(spy_dir).glob("hooks-*.txt")):
        out[p.stem.split("-", 1)[1]] = p.read_text().splitlines()
    return out


@dataclass
class Verdict:
    name: str
    passed: bool
    figure: str
    detail: str = ""
    comparisons: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "figure": self.figure, "detail": self.detail,
                "comparisons": [c.as_dict() for c in self.comparisons], "facts": self.facts}


def _segments(rec) -> list[tuple[int, int]]:
    """(start, length) of each request's rows in a record."""
    rows = rec["hidden"].shape[0]
    if rec["mode"] == "TARGET_VERIFY" or rec["mode"].startswith("DRAFT_EXTEND"):
        bs = len(rec["req_pool_indices"])
        if bs == 0 or rows % bs:
            raise ValueError("%s record with %d rows for %d requests" % (rec["mode"], rows, bs))
        n = rows // bs
        return [(i * n, n) for i in range(bs)]
    lens = rec.get("extend_seq_lens")
    if lens is None:
        raise ValueError("EXTEND record without extend_seq_lens")
    out, start = [], 0
    for n in lens:
        out.append((start, int(n)))
        start += int(n)
    if start != rows:
        raise ValueError("EXTEND record: extend_seq_lens add up to %d, %d rows" % (start, rows))
    return out


def _columns(hidden: torch.Tensor, count: int) -> list[torch.Tensor]:
    if hidden.shape[-1] % count:
        raise ValueError("hidden width %d is not %d equal parts" % (hidden.shape[-1], count))
    w = hidden.shape[-1] // count
    return [hidden[:, i * w:(i + 1) * w] for i in range(count)]


def extend_requests(rec, prompts) -> list[tuple[int | None, int, int]]:
    """(request index or None, start, length) for each request of an EXTEND record (target or probe)."""
    index = {tuple(p): i for i, p in enumerate(prompts)}
    ids = rec["input_ids"].tolist()
    return [(index.get(tuple(ids[s:s + n])), s, n) for s, n in _segments(rec)]


def check_capture(name: str, records, prompts, refs, ids, tol: float = TOL) -> Verdict:
    """Every request's rows in the target EXTEND records vs the reference, per EAGLE id."""
    comps, forwards, unmatched = [], [], 0
    seen = set()
    for rec in records:
        if rec["kind"] != "target" or rec["mode"] != "EXTEND":
            continue
        cols = _columns(rec["hidden"], len(ids))
        matched = 0
        for r, s, n in extend_requests(rec, prompts):
            if r is None:
                unmatched += 1
                continue
            matched += 1
            seen.add(r)
            for j, k in enumerate(ids):
                comps.append(compare("request %d (%d tokens) layer %d" % (r, n, k), cols[j][s:s + n],
                                     refs[r]["layer.%d" % k], tol))
        if matched:
            forwards.append(int(rec["hidden"].shape[0]))
    missing = [i for i in range(len(prompts)) if i not in seen]
    m = merge(name, comps)
    problems = []
    if missing:
        problems.append("no capture for requests %s" % missing)
    if not m.passed:
        bad = [c.line() for c in comps if not c.passed][:4]
        problems.append("rows off the reference: " + "; ".join(bad))
    detail = "%d requests in forwards of %s tokens; ids %s; %s" % (
        len(seen), forwards, list(ids), m.line())
    if unmatched:
        detail += "; %d extend segments of other requests ignored" % unmatched
    return Verdict(name, not problems, "max row error %.3g" % m.max_err,
                   ("; ".join(problems) + " | " if problems else "") + detail, comps,
                   {"forward_tokens": forwards, "requests": len(seen)})


def check_draft(name: str, records, prompts, outputs, ref_fn: Callable, ids, tol: float = TOL) -> Verdict:
    """Graph-replayed verify rows vs the reference for the same tokens; the draft's inputs found
    bit for bit in the target output that preceded them.

    ``ref_fn(tokens)`` -> reference states of a token sequence; ``outputs[i]`` the generated ids of
    request i (prompt + outputs is the committed sequence)."""
    full = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    pool_to_req: dict = {}
    comps, problems = [], []
    verify_graph = verify_eager = 0
    last_target: dict = {}
    draft_stats = {"prefill": 0, "decode": 0, "graph": 0, "rows": 0, "rows_not_from_target": 0}
    for rec in records:
        pid = rec["pid"]
        if rec["kind"] == "target":
            last_target[pid] = rec
            if rec["mode"] == "EXTEND":
                for (r, _, _), rpi in zip(extend_requests(rec, prompts), rec["req_pool_indices"].tolist()):
                    pool_to_req[rpi] = r
                continue
            if rec["mode"] != "TARGET_VERIFY":
                continue
            if rec.get("graph"):
                verify_graph += 1
            else:
                verify_eager += 1
            cols = _columns(rec["hidden"], len(ids))
            toks = rec["input_ids"].tolist()
            pos = rec["positions"].tolist()
            for (s, n), rpi in zip(_segments(rec), rec["req_pool_indices"].tolist()):
                r = pool_to_req.get(rpi)
                if r is None:
                    continue
                p0 = pos[s]
                if pos[s:s + n] != list(range(p0, p0 + n)):
                    problems.append("verify positions of request %d are not consecutive: %s" % (r, pos[s:s + n]))
                    continue
                if p0 >= len(full[r]) or full[r][p0] != toks[s]:
                    problems.append("verify block of request %d starts with token %d at position %d, the "
                                    "committed sequence has %s" % (r, toks[s], p0,
                                                                   full[r][p0] if p0 < len(full[r]) else "nothing"))
                    continue
                ref = ref_fn(full[r][:p0] + toks[s:s + n])
                for j, k in enumerate(ids):
                    comps.append(compare("verify request %d positions %d..%d layer %d" % (r, p0, p0 + n - 1, k),
                                         cols[j][s:s + n], ref["layer.%d" % k][p0:p0 + n], tol))
        elif rec["kind"] == "draft":
            t = last_target.get(pid)
            kind = "prefill" if rec["mode"] == "EXTEND" else "decode"
            draft_stats[kind] += 1
            draft_stats["graph"] += bool(rec.get("graph"))
            rows = rec["hidden"]
            draft_stats["rows"] += int(rows.shape[0])
            if t is None:
                draft_stats["rows_not_from_target"] += int(rows.shape[0])
                continue
            have = {bytes(row.contiguous().view(torch.uint8).numpy()) for row in t["hidden"]}
            miss = sum(bytes(row.contiguous().view(torch.uint8).numpy()) not in have for row in rows)
            draft_stats["rows_not_from_target"] += int(miss)
    m = merge(name, comps)
    if verify_graph == 0:
        problems.append("no target verify forward ran in a CUDA graph (%d eager)" % verify_eager)
    if not comps:
        problems.append("no verify rows could be checked")
    if not m.passed:
        problems.append("verify rows off the reference: " + "; ".join(c.line() for c in comps if not c.passed)[:600])
    if draft_stats["prefill"] == 0 or draft_stats["decode"] == 0:
        problems.append("the draft received %d prefill and %d decode inputs (want both)" % (
            draft_stats["prefill"], draft_stats["decode"]))
    if draft_stats["rows_not_from_target"]:
        problems.append("%d of %d rows the draft received are not rows the target produced just before" % (
            draft_stats["rows_not_from_target"], draft_stats["rows"]))
    detail = ("verify forwards: %d graph-replayed, %d eager; %d verify blocks checked; draft inputs: %d prefill, "
              "%d decode (%d through its CUDA graph), %d rows, all taken from the target's output: %s; %s" % (
                  verify_graph, verify_eager, len(comps) // max(len(ids), 1), draft_stats["prefill"],
                  draft_stats["decode"], draft_stats["graph"], draft_stats["rows"],
                  "yes" if not draft_stats["rows_not_from_target"] else "NO", m.line()))
    return Verdict(name, not problems, "max row error %.3g" % m.max_err,
                   ("; ".join(problems) + " | " if problems else "") + detail, comps,
                   dict(draft_stats, verify_graph=verify_graph, verify_eager=verify_eager))


def request_key(rid) -> str:
    """A dump file's key: sha256 of its request id (written here, not taken from the series)."""
    import hashlib

    return hashlib.sha256(str(rid).encode("utf-8")).hexdigest()


def check_dump(name: str, directory: Path, prompts, refs, ids, expect_meta: dict, rids, tol: float = TOL) -> Verdict:
    """One file per request (``rids``: each request's id), nothing else in the directory, every
    state vs the reference.

    Each file is read and checked by ``extract.dumps.load_dump`` (format, key, input_ids, token
    count, HF indices, tensor set with ``final``, shapes, dtypes); on top: the stored ids are
    ``ids``, the metadata names the request id, matches ``expect_meta`` and names the sglang and
    series versions. A compact (``eagle3-dump/2``) file's left-out states are rebuilt from the
    weights in ``expect_meta["model_path"]``."""
    directory = Path(directory)
    keys = [request_key(r) for r in rids]
    if len(set(keys)) != len(keys):
        raise ValueError("check_dump: request ids repeat: %s" % list(rids))
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    want = {k + ".safetensors" for k in keys}
    problems = []
    missing = [k[:12] for k in keys if k + ".safetensors" not in names]
    extra = [n for n in names if n not in want]
    if missing:
        problems.append("missing files for %d of %d requests: %s" % (len(missing), len(keys), missing[:4]))
    if extra:
        problems.append("unexpected files: %s" % extra[:4])
    comps = []
    tensor_names = {"input_ids"} | {"layer.%d" % k for k in ids} | {"final"}
    hidden = expect_meta.get("hidden_size")
    # a compact dump's left-out states are rebuilt from the checkpoint's weights (read only if needed)
    rebuilder = Rebuilder(expect_meta["model_path"]) if expect_meta.get("model_path") else None
    for i, (ids_, key, rid) in enumerate(zip(prompts, keys, rids)):
        path = directory / (key + ".safetensors")
        if not path.is_file():
            continue
        try:
            d = load_dump(path, ids_, hidden_size=int(hidden) if hidden is not None else None, need_final=True,
                          key=key, rebuilder=rebuilder)
        except (BadDump, UsageError) as exc:
            problems.append("request %d: %s" % (i, exc))
            continue
        if d.layer_ids != list(ids):
            problems.append("request %d: metadata eagle3_layer_ids=%s, want %s" % (i, d.layer_ids, list(ids)))
            continue
        for mk, mv in dict(expect_meta, rid=str(rid)).items():
            if d.meta.get(mk) != mv:
                problems.append("request %d: metadata %s=%r, want %r" % (i, mk, d.meta.get(mk), mv))
        for mk in ("sglang_version", "series_version"):
            if not d.meta.get(mk):
                problems.append("request %d: metadata %s missing" % (i, mk))
        tensors = dict(d.layers, final=d.final)
        for tn in sorted(tensor_names - {"input_ids"}):
            comps.append(compare("request %d (%d tokens) %s" % (i, len(ids_), tn), tensors[tn], refs[i][tn], tol))
    m = merge(name, comps)
    if not m.passed:
        problems.append("states off the reference: " + "; ".join(c.line() for c in comps if not c.passed)[:600])
    detail = "%d requests, %d files; tensors %s; %s" % (len(keys), len(names), sorted(tensor_names), m.line())
    return Verdict(name, not problems, "max row error %.3g" % m.max_err,
                   ("; ".join(problems) + " | " if problems else "") + detail, comps,
                   {"files": len(names), "requests": len(keys)})


def dump_states(directory: Path, rids) -> list[dict]:
    """{tensor name: tensor} of each request's dump (missing files give {})."""
    from safetensors.torch import load_file

    out = []
    for r in rids:
        path = Path(directory) / (request_key(r) + ".safetensors")
        out.append(load_file(str(path)) if path.is_file() else {})
    return out


def compare_runs(name: str, got: list[dict], base: list[dict], tol: float = TOL) -> Verdict:
    """Two runs' states of the same requests (e.g. TP=2 vs TP=1), per request and tensor."""
    comps, problems = [], []
    for i, (g, b) in enumerate(zip(got, base)):
        shared = sorted((set(g) & set(b)) - {"input_ids"})
        if not shared:
            problems.append("request %d: nothing to compare" % i)
        for tn in shared:
            comps.append(compare("request %d %s" % (i, tn), g[tn], b[tn].float(), tol))
    m = merge(name, comps)
    if not m.passed:
        problems.append("; ".join(c.line() for c in comps if not c.passed)[:600])
    return Verdict(name, not problems and bool(comps), "max row error %.3g" % m.max_err,
                   ("; ".join(problems) + " | " if problems else "") + m.line(), comps)


def draft_prefill_inputs(records, prompts, ids) -> list[dict]:
    """{"layer.k": rows} the draft received in prefill, per request (from target EXTEND records,
    which the draft records were checked to equal)."""
    out = [dict() for _ in prompts]
    for rec in records:
        if rec["kind"] != "target" or rec["mode"] != "EXTEND":
            continue
        cols = _columns(rec["hidden"], len(ids))
        for r, s, n in extend_requests(rec, prompts):
            if r is not None:
                for j, k in enumerate(ids):
                    out[r]["layer.%d" % k] = cols[j][s:s + n]
    return out


def check_probe(name: str, records, prompts, refs, tol: float = TOL) -> tuple[Verdict, Verdict]:
    """The layer-input probe: (without the fix: must FAIL where the previous layer deferred its
    all-reduce; with the fix: must pass everywhere)."""
    raw, fixed, flagged_layers = [], [], set()
    for rec in records:
        if rec["kind"] != "probe":
            continue
        i = rec["layer_index"]
        k = i - 1  # the input of layer i is the output of layer i-1 (EAGLE id i-1)
        for r, s, n in extend_requests(rec, prompts):
            if r is None:
                continue
            if rec["flagged"]:
                flagged_layers.add(k)
            ref = refs[r]["layer.%d" % k]
            tag = "request %d layer %d%s" % (r, k, " (previous layer deferred its all-reduce)" if rec["flagged"] else "")
            raw.append((rec["flagged"], compare(tag, rec["hidden"][s:s + n], ref, tol)))
            fixed.append(compare(tag, rec["fixed"][s:s + n], ref, tol))
    deferred = [c for f, c in raw if f]
    plain = [c for f, c in raw if not f]
    m_fixed = merge(name + " (fix)", fixed)
    caught = bool(deferred) and all(not c.passed for c in deferred) and all(c.passed for c in plain)
    worst_wrong = min((c.max_err for c in deferred), default=0.0)
    v_unfixed = Verdict(
        name + ": without the fix the check fails", caught,
        "smallest max row error of a deferred layer %.3g (tol %g)" % (worst_wrong, tol),
        "layers whose producer deferred its all-reduce: %s; %d probes there, %d failing; %d probes elsewhere, "
        "%d passing" % (sorted(flagged_layers), len(deferred), sum(not c.passed for c in deferred), len(plain),
                        sum(c.passed for c in plain)),
        [c for _, c in raw])
    v_fixed = Verdict(name + ": with the all-reduce completed at the capture point", bool(fixed) and m_fixed.passed,
                      "max row error %.3g" % m_fixed.max_err, m_fixed.line(), fixed)
    return v_unfixed, v_fixed


__all__ = ["request_key", "load_records", "hook_notes", "Verdict", "check_capture", "check_draft", "check_dump",
           "dump_states", "compare_runs", "draft_prefill_inputs", "check_probe", "extend_requests"]
