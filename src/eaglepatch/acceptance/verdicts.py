"""The acceptance run's verdicts, from its figures alone (pure Python: the tests feed these
functions mutated results and read the cause each failure names).

- ``drafts_verdict``: whether the drafts trained what they were configured to (``measured``). A
  draft cut by the run's budget has no figure worth reporting: its accept length would be the
  cut's, not the layers' (a CPU toy whose drafts trained 11 of 150 steps reported every accept
  length as 1.0).
- ``served_verdict`` (GPU): each draft served by a real server. Passes when the issue's
  thresholds hold (``GPU_LIMITS``), every served request's output equals the no-speculation greedy
  one (``lossless_requests`` == ``requests``, for every draft: speculative decoding must not change
  greedy output, whatever the draft) and the upstream-ids control (unpatched SGLang, upstream's
  ids for the same layers) accepts what the correct draft accepts, within ``GPU_LIMITS
  ["upstream_ids_minus_correct"]``.
- ``replayed_verdict`` (CPU): no server loads a draft there (sglang 0.5.9 runs no EAGLE-3 decoding
  on CPU); each control's chain acceptance is replayed with SpecForge's TTT forward over the
  data its reading serves. It shows what a layer mix-up costs the same weights (the ordering), not
  that serving works: a tree whose draft-serving code raises at first use replays the same.
- ``outcome``: the run's exit code and its one line.
"""

from __future__ import annotations

from . import language as lang_mod

# the thresholds on the GPU: |served - predicted|, correct - off_by_one, correct - floor; and
# how far the upstream-ids control may be from the correct draft (the same layers reach the draft,
# so the same outputs: the H200 run had 1314 verifies each; 0.05 allows batch-order noise only)
GPU_LIMITS = {"served_minus_predicted": 0.15, "correct_minus_off_by_one": 0.5, "correct_minus_floor": 0.3,
              "upstream_ids_minus_correct": 0.05}
REPLAY_NOTE = ("replayed, not served: no server loaded a draft (sglang 0.5.9 runs no EAGLE-3 decoding on CPU); "
               "SpecForge's TTT forward over the data each control's reading serves")


def _r(x: float) -> float:
    return round(x, 4)


def drafts_verdict(correct: dict, floor: dict | None = None, configured_steps: int | None = None,
                   configured_s: float | None = None) -> dict:
    """``correct`` and ``floor``: each draft's training record (``DraftRun.train``: steps,
    stopped_by, budget_s; the floor None before it trains). ``configured_steps``: the correct
    draft's configured steps (``draft_max_steps``; None when its seconds decide, ``configured_s``).
    The floor is configured to the correct draft's steps. ``measured`` is False, with the verdict
    ``not measured: drafts trained N of M steps (budget)``, when the run's budget stopped either
    short of that."""
    steps = {"correct": correct["steps"], "floor": floor["steps"] if floor else None}
    v = {"same_steps": steps["correct"] == steps["floor"], "steps": steps, "configured_steps": configured_steps,
         "measured": True}
    cut = None
    if correct.get("stopped_by") == "budget":
        if configured_steps:
            cut = "%d of %d steps" % (correct["steps"], configured_steps)
        elif configured_s is not None and correct.get("budget_s") is not None \
                and correct["budget_s"] < configured_s - 1e-6:
            cut = "for %.0f of %.0f s" % (correct["budget_s"], configured_s)
    if cut is None and floor and floor.get("stopped_by") == "budget" and floor["steps"] < correct["steps"]:
        cut = "%d of %d steps" % (floor["steps"], correct["steps"])
    if cut is not None:
        v.update(measured=False, verdict="not measured: drafts trained %s (budget)" % cut)
    elif v["same_steps"]:
        v["verdict"] = "trained %d steps each" % steps["correct"]
    else:
        v["verdict"] = "the drafts trained unequal steps (correct %s, floor %s)" % (steps["correct"], steps["floor"])
    return v


def seed_drafts_verdict(hists: dict, configured_steps: int | None = None, configured_s: float | None = None) -> dict:
    """controls=correct: ``hists`` (name -> training record) of the correct drafts trained so far,
    one per draft seed. Each is judged as ``drafts_verdict`` judges the correct draft; by steps
    they must all train the configured steps (``same_steps``); by seconds each trains its own."""
    steps = {n: h["steps"] for n, h in hists.items()}
    v = {"steps": steps, "configured_steps": configured_steps, "measured": True,
         "same_steps": len(set(steps.values())) == 1 if configured_steps else True}
    for h in hists.values():
        one = drafts_verdict(h, None, configured_steps, configured_s)
        if not one["measured"]:
            v.update(measured=False, verdict=one["verdict"])
            return v
    if configured_steps and not v["same_steps"]:
        v["verdict"] = "the drafts trained unequal steps (%s)" % steps
    else:
        v["verdict"] = "trained %s steps (%d draft%s, one per seed)" % (
            "/".join(str(x) for x in steps.values()) if not configured_steps else configured_steps, len(steps),
            "s" if len(steps) > 1 else "")
    return v


