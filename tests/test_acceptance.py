"""tools/acceptance.py at toy scale on CPU: the same pipeline as the GPU run (greedy data from the
patched sglang 0.5.9 CPU server, tools/extract.py, SpecForge 0.2.0 drafts, tools/guard.py on every
control), with serving replayed (sglang runs no EAGLE-3 decoding on CPU). The target is
tests/data/acceptance-toy-target: the CPU toy's DeepSeek-V3 trained on the GPU on the copy
language (an induction lookup: this 2-core machine does not teach it one within a test's budget;
docs/acceptance.md), passed as a user passes their own with --target. Asserts the gates, the data
path, guard's verdicts, the predicted accept length and the replayed controls' ordering (correct >
off-by-one, correct > floor, by margins): replayed, not served, and named so (no server loads a
draft on CPU). test_target_trains_and_is_gated covers the training path on CPU. The verdicts
themselves are tested on mutated results (test_*_verdict_fails_*), the refusals before any work
on the tool's command line, and the draft budget and progress on fakes and tiny real drafts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import acceptance_toy  # noqa: E402
from acceptance_toy import TOY_SETTINGS, TOY_TARGET  # noqa: E402  (the toy target and its settings)

TOOL = REPO / "tools" / "acceptance.py"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("acceptance")
    out = work / "result.json"
    sets = [a for k, v in TOY_SETTINGS.items() for a in ("--set", f"{k}={v}")]
    p = subprocess.run([sys.executable, str(TOOL), "--cpu", "--target", str(TOY_TARGET), "--work", str(work / "w"),
                        "--out", str(out), "--budget-s", "0", "--port", str(_free_port()), *sets],
                       capture_output=True, text=True, timeout=1800)
    assert out.is_file(), p.stderr[-3000:]
    r = json.loads(out.read_text())
    # a figure of drafts the run cut short is no figure: fail with the reason, assert nothing on it
    d = r["verdicts"].get("drafts", {})
    assert d.get("measured"), (d.get("verdict"), p.stderr[-2000:])
    # its data and correct draft are the check-draft toy's too: that toy's build starts from them
    acceptance_toy.publish(work / "w")
    return p, r


def test_controls_ordered(result):
    """What a layer mix-up costs, replayed: the draft fed the layers it was trained on accepts far
    more than the same weights fed the off-by-one reading, or a draft trained with its aux inputs
    zeroed (measured on this machine: 3.56 / 2.30 / 1.55 with these settings). Both drafts trained
    their 150 steps (by steps, without a time cap). The replay near the held-out prediction
    checks the replay's arithmetic only: both come from the same TTT forward of the same draft,
    so it says nothing about serving. The tool exits 0."""
    p, r = result
    assert r["verdicts"]["drafts"]["steps"] == {"correct": 150, "floor": 150}, r["verdicts"]["drafts"]
    v = r["verdicts"]["replay"]
    a = v["replayed_accept_length"]
    assert v["ordering"] and v["passed"], v
    assert a["correct"] - a["off_by_one"] >= 0.3 and a["correct"] - a["floor"] >= 1.0, v
    assert a["correct"] >= 3.0 and abs(v["replayed_minus_predicted"]) <= 0.3, v
    assert r["verdicts"]["drafts"]["same_steps"], r["verdicts"]["drafts"]
    assert p.returncode == 0, p.stderr[-2000:]


def test_cpu_figure_is_named_replayed(result):
    """No server loads a draft on CPU, so nothing in the report is called served: the figures are
    `replayed`, their verdict says so, and the tool's last line too."""
    p, r = result
    assert "served" not in r and "serve" not in r["verdicts"] and "serve" not in r["phases"], sorted(r)
    assert set(r["replayed"]) >= {"correct", "off_by_one", "floor"}, r["replayed"]
    assert "no server loaded a draft" in r["replayed"]["correct"]["how"]
    assert r["verdicts"]["replay"]["verdict"].startswith("replayed (no server loaded a draft): ordering holds")
    assert p.stderr.strip().splitlines()[-1].startswith("passed: replayed (no server loaded a draft)"), p.stderr[-500:]


def test_target_trains_and_is_gated():
    """The training path on CPU: the CPU scale's own target (skip language: next = g(token two
    back)) trained for the scale's steps learns its language and passes the gates; an untrained
    one does not (bigram predictability or bf16 agreement fails)."""
    from eaglepatch.acceptance import language as lang_mod, pipeline, train

    p = pipeline.SCALES["cpu"]
    cfg = pipeline.target_config("cpu")
    lg = lang_mod.Language(p["language"], cfg["vocab_size"], p["symbols"], p["answer_len"], 0, alphabet=p["alphabet"])
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = train.build_target(cfg, "cpu", 0, Path(tmp), None)
    before = train.measure(model, lg, 8, 0)
    hist = train.train_target(model, lg, p["target_steps"], p["target_batch"], p["target_lr"], p["target_budget_s"], 0,
                              "cpu", say=lambda m: None)
    g = train.measure(model, lg, 8, 0)
    assert not pipeline.gate_failures(g) and g["task_accuracy"] >= 0.5, (g, hist["steps"])
    assert pipeline.gate_failures(before) and before["task_accuracy"] < 0.2, before


def test_target_gates(result):
    _, r = result
    g = r["target"]["gates"]
    assert r["target"]["given"] and r["verdicts"]["target_gates"]["passed"], g
    assert g["bf16_fp32_agreement"] >= 0.99 and g["bigram_predictability"] <= 0.5 and g["loop_rate"] <= 0.2, g
    assert g["task_accuracy"] >= 0.5, g  # the toy target does the lookup: each next token is found in the list


def test_data_went_through_extract(result):
    _, r = result
    ex = r["extract"]
    assert ex["ds-train@correct"]["rc"] == 0 and ex["ds-train@correct"]["aux_hf"] == [0, 2, 3]
    assert ex["ds-heldout@off_by_one"]["aux_hf"] == [1, 3, 4]  # what the off-by-one reading serves
    for name in ("ds-train@correct", "ds-heldout@correct"):
        ds = Path(r["work"]) / "data" / name
        assert (ds / "manifest.json").is_file() and list(ds.rglob("*.ckpt")), name


def test_guard_fails_exactly_the_mismatched(result):
    _, r = result
    g = r["guard"]
    assert g["correct"]["rc"] == 0 and g["floor"]["rc"] == 0, g
    assert g["off_by_one"]["rc"] == 1, g
    # unpatched 0.5.9 cannot capture index 0 (the embedding output) that the upstream-id draft reads
    assert g["upstream_ids"]["rc"] == 1, g
    assert r["verdicts"]["guard"]["passed"], r["verdicts"]["guard"]


def test_reader_equals_specforges(result):
    """The tool reads the dataset itself (SpecForge's reader module imports HF datasets, which the
    GPU machine lacks); what it hands training must be what SpecForge 0.2.0's OfflineEagle3Dataset
    hands it, tensor for tensor, on the run's own extracted files."""
    import torch
    from specforge.data.preprocessing import OfflineEagle3Dataset

    from eaglepatch.acceptance.train import read_sample, sample_files

    _, r = result
    files = sample_files(Path(r["work"]) / "data" / "ds-train@correct")[:4]
    assert files
    theirs = OfflineEagle3Dataset(files, max_len=2048)
    for i, f in enumerate(files):
        ours, ref = read_sample(f), theirs[i]
        assert set(ours) == set(ref), (set(ours), set(ref))
        for k in ref:
            assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), (f, k)
    # and a reader that forgot SpecForge's last-position mask would differ
    assert not torch.equal(torch.load(files[0], weights_only=True)["loss_mask"][None, :], read_sample(files[0])["loss_mask"])


def test_predicted_accept_length(result):
    _, r = result
    pred = r["drafts"]["correct"]["heldout"]
    assert len(pred["step_accuracies"]) == 3 and 1.0 <= pred["predicted_accept_length"] <= 4.0, pred
    assert pred["tokens"] > 0


