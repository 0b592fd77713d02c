"""benchmarks/peers.py on CPU (``--cpu``): the same EAGLE-3 dataset made four ways from the CPU demo's
tiny DeepSeek-V3, each dataset loaded with SpecForge 0.2.0's own reader and checked against a float32
transformers reference; the reference check shown failing on wrong data (aux layers shifted by one
either way, the pre-norm state where the post-norm one belongs); the refusals reported with their
reasons; the usage errors; --budget-s reporting what it did not run; the limit (ours's server with the
dump off) over two repetitions and each method's ratio to it, recomputed from the JSON's figures.

CPU figures prove the plumbing, not performance. Runs inside the CPU environment
(``eaglepatch.cpuenv``); under another interpreter ``test_peers_suite_in_cpu_env`` reruns this file
there. About 8 minutes on a 2-core machine.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import process_table, run_suite_in_cpu_env

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / "benchmarks" / "peers.py"
IN_ENV = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "specforge"))
in_env = pytest.mark.skipif(not IN_ENV, reason="runs inside the CPU env (see test_peers_suite_in_cpu_env)")
TOL = 1e-3  # the CPU profile's tolerance: float32 on both sides


@pytest.mark.skipif(IN_ENV, reason="already inside the CPU env")
def test_peers_suite_in_cpu_env():
    run_suite_in_cpu_env(__file__, 1200)


def peers(*args, timeout=840) -> subprocess.CompletedProcess:
    return subprocess.run(["nice", "-n", "5", sys.executable, str(PEERS), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    out, work = root / "peers.json", root / "work"
    # --budget-s 700: the limit's server, ours-mooncake's and the second repetitions take the default's room
    p = peers("--cpu", "--out", out, "--work", work, "--keep-work", "--repeats", "2", "--budget-s", "700",
              "--methods", "limit,ours,ours-fp8-disk,ours-mooncake,hf,specforge,sglang-json", "--extract-processes",
              "2", "--dump-writers", "3", "--dump-gil-switch-ms", "2")
    print(p.stderr[-4000:])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    measured = {k: v for k, v in res["methods"].items() if v["status"] == "measured"}
    return SimpleNamespace(root=root, out=out, work=work, res=res, stderr=p.stderr, measured=measured,
                           datasets={k: v for k, v in measured.items() if k != "limit"})


@in_env
def test_every_method_reported_with_its_figures(run):
    m = run.res["methods"]
    assert set(m) == {"limit", "ours", "ours-fp8-disk", "ours-mooncake", "hf", "specforge", "sglang-json"}
    assert run.res["partial"] is False and "CPU smoke" in run.res["note"]
    assert {"limit", "ours", "ours-fp8-disk", "ours-mooncake", "hf"} <= set(run.measured), {k: v.get("refused") or v.get("failed") for k, v in m.items()}
    conv = run.res["conversations"]
    for name, r in run.measured.items():
        assert r["complete"] and r["samples_done"] == conv["count"], name
        assert r["tokens_done"] == conv["tokens"], name
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_including_startup"] > 0, name
        assert r["peak_rss_bytes"] > 100 << 20, name
        assert r["peak_gpu_bytes"] is None  # no GPU here
        assert [b["bucket"] for b in r["buckets"]] == [b["bucket"] for b in conv["buckets"]]
        # with requests in flight at once, a bucket whose samples all finished before the last of the bucket
        # before has no time of its own (buckets_by_completion): every other bucket has a rate
        assert all(b["tokens_per_s"] > 0 for b in r["buckets"] if b["seconds"] > 0), (name, r["buckets"])
        assert sum(b["seconds"] > 0 for b in r["buckets"]) >= len(r["buckets"]) // 2, (name, r["buckets"])
        if name == "limit":
            continue
        assert r["gb_per_million_tokens"] > 0, name
    # each fresh server was warmed up before its timed pass (untimed; Triton compiles per shape on a GPU)
    warm = [run.measured["ours"]["warmup"]] + [p["warmup"] for p in m["sglang-json"].get("passes", {}).values()
                                              if "warmup" in p]
    for w in warm:
        assert w["rounds"] and all(r["tokens_per_s"] > 0 for r in w["rounds"]) and "error" not in w, w
    # ours's servers, as the limit's, then make one untimed extract pass of the real conversations
    for name in ("ours", "ours-fp8-disk", "ours-mooncake"):
        passes = run.measured[name]["warmup"]["passes"]
        assert [(w["samples_done"], "failed" in w) for w in passes] == [(conv["count"], False)], (name, passes)
        assert passes[0]["tokens_per_s"] > 0, passes
        assert not list((run.work / name).glob("dataset-warm*")), "the untimed pass's dataset was kept"
    # the dump writer's counts and extract's stage seconds are kept for a post-mortem
    ours = run.measured["ours"]
    assert ours["dump_counts"]["flushed"] and ours["dump_counts"]["written"] >= conv["count"], ours["dump_counts"]
    assert any(x.startswith("time per stage") for x in ours["extract_progress"]), ours["extract_progress"]
    # hidden 256 float32: aux 3 states + final = 4 x 256 x 4 bytes per token, plus ids and mask
    for name in ("ours", "hf"):
        assert 4.0 < run.measured[name]["gb_per_million_tokens"] < 4.6, (name, run.measured[name])
    assert run.res["summary"]["tokens_per_s"].keys() == run.measured.keys()
    assert "ours_over_fastest_peer" in run.res["summary"]
    assert run.res["plot"]["written"] or "matplotlib" in run.res["plot"]["why"]


@in_env
def test_limit_is_ours_server_with_the_dump_off(run):
    """``limit``: ours's server (the tools/serve.py command's --print line) without the dump's
    variables, every conversation prefilled in each of the two repetitions, figures in the JSON,
    nothing written but them."""
    lim = run.measured["limit"]
    conv = run.res["conversations"]
    assert "404" in lim["dump_route"] and "EAGLE3_DUMP_DIR" in lim["server"], lim
    assert lim["dataset"] is None and "gb_per_million_tokens" not in lim and "reference" not in lim
    assert lim["warmup"]["rounds"] and "error" not in lim["warmup"]
    # then one untimed pass of the real conversations, kept apart from the timed ones
    assert [w["answers"] for w in lim["warmup"]["passes"]] == [conv["count"]] and lim["warmup"]["passes"][0]["tokens_per_s"] > 0
    assert len(lim["repetitions"]) == 2 and len(run.measured["ours"]["repetitions"]) == 2
    assert len(run.measured["hf"]["repetitions"]) == 1  # --repeats: limit and ours only
    for rep in lim["repetitions"]:
        assert rep["answers"] == rep["samples_done"] == conv["count"] and rep["tokens_done"] == conv["tokens"], rep
        assert rep["error_count"] == 0 and rep["tokens_per_s"] > 0, rep
        assert [b["tokens"] for b in rep["buckets"]] == [b["tokens"] for b in conv["buckets"]]
    o = lim["over_repetitions"]
    tps = [rep["tokens_per_s"] for rep in lim["repetitions"]]
    assert o["tokens_per_s"] == {"per_repetition": tps, "min": min(tps), "median": pytest.approx(sum(tps) / 2)}
    for rep in run.measured["ours"]["repetitions"]:  # each repetition of ours made and checked its own dataset
        assert rep["samples_done"] == conv["count"] and rep["reference"]["verdict"] == "pass", rep
    assert len({rep["dataset"] for rep in run.measured["ours"]["repetitions"]}) == 2
    left = [p for p in (run.work / "limit").rglob("*") if p.suffix in (".ckpt", ".safetensors", ".pt")]
    assert not left, left


@in_env
def test_ours_fp8_disk_makes_one_fp8_dataset_in_worker_processes(run):
    """``ours-fp8-disk`` (issue 45), the ``ours-processes`` path storing fp8: one tools/extract.py run with
    --processes 2 and --format compact per repetition from a server dumping fp8 (serve.py --dump-dtype fp8
    --rebuildable omit), its log naming the two workers and their threads; one dataset of half ours's
    bytes that ``CompactDataset`` loads whole in SpecForge's view and whose rows pass the reference
    check at the profile's tolerance plus fp8's."""
    m = run.measured["ours-fp8-disk"]
    n = run.res["conversations"]["count"]
    assert m["extract_worker_processes"] == 2 and len(m["repetitions"]) == 2, m
    assert "--dump-dtype fp8" in m["storage"] and m["disk_file_system"] not in ("unknown", ""), m
    probe = m["disk_write_rate"]  # the disk's own rate, the bound of this method: measured, its file gone
    assert probe["bytes"] == 64 << 20 and probe["seconds"] > 0 and probe["gb_per_s"] > 0, probe
    assert not list(Path(m["disk_dir"]).glob(".peers-disk-probe-*")), m["disk_dir"]
    for k, rep in enumerate(m["repetitions"]):
        assert rep["samples_done"] == n and rep["extract_exit"] == 0 and rep["extract_worker_processes"] == 2, rep
        assert rep["format"] == "compact" and rep["reader"]["loaded"] and rep["reader"]["samples"] == n, rep["reader"]
        assert rep["reader"]["first"]["hidden_state"][-1] == 3 * rep["reader"]["first"]["target"][-1], rep["reader"]
        ref = rep["reference"]
        assert ref["verdict"] == "pass" and not ref["missing"] and ref["tolerance_row_rel"] == TOL + 0.05, ref
        assert TOL < ref["max_row_rel"] < 0.05, ref  # fp8's rounding shows; the layers are right
        log = run.work / "ours-fp8-disk" / ("extract.log" if k == 0 else "extract-rep%d.log" % (k + 1))
        assert "2 worker processes, 2+2 threads" in log.read_text(), log.read_text()[-2000:]
    # one byte a value and a float32 scale per token and state, against the CPU demo's float32 states (4 bytes
    # a value): about a quarter of ours's bytes (on a GPU, against bf16, about half)
    ratio = m["gb_per_million_tokens"] / run.measured["ours"]["gb_per_million_tokens"]
    assert 0.2 < ratio < 0.4, ratio


@in_env
def test_ours_mooncake_reads_every_sample_from_the_store(run):
    """``ours-mooncake`` (issue 45): the server's Mooncake sink into a mooncake_master the run started,
    tools/extract.py --processes 2 reading each answer's states from the store: every sample of each
    repetition in a dataset SpecForge's reader loads, rows within the CPU tolerance of the float32
    reference, the server's writer counting store puts and no dump file written."""
    m = run.measured["ours-mooncake"]
    n = run.res["conversations"]["count"]
    assert m["sink"].startswith("mooncake") and "dump_dir" not in m and m["extract_worker_processes"] == 2, m
    assert "--sink mooncake" in m["server_dump_flags"], m
    log = (run.work / "ours-mooncake" / "server.log").read_text()
    assert "sink mooncake (master 127.0.0.1:" in log, log[-2000:]
    for k, rep in enumerate(m["repetitions"]):
        assert rep["samples_done"] == n and rep["extract_exit"] == 0, rep
        assert rep["dump_counts"]["written"] >= n and not rep["dump_counts"]["failed"], rep["dump_counts"]
        assert rep["losses"] == {"failed": 0, "dropped": 0, "conversations_failed": 0}, rep["losses"]
        # the store cleared between phases, the server's sentinel left: no restart of the master seen
        assert rep["dump_counts"]["master_restarts"] == rep["dump_counts"]["gone_at_restart"] == 0, rep["dump_counts"]
        assert rep["dataset_bytes"] > 0 and rep["reader"]["loaded"] and rep["reader"]["samples"] == n, rep
        ref = rep["reference"]
        assert ref["verdict"] == "pass" and not ref["missing"] and ref["max_row_rel"] < TOL, ref
        xlog = run.work / "ours-mooncake" / ("extract.log" if k == 0 else "extract-rep%d.log" % (k + 1))
        assert "2 worker processes" in xlog.read_text(), xlog.read_text()[-2000:]
    master_log = run.work / "ours-mooncake" / "master.log"
    assert master_log.is_file() and master_log.stat().st_size > 0
    # the warm-up's objects, which nobody reads, removed before any pass (left, they filled the store of
    # the H100 run 21: docs/results/peers-h100-run21.json), and the store cleared between passes
    cleared = m["store_cleared"]
    warm_requests = sum(r["requests"] for r in m["warmup"]["rounds"])
    assert warm_requests and cleared[0]["after"] == "warm-up rounds", m["warmup"]
    assert cleared[0]["keys_removed"] >= warm_requests, cleared
    assert [c["after"] for c in cleared[1:]] == ["untimed pass 1", "repetition 1"], cleared
    # the same bytes as ours's dataset: only where the states travel differs
    assert m["gb_per_million_tokens"] == pytest.approx(run.measured["ours"]["gb_per_million_tokens"], rel=0.02)