def seeds_verdict(figures: dict, heldouts: dict, answer_len: int, how: str) -> dict:
    """controls=correct: the correct drafts, one per draft seed (``heldouts``: name -> held-out
    evaluation), each ``served`` (GPU) or ``replayed`` (CPU; ``figures``: the result's ``served``
    or ``replayed``). Reports each accept length, its prediction at the answer length, the mean
    and the spread over the seeds. Served: passes when every draft was served, every request
    lossless and each within ``GPU_LIMITS["served_minus_predicted"]`` of its prediction at the
    answer length (the exact expectation for its a1..a3; the answer cuts the last verify).
    Replayed: when every draft has a figure (no ordering to judge: there is no control)."""
    a = {n: (figures.get(n) or {}).get("accept_length") for n in heldouts}
    at = {n: _r(lang_mod.chain_accept_length_at(h["step_accuracies"], answer_len - 1)) for n, h in heldouts.items()}
    v = {f"{how}_accept_length": a, "predicted": {n: h["predicted_accept_length"] for n, h in heldouts.items()},
         "predicted_at_answer_length": at}
    failed = _missing(figures, a, list(heldouts), how)
    got = [x for x in a.values() if x is not None]
    if got:
        v.update(mean=_r(sum(got) / len(got)), spread=_r(max(got) - min(got)))
    if how == "served":
        lim = GPU_LIMITS["served_minus_predicted"]
        lossless = {}
        for n, x in a.items():
            if x is None:
                continue
            if abs(x - at[n]) > lim:
                failed.append("%s served %.3f vs predicted %.3f at %d tokens: differs by %.3f > %s"
                              % (n, x, at[n], answer_len, abs(x - at[n]), lim))
            k, m = figures[n].get("lossless_requests"), figures[n].get("requests")
            lossless[n] = "%s of %s" % (k, m)
            if k is None or m is None or k < m:
                failed.append("%s: %s of %s requests lossless (outputs differ from the no-speculation greedy ones)"
                              % (n, k, m))
        v["lossless"] = lossless
        head = "served"
    else:
        v["how"] = REPLAY_NOTE
        head = "replayed (no server loaded a draft)"
    v["failed"] = failed
    v["passed"] = not failed
    figs = ", ".join("%s %s" % (n, "%.3f" % x if x is not None else "-") for n, x in a.items())
    v["verdict"] = head + ": " + ("failed: " + "; ".join(failed) if failed else
                                  "correct drafts %s; mean %.3f" % (figs, v["mean"]))
    return v


def _common(figures: dict, heldout: dict, answer_len: int, name: str) -> tuple[dict, dict]:
    pred = heldout["predicted_accept_length"]
    at = lang_mod.chain_accept_length_at(heldout["step_accuracies"], answer_len - 1)
    a = {c: v.get("accept_length") for c, v in figures.items()}
    v = {"predicted": pred, "predicted_at_answer_length": _r(at), f"{name}_accept_length": a}
    if all(a.get(c) is not None for c in ("correct", "off_by_one", "floor")):
        v.update(correct_minus_off_by_one=_r(a["correct"] - a["off_by_one"]),
                 correct_minus_floor=_r(a["correct"] - a["floor"]),
                 ordering=a["correct"] > a["off_by_one"] and a["correct"] > a["floor"])
        v[f"{name}_minus_predicted"] = _r(a["correct"] - pred)
        v[f"{name}_minus_predicted_at_answer_length"] = _r(a["correct"] - at)
    return v, a


def _missing(figures: dict, a: dict, controls, verb: str) -> list:
    out = []
    for c in controls:
        if a.get(c) is None:
            f = figures.get(c) or {}
            why = f.get("error") or f.get("not_servable") or ("no figure" if c in figures else "absent")
            out.append(f"{c}: not {verb} ({why})")
    return out