def test_every_phase_timed(result):
    _, r = result
    assert set(r["phases"]) == {"target", "data", "drafts", "guard", "replay"}
    assert all("wall_s" in v for v in r["phases"].values()), r["phases"]


# ---- compact dump (issue 30): the same toy on fp8 data with the rebuildable states left out --------

FP8_SETS = dict(dump_dtype="fp8", rebuildable="omit", controls="correct")
# |fp8 - bf16| replayed accept length of one seed (test_fp8_accept_length_within_bf16s says why)
FP8_ACCEPT_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def fp8_result(result):
    """The toy again in the bf16 run's work directory (so the same target and prompts: its
    conversations are reused, not generated again), its data server storing the states as fp8
    with the rebuildable ones left out (EAGLE3_DUMP_DTYPE=fp8, EAGLE3_DUMP_REBUILDABLE=omit), the
    dataset read back through tools/extract.py (dequantised, rebuilt from the target); only the
    correct draft (controls=correct), trained as the bf16 run's (same seed, same 150 steps) and
    replayed. Adds a data server start, two extractions and one draft: 97 s on this 2-core
    machine idle (129-134 s shared)."""
    _, r = result
    work = Path(r["work"])
    out = work.parent / "result-fp8.json"
    sets = [a for k, v in dict(TOY_SETTINGS, **FP8_SETS).items() for a in ("--set", f"{k}={v}")]
    p = subprocess.run([sys.executable, str(TOOL), "--cpu", "--target", str(TOY_TARGET), "--work", str(work),
                        "--out", str(out), "--budget-s", "0", "--port", str(_free_port()), *sets],
                       capture_output=True, text=True, timeout=1800)
    assert out.is_file(), p.stderr[-3000:]
    f = json.loads(out.read_text())
    d = f["verdicts"].get("drafts", {})
    assert d.get("measured"), (d.get("verdict"), p.stderr[-2000:])
    return p, f


def test_fp8_data_went_through_the_compact_dump(result, fp8_result):
    """The fp8 run's dataset came from dumps stored as float8_e4m3fn with the embedding output and
    the final state left out (format eagle3-dump/2), of the same conversations as the bf16 run's
    (its greedy.json reused: same prompts, same target), extracted by tools/extract.py; the run
    passed (exit 0) with its one figure named replayed."""
    _, r = result
    p, f = fp8_result
    s = f["storage"]
    tr = s["dump"]["train@correct"]
    assert s["dump_dtype"] == "fp8" and s["rebuildable"] == "omit", s
    assert tr["storage_dtype"] == ["float8_e4m3fn"] and tr["formats"] == ["eagle3-dump/2"], tr
    assert [sorted(json.loads(x)) for x in tr["left_out"]] == [["final", "layer.-1"]], tr
    assert tr["files"] == tr["samples"] == TOY_SETTINGS["train_prompts"] and not tr["unmatched_samples"], tr
    assert "layer.-1" not in tr["tensor_bytes"] and "final" not in tr["tensor_bytes"], tr["tensor_bytes"]
    assert s["greedy_sha256"] == r["storage"]["greedy_sha256"] and f["greedy_from"].endswith("data/greedy.json")
    assert f["target"]["sha256"] == r["target"]["sha256"]
    assert Path(f["work"], "data-fp8-omit", "ds-train@correct", "manifest.json").is_file()
    # its draft and server logs beside the bf16 run's, not over them
    assert f["drafts"]["correct"]["dir"] == str(Path(f["work"], "drafts-fp8-omit", "correct")) != r["drafts"]["correct"]["dir"]
    assert Path(f["work"], "logs-fp8-omit", "server-data.log").is_file()
    assert f["extract"]["ds-train@correct"]["rc"] == 0 and set(f["extract"]) == {"ds-train@correct",
                                                                                 "ds-heldout@correct"}
    assert f["guard"]["correct"]["rc"] == 0 and set(f["guard"]) == {"correct"}, f["guard"]
    assert set(f["replayed"]) == {"correct"} and f["verdicts"]["replay"]["passed"], f["verdicts"]["replay"]
    assert p.returncode == 0 and p.stderr.strip().splitlines()[-1].startswith("passed: replayed"), p.stderr[-1000:]


def test_fp8_accept_length_within_bf16s(result, fp8_result):
    """Issue 30: a draft trained on the fp8 dump's data (dequantised, embedding and final rebuilt)
    accepts what the same draft (seed 0, same steps, same conversations) trained on the states
    stored as computed accepts, within 0.15 (replayed, on the 32 held-out conversations: 352
    tokens in about 100 verifies, so one verify more or less moves it by 0.034). A tripwire for
    the data path, not evidence for the GPU goal (within 0.03); the data path itself is held by
    test_fp8_row_error_per_state. One seed's difference moves with the training's arithmetic: with
    torch's 2 threads 3.451 (bf16) vs 3.485 (fp8), +0.034; with 1 thread (the test workers'
    setting, tools/test.py) 3.4175 vs 3.520, +0.1025; with draft seeds 1 and 2 -0.068 and -0.103
    (docs/acceptance.md). So 0.15, not the 0.05 it was (which the 1-thread run failed): above every
    difference measured, below what a layer mix-up costs on this toy (test_controls_ordered: the
    off-by-one reading accepts at least 0.3 less, measured 1.26). The held-out prediction is
    reported, not judged: a change of the server's scale in its last bit moved it from 3.642 to
    3.560 (bf16 3.635) while the replay stayed 3.485."""
    from eaglepatch.acceptance import storage_check

    _, r = result
    _, f = fp8_result
    assert f["verdicts"]["drafts"]["steps"] == {"correct": 150} == {"correct": r["verdicts"]["drafts"]["steps"]["correct"]}
    assert f["drafts"]["correct"]["seed"] == r["drafts"]["correct"]["seed"] == 0
    c = storage_check.compare(r, f)
    a, b = r["replayed"]["correct"]["accept_length"], f["replayed"]["correct"]["accept_length"]
    assert c["seeds"] == [0] and c["per_seed"][0]["difference"] == round(b - a, 4), c
    assert abs(b - a) <= FP8_ACCEPT_TOLERANCE, ("replayed accept length bf16 %.4f, fp8+omit %.4f" % (a, b), c["per_seed"])


def test_fp8_dump_bytes(result, fp8_result):
    """The fp8 dump with the rebuildable states left out writes at most 0.55 of the state bytes the
    dump stores as computed, on the same train conversations. Judged on the state tensors
    (layer.*, final, the fp8 scales and row positions), not on the files: the int64 input_ids
    and the safetensors header do not shrink (on the toy, hidden 256 and 34 tokens a file, they
    were 5% of the fp8 files: 0.44 MB of headers and 0.07 MB of ids in 9.6 MB), so the file
    ratio is in the message, not judged. The CPU toy computes in float32, so its reference dump
    is float32 (measured 0.169 of its state bytes); the ratio against a bf16 store of the same
    states (2 bytes a value, what a bf16 model's dump writes) is judged too (measured 0.339: 4
    of 6 states stored, 1 byte a value plus a 4-byte scale per row of 256)."""
    _, r = result
    _, f = fp8_result
    ref, got = r["storage"]["dump"]["train@correct"], f["storage"]["dump"]["train@correct"]
    vs = f["storage"]["vs_reference"]
    assert ref["storage_dtype"] == ["float32"] and ref["tokens"] == got["tokens"], (ref, got)
    ratio, vs_bf16 = got["state_bytes"] / ref["state_bytes"], got["state_bytes"] / (2 * ref["state_values"])
    files = "file bytes %d vs %d (%.3f; ids and headers included)" % (got["file_bytes"], ref["file_bytes"],
                                                                     got["file_bytes"] / ref["file_bytes"])
    assert vs["state_bytes_ratio"] == round(ratio, 4) and vs["same_conversations"], vs
    assert ratio <= 0.55, "state tensors' bytes fp8+omit %d vs float32 %d = %.3f > 0.55; %s" % (
        got["state_bytes"], ref["state_bytes"], ratio, files)
    assert vs_bf16 <= 0.55, "state tensors' bytes fp8+omit %d vs a bf16 store %d = %.3f > 0.55; %s" % (
        got["state_bytes"], 2 * ref["state_values"], vs_bf16, files)
    for name in ("train@correct", "heldout@correct"):  # the datasets' bytes are recorded too
        assert f["storage"]["datasets"][name]["sample_bytes"] > 0, f["storage"]["datasets"]