def test_each_of_ours_methods_dumps_and_writes_where_it_says(tmp_path):
    """Where each of ours's methods has its server dump and extract write, with the GPU profile's
    --dump-dir and --disk-dir (no server started): ``ours-fp8`` as ``ours`` (dumps in a new
    subdirectory of --dump-dir, the dataset in the work directory), ``ours-fp8-disk`` both in a new
    subdirectory of --disk-dir; every such subdirectory removed after the method."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import peers as P

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    disk.mkdir()
    r = P.Run(SimpleNamespace(cpu=False, work=str(tmp_path / "work"), dump_dir=str(shm), disk_dir=str(disk)),
              P.PROFILES["gpu"])
    assert set(P.OURS_VARIANTS) == set(P.OURS) and set(P.OURS) <= set(P.METHODS)
    for name in P.OURS:
        dumps, out = r.ours_places(name)
        if name == "ours-fp8-disk":
            assert out.parent == disk and dumps == out / "dumps" and dumps.is_dir(), (name, dumps, out)
        else:
            assert dumps.parent == shm and dumps.is_dir() and out == r.work / name, (name, dumps, out)
    assert P.OURS_VARIANTS["ours-fp8"]["fp8"] and not P.OURS_VARIANTS["ours-processes"]["fp8"]
    r.drop_extra_dumps()
    assert not list(shm.iterdir()) and not list(disk.iterdir())


@in_env
def test_dump_writers_and_gil_switch_reach_every_server_of_ours(run):
    """``--dump-writers 3 --dump-gil-switch-ms 2``: each of ours's servers starts with 3 writer threads and
    its writing process at a 2 ms GIL switch interval (its start line, the interval read back from the
    interpreter), the limit's with the dump off."""
    for name in ("ours", "ours-fp8-disk", "ours-mooncake"):
        assert run.measured[name]["dump_writers"] == 3 and run.measured[name]["dump_gil_switch_ms"] == 2
        log = (run.work / name / "server.log").read_text()
        assert "3 writer threads (EAGLE3_DUMP_WRITERS=3), GIL switch interval 2 ms (EAGLE3_DUMP_GIL_SWITCH_MS)" \
            in log, (name, log[-2000:])
    limit = (run.work / "limit" / "server.log").read_text()
    assert "writer threads" not in limit and "GIL switch interval" not in limit


