"""tools/drift.py on the real releases: the pinned gate (CI) and the release x hunk matrix."""

import json
import os
import re
import shutil
import subprocess
import sys

import yaml
from conftest import REPO, one_line_error, python3_in, run_tool


def hunks_in(series: str) -> int:
    """The number of hunks of a series' patches (those its `series` file lists), counted by unidiff."""
    from unidiff import PatchSet
    root = REPO / "patches" / series
    names = [ln.strip() for ln in (root / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return sum(len(f) for n in names for f in PatchSet((root / n).read_text(encoding="utf-8")))


def test_pinned_gate_passes_on_the_real_series():
    r = run_tool("drift", "--pinned")
    assert r.returncode == 0, r.stdout + r.stderr
    n = hunks_in("sglang-0.5.9")
    assert "sglang-0.5.9 on sglang 0.5.9: all exact (%d/%d hunks exact)" % (n, n) in r.stdout
    assert "sglang-0.5.23 on sglang 0.5.23: all exact" in r.stdout
    assert "sglang-0.5.17 on sglang 0.5.17: all exact" in r.stdout


def test_pinned_gate_fails_when_a_series_is_not_exact_on_its_release(tmp_path):
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches" / "sglang-0.5.23", root / "sglang-0.5.22")
    m = json.loads((root / "sglang-0.5.22" / "manifest.json").read_text())
    m["release"] = "0.5.22"
    (root / "sglang-0.5.22" / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    r = run_tool("drift", "--pinned", env={"EAGLEPATCH_PATCHES": str(root)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "sglang-0.5.22 on sglang 0.5.22: drift" in r.stdout
    assert "model_runner.py hunk 0" in r.stdout and "DRIFT (exit 1)" in r.stdout


def test_matrix_uses_the_nearest_older_series_and_names_the_port(tmp_path):
    out = tmp_path / "drift.md"
    r = run_tool("drift", "--releases", "0.5.23,0.5.9,0.5.10", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    md = out.read_text()
    n, m = hunks_in("sglang-0.5.9"), hunks_in("sglang-0.5.23")
    assert "| 0.5.9 | sglang-0.5.9 | %d/%d exact | all exact |" % (n, n) in md
    assert "| 0.5.23 | sglang-0.5.23 | %d/%d exact | all exact |" % (m, m) in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| 0.5.10 | sglang-0.5.9 |"))
    assert "drift:" in row and "`python3 tools/port.py --from 0.5.9 --to 0.5.10`" in row
    # release x hunk table of the 0.5.9 series: the 0.5.10 capture-loop hunk lost its context
    table = md.split("## Series sglang-0.5.9", 1)[1].split("## Series", 1)[0]
    head = next(ln for ln in table.splitlines() if ln.startswith("| release |")).split(" | ")
    r510 = next(ln for ln in table.splitlines() if ln.startswith("| 0.5.10 |")).split(" | ")
    assert r510[head.index("2.deepseek_v2.py#1")] == "ctx"
    assert r510[head.index("1.settings.py#0")] == "exact"
    assert "Footprint: 11 line(s) added and 3 removed in 4 upstream file(s)" in table
    assert "## Series sglang-0.5.23" in md and "`kimi_k25.py`" not in md.split("## Series sglang-0.5.23")[1]
    # a report: exit 0 with drift, its summary says so and names the gate flags
    assert f"drift: 3 release(s): 2 apply with their own series, 1 with drift (0.5.10); wrote {out}" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("drift: a report, exit 0 whatever drifts; to gate a CI: "
                                                        "--releases <your sglang> --strict")
    # --strict turns the drift into exit 1, and the file is still written in one piece
    r = run_tool("drift", "--releases", "0.5.10", "--out", out, "--strict")
    assert r.returncode == 1 and "1 with drift (0.5.10)" in r.stdout
    assert "drift --strict: FAIL: 0.5.10 (exit 1)" in r.stdout
    assert out.read_text().startswith("# Drift matrix")


def test_committed_drift_doc_covers_every_release_since_the_pin():
    md = (REPO / "docs" / "drift.md").read_text()
    for rel in ("0.5.9", "0.5.10", "0.5.11", "0.5.15.post1", "0.5.22", "0.5.23"):
        assert f"\n| {rel} | sglang-" in md, rel
    assert "| 0.5.23 | sglang-0.5.23 | 14/14 exact | all exact |" in md
    assert "| 0.5.17 | sglang-0.5.17 | 14/14 exact | all exact |" in md


def test_usage_errors():
    r = run_tool("drift", "--pinned", "--releases", "0.5.9")
    assert r.returncode == 2 and "--pinned takes the releases" in one_line_error(r)
    r = run_tool("drift", "--pinned", env={"EAGLEPATCH_PATCHES": "/nonexistent"})
    assert r.returncode == 2 and "there is no series" in one_line_error(r)


def _readme_gate() -> tuple[str, dict]:
    """The shell block and the GitHub Actions job of the README's 'Gating your own CI'."""
    text = (REPO / "README.md").read_text()
    sec = text.split("## Gating your own CI\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", sec, re.S)
    (shell,) = [b for lang, b in blocks if lang == "bash"]
    (job,) = [b for lang, b in blocks if lang == "yaml"]
    return shell, yaml.safe_load(job)


def test_the_documented_ci_gate_passes_on_a_clean_release_and_fails_on_a_drifted_one(tmp_path):
    shell, job = _readme_gate()
    (gate,) = [ln for ln in shell.splitlines() if ln.startswith("python3 ")]
    (steps,) = [j["steps"] for j in job["jobs"].values()]
    assert gate in [s.get("run") for s in steps]  # the job runs the same line
    assert [j["env"]["SGLANG_VERSION"] for j in job["jobs"].values()] == ["0.5.9"]
    assert "SGLANG_VERSION=0.5.9" in shell
    # the user's repository: eaglepatch checked out at eaglepatch/; python3 is this interpreter
    user = tmp_path / "user-repo"
    user.mkdir()
    (user / "eaglepatch").symlink_to(REPO)
    (tmp_path / "bin").mkdir()
    python3_in(tmp_path / "bin")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("SGLANG_VERSION", None)

    def run(script):
        return subprocess.run(["bash", "-c", script], cwd=user, env=env, capture_output=True, text=True)

    r = run(shell)  # exactly as documented
    assert r.returncode == 0, r.stdout + r.stderr
    assert "drift --strict: every release passes (exit 0)" in r.stdout
    assert (user / "drift-report.md").read_text().startswith("# Drift matrix")
    (user / "drift-report.md").unlink()
    r = run(shell.replace("SGLANG_VERSION=0.5.9", "SGLANG_VERSION=0.5.10"))  # the pin moved to 0.5.10
    assert r.returncode == 1, r.stdout + r.stderr
    assert "drift --strict: FAIL: 0.5.10 (exit 1)" in r.stdout
    assert f"port it: python3 {REPO}/tools/port.py --from 0.5.9 --to 0.5.10" in r.stdout
    assert "engine.py hunk 1 [_launch_subprocesses]: conflict" in r.stdout
    assert "| 0.5.10 | sglang-0.5.9 |" in (user / "drift-report.md").read_text()


def test_strict_fails_a_release_that_apply_would_refuse(tmp_path):
    """--strict passes a release only when apply.py would apply: its own series, every hunk exact or
    offset. A release only an older series covers (all exact, but apply refuses it) and one older
    than every series both fail."""
    root = tmp_path / "patches"
    shutil.copytree(REPO / "patches" / "sglang-0.5.9", root / "sglang-0.5.8")
    m = json.loads((root / "sglang-0.5.8" / "manifest.json").read_text())
    m["release"] = "0.5.8"
    (root / "sglang-0.5.8" / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    out = tmp_path / "d.md"
    r = run_tool("drift", "--releases", "0.5.9", "--strict", "--out", out, env={"EAGLEPATCH_PATCHES": str(root)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 apply only with an older series (port them) (0.5.9)" in r.stdout
    assert "sglang 0.5.9: sglang-0.5.8 all exact (no series of its own); port it:" in r.stdout
    assert "apply.py refuses a release without its own" in out.read_text()
    r = run_tool("apply", "--fetch", "0.5.9", tmp_path / "t", env={"EAGLEPATCH_PATCHES": str(root)})
    assert r.returncode == 2 and "no series for sglang 0.5.9" in one_line_error(r)  # what the gate foresaw
    r = run_tool("drift", "--releases", "0.5.8", "--strict", "--out", out)
    assert r.returncode == 1 and "sglang 0.5.8: older than every series" in r.stdout
