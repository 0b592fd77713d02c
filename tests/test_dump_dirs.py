"""Several dump directories (issue 31): ``EAGLE3_DUMP_DIR=A:B``, one directory per local disk. The
server's ``sinks.spread`` puts each key's file in one of them and ``tools/extract.py``'s
``dumps.spread`` looks for it there, so the two must agree for every key and stay what they are
(a dump written by today's server is read by tomorrow's client). One directory stays exactly the
layout it was.

The real ``DumpWriter`` and ``DumpSettings`` of the overlay, the real ``tools/serve.py`` and
``tools/extract.py`` command lines. (tests/test_extract.py serves a real CPU model with two
directories and extracts from them: ``test_dump_files_spread_over_two_directories``.)"""

import hashlib
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from conftest import one_line_error, run_tool  # noqa: E402
from test_capture_package import _idx, dump_mod  # noqa: E402
from test_dump_writers import _forwards  # noqa: E402

from eaglepatch.extract import dumps as reader  # noqa: E402

PKG = dump_mod.__name__.rsplit(".", 1)[0]
sinks = sys.modules[PKG + ".sinks"]
settings = sys.modules[PKG + ".settings"]


def test_the_server_and_the_reader_put_every_key_in_the_same_directory():
    keys = [hashlib.sha256(f"eaglepatch-{i}".encode()).hexdigest() for i in range(3000)]
    keys += ["not-a-hex-key", "\udc80 lone surrogate"]  # any key the writer may be given
    for n in range(1, 6):
        picks = [sinks.spread(k, n) for k in keys]
        assert picks == [reader.spread(k, n) for k in keys], n
        counts = [picks.count(i) for i in range(n)]
        assert min(counts) > 0.8 * len(keys) / n, counts  # spread evenly, not all to one disk
    # pinned: a dump directory written today is read the same way by every later client
    key = hashlib.sha256(b"rid-0").hexdigest()
    assert [sinks.spread(key, n) for n in (1, 2, 3, 4, 5)] == [0, 1, 2, 3, 4]
    assert [reader.spread(hashlib.sha256(f"rid-{i}".encode()).hexdigest(), 4) for i in range(8)] == \
        [3, 0, 1, 2, 0, 1, 3, 0]


def test_one_directory_is_the_layout_it_always_was(tmp_path):
    key = hashlib.sha256(b"x").hexdigest()
    assert sinks.FileSink(str(tmp_path)).path(key) == os.path.join(str(tmp_path), key + ".safetensors")
    assert reader.dump_path(tmp_path, key) == tmp_path / (key + ".safetensors")
    assert reader.dump_path(str(tmp_path), key) == tmp_path / (key + ".safetensors")


def _disks(tmp_path, n):
    disks = [tmp_path / f"disk{i}" for i in range(n)]
    for d in disks:
        d.mkdir()
    return disks, os.pathsep.join(map(str, disks))


def test_the_writer_spreads_whole_files_over_the_directories(tmp_path):
    """Three directories, four writer threads: every request's file is in the directory its key
    picks, whole (the rows it was given), and nothing else is left in any of them."""
    from safetensors import safe_open

    layers = [-1, 1, 3]
    disks, spec = _disks(tmp_path, 3)
    w = dump_mod.DumpWriter(spec, _idx(layers), True, 1 << 22, {"format": "eagle3-dump/1"}, writers=4)
    want = _forwards(w, 10, 8, layers)
    report = w.flush_report(60)
    assert report["flushed"] and (report["written"], report["failed"]) == (80, 0), report
    w.close()
    per_disk = [sorted(p.name for p in d.iterdir()) for d in disks]
    assert all(per_disk), [len(x) for x in per_disk]
    for rid, (ids, cap, fin) in want.items():
        key = dump_mod.request_key(rid)
        home = disks[reader.spread(key, 3)]
        assert reader.dump_path(spec, key) == home / (key + ".safetensors")
        with safe_open(str(home / (key + ".safetensors")), "pt") as f:
            assert f.get_tensor("input_ids").tolist() == ids.tolist(), rid
            for k in layers:
                assert torch.equal(f.get_tensor(f"layer.{k}"), cap[k]), (rid, k)
            assert torch.equal(f.get_tensor("final"), fin), rid
    assert sum(map(len, per_disk)) == 80  # no temporary file, no file twice


def test_a_directory_that_fails_fails_its_requests_by_name(tmp_path):
    """A disk that goes away under the writer: the requests whose keys it holds are reported failed
    (the flush's counts, each request's state), the others are written; nothing is reported written
    that is not on a disk."""
    disks, spec = _disks(tmp_path, 2)
    w = dump_mod.DumpWriter(spec, _idx([1]), False, 1 << 22, {}, writers=2)
    disks[1].rmdir()
    want = _forwards(w, 3, 8, [1])
    report = w.flush_report(60)
    w.close()
    lost = [rid for rid in want if reader.spread(dump_mod.request_key(rid), 2) == 1]
    assert lost and len(lost) < len(want)
    assert (report["written"], report["failed"]) == (len(want) - len(lost), len(lost)), report
    on_disk = {p.stem for p in disks[0].glob("*.safetensors")}
    assert on_disk == {dump_mod.request_key(r) for r in want if r not in lost}


@pytest.mark.parametrize("value, needle", [
    ("{a}::{b}", "has an empty entry; name one directory, or several separated by ':'"),
    ("{a}:{b}:{a}/.", "twice"),
    ("{a}:", "has an empty entry"),
])
def test_the_server_refuses_a_list_it_cannot_spread_over(tmp_path, value, needle):
    disks, _ = _disks(tmp_path, 2)
    v = value.format(a=disks[0], b=disks[1]).replace(":", os.pathsep)
    with pytest.raises(settings.DumpConfigError) as e:
        settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": v})
    assert needle in str(e.value), str(e.value)


