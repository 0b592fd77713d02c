"""The capture as an SGLang plugin (issue 47): the eaglepatch-capture wheel, its refusals, and
parity with the patch series, all with the real sglang code of the cached releases.

- the wheel (eaglepatch.plugin.build_wheel / install, tools/export.py --plugin): it builds, pip
  installs it with --target, it carries the entry point, and it writes nothing under sglang/;
- refusals, each in a real process through sglang's own plugin loader (load_plugins): a release
  the plugin does not cover, a patched tree with the plugin, and register() on 0.5.9 (which has
  no loader); each is SystemExit(2) with one line;
- parity, bit for bit: for each release the plugin covers, the same requests through a real
  sglang.Engine on CPU on the series-patched tree (conftest's series_smoke: the engine group
  tests/test_functional.py runs anyway) and on the UNMODIFIED release with the plugin installed
  (one engine-group run per release: checks b and c, DeepSeek-V3 and the Kimi-K2.5 wrapper under
  chunked prefill) give the same dump files: the same names, every tensor's bytes equal, the
  same metadata but for the fields that name the run itself (RUN_FIELDS).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from conftest import one_line_error, run_tool  # noqa: E402
from eaglepatch import cpuenv, overlay, plugin  # noqa: E402
from eaglepatch.fetch import unpacked_release  # noqa: E402
from eaglepatch.series import available_series  # noqa: E402
from eaglepatch.plugin_check import dump_differences  # noqa: E402
from eaglepatch.smoke import run_smoke, stubs_for, worker_env  # noqa: E402

SERIES = available_series()
COVERED = plugin.plugin_releases()
# dump metadata that names the run, not the data: the launch's random id and the dump directory
DUMPS = ("dump-deepseek", "dump-kimi")  # check b's and check c's files (engine group work dir)
PREFIX = "error: eaglepatch-capture plugin: "


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    return plugin.build_wheel(tmp_path_factory.mktemp("plugin-wheel"))


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    return plugin.install(wheel, tmp_path_factory.mktemp("plugin-target"))


# ---- the wheel --------------------------------------------------------------------------------

def test_wheel_carries_the_package_and_entry_point_and_nothing_under_sglang(wheel, installed):
    import importlib.metadata as md

    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.split("/")[0] == "sglang" or n.startswith("sglang-")], names
    assert {n.split("/")[0] for n in names} == {plugin.TOP, f"{plugin.TOP}-0.1.0.dist-info"}, names
    # pip --target installed exactly that: our package and its dist-info
    assert sorted(p.name for p in installed.iterdir()) == [plugin.TOP, f"{plugin.TOP}-0.1.0.dist-info"]
    (dist,) = list(md.distributions(path=[str(installed)]))
    assert dist.metadata["Name"] == plugin.DIST
    eps = [(ep.group, ep.name, ep.value) for ep in dist.entry_points]
    assert eps == [("sglang.srt.plugins", "eaglepatch_capture", "eaglepatch_capture.plugin:register")]
    # the package: the overlay's files as they are (one source), release.py for plugin delivery,
    # and sglang-plugin/'s modules
    pkg = installed / plugin.TOP
    got = {p.name: p.read_bytes() for p in pkg.iterdir() if p.is_file()}
    want = {rel.rsplit("/", 1)[1]: data for rel, data in overlay.source_files().items()}
    want.update({p.name: p.read_bytes() for p in plugin.PLUGIN_DIR.glob("*.py")})
    want["release.py"] = plugin.plugin_release_py()
    assert got == want
    release = (pkg / "release.py").read_text()
    assert 'DELIVERY = "plugin"' in release
    for rel in COVERED:  # each covered release's facts come from its series' manifest
        m = json.loads((SERIES[rel] / "manifest.json").read_text())
        assert f"'{rel}': ('{m['series_version']}', " in release
    # the series' release.py says "series"
    for rel, d in SERIES.items():
        gen = overlay.generate_for(*overlay.series_params(json.loads((d / "manifest.json").read_text()), d))
        assert b'\nDELIVERY = "series"\n' in gen.files[overlay.RELEASE_FILE], rel


def test_plugin_covers_exactly_the_releases_with_a_plugin_loader():
    """targets.py's releases (the plugin's table) are the series releases whose sglang has
    srt/plugins (load_plugins + HookRegistry); the others are refused by name."""
    with_loader = [r for r in SERIES
                   if (unpacked_release(r, quiet=True) / "sglang" / "srt" / "plugins" / "hook_registry.py").is_file()]
    assert sorted(COVERED) == sorted(with_loader) and COVERED


def test_export_plugin_writes_one_wheel_or_nothing(tmp_path):
    out = tmp_path / "dist"
    r = run_tool("export", "--plugin", out)
    assert r.returncode == 0, r.stderr
    (whl,) = sorted(out.iterdir())
    assert whl.name == f"{plugin.TOP}-0.1.0-py3-none-any.whl" and r.stdout.strip() == f"built {whl}"
    # bad input: one line, exit 2, nothing written
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    for args in (["--plugin", afile], ["--plugin", tmp_path / "d2", "--overlay"],
                 ["--plugin", tmp_path / "d3", "--check"]):
        r = run_tool("export", *args)
        assert r.returncode == 2, r.stderr
        one_line_error(r)
        assert "Traceback" not in r.stderr
    assert afile.read_bytes() == b"x" and not (tmp_path / "d2").exists() and not (tmp_path / "d3").exists()


# ---- refusals, in real processes ----------------------------------------------------------------

LOAD = ("import json\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "print('PATCHED', json.dumps(sorted(HookRegistry._patched)))\n")


def _run(release: str, pythonpath: list, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in the CPU environment of ``release`` with ``pythonpath`` (+ the import stubs)."""
    req = cpuenv.requirements_for(release)
    py = cpuenv.ensure_env(req)
    env = worker_env(pythonpath[0], stubs_for(req, tmp_path), [Path(p) for p in pythonpath[1:]])
    env.pop("SGLANG_PLUGINS", None)
    return subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)


