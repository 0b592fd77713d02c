"""tools/check_draft.py on the CPU toy: the prediction and diagnosis path (replay; no server loads
a draft on CPU: sglang 0.5.9 runs no EAGLE-3 decoding there).

The inputs are made as a user makes them: the toy target of tests/data/acceptance-toy-target
(the acceptance test's), greedy conversations from the patched sglang 0.5.9 CPU server with the
dump on for every layer, datasets extracted by tools/extract.py (specforge format), the held-out
conversations' dump files kept (every layer and the post-norm final state: the states the
diagnosis replays), and EAGLE-3 drafts trained with SpecForge 0.2.0's own classes
(``acceptance.train.DraftRun``), 150 steps each:

- ``correct``: trained on HF indices [0, 2, 3] (ids [-1, 1, 2]), config as trained;
- ``shifted``: the same weights, its config's ids shifted to [0, 2, 3] (HF [1, 3, 4]);
- ``postnorm``: trained on [0, 2, final]: its last slot held the post-norm final state where its
  config (ids [-1, 1, 3], HF [0, 2, 4]) and the series feed the pre-norm output of layer 3; its
  held-out data is the [0, 2, 4] extraction with the same mistake (the last slot replaced by the
  final state), as the pipeline that trained it would have written it. Without fc_norm (``build``
  says why).

Each check runs the real command line. Nothing is stubbed: every figure is the drafts' own
forward over the extracted data. The inputs are made once and cached while the code that makes
them is unchanged (the ``toy`` fixture); the greedy conversations, the correct-layer datasets, the
kept held-out dumps and the correct draft are the acceptance test's own (tests/acceptance_toy.py:
the same target, settings and seed), copied from its run when one of the same code published them.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import acceptance_toy  # noqa: E402
# the acceptance test's toy target and settings: the language the toy target was trained on, and
# draft settings under which a one-layer draft learns the lookup
from acceptance_toy import TOY_SETTINGS, TOY_TARGET  # noqa: E402

TOOL = REPO / "tools" / "check_draft.py"
CORRECT_HF, LAST_HF = [0, 2, 3], [0, 2, 4]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_final_last(src: Path, dest: Path) -> None:
    """Copy the specforge dataset ``src`` to ``dest`` with each sample's last aux slot replaced by its
    post-norm final state (``hidden_state``): what a trainer that took the post-norm state for
    'the last layer' writes."""
    import torch

    shutil.copytree(src, dest)
    for p in sorted(dest.rglob("*.ckpt")):
        d = torch.load(p, map_location="cpu", weights_only=True)
        H = d["hidden_state"].shape[-1]
        d["aux_hidden_state"][..., -H:] = d["hidden_state"]
        torch.save(d, p)


def build(work: Path, say=print, shared: Path | None = None) -> dict:
    """The toy inputs under ``work``: greedy data from the patched CPU server (dump on, every layer),
    the extractions, the kept held-out dumps, the post-norm datasets, the drafts. Returns their
    paths relative to ``work`` (the cache renames the directory it is built in). With ``shared``
    (``acceptance_toy.shared()``: an acceptance run's greedy conversations, correct-layer datasets,
    kept held-out dumps and correct draft, made from the same target, settings and seed), those are
    copied, not made again: the server extracts only the [0, 2, 4] data of the same conversations."""
    from eaglepatch.acceptance import pipeline, train

    work = Path(work)
    sets = pipeline.parse_sets("cpu", [f"{k}={v}" for k, v in TOY_SETTINGS.items()])
    greedy = None
    if shared is not None:
        (work / "data").mkdir(parents=True)
        for name in acceptance_toy.SHARED_DATA:
            src = shared / "data" / name
            if src.is_dir():
                shutil.copytree(src, work / "data" / name)
            else:
                shutil.copy2(src, work / "data" / name)
        shutil.copytree(shared / acceptance_toy.SHARED_DRAFT, work / "drafts" / "correct")
        greedy = json.loads((work / "data" / "greedy.json").read_text())

    class DataRun(pipeline.Run):
        def datasets_needed(self):
            if greedy is not None:
                return [("heldout@last", LAST_HF)]
            return [("train@correct", CORRECT_HF), ("heldout@correct", CORRECT_HF), ("heldout@last", LAST_HF)]

        def reused_greedy(self, prompts):  # the shared conversations, when of these very prompts
            if greedy is not None:
                assert [c["prompt_ids"] for c in greedy] == prompts, "the shared conversations are of other prompts"
            return greedy

    run = DataRun(pipeline.Options(work=work, scale="cpu", target=TOY_TARGET, release="0.5.9", budget_s=0,
                                   overrides=sets, port=_free_port(), say=say))
    run.servers = {}
    # the acceptance test measures this target's gates; here only what the data phase reads
    run.cfg = json.loads((TOY_TARGET / "config.json").read_text())
    run.lg, run.target = run.language(run.cfg), TOY_TARGET
    run.do_data()
    data = Path(run.data["dir"])
    kept = data / "kept-dumps"
    assert len(list(kept.glob("*.safetensors"))) == TOY_SETTINGS["heldout_prompts"], list(kept.iterdir())[:3]
    post_train, post_held = data / "ds-train@postnorm", data / "ds-heldout@postnorm"
    _with_final_last(data / "ds-train@correct", post_train)
    _with_final_last(data / "ds-heldout@last", post_held)
    p = run.p
    # the post-norm draft without fc_norm: with it, each slot RMS-normed before fc, the toy target's
    # final norm (weights 0.49..1.39) changed no prediction of a draft trained so (accept length
    # 3.459 on either state): a swap that costs nothing is nothing to diagnose
    for name, files, ids, fc_norm in (("correct", data / "ds-train@correct", [-1, 1, 2], p["draft_fc_norm"]),
                                      ("postnorm", post_train, [-1, 1, 3], False)):
        if (work / "drafts" / name).is_dir():  # shared
            continue
        cfg = train.draft_config(run.cfg, ids, p["dtype"], fc_norm)
        d = train.DraftRun(TOY_TARGET, cfg, pipeline.NUM_STEPS, "cpu", seed=0)
        d.train(train.sample_files(files), p["draft_epochs"], p["draft_batch"], p["draft_lr"], None, 0, say,
                max_steps=p["draft_max_steps"])
        d.export(work / "drafts" / name, p["dtype"])
    # the same weights, the ids in its config shifted: the release reads them one layer deeper
    shifted = work / "drafts" / "shifted"
    shifted.mkdir(parents=True)
    cfg = json.loads((work / "drafts" / "correct" / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (shifted / "config.json").write_text(json.dumps(cfg, indent=2))
    (shifted / "model.safetensors").write_bytes((work / "drafts" / "correct" / "model.safetensors").read_bytes())
    shutil.rmtree(data / "dumps")  # emptied by the data phase
    rel = lambda q: str(Path(q).relative_to(work))  # noqa: E731
    out = {"drafts": {n: f"drafts/{n}" for n in ("correct", "shifted", "postnorm")},
           "heldout": rel(data / "ds-heldout@correct"), "heldout_postnorm": rel(post_held), "states": rel(kept)}
    (work / "inputs.json").write_text(json.dumps(out, indent=2))
    return out


def toy_key() -> str:
    """What the toy inputs are made from: the sglang 0.5.9 series (the data server), the project's
    code (but the check itself: check.py, serve_check.py), tools/extract.py, tools/acceptance.py (whose
    run's inputs ``build`` may start from), the target, this module's build, the settings and the
    environment. The cache holds inputs of this key only."""
    import hashlib
    import inspect

    h = hashlib.sha256()
    files = sorted((REPO / "patches" / "sglang-0.5.9").rglob("*")) + sorted((REPO / "src" / "eaglepatch").rglob("*.py"))
    files += [REPO / "tools" / "extract.py", REPO / "tools" / "acceptance.py"] + sorted(TOY_TARGET.iterdir())
    for f in files:
        if f.is_file() and f.name not in ("check.py", "serve_check.py"):  # the check itself makes no input
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    for fn in (build, _with_final_last):
        h.update(inspect.getsource(fn).encode())
    h.update(json.dumps([TOY_SETTINGS, CORRECT_HF, LAST_HF, sys.executable]).encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def toy():
    """The toy inputs (``build``), made once per ``toy_key`` under the cache (EAGLEPATCH_CACHE, else
    ~/.cache/eaglepatch: check-draft-toy/<key>) and reused while the code that makes them is
    unchanged: making them took 18 and 25 minutes on this 2-core machine while other tests ran
    (load 4-5), mostly the two drafts' 150 steps; with them cached the module took 2 minutes. A
    build goes to a temporary directory beside it, renamed in when done; other keys' inputs are
    removed then. A build after test_acceptance.py's run of the same code (the whole suite) starts
    from what that run published (``acceptance_toy.shared``)."""
    from eaglepatch import cpuenv

    dest = acceptance_toy.made_once(cpuenv.cache_dir() / "check-draft-toy", toy_key(), "inputs.json", lambda tmp: build(
        tmp, say=lambda m: print(m, file=sys.stderr), shared=acceptance_toy.shared()))
    rel = json.loads((dest / "inputs.json").read_text())
    return dict({k: str(dest / v) for k, v in rel.items() if k != "drafts"},
                drafts={n: str(dest / v) for n, v in rel["drafts"].items()})


def _check(toy, where, draft, data="heldout", *extra, states=True):
    """tools/check_draft.py on the toy's inputs, its report under ``where``; (process, report)."""
    where.mkdir(parents=True, exist_ok=True)
    out = where / "report.json"
    cmd = [sys.executable, str(TOOL), "--target", str(TOY_TARGET), "--draft", toy["drafts"][draft],
           "--data", toy[data], "--release", "0.5.9", "--out", str(out), *extra]
    if states:
        cmd += ["--states", toy["states"]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.is_file(), p.stderr[-3000:]
    return p, json.loads(out.read_text())


@pytest.fixture(scope="module")
def checked(toy, tmp_path_factory):
    """Each draft's check, run once for the module: name -> (process, report)."""
    where = tmp_path_factory.mktemp("checks")
    done = {}

    def get(name, data="heldout"):
        if name not in done:
            done[name] = _check(toy, where / name, name, data)
        return done[name]

    return get


def _reading(r, kind):
    return next(x for x in r["readings"] if kind in x["kinds"])


def test_correct_draft_passes(checked):
    """The draft whose config reads the layers it was trained on: guard passes, the replay on what
    sglang 0.5.9 with the series feeds it accepts what the held-out data predicts, exit 0. The
    readings a mix-up would produce accept less, by margins the diagnosis can tell apart."""
    p, r = checked("correct")
    assert p.returncode == 0, p.stderr[-2000:]
    assert r["guard"]["ok"] and r["guard"]["served_hf"] == CORRECT_HF, r["guard"]
    pred, obs = r["predicted"], r["observed"]
    assert pred["accept_length"] >= 3.0 and len(pred["per_position"]) == 3, pred  # the draft learned the lookup
    assert obs["kind"] == "replayed" and "no server loaded the draft" in obs["how"], obs
    assert r["within_tolerance"] and abs(r["observed_minus_predicted"]) <= 0.15, r["observed_minus_predicted"]
    assert r["diagnosis"]["cause"] == "none", r["diagnosis"]
    deeper = _reading(r, "off_by_one_deeper")
    assert deeper["hf"] == ["HF 1", "HF 3", "HF 4"], deeper
    assert pred["accept_length"] - deeper["accept_length"] >= 0.5, (pred, deeper)
    assert _reading(r, "as_trained")["minus_predicted"] == 0, _reading(r, "as_trained")  # the dumps hold the data's states
    png = Path(r["png"]["path"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r["png"]
    assert p.stderr.strip().splitlines()[-1].startswith("passed: replayed"), p.stderr[-500:]
    assert "diagnosis:" in p.stdout and "predicted" in p.stdout, p.stdout


def test_shifted_ids_is_off_by_one(checked):
    """The same weights with the ids in its config shifted: sglang 0.5.9 reads them one layer deeper
    (HF [1, 3, 4]). The replay on that accepts far less than predicted: exit 1, and the diagnosis
    names the mix-up: the prediction matches the data's own reading, the observed figure each aux
    layer one deeper."""
    p, r = checked("shifted")
    assert p.returncode == 1, p.stderr[-2000:]
    assert not r["guard"]["ok"] and r["guard"]["served_hf"] == [1, 3, 4], r["guard"]
    assert r["observed"]["hf"] == ["HF 1", "HF 3", "HF 4"], r["observed"]
    assert r["observed_minus_predicted"] < -0.5, r["observed_minus_predicted"]
    d = r["diagnosis"]
    assert d["cause"] == "off_by_one_deeper" and "off by one" in d["text"], d
    assert d["trained_reading"][0].startswith("as trained"), d
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("failed:") and "off by one" in last, last


def test_postnorm_last_slot_is_named(checked):
    """A draft whose last slot was trained on the post-norm final state, its config naming layer 3's
    output (HF 4), which the series feeds before the final norm. Guard cannot see it (the ids and
    the data's layers agree); the figures do: exit 1, and the diagnosis names the swap: the
    prediction matches the reading with the post-norm state in the last slot, the observed figure
    the pre-norm one."""
    p, r = checked("postnorm", "heldout_postnorm")
    assert r["guard"]["ok"] and r["guard"]["served_hf"] == LAST_HF, r["guard"]
    assert p.returncode == 1, p.stderr[-2000:]
    assert r["observed_minus_predicted"] < -0.15, (r["predicted"], r["observed"])
    d = r["diagnosis"]
    assert d["cause"] == "norm_swapped" and "post-norm" in d["text"], d
    assert _reading(r, "norm_swapped")["slots"] == [0, 2, "final"], r["readings"]
    assert "pre-norm and post-norm" in d["trained_reading"][0], d
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("failed:") and "post-norm" in last, last


def test_served_figures_are_compared(toy, checked, tmp_path):
    """--served: figures given from a file (a GPU run writes it) are what the prediction is compared
    with, named served, and matched against the replayed readings. Given the shifted draft's
    replayed figures (here the previous check's, named so in the file), the correct draft's check
    fails with the off-by-one diagnosis; given its own, it passes."""
    shifted, own = checked("shifted")[1], checked("correct")[1]
    for name, src, code in (("off", shifted, 1), ("own", own, 0)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"accept_length": src["observed"]["accept_length"],
                                 "per_position": src["observed"]["per_position"],
                                 "how": "replayed by tools/check_draft.py (test input)"}))
        p, r = _check(toy, tmp_path / name, "correct", "heldout", "--served", str(f))
        assert p.returncode == code, (name, p.stderr[-2000:])
        assert r["observed"]["kind"] == "served" and r["observed"]["source"] == str(f), r["observed"]
        if code:
            assert r["diagnosis"]["cause"] == "off_by_one_deeper", r["diagnosis"]


@pytest.mark.parametrize("extra,says", [
    (["--topk", "2"], "models a chain"),
    (["--steps", "0"], "draft steps per verify"),
    (["--release", "9.9.9"], "9.9.9"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--prompt-answer-tokens", "-1"], "--prompt-answer-tokens -1"),
])
def test_usage_errors(tmp_path, extra, says):
    """Refused before anything is loaded: one line (error: ...; fix), exit 2, no report, no PNG."""
    out = tmp_path / "r.json"
    d = tmp_path / "d"
    d.mkdir()
    cmd = [sys.executable, str(TOOL), "--target", str(TOY_TARGET), "--draft", str(d), "--data", str(d),
           "--states", str(d), "--out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and ";" in lines[0], p.stderr
    assert says in lines[0] and "Traceback" not in p.stderr, lines
    assert list(tmp_path.iterdir()) == [d], list(tmp_path.iterdir())


def test_usage_errors_on_inputs(toy, tmp_path):
    """Inputs that cannot be checked: the target's directory given as the draft (guard's refusal),
    no --states and no --served, a --served file of no accept length. Exit 2, one line, nothing
    written."""
    base = ["--target", str(TOY_TARGET), "--data", toy["heldout"], "--out", str(tmp_path / "r.json")]
    bad = tmp_path / "served.json"
    bad.write_text(json.dumps({"per_position": [1, 1, 1]}))
    good = tmp_path / "served-ok.json"
    good.write_text(json.dumps({"accept_length": 3.5}))
    correct = ["--draft", toy["drafts"]["correct"]]
    for extra, says in ((["--draft", str(TOY_TARGET), "--states", toy["states"]], "target model's config"),
                        (correct, "nothing to compare"),
                        (correct + ["--served", str(bad)], "accept_length"),
                        (correct + ["--served", str(good), "--serve"], "both give served figures"),
                        (correct + ["--states", toy["states"], "--site", str(tmp_path)], "settings of --serve"),
                        (correct + ["--states", toy["states"], "--lossless"], "--lossless compares"),
                        # a file without the answers' counts cannot say whether decoding was lossless
                        (correct + ["--served", str(good), "--lossless"], "answers_equal_to_data")):
        p = subprocess.run([sys.executable, str(TOOL), *base, *extra], capture_output=True, text=True, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
        assert says in lines[0], lines
        assert sorted(x.name for x in tmp_path.iterdir()) == ["served-ok.json", "served.json"], list(tmp_path.iterdir())


def _without_layer(src: Path, dest: Path, k: int) -> None:
    """The dump files of ``src`` as a server dumping every layer but ``k`` writes them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dest.mkdir()
    for p in sorted(src.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {name: f.get_tensor(name) for name in f.keys() if name != f"layer.{k}"}
        ids = [i for i in json.loads(meta["eagle3_layer_ids"]) if i != k]
        meta.update(eagle3_layer_ids=json.dumps(ids), hf_hidden_state_indices=json.dumps([i + 1 for i in ids]))
        save_file(tensors, str(dest / p.name), metadata=meta)


def test_readings_need_their_layers(toy, tmp_path):
    """Dump files that lack a state. Without layer 3's output (HF 4) the correct draft's check runs,
    and the reading one layer deeper is reported not replayed, naming what the dumps lack. Without
    layer 2's output (HF 3, which 0.5.9 feeds the draft) what it is fed cannot be replayed: a
    usage error naming the state, before any replay, nothing written."""
    gone3 = tmp_path / "no-layer-3"
    _without_layer(Path(toy["states"]), gone3, 3)
    p, r = _check(toy, tmp_path / "a", "correct", "heldout", "--states", gone3, states=False)
    assert p.returncode == 0, p.stderr[-2000:]
    deeper = _reading(r, "off_by_one_deeper")
    assert "accept_length" not in deeper and "layer.3" in deeper["not_replayed"], deeper
    assert _reading(r, "as_trained")["accept_length"] == r["predicted"]["accept_length"], r["readings"]
    gone2 = tmp_path / "no-layer-2"
    _without_layer(Path(toy["states"]), gone2, 2)
    out = tmp_path / "b" / "report.json"
    out.parent.mkdir()
    q = subprocess.run([sys.executable, str(TOOL), "--target", str(TOY_TARGET), "--draft", toy["drafts"]["correct"],
                        "--data", toy["heldout"], "--states", str(gone2), "--release", "0.5.9", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    lines = q.stderr.strip().splitlines()
    assert q.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "layer.2" in lines[0], q.stderr
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_relation_names_each_mix_up():
    """The mix-up named from the reading the draft was trained on and the one it is fed, on a
    4-layer target; each name only for its own case."""
    from eaglepatch.acceptance.check import FINAL, relation

    assert relation([0, 2, 3], [1, 3, 4], 4)[0] == "off_by_one_deeper"
    assert relation([1, 3, 4], [0, 2, 3], 4)[0] == "off_by_one_shallower"
    assert relation([0, 2, FINAL], [0, 2, 4], 4)[0] == "norm_swapped"
    assert "trained on the post-norm" in relation([0, 2, FINAL], [0, 2, 4], 4)[1]
    assert "trained on layer 3's output before" in relation([0, 2, 4], [0, 2, FINAL], 4)[1]
    assert relation([0, 2, 3], [0, 2, 3], 4)[0] == "none"
    assert relation([0, 2, 3], [0, 1, 3], 4)[0] == "other_layers"
    assert relation([0, 2, 3], [0, 2, FINAL], 4)[0] == "other_layers"  # HF 3 is no last layer of 4


def test_readings_follow_the_release():
    """The readings replayed for the data's HF indices. [0, 2, 3] on 0.5.9: upstream reads ids as the
    series does (k + 1), so output-of-layer ids read as trained and capture indices written as ids
    read one deeper. [1, 3, 4] on 0.5.17: unpatched reads output-of-layer ids [0, 2, 3] (first id
    not 1) as capture indices, one shallower; HF 4 is the last layer's pre-norm output, so the
    post-norm swap is replayed too."""
    from eaglepatch import conventions
    from eaglepatch.acceptance.check import readings

    r9 = readings([0, 2, 3], 4, [0, 2, 3], conventions.release_rule("0.5.9", unpatched=True),
                  conventions.release_rule("0.5.9"), "0.5.9")
    assert [x["slots"] for x in r9] == [[0, 2, 3], [1, 3, 4]], r9
    assert r9[0]["kinds"] == ["as_trained", "upstream_convention", "config"], r9[0]
    assert r9[1]["kinds"] == ["off_by_one_deeper", "upstream_convention"], r9[1]  # capture indices read k + 1
    r = readings([1, 3, 4], 4, None, conventions.release_rule("0.5.17", unpatched=True),
                 conventions.release_rule("0.5.17"), "0.5.17")
    kinds = {tuple(x["slots"]): x["kinds"] for x in r}
    assert kinds[(0, 2, 3)] == ["off_by_one_shallower", "upstream_convention"], kinds  # ids [0, 2, 3] read as they are
    assert kinds[(1, 3, "final")] == ["norm_swapped"], kinds
    assert (2, 4, 5) not in kinds and len(kinds) == 3, kinds  # HF 5 is no state of a 4-layer target


def test_figures_count_each_position():
    """Per-position rates from replayed verifies: position k counts a verify that accepted k-1 and
    had room for k; accept length sum(C-1)/sum(V)."""
    from eaglepatch.acceptance.check import figures

    metas = [{"completion_tokens": 9, "spec_verify_ct": 3, "accepted": [3, 1, 0], "room": [3, 3, 3]},
             {"completion_tokens": 3, "spec_verify_ct": 1, "accepted": [1], "room": [1]}]
    f = figures(metas, 3)
    assert f["accept_length"] == round((8 + 2) / 4, 4), f
    assert f["per_position"] == [round(3 / 4, 4), round(1 / 2, 4), 1.0], f
    assert f["at_least"] == [0.75, 0.25, 0.25], f


# ---- --serve: what can be checked without a GPU ----------------------------------------------------------

def test_serve_is_refused_without_a_gpu(toy, tmp_path):
    """--serve on a machine without CUDA: one line naming the reason (sglang's EAGLE-3 decoding runs
    CUDA and Triton kernels) and what to do instead, exit 2, nothing written (no report, PNG, served
    figures or server log), no server started."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --serve is not refused here")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(TOOL), "--target", str(TOY_TARGET), "--draft", toy["drafts"]["correct"],
                        "--data", toy["heldout"], "--states", toy["states"], "--release", "0.5.9", "--out", str(out),
                        "--serve"], capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --serve needs a CUDA GPU"), p.stderr
    assert "Triton" in lines[0] and "--states DIR" in lines[0] and "--served FILE" in lines[0], lines
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_serving_tree_is_the_release_asked_for(release_059):
    """The sglang --serve would start is checked before anything is loaded: its release must be
    --release, and it must carry the series unless --unpatched (and not carry it with
    --unpatched). Real trees: the unpacked 0.5.9 wheel and the patched 0.5.9 tree the CPU data server
    runs."""
    from eaglepatch.acceptance.serve_check import parse_server_args, serving_tree
    from eaglepatch.errors import UsageError
    from eaglepatch.serve.demo import cached_tree

    patched = cached_tree(say=lambda m: None)
    assert serving_tree("0.5.9", False, sglang_parent=patched)[0] == patched
    assert serving_tree("0.5.9", True, site=release_059)[0] == release_059
    for kw, says in ((dict(release="0.5.9", unpatched=False, sglang_parent=release_059), "is unpatched"),
                     (dict(release="0.5.9", unpatched=True, sglang_parent=patched), "is patched"),
                     (dict(release="0.5.17", unpatched=True, site=release_059), "is 0.5.9, not --release 0.5.17"),
                     (dict(release="0.5.9", unpatched=False, patched_files=release_059), "no --site")):
        with pytest.raises(UsageError) as e:
            serving_tree(**kw)
        assert says in e.value.line(), (kw, e.value.line())
    assert parse_server_args("--mem-fraction-static 0.5 --cuda-graph-bs-decode 1 2") == [
        "--mem-fraction-static", "0.5", "--cuda-graph-bs-decode", "1", "2"]
    for text, says in (("--port 1", "pass --port instead"), ("--speculative-num-steps=5", "pass --steps instead"),
                       ("--model-path x", "pass --target instead"), ("'--dtype", "quote it")):
        with pytest.raises(UsageError) as e:
            parse_server_args(text)
        assert says in e.value.line(), (text, e.value.line())


def test_served_requests_are_the_replayed_ones(toy):
    """--serve sends one request per held-out answer, the ones the prediction replays
    (``check.request_spans``). With --prompt-answer-tokens 1 they are exactly the toy's data: each
    prompt is the one the patched CPU server was given when it made the data (the copy language's
    first answer token, the symbol to copy from, is the user's), and each answer the target's
    greedy continuation; with 0 the answer starts at that symbol."""
    from eaglepatch.acceptance import train
    from eaglepatch.acceptance.serve_check import requests_of

    greedy = {tuple(g["prompt_ids"]): g["continuation"]
              for g in json.loads((Path(toy["heldout"]).parent / "greedy.json").read_text())}
    files = train.sample_files(Path(toy["heldout"]))
    reqs = requests_of(files, 1)
    assert len(reqs) == len(files) == TOY_SETTINGS["heldout_prompts"], len(reqs)
    assert all(greedy.get(tuple(r["prompt"])) == r["answer"] for r in reqs), reqs[0]
    assert all(r["max_new_tokens"] == len(r["answer"]) == TOY_SETTINGS["answer_len"] for r in reqs), reqs[0]
    whole = requests_of(files, 0)
    assert [r["prompt"] + r["answer"][:1] for r in whole] == [r["prompt"] for r in reqs], whole[0]
    assert [r["answer"][1:] for r in whole] == [r["answer"] for r in reqs]


def test_served_figures_from_meta_info():
    """The figures --serve writes from sglang's responses: accept length sum(C-1)/sum(V) over
    completion_tokens and spec_verify_ct; per position from the summed spec_correct_drafts_histogram
    (index a: verifies that accepted a draft tokens); the answers equal to the data's, with where each
    other one first differs. Responses without spec_verify_ct (no speculative decoding) or without a
    verify are refused. The responses are written here in sglang 0.5.17's meta_info fields: this
    tests the arithmetic, not a server."""
    from eaglepatch.acceptance.serve_check import served_figures
    from eaglepatch.errors import RefusedError

    reqs = [{"prompt": [1], "max_new_tokens": 9, "answer": list(range(9))},
            {"prompt": [2], "max_new_tokens": 5, "answer": list(range(5))}]
    outs = [{"output_ids": list(range(9)), "meta_info": {"completion_tokens": 9, "spec_verify_ct": 3,
                                                         "spec_correct_drafts_histogram": [0, 1, 0, 2]}},
            {"output_ids": [0, 1, 7, 3, 4], "meta_info": {"completion_tokens": 5, "spec_verify_ct": 2,
                                                          "spec_correct_drafts_histogram": [1, 0, 1]}}]
    f = served_figures(outs, reqs, 3, "test")
    assert f["accept_length"] == round((8 + 4) / 5, 4) and f["verify_ct"] == 5 and f["requests"] == 2, f
    # verifies accepting at least 0..3 drafts: 5, 4, 3, 2
    assert f["at_least"] == [0.8, 0.6, 0.4] and f["per_position"] == [0.8, 0.75, round(2 / 3, 4)], f
    assert f["answers_equal_to_data"] == 1 and f["requests_compared"] == 2, f
    assert f["first_difference_at"] == [{"request": 1, "sample": None, "at": 2}], f
    outs[1]["meta_info"].pop("spec_correct_drafts_histogram")
    g = served_figures(outs, reqs, 3, "test")
    assert g["per_position"] is None and "no spec_correct_drafts_histogram" in g["per_position_how"], g
    for meta, says in (({"completion_tokens": 5}, "did not decode speculatively"),
                       ({"completion_tokens": 5, "spec_verify_ct": 0}, None)):
        bad = [dict(o, meta_info=dict(meta)) for o in outs]
        with pytest.raises(RefusedError) as e:
            served_figures(bad, reqs, 3, "test")
        assert says is None or says in e.value.line(), e.value.line()
    assert "verified no draft token" in e.value.line()


def test_served_file_round_trip_and_lossless(toy, checked, tmp_path):
    """What --serve writes is what --served reads, and --lossless judges it. The correct draft with
    --prompt-answer-tokens 1 (replayed) predicts over exactly the requests --serve would send (the
    same count and tokens); a figures file written by ``served_figures`` from responses that accept
    what that prediction says, one answer changed, is then read back with --served --lossless: the
    accept length passes, the changed answer fails the check (exit 1, named), and with every answer
    equal it passes. The responses are made here from the data's answers: no server ran."""
    from eaglepatch.acceptance import train
    from eaglepatch.acceptance.serve_check import requests_of, served_figures, write_served

    p, r = _check(toy, tmp_path / "k1", "correct", "heldout", "--prompt-answer-tokens", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    reqs = requests_of(train.sample_files(Path(toy["heldout"])), 1)
    pred = r["predicted"]
    assert pred["requests"] == len(reqs) and pred["tokens_after_prefill"] == sum(
        q["max_new_tokens"] - 1 for q in reqs), (pred, len(reqs))
    assert r["inputs"]["prompt_answer_tokens"] == 1
    # a verify count per request that gives the predicted accept length over the whole set
    total_v = round(pred["tokens_after_prefill"] / pred["accept_length"])
    vs = [total_v // len(reqs) + (k < total_v % len(reqs)) for k in range(len(reqs))]
    for name, changed, code in (("one-changed", 1, 1), ("lossless", 0, 0)):
        outs = [{"output_ids": list(q["answer"]), "meta_info": {"completion_tokens": q["max_new_tokens"],
                                                                  "spec_verify_ct": v}} for q, v in zip(reqs, vs)]
        if changed:
            outs[3]["output_ids"][5] += 1
        f = write_served(served_figures(outs, reqs, 3, "made by the test from the data's answers"),
                         tmp_path / f"{name}.served.json")
        q, s = _check(toy, tmp_path / name, "correct", "heldout", "--prompt-answer-tokens", "1", "--served", str(f),
                      "--lossless")
        assert q.returncode == code, (name, q.stderr[-2000:])
        assert s["within_tolerance"] and s["observed"]["kind"] == "served", (s["observed"], pred)
        assert s["observed"]["answers_equal_to_data"] == len(reqs) - changed, s["observed"]
        last = q.stderr.strip().splitlines()[-1]
        if changed:
            assert last.startswith("failed: lossless: 1 of 32 served answers differ") and "[5]" in last, last
        else:
            assert last.startswith("passed: served") and "32 of 32 served answers equal" in last, last


def test_gpu_proof_builds_the_postnorm_data_as_the_cpu_toy(toy, tmp_path):
    """benchmarks/check_draft_gpu.py builds its post-norm draft's data with ``check.with_final_last``;
    on the toy's [0, 2, 4] held-out extraction it gives, file by file and tensor by tensor, the
    post-norm held-out data this module's build made with ``_with_final_last``: the GPU proof's case
    (c) is this test's case (c)."""
    import torch

    from eaglepatch.acceptance.check import with_final_last

    src = Path(toy["heldout"]).parent / "ds-heldout@last"
    with_final_last(src, tmp_path / "post")
    want = Path(toy["heldout_postnorm"])
    names = sorted(p.relative_to(want) for p in want.rglob("*.ckpt"))
    assert names and names == sorted(p.relative_to(tmp_path / "post") for p in (tmp_path / "post").rglob("*.ckpt"))
    for n in names:
        a = torch.load(tmp_path / "post" / n, weights_only=True)
        b = torch.load(want / n, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), n
    d = torch.load(tmp_path / "post" / names[0], weights_only=True)
    H = d["hidden_state"].shape[-1]
    assert torch.equal(d["aux_hidden_state"][..., -H:], d["hidden_state"])  # the last slot is the final state


# ---- issue 43: the release judged for, a single-file target, hostile inputs (the demo model) --------------
#
# These run the command line on small inputs made in seconds: the target is the project's own demo model
# (the CPU demo's tiny DeepSeek-V3, the smoke tests' cached checkpoint: one model.safetensors, no index),
# the held-out samples its own forward's states (transformers) in the layout tools/extract.py writes, the
# manifest recording sglang 0.5.9, and a draft SpecForge's classes trained on them for a few steps
# (``acceptance.train.DraftRun``), with its config ids shifted to [0, 2, 3] for the off-by-one case.

def _demo_inputs(work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from safetensors import safe_open

    from eaglepatch import cpuenv
    from eaglepatch.acceptance import train
    from eaglepatch.smoke import ensure_checkpoints

    target = ensure_checkpoints(cpuenv.ensure_env(), work)["deepseek_v3"]
    assert not (target / "model.safetensors.index.json").exists() and (target / "model.safetensors").is_file()
    cfg = json.loads((target / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    data = work / "heldout"
    (data / "samples" / "00").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for k in range(4):
        ids = torch.randint(0, cfg["vocab_size"], (24,), generator=g)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states  # HF 0..N, the last post-norm
        mask = torch.zeros(24, dtype=torch.int64)
        mask[8:] = 1  # an 8-token prompt, a 16-token answer
        torch.save({"input_ids": ids, "loss_mask": mask, "hidden_state": hs[-1].clone(),
                    "aux_hidden_state": torch.cat([hs[0], hs[2], hs[3]], -1).clone()},
                   data / "samples" / "00" / f"s{k}.ckpt")
    (data / "manifest.json").write_text(json.dumps({
        "format": "eaglepatch-hidden-states/2", "eagle3_layer_ids": [-1, 1, 2], "hf_hidden_state_indices": [0, 2, 3],
        "model": {"num_hidden_layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"]},
        "dataset_format": "specforge", "sglang_release": "0.5.9", "final": "post_norm"}))
    # the same checkpoint sharded as SpecForge's TargetHead wants it: the file beside the index its names make
    sharded = work / "sharded"
    sharded.mkdir()
    for f in target.iterdir():
        shutil.copy(f, sharded / f.name)
    with safe_open(str(sharded / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}))
    d = train.DraftRun(sharded, train.draft_config(cfg, [-1, 1, 2], "float32"), 3, "cpu", seed=0)
    d.train(train.sample_files(data), 100, 4, 1e-2, None, 0, lambda m: None, max_steps=25)
    d.export(work / "drafts" / "trained", "float32")
    shifted = work / "drafts" / "shifted"
    shifted.mkdir()
    c = json.loads((work / "drafts" / "trained" / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (shifted / "config.json").write_text(json.dumps(c, indent=2))
    shutil.copy(work / "drafts" / "trained" / "model.safetensors", shifted / "model.safetensors")
    return {"target": target, "sharded": sharded, "data": data, "trained": work / "drafts" / "trained",
            "shifted": shifted}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return _demo_inputs(tmp_path_factory.mktemp("demo-inputs"))


def _run(where: Path, target, draft, data, *extra):
    """tools/check_draft.py, its report at ``where``/report.json; (process, report or None)."""
    where.mkdir(parents=True, exist_ok=True)
    out = where / "report.json"
    p = subprocess.run([sys.executable, str(TOOL), "--target", str(target), "--draft", str(draft), "--data", str(data),
                        "--out", str(out), *map(str, extra)], capture_output=True, text=True, timeout=600)
    return p, (json.loads(out.read_text()) if out.is_file() else None)


def _served(path: Path, accept_length: float) -> Path:
    path.write_text(json.dumps({"accept_length": accept_length, "how": "the prediction, written by the test"}))
    return path


def test_a_single_file_target_is_read(demo, tmp_path):
    """Issue 43 item 15: the demo model (one model.safetensors, no index) is a target check_draft
    takes (was: refused, "no model.safetensors.index.json"). Its LM head is read: the trained draft
    predicts above 1, and exactly what it predicts when the same checkpoint is given with an index
    (made by the fixture from the file's own tensor names) beside it."""
    p, r = _run(tmp_path / "single", demo["target"], demo["trained"], demo["data"],
                "--served", _served(tmp_path / "s.json", 1.0))
    assert r is not None, p.stderr[-2000:]
    assert r["predicted"]["accept_length"] > 1.2, r["predicted"]
    sharded = demo["sharded"]
    q, s = _run(tmp_path / "indexed", sharded, demo["trained"], demo["data"],
                "--served", _served(tmp_path / "s2.json", r["predicted"]["accept_length"]))
    assert q.returncode == 0, q.stderr[-2000:]
    assert s["predicted"] == r["predicted"], (s["predicted"], r["predicted"])
    assert sorted(x.name for x in demo["target"].iterdir()) == sorted(x.name for x in sharded.iterdir()
                                                                      if not x.name.endswith(".index.json"))


def test_the_release_is_the_datas_unless_given(demo, tmp_path):
    """Issue 43 item 3: without --release the draft is judged for the release that dumped the data (its
    manifest: 0.5.9), as tools/guard.py judges it, and the output and the report say so. The draft
    whose ids are shifted to [0, 2, 3] is read one layer deeper by 0.5.9: exit 1 (was: judged for
    0.5.17, which reads [0, 2, 3] as capture indices, and it passed). --release 0.5.17 wins over the
    manifest, and the first line says both; a manifest release no series reads is refused."""
    p, r = _run(tmp_path / "own", demo["sharded"], demo["trained"], demo["data"],
                "--served", _served(tmp_path / "x.json", 1.0))
    served = _served(tmp_path / "served.json", r["predicted"]["accept_length"])  # observed = predicted
    p, r = _run(tmp_path / "default", demo["sharded"], demo["shifted"], demo["data"], "--served", served)
    first = "release: sglang 0.5.9 with the series (the release that dumped the dataset, as its manifest records)"
    assert p.returncode == 1 and p.stdout.splitlines()[0] == first, (p.stdout, p.stderr[-2000:])
    assert r["release"]["release"] == "0.5.9" and not r["guard"]["ok"] and r["guard"]["served_hf"] == [1, 3, 4], r
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("failed: guard: the draft's config does not read the data's layers on sglang 0.5.9 with "
                           "the series"), last
    p, r = _run(tmp_path / "given", demo["sharded"], demo["shifted"], demo["data"], "--served", served,
                "--release", "0.5.17")
    assert p.returncode == 0 and r["release"]["release"] == "0.5.17", p.stderr[-2000:]
    assert p.stdout.splitlines()[0].startswith("release: sglang 0.5.17 with the series (--release, not the release "
                                               "that dumped the dataset (sglang 0.5.9)"), p.stdout
    bad = tmp_path / "bad-release"
    shutil.copytree(demo["data"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(dict(m, sglang_release="../../etc")))
    p, r = _run(tmp_path / "bad", demo["sharded"], demo["shifted"], bad, "--served", served)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "'../../etc', which is no release number" in lines[0], p.stderr
    assert r is None and list((tmp_path / "bad").iterdir()) == []


def _damage(case: str, draft: Path, data: Path) -> tuple[str, Path]:
    """Damage a copy of the inputs as ``case`` says; (what the one line must name, the file)."""
    import torch

    w = draft / "model.safetensors"
    s = data / "samples" / "00" / "s1.ckpt"
    if case == "empty weights":
        w.write_bytes(b"")
        return "shorter than a safetensors header", w
    if case == "truncated weights":
        w.write_bytes(w.read_bytes()[:5000])
        return "its tensors end past the end of the file", w
    if case == "weights a directory":
        w.unlink()
        w.mkdir()
        return "is not a file", w
    if case == "garbage sample":
        s.write_bytes(bytes(range(256)) * 2)
        return "is not a readable torch.save file", s
    if case == "wrong-width sample":
        d = torch.load(s, weights_only=True)
        d["aux_hidden_state"] = d["aux_hidden_state"][..., :512].clone()
        torch.save(d, s)
        return "aux_hidden_state is [1, 24, 512], not [1, 24, 768]", s
    if case == "deep JSON":
        (draft / "config.json").write_text("[" * 100000 + "]" * 100000)
        return "is not readable JSON (RecursionError)", draft / "config.json"
    if case == "hidden_size a string":
        c = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps(dict(c, hidden_size=str(c["hidden_size"]))))
        return "has hidden_size '256', not a positive integer", draft / "config.json"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["empty weights", "truncated weights", "weights a directory", "garbage sample",
                                  "wrong-width sample", "deep JSON", "hidden_size a string"])
def test_hostile_inputs_are_one_line(demo, tmp_path, case):
    """Issue 43 item 17: inputs that are not what they claim are one line naming the file and what is
    wrong, exit 2, nothing written (were: "internal error", "No such device" without a path, and
    "hidden_size 256 is not the target's 256" for the string "256")."""
    draft, data = tmp_path / "draft", tmp_path / "data"
    shutil.copytree(demo["trained"], draft)
    shutil.copytree(demo["data"], data)
    says, path = _damage(case, draft, data)
    p, r = _run(tmp_path / "out", demo["sharded"], draft, data, "--served", _served(tmp_path / "s.json", 1.0))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], p.stderr
    assert says in lines[0] and str(path) in lines[0] and "internal error" not in lines[0], lines[0]
    assert r is None and list((tmp_path / "out").iterdir()) == []