@in_env
def test_ratio_to_limit_is_each_repetition_over_the_limits(run):
    """The ratio block, recomputed from the JSON's own per-repetition figures: pass i of a method over
    pass i of the limit, overall and per bucket, with their min and median; the lines said at the end
    show them."""
    import statistics

    r = run.res["ratio_to_limit"]
    assert r["computed"] is True and set(r["methods"]) == set(run.measured) - {"limit"}
    L = run.measured["limit"]["repetitions"]

    def rate(rep, bucket=None):
        if bucket is None:
            return rep["tokens_per_s"]
        return next(b["tokens_per_s"] for b in rep["buckets"] if b["bucket"] == bucket)

    def check(got, mine, bucket=None):
        want = []
        for a, b in zip(mine, L):
            x, y = rate(a, bucket), rate(b, bucket)
            want.append(x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) else "not measured")
        assert len(got["per_repetition"]) == len(want) == min(len(mine), len(L))
        for g, w in zip(got["per_repetition"], want):
            assert g == (w if w == "not measured" else pytest.approx(w, abs=6e-5)), (bucket, got, want)
        if "not measured" in want:
            assert got["min"] == got["median"] == "not measured"
        else:
            assert got["min"] == min(got["per_repetition"])
            assert got["median"] == pytest.approx(statistics.median(got["per_repetition"]))

    for name, block in r["methods"].items():
        mine = run.measured[name]["repetitions"]
        assert block["repetitions_paired"] == min(len(mine), len(L))
        check(block["overall"], mine)
        assert list(block["buckets"]) == [b["bucket"] for b in run.res["conversations"]["buckets"]]
        for bucket, got in block["buckets"].items():
            check(got, mine, bucket)
    ours = r["methods"]["ours"]
    assert ours["repetitions_paired"] == 2 and all(x > 0 for x in ours["overall"]["per_repetition"])
    assert run.res["summary"]["ratio_to_limit"]["ours"] == {k: ours["overall"][k] for k in ("min", "median")}
    line = next(x for x in run.stderr.splitlines() if "summary: ours " in x)
    assert "ratio to limit min / median %s / %s" % (ours["overall"]["min"], ours["overall"]["median"]) in line
    assert run.res["summary"]["fastest_peer"] != "limit"  # the limit is no peer: it makes no dataset