def _refused(p: subprocess.CompletedProcess) -> str:
    """SystemExit(2) with one line, nothing else on stderr from us, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "PATCHED" not in p.stdout, p.stderr[-3000:]
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith(PREFIX)]
    assert len(ours) == 1 and "; " in ours[0], p.stderr[-3000:]
    assert p.stderr.rstrip().splitlines()[-1] == ours[0]
    return ours[0]


def _relabelled(release_dir: Path, version: str, dest: Path) -> Path:
    """A copy of an unpacked release whose version is ``version``: its sglang/ (linked, never
    written) with its dist-info copied under the new version."""
    dest.mkdir()
    (dest / "sglang").symlink_to(release_dir / "sglang", target_is_directory=True)
    (src_info,) = list(release_dir.glob("sglang-*.dist-info"))
    info = dest / f"sglang-{version}.dist-info"
    shutil.copytree(src_info, info)
    meta = (info / "METADATA").read_text()
    (info / "METADATA").write_text(meta.replace(f"\nVersion: {src_info.name[len('sglang-'):-len('.dist-info')]}\n",
                                                f"\nVersion: {version}\n", 1))
    return dest


def test_load_plugins_applies_the_hooks_on_the_unmodified_release(installed, tmp_path):
    """The control for the refusals: sglang's loader runs register() and applies our three hooks
    (one release: ~40 s of imports; the parity runs load the plugin on every covered release)."""
    release = COVERED[-1]
    p = _run(release, [unpacked_release(release, quiet=True), installed], LOAD, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    patched = [ln for ln in p.stdout.splitlines() if ln.startswith("PATCHED ")]
    assert patched, p.stdout
    assert set(json.loads(patched[0][len("PATCHED "):])) == {
        "sglang.srt.server_args.ServerArgs.check_server_args",
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"}


def test_unknown_release_is_refused_through_the_loader(installed, tmp_path):
    base = COVERED[-1]
    pp = _relabelled(unpacked_release(base, quiet=True), "0.5.99", tmp_path / "pp")
    line = _refused(_run(base, [pp, installed], LOAD, tmp_path))
    assert "sglang 0.5.99 is not a release this plugin covers" in line
    assert all(r in line for r in COVERED) and "patches/sglang-" in line and "tools/apply.py" in line


def test_patched_tree_with_the_plugin_is_refused_through_the_loader(installed, series_smoke, tmp_path):
    release = COVERED[0]
    pp = series_smoke.tree(release)  # the series-patched tree tests/test_functional.py runs
    line = _refused(_run(release, [pp, installed], LOAD, tmp_path))
    assert "already patched" in line and "sglang.srt.eagle3_capture" in line and "pip uninstall eaglepatch-capture" in line


def test_register_on_0_5_9_names_its_series(installed, tmp_path):
    """0.5.9 has no plugin loader (nothing would call register()); called directly, it refuses."""
    rel = "0.5.9"
    assert not (unpacked_release(rel, quiet=True) / "sglang" / "srt" / "plugins").exists()
    line = _refused(_run(rel, [unpacked_release(rel, quiet=True), installed],
                         "from eaglepatch_capture.plugin import register\nregister()\nprint('PATCHED')", tmp_path))
    assert "sglang 0.5.9 is not a release this plugin covers" in line
    assert "patches/sglang-0.5.9 with tools/apply.py" in line


# ---- parity with the series, bit for bit ----------------------------------------------------------

@pytest.fixture(scope="session")
def plugin_engine_runs(installed, tmp_path_factory):
    """release -> (results, work dir) of the engine group's checks b and c on the unmodified
    release with the plugin, once per release per session."""
    runs = {}

    def get(release):
        if release not in runs:
            work = tmp_path_factory.mktemp("plugin-engine-" + release)
            runs[release] = (run_smoke("functional", unpacked_release(release, quiet=True), SERIES[release],
                                       checks=["engine:bc"], work_dir=work, plugin=installed), work)
        return runs[release]

    return get


@pytest.mark.parametrize("release", COVERED)
def test_plugin_dump_equals_series_dump_bit_for_bit(release, series_smoke, plugin_engine_runs, plugin_cli_smoke):
    """Checks b (DeepSeek-V3) and c (Kimi-K2.5 wrapper, chunked prefill): the plugin's run passes
    them (== the HF reference), and its files equal the series run's byte for byte in every tensor.
    The newest release's plugin run is tools/verify.py --plugin --smoke functional's (conftest's
    plugin_cli_smoke: the same engine checks through the wheel the CLI builds), the others' a run
    of checks b and c here."""
    if release == plugin_cli_smoke.release:
        assert plugin_cli_smoke.proc.returncode == 0, plugin_cli_smoke.proc.stderr[-3000:]
        presults = [SimpleNamespace(**x) for x in json.loads(plugin_cli_smoke.json.read_text())["smoke"]]
        pwork = plugin_cli_smoke.work / "smoke"
    else:
        presults, pwork = plugin_engine_runs(release)
    sresults, swork = series_smoke(release, "engine")
    for results, who in ((presults, "plugin"), (sresults, "series")):
        for letter in "bc":
            (r,) = [r for r in results if r.name.startswith(letter + ".")]
            assert r.passed, f"{who} {r.name}: {r.figure}\n{r.detail}"
    for sub in DUMPS:
        problems = dump_differences(swork / "engine" / sub, pwork / "engine" / sub)
        assert not problems, f"{release} {sub}: " + "\n".join(problems[:20])


def test_dump_differences_sees_a_shifted_layer_and_a_metadata_change(tmp_path):
    """The comparison can fail: a copy of a dump where one layer holds another's states (a shifted
    id), or where one metadata field differs, is reported; RUN_FIELDS alone are not."""
    import torch
    from safetensors.torch import save_file

    def write(d: Path, tensors: dict, meta: dict):
        d.mkdir()
        save_file(tensors, str(d / "k.safetensors"), metadata=dict(meta, dump_dirs=json.dumps([str(d)])))

    t = {"layer.-1": torch.arange(6.0).reshape(2, 3), "layer.1": torch.ones(2, 3), "input_ids": torch.tensor([1, 2])}
    base = {"launch_id": "a", "rid": "r"}
    write(tmp_path / "s", t, base)
    write(tmp_path / "same", t, dict(base, launch_id="b"))
    assert dump_differences(tmp_path / "s", tmp_path / "same") == []
    write(tmp_path / "shift", dict(t, **{"layer.1": t["layer.-1"].clone()}), base)
    assert dump_differences(tmp_path / "s", tmp_path / "shift") == [
        "k.safetensors: tensor layer.1 differs (torch.float32 (2, 3) vs torch.float32 (2, 3))"]
    write(tmp_path / "meta", t, dict(base, rid="other"))
    assert dump_differences(tmp_path / "s", tmp_path / "meta") == [
        "k.safetensors: metadata rid: series 'r', plugin 'other'"]
    # one bit of one float
    flipped = t["layer.1"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    write(tmp_path / "bit", dict(t, **{"layer.1": flipped}), base)
    assert len(dump_differences(tmp_path / "s", tmp_path / "bit")) == 1


# ---- tools/gpucheck.py --plugin (the GPU parity run's options; the engines run on the GPU) ------------

def _no_trace(r, *paths) -> str:
    """Exit 2, one line, nothing written."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert not any(Path(p).exists() for p in paths), [p for p in paths if Path(p).exists()]
    return one_line_error(r)


