"""Upstream tree detection and the release fetcher, on the real sglang 0.5.9 release."""

import shutil
import subprocess

import pytest
from conftest import BASIC, copy_installed, one_line_error, run_tool

from eaglepatch.errors import UsageError
from eaglepatch.fetch import cache_root, fetch_release
from eaglepatch.series import load_series
from eaglepatch.tree import UpstreamTree


def test_git_checkout_is_laid_out_like_an_upstream_clone(checkout_059):
    assert (checkout_059 / "python" / "sglang" / "srt" / "models" / "deepseek_v2.py").is_file()
    assert not (checkout_059 / "python" / "sglang" / "_version.py").exists()
    assert not list(checkout_059.rglob("*.dist-info"))
    log = subprocess.run(["git", "log", "--format=%H"], cwd=checkout_059, capture_output=True, text=True)
    assert len(log.stdout.split()) == 1
    tag = subprocess.run(["git", "describe", "--tags", "--exact-match"], cwd=checkout_059,
                         capture_output=True, text=True)
    assert tag.stdout.strip() == "v0.5.9"
    t = UpstreamTree.open(checkout_059)
    assert (t.kind, t.release, t.release_source) == ("git", "0.5.9", "git tag")
    assert t.package_parent == checkout_059 / "python"


def test_installed_release_from_version_py_then_dist_info(installed_059):
    t = UpstreamTree.open(installed_059)
    assert (t.kind, t.release, t.release_source) == ("installed", "0.5.9", "_version.py")
    assert t.package_parent == installed_059
    (installed_059 / "sglang" / "_version.py").unlink()
    t = UpstreamTree.open(installed_059)
    assert (t.release, t.release_source) == ("0.5.9", "dist-info")
    # the sglang package dir itself is accepted too
    assert UpstreamTree.open(installed_059 / "sglang").package_parent == installed_059


def test_hashes_decide_when_no_version_source(installed_059):
    (installed_059 / "sglang" / "_version.py").unlink()
    for d in installed_059.glob("sglang-*.dist-info"):
        shutil.rmtree(d)
    assert UpstreamTree.open(installed_059).release is None
    s = load_series(BASIC)
    t = UpstreamTree.open(installed_059, {"0.5.9": s})
    assert (t.release, t.release_source) == ("0.5.9", "hashes")
    assert t.state(s) == "upstream"


def test_hashes_override_a_contradicting_version_source(tmp_path, release_0510, release_059):
    """A 0.5.10 tree whose _version.py claims 0.5.9 is not taken for 0.5.9."""
    root = copy_installed(release_0510, tmp_path / "sp", load_series(BASIC).files())
    v = root / "sglang" / "_version.py"
    v.write_text(v.read_text().replace("0.5.10", "0.5.9"))
    s = load_series(BASIC)
    t = UpstreamTree.open(root, {"0.5.9": s})
    assert t.declared_release == "0.5.9"
    assert t.state(s) == "modified"


def test_not_an_sglang_tree_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError):
        UpstreamTree.open(tmp_path)
    r = run_tool("apply", tmp_path)
    assert r.returncode == 2
    assert "not an sglang tree" in one_line_error(r)
    r = run_tool("verify", tmp_path / "missing")
    assert r.returncode == 2
    one_line_error(r)


def test_fetch_is_cached(release_059):
    whl = fetch_release("0.5.9", quiet=True)
    assert whl.parent == cache_root() / "0.5.9" and whl.name.startswith("sglang-0.5.9-")
    mtime = whl.stat().st_mtime_ns
    assert fetch_release("0.5.9", quiet=True) == whl
    assert whl.stat().st_mtime_ns == mtime
    assert (release_059 / "sglang" / "_version.py").is_file()
