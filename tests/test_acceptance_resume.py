"""tools/acceptance.py's target training across calls (issue 32, item 2: "the demo holds for any
seed"): the target trains until its gates pass; a call whose budget ends first saves the training
state under --work and exits 3 (incomplete) with one line naming the progress and the command to
continue; the same command resumes at the saved step with the saved weights, optimizer and RNG; a
state of another run is refused; once the gates pass the target is saved and the later phases run.

Real training at the CPU scale, made small: batch 2, a call's training capped at 0.3 s
(--target-budget-s), so each call trains a handful of steps (0.03-0.25 s a step here: at least
one, the budget is checked before each). The scale's 8 gate prompts: with them every one of the
first 40 steps fails a gate (measured; with 2 prompts a target of 59 steps passed them all). The
later phases are stubbed where a test only needs to see that they run."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "acceptance.py"
# a small CPU target run: batch 2; one call trains 0.3 s (--target-budget-s)
SETS = dict(target_batch=2)
CAP_S = 0.3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(work: Path, *extra, timeout=300):
    sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
    return subprocess.run([sys.executable, str(TOOL), "--cpu", "--work", str(work), "--budget-s", "0",
                           "--target-budget-s", str(CAP_S), "--port", str(_free_port()), *sets, *map(str, extra)],
                          capture_output=True, text=True, timeout=timeout)


def _options(work: Path, said: list, **kw):
    from eaglepatch.acceptance import pipeline

    over = dict(dict(SETS, target_budget_s=CAP_S), **kw.pop("overrides", {}))
    return pipeline.Options(work=work, scale="cpu", budget_s=kw.pop("budget_s", 0), seed=kw.pop("seed", 0),
                            overrides=over, port=_free_port(), say=said.append, **kw)


def _state(work: Path) -> dict:
    from eaglepatch.acceptance import pipeline, train

    return train.TargetTraining.read(work / pipeline.STATE_NAME)


@pytest.fixture(scope="module")
def first_call(tmp_path_factory):
    """One call of the tool whose training budget (0.3 s) ends long before the gates pass."""
    work = tmp_path_factory.mktemp("resume") / "w"
    p = _tool(work)
    return work, p


def test_budget_end_saves_the_state_and_exits_incomplete(first_call):
    """Exit 3 (not 0, 1 or 2), one line on stderr: `incomplete:` with the steps, the token
    accuracy, each failing gate and how far it is, where the state is and its size, and the
    exact command to continue (the same arguments, the same --work). The state is on disk, whole
    (no temporary file left), at the step the line names; the result JSON says the same."""
    from eaglepatch.acceptance import pipeline

    work, p = first_call
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    line = lines[-1]
    m = re.match(r"incomplete: the target trained (\d+) steps in 1 call \(token accuracy ([\d.]+) on its last batch\) and fails (.+); "
                 r"its training state \(([\d.]+) MiB\) is saved in (\S+), and the call's budget ended; run again "
                 r"with the same --work to continue: python3 (\S+) (.+)$", line)
    assert m, line
    steps, state = int(m.group(1)), Path(m.group(5))
    assert steps >= 1 and state == work.absolute() / pipeline.STATE_NAME and state.is_file(), line
    assert re.search(r"\(need (>=|<=) [\d.]+: [\d.e-]+ (short|over)\)", m.group(3)), m.group(3)
    assert Path(m.group(6)).resolve() == TOOL and f"--work {work}" in m.group(7) and "--set target_batch=2" in m.group(7)
    assert sorted(x.name for x in work.iterdir() if x.name.startswith(".")) == []  # no temporary state left
    s = _state(work)
    assert s["step"] == steps and s["meta"]["seed"] == 0 and s["history"][0]["step"] == 1, s["step"]
    assert s["last"]["step"] == steps and f"{s['last']['acc']:.3f}" == m.group(2), (s["last"], line)
    r = json.loads((work / "result.json").read_text())
    assert r["incomplete"] == line and r["target"]["state"]["step"] == steps, r.get("incomplete")
    assert r["phases"]["target"]["incomplete"] and set(r["phases"]) == {"target"}, r["phases"]
    assert r["target"]["state"]["bytes"] == state.stat().st_size and not r["verdicts"]["target_gates"]["passed"]
    assert not (work / "target" / "acceptance-target.json").exists()  # nothing saved as the target


def test_second_call_resumes_at_the_saved_step(first_call, monkeypatch):
    """The same settings and --work again: the weights the training starts from are the saved ones
    (not the seed's initial ones), the steps go on from the saved step, the history is the saved
    one with this call's appended, and the call ends incomplete again (its 0.3 s are not enough
    either), its state now further on."""
    import torch

    from eaglepatch.acceptance import pipeline, train

    work, p = first_call
    assert p.returncode == 3, p.stderr[-2000:]
    saved = _state(work)
    loaded = {}
    real_run = train.TargetTraining.run

    def spy_run(self, *a, **k):  # the weights and step the training starts from
        loaded["weights"] = {n: v.detach().clone() for n, v in self.model.state_dict().items()}
        loaded["step"] = self.step
        return real_run(self, *a, **k)

    monkeypatch.setattr(train.TargetTraining, "run", spy_run)
    said = []
    run = pipeline.Run(_options(work, said))
    with pytest.raises(pipeline.Incomplete) as e:
        run.do_target()
    assert loaded["step"] == saved["step"], (loaded["step"], saved["step"])
    w = loaded["weights"]
    assert set(w) == set(saved["model"]) and all(torch.equal(w[n], saved["model"][n]) for n in w)
    init = train.build_target(pipeline.target_config("cpu"), "cpu", 0, work.parent / "init")
    assert any(not torch.equal(v, w[n]) for n, v in init.state_dict().items()), "the saved weights are the initial ones"
    assert any(m.startswith("[acceptance] target: resumed at step %d" % saved["step"]) for m in said), said
    now = _state(work)
    h = run.res["target"]["training"]
    assert now["step"] > saved["step"] and h["steps"] == now["step"], (now["step"], saved["step"])
    assert now["history"][:len(saved["history"])] == saved["history"] and len(now["history"]) >= len(saved["history"])
    assert [c["from_step"] for c in h["calls"]] == [0, saved["step"]] and h["calls"][1]["to_step"] == now["step"]
    assert run.res["target"]["resumed_at_step"] == saved["step"]
    assert "in 2 calls" in e.value.line() and e.value.exit_code == 3, e.value.line()


def test_resumed_training_equals_an_uninterrupted_one(tmp_path):
    """Saved after 3 steps and resumed to 6, the target is bit for bit the one trained 6 steps in
    one go (same batches: the RNG; same updates: AdamW's moments and step; same learning-rate
    warm-up: the step), and its history the same. A resume that forgot any of them differs."""
    import torch

    from eaglepatch.acceptance import language, pipeline, train

    p, cfg = pipeline.SCALES["cpu"], pipeline.target_config("cpu")
    lg = language.Language(p["language"], cfg["vocab_size"], p["symbols"], p["answer_len"], 0)

    def fresh():
        m = train.build_target(cfg, "cpu", 0, tmp_path / "init")
        return train.TargetTraining(m, lg, 2, p["target_lr"], 0, "cpu")

    quiet = lambda m: None  # noqa: E731
    a = fresh()
    a.run(3, None, quiet)
    a.save(tmp_path / "s.pt", {"seed": 0})
    b = fresh()
    b.load(train.TargetTraining.read(tmp_path / "s.pt"))
    assert b.step == 3
    hb = b.run(6, None, quiet)
    c = fresh()
    hc = c.run(6, None, quiet)
    sb, sc = b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sb[n], sc[n]) for n in sc), [n for n in sc if not torch.equal(sb[n], sc[n])][:3]
    assert hb["history"] == hc["history"] and hb["steps"] == 6


def test_state_of_another_run_is_refused(first_call):
    """Another seed's state (the tool, one line, exit 2, before anything is built; the state is
    kept); another setting bound to the state (the learning rate) likewise."""
    from eaglepatch.acceptance import pipeline
    from eaglepatch.errors import UsageError

    work, p = first_call
    assert p.returncode == 3, p.stderr[-2000:]
    stamp = lambda: [(work / f).stat().st_mtime_ns for f in (pipeline.STATE_NAME, "target-init/model.safetensors")]  # noqa: E731
    before = stamp()
    q = _tool(work, "--seed", "7")
    lines = q.stderr.strip().splitlines()  # the phase's start, then the refusal
    assert q.returncode == 2 and lines[-1].startswith("error: ") and "Traceback" not in q.stderr, q.stderr[-2000:]
    assert lines[-1].startswith(f"error: the target training state {work.absolute() / pipeline.STATE_NAME} is of "
                               "another run (seed 0, not 7); pass another --work, or delete"), lines[-1]
    assert stamp() == before  # the state kept, no target built
    run = pipeline.Run(_options(work, [], overrides={"target_lr": 0.01}))
    with pytest.raises(UsageError, match=r"is of another run \(target_lr 0.003, not 0.01\)"):
        run.do_target()


def test_gates_passed_save_the_target_and_the_run_goes_on(first_call, monkeypatch):
    """Once the gates pass (here gates every target passes, measured as soon as the proxy holds:
    target_done_acc 0) the training stops ('gates'), the target is saved with its training and
    gates, the state is removed. With too little budget left for the later phases the call ends
    incomplete and names the saved target; the next call reuses it (no training) and runs the
    later phases (stubbed here) to the verdict."""
    from eaglepatch.acceptance import pipeline, train, verdicts

    work, p = first_call
    assert p.returncode == 3, p.stderr[-2000:]
    step0 = _state(work)["step"]
    monkeypatch.setattr(pipeline, "GATES", {"loop_rate": ("<=", 1.0)})
    said = []
    run = pipeline.Run(_options(work, said, budget_s=3600, overrides={"target_done_acc": 0.0, "target_budget_s": None,
                                                                      "later_phases_s": 10 ** 6}))
    with pytest.raises(pipeline.Incomplete, match="the target passed its gates and is saved in"):
        run.do_target()
    h = run.res["target"]["training"]
    assert h["stopped_by"] == "gates" and h["steps"] > step0 and h["gate_checks"][-1]["passed"], h["stopped_by"]
    meta = json.loads((work / "target" / "acceptance-target.json").read_text())
    assert meta["training"]["steps"] == h["steps"] and meta["fingerprint"]["seed"] == 0 and meta["gates"]
    assert not (work / pipeline.STATE_NAME).exists()

    trained = []
    monkeypatch.setattr(train.TargetTraining, "run", lambda *a, **k: trained.append(1))

    def stub(name, verdict):
        def phase(self):
            self.res["verdicts"][name] = verdict
        return phase

    monkeypatch.setattr(pipeline.Run, "do_data", lambda self: None)
    monkeypatch.setattr(pipeline.Run, "do_drafts", stub("drafts", {"measured": True, "same_steps": True}))
    monkeypatch.setattr(pipeline.Run, "do_guard", stub("guard", {"passed": True, "wrong": []}))
    monkeypatch.setattr(pipeline.Run, "do_replay", stub("replay", {"passed": True, "verdict": "replayed: stub"}))
    res = pipeline.Run(_options(work, said)).run()
    assert not trained and res["verdicts"]["target_gates"]["passed"], res["verdicts"]
    assert set(res["phases"]) == {"target", "data", "drafts", "guard", "replay"}, res["phases"]
    assert verdicts.outcome(res) == (0, "passed: replayed: stub")


def test_data_another_target_made_is_refused_not_reused(tmp_path):
    """WORK/data records the target that made it: a later call whose target differs (the target
    retrained after WORK/target was removed, say) is refused in one line instead of training drafts
    on another target's states; the same target's data is reused, and so are data made before the
    target was recorded (unknown, as before)."""
    from eaglepatch.acceptance import pipeline
    from eaglepatch.errors import UsageError

    work = tmp_path / "w"
    run = pipeline.Run(_options(work, []))
    run.res["target"] = {"sha256": "a" * 64}
    d = work / run.data_name()
    d.mkdir(parents=True)
    for made_by, refused in (("b" * 64, True), ("a" * 64, False), (None, False)):
        (d / "done.json").write_text(json.dumps({"dir": str(d), "storage": {"k": 1}, "target_sha256": made_by}))
        run.data = None
        if refused:
            with pytest.raises(UsageError, match="holds data another target made .*bbbbbbbbbbbb.*aaaaaaaaaaaa"):
                run.do_data()
            assert run.data is None
        else:
            run.do_data()
            assert run.data["dir"] == str(d) and run.res["storage"] == {"k": 1}
    # a caller that runs the data phase alone (the check-draft toy's build) has the target's files only
    alone = pipeline.Run(_options(work, []))
    alone.target = REPO / "tests" / "data" / "acceptance-toy-target"
    from eaglepatch.acceptance.storage_check import target_sha256

    assert alone.target_sha() == target_sha256(alone.target) == alone.res["target"]["sha256"]


def test_work_carried_elsewhere_resumes(tmp_path):
    """Item 2's "state under --work that can be carried": --work copied to another place (as to a
    fresh machine) and the same command with the new --work goes on at the saved step, in its
    second call; nothing in the state ties it to the directory it was written in. (Its own first
    call: the module's is changed by the tests before it.)"""
    import shutil

    work = tmp_path / "here" / "w"
    p = _tool(work)
    assert p.returncode == 3, p.stderr[-2000:]
    carried = tmp_path / "elsewhere" / "w"
    shutil.copytree(work, carried)
    saved = _state(carried)
    q = _tool(carried)
    assert q.returncode == 3 and "Traceback" not in q.stderr, q.stderr[-3000:]
    assert "[acceptance] target: resumed at step %d from %s" % (saved["step"], carried.absolute()) in q.stderr, q.stderr[-3000:]
    line = q.stderr.strip().splitlines()[-1]
    assert " in %d calls " % (len(saved["calls"]) + 1) in line and f"--work {carried}" in line, line
    assert _state(carried)["step"] > saved["step"]