def test_gpucheck_plugin_arguments_are_refused_with_one_line(wheel, installed, tmp_path):
    site = unpacked_release(COVERED[-1], quiet=True)
    work, out = tmp_path / "w", tmp_path / "r.json"
    base = ["--site", site, "--work", work, "--out", out, "--checks", "f"]
    junk = tmp_path / "junk.whl"
    junk.write_text("not a zip")
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("other-0.1.dist-info/entry_points.txt", "[sglang.srt.plugins]\nother = other:register\n")
    cases = [
        (["--plugin", wheel, "--series", REPO / "patches" / f"sglang-{COVERED[-1]}"], {}, "name a patched tree"),
        (["--plugin", junk], {}, "is not a readable wheel"),
        (["--plugin", other], {}, "is not the eaglepatch-capture wheel"),
        (["--plugin", wheel], {"PYTHONPATH": str(installed)}, "the plugin is already importable here"),
    ]
    for extra, env, want in cases:
        line = _no_trace(run_tool("gpucheck", *base, *extra, env=env), work, out)
        assert want in line, (extra, line)
    line = _no_trace(run_tool("gpucheck", "--work", work, "--out", out, "--plugin", wheel), work, out)
    assert "--plugin needs --site" in line
    # the control: the real wheel with --site passes the plugin's checks and stops at the next one (no CUDA here)
    line = _no_trace(run_tool("gpucheck", *base, "--plugin", wheel), work, out)
    assert "CUDA is not available" in line


