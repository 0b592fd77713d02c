"""tools/acceptance.py at toy scale on CPU: the same pipeline as the GPU run (greedy data from the
patched sglang 0.5.9 CPU server, tools/extract.py, SpecForge 0.2.0 drafts, tools/guard.py on every
control), with serving replayed (sglang runs no EAGLE-3 decoding on CPU). The target is
tests/data/acceptance-toy-target: the CPU toy's DeepSeek-V3 trained on the GPU on the copy
language (an induction lookup: this 2-core machine does not teach it one within a test's budget;
docs/acceptance.md), passed as a user passes their own with --target. Asserts the gates, the data
path, guard's verdicts, the predicted accept length and the controls' ordering (correct >
off-by-one, correct > floor, by margins). test_target_trains_and_is_gated covers the training path
on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOY_TARGET = REPO / "tests" / "data" / "acceptance-toy-target"
# the language the toy target was trained on, and draft settings under which a one-layer draft
# learns the lookup from the aux states: 150 steps (about 45 s here), by steps and not by seconds,
# so a busy machine gives the drafts the same training (240 s is only the cap)
TOY_SETTINGS = dict(language="copy", symbols=16, alphabet=32, answer_len=12, lead=0, train_prompts=256,
                    heldout_prompts=32, gate_prompts=16, draft_fc_norm="true", draft_batch=64, draft_lr=2e-3,
                    draft_max_steps=150, draft_budget_s=240)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("acceptance")
    out = work / "result.json"
    sets = [a for k, v in TOY_SETTINGS.items() for a in ("--set", f"{k}={v}")]
    p = subprocess.run([sys.executable, str(REPO / "tools" / "acceptance.py"), "--cpu", "--target", str(TOY_TARGET),
                        "--work", str(work / "w"), "--out", str(out), "--budget-s", "480", *sets],
                       capture_output=True, text=True, timeout=900)
    assert out.is_file(), p.stderr[-3000:]
    return p, json.loads(out.read_text())


def test_controls_ordered(result):
    """What a layer mix-up costs, replayed: the draft fed the layers it was trained on accepts far
    more than the same weights fed the off-by-one reading, or a draft trained with its aux inputs
    zeroed (measured on this machine: 3.56 / 2.30 / 1.55 with these settings); the replay is
    near the held-out prediction; the tool exits 0."""
    p, r = result
    v = r["verdicts"]["serve"]
    a = v["accept_length"]
    assert v["ordering"], v
    assert a["correct"] - a["off_by_one"] >= 0.3 and a["correct"] - a["floor"] >= 1.0, v
    assert a["correct"] >= 3.0 and abs(v["served_minus_predicted"]) <= 0.3, v
    assert r["verdicts"]["drafts"]["same_steps"], r["verdicts"]["drafts"]
    assert p.returncode == 0, p.stderr[-2000:]


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
    assert set(r["phases"]) == {"target", "data", "drafts", "guard", "serve"}
    assert all("wall_s" in v for v in r["phases"].values()), r["phases"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeRun:
    """What pipeline.Server needs of a Run: a work dir, a port, a server command (here ``python -c
    CODE``) and its environment."""

    def __init__(self, work, port, code):
        import os
        import types

        self.work, self.o, self.code, self.env = work, types.SimpleNamespace(port=port), code, dict(os.environ)

    def server_argv(self, port, draft, parent, model=None):
        return [sys.executable, "-c", self.code]

    def server_env(self, parent, dump):
        return self.env

    def say(self, m):
        pass


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


@pytest.mark.parametrize("item,why", [("bogus=1", "not KEY=VALUE with a known key"),
                                      ("symbols=many", "symbols takes a int"),
                                      ("target_lr", "not KEY=VALUE with a known key")])
def test_set_refuses_bad_settings(tmp_path, item, why):
    """--set names one of the scale's settings with a value of its type; anything else is a
    one-line usage error (exit 2) before any work, and no work directory is made."""
    work = tmp_path / "w"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "acceptance.py"), "--work", str(work), "--site",
                        str(tmp_path), "--patched-files", str(tmp_path), "--set", item],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --set {item}: {why}"), p.stderr
    assert not work.exists()


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


def test_server_ready_only_after_its_warm_up(tmp_path):
    """SGLang answers /get_model_info while its warm-up request still runs, and /health 503 until
    it ends; tools/extract.py refuses such a server. wait_ready returns only once /health is 200
    (a toy whose greedy data came back within the warm-up had its extract refused)."""
    import time

    from eaglepatch.acceptance.pipeline import Server

    port, state = _free_port(), tmp_path / "warm.jsonl"
    code = "import runpy, sys; sys.argv = ['warmkit', '%d', '3.0', %r]; runpy.run_path(%r, run_name='__main__')" % (
        port, str(state), str(REPO / "tests" / "warmkit.py"))
    with Server(_FakeRun(tmp_path, port, code), "data", tmp_path, None, None):
        ready_at = time.monotonic()
    lines = [json.loads(x) for x in state.read_text().splitlines()]
    health = [x["health"] for x in lines[1:]]
    assert ready_at >= lines[0]["until"], "wait_ready returned during the warm-up"
    assert health and health[-1] is True and False in health, health


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
