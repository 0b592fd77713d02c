"""eaglepatch.outputs.build_beside: how the caches are made (the CPU demo's patched sglang tree,
serve.demo.cached_tree; the tiny smoke checkpoints, smoke/_hf.py; the test toys' inputs,
tests/acceptance_toy.made_once). A directory is made in a temporary directory beside it and renamed
in when whole; where another run renamed its own in first, theirs is kept; the temporary directory
is never left behind, also when the build fails. Shown with real processes racing for one
destination, a real full disk, the smoke checkpoints' worker run by file path as the smoke runs it,
and the demo tree built in a cache of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_txn_faults import mounts  # noqa: F401  (fixture: tmpfs mounts, unmounted after the test)

from eaglepatch.outputs import build_beside

SMOKE = REPO / "src" / "eaglepatch" / "smoke"


def _tree(d: Path) -> list:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))


def test_made_whole_beside_then_renamed_in(tmp_path):
    dest = tmp_path / "cache" / "key"  # the parent is created
    seen = {}

    def make(tmp: Path) -> None:
        seen.update(tmp=tmp, dest_existed=dest.exists())
        (tmp / "a").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("2")

    assert build_beside(dest, make) is True
    assert seen["tmp"].parent == dest.parent and seen["tmp"].name.startswith(".build-"), seen
    assert not seen["dest_existed"]  # nobody saw dest before it was whole
    assert _tree(dest) == ["a", "sub", "sub/b"] and (dest / "sub" / "b").read_text() == "2"
    assert list(dest.parent.iterdir()) == [dest]


def test_a_failed_build_raises_and_leaves_nothing(tmp_path):
    dest = tmp_path / "key"

    def make(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        build_beside(dest, make)
    assert list(tmp_path.iterdir()) == []


RACER = """
import sys, time
from pathlib import Path
from eaglepatch.outputs import build_beside

dest, sync, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def make(tmp):
    for i in range(20):
        (tmp / ("f%d" % i)).write_text(me)
    (sync / ("ready-" + me)).touch()
    while not (sync / "go").exists():  # every racer's build is whole before any renames
        time.sleep(0.01)

print(me, "renamed" if build_beside(dest, make, prefix=".race-") else "kept", flush=True)
"""


def test_the_first_rename_wins_and_the_others_keep_it(tmp_path):
    """Three processes build the same destination at once: exactly one renames its directory in,
    the others keep it (one builder's files, all of them), and no temporary directory stays."""
    dest, sync = tmp_path / "cache" / "key", tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(dest), str(sync), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        t0 = time.monotonic()
        while len(list(sync.glob("ready-*"))) < 3:
            assert time.monotonic() - t0 < 120 and all(p.poll() is None for p in procs), \
                [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.05)
        (sync / "go").touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    said = dict(o.split() for o, _ in outs)
    winners = [me for me, what in said.items() if what == "renamed"]
    assert len(winners) == 1 and sorted(said.values()) == ["kept", "kept", "renamed"], said
    assert _tree(dest) == sorted("f%d" % i for i in range(20))
    assert {f.read_text() for f in dest.iterdir()} == set(winners)
    assert list(dest.parent.iterdir()) == [dest]


def test_a_smoke_checkpoint_on_a_full_disk_leaves_nothing(tmp_path, mounts):  # noqa: F811
    """smoke/_hf.py's checkpoint (17 MB) on a 1 MiB tmpfs: the save fails (ENOSPC) and the half
    written temporary directory goes with it (it stayed beside the checkpoint before)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(SMOKE))
    import _hf

    disk = mounts(tmp_path / "disk", "size=1m")
    with pytest.raises(Exception, match="No space left on device"):
        _hf.build_deepseek(disk / "deepseek_v3-x")
    assert list(disk.iterdir()) == []


def test_the_smoke_checkpoints_worker_builds_by_file_path(tmp_path, monkeypatch):
    """ensure_checkpoints as the smoke runs it: _build.py by file path in the CPU environment, with
    only the work directory and the stubs on its path (no src/), into a cache of its own: both
    checkpoints whole and marked, nothing else beside them."""
    pytest.importorskip("transformers")
    from eaglepatch.smoke import ensure_checkpoints

    monkeypatch.setenv("EAGLEPATCH_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    dirs = ensure_checkpoints(Path(sys.executable), work)
    root = tmp_path / "cache" / "smoke-checkpoints"
    assert sorted(root.iterdir()) == sorted(dirs.values()), _tree(root)
    for d in dirs.values():
        assert (d / ".complete").read_text() == "ok\n" and {"config.json", "model.safetensors"} <= set(_tree(d)), d
    assert json.loads((dirs["deepseek_v3"] / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]


def test_the_demo_tree_is_built_once_in_the_cache(tmp_path, monkeypatch):
    """serve.demo.cached_tree in an empty cache (the release itself comes from the real cache): the
    patched tree, marked with its series, is the only entry under serve/; a second call reuses it."""
    from eaglepatch.fetch import cache_root, unpacked_release
    from eaglepatch.serve.demo import cached_tree

    unpacked_release("0.5.9", quiet=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "releases").symlink_to(cache_root(), target_is_directory=True)
    monkeypatch.setenv("EAGLEPATCH_CACHE", str(tmp_path / "cache"))
    said = []
    tree = cached_tree(say=said.append)
    assert len(said) == 1 and "building sglang 0.5.9" in said[0], said
    assert list((tmp_path / "cache" / "serve").iterdir()) == [tree]
    assert (tree / ".complete").read_text().strip() == str(REPO / "patches" / "sglang-0.5.9")
    assert (tree / "sglang" / "srt" / "eagle3_capture" / "__init__.py").is_file()
    assert cached_tree(say=said.append) == tree and len(said) == 1


def test_the_toys_cache_holds_one_key(tmp_path):
    """tests/acceptance_toy.made_once: made once per key (``make`` not called again while the
    marker is there); a new key's build removes the other keys' directories but not another run's
    build in progress."""
    from acceptance_toy import made_once

    calls = []

    def make(tmp: Path) -> None:
        calls.append(tmp.name)
        (tmp / "done").write_text(str(len(calls)))

    a = made_once(tmp_path, "a", "done", make)
    assert made_once(tmp_path, "a", "done", make) == a and len(calls) == 1 and (a / "done").read_text() == "1"
    (tmp_path / ".build-other").mkdir()  # another run's build, not renamed in yet
    b = made_once(tmp_path, "b", "done", make)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [".build-other", "b"], b