def test_gpucheck_plugin_reaches_the_engines_under_test_only(wheel, tmp_path):
    """--plugin: the engines under test find the plugin's entry point and SGLANG_PLUGINS selects it;
    the unpatched engines (checks e, f, h) find no such entry point. What the engines then load is
    judged on the GPU: check f's and h's verdicts require the spy's records to name the plugin's
    package in the engine under test and none in the unpatched one (``_overlay_seen``)."""
    from eaglepatch.gpucheck.check import Options, patched_parent, worker_env as gpu_env

    site = unpacked_release(COVERED[-1], quiet=True)
    opts = Options(out=tmp_path / "r.json", work=tmp_path / "w", site=site, plugin=wheel, say=lambda m: None)
    pp = patched_parent(opts)
    code = ("import json, os\nfrom importlib.metadata import entry_points\n"
            "print(json.dumps([sorted(e.name for e in entry_points(group='sglang.srt.plugins')), "
            "os.environ.get('SGLANG_PLUGINS')]))")
    seen = {}
    for role, parent in (("under test", pp), ("unpatched", site)):
        env = gpu_env(parent, site)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        seen[role] = json.loads(p.stdout)
    assert "eaglepatch_capture" in seen["under test"][0] and seen["under test"][1] == "eaglepatch_capture", seen
    assert "eaglepatch_capture" not in seen["unpatched"][0], seen
    assert not (pp / "sglang").exists()  # sglang itself comes from --site, unmodified


def test_gpucheck_verdicts_require_the_capture_package_they_compare(wheel, tmp_path):
    """A patched-vs-unpatched comparison proves nothing when the capture never loaded: the engine under
    test must record the plugin's (or the series') package, the unpatched one none."""
    from eaglepatch.gpucheck.check import Options, State, _overlay_seen

    for plugin_opt, want in ((wheel, "eaglepatch_capture:plugin"), (None, "sglang.srt.eagle3_capture:series")):
        st = State(Options(out=tmp_path / "r.json", work=tmp_path, plugin=plugin_opt), 0.0)
        assert _overlay_seen(st, [{"overlay": want}] * 3, True)[0]
        assert _overlay_seen(st, [{"overlay": None}] * 3, False)[0]
        assert not _overlay_seen(st, [{"overlay": None}] * 3, True)[0]  # the capture did not load
        assert not _overlay_seen(st, [{"overlay": want}], False)[0]  # the "unpatched" engine had it
        assert not _overlay_seen(st, [{"overlay": want}, {"overlay": None}], True)[0]  # one process without it
        assert not _overlay_seen(st, [], True)[0]  # nothing recorded
    st = State(Options(out=tmp_path / "r.json", work=tmp_path, plugin=wheel), 0.0)
    ok, fig = _overlay_seen(st, [{"overlay": "sglang.srt.eagle3_capture:series"}], True)
    assert not ok and "want eaglepatch_capture:plugin" in fig  # a patched tree where the plugin was asked for
