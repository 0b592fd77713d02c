"""Fault tolerance of the hidden-state dump (real ModelRunner on CPU) and of tools/apply.py.

Dump faults run real SGLang 0.5.9 code patched with the product series, in the cached CPU
environment (this file is also the worker: ``python test_faults.py worker ...``):
- a dump directory on a 1 MiB tmpfs that fills up: forwards keep returning logits, failed
  dumps are counted and logged with the request key, no partial or temporary files remain,
  and writing resumes once files are deleted;
- a missing and a read-only (read-only tmpfs mount) dump directory: ModelRunner refuses to
  start with a message naming the path;
- a burst of 64 requests (8 prefills of 8, no waiting between them) under a 1 MiB pending
  cap: peak pending bytes stay at the cap, every request's file is written with its rows.
Tool faults: tools/apply.py SIGKILLed at every stage of its transaction (before, while and
after the redo log is committed, while files are replaced), and inputs it must refuse
(malformed patch, not an sglang tree, a release without a series, a locally edited target):
exit codes as docs/design.md says, every file byte-identical.

Mounting needs root; without it the dump tests are skipped, saying so.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

LAYERS = "-1,1,2"
HIDDEN = 256  # tinyconfig.DEEPSEEK_V3["hidden_size"]
N_STATES = 4  # three layers + final
FULL_TOKENS = 100  # ~410 KB per file: two fit on the 1 MiB tmpfs, the third does not
BURST_REQUESTS = 64
BURST_BATCH = 8
BURST_CAP_MB = 1
HANG_S = 60


# ------------------------------------------------------------------------------------------
# worker (runs inside the CPU environment)

def _prompt(rng, n):
    return [rng.randrange(2, 1023) for _ in range(n)]


def _worker(ckpt: str, missing: str, readonly: str, full: str, burst: str, out: str) -> None:
    import logging

    import torch

    import _hf
    import _rt

    if not Path(ckpt, "config.json").exists():
        _hf.build_deepseek(Path(ckpt))
    from sglang.srt.eagle3_capture import capture_target
    from sglang.srt.eagle3_capture.dump import request_key

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    lg = logging.getLogger("sglang.srt.eagle3_capture")
    lg.addHandler(Keep())
    lg.setLevel(logging.INFO)
    res = {}
    os.environ["EAGLE3_DUMP_LAYERS"] = LAYERS

    def save():
        Path(out).write_text(json.dumps(res, indent=1))

    for label, d in (("missing", missing), ("readonly", readonly)):
        os.environ["EAGLE3_DUMP_DIR"] = d
        try:
            r = _rt.make_runner(_rt.server_args(Path(ckpt)))
            res[label] = {"started": True}
            _rt.release(r)
        except Exception as exc:
            res[label] = {"started": False, "error": "%s: %s" % (type(exc).__name__, exc)}
            _rt.release(None)
        save()

    rng = random.Random(7)

    def forward(runner, prompts, rids):
        try:
            o = _rt.extend(runner, prompts, rids=rids).next_token_logits
            return {"logits_ok": bool(o is not None and tuple(o.shape)[0] == len(prompts)
                                      and torch.isfinite(o).all())}
        except Exception as exc:
            runner.req_to_token_pool.clear()  # what extend() skips when the forward raises
            runner.token_to_kv_pool_allocator.clear()
            return {"logits_ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}

    # -- full disk
    os.environ["EAGLE3_DUMP_DIR"] = full
    runner = _rt.make_runner(_rt.server_args(Path(ckpt)))
    writer = capture_target(runner.model)._eagle3_capture_state.writer
    steps = []
    prompts = [_prompt(rng, FULL_TOKENS) for _ in range(6)]
    for i, p in enumerate(prompts):
        if i == 4:  # space returns
            for name in os.listdir(full):
                os.unlink(os.path.join(full, name))
        step = forward(runner, [p], ["full-%d" % i])
        writer.flush()
        step.update(key=request_key("full-%d" % i), written=writer.written, failed=writer.failed,
                    files=sorted(os.listdir(full)))
        steps.append(step)
    res["full"] = {"steps": steps, "log": [m for m in messages if "failed" in m]}
    save()
    writer.close()
    _rt.release(runner)

    # -- burst under a small pending cap
    os.environ["EAGLE3_DUMP_DIR"] = burst
    os.environ["EAGLE3_DUMP_MAX_PENDING_MB"] = str(BURST_CAP_MB)
    runner = _rt.make_runner(_rt.server_args(Path(ckpt)))
    writer = capture_target(runner.model)._eagle3_capture_state.writer
    prompts = [_prompt(rng, rng.randint(5, 60)) for _ in range(BURST_REQUESTS)]
    errors, largest = [], 0
    for b in range(0, BURST_REQUESTS, BURST_BATCH):
        batch = prompts[b:b + BURST_BATCH]
        tokens = sum(map(len, batch))
        # rows: the states (float32) and the ids (int64), each tensor's block rounded up to the
        # staging's 256-byte alignment
        largest = max(largest, sum(-(-tokens * w // 256) * 256 for w in [HIDDEN * 4] * N_STATES + [8]))
        import threading

        def hung(k=b // BURST_BATCH):
            errors.append("prefill %d blocked for %d s in the dump (pending bytes never released)" % (k, HANG_S))
            res["burst"] = {"errors": errors}
            save()
            os._exit(3)

        watchdog = threading.Timer(HANG_S, hung)
        watchdog.start()
        step = forward(runner, batch, ["burst-%d" % j for j in range(b, b + len(batch))])  # no flush: the writer drains while the next prefill runs
        watchdog.cancel()
        if not step["logits_ok"]:
            errors.append("prefill %d: %s" % (b // BURST_BATCH, step.get("error", "bad logits")))
    writer.flush()
    checked = {}
    from safetensors import safe_open

    for j, p in enumerate(prompts):
        key = request_key("burst-%d" % j)
        f = Path(burst, key + ".safetensors")
        if not f.exists():
            checked[key] = "missing"
            continue
        with safe_open(str(f), "pt") as st:
            ids = st.get_tensor("input_ids").tolist()
            shapes = {k: list(st.get_tensor(k).shape) for k in st.keys() if k != "input_ids"}
        want = {k: [len(p), HIDDEN] for k in ["layer.-1", "layer.1", "layer.2", "final"]}
        checked[key] = "ok" if ids == p and shapes == want else "wrong: ids %s shapes %s" % (
            ids[:4], shapes)
    res["burst"] = {"errors": errors, "written": writer.written, "failed": writer.failed,
                    "peak_pending": writer.peak_pending_bytes, "cap": writer.max_pending_bytes,
                    "largest_prefill_bytes": largest, "checked": checked,
                    "files": sorted(os.listdir(burst))}
    save()
    writer.close()
    _rt.release(runner)


# ------------------------------------------------------------------------------------------
# pytest side (the project's python)

if __name__ != "__main__":
    import pytest
    from conftest import REAL, hashes, run_tool
    from txnkit import kill, own_tmp, start_stopped

    from eaglepatch.series import load_series, sha256_bytes

    def _mount_tmpfs(path: Path, size: str, readonly: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", str(path)], check=True,
                       capture_output=True)
        if readonly:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)

    def _umount(path: Path) -> None:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)

    @pytest.fixture(scope="module")
    def dump_faults(tmp_path_factory, release_059):
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (tests run as root in CI)")
        probe = tmp_path_factory.mktemp("mount-probe")
        try:
            _mount_tmpfs(probe / "m", "64k")
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            pytest.skip("cannot mount tmpfs here: %s" % getattr(exc, "stderr", exc))
        _umount(probe / "m")
        from eaglepatch.cpuenv import ensure_env
        from eaglepatch.smoke.tree import patched_tree

        work = tmp_path_factory.mktemp("dump-faults")
        tree = patched_tree(release_059, REAL, work / "pp")
        ro, full, burst = work / "readonly", work / "full", work / "burst"
        burst.mkdir()
        mounted = []
        try:
            _mount_tmpfs(ro, "64k", readonly=True)
            mounted.append(ro)
            _mount_tmpfs(full, "1m")
            mounted.append(full)
            smoke = REAL.parents[1] / "src" / "eaglepatch" / "smoke"
            env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join([str(tree), str(smoke / "stubs"), str(smoke)]))
            for k in ("EAGLE3_DUMP_DIR", "EAGLE3_DUMP_LAYERS", "EAGLE3_DUMP_FINAL", "EAGLE3_DUMP_MAX_PENDING_MB"):
                env.pop(k, None)
            out = work / "result.json"
            proc = subprocess.run([str(ensure_env()), __file__, "worker", str(work / "ckpt"),
                                   str(work / "missing"), str(ro), str(full), str(burst), str(out)],
                                  env=env, capture_output=True, text=True, timeout=420)
            res = json.loads(out.read_text()) if out.exists() else {}
            res["_stderr"] = proc.stderr[-4000:]
            res["_rc"] = proc.returncode
            res["_paths"] = {"missing": str(work / "missing"), "readonly": str(ro), "full": str(full)}
            yield res
        finally:
            for m in mounted:
                _umount(m)

    def _part(res, name):
        if name not in res:
            pytest.fail("the worker did not reach '%s' (exit %s):\n%s" % (name, res["_rc"], res["_stderr"]))
        return res[name]

    @pytest.mark.parametrize("which", ["missing", "readonly"])
    def test_bad_dump_dir_refused_at_start_naming_the_path(dump_faults, which):
        r = _part(dump_faults, which)
        assert not r["started"], "ModelRunner started with a %s dump directory" % which
        assert dump_faults["_paths"][which] in r["error"], r["error"]
        assert "EAGLE3_DUMP_DIR" in r["error"], r["error"]

    def test_full_disk_keeps_serving_counts_logs_and_resumes(dump_faults):
        steps = _part(dump_faults, "full")["steps"]
        log = dump_faults["full"]["log"]
        assert all(s["logits_ok"] for s in steps), [s.get("error") for s in steps]
        # two files fit, then every dump fails until space returns
        assert [s["written"] for s in steps[:4]] == [1, 2, 2, 2], steps
        assert [s["failed"] for s in steps[:4]] == [0, 0, 1, 2], steps
        for s in steps[2:4]:
            assert any(s["key"] in m for m in log), "no log line names key %s: %s" % (s["key"], log)
        for i, s in enumerate(steps[:4]):  # only whole files, no temporaries
            want = sorted(x["key"] + ".safetensors" for x in steps[:min(i + 1, 2)])
            assert s["files"] == want, (i, s["files"])
        # files deleted -> writing resumes
        assert [s["written"] for s in steps[4:]] == [3, 4] and steps[-1]["failed"] == 2, steps
        assert steps[-1]["files"] == sorted(x["key"] + ".safetensors" for x in steps[4:]), steps[-1]["files"]

    def test_burst_of_64_under_a_small_cap_loses_nothing(dump_faults):
        b = _part(dump_faults, "burst")
        assert not b["errors"], "prefills failed with the dump on: %s" % b["errors"][:3]
        assert b["failed"] == 0 and b["written"] == BURST_REQUESTS, b
        bad = {k: v for k, v in b["checked"].items() if v != "ok"}
        assert not bad, "%d of %d requests missing or wrong: %s" % (len(bad), BURST_REQUESTS, list(bad.items())[:3])
        assert all(f.endswith(".safetensors") for f in b["files"]) and len(b["files"]) == BURST_REQUESTS
        assert b["peak_pending"] <= max(b["cap"], b["largest_prefill_bytes"]), b
        assert b["peak_pending"] > b["cap"] // 2, "the burst never came near the cap: %s" % b

    # --------------------------------------------------------------------------------------
    # tools/apply.py faults

    TOOLS = REAL.parents[1] / "tools"

    def _targets():
        s = load_series(REAL)
        return s.manifest_files()

    def _state(pp: Path, orig: dict) -> str:
        """'upstream' | 'patched' | 'mixed' for the series' target files; user files must be intact."""
        states = set()
        for rel, h in _targets().items():
            p = pp / rel
            cur = sha256_bytes(p.read_bytes()) if p.exists() else None
            states.add("patched" if cur == h["patched_sha256"] else "upstream" if cur == h["upstream_sha256"]
                       else "other")
        now = hashes(pp)
        others = {k for k in orig if k not in _targets() and not k.startswith(".eaglepatch-txn")}
        changed = [k for k in others if now.get(k) != orig[k]]
        assert not changed, "files outside the series changed: %s" % changed[:5]
        return states.pop() if len(states) == 1 else "mixed"

    def _kill_at(pp: Path, args, stage: str, delay: float) -> str:
        """Run apply.py and SIGKILL it at `stage` of its transaction (a stop point: `staged` = before
        the commit point, `ready` = just after it, `replacing` = one file replaced) or, for
        `delay`, after `delay` seconds wherever it is; returns what the redo log looked like."""
        txn = pp / ".eaglepatch-txn"
        if stage == "delay":
            tmp = own_tmp()  # a SIGKILLed tool cannot remove its scratch copy
            proc = subprocess.Popen([sys.executable, str(TOOLS / "apply.py"), str(pp), *args],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=dict(os.environ, TMPDIR=str(tmp)))
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            kill(start_stopped("apply", pp, *args, stage=stage))
        if not txn.exists():
            return "no log"
        return "log with READY" if (txn / "READY").exists() else "log without READY"

    def _installed_with_user_file(installed_059):
        (installed_059 / "sglang" / "MY_NOTES.txt").write_text("a user's file next to the package\n")
        return installed_059

    def test_apply_killed_mid_series_recovers_on_next_run(installed_059):
        pp = _installed_with_user_file(installed_059)
        orig = hashes(pp)
        t0 = time.monotonic()
        r = run_tool("apply", pp)
        assert r.returncode == 0, r.stderr
        full_run = time.monotonic() - t0
        assert _state(pp, orig) == "patched"
        r = run_tool("apply", pp, "--reverse")
        assert r.returncode == 0 and hashes(pp) == orig, r.stderr
        seen = []
        rng = random.Random(3)
        stages = ["staged", "ready", "replacing", "delay"]
        for i in range(24):
            stage = stages[i % len(stages)]
            reverse = (i // len(stages)) % 2 == 1
            args = ["--reverse"] if reverse else []
            if reverse:  # start from the patched tree
                assert run_tool("apply", pp).returncode == 0
            found = _kill_at(pp, args, stage, rng.uniform(0.0, full_run))
            st = _state(pp, orig)
            seen.append((stage, "reverse" if reverse else "apply", found, st))
            if stage != "delay":
                assert found == ("log without READY" if stage == "staged" else "log with READY"), seen[-1]
            if found != "log with READY":  # nothing committed yet, or all done: never a mix
                assert st in ("upstream", "patched"), seen[-1]
            r = run_tool("apply", pp, *args)  # the next run completes or discards, then acts
            assert r.returncode == 0, (seen[-1], r.stdout, r.stderr)
            assert not (pp / ".eaglepatch-txn").exists()
            if reverse:
                assert hashes(pp) == orig, seen[-1]
            else:
                assert _state(pp, orig) == "patched", seen[-1]
                assert run_tool("apply", pp, "--reverse").returncode == 0
                assert hashes(pp) == orig, seen[-1]
        found = {s[2] for s in seen}
        assert {"log with READY", "log without READY"} <= found, \
            "kills never landed inside the transaction: %s" % seen

    def _series_copy(tmp_path):
        d = tmp_path / "series-copy" / REAL.name
        shutil.copytree(REAL, d)
        return d

    @pytest.mark.parametrize("damage", ["no separator", "bad hunk counts", "not utf-8", "path outside sglang"])
    def test_malformed_patch_exit_2_tree_untouched(installed_059, tmp_path, damage):
        series = _series_copy(tmp_path)
        victim = sorted(series.glob("0002-*.patch"))[0]
        text = victim.read_bytes()
        if damage == "no separator":
            text = text.replace(b"\n---\n", b"\n", 1)
        elif damage == "bad hunk counts":
            lines = text.split(b"\n")
            k = next(n for n, ln in enumerate(lines) if ln.startswith(b"@@ "))
            lines.insert(k + 1, b" only context that is not counted")
            text = b"\n".join(lines)
        elif damage == "not utf-8":
            text = text.replace(b"Subject:", b"Subject: \xff\xfe", 1)
        else:
            text = text.replace(b"a/sglang/", b"a/../etc/", 1).replace(b"b/sglang/", b"b/../etc/", 1)
        victim.write_bytes(text)
        before = hashes(installed_059)
        r = run_tool("apply", installed_059, "--series", series)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert r.stderr.strip().startswith("error: ") and "; " in r.stderr, r.stderr
        assert hashes(installed_059) == before

    def test_not_sglang_exit_2_untouched(tmp_path):
        d = tmp_path / "project"
        (d / "python" / "other").mkdir(parents=True)
        (d / "python" / "other" / "x.py").write_text("print(1)\n")
        (d / "README").write_text("not sglang\n")
        before = hashes(d)
        r = run_tool("apply", d)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert str(d) in r.stderr and hashes(d) == before

    def test_release_without_series_refused_untouched(installed_0510):
        before = hashes(installed_0510)
        r = run_tool("apply", installed_0510)
        assert r.returncode == 1, (r.returncode, r.stderr)  # refused: nothing to apply for 0.5.10
        assert "0.5.10" in r.stderr and hashes(installed_0510) == before

    def test_dirty_target_refused_untouched(installed_059):
        target = installed_059 / "sglang" / "srt" / "model_executor" / "model_runner.py"
        target.write_bytes(target.read_bytes() + b"# a local edit\n")
        before = hashes(installed_059)
        r = run_tool("apply", installed_059)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "model_runner.py" in r.stderr and hashes(installed_059) == before


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "worker":
    _worker(*sys.argv[2:])