def _lossless(figures: dict, failed: list) -> dict:
    """Per served control "k of n" requests equal to the no-speculation greedy output; a failure in
    ``failed`` for each control with fewer (speculative decoding must not change greedy output)."""
    out = {}
    for c, f in figures.items():
        if f.get("accept_length") is None:
            continue
        n, k = f.get("requests"), f.get("lossless_requests")
        out[c] = "%s of %s" % (k, n)
        if n is None or k is None or k < n:
            failed.append("%s: %s of %s requests lossless (outputs differ from the no-speculation greedy ones)"
                          % (c, k, n))
    return out


def served_verdict(figures: dict, heldout: dict, answer_len: int) -> dict:
    """The GPU verdict on ``figures`` (the result's ``served``: per control accept_length, requests,
    lossless_requests, or error / not_servable); ``heldout``: the correct draft's held-out
    evaluation; ``answer_len``: tokens per request."""
    v, a = _common(figures, heldout, answer_len, "served")
    lim = GPU_LIMITS
    failed = _missing(figures, a, ("correct", "off_by_one", "floor"), "served")
    if "ordering" in v:
        d = v["served_minus_predicted"]
        if abs(d) > lim["served_minus_predicted"]:
            failed.append("correct served %.3f vs predicted %.3f: differs by %.3f > %s"
                          % (a["correct"], v["predicted"], abs(d), lim["served_minus_predicted"]))
        if v["correct_minus_off_by_one"] < lim["correct_minus_off_by_one"]:
            failed.append("correct - off_by_one = %.3f < %s: the layer mix-up does not cost what it must"
                          % (v["correct_minus_off_by_one"], lim["correct_minus_off_by_one"]))
        if v["correct_minus_floor"] < lim["correct_minus_floor"]:
            failed.append("correct - floor = %.3f < %s: the aux layers add too little over none"
                          % (v["correct_minus_floor"], lim["correct_minus_floor"]))
    v["lossless"] = _lossless(figures, failed)
    up = figures.get("upstream_ids")
    if up is not None and "not_servable" in up:
        v["upstream_ids_minus_correct"] = None
        v["upstream_ids_note"] = "not compared: " + up["not_servable"]
    elif a.get("correct") is not None:
        if a.get("upstream_ids") is None:
            failed += _missing(figures, a, ("upstream_ids",), "served")
        else:
            d = _r(a["upstream_ids"] - a["correct"])
            v["upstream_ids_minus_correct"] = d
            if abs(d) > lim["upstream_ids_minus_correct"]:
                failed.append("upstream_ids served %.3f vs correct %.3f: differs by %.3f > %s (unpatched SGLang "
                              "with upstream's ids must feed the draft the same layers)"
                              % (a["upstream_ids"], a["correct"], abs(d), lim["upstream_ids_minus_correct"]))
    v["failed"] = failed
    v["passed"] = not failed
    if failed:
        v["verdict"] = "served: failed: " + "; ".join(failed)
    else:
        v["verdict"] = ("served: passed: correct %.3f (predicted %.3f), off_by_one %.3f, floor %.3f%s; every request "
                        "lossless" % (a["correct"], v["predicted"], a["off_by_one"], a["floor"],
                                      ", upstream_ids %.3f" % a["upstream_ids"] if a.get("upstream_ids") is not None
                                      else ""))
    return v


def replayed_verdict(figures: dict, heldout: dict, answer_len: int) -> dict:
    """The CPU verdict on ``figures`` (the result's ``replayed``): the ordering correct >
    off_by_one and correct > floor of the replayed accept lengths. ``replayed_minus_predicted``
    is reported, not judged: both come from the same TTT forward of the same draft, so it checks
    the replay's arithmetic, not serving."""
    v, a = _common(figures, heldout, answer_len, "replayed")
    failed = _missing(figures, a, ("correct", "off_by_one", "floor"), "replayed")
    if "ordering" in v:
        for c in ("off_by_one", "floor"):
            if not a["correct"] > a[c]:
                failed.append("correct replayed %.3f <= %s %.3f" % (a["correct"], c, a[c]))
    v["how"] = REPLAY_NOTE
    v["failed"] = failed
    v["passed"] = not failed
    v["verdict"] = ("replayed (no server loaded a draft): " + ("failed: " + "; ".join(failed) if failed else
                    "ordering holds: correct %.3f > off_by_one %.3f, correct > floor %.3f"
                    % (a["correct"], a["off_by_one"], a["floor"])))
    return v


# DFlash (issue 44, item 5): |served - replayed prediction| of the correct draft, and how far below it
# each control of the same weights must serve (ids shifted by one; the layer-input reading)
DFLASH_LIMITS = {"served_minus_predicted": 0.15, "correct_minus_shifted": 0.3, "correct_minus_layer_input": 0.3,
                 "upstream_ids_minus_correct": 0.05}
