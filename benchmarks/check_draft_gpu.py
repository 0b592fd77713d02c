#!/usr/bin/env python3
"""Issue 32, item 3, on one GPU in one call: tools/check_draft.py --serve on the acceptance run's toy
target for (a) the correct draft, (b) the same weights with the ids in its config shifted by one,
(c) a draft whose last slot was trained on the post-norm final state where its config names the last
layer, whose output the series feeds before the final norm.

  sh .gpu-bundle/unpack.sh /tmp/site && PYTHONPATH=/tmp/site:src timeout -s INT -k 20 525 \
      python3 benchmarks/check_draft_gpu.py --site /tmp/site --patched-files .gpu-patched --out $OUT

From nothing. The acceptance tool's own phases (eaglepatch.acceptance.pipeline, GPU scale, as
tools/acceptance.py runs them) train the target (4-layer DeepSeek-V3 on the copy language, until its
gates pass) and make the data: greedy conversations from the patched server with every layer dumped,
tools/extract.py datasets for HF [0, 2, 3] (train and held out) and [0, 2, 4] (held out), the held-out
conversations' dump files kept. The drafts are built as tests/test_check_draft.py builds the CPU toy's
(the ids from guard's table for 0.5.17 with the series, as the acceptance run's controls): `correct`
trained on HF [0, 2, 3] (ids [-1, 1, 2], fc_norm); `shifted` the same weights, its config's ids those
0.5.17 reads one layer deeper ([3, 4, 1]: HF [1, 3, 4], the acceptance run's off_by_one control; on
0.5.17 ids [0, 2, 3] would be read as capture indices, HF [0, 2, 3]); `postnorm` trained on
[0, 2, final] (the train set's last slot replaced by the post-norm final state,
`check.with_final_last`) without fc_norm, its config's ids naming HF [0, 2, 4] ([0, 2, 4]: HF 4 is
the last layer's output before the final norm), its held-out data the [0, 2, 4] extraction with the
same replacement. Then the three checks side by side, each its own
tools/check_draft.py --serve process and server (the acceptance servers' flags), with --states (the
kept dumps), --lossless (the held-out answers are the target's greedy output on this server) and
--prompt-answer-tokens 1 (each copy answer starts with the symbol the user gave: the data server was
prompted with it).

Writes under --out: summary.json, proof.log, pipeline.json (the acceptance phases' result),
check-<case>/ (report.json, report.png, report.served.json, report.server.log, check.log), logs/
(the data and warm-up servers' logs, their last 200 KB). Stops itself within --budget-s (the checks
are sent SIGTERM, which stops their servers), saving what it has; prints a short summary at the end.

Exit: 0 every case ended as expected ((a) exit 0; (b) exit 1, diagnosis off_by_one_deeper; (c) exit
1, diagnosis norm_swapped), 1 one did not or the budget ended first, 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.errors import EaglepatchError, RefusedError, UsageError, run_main  # noqa: E402

RELEASE = "0.5.17"
# case -> (exit code, diagnosis cause) check_draft must give
CASES = {"correct": (0, "none"), "shifted": (1, "off_by_one_deeper"), "postnorm": (1, "norm_swapped")}
# what the three checks need, side by side (estimate: servers ready 50-60 s after the warm-up
# servers compiled their kernels, as the acceptance run's four were; a few s of requests; the
# replays), kept back from the drafts' training
CHECK_RESERVE_S = 110
LOG_TAIL = 200_000


def tail_copy(src: Path, dest: Path, limit: int = LOG_TAIL) -> None:
    try:
        data = src.read_bytes()
    except OSError:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data[-limit:])


class Proof:
    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.out = Path(a.out)
        self.work = Path(a.work).absolute()
        self.logf = open(self.out / "proof.log", "a")
        self.res = {"what": "issue 32 item 3: tools/check_draft.py --serve on the acceptance toy target, sglang "
                            f"{RELEASE} with the series, one GPU", "budget_s": a.budget_s, "seed": a.seed,
                    "phases": {}, "drafts": {}, "cases": {}}
        self.run = None
        self.procs = {}
        self.device = "cuda"

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.a.budget_s - self.elapsed()

    def say(self, m: str) -> None:
        line = "[%5.0f s] %s" % (self.elapsed(), m)
        print(line, file=sys.stderr, flush=True)
        self.logf.write(line + "\n")
        self.logf.flush()

    def save(self) -> None:
        from eaglepatch.outputs import write_atomic

        self.res["wall_s"] = round(self.elapsed(), 1)
        write_atomic(self.out / "summary.json", json.dumps(self.res, indent=2) + "\n", "--out's summary.json")

    def timed(self, name, fn):
        t = time.monotonic()
        self.say(f"{name} ...")
        fn()
        self.res["phases"][name] = {"wall_s": round(time.monotonic() - t, 1)}
        self.say(f"{name} done ({time.monotonic() - t:.0f} s)")
        self.save()

    # ---- target and data: the acceptance run's phases ---------------------------------------------
    def acceptance_phases(self) -> bool:
        from eaglepatch.acceptance import pipeline
        from eaglepatch.gpucheck.patched_files import lay_patched_files

        a = self.a
        self.parent = lay_patched_files(a.patched_files, a.site, self.work / "patched").resolve()

        class ProofRun(pipeline.Run):
            def datasets_needed(self):  # as tests/test_check_draft.py's build: the data of (a)-(c)
                hf = self.readings()["correct"][1]
                return [("train@correct", hf), ("heldout@correct", hf),
                        ("heldout@last", hf[:-1] + [self.cfg["num_hidden_layers"]])]

        o = pipeline.Options(work=self.work, scale="gpu", out=self.out / "pipeline.json", release=RELEASE,
                             sglang_parent=self.parent, unpatched_parent=Path(a.site), site=Path(a.site),
                             budget_s=max(self.left(), 1), seed=a.seed, overrides={}, port=a.port, say=self.say)
        pipeline.check_options(o)
        self.run = run = ProofRun(o)
        run.servers = {}
        for name, fn in (("target", run.do_target), ("data", run.do_data)):
            started = run.phase(name, fn)
            self.res["phases"][name] = run.res["phases"].get(name)
            self.save()
            if not started:
                self.res["stopped"] = f"the budget left no time for the {name} phase"
                return False
        self.res["target"] = {k: run.res["target"].get(k) for k in ("gates", "sha256")}
        return True

    # ---- the drafts, as tests/test_check_draft.py builds the CPU toy's --------------------------------
    def drafts(self) -> None:
        import shutil

        from eaglepatch import guard
        from eaglepatch.acceptance import pipeline, train
        from eaglepatch.acceptance.check import with_final_last

        run, a = self.run, self.a
        r = run.readings()
        n = run.cfg["num_hidden_layers"]
        hf = r["correct"][1]
        last_ids = guard.release_semantics(RELEASE).ids_for(hf[:-1] + [n])
        data = Path(run.data["dir"])
        for src, dest in (("ds-train@correct", "ds-train@postnorm"), ("ds-heldout@last", "ds-heldout@postnorm")):
            if not (data / dest).exists():
                with_final_last(data / src, data / dest)
        p = run.p
        drafts = self.work / "drafts"
        plan = (("correct", data / "ds-train@correct", r["correct"][0], p["draft_fc_norm"], a.correct_steps,
                 a.correct_s),
                # without fc_norm: with it (each slot RMS-normed before fc) a post-norm draft on the CPU
                # toy accepted the same on either state (tests/test_check_draft.py's build says why)
                ("postnorm", data / "ds-train@postnorm", last_ids, False, a.postnorm_steps, a.postnorm_s))
        for k, (name, files, ids, fc_norm, steps, most_s) in enumerate(plan):
            later = sum(x[5] for x in plan[k + 1:])
            budget = max(min(most_s, self.left() - CHECK_RESERVE_S - later), 5)
            cfg = train.draft_config(run.cfg, ids, p["dtype"], fc_norm)
            d = train.DraftRun(run.target, cfg, pipeline.NUM_STEPS, self.device, seed=a.seed)
            hist = d.train(train.sample_files(files), p["draft_epochs"], p["draft_batch"], p["draft_lr"], budget,
                           a.seed, self.say, max_steps=steps)
            d.export(drafts / name, p["dtype"])
            self.res["drafts"][name] = {"ids": ids, "fc_norm": fc_norm, "trained_on": files.name,
                                        "steps": hist["steps"], "stopped_by": hist["stopped_by"],
                                        "wall_s": hist["wall_s"], "last": hist["history"][-1:]}
            del d
            self.save()
        if self.device == "cuda":  # what the drafts' training cached goes back before the servers start
            import torch

            torch.cuda.empty_cache()
        # the same weights, the ids in its config shifted: the release reads them one layer deeper
        shifted = drafts / "shifted"
        shifted.mkdir(parents=True, exist_ok=True)
        cfg = json.loads((drafts / "correct" / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = r["off_by_one"][0]
        (shifted / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copyfile(drafts / "correct" / "model.safetensors", shifted / "model.safetensors")
        self.res["drafts"]["shifted"] = {"ids": r["off_by_one"][0], "weights": "correct's"}
        self.inputs = {"correct": (drafts / "correct", data / "ds-heldout@correct"),
                       "shifted": (shifted, data / "ds-heldout@correct"),
                       "postnorm": (drafts / "postnorm", data / "ds-heldout@postnorm")}
        self.kept = data / "kept-dumps"

    # ---- the checks, side by side -------------------------------------------------------------------
    def server_args(self) -> str:
        """The acceptance run's draft-server flags, less those check_draft sets itself."""
        import shlex

        argv = self.run.server_argv(0, None, self.parent)[3:]  # past python -m sglang.launch_server
        out, skip = [], False
        for x in argv:
            if skip:
                skip = False
            elif x in ("--model-path", "--host", "--port"):
                skip = True
            else:
                out.append(x)
        return " ".join(shlex.quote(x) for x in out)

    def checks(self) -> None:
        srv = self.run.servers.pop("warm-spec", None)  # its kernels are compiled by now, or soon
        if srv is not None:
            try:
                srv.wait_ready(timeout=max(min(60.0, self.left() - CHECK_RESERVE_S), 5))
                self.res["warm_spec_ready_after_s"] = srv.start_s
            except RefusedError as exc:
                self.res["warm_spec_error"] = exc.line()[:300]
            finally:
                srv.stop()
        env = dict(os.environ)
        for k, (case, (draft, held)) in enumerate(self.inputs.items()):
            where = self.out / f"check-{case}"
            where.mkdir(parents=True, exist_ok=True)
            cmd = self.check_cmd(k, draft, held, where / "report.json")
            self.res["cases"][case] = {"cmd": " ".join(cmd[1:])}
            self.procs[case] = subprocess.Popen(cmd, stdout=open(where / "check.log", "w"), stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            self.say(f"check {case}: started (pid {self.procs[case].pid})")
        self.save()
        while any(p.poll() is None for p in self.procs.values()) and self.left() > 8:
            time.sleep(1)
        self.stop_checks()
        for case, p in self.procs.items():
            self.res["cases"][case].update(self.case_result(case, p.returncode))
        self.save()

    def check_cmd(self, k: int, draft: Path, held: Path, report: Path) -> list:
        """tools/check_draft.py --serve as a user runs it, the acceptance servers' flags passed on."""
        return [sys.executable, str(REPO / "tools" / "check_draft.py"), "--target", str(self.run.target),
                "--draft", str(draft), "--data", str(held), "--states", str(self.kept), "--release", RELEASE,
                "--out", str(report), "--serve", "--site", str(self.a.site), "--sglang-parent", str(self.parent),
                "--port", str(self.a.port + 5 + k), "--server-args", self.server_args(),
                "--serve-timeout-s", "%.0f" % max(self.left() - 45, 10), "--lossless", "--prompt-answer-tokens", "1"]

    def stop_checks(self) -> None:
        """SIGTERM to each check still running (its handler stops its server), SIGKILL 10 s later."""
        live = {c: p for c, p in self.procs.items() if p.poll() is None}
        for c, p in live.items():
            self.say(f"check {c}: still running at the budget's end, sent SIGTERM")
            self.res["cases"].setdefault(c, {})["stopped"] = "budget"
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for c, p in live.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()

    def case_result(self, case: str, rc) -> dict:
        want_rc, want_cause = CASES[case]
        where = self.out / f"check-{case}"
        try:
            last = (where / "check.log").read_text(errors="replace").strip().splitlines()[-1]
        except (OSError, IndexError):
            last = ""
        out = {"exit": rc, "want_exit": want_rc, "want_cause": want_cause, "last_line": last[:2000]}
        try:
            r = json.loads((where / "report.json").read_text())
        except (OSError, ValueError):
            out.update(ok=False, why="no report (read check.log)")
            return out
        ob, pr = r["observed"], r["predicted"]
        out.update(guard_ok=r["guard"]["ok"], predicted=pr["accept_length"], observed_kind=ob["kind"],
                   observed=ob["accept_length"], gap=r["observed_minus_predicted"], cause=r["diagnosis"]["cause"],
                   diagnosis=r["diagnosis"]["text"], trained_reading=r["diagnosis"].get("trained_reading"),
                   fed_reading=r["diagnosis"].get("fed_reading"),
                   answers_equal=ob.get("answers_equal_to_data"), requests=ob.get("requests_compared"),
                   per_position_predicted=pr["per_position"], per_position_served=ob.get("per_position"),
                   readings={"/".join(x["kinds"]): x.get("accept_length", x.get("not_replayed"))
                             for x in r.get("readings", [])},
                   server_start_s=(ob.get("server") or {}).get("start_s"), png=(r.get("png") or {}).get("path"))
        out["ok"] = rc == want_rc and out["cause"] == want_cause and ob["kind"] == "served"
        return out

    # ---- all of it ------------------------------------------------------------------------------------
    def main(self) -> int:
        try:
            if self.acceptance_phases():
                self.timed("drafts", self.drafts)
                self.timed("checks", self.checks)
        except (EaglepatchError, Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - recorded, then the summary
            what = exc.line() if isinstance(exc, EaglepatchError) else "%s: %s" % (type(exc).__name__, exc)
            self.res["error"] = what[:1000]
            self.say("stopped: " + what[:300])
        finally:
            if self.procs:
                self.stop_checks()
            if self.run is not None:
                for srv in list(getattr(self.run, "servers", {}).values()):
                    srv.stop()
                try:
                    self.run.save()  # the acceptance phases' result (pipeline.json)
                except Exception as exc:  # noqa: BLE001 - the summary goes on
                    self.res["pipeline_save_error"] = str(exc)[:300]
                for f in sorted(self.run.logs.glob("*.log")):
                    tail_copy(f, self.out / "logs" / f.name)
            self.save()
        ok = bool(self.res["cases"]) and all(c.get("ok") for c in self.res["cases"].values()) \
            and len(self.res["cases"]) == len(CASES)
        self.res["passed"] = ok
        self.save()
        lines = self.summary_lines()
        self.logf.write("\n".join(lines) + "\n")
        self.logf.close()
        print("\n".join(lines), flush=True)
        return 0 if ok else 1

    def summary_lines(self) -> list:
        lines = ["issue 32 item 3: tools/check_draft.py --serve, sglang %s with the series, toy target (%.0f s)"
                 % (RELEASE, self.elapsed())]
        ph = self.res["phases"]
        lines.append("phases: " + ", ".join("%s %s" % (k, "%.0f s" % v["wall_s"] if v and "wall_s" in v else
                                                        (v or {}).get("skipped", "-")) for k, v in ph.items()))
        for name, d in self.res["drafts"].items():
            if "steps" in d:
                lines.append("draft %-8s ids %s, %d steps (%s, %.0f s), last %s" % (
                    name, d["ids"], d["steps"], d["stopped_by"], d["wall_s"], d["last"]))
        for case, c in self.res["cases"].items():
            if "predicted" in c:
                lines.append("%-8s exit %s (want %s)  predicted %.3f  %s %.3f  answers equal %s/%s  diagnosis %s  %s"
                             % (case, c["exit"], c["want_exit"], c["predicted"], c["observed_kind"], c["observed"],
                                c["answers_equal"], c["requests"], c["cause"], "OK" if c["ok"] else "NOT AS EXPECTED"))
            else:
                lines.append("%-8s exit %s (want %s): %s; %s" % (
                    case, c.get("exit"), CASES[case][0], c.get("why", c.get("stopped", "")),
                    c.get("last_line", "")[:300]))
        if self.res.get("error"):
            lines.append("error: " + self.res["error"][:500])
        lines.append("PASSED" if self.res.get("passed") else "FAILED")
        return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="check_draft_gpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True, type=Path, help="the unpacked GPU bundle (sh .gpu-bundle/unpack.sh SITE)")
    ap.add_argument("--patched-files", required=True, type=Path, help="the series' patched files (.gpu-patched)")
    ap.add_argument("--out", required=True, type=Path, help="the directory the results go to ($OUT)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/check-draft-gpu"),
                    help="work directory (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=500.0, help="seconds for all of it (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the acceptance run's seed (default: %(default)s)")
    ap.add_argument("--port", type=int, default=31000, help="first port: the acceptance phases use it to +4 and +20, "
                                                          "+21; the checks +5 to +7 (default: %(default)s)")
    ap.add_argument("--correct-steps", type=int, default=300, help="the correct draft's steps (default: %(default)s)")
    ap.add_argument("--correct-s", type=float, default=35.0, help="its seconds at most (default: %(default)s)")
    ap.add_argument("--postnorm-steps", type=int, default=600,
                    help="the post-norm draft's steps (default: %(default)s)")
    ap.add_argument("--postnorm-s", type=float, default=50.0, help="its seconds at most (default: %(default)s)")
    a = ap.parse_args(argv)

    def body() -> int:
        if not (a.site / "sglang" / "__init__.py").is_file():
            raise UsageError(f"--site {a.site} holds no sglang",
                             "unpack the bundle there: sh .gpu-bundle/unpack.sh SITE")
        if not (a.patched_files / "patched-files.json").is_file():
            raise UsageError(f"--patched-files {a.patched_files} has no patched-files.json",
                             "make it: python3 tools/gpucheck.py --make-patched-files --series "
                             f"patches/sglang-{RELEASE}")
        if not a.budget_s >= 300:
            raise UsageError(f"--budget-s {a.budget_s}: the target, data, drafts and checks need about 400 s",
                             "pass e.g. --budget-s 500")
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        if not gpu:
            raise UsageError("the proof serves EAGLE-3 drafts and needs a CUDA GPU, which this Python does not see",
                             "run it on the GPU machine (with PYTHONPATH=SITE:src)")
        a.out.mkdir(parents=True, exist_ok=True)
        return Proof(a).main()

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