def test_the_server_reads_a_list_and_keeps_one_directory_as_it_was(tmp_path):
    disks, spec = _disks(tmp_path, 2)
    s = settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": f" {disks[0]} {os.pathsep} {disks[1]} "})
    assert s.directories == [str(disks[0]), str(disks[1])] and s.directory == spec
    one = settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": f"{disks[0]} "})
    assert one.directory == str(disks[0]) and one.directories == [str(disks[0])]
    with pytest.raises(settings.DumpConfigError) as e:  # the Mooncake sink writes no file to spread
        settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": spec, "EAGLE3_DUMP_SINK": "mooncake",
                                        "EAGLE3_DUMP_MOONCAKE_MASTER": "127.0.0.1:50051"})
    assert "names 2 directories, which spread dump files, but EAGLE3_DUMP_SINK=mooncake writes none" in str(e.value)


def _one_line(r):
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    return one_line_error(r)


def test_serve_passes_the_list_and_refuses_what_the_server_would(tmp_path):
    from eaglepatch.serve import dump_dir_list

    disks = [tmp_path / "a", tmp_path / "b"]
    spec = os.pathsep.join(map(str, disks))
    assert dump_dir_list(spec) == disks  # created at start (Plan.mkdirs), in this order
    for value, needle in [(f"{disks[0]}{os.pathsep}{os.pathsep}{disks[1]}", "has an empty entry"),
                          (f"{disks[0]}{os.pathsep}{disks[0]}/", f"--dump-dir names {disks[0]} twice")]:
        line = _one_line(run_tool("serve", "--model-path", "m", "--dump-dir", value, "--print"))
        assert needle in line, line
    assert not any(d.exists() for d in disks)


def test_extract_refuses_a_list_it_cannot_read(tmp_path):
    disks, spec = _disks(tmp_path, 2)
    data = tmp_path / "c.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    base = ["--server", "http://127.0.0.1:9", "--model", tmp_path, "--data", data, "--out", tmp_path / "out"]
    for value, needle in [(f"{disks[0]}{os.pathsep}", "has an empty entry"),
                          (f"{disks[0]}{os.pathsep}{disks[0]}", "names " + str(disks[0]) + " twice"),
                          (f"{disks[0]}{os.pathsep}{tmp_path / 'gone'}", f"dump directory {tmp_path / 'gone'} is not "
                                                                         f"visible on this machine")]:
        line = _one_line(run_tool("extract", *base, "--dump-dir", value))
        assert needle in line, line
    assert not (tmp_path / "out").exists()


def test_a_link_to_a_listed_directory_is_refused_and_tilde_is_expanded(tmp_path, monkeypatch):
    """Issue 43 item 17: a second name of a listed directory (a symlink) is refused by serve and
    extract in one line, as a directory named twice is (the server would spread files over one disk
    as if two, and the client look for half of them in the other name); ``~`` is expanded where
    extract reads the files too, as serve expands it (tests/test_rebuild_identity.py runs extract
    with ``--dump-dir ~/dumps`` end to end)."""
    disks, _ = _disks(tmp_path, 1)
    link = tmp_path / "alias"
    link.symlink_to(disks[0], target_is_directory=True)
    value = f"{disks[0]}{os.pathsep}{link}"
    data = tmp_path / "c.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    want = f"--dump-dir names {disks[0]} and {link}, which are the same directory ({disks[0]})"
    line = _one_line(run_tool("extract", "--server", "http://127.0.0.1:9", "--model", tmp_path, "--data", data,
                              "--out", tmp_path / "out", "--dump-dir", value))
    assert want in line and "list each directory once" in line, line
    line = _one_line(run_tool("serve", "--model-path", "m", "--dump-dir", value, "--print"))
    assert want in line, line
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("HOME", str(tmp_path))
    key = hashlib.sha256(b"k").hexdigest()
    assert reader.dump_dir_entries(f"~/disk0{os.pathsep}~/disk1") == [disks[0], tmp_path / "disk1"]
    assert reader.dump_path("~/disk0", key) == disks[0] / f"{key}.safetensors"


def test_the_launch_refusal_never_suggests_a_mkdir_that_splits_a_name(tmp_path):
    """EAGLE3_DUMP_DIR naming an existing directory whose name holds ':' is split into entries that
    do not exist; the launch's refusal used to suggest `mkdir -p a`, which would make the split
    permanent. Now it names the directory and the fix; a missing entry of a list suggests no
    mkdir of a fragment; a single missing directory still gets its mkdir."""
    odd = tmp_path / "a:b"
    odd.mkdir()
    value = str(odd)
    with pytest.raises(settings.DumpConfigError) as err:
        for d in settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": value}).directories:
            settings.check_directory(d, value)
    msg = str(err.value)
    assert "one directory whose name holds ':'" in msg and "mkdir" not in msg and "\n" not in msg, msg
    other = tmp_path / "present"
    other.mkdir()
    value = f"{other}:{tmp_path / 'missing'}"
    with pytest.raises(settings.DumpConfigError) as err:
        for d in settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": value}).directories:
            settings.check_directory(d, value)
    assert "mkdir" not in str(err.value) and "create each directory of the list" in str(err.value)
    with pytest.raises(settings.DumpConfigError, match="mkdir -p"):
        settings.check_directory(str(tmp_path / "missing"))