@in_env
def test_refusals_are_measured_with_their_reasons(run):
    """SpecForge 0.2.0's only backend needs sglang 0.5.14 internals; upstream's aux states need an
    EAGLE-3 server, which does not start on CPU. Both are reported, with no figure made up; the
    JSON path's final pass that did run is measured and its rows checked."""
    m = run.res["methods"]
    sf = m["specforge"]
    if sf["status"] != "measured":
        assert sf["status"] == "refused" and "0.5.14" in sf["refused"] and sf.get("tokens_per_s") is None
        assert "ModuleNotFoundError" in sf["refused"] or "Error" in sf["refused"]
    js = m["sglang-json"]
    if js["status"] != "measured":
        assert js["status"] == "refused" and js["refused"].startswith("aux pass") and js.get("tokens_per_s") is None
        fp = js["passes"]["final"]
        assert fp["tokens_per_s"] > 0 and fp["json_bytes"] > 0
        assert sum(b["samples_done"] for b in fp["buckets"]) == run.res["conversations"]["count"]
        assert fp["reference"]["verdict"] == "pass" and fp["reference"]["checked"] == len(
            run.res["conversations"]["reference_sample"]), fp["reference"]
    assert "not measured" not in {v["status"] for v in m.values()}


@in_env
def test_datasets_load_in_specforge_with_the_same_samples(run):
    import torch
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    from safetensors.torch import load_file

    from eaglepatch.compact import CompactDataset

    ids = {}
    for name, r in run.datasets.items():
        if r.get("format") == "compact":  # ours-fp8-disk: read through CompactDataset, which yields SpecForge's
            # reader's items for the same samples (tests/test_compact.py compares them)
            ds = CompactDataset(r["dataset"], run.work / "demo" / "model", yields="specforge", max_len=1000)
            files = sorted(Path(r["dataset"]).rglob("*.safetensors"))
            got = {f.stem: load_file(str(f))["input_ids"].tolist() for f in files}
        else:
            ds = build_offline_eagle3_dataset(r["dataset"], max_len=1000)
            files = sorted(Path(r["dataset"]).rglob("*.ckpt"))
            got = {f.stem: torch.load(str(f), weights_only=True)["input_ids"].tolist() for f in files}
        assert len(ds) == run.res["conversations"]["count"] == r["reader"]["samples"], name
        item = ds[0]
        assert item["hidden_state"].shape[-1] == 3 * 256 and item["target"].shape[-1] == 256, name
        ids[name] = got
    first = next(iter(ids.values()))
    for name, got in ids.items():
        assert got == first, f"{name} holds other samples or other token ids than the others"


