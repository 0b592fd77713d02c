"""The CPU side of tools/gpucheck.py: the check model and its criterion, the spy and the verdicts
against the real patched sglang 0.5.9 on CPU, and what the check hooks in the sglang 0.5.17 wheel.

Margins (the figures docs/gpu.md quotes) are printed by test_criterion_margins (pytest -s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REAL, REPO, one_line_error, run_tool
from eaglepatch import cpuenv
from eaglepatch.fetch import unpacked_release
from eaglepatch.gpucheck import criterion, models, records as R, reference
from eaglepatch.gpucheck.check import SPY, Options, _dflash_engine, _engine_kwargs
from eaglepatch.gpucheck.static import check_tree

TOL = criterion.TOL
N = models.CHECK_MODEL["num_hidden_layers"]
DUMP_IDS = models.dump_ids(N)  # check c's dump: [-1, 1, 2, N-1]
RIDS = [str(i) for i in range(len(models.BATCHES["small"]))]  # the one-batch module names its requests 0, 1, ...


@pytest.fixture(scope="session")
def check_ckpt() -> Path:
    d = cpuenv.cache_dir() / "gpucheck-checkpoints" / ("check-" + models.checkpoint_key())
    return reference.build_checkpoint(d)


@pytest.fixture(scope="session")
def ref(check_ckpt):
    return reference.Reference(check_ckpt)


@pytest.fixture(scope="session")
def small(ref):
    ps = models.prompts("small")
    return ps, [ref.states(p) for p in ps]


def test_criterion_rows():
    ref = torch.ones(3, 4)
    x = ref.clone()
    x[1] *= 1.05
    c = criterion.compare("x", x, ref)
    assert c.passed and c.worst_row == 1 and abs(c.max_err - 0.05) < 1e-6
    x[2, 0] = float("nan")
    c = criterion.compare("x", x, ref)
    assert not c.passed and c.worst_row == 2 and c.max_err == float("inf")
    with pytest.raises(ValueError):
        criterion.compare("x", torch.ones(3, 5), ref)


def test_checkpoint_is_bf16_exact_and_routing_decisive(check_ckpt):
    from safetensors.torch import load_file

    w = load_file(str(check_ckpt / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for k, t in w.items() if not k.endswith("e_score_correction_bias"))
    for i in range(models.CHECK_MODEL["first_k_dense_replace"], models.CHECK_MODEL["num_hidden_layers"]):
        b = w["model.layers.%d.mlp.gate.e_score_correction_bias" % i]
        top = sorted(b.tolist(), reverse=True)
        # sigmoid scores lie in (0, 1): a bias gap above 1 fixes the top-2 choice for every token
        assert top[1] - top[2] > 1.0
    cfg = json.loads((check_ckpt / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (512, 64, 128, 128)


def test_criterion_margins(check_ckpt, ref, small):
    """HF bf16 (the engine's precision) passes; ids shifted by one, a skipped final norm and a TP=2
    partial sum fail in every row, by a wide margin."""
    from transformers import DeepseekV3ForCausalLM

    bf = reference.Reference.__new__(reference.Reference)
    bf.model = DeepseekV3ForCausalLM.from_pretrained(str(check_ckpt), dtype=torch.bfloat16).eval()
    bf.device, bf.num_layers = "cpu", ref.num_layers
    ps, refs = small
    ps, refs = ps + models.prompts("large")[:1], refs + [ref.states(models.prompts("large")[0])]
    n = ref.num_layers
    names = ["layer.%d" % k for k in range(-1, n)]
    noise, shift, skip, partial = 0.0, [], [], []
    for i, (p, r) in enumerate(zip(ps, refs)):
        b = bf.states(p)
        noise = max([noise] + [criterion.compare(k, b[k], r[k]).max_err for k in r])
        for lo, hi in zip(names, names[1:]):
            shift += [criterion.min_row_error(r[hi], r[lo]), criterion.min_row_error(r[lo], r[hi])]
        skip += [criterion.min_row_error(r["layer.%d" % (n - 1)], r["final"]),
                 criterion.min_row_error(r["final"], r["layer.%d" % (n - 1)])]
        if i in (1, 3):  # rank 0 of a TP=2 run whose layer k skipped its MLP all-reduce
            partial += [criterion.min_row_error(v, r[k]) for k, v in ref.partial_states(p).items()]
    figures = {"bf16_noise_max_row_error": noise, "shifted_id_min_row_error": min(shift),
               "skipped_norm_min_row_error": min(skip), "tp2_partial_sum_min_row_error": min(partial), "tol": TOL}
    print("\ncriterion margins on CPU: " + json.dumps({k: round(v, 4) for k, v in figures.items()}))
    assert noise <= TOL / 2.5
    assert min(shift) >= 5 * TOL and min(skip) >= 5 * TOL and min(partial) >= 4 * TOL


def _patched_059(tmp: Path) -> Path:
    from eaglepatch.smoke.tree import patched_tree

    return patched_tree(unpacked_release("0.5.9", quiet=True), REAL, tmp / "tree")


@pytest.fixture(scope="session")
def cpu_capture(tmp_path_factory, check_ckpt):
    """The real patched sglang 0.5.9 on CPU: one extend of the small batch in a target ModelRunner
    configured for EAGLE-3 [-1, 1, 2], with the spy (and its layer-input probe) and the dump of
    check c on (layers [-1, 1, 2, N-1] and final)."""
    from eaglepatch.smoke import worker_env

    w = tmp_path_factory.mktemp("gpucheck-cpu")
    pp = _patched_059(w)
    draft = reference.write_config_only(w / "draft", models.draft_config(models.CHECK_MODEL))
    (w / "prompts.json").write_text(json.dumps(models.prompts("small")))
    for d in ("spy", "dump"):
        (w / d).mkdir()
    env = worker_env(pp)
    env["PYTHONPATH"] = str(SPY) + os.pathsep + env["PYTHONPATH"]
    env.update(EAGLEPATCH_SPY_DIR=str(w / "spy"), EAGLEPATCH_SPY_PROBE="0,1,2,3", EAGLE3_DUMP_DIR=str(w / "dump"),
               EAGLE3_DUMP_LAYERS=",".join(map(str, DUMP_IDS)), EAGLE3_DUMP_FINAL="1")
    script = REPO / "src" / "eaglepatch" / "gpucheck" / "cpu_capture.py"
    r = subprocess.run([str(cpuenv.ensure_env()), str(script), str(check_ckpt), str(draft), str(w / "prompts.json")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "@@DONE" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    return w


def test_spy_records_what_the_target_hands_the_draft(cpu_capture, small):
    ps, refs = small
    notes = [ln for lines in R.hook_notes(cpu_capture / "spy").values() for ln in lines]
    assert "installed ModelRunner.forward" in notes
    assert any(ln.startswith("installed DeepseekV2DecoderLayer.forward probe") for ln in notes)
    recs = R.load_records(cpu_capture / "spy")
    assert R.overlays(recs) == ["sglang.srt.eagle3_capture:series"]  # the capture package the process had loaded
    target = [r for r in recs if r["kind"] == "target"]
    assert len(target) == 1 and target[0]["mode"] == "EXTEND" and target[0]["extend_seq_lens"] == models.BATCHES["small"]
    assert tuple(target[0]["hidden"].shape) == (sum(models.BATCHES["small"]), 3 * models.CHECK_MODEL["hidden_size"])
    v = R.check_capture("a", recs, ps, refs, models.EAGLE_IDS)
    assert v.passed, v.detail
    assert v.comparisons and max(c.max_err for c in v.comparisons) < 1e-4  # float32 on CPU
    # the same records judged as ids shifted by one must fail
    shifted = R.check_capture("a shifted", recs, ps, refs, [k + 1 for k in models.EAGLE_IDS])
    assert not shifted.passed and min(c.max_err for c in shifted.comparisons) > 5 * TOL
    # a request missing from the capture fails too
    assert not R.check_capture("a missing", recs, ps + [[5, 6, 7]], refs + [refs[0]], models.EAGLE_IDS).passed


def test_dump_verdict_and_its_failures(cpu_capture, small, check_ckpt):
    ps, refs = small
    meta = {"format": "eagle3-dump/1", "final": "post_norm", "architecture": "DeepseekV3ForCausalLM",
            "dtype": "float32", "tp_size": "1", "model_path": str(check_ckpt)}
    ids = DUMP_IDS
    v = R.check_dump("c", cpu_capture / "dump", ps, refs, ids, meta, RIDS)
    assert v.passed, v.detail
    skipped_norm = [dict(r, final=r["layer.%d" % (N - 1)]) for r in refs]
    assert not R.check_dump("c", cpu_capture / "dump", ps, skipped_norm, ids, meta, RIDS).passed
    for d in (1, -1):  # every id read one layer off (N-1 one down, -1 one up where there is no neighbour)
        shifted = [dict(r, **{"layer.%d" % k: r[_off("layer.%d" % k, d)] for k in ids}) for r in refs]
        assert not R.check_dump("c", cpu_capture / "dump", ps, shifted, ids, meta, RIDS).passed
    assert "eagle3_layer_ids" in R.check_dump("c", cpu_capture / "dump", ps, refs, [-1, 1, 2], meta, RIDS).detail
    assert "tp_size" in R.check_dump("c", cpu_capture / "dump", ps, refs, ids, dict(meta, tp_size="2"), RIDS).detail
    extra = cpu_capture / "dump" / "stray.safetensors"
    shutil.copy(next((cpu_capture / "dump").glob("*.safetensors")), extra)
    try:
        assert "unexpected files" in R.check_dump("c", cpu_capture / "dump", ps, refs, ids, meta, RIDS).detail
    finally:
        extra.unlink()


def test_probe_without_the_fix_fails_on_a_partial_sum(cpu_capture, ref, small):
    ps, refs = small
    recs = R.load_records(cpu_capture / "spy")
    unfixed, fixed = R.check_probe("d", recs, ps, refs)
    assert fixed.passed, fixed.detail  # TP=1: the layer input is complete
    assert not unfixed.passed and "[]" in unfixed.detail  # nothing deferred at TP=1: nothing to catch
    # the same probes judged against the layer one off (the input of layer i read as the output of
    # layer i or i-2, the k = i-1 mapping off by one) fail in every probe whose layer has that neighbour
    n = ref.num_layers
    for d in (1, -1):
        off = [dict(r, **{"layer.%d" % k: r["layer.%d" % (k + d)] for k in range(-1, n) if -1 <= k + d < n})
               for r in refs]
        _, wrong = R.check_probe("d", recs, ps, off)
        moved = [c for c in wrong.comparisons if d > 0 or not c.name.endswith("layer -1")]
        assert not wrong.passed and len(moved) == len(ps) * (n - (d < 0))
        assert all(not c.passed for c in moved) and min(c.max_err for c in moved) > 5 * TOL
    # What rank 0 of a TP=2 run holds at the layer input when the previous layer deferred its
    # all-reduce, as the probe would record it (two short requests): the check without the fix
    # must fail there, with the all-reduce completed it must pass.
    two = ps[:2]
    parts = [ref.partial_states(p) for p in two]
    sim = []
    for i in range(1, ref.num_layers):
        k = i - 1
        sim.append({"kind": "probe", "pid": 1, "seq": i, "mode": "EXTEND", "layer_index": i, "flagged": True,
                    "input_ids": torch.tensor(two[0] + two[1]), "extend_seq_lens": [len(two[0]), len(two[1])],
                    "hidden": torch.cat([parts[0]["layer.%d" % k], parts[1]["layer.%d" % k]]),
                    "fixed": torch.cat([refs[0]["layer.%d" % k], refs[1]["layer.%d" % k]])})
    unfixed, fixed = R.check_probe("d", sim, two, refs[:2])
    assert unfixed.passed, unfixed.detail
    assert fixed.passed
    assert min(c.max_err for c in unfixed.comparisons) > 4 * TOL
    # and an honest probe (complete sums) flagged as deferred is not "caught"
    honest = [dict(r, hidden=r["fixed"]) for r in sim]
    assert not R.check_probe("d", honest, two, refs[:2])[0].passed


def test_draft_verdict_on_synthetic_records(ref):
    """check b's bookkeeping: verify blocks mapped to requests through req_pool_indices, judged
    against the reference of the same tokens; draft rows must be the target's rows."""
    ps = [p[:40] for p in models.prompts("small")[2:4]]
    outs = [[11, 12, 13, 14], [21, 22, 23, 24]]
    ids = models.EAGLE_IDS

    def pack(states, lo, hi):
        return torch.cat([states["layer.%d" % k][lo:hi] for k in ids], dim=-1).to(torch.bfloat16)

    pre = [ref.states(p) for p in ps]
    ext = {"kind": "target", "pid": 1, "seq": 0, "mode": "EXTEND", "graph": False,
           "input_ids": torch.tensor(ps[0] + ps[1]), "positions": None,
           "req_pool_indices": torch.tensor([5, 9]), "extend_seq_lens": [len(ps[0]), len(ps[1])],
           "hidden": torch.cat([pack(pre[0], 0, 40), pack(pre[1], 0, 40)])}
    blocks, toks, pos = [], [], []
    for r in range(2):
        seq = ps[r] + [outs[r][0], 7, 8, 9]  # committed first output, then 3 draft tokens
        st = ref.states(seq)
        blocks.append(pack(st, 40, 44))
        toks += seq[40:44]
        pos += list(range(40, 44))
    ver = {"kind": "target", "pid": 1, "seq": 2, "mode": "TARGET_VERIFY", "graph": True,
           "input_ids": torch.tensor(toks), "positions": torch.tensor(pos),
           "req_pool_indices": torch.tensor([5, 9]), "extend_seq_lens": None, "hidden": torch.cat(blocks)}
    d_pre = {"kind": "draft", "pid": 1, "seq": 1, "mode": "EXTEND", "graph": None, "hidden": ext["hidden"].clone(),
             "req_pool_indices": torch.tensor([5, 9])}
    d_dec = {"kind": "draft", "pid": 1, "seq": 3, "mode": "DRAFT_EXTEND_V2", "graph": True,
             "hidden": ver["hidden"][[0, 5]].clone(), "req_pool_indices": torch.tensor([5, 9])}
    recs = [ext, d_pre, ver, d_dec]
    fn = ref.states
    v = R.check_draft("b", recs, ps, outs, fn, ids)
    assert v.passed, v.detail
    bad = dict(d_dec, hidden=d_dec["hidden"] * 1.01)
    assert "not rows the target produced" in R.check_draft("b", [ext, d_pre, ver, bad], ps, outs, fn, ids).detail
    eager = dict(ver, graph=False)
    assert "no target verify forward ran in a CUDA graph" in R.check_draft("b", [ext, d_pre, eager, d_dec], ps, outs,
                                                                           fn, ids).detail
    wrong = dict(ver, hidden=torch.cat([pack(ref.states(ps[r] + [outs[r][0], 7, 8, 9]), 39, 43) for r in range(2)]))
    assert not R.check_draft("b", [ext, d_pre, wrong, d_dec], ps, outs, fn, ids).passed  # rows one position off
    shifted = R.check_draft("b", recs, ps, outs, fn, [k + 1 for k in ids])  # the same rows read as ids + 1
    assert not shifted.passed and min(c.max_err for c in shifted.comparisons) > 5 * TOL, shifted.detail


def _off(name: str, d: int) -> str:
    """``layer.k`` one layer off: k + d, or k - d where k + d is no layer (below -1 or past N-1)."""
    k = int(name.split(".")[1])
    return "layer.%d" % (k + d if -1 <= k + d < N else k - d)


def test_run_comparison_fails_on_shifted_ids_and_a_skipped_norm(cpu_capture, small):
    """check d's "TP=2 == TP=1" comparisons (dump files, draft prefill inputs) on the real CPU run: the
    run against the float32 reference of the same names passes; the reference read one layer off, or
    with the final norm skipped (or applied to the last layer's output), fails."""
    ps, refs = small
    n = N
    dumps = R.dump_states(cpu_capture / "dump", RIDS)
    drafts = R.draft_prefill_inputs(R.load_records(cpu_capture / "spy"), ps, models.EAGLE_IDS)
    assert all(set(d) == {"input_ids", "layer.-1", "layer.1", "layer.2", "layer.3", "final"} for d in dumps)
    assert all(set(d) == {"layer.-1", "layer.1", "layer.2"} for d in drafts)

    def like(run, pick):
        return [{k: pick(r, k) for k in got if k != "input_ids"} for got, r in zip(run, refs)]

    same = lambda r, k: r[k]  # noqa: E731
    up = lambda r, k: r[k] if k == "final" else r[_off(k, 1)]  # noqa: E731
    down = lambda r, k: r[k] if k == "final" else r[_off(k, -1)]  # noqa: E731
    pre = lambda r, k: r["layer.%d" % (n - 1)] if k == "final" else r[k]  # noqa: E731
    for run in (dumps, drafts):
        assert R.compare_runs("d", run, like(run, same)).passed
        for wrong in (up, down):
            v = R.compare_runs("d", run, like(run, wrong))
            assert not v.passed and max(c.max_err for c in v.comparisons) > 5 * TOL, v.detail
    v = R.compare_runs("d", dumps, like(dumps, pre))  # final stored without the norm
    assert not v.passed and "final" in v.detail
    post = [dict(r, **{"layer.2": r["final"]}) for r in like(dumps, same)]  # a normed state read as layer 2
    assert not R.compare_runs("d", dumps, post).passed
    assert not R.compare_runs("d", dumps, [{} for _ in dumps]).passed  # nothing to compare is no pass


def test_run_comparison_between_real_runs(cpu_capture, small):
    """check d's run-vs-run comparison on two real records of one CPU forward (the dump files and
    the spy's capture): equal runs pass; the run with every layer holding its neighbour's rows, or
    with N-1 and final swapped (a skipped norm), fails in every compared row."""
    ps, _ = small
    dumps = R.dump_states(cpu_capture / "dump", RIDS)
    drafts = R.draft_prefill_inputs(R.load_records(cpu_capture / "spy"), ps, models.EAGLE_IDS)
    v = R.compare_runs("d", drafts, dumps)  # what the target handed the draft == what it dumped
    assert v.passed and len(v.comparisons) == len(ps) * len(models.EAGLE_IDS), v.detail
    assert R.compare_runs("d", dumps, dumps).passed
    inner = [k for k in DUMP_IDS if k + 1 in DUMP_IDS]  # ids whose next layer is in the dump: 1, 2
    assert inner == [1, 2]
    for d in (1, -1):  # layer k holding layer k+1's rows, then layer k+1 holding layer k's
        moved = [{"layer.%d" % (k + (d < 0)): r["layer.%d" % (k + (d > 0))] for k in inner} for r in dumps]
        v = R.compare_runs("d", moved, dumps)
        assert not v.passed and min(c.max_err for c in v.comparisons) > 5 * TOL, v.detail
    last = "layer.%d" % (N - 1)
    for bad in ({last: "final", "final": last}, {"final": last}, {last: "final"}):  # swapped, norm skipped, added
        run = [dict(r, **{k: r[src] for k, src in bad.items()}) for r in dumps]
        v = R.compare_runs("d", run, dumps)
        wrong = [c for c in v.comparisons if not c.passed]
        assert not v.passed and {c.name.split()[-1] for c in wrong} == set(bad), v.detail
        assert min(c.max_err for c in wrong) > 5 * TOL


def test_draft_verdict_on_real_rows_fails_on_shifted_ids(cpu_capture, small):
    """check b's verify comparison on rows the real CPU target captured: the last 4 prompt tokens of
    each request replayed as its verify block (same tokens, same positions, so the reference of the
    committed sequence is the prompt's) pass; the same records judged against a reference one layer
    off (ids + 1, ids - 1), or read as ids + 1, fail in every row of the shifted layers."""
    ps, refs = small
    recs = R.load_records(cpu_capture / "spy")
    ext = next(r for r in recs if r["kind"] == "target" and r["mode"] == "EXTEND")
    ids = models.EAGLE_IDS
    segs = [(seg, pool) for seg, pool in zip(R.extend_requests(ext, ps), ext["req_pool_indices"].tolist())
            if seg[2] >= 8]
    assert len(segs) >= 4
    rows, toks, pos, rpi = [], [], [], []
    for (r, s, n), pool in segs:
        rows.append(ext["hidden"][s + n - 4:s + n])
        toks += ps[r][n - 4:]
        pos += range(n - 4, n)
        rpi.append(pool)
    ver = {"kind": "target", "pid": ext["pid"], "seq": ext["seq"] + 2, "mode": "TARGET_VERIFY", "graph": True,
           "input_ids": torch.tensor(toks), "positions": torch.tensor(pos), "req_pool_indices": torch.tensor(rpi),
           "extend_seq_lens": None, "hidden": torch.cat(rows)}
    d_pre = {"kind": "draft", "pid": ext["pid"], "seq": ext["seq"] + 1, "mode": "EXTEND", "graph": None,
             "hidden": ext["hidden"].clone(), "req_pool_indices": ext["req_pool_indices"]}
    d_dec = {"kind": "draft", "pid": ext["pid"], "seq": ext["seq"] + 3, "mode": "DRAFT_EXTEND_V2", "graph": True,
             "hidden": ver["hidden"][::4].clone(), "req_pool_indices": torch.tensor(rpi)}
    real = [ext, d_pre, ver, d_dec]
    outs = [[] for _ in ps]  # the verify blocks lie inside the prompts: the committed sequence is the prompt
    by_tokens = {tuple(p): r for p, r in zip(ps, refs)}

    def ref_fn(shift):
        def fn(tokens):
            r = by_tokens[tuple(tokens)]
            return dict(r, **{"layer.%d" % k: r[_off("layer.%d" % k, shift)] for k in range(-1, N)}) if shift else r
        return fn

    v = R.check_draft("b", real, ps, outs, ref_fn(0), ids)
    assert v.passed and len(v.comparisons) == len(segs) * len(ids), v.detail
    assert max(c.max_err for c in v.comparisons) < 1e-4  # float32 on CPU
    for shift in (1, -1):
        v = R.check_draft("b", real, ps, outs, ref_fn(shift), ids)
        assert not v.passed and "verify rows off the reference" in v.detail
        assert all(not c.passed for c in v.comparisons)
        assert min(c.max_err for c in v.comparisons) > 5 * TOL, v.detail
    v = R.check_draft("b", real, ps, outs, ref_fn(0), [k + 1 for k in ids])  # the same rows read as ids + 1
    assert not v.passed and min(c.max_err for c in v.comparisons) > 5 * TOL, v.detail


def test_gpucheck_hooks_and_engine_arguments_exist_in_sglang_0517():
    """What the spy hooks and the ServerArgs fields the engines are started with, in the release
    the GPU check runs (and the 0.5.9 hooks the CPU tests use)."""
    opts = Options(out=Path("x"), work=Path("w"))
    kw = dict(_engine_kwargs(opts, Path("m"), Path("d"), tp=2), load_format="dummy")
    dflash = _dflash_engine(opts, Path("m"), Path("d"))  # check h's engine: SGLang's own DFLASH worker
    assert check_tree(unpacked_release("0.5.17", quiet=True), dict(kw, **dflash), probe=True, deferral=True,
                      dflash=True) == []
    assert check_tree(unpacked_release("0.5.9", quiet=True), None, probe=True, deferral=True) == []
    # 0.5.9 has no DFlash: check h is refused there, by name, before any engine starts
    problems = check_tree(unpacked_release("0.5.9", quiet=True), dflash, dflash=True)
    assert any("DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc" in p for p in problems), problems


def test_gpucheck_cli_errors_are_one_line(tmp_path):
    r = run_tool("gpucheck", "--checks", "xz")
    assert r.returncode == 2 and "--checks" in one_line_error(r)
    r = run_tool("gpucheck", "--site", tmp_path, "--series", REAL, "--out", tmp_path / "r.json")
    assert r.returncode == 2
    line = one_line_error(r)
    assert "CUDA is not available" in line or "torch is not installed" in line
    assert "Traceback" not in r.stderr and not (tmp_path / "r.json").exists()


def test_patched_files_carry_the_series_without_git(tmp_path):
    """--make-patched-files here, --patched-files there: the same files as applying the series, and a site of
    another release is refused with one line."""
    from eaglepatch.gpucheck.patched_files import lay_patched_files
    from eaglepatch.smoke.tree import patched_tree

    ov = tmp_path / "patched_files"
    r = run_tool("gpucheck", "--make-patched-files", "--series", REAL, "--patched-files", ov)
    assert r.returncode == 0, r.stderr
    m = json.loads((ov / "patched-files.json").read_text())
    assert m["release"] == "0.5.9" and "sglang/srt/eagle3_capture/__init__.py" in m["files"]
    site = unpacked_release("0.5.9", quiet=True)
    got = lay_patched_files(ov, site, tmp_path / "laid")
    want = patched_tree(site, REAL, tmp_path / "applied", smoke=False)
    for rel in m["files"]:
        assert (got / rel).read_bytes() == (want / rel).read_bytes()
    assert (got / "sglang" / "srt" / "layers" / "communicator.py").read_bytes() == \
        (site / "sglang" / "srt" / "layers" / "communicator.py").read_bytes()
    other = unpacked_release("0.5.10", quiet=True)
    with pytest.raises(Exception) as e:
        lay_patched_files(ov, other, tmp_path / "laid2")
    assert "were made for sglang 0.5.9" in str(e.value)


def test_orchestrator_and_worker_on_cpu(cpu_capture, tmp_path):
    """tools/gpucheck.py end to end where CPU allows: the worker starts a real sglang.Engine (patched
    0.5.9, dump on, spy on), generates, and the orchestrator judges the files against the float32
    reference and writes the results JSON and the log bundle."""
    out, logs = tmp_path / "r.json", tmp_path / "logs.tar.gz"
    r = run_tool("gpucheck", "--cpu", "--checks", "cg", "--package-parent", cpu_capture / "tree",
                 "--dump-ids=-1,1,2", "--new-tokens", "2", "--work", tmp_path / "w", "--out", out, "--logs", logs)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["passed"] and [x["name"][:2] for x in res["results"]] == ["c.", "g."], res["results"]
    assert res["results"][0]["facts"] == {"files": 7, "requests": 7}
    g = res["results"][1]["facts"]  # chunked prefill 256 (the 311-token prompt in two chunks), 8 new tokens
    assert g["files"] == g["requests"] == 8
    assert g["flush"]["files_at_flush"] == g["flush"]["files_after_shutdown"] == 8
    assert res["stages"]["D"]["ok"] and res["stages"]["D"]["sglang"]["file"].startswith(str(cpu_capture / "tree"))
    import tarfile

    with tarfile.open(logs) as t:
        assert "stages/D/log.txt" in t.getnames()


def test_the_compact_dump_through_a_real_engine_equals_the_reference(cpu_capture, tmp_path):
    """Check g's fp8 mode on CPU: a real patched sglang 0.5.9 Engine with EAGLE3_DUMP_DTYPE=fp8 and
    EAGLE3_DUMP_REBUILDABLE=omit, chunked prefill (the 311-token prompt in two chunks): every file
    stores neither the embedding nor the final state, and what the reader gives back (dequantised,
    the embedding and the final rebuilt from the checkpoint's weights) equals the float32
    reference within the check's tolerance. (A rebuild from wrong weights or shifted ids fails:
    tests/test_storage.py.)"""
    out = tmp_path / "r.json"
    r = run_tool("gpucheck", "--cpu", "--checks", "g", "--g-modes", "fp8", "--package-parent", cpu_capture / "tree",
                 "--dump-ids=-1,1,2,3", "--work", tmp_path / "w", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    (g,) = res["results"]
    assert g["passed"] and "compact dump" in g["name"], g
    assert g["facts"]["files"] == g["facts"]["requests"] == 8
    assert g["facts"]["stored_tensors"] == ["input_ids", "layer.1", "layer.2", "layer.3", "scale.layer.1",
                                            "scale.layer.2", "scale.layer.3"], g["facts"]