DFLASH_CONTROLS = ("correct", "shifted", "layer_input", "upstream_ids")


def dflash_drafts_verdict(training: dict, by_steps: bool) -> dict:
    """The DFlash draft trained as configured: by steps (``draft_max_steps``) it must reach them;
    by seconds (``draft_budget_s``) a budget stop is its configured end."""
    cut = training["stopped_by"] == "budget" and by_steps
    v = {"family": "dflash", "measured": not cut, "steps": training["steps"]}
    v["verdict"] = ("not measured: the DFlash draft trained %d of %d steps (budget)"
                    % (training["steps"], training["max_steps"]) if cut else
                    "the DFlash draft trained %d steps (%s)" % (training["steps"], training["stopped_by"]))
    return v


def dflash_served_verdict(figures: dict, predicted: float) -> dict:
    """The GPU verdict of a DFlash run on ``figures`` (the result's ``served``: per control
    accept_length, requests, lossless_requests, or error); ``predicted``: the correct draft's
    replayed accept length on the held-out data (``DFlashRun.block_replay``)."""
    lim = DFLASH_LIMITS
    a = {c: f.get("accept_length") for c, f in figures.items()}
    v = {"predicted": predicted, "served_accept_length": a}
    failed = _missing(figures, a, DFLASH_CONTROLS, "served")
    if a.get("correct") is not None:
        v["served_minus_predicted"] = d = _r(a["correct"] - predicted)
        if abs(d) > lim["served_minus_predicted"]:
            failed.append("correct served %.3f vs predicted %.3f: differs by %.3f > %s"
                          % (a["correct"], predicted, abs(d), lim["served_minus_predicted"]))
        for c in ("shifted", "layer_input"):
            if a.get(c) is None:
                continue
            v[f"correct_minus_{c}"] = d = _r(a["correct"] - a[c])
            if d < lim[f"correct_minus_{c}"]:
                failed.append("correct - %s = %.3f < %s: the layer mix-up does not cost what it must"
                              % (c, d, lim[f"correct_minus_{c}"]))
        if a.get("upstream_ids") is not None:
            v["upstream_ids_minus_correct"] = d = _r(a["upstream_ids"] - a["correct"])
            if abs(d) > lim["upstream_ids_minus_correct"]:
                failed.append("upstream_ids served %.3f vs correct %.3f: differs by %.3f > %s (unpatched SGLang "
                              "must feed the draft the same layers)"
                              % (a["upstream_ids"], a["correct"], abs(d), lim["upstream_ids_minus_correct"]))
    v["lossless"] = _lossless(figures, failed)
    v["failed"] = failed
    v["passed"] = not failed
    v["verdict"] = ("served (DFlash): failed: " + "; ".join(failed) if failed else
                    "served (DFlash): passed: correct %.3f (replay predicted %.3f), shifted %.3f, layer_input %.3f, "
                    "upstream_ids %.3f; every request lossless"
                    % (a["correct"], predicted, a["shifted"], a["layer_input"], a["upstream_ids"]))
    return v


def outcome(res: dict) -> tuple[int, str]:
    """The run's exit code (0 every verdict passed, 1 otherwise) and one line saying why. A run
    whose drafts the budget cut is ``not measured`` (exit 1), whatever else it holds."""
    v = res.get("verdicts", {})
    d = v.get("drafts")
    if d is not None and not d.get("measured", True):
        return 1, d["verdict"]
    skipped = [f"{k} ({p['skipped']})" for k, p in res.get("phases", {}).items() if "skipped" in p]
    if skipped:
        return 1, "not measured: phase " + ", ".join(skipped) + " not run"
    bad = []
    g = v.get("target_gates")
    if not g or not g.get("passed"):
        bad.append("target gates: " + ("; ".join(g.get("failed", [])) if g else "not measured"))
    gu = v.get("guard")
    if not gu or not gu.get("passed"):
        bad.append("guard: " + ("wrong exit code for " + ", ".join(gu["wrong"]) if gu and gu.get("wrong")
                                else "not run on every control"))
    if d is None or not (d.get("same_steps") or d.get("family") == "dflash" and d.get("measured")):
        bad.append("drafts: " + (d["verdict"] if d else "not trained"))
    fig = v.get("serve") or v.get("replay")
    if fig is None:
        bad.append("no accept length measured")
    elif not fig.get("passed"):
        bad.append(fig["verdict"])
    if bad:
        return 1, "failed: " + "; ".join(bad)
    return 0, "passed: " + fig["verdict"]