@in_env
def test_rows_within_tolerance_of_the_float32_reference(run):
    n = len(run.res["conversations"]["reference_sample"])
    assert n >= 6
    for name, r in run.datasets.items():
        ref = r["reference"]
        assert ref["verdict"] == "pass" and ref["checked"] == n and not ref["missing"], (name, ref)
        assert set(ref["states"]) == {"aux.hf1", "aux.hf2", "aux.hf3", "final"}
        # the fp8 method's states are fp8 with a scale per token and state: the profile's tolerance plus fp8's
        assert ref["max_row_rel"] <= (TOL + 0.05 if r.get("format") == "compact" else TOL), (name, ref)


def _dataset_from_reference(ref: dict, dest: Path, aux_layers, final_key="final") -> Path:
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from eaglepatch.extract.writers import sample_rel

    for cid, r in ref.items():
        p = dest / sample_rel("specforge", cid)
        p.parent.mkdir(parents=True, exist_ok=True)
        aux = torch.cat([r[f"layer.{k}"] for k in aux_layers], dim=-1)
        torch.save({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "hidden_state": r[final_key][None],
                    "aux_hidden_state": aux[None]}, str(p))
    return dest


@in_env
@pytest.mark.parametrize("case, aux, final", [
    ("right", (0, 1, 2), "final"),
    ("aux shifted down by one", (-1, 0, 1), "final"),
    ("aux shifted up by one", (1, 2, 3), "final"),
    ("pre-norm where post-norm belongs", (0, 1, 2), "layer.3"),
])
def test_reference_check_fails_on_wrong_data(run, tmp_path, case, aux, final):
    import torch

    refp = run.work / "reference.pt"
    ds = _dataset_from_reference(torch.load(str(refp), weights_only=True), tmp_path / "ds", aux, final)
    p = peers("--check", ds, "--reference", refp, "--out", tmp_path / "check.json", timeout=300)
    res = json.loads((tmp_path / "check.json").read_text())
    if case == "right":
        assert p.returncode == 0 and res["verdict"] == "pass" and res["max_row_rel"] == 0, res
    else:
        assert p.returncode == 1 and res["verdict"] == "fail", (case, res)
        assert res["max_row_rel"] > 100 * TOL, (case, res)  # far from float noise


