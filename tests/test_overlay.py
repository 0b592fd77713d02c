"""sglang-overlay/ is the one source of the package every series adds to SGLang.

- every committed series' new-file patch and manifest entries are byte-identical to what the
  overlay generates (the CI gate), and the gate fails on a one-byte difference;
- the generated patch is what `git diff` of a branch gives (tools/export.py's format);
- the overlay's release.py holds the pinned series' values, other series get their own;
- the package imports without SGLang.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import PINNED_RELEASE  # noqa: E402
from eaglepatch import overlay  # noqa: E402
from eaglepatch.series import available_series, load_manifest, load_series  # noqa: E402

from conftest import run_tool  # noqa: E402


def test_every_series_matches_the_overlay():
    r = run_tool("export", "--overlay", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(available_series()) >= 2
    for d in available_series().values():
        assert f"{d}: matches sglang-overlay/" in r.stdout


@pytest.mark.parametrize("damage", ["patch byte", "manifest hash", "overlay edit"])
def test_the_gate_fails_on_any_difference(tmp_path, damage):
    series = tmp_path / "patches" / "sglang-0.5.9"
    shutil.copytree(available_series()["0.5.9"], series)
    env = {}
    if damage == "patch byte":
        p = next(series.glob("0001-*.patch"))
        data = bytearray(p.read_bytes())
        i = data.index(b"def set_eagle3_layers")
        data[i + 4] ^= 0x20
        p.write_bytes(bytes(data))
    elif damage == "manifest hash":
        m = json.loads((series / "manifest.json").read_text())
        m["patches"][0]["sha256"] = "0" * 64
        (series / "manifest.json").write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    else:
        ov = tmp_path / "overlay"
        shutil.copytree(overlay.overlay_root(), ov, ignore=shutil.ignore_patterns("__pycache__"))
        f = ov / overlay.PACKAGE_DIR / "dump.py"
        f.write_text(f.read_text() + "\n# one more line\n")
        env["EAGLEPATCH_OVERLAY"] = str(ov)
    before = {p.name: p.read_bytes() for p in series.iterdir()}
    r = run_tool("export", "--overlay", "--check", "--out", series, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "differ from sglang-overlay/" in r.stdout
    assert {p.name: p.read_bytes() for p in series.iterdir()} == before  # --check writes nothing
    # regenerating repairs it; a second check is clean
    assert run_tool("export", "--overlay", "--out", series, env=env).returncode == 0
    assert run_tool("export", "--overlay", "--check", "--out", series, env=env).returncode == 0


@pytest.mark.parametrize("stray", ["dump.py.save", "dump (copy).py", "dump-v2.py", "class.py", "notes.txt",
                                   "copy of eagle3/dump.py", "__pycache__.py.save"])
def test_export_packs_only_the_packages_modules(tmp_path, stray):
    """Only modules (NAME.py, NAME a valid module name, in folders with valid package names) and
    declared data go into the 0001 patch: nano's `dump.py.save`, a file manager's `dump (copy).py`
    and any other file there is refused in one line, exit 2, with the series left as it was
    (export --overlay and --overlay --check alike)."""
    from conftest import one_line_error
    series = tmp_path / "patches" / "sglang-0.5.9"
    shutil.copytree(available_series()["0.5.9"], series)
    ov = tmp_path / "overlay"
    shutil.copytree(overlay.overlay_root(), ov, ignore=shutil.ignore_patterns("__pycache__"))
    assert run_tool("export", "--overlay", "--out", series, env={"EAGLEPATCH_OVERLAY": str(ov)}).returncode == 0
    f = ov / overlay.PACKAGE_DIR / stray
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes((ov / overlay.PACKAGE_DIR / "dump.py").read_bytes())
    before = {p.name: p.read_bytes() for p in series.iterdir()}
    for args in ([], ["--check"]):
        r = run_tool("export", "--overlay", *args, "--out", series, env={"EAGLEPATCH_OVERLAY": str(ov)})
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        err = one_line_error(r)
        assert str(f) in err and "nothing was written" in err, err
        assert {p.name: p.read_bytes() for p in series.iterdir()} == before


def test_declared_data_is_packed(tmp_path, monkeypatch):
    ov = tmp_path / "overlay"
    shutil.copytree(overlay.overlay_root(), ov, ignore=shutil.ignore_patterns("__pycache__"))
    (ov / overlay.PACKAGE_DIR / "layers.json").write_text("{}\n")
    with pytest.raises(overlay.UsageError, match="layers.json is not a module of the package"):
        overlay.source_files(ov)
    monkeypatch.setattr(overlay, "DATA", (f"{overlay.PACKAGE_DIR}/*.json",))
    assert overlay.source_files(ov)[f"{overlay.PACKAGE_DIR}/layers.json"] == b"{}\n"


def test_generated_patch_is_what_git_writes_for_a_branch(tmp_path):
    """The new-file patch equals `git diff --cached` of a real repository holding the files."""
    gen = overlay.generate_for("0.5.9", "0.5.9-9")
    repo = tmp_path / "r"
    repo.mkdir()
    env = {"GIT_CEILING_DIRECTORIES": str(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}  # no config can change the diff
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env=env)
    for rel, data in gen.files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    from eaglepatch.series import DIFF_ARGS, SEPARATOR, parse_patch

    body = subprocess.run(["git", "diff", "--cached", *DIFF_ARGS], cwd=repo, check=True, env=env,
                          capture_output=True).stdout
    assert gen.data == overlay.header().encode() + SEPARATOR + body
    patch = parse_patch(gen.data, gen.name)
    assert sorted(fp.path for fp in patch.files) == sorted(gen.files)
    assert all(fp.is_new for fp in patch.files)


def test_release_file_is_the_only_per_release_difference():
    pinned = load_manifest(available_series()[PINNED_RELEASE] / "manifest.json")
    src = overlay.source_files()
    gen = overlay.generate_for(*overlay.series_params(pinned, Path("pinned")))
    assert gen.files == src, "the overlay's release.py must hold the pinned series' values"
    for rel, d in available_series().items():
        m = load_manifest(d / "manifest.json")
        files = overlay.release_files(*overlay.series_params(m, d))
        differ = sorted(k for k in files if files[k] != src[k])
        assert differ == ([] if rel == PINNED_RELEASE else [overlay.RELEASE_FILE]), (rel, differ)
        text = files[overlay.RELEASE_FILE].decode()
        assert f'SERIES_RELEASE = "{rel}"' in text and f'SERIES_VERSION = "{m["series_version"]}"' in text
        s = load_series(d)
        assert s.patches[0].name == overlay.patch_name(overlay.header())


def test_release_constants_must_be_there_once(tmp_path):
    from eaglepatch.errors import UsageError

    with pytest.raises(UsageError, match="SERIES_VERSION"):
        overlay.render_release(b'SERIES_RELEASE = "x"\nUPSTREAM_EAGLE_ID_MAPPING = "plus_one"\n', "1", "1-1", "plus_one")


def test_the_package_imports_without_sglang():
    pkg = overlay.import_package()
    assert "sglang" not in sys.modules
    assert pkg.settings.SERIES_RELEASE == PINNED_RELEASE
    assert pkg.capture_indices([-1, 2], 4, "x") == [0, 3] and pkg.settings.layer_output_id(3) == 2