def test_fp8_row_error_per_state(fp8_result):
    """The states the fp8 dump's reader yields against the same conversations' states stored as
    computed (the held-out files both runs keep), per state: the rebuilt embedding output is exact
    (embed_tokens.weight[id]); each fp8 state is within e4m3's rounding (3 mantissa bits: at most
    2^-4 of each value, so of a row's norm); the rebuilt final (RMSNorm of the fp8 layer N-1) too.
    Measured: 0 for layer.-1; mean 0.025, max 0.031 for layers 0-3; final mean 0.026, max 0.032."""
    _, f = fp8_result
    e = f["storage"]["row_error_vs_reference"]
    assert "error" not in e and e["files"] == TOY_SETTINGS["heldout_prompts"] and not e["files_without_reference"], e
    st = e["states"]
    assert set(st) == {"layer.-1", "layer.0", "layer.1", "layer.2", "layer.3", "final"}, st
    assert st["layer.-1"]["max"] == 0.0, st["layer.-1"]
    for name in ("layer.0", "layer.1", "layer.2", "layer.3", "final"):
        assert 0 < st[name]["max"] <= 2 ** -4 and st[name]["mean"] <= 0.04, (name, st[name])


def test_fp8_compare_tool(result, fp8_result, tmp_path):
    """benchmarks/fp8_accept.py, what the GPU comparison ends with, on the two CPU results: per
    seed, means, the mean difference, the bytes and the row errors, in its JSON and its lines."""
    _, r = result
    _, f = fp8_result
    a, b = tmp_path / "bf16.json", tmp_path / "fp8.json"
    a.write_text(json.dumps(r))
    b.write_text(json.dumps(f))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fp8_accept.py"), str(a), str(b), "--out",
                        str(tmp_path / "c.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode in (0, 1), p.stderr
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["seeds"] == [0] and c["how"] == "replayed" and "bytes" in c and c["row_error"]["states"], c
    assert "seed 0:" in p.stdout and "mean:" in p.stdout and "row error final" in p.stdout, p.stdout
    # two runs of other targets or other conversations are not compared
    f2 = dict(f, target=dict(f["target"], sha256="0" * 64))
    b.write_text(json.dumps(f2))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fp8_accept.py"), str(a), str(b)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "same target" in p.stderr, p.stderr


class _FakeRun:
    """What pipeline.Server needs of a Run: a work dir, a port, a server command (here ``python -c
    CODE``) and its environment."""

    def __init__(self, work, port, code):
        import os
        import types

        self.work, self.o, self.code, self.env = work, types.SimpleNamespace(port=port), code, dict(os.environ)
        self.logs = work / "logs"
        self.lines = []

    def server_argv(self, port, draft, parent, model=None):
        return [sys.executable, "-c", self.code]

    def server_env(self, parent, dump):
        return self.env

    def say(self, m):
        self.lines.append(m)


def test_server_that_exits_is_one_line_refusal(tmp_path):
    """A server that dies before answering ends the run with `error: <problem>; <fix>` (exit 1)
    naming its log, not an internal-error line."""
    from eaglepatch.acceptance.pipeline import Server
    from eaglepatch.errors import RefusedError

    s = Server(_FakeRun(tmp_path, _free_port(), "import sys; print('address already in use'); sys.exit(3)"), "data", tmp_path,
               None, None)
    with pytest.raises(RefusedError) as ei:
        with s:
            pass
    line = ei.value.line()
    assert line.startswith("error: server data exited with 3 before answering (address already in use)"), line
    assert str(s.log) in line and "\n" not in line and ei.value.exit_code == 1


def test_server_port_taken_is_refused(tmp_path):
    """A port something already listens on is refused before the server starts, in one line naming
    the port and --port: otherwise that listener would answer the run's requests in its place."""
    import socket

    from eaglepatch.acceptance.pipeline import Server
    from eaglepatch.errors import RefusedError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        s = Server(_FakeRun(tmp_path, port, "import time; time.sleep(60)"), "data", tmp_path, None, None)
        with pytest.raises(RefusedError) as ei:
            s.start()
    line = ei.value.line()
    assert line.startswith(f"error: port {port} on 127.0.0.1 is taken"), line
    assert "--port" in line and "\n" not in line and s.proc is None and not s.log.exists()


def test_rule_next_follows_each_language():
    """rule_next (what the gates' rule accuracy scores greedy output against) gives back each
    sample's own answer from the tokens before it, and the recall alphabet bounds its symbols."""
    import random

    from eaglepatch.acceptance.language import Language

    rng = random.Random(3)
    for kind, kw in (("skip", {}), ("recall", {"alphabet": 8})):
        lg = Language(kind, 1024, 8, 7, 0, **kw)
        for _ in range(20):
            s = lg.sample(rng)
            seq = list(s.prefix) + list(s.answer)
            assert lg.rule_next(s, seq[:-1]) == seq[1:], (kind, s)
            wrong = seq[:-1]
            wrong[-1] = next(t for t in lg.pool if t != wrong[-1])
            assert lg.rule_next(s, wrong)[-1] != seq[-1] or kind == "skip", (kind, s)
        if kind == "recall":
            assert {t for t in s.user} <= set(lg.pool[:8]) and len(lg.pool) == 8


def _tool(tmp_path, *args, timeout=120):
    """tools/acceptance.py, GPU form (--site and --patched-files are empty directories: laying the
    patched files out would fail, so a refusal seen first was checked before that work)."""
    return subprocess.run([sys.executable, str(TOOL), "--work", str(tmp_path / "w"), "--site", str(tmp_path),
                           "--patched-files", str(tmp_path), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def _one_line(p, code: int) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    return lines[0]


@pytest.mark.parametrize("item,why", [("bogus=1", "not KEY=VALUE with a known key"),
                                      ("symbols=many", "symbols takes an integer >= 0; e.g. --set symbols=48"),
                                      ("target_lr", "not KEY=VALUE with a known key"),
                                      # True is an int to Python: this trained the drafts 1 step
                                      ("draft_max_steps=true", "draft_max_steps takes an integer >= 0; "
                                                               "e.g. --set draft_max_steps=0"),
                                      ("target_lr=false", "target_lr takes a number >= 0; e.g. --set target_lr=0.001"),
                                      ("target_lr=NaN", "target_lr takes a number >= 0"),
                                      ("draft_fc_norm=1", "draft_fc_norm takes true or false; "
                                                          "e.g. --set draft_fc_norm=true"),
                                      ("symbols=-4", "symbols takes an integer >= 0"),
                                      ("alphabet=true", "alphabet takes an integer >= 0 or null"),
                                      ("language=cpy", "language is one of skip, recall, copy"),
                                      ("dump_dtype=fp16", "dump_dtype is one of bf16, fp8"),
                                      ("rebuildable=drop", "rebuildable is one of store, omit"),
                                      ("controls=some", "controls is one of all, correct"),
                                      ("draft_seed=x", "draft_seed takes an integer >= 0 or null")])
def test_set_refuses_bad_settings(tmp_path, item, why):
    """--set names one of the scale's settings with a value of its type (true/false only for a
    flag); anything else is a one-line usage error (exit 2) naming the key, the type and an
    example, before any work, and no work directory is made."""
    line = _one_line(_tool(tmp_path, "--set", item), 2)
    assert line.startswith(f"error: --set {item}: {why}"), line
    assert not (tmp_path / "w").exists()


def test_set_takes_a_null_where_the_default_is_one(tmp_path):
    """alphabet=null (all symbol words) and an integer for a float are values of the setting's
    type: the run goes on to its next check (laying out the patched files on a CUDA machine; here,
    without CUDA, the refusal of device=cuda, which comes after every --set is taken)."""
    line = _one_line(_tool(tmp_path, "--set", "alphabet=null", "--set", "target_lr=1", "--port", _free_port()), 2)
    assert "has no patched-files.json" in line or "sees no CUDA device" in line, line
    assert "alphabet" not in line and "target_lr" not in line, line


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_out_must_be_a_regular_file(tmp_path, kind):
    """--out through a symbolic link wrote the link's target; a FIFO hung the run at its first
    save. Either is refused in one line (exit 2) before any work: nothing is written, the link's
    target keeps its content, no work directory is made."""
    import os

    out, victim = tmp_path / "result.json", tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    if kind == "symlink":
        out.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    line = _one_line(_tool(tmp_path, "--out", out, "--port", _free_port(), timeout=60), 2)
    want = {"symlink": "is a symbolic link, not a regular file", "fifo": "is a FIFO, not a regular file",
            "directory": "is a directory"}[kind]
    assert line.startswith(f"error: --out {out} {want}"), line
    assert victim.read_text() == "keep me\n" and not (tmp_path / "w").exists()


def test_report_is_written_by_rename(tmp_path):
    """The result JSON is written whole: a temporary file in its directory, then a rename. A hard
    link to the old report keeps the old content (an in-place write would change it), and no
    temporary file is left."""
    import os

    from eaglepatch.acceptance.pipeline import Options, Run

    out = tmp_path / "result.json"
    out.write_text("old\n")
    os.link(out, tmp_path / "old.json")
    Run(Options(work=tmp_path / "w", out=out)).save()
    assert json.loads(out.read_text())["scale"] == "cpu"
    assert (tmp_path / "old.json").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json", "result.json", "w"]


def test_ports_checked_before_any_work(tmp_path):
    """Every port the run will listen on (GPU: --port, the four control servers at +1..+4) is
    checked before anything is trained or laid out: a taken one is refused in one line naming it
    (exit 1); a --port whose range passes 65535 is a usage error (exit 2)."""
    import socket

    port = _free_port()
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", port + 3))
        except OSError:
            pytest.skip("port %d is in use here" % (port + 3))
        taken.listen(1)
        line = _one_line(_tool(tmp_path, "--port", port), 1)
    assert line.startswith(f"error: port {port + 3} on 127.0.0.1 is taken") and "--port" in line, line
    assert not (tmp_path / "w").exists()
    line = _one_line(_tool(tmp_path, "--port", 65530), 2)
    assert line.startswith("error: --port 65530: the run listens on ports 65530 to 65551"), line


@pytest.mark.parametrize("what", ["llama", "no-config", "tokenizer", "layers"])
def test_given_target_checked_before_any_work(tmp_path, what):
    """--target must be a DeepSeek-V3 of at least 3 layers with the tinychat tokenizer; anything
    else is refused in one line (exit 2) before any work (it was found only after training, or
    not at all)."""
    import shutil

    t = tmp_path / "target"
    shutil.copytree(TOY_TARGET, t, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((t / "config.json").read_text())
    if what == "llama":
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif what == "layers":
        cfg["num_hidden_layers"] = 2
    elif what == "tokenizer":
        tok = json.loads((t / "tokenizer.json").read_text())
        tok["model"]["vocab"] = {f"t{i}": i for i in range(len(tok["model"]["vocab"]))}
        (t / "tokenizer.json").write_text(json.dumps(tok))
    (t / "config.json").write_text(json.dumps(cfg))
    if what == "no-config":
        (t / "config.json").unlink()
    line = _one_line(_tool(tmp_path, "--target", t, "--port", _free_port()), 2)
    want = {"llama": "is ['LlamaForCausalLM'] (config.json), not DeepseekV3ForCausalLM",
            "no-config": "has no config.json", "layers": "has 2 layers; the run needs at least 3",
            "tokenizer": "does not use the chat tokenizer of eaglepatch.serve.tinychat"}[what]
    assert line.startswith(f"error: --target {t} {want}"), line
    assert not (tmp_path / "w").exists()


def test_draft_seconds_with_draft_steps_is_refused(tmp_path):
    """With draft_max_steps the drafts train by steps; a draft_budget_s beside it would do nothing
    (it was a cap that cut a loaded machine's drafts to 17 of 150 steps): refused in one line."""
    line = _one_line(_tool(tmp_path, "--set", "draft_max_steps=150", "--draft-budget-s", "240"), 2)
    assert line.startswith("error: draft_budget_s does nothing with draft_max_steps 150"), line


@pytest.mark.parametrize("sets,why", [(["draft_seeds=3"], "draft_seeds 3 needs controls=correct"),
                                     (["draft_seeds=9", "controls=correct"], "draft_seeds 9: 1 to 8 drafts"),
                                     (["draft_seeds=0", "controls=correct"], "draft_seeds 0: 1 to 8 drafts")])
def test_draft_seeds_refused(tmp_path, sets, why):
    """Several draft seeds train one correct draft each (controls=correct); with the four controls,
    or more seeds than servers fit (8), the run is refused in one line before any work."""
    line = _one_line(_tool(tmp_path, *[a for x in sets for a in ("--set", x)]), 2)
    assert line.startswith("error: " + why), line
    assert not (tmp_path / "w").exists()


def test_seed_drafts_trained_served_and_judged(tmp_path, monkeypatch):
    """controls=correct with draft_seeds=3 (the GPU comparison's drafts): three correct drafts,
    seeds 0, 1, 2, each its configured steps, exported under its own name, guarded (the reading of
    the correct draft), served on its own port (--port + 1..3); no floor, no other control. The
    seeds verdict reports each accept length, the mean and the spread, and fails a draft whose
    outputs differ from the greedy ones or that is far from its prediction."""
    from eaglepatch.acceptance import verdicts

    run = _draft_run(tmp_path, monkeypatch, 0, draft_max_steps=150, controls="correct", draft_seeds=3)
    run.do_drafts()
    names = ["correct", "correct@seed1", "correct@seed2"]
    assert [(m.seed, m.zero_aux) for m in _SlowDraft.made] == [(0, False), (1, False), (2, False)]
    d = run.res["verdicts"]["drafts"]
    assert d["measured"] and d["steps"] == dict.fromkeys(names, 150) and d["same_steps"], d
    assert list(run.draft_dirs) == names and sorted(run.res["guard"]) == sorted(names)
    assert [run.res["drafts"][n]["seed"] for n in names] == [0, 1, 2]
    assert run.served_order() == names and run.res["drafts"]["correct@seed2"]["ids"] == [-1, 1, 2]
    ports = {}
    monkeypatch.setattr(run, "patched_parent", lambda: tmp_path)

    class FakeServer:
        def __init__(self, r, name, parent, draft, dump, port=None, model=None):
            ports[name] = port

        def start(self):
            pass
    from eaglepatch.acceptance import pipeline

    monkeypatch.setattr(pipeline, "Server", FakeServer)
    run.servers = {}
    for n in names:
        run.start_server(n)
    assert ports == {n: run.o.port + 1 + i for i, n in enumerate(names)}, ports
    assert pipeline.ports_used("gpu", run.p, 100) == [100, 101, 102, 103]

    held = {n: run.res["drafts"][n]["heldout"] for n in names}
    fig = {n: {"accept_length": x, "requests": 32, "lossless_requests": 32} for n, x in zip(names, (3.0, 3.1, 3.2))}
    v = verdicts.seeds_verdict(fig, held, 12, "served")
    assert v["passed"] and v["mean"] == 3.1 and v["spread"] == 0.2, v
    assert v["verdict"] == "served: correct drafts correct 3.000, correct@seed1 3.100, correct@seed2 3.200; mean 3.100"
    bad = dict(fig, **{"correct@seed1": dict(fig["correct@seed1"], lossless_requests=31)})
    v = verdicts.seeds_verdict(bad, held, 12, "served")
    assert not v["passed"] and v["failed"] == ["correct@seed1: 31 of 32 requests lossless (outputs differ from the "
                                               "no-speculation greedy ones)"], v
    far = dict(fig, correct={"accept_length": 2.0, "requests": 32, "lossless_requests": 32})
    assert verdicts.seeds_verdict(far, held, 12, "served")["failed"][0].startswith("correct served 2.000 vs predicted")
    v = verdicts.seeds_verdict({n: {"accept_length": 3.0} for n in names[:2]}, held, 12, "replayed")
    assert v["failed"] == ["correct@seed2: not replayed (absent)"] and v["verdict"].startswith(
        "replayed (no server loaded a draft): failed"), v


def test_seed_drafts_served_each_on_its_server(tmp_path, monkeypatch):
    """The GPU serve phase with controls=correct, draft_seeds=3 (fake servers: the phase's own
    code): each seed's draft on its own server, its accept length from the responses' meta_info,
    its outputs compared with the greedy ones, judged by the seeds verdict; the run's outcome
    passes on it (a data comparison has no off-by-one or floor to judge)."""
    from eaglepatch.acceptance import pipeline
    from eaglepatch.acceptance.verdicts import outcome

    run = _draft_run(tmp_path, monkeypatch, 0, draft_max_steps=150, controls="correct", draft_seeds=3)
    run.o.scale = "gpu"
    run.do_drafts()
    greedy = [{"prompt_ids": [5, 6, 7], "continuation": [8] * 12} for _ in range(TOY_SETTINGS["train_prompts"] + 4)]
    (tmp_path / "greedy.json").write_text(json.dumps(greedy))
    monkeypatch.setattr(run, "patched_parent", lambda: tmp_path)
    started = []

    class FakeServer:
        def __init__(self, r, name, parent, draft, dump, port=None, model=None):
            self.name, self.start_s = name, 1.0

        def start(self):
            started.append(self.name)

        def wait_ready(self, timeout=400):
            pass

        def generate(self, prompts, n, timeout=600):  # 12 tokens in 4 verifies: (12 - 1) / 4
            return [{"output_ids": [8] * n, "meta_info": {"completion_tokens": n, "spec_verify_ct": 4}} for _ in prompts]

        def stop(self):
            pass

        def tail(self):
            return []

    monkeypatch.setattr(pipeline, "Server", FakeServer)
    run.servers = {}
    run.do_serve()
    names = ["correct", "correct@seed1", "correct@seed2"]
    assert started == names and set(run.res["served"]) == set(names), run.res["served"]
    assert all(run.res["served"][n]["accept_length"] == 2.75 and run.res["served"][n]["lossless_requests"] == 4
               for n in names), run.res["served"]
    v = run.res["verdicts"]["serve"]
    assert v["served_accept_length"] == dict.fromkeys(names, 2.75) and v["mean"] == 2.75, v
    run.res["verdicts"].update(target_gates={"passed": True}, guard={"passed": True})
    code, line = outcome(run.res)
    # a1..a3 0.9 predict 3.08 at 11 tokens after the prefill: 2.75 is 0.33 short
    assert line.startswith("failed: served: failed: correct served 2.750 vs predicted 3.084"), line
    for n in names:  # 0.8 predict 2.66
        run.res["drafts"][n]["heldout"] = {"step_accuracies": [0.8, 0.8, 0.8], "predicted_accept_length": 2.95}
    run.do_serve()
    assert outcome(run.res)[0] == 0, outcome(run.res)


def test_storage_setting_reaches_the_data_server_only(tmp_path):
    """dump_dtype / rebuildable reach the data server as EAGLE3_DUMP_DTYPE / EAGLE3_DUMP_REBUILDABLE
    (a default run sets neither: its servers start as before), the data goes to its own
    directory (data-fp8-omit: the reference data stays), and a patched tree that does not know the
    variables is refused before its server starts (it would ignore them and store bf16)."""
    from eaglepatch.acceptance import pipeline
    from eaglepatch.errors import UsageError

    def run_with(**o):
        r = pipeline.Run(pipeline.Options(work=tmp_path / "w", overrides=o))
        r.cfg = json.loads((TOY_TARGET / "config.json").read_text())
        return r

    plain, fp8 = run_with(), run_with(dump_dtype="fp8", rebuildable="omit")
    parent = tmp_path / "parent"
    settings = parent / "sglang" / "srt" / "eagle3_capture" / "settings.py"
    settings.parent.mkdir(parents=True)
    settings.write_text('ENV_DIR = "EAGLE3_DUMP_DIR"\n')
    env = plain.server_env(parent, tmp_path / "d")
    assert "EAGLE3_DUMP_DTYPE" not in env and "EAGLE3_DUMP_REBUILDABLE" not in env and plain.data_name() == "data"
    plain.check_storage_supported(parent)  # nothing asked: nothing to refuse
    env = fp8.server_env(parent, tmp_path / "d")
    assert env["EAGLE3_DUMP_DTYPE"] == "fp8" and env["EAGLE3_DUMP_REBUILDABLE"] == "omit", env
    assert "EAGLE3_DUMP_DTYPE" not in fp8.server_env(parent, None)  # draft servers dump nothing
    assert fp8.data_name() == "data-fp8-omit" and fp8.logs.name == "logs-fp8-omit" and plain.logs.name == "logs"
    with pytest.raises(UsageError, match="has no EAGLE3_DUMP_DTYPE / EAGLE3_DUMP_REBUILDABLE"):
        fp8.check_storage_supported(parent)
    settings.write_text('A = "EAGLE3_DUMP_DTYPE"\nB = "EAGLE3_DUMP_REBUILDABLE"\n')
    fp8.check_storage_supported(parent)


def test_copy_language_needs_a_lookup():
    """copy: every symbol occurs once in the user turn and the answer continues the list from the
    given symbol; the rule gives back the answer, and a fixed offset does not (the start varies)."""
    import random

    from eaglepatch.acceptance.language import Language

    lg = Language("copy", 1024, 24, 16, 0, alphabet=64)
    rng = random.Random(5)
    offsets = set()
    for _ in range(50):
        s = lg.sample(rng)
        assert len(set(s.user)) == 24 and set(s.user) <= set(lg.pool)
        seq = list(s.prefix) + list(s.answer)
        assert lg.rule_next(s, seq[:-1]) == seq[1:]
        offsets.add(s.user.index(s.prefix[0]))
    assert len(offsets) > 4, offsets  # the answer's source position varies between samples
    with pytest.raises(ValueError):
        Language("copy", 1024, 8, 8, 0)  # the answer must be shorter than the list


def test_accept_length_at_a_length():
    """chain_accept_length_at: a perfect 3-step draft on 15 tokens after the prefill verifies
    4+4+4+3 (15/4), on 16 tokens 4 times (4.0); a draft that is always wrong accepts 1; long
    requests tend to 1 + a1 + a1*a2 + a1*a2*a3; and it equals a direct simulation of the cut."""
    import random

    from eaglepatch.acceptance.language import chain_accept_length, chain_accept_length_at as at

    assert at([1, 1, 1], 15) == 3.75 and at([1, 1, 1], 16) == 4.0 and at([0, 0, 0], 15) == 1.0
    acc = [0.9, 0.8, 0.7]
    assert abs(at(acc, 10**5) - chain_accept_length(acc)) < 1e-3
    assert at(acc, 15) < at(acc, 39) < chain_accept_length(acc)
    rng, T, V = random.Random(1), 15, 0
    for _ in range(40000):
        p = 0
        while p < T:
            V += 1
            k = 0
            while k < 3 and p + k + 1 < T and rng.random() < acc[k]:
                k += 1
            p += k + 1
    assert abs(40000 * T / V - at(acc, T)) < 0.02, (40000 * T / V, at(acc, T))


def test_copy_lead_moves_the_list():
    """copy with ``lead``: 0..lead filler tokens from outside the alphabet end the user turn, so
    the distance between an answer token and its copy in the list (what a draft fed nothing can
    learn by position) takes symbols - answer_len + lead values, not only symbols - answer_len;
    the rule still gives the answer back."""
    import random

    from eaglepatch.acceptance.language import Language

    def distances(lg):
        rng = random.Random(3)
        out = set()
        for _ in range(300):
            s = lg.sample(rng)
            full = lg.prompt_ids(s) + list(s.answer)
            first = len(lg.prompt_ids(s))  # where the first answer token sits
            out.add(first - full.index(s.answer[0]))
            seq = list(s.prefix) + list(s.answer)
            assert lg.rule_next(s, seq[:-1]) == seq[1:]
            fill = s.user[24:]
            assert not set(fill) & set(lg.pool) and len(fill) <= lg.lead and set(s.user[:24]) <= set(lg.pool)
        return out

    assert len(distances(Language("copy", 1024, 24, 16, 0, alphabet=64))) == 8
    assert len(distances(Language("copy", 1024, 24, 16, 0, alphabet=64, lead=8))) == 8 + 8
    for bad in (dict(kind="skip", alphabet=64), dict(kind="copy", alphabet=None)):
        with pytest.raises(ValueError, match="lead"):
            Language(bad["kind"], 1024, 24, 16, 0, alphabet=bad["alphabet"], lead=8)


def test_server_ready_only_after_its_warm_up(tmp_path, monkeypatch):
    """SGLang answers /get_model_info while its warm-up request still runs, and /health 503 until
    it ends; tools/extract.py refuses such a server. wait_ready returns only once /health is 200
    (a toy whose greedy data came back within the warm-up had its extract refused), and says
    while it waits that it does, with the seconds (a CPU server start took minutes in silence)."""
    import time

    from eaglepatch.acceptance import progress
    from eaglepatch.acceptance.pipeline import Server

    monkeypatch.setattr(progress, "PROGRESS_S", 0.5)
    port, state = _free_port(), tmp_path / "warm.jsonl"
    code = "import runpy, sys; sys.argv = ['warmkit', '%d', '3.0', %r]; runpy.run_path(%r, run_name='__main__')" % (
        port, str(state), str(REPO / "tests" / "warmkit.py"))
    fake = _FakeRun(tmp_path, port, code)
    with Server(fake, "data", tmp_path, None, None):
        ready_at = time.monotonic()
    lines = [json.loads(x) for x in state.read_text().splitlines()]
    health = [x["health"] for x in lines[1:]]
    assert ready_at >= lines[0]["until"], "wait_ready returned during the warm-up"
    assert health and health[-1] is True and False in health, health
    waiting = [m for m in fake.lines if m.startswith("[acceptance] server data: starting, waiting for /health (")]
    assert len(waiting) >= 2 and "of at most 400 s)" in waiting[0], fake.lines


def test_drafts_exported_as_sglang_loads_them(result):
    """Each control's draft directory holds what sglang 0.5.17 loads: config.json with the
    control's ids (and fc_norm as set), and fc, midlayer, norm and lm_head weights (fc_norm.{0,1,2}
    where set) without the frozen embedding; the floor's fc is zeros, the others' equal the correct draft's."""
    import torch
    from safetensors.torch import load_file

    _, r = result
    d = r["drafts"]
    tensors = {}
    for c in ("correct", "off_by_one", "floor", "upstream_ids"):
        cfg = json.loads((Path(d[c]["dir"]) / "config.json").read_text())
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == d[c]["ids"], c
        assert cfg.get("fc_norm", False) is r["settings"]["draft_fc_norm"], cfg
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"], cfg
        tensors[c] = load_file(str(Path(d[c]["dir"]) / "model.safetensors"))
        names = set(tensors[c])
        norms = {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
        assert {"fc.weight", "norm.weight", "lm_head.weight"} <= names, names
        assert (norms <= names) is r["settings"]["draft_fc_norm"] and (not names & norms) is not cfg.get("fc_norm", False)
        assert not any("embed_tokens" in n for n in names), names
    assert not tensors["floor"]["fc.weight"].any()
    assert tensors["correct"]["fc.weight"].any()
    for c in ("off_by_one", "upstream_ids"):
        assert all(torch.equal(tensors[c][k], tensors["correct"][k]) for k in tensors["correct"]), c
    assert d["off_by_one"]["ids"] != d["correct"]["ids"]


def test_fc_norm_draft_exports_its_norms(result, tmp_path):
    """--set draft_fc_norm=true: the exported draft declares fc_norm and carries the three per-aux
    norms sglang 0.5.17 loads (model.fc_norm.N); without it, neither."""
    from safetensors.torch import load_file

    from eaglepatch.acceptance import train

    _, r = result
    target = Path(r["target"]["path"])
    tcfg = json.loads((target / "config.json").read_text())
    for on in (True, False):
        cfg = train.draft_config(tcfg, [-1, 1, 2], "float32", fc_norm=on)
        run = train.DraftRun(target, cfg, 3, "cpu")
        out = run.export(tmp_path / str(on), "float32")
        names = set(load_file(str(out / "model.safetensors")))
        got = json.loads((out / "config.json").read_text())
        assert got.get("fc_norm", False) is on
        assert ({f"fc_norm.{i}.weight" for i in range(3)} <= names) is on, names


# ---- verdicts, fed mutated results --------------------------------------------------------------

# the H200 run's figures (docs/acceptance.md): they pass the GPU verdict
HELDOUT = {"step_accuracies": [0.991, 0.991, 0.990], "tokens": 4992, "predicted_accept_length": 3.943}


def _served(**acc):
    a = dict(dict(correct=3.799, off_by_one=2.795, floor=1.664, upstream_ids=3.799), **acc)
    return {c: {"accept_length": v, "requests": 128, "lossless_requests": 128, "how": "served"} for c, v in a.items()}


def _gpu_mutant(name):
    f = _served()
    if name == "lossless":
        f["floor"]["lossless_requests"] = 127
    elif name == "upstream_ids":
        f["upstream_ids"]["accept_length"] = 3.6
    elif name == "upstream_ids_error":
        f["upstream_ids"] = {"error": "RefusedError: server upstream_ids exited with 1 before answering"}
    elif name == "off_by_one":
        f["off_by_one"]["accept_length"] = 3.5
    elif name == "floor":
        f["floor"]["accept_length"] = 3.6
    elif name == "predicted":
        for c in ("correct", "upstream_ids"):
            f[c]["accept_length"] = 3.6
    elif name == "correct_error":
        f["correct"] = {"error": "URLError: timed out"}
    return f


@pytest.mark.parametrize("mutant,cause", [
    ("lossless", "floor: 127 of 128 requests lossless (outputs differ from the no-speculation greedy ones)"),
    ("upstream_ids", "upstream_ids served 3.600 vs correct 3.799: differs by 0.199 > 0.05"),
    ("upstream_ids_error", "upstream_ids: not served (RefusedError: server upstream_ids exited with 1"),
    ("off_by_one", "correct - off_by_one = 0.299 < 0.5"),
    ("floor", "correct - floor = 0.199 < 0.3"),
    ("predicted", "correct served 3.600 vs predicted 3.943: differs by 0.343 > 0.15"),
    ("correct_error", "correct: not served (URLError: timed out)"),
])
def test_served_verdict_fails_each_mutant(mutant, cause):
    """The GPU verdict on the H200 run's figures passes; each mutation of them fails it, alone, with
    a message naming the cause, and the run's outcome is exit 1 with that message. Among them what
    it did not check before: a draft whose outputs differ from the no-speculation greedy ones
    (lossless_requests < requests), and upstream ids on unpatched SGLang accepting other than
    the correct draft (they must feed it the same layers)."""
    from eaglepatch.acceptance.verdicts import outcome, served_verdict

    ok = served_verdict(_served(), HELDOUT, 40)
    assert ok["passed"] and not ok["failed"] and ok["verdict"].startswith("served: passed"), ok
    assert ok["lossless"]["floor"] == "128 of 128" and ok["upstream_ids_minus_correct"] == 0.0, ok
    v = served_verdict(_gpu_mutant(mutant), HELDOUT, 40)
    assert not v["passed"] and len(v["failed"]) == 1 and v["failed"][0].startswith(cause), v["failed"]
    assert cause in v["verdict"], v["verdict"]
    res = {"phases": {}, "verdicts": {"target_gates": {"passed": True}, "guard": {"passed": True},
                                      "drafts": {"measured": True, "same_steps": True, "verdict": "trained"},
                                      "serve": v}}
    code, line = outcome(res)
    assert code == 1 and cause in line, line
    res["verdicts"]["serve"] = ok
    assert outcome(res)[0] == 0


@pytest.mark.parametrize("mutant,cause", [
    ("off_by_one", "correct replayed 3.490 <= off_by_one 3.600"),
    ("floor", "correct replayed 3.490 <= floor 3.490"),
    ("correct", "correct: not replayed (absent)"),
])
def test_replayed_verdict_fails_each_mutant(mutant, cause):
    """The CPU verdict is about replayed figures and says so; it fails when the ordering does not
    hold, naming the control, or when a control has no figure."""
    from eaglepatch.acceptance.verdicts import replayed_verdict

    def figs(**acc):
        a = dict(dict(correct=3.49, off_by_one=2.27, floor=1.57), **acc)
        return {c: {"accept_length": v, "requests": 32} for c, v in a.items() if v is not None}

    ok = replayed_verdict(figs(), HELDOUT, 12)
    assert ok["passed"] and ok["verdict"].startswith("replayed (no server loaded a draft): ordering holds"), ok
    assert "replayed_accept_length" in ok and "accept_length" not in ok and "served_minus_predicted" not in ok
    v = replayed_verdict(figs(**{mutant: {"off_by_one": 3.6, "floor": 3.49, "correct": None}[mutant]}), HELDOUT, 12)
    assert not v["passed"] and v["failed"] == [cause] and v["verdict"].startswith("replayed"), v


def test_drafts_verdict_not_measured():
    """Drafts the budget stopped short of their configured steps (or the floor short of the correct
    draft's, or the correct draft short of its seconds) are not measured, in the issue's words;
    drafts that trained what they were configured to are."""
    from eaglepatch.acceptance.verdicts import drafts_verdict, outcome

    full = {"steps": 150, "stopped_by": "max_steps", "budget_s": None}
    v = drafts_verdict({"steps": 11, "stopped_by": "budget", "budget_s": 5.0}, None, 150)
    assert not v["measured"] and v["verdict"] == "not measured: drafts trained 11 of 150 steps (budget)", v
    v = drafts_verdict(full, {"steps": 17, "stopped_by": "budget", "budget_s": 5.0}, 150)
    assert not v["measured"] and v["verdict"] == "not measured: drafts trained 17 of 150 steps (budget)", v
    v = drafts_verdict({"steps": 40, "stopped_by": "budget", "budget_s": 12.0}, None, None, 30.0)
    assert not v["measured"] and v["verdict"] == "not measured: drafts trained for 12 of 30 s (budget)", v
    assert drafts_verdict({"steps": 90, "stopped_by": "budget", "budget_s": 30.0},
                          {"steps": 90, "stopped_by": "max_steps"}, None, 30.0)["measured"]
    v = drafts_verdict(full, dict(full), 150)
    assert v["measured"] and v["same_steps"] and v["verdict"] == "trained 150 steps each", v
    # whatever else the result holds, a run with such drafts ends on that one line, exit 1
    res = {"phases": {"guard": {"skipped": "x"}}, "verdicts": {"target_gates": {"passed": True},
                                                               "drafts": drafts_verdict({"steps": 11, "stopped_by": "budget"}, None, 150)}}
    assert outcome(res) == (1, "not measured: drafts trained 11 of 150 steps (budget)")


# ---- the drafts' budget, on a simulated slow machine ---------------------------------------------

class _SlowDraft:
    """A DraftRun on a loaded machine: each step costs SECONDS_PER_STEP (simulated: the budget it is
    given buys budget_s / SECONDS_PER_STEP steps)."""

    SECONDS_PER_STEP = 4.0
    made = []

    def __init__(self, target, cfg, steps, device, zero_aux=False, seed=0):
        self.zero_aux, self.cfg, self.seed = zero_aux, cfg, seed
        _SlowDraft.made.append(self)

    def train(self, files, epochs, batch, lr, budget_s, seed, say=print, max_steps=None):
        n = max_steps if max_steps is not None else 10 ** 6
        if budget_s is not None and budget_s / self.SECONDS_PER_STEP < n:
            return {"steps": int(budget_s / self.SECONDS_PER_STEP), "stopped_by": "budget", "budget_s": budget_s}
        return {"steps": n, "stopped_by": "max_steps", "budget_s": budget_s}

    def evaluate(self, held):
        return {"step_accuracies": [0.9, 0.9, 0.9], "tokens": 100, "predicted_accept_length": 3.439}

    def export(self, dest, dtype, zero_fc=False):
        Path(dest).mkdir(parents=True, exist_ok=True)
        return Path(dest)


def _draft_run(tmp_path, monkeypatch, budget_s, **overrides):
    from eaglepatch.acceptance import pipeline, train

    _SlowDraft.made = []
    monkeypatch.setattr(train, "DraftRun", _SlowDraft)
    monkeypatch.setattr(train, "sample_files", lambda d: [str(Path(d) / "s0.ckpt")])
    run = pipeline.Run(pipeline.Options(work=tmp_path / "w", target=TOY_TARGET, budget_s=budget_s, port=_free_port(),
                                        overrides=dict(TOY_SETTINGS, draft_fc_norm=True, **overrides)))
    run.cfg, run.target = json.loads((TOY_TARGET / "config.json").read_text()), TOY_TARGET
    run.data = {"dir": str(tmp_path), "train": str(tmp_path / "ds-train"), "heldout": str(tmp_path / "ds-heldout")}
    monkeypatch.setattr(run, "guard_one", lambda c: run.res["guard"].__setitem__(c, {"rc": 0, "expected_rc": 0}))
    return run


def test_drafts_train_their_steps_whatever_a_step_costs(tmp_path, monkeypatch):
    """Issue 29, item 9: a 240 s cap stopped a loaded machine's draft at 17 of 150 steps. Trained by
    steps, without a run budget (the CPU test's --budget-s 0), each draft trains its 150 steps
    however long a step takes (here a simulated 4 s), and is measured."""
    run = _draft_run(tmp_path, monkeypatch, 0, draft_max_steps=150)
    run.do_drafts()
    d = run.res["verdicts"]["drafts"]
    assert d["steps"] == {"correct": 150, "floor": 150} and d["measured"] and d["same_steps"], d
    assert [m.zero_aux for m in _SlowDraft.made] == [False, True]
    assert run.res["drafts"]["correct"]["training"]["budget_s"] is None
    assert run.res["drafts"]["correct"]["heldout"]["predicted_accept_length"] == 3.439


def test_truncated_drafts_are_not_measured(tmp_path, monkeypatch):
    """Issue 29, item 13: a run whose budget cut the drafts short (here 23 of 150 steps) reports no
    accept length: the drafts verdict is `not measured: drafts trained N of M steps (budget)`,
    nothing is evaluated, exported, guarded or replayed, the result says why each later phase did
    not run, and the outcome is exit 1 with that one line."""
    from eaglepatch.acceptance.verdicts import outcome

    run = _draft_run(tmp_path, monkeypatch, 300, draft_max_steps=150)
    said = []
    run.say = said.append
    monkeypatch.setattr(run, "do_target", lambda: run.res["verdicts"].update(target_gates={"passed": True,
                                                                                          "failed": []}))
    monkeypatch.setattr(run, "do_data", lambda: None)
    res = run.run()
    d = res["verdicts"]["drafts"]
    assert not d["measured"] and d["verdict"].startswith("not measured: drafts trained "), d
    n = d["steps"]["correct"]
    assert 0 < n < 150 and d["verdict"] == f"not measured: drafts trained {n} of 150 steps (budget)", d
    assert len(_SlowDraft.made) == 1, "the floor was trained after the correct draft was cut"
    assert "heldout" not in res["drafts"]["correct"] and "replayed" not in res and "served" not in res
    assert res["phases"]["guard"] == {"skipped": d["verdict"]} and res["phases"]["replay"] == {"skipped": d["verdict"]}
    assert outcome(res) == (1, d["verdict"])
    assert "[acceptance] " + d["verdict"] in said


# ---- progress ------------------------------------------------------------------------------------

def test_data_generation_says_how_far_it_is(tmp_path, monkeypatch):
    """The data phase says, at least every progress.PROGRESS_S seconds (30; here 0.05), how many of
    the prompts have their greedy continuation and how many samples are extracted, with the
    seconds: a CPU run spent 11 silent minutes there."""
    import re
    import time

    from eaglepatch.acceptance import language, pipeline, progress

    monkeypatch.setattr(progress, "PROGRESS_S", 0.05)

    class FakeServer:
        url = "http://127.0.0.1:1"

        def __init__(self, run, name, parent, draft, dump, port=None, model=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompts, n, timeout=600):
            time.sleep(0.15)
            return [{"output_ids": [5] * n} for _ in prompts]

    def fake_extract(srv, data, out, hf, dump):
        out.mkdir(parents=True, exist_ok=True)
        for i in range(len(data.read_text().splitlines())):
            with open(out / "progress.jsonl", "a") as f:
                f.write("{}\n")
            time.sleep(0.003)

    monkeypatch.setattr(pipeline, "Server", FakeServer)
    run = pipeline.Run(pipeline.Options(work=tmp_path / "w", sglang_parent=tmp_path,
                                        overrides=dict(train_prompts=96, heldout_prompts=32)))
    said = []
    run.say = said.append
    run.servers = {}
    run.cfg = json.loads((TOY_TARGET / "config.json").read_text())
    run.lg = language.Language("copy", 1024, 16, 12, 0, alphabet=32)
    monkeypatch.setattr(run, "extract", fake_extract)
    run.do_data()
    gen = [m for m in said if re.fullmatch(r"\[acceptance\] data: greedy continuations \d+/128 prompts \(\d+ s\)", m)]
    ext = [m for m in said if re.fullmatch(r"\[acceptance\] data: \d+/\d+ samples extracted \(\d+ datasets\) \(\d+ s\)", m)]
    assert gen and ext, said
    total = int(ext[-1].split("/")[1].split()[0])
    assert total == 96 + 32 * (len(run.datasets_needed()) - 1), (ext, run.datasets_needed())


def _tiny_samples(d: Path, n: int, hidden: int) -> list:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        L = 12
        torch.save({"input_ids": torch.randint(8, 200, (L,), generator=g), "loss_mask": torch.ones(L, dtype=torch.long),
                    "hidden_state": torch.randn(1, L, hidden, generator=g),
                    "aux_hidden_state": torch.randn(1, L, 3 * hidden, generator=g)}, d / f"s{i}.ckpt")
        out.append(str(d / f"s{i}.ckpt"))
    return out


def test_draft_training_says_how_far_it_is_and_why_it_stopped(tmp_path, monkeypatch):
    """A real SpecForge draft on the toy target: a progress line per step here (PROGRESS_S 0; 30 s
    by default, besides every 25 steps) with step/total and seconds; max_steps stops it by steps
    (no time limit with budget_s None); a budget it runs out of stops it as 'budget' (the stop the
    pipeline reports as not measured)."""
    import re

    from eaglepatch.acceptance import progress, train

    monkeypatch.setattr(progress, "PROGRESS_S", 0.0)
    tcfg = json.loads((TOY_TARGET / "config.json").read_text())
    files = _tiny_samples(tmp_path / "ds", 4, tcfg["hidden_size"])
    run = train.DraftRun(TOY_TARGET, train.draft_config(tcfg, [-1, 1, 2], "float32", True), 3, "cpu")
    said = []
    h = run.train(files, 40, 2, 1e-3, None, 0, said.append, max_steps=3)
    assert h["steps"] == 3 and h["stopped_by"] == "max_steps" and h["budget_s"] is None, h
    steps = [m for m in said if re.match(r"\[acceptance\] draft step \d/3 \(epoch \d\): loss [\d.]+.* \(\d+ s\)$", m)]
    assert len(steps) == 3, said
    h = run.train(files, 40, 2, 1e-3, 0.0, 0, lambda m: None, max_steps=1000)
    assert h["stopped_by"] == "budget" and h["steps"] < 1000, h


def test_target_checked_and_training_says_how_far_it_is(tmp_path, monkeypatch):
    """The trained target: what save_target checks after training (DeepSeek-V3's hub names and
    shapes) is checked before it, so a transformers that saves other names costs no training; and
    the training says step/total and seconds at least every PROGRESS_S."""
    import re

    from eaglepatch.acceptance import pipeline, progress, train
    from eaglepatch.errors import UsageError

    monkeypatch.setattr(progress, "PROGRESS_S", 0.0)
    cfg = pipeline.target_config("cpu")
    model = train.build_target(cfg, "cpu", 0, tmp_path / "init")
    lg = language_for(cfg)
    said = []
    h = train.train_target(model, lg, 3, 2, 1e-3, 600, 0, "cpu", said.append)
    assert h["steps"] == 3, h
    assert [m for m in said if re.match(r"\[acceptance\] target step 2/3: loss [\d.]+ \(\d+ s\)$", m)], said
    train.check_target_saves(model, cfg, tmp_path / "chk")  # the real names pass

    # a transformers whose save_pretrained writes one tensor under another name
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    real_save = DeepseekV3ForCausalLM.save_pretrained

    def renamed_save(self, d, *a, **k):
        real_save(self, d, *a, **k)
        for f in Path(d).glob("*.safetensors"):
            sd = load_file(str(f))
            name = sorted(sd)[0]
            sd["renamed." + name] = sd.pop(name)
            save_file(sd, str(f), metadata={"format": "pt"})

    monkeypatch.setattr(DeepseekV3ForCausalLM, "save_pretrained", renamed_save)
    trained = []
    monkeypatch.setattr(train.TargetTraining, "run", lambda *a, **k: trained.append(1))
    run = pipeline.Run(pipeline.Options(work=tmp_path / "w"))
    run.say = said.append
    with pytest.raises(UsageError, match="saved tensors differ from DeepSeek-V3's hub names"):
        run.do_target()
    assert not trained, "the target was trained before its names were checked"


def language_for(cfg):
    from eaglepatch.acceptance import language, pipeline

    p = pipeline.SCALES["cpu"]
    return language.Language(p["language"], cfg["vocab_size"], p["symbols"], p["answer_len"], 0)