@in_env
def test_reference_check_fails_on_a_methods_dataset_with_shifted_aux(run, tmp_path):
    """A real method's dataset (hf) whose aux slots are shifted by one (HF 2, 3 and the final state
    where HF 1, 2, 3 belong) fails; unchanged it passes."""
    import shutil

    import torch

    src = Path(run.measured["hf"]["dataset"])
    refp = run.work / "reference.pt"
    assert peers("--check", src, "--reference", refp, timeout=300).returncode == 0
    ds = tmp_path / "shifted"
    shutil.copytree(src, ds)
    for f in ds.rglob("*.ckpt"):
        d = torch.load(str(f), weights_only=True)
        H = d["hidden_state"].shape[-1]
        d["aux_hidden_state"] = torch.cat([d["aux_hidden_state"][..., H:], d["hidden_state"]], dim=-1)
        torch.save(d, str(f))
    p = peers("--check", ds, "--reference", refp, "--out", tmp_path / "c.json", timeout=300)
    res = json.loads((tmp_path / "c.json").read_text())
    assert p.returncode == 1 and res["verdict"] == "fail", res
    assert res["states"]["aux.hf3"]["max_row_rel"] > 0.1 and res["states"]["final"]["max_row_rel"] <= TOL


@in_env
def test_reference_check_fails_on_an_fp8_dataset_with_rotated_layers(run, tmp_path):
    """The fp8 method's dataset (compact samples, read back through extract's decoding and the model's
    rebuilder) passes the reference check as written; with its aux layers rotated by one (each sample's
    layer 0 states stored under layer 1, 1 under 2, 2 under 0, scales with them) it fails, far above
    fp8's rounding, while the final state still passes."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    spec = importlib.util.spec_from_file_location("peers_mod", PEERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = Path(run.measured["ours-fp8-disk"]["dataset"])
    refp, model, tol = run.work / "reference.pt", run.work / "demo" / "model", TOL + 0.05
    assert mod.check_dataset(src, refp, tol, model=model)["verdict"] == "pass"
    ds = tmp_path / "rotated"
    shutil.copytree(src, ds)
    rot = {"layer.0": "layer.1", "layer.1": "layer.2", "layer.2": "layer.0"}
    files = list(ds.rglob("*.safetensors"))
    assert files
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
            t = {k: h.get_tensor(k) for k in h.keys()}
        save_file({(("scale." + rot[k[6:]]) if k.startswith("scale.") and k[6:] in rot else rot.get(k, k)): v
                   for k, v in t.items()}, str(f), metadata=meta)
    res = mod.check_dataset(ds, refp, tol, model=model)
    assert res["verdict"] == "fail" and not res["missing"] and not res["problems"], res
    assert min(res["states"]["aux.hf%d" % h]["max_row_rel"] for h in (1, 2, 3)) > 0.3, res["states"]
    assert res["states"]["final"]["max_row_rel"] <= tol, res["states"]


@in_env
@pytest.mark.parametrize("args, words", [
    (["--cpu", "--model", "x"], "exactly one of --cpu and --model"),
    (["--cpu"], "--out is required"),
    (["--cpu", "--methods", "ours,nope"], "unknown"),
    (["--cpu", "--budget-s", "0"], "--budget-s must be positive"),
    (["--cpu", "--warm-s", "-1"], "--warm-s must be 0 or more"),
    (["--cpu", "--repeats", "0"], "--repeats must be >= 1"),
    (["--cpu", "--extract-processes", "1"], "--extract-processes must be >= 2"),
    (["--cpu", "--dump-dir", "/dev/shm"], "--dump-dir is for the GPU profile"),
    (["--model", "m", "--dump-dir", "/nonexistent-dump-dir"], "--dump-dir /nonexistent-dump-dir: not an existing directory"),
    (["--cpu", "--disk-dir", "/tmp"], "--disk-dir is for the GPU profile"),
    (["--model", "m", "--disk-dir", "/nonexistent-disk-dir"], "--disk-dir /nonexistent-disk-dir: not an existing directory"),
    (["--cpu", "--dump-writers", "0"], "--dump-writers 0: not between 1 and 64"),
    (["--cpu", "--dump-writers", "65"], "--dump-writers 65: not between 1 and 64"),
    (["--cpu", "--dump-gil-switch-ms", "0"], "--dump-gil-switch-ms 0: not above 0 and at most 100"),
    (["--cpu", "--dump-gil-switch-ms", "101"], "--dump-gil-switch-ms 101: not above 0 and at most 100"),
    (["--cpu", "--mooncake-site", "/tmp"], "--mooncake-site /tmp holds no mooncake/mooncake_master"),
    (["--model", "m", "--methods", "limit,ours-mooncake"], "ours-mooncake on the GPU needs --mooncake-site"),
])
def test_usage_errors_one_line_nothing_written(tmp_path, args, words):
    out = tmp_path / "p.json"
    full = args + (["--out", str(out)] if "--out is required" not in words else [])
    p = peers(*full, timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], p.stderr
    assert words in lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())
    p = peers("--cpu", "--out", tmp_path / "nodir" / "p.json", timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and not (tmp_path / "nodir").exists()


def test_the_gpu_call_script_refuses_usage_errors_in_one_line(tmp_path):
    """benchmarks/peers_gpu.sh (one GPU call of issue 45's runs): without METHODS and BUDGET_S, or without an
    existing $OUT, one ``error: ...; fix: ...`` line, exit 2, before it unpacks or starts anything."""
    script = REPO / "benchmarks" / "peers_gpu.sh"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for args, out, words in ((["limit"], str(tmp_path), "METHODS and BUDGET_S are required"),
                             (["limit,ours-processes", "300"], None, "OUT is not an existing directory"),
                             (["limit,ours-processes", "300"], str(tmp_path / "absent"), "OUT is not an existing")):
        p = subprocess.run(["bash", str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env=dict(env, **({"OUT": out} if out else {})))
        lines = p.stderr.splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "; fix: " in lines[0], p
        assert words in lines[0] and not p.stdout, p
    assert sorted(x.name for x in tmp_path.iterdir()) == []  # nothing unpacked, nothing written


@in_env
def test_budget_spent_reports_not_measured(tmp_path):
    out = tmp_path / "p.json"
    p = peers("--cpu", "--out", out, "--budget-s", "1", "--methods", "hf,ours", "--conversations", "6", timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"hf", "ours"}
    for r in res["methods"].values():
        assert r["status"] == "not measured" and "--budget-s" in r["reason"] and "tokens_per_s" not in r
    assert res["summary"]["tokens_per_s"] == {}
    # no limit among the methods: no ratio, said so, nothing estimated
    r = res["ratio_to_limit"]
    assert r["computed"] is False and "limit was not among the methods run" in r["why"] and "methods" not in r
    assert res["summary"]["ratio_to_limit"] == r["why"]
    assert "summary: no ratio to the limit: limit was not among the methods run" in p.stderr


@in_env
def test_a_pass_of_ours_that_lost_samples_fails_the_method(tmp_path):
    """A pass of ours whose server failed writes, or whose extract gave up on conversations, is a
    failure (exit 1), never a figure: the verdict on the recorded H100 runs of 2026-12-07. Run 21's
    ``ours-mooncake`` (the store full of the warm-up's objects: the server failed its puts, extract its
    conversations, no sample came) fails; run 20's ``ours-processes`` (1,000 samples a pass) passes."""
    spec = importlib.util.spec_from_file_location("peers_mod", PEERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = REPO / "docs" / "results"
    bad = json.loads((res / "peers-h100-run21.json").read_text())["methods"]["ours-mooncake"]["repetitions"]
    good = json.loads((res / "peers-h100-run20.json").read_text())["methods"]["ours-processes"]["repetitions"]
    log = res / "peers-h100-run21-ours-mooncake-extract-rep3.log.gz"
    xlog = tmp_path / "extract-rep3.log"  # the recorded log, as extract left it
    xlog.write_bytes(gzip.decompress(log.read_bytes()))
    losses = mod.pass_losses(bad[1]["dump_counts"], bad[2]["dump_counts"], xlog)  # repetition 3's own
    assert losses["failed"] == 139 and losses["conversations_failed"] > 0, losses
    why = mod.loss_verdict(losses, bad[2]["samples_done"], bad[2]["work_s"], cut=True)
    assert "the server failed 139 write(s)" in why and "extract failed" in why and "no sample" in why, why
    for a, b in zip(good, good[1:]):  # each pass's counts over the one before: nothing lost
        clean = mod.pass_losses(a["dump_counts"], b["dump_counts"], REPO / "no-such.log")
        assert clean == {"failed": 0, "dropped": 0, "conversations_failed": 0}, clean
        assert mod.loss_verdict(clean, b["samples_done"], b["work_s"], cut=False) is None
    # a dropped chunked request is a loss unless extract was stopped with it in flight; unreadable counts are
    assert "dropped 2" in mod.loss_verdict({"failed": 0, "dropped": 2}, 10, 5.0, cut=False)
    assert mod.loss_verdict({"failed": 0, "dropped": 2}, 10, 5.0, cut=True) is None
    assert "could not be read" in mod.loss_verdict({"failed": None, "dropped": None}, 10, 5.0, cut=False)


@in_env
def test_json_rows_refuse_an_answer_short_of_the_prompt():
    """Upstream's ``return_hidden_states`` gives one row per token it prefilled: with the radix cache on,
    a prompt whose first token was cached comes back a row short (the H200 run of 2026-12-04: 218 rows
    for a 219-token prompt). Such an answer must be refused with the cause, never padded or shifted."""
    spec = importlib.util.spec_from_file_location("peers_mod", PEERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [[float(t), 0.5] for t in range(5)]
    assert mod._rows({"hidden_states": [rows, [9.0, 9.0]]}, 5) == rows  # prefill rows, then the decode row
    assert mod._rows({"hidden_states": [rows + [[7.0, 7.0]]]}, 5) == rows
    with pytest.raises(ValueError, match=r"4 rows for a 5-token prompt.*--disable-radix-cache"):
        mod._rows({"hidden_states": [rows[1:], [9.0, 9.0]]}, 5)
    with pytest.raises(ValueError, match="no hidden_states"):
        mod._rows({}, 5)


@in_env
def test_warm_up_ends_only_on_rates_that_settled():
    """The warm-up's stop rule: the last ``WARM_STABLE`` rounds each within 10% of the round before. The
    H100 limit server of 2026-12-06 stopped its one-wave rounds at 51k then 54k tokens/s and timed 36k,
    62k and 90k after: a rule that ends on one lucky pair of rounds would have ended there too."""
    spec = importlib.util.spec_from_file_location("peers_mod", PEERS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.WARM_STABLE == 2
    h100 = [36824, 27180, 15346, 50188, 12983, 52895, 15846, 51236, 54263]  # docs/results/peers-h100-limit-run3.log
    assert not any(mod.steady(h100[:k]) for k in range(len(h100) + 1))
    assert mod.steady(h100 + [57000])  # 51k, 54k, 57k: each within 10% of the one before
    assert not mod.steady([100, 105])  # one pair is not enough
    assert mod.steady([100, 105, 110]) and not mod.steady([100, 105, 120])
    assert not mod.steady([100, 89, 90]) and mod.steady([100, 91, 90])


def _descendants(pid: int) -> set:
    """Every live process whose parent chain reaches ``pid`` (the servers run in their own sessions, so
    their process groups are not the run's)."""
    parent = {c: pp for c, (_, pp) in process_table().items()}
    out, grew = set(), True
    while grew:
        new = {c for c, pp in parent.items() if (pp == pid or pp in out) and c not in out}
        out |= new
        grew = bool(new)
    return out


def _alive(pid: int) -> bool:
    return process_table().get(pid, ("Z",))[0] != "Z"


@in_env
def test_a_signalled_run_stops_every_server_it_started(tmp_path):
    """A run stopped by SIGTERM (a container's stop, ``timeout``) stops the server and the workers it
    started and exits 128 + the signal: killed by the default action, it left its SGLang server running
    with its port and memory taken (seen in session 15). The signal goes once the limit's server
    answers; every process below the run then must end within the stop's grace. (SIGHUP and SIGINT take
    the same handler; one server start is this test's cost.)"""
    import signal
    import time

    err = tmp_path / "peers.err"
    with open(err, "w") as fh:
        p = subprocess.Popen(["nice", "-n", "5", sys.executable, str(PEERS), "--cpu", "--methods", "limit",
                              "--conversations", "6", "--out", str(tmp_path / "p.json"), "--work",
                              str(tmp_path / "work")], cwd=REPO, stdout=subprocess.DEVNULL, stderr=fh)
    below: set = set()
    try:
        deadline = time.monotonic() + 600
        while "dump-off server ready" not in err.read_text():
            assert p.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)
        below = _descendants(p.pid)
        assert below, "no server process under the run"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
        text = err.read_text()
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert "stopped by SIGTERM" in text and "Traceback" not in text, text[-3000:]
        deadline = time.monotonic() + 30  # the grandchildren's own parents reap them
        while any(_alive(q) for q in below) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [q for q in below if _alive(q)], "left running: %s" % [q for q in below if _alive(q)]
        res = json.loads((tmp_path / "p.json").read_text())  # a run that did not end says so
        assert res["partial"] is True and res["stopped_by"] == "SIGTERM" and res["methods"] == {}, res
    finally:
        left = below | _descendants(p.pid)
        if p.poll() is None:
            p.kill()
            p.wait()
        for q in left:
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
