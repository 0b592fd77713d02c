"""Property-style tests of the extract and guard command lines (hypothesis): random flags, paths and
malformed files. Whatever they get, the tools exit 0, 1 or 2, never raise (no traceback), say an
error in one ``error: <problem>; <fix>`` line, and a refusal leaves every file as it was (extract
creates no --out directory).

The tools run in this process (their ``main``) with EAGLEPATCH_DEBUG=1, so anything ``run_main``
would report as an internal error escapes and fails the test with its traceback. No server
runs: extract always meets a closed port or a malformed URL, so it must refuse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import socket
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_cli", REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(mod, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    os.environ["EAGLEPATCH_DEBUG"] = "1"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = mod.main([str(a) for a in argv])
        except SystemExit as exc:  # argparse
            rc = exc.code
        finally:
            del os.environ["EAGLEPATCH_DEBUG"]
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict:
    snap = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            st_ = p.lstat()
            snap[str(p)] = (st_.st_mode, st_.st_size, st_.st_mtime_ns)
    return snap


def check_outcome(rc, out, err, before, after):
    assert rc in (0, 1, 2), (rc, err)
    assert "Traceback" not in err and "Traceback" not in out and "internal error" not in err
    if rc == 2 and not err.startswith("usage:"):
        lines = [x for x in err.strip().splitlines() if x]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], err
    if rc != 0:
        assert after == before, "a refused run changed files"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 100) | st.text(max_size=8)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=12)
IDS = st.one_of(st.lists(st.integers(-3, 70), min_size=0, max_size=5), JSON)
NUM = st.one_of(st.integers(-5, 10**6).map(str), st.sampled_from(["nan", "inf", "-inf", "0", "1e308", "x", ""]))


def _file_bytes():
    """Contents for config/manifest/data files: valid-looking structures with random values, random
    JSON and random bytes (not UTF-8 either)."""
    draftish = st.fixed_dictionaries({}, optional={
        "eagle_config": st.one_of(JSON, st.fixed_dictionaries({}, optional={
            "eagle_aux_hidden_state_layer_ids": IDS, "use_aux_hidden_state": JSON})),
        "speculators_model_type": JSON,
        "eagle_aux_hidden_state_layer_ids": IDS,
        "eagle3_layer_ids": IDS,
        "hf_hidden_state_indices": IDS,
        "num_hidden_layers": st.one_of(st.integers(-2, 70), st.sampled_from(["sixty", "61", "", None])),
        "model": st.one_of(JSON, st.fixed_dictionaries({"num_hidden_layers": st.one_of(st.integers(-2, 70), JSON)})),
        "dataset_format": JSON,
        "hidden_size": JSON, "vocab_size": JSON, "text_config": JSON, "architectures": JSON,
        # the release a manifest records (guard and check_draft judge by it when --release is not given)
        "sglang_release": st.one_of(JSON, st.sampled_from(["0.5.9", "0.5.17", "0.5.12", "../../etc", "0.5.09", ""])),
    })
    return st.one_of(draftish.map(lambda d: json.dumps(d).encode()), JSON.map(lambda d: json.dumps(d).encode()),
                     st.binary(max_size=64), st.just(b'{"eagle_config": "[1, 2, 3]"}'),
                     st.just(b'{"model": {"num_hidden_layers": "sixty"}, "eagle3_layer_ids": [1, 2, 3]}'))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- guard ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guard_mod():
    return load_tool("guard")


@SETTINGS
@given(draft=_file_bytes(), data=_file_bytes(), draft_kind=st.sampled_from(["file", "dir", "missing", "unreadable"]),
       data_kind=st.sampled_from(["dir", "file", "missing", "dump"]),
       release=st.sampled_from([None, None, None, None, "0.5.9", "0.5.23", "9.9.9", ""]),
       sglang=st.sampled_from([None, None, None, "missing", "empty-dir", "file"]), as_json=st.booleans())
def test_guard_cli_properties(tmp_path_factory, guard_mod, draft, data, draft_kind, data_kind, release, sglang,
                              as_json):
    root = tmp_path_factory.mktemp("g")
    d = root / "draft"
    d.mkdir()
    (d / "config.json").write_bytes(draft)
    dpath = {"file": d / "config.json", "dir": d, "missing": root / "nope.json",
             "unreadable": d / "config.json"}[draft_kind]
    if draft_kind == "unreadable":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()  # a directory where the file should be: reading it fails
        dpath = d / "config.json" / "config.json"
        dpath.mkdir()
    ds = root / "ds"
    ds.mkdir()
    (ds / "manifest.json").write_bytes(data)
    if data_kind == "dump":
        (ds / "x.safetensors").write_bytes(data)
    spath = {"dir": ds, "file": ds / "manifest.json", "missing": root / "none", "dump": ds / "x.safetensors"}[data_kind]
    argv = ["--draft-config", dpath, "--dataset", spath]
    if sglang is not None:
        sg = {"missing": root / "no-tree", "empty-dir": root, "file": ds / "manifest.json"}[sglang]
        argv += ["--sglang", sg]
    elif release is not None:
        argv += ["--release", release]
    if as_json:
        argv.append("--json")
    before = snapshot(root)
    rc, out, err = run(guard_mod, argv)
    check_outcome(rc, out, err, before, snapshot(root))


# ---- extract --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from eaglepatch.serve import tinychat

    root = tmp_path_factory.mktemp("exprop")
    tok = tinychat.build_tokenizer(root / "tok")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1024,
                                                   "hidden_size": 256, "num_hidden_layers": 4}))
    data = tinychat.write_jsonl(root / "conv.jsonl", tinychat.conversations(4))
    dumps = root / "dumps"
    dumps.mkdir()
    return {"root": root, "tok": tok, "model": model, "data": data, "dumps": dumps, "mod": load_tool("extract"),
            "port": closed_port()}


def mostly(common, *rare):
    """``common`` three times in four, else one of ``rare`` (keeps most runs past argument parsing)."""
    return st.one_of(st.just(common), st.just(common), st.just(common), st.sampled_from(rare))


@SETTINGS
@given(data_kind=mostly("good", "bytes", "missing", "dir"), data_bytes=_file_bytes(),
       model_kind=mostly("good", "bytes", "missing"), model_bytes=_file_bytes(),
       tok_kind=mostly("good", "model", "missing"), dump_kind=mostly("good", "missing", "file"),
       out_kind=mostly("new", "nested-new", "file", "under-file", "empty-dir"),
       server=st.one_of(st.just("closed"), st.sampled_from(["", "nonsense", "http://[::1", "ftp://x", "http://a..b:1",
                                                          ",", "x,", "http://a:1,http://a:1/", "closed,closed"]),
                        st.text(max_size=12)),
       fmt=mostly(None, "specforge", "speculators", "other"),
       nums=st.dictionaries(st.sampled_from(["--max-len", "--concurrency", "--dump-timeout", "--request-timeout",
                                             "--retries", "--max-attempts", "--limit"]), NUM, max_size=2),
       aux=mostly(None, "-1,1,2", "1,2", "7", "-2", "1,,2", "x"),
       mask=mostly(None, "auto", "generation", "offsets", "bogus"))
def test_extract_cli_properties(ex, tmp_path_factory, data_kind, data_bytes, model_kind, model_bytes, tok_kind,
                                dump_kind, out_kind, server, fmt, nums, aux, mask):
    root = tmp_path_factory.mktemp("e")
    data = {"good": ex["data"], "missing": root / "none.jsonl", "dir": root}.get(data_kind)
    if data_kind == "bytes":
        data = root / "d.jsonl"
        data.write_bytes(data_bytes)
    model = {"good": ex["model"], "missing": root / "no-model"}.get(model_kind)
    if model_kind == "bytes":
        model = root / "m"
        model.mkdir()
        (model / "config.json").write_bytes(model_bytes)
    tok = {"good": ex["tok"], "model": model, "missing": root / "no-tok"}[tok_kind]
    dump = {"good": ex["dumps"], "missing": root / "no-dumps", "file": ex["data"]}[dump_kind]
    (root / "f").write_text("x")
    (root / "empty").mkdir()
    out = {"new": root / "out", "nested-new": root / "a" / "b" / "out", "file": root / "f",
           "under-file": root / "f" / "out", "empty-dir": root / "empty"}[out_kind]
    url = server.replace("closed", f"http://127.0.0.1:{ex['port']}") if server.startswith("closed") else server
    argv = ["--server", url, "--model", model, "--tokenizer", tok, "--data", data, "--dump-dir", dump,
            "--out", out, "--no-progress"]
    if fmt:
        argv += ["--format", fmt]
    if mask:
        argv += ["--mask", mask]
    if aux is not None:
        argv.append(f"--aux-layers={aux}")
    for k, v in nums.items():
        argv.append(f"{k}={v}")
    before = snapshot(root)
    rc, stdout, err = run(ex["mod"], argv)
    check_outcome(rc, stdout, err, before, snapshot(root))
    assert rc != 0  # no server answers


# ---- check_draft (issue 43): the inputs it reads before any replay ------------------------------------------

@pytest.fixture(scope="module")
def check_draft_mod():
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    return load_tool("check_draft")


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


TARGET_CFG = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 1024}
DRAFT_CFG = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 256, "num_hidden_layers": 1,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 1, 2], "use_aux_hidden_state": True}}
MANIFEST = {"eagle3_layer_ids": [-1, 1, 2], "model": {"num_hidden_layers": 4}, "dataset_format": "specforge",
            "sglang_release": "0.5.9"}


def _near(good: dict, **variants):
    """``good`` as JSON bytes, or with one of its fields replaced by a variant (a string of digits, a
    float, another value, removed), or random bytes (``_file_bytes``)."""
    def pick(n, kv, junk):  # most runs get past each input to the next
        if n < 7:
            return json.dumps(good).encode()
        if n < 9:
            return json.dumps({**{k: v for k, v in good.items() if k != kv[0]},
                               **({} if kv[1] is None else {kv[0]: kv[1]})}).encode()
        return junk

    one = st.sampled_from([(k, v) for k, vs in variants.items() for v in vs])
    return st.builds(pick, st.integers(0, 11), one, st.one_of(_file_bytes(), st.just(_deep(100000))))


@SETTINGS
@given(target=_near(TARGET_CFG, hidden_size=["256", 256.0, 512, None, True], num_hidden_layers=[0, "4", None],
                     vocab_size=[-1, None]),
       draft=_near(DRAFT_CFG, hidden_size=["256", 256.0, 512, None, [256]], eagle_config=["x", None, {}],
                   speculators_model_type=["eagle3"]),
       data=_near(MANIFEST, sglang_release=["../../etc", "0.5.12", "", 9, None],
                  eagle3_layer_ids=[[-2, 1, 2], [1, 2, 4], [1, 1, 2], [0, 1, 2, 3], []], dataset_format=["speculators"]),
       served=st.one_of(st.none(), _file_bytes(), st.just(_deep(100000))),
       target_weights=st.sampled_from(["index", "index", "single", "none", "single-garbage"]),
       release=st.sampled_from([None, None, "0.5.9", "0.5.17", "9.9.9", "../x"]))
def test_check_draft_cli_properties(tmp_path_factory, check_draft_mod, target, draft, data, served, target_weights,
                                    release):
    """Target and draft configs, manifests (their release and ids too) and --served files, each valid, one
    field changed (a string of digits, a float, out of range, removed) or random bytes (nested too deep
    too), a target with an index, one weights file (empty or garbage) or none: check_draft exits 0, 1 or
    2, one line on a refusal, no internal error, nothing written. The held-out data holds no sample, so
    no run gets past the inputs to a replay (tests/test_check_draft.py damages samples and weights)."""
    root = tmp_path_factory.mktemp("cd")
    t, d, ds = root / "target", root / "draft", root / "data"
    for x in (t, d, ds):
        x.mkdir()
    (t / "config.json").write_bytes(target)
    if target_weights == "index":
        (t / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    elif target_weights != "none":
        (t / "model.safetensors").write_bytes(b"" if target_weights == "single" else bytes(range(200)))
    (d / "config.json").write_bytes(draft)
    (ds / "manifest.json").write_bytes(data)
    argv = ["--target", t, "--draft", d, "--data", ds, "--out", root / "r.json", "--states", root]
    if served is not None:
        (root / "served.json").write_bytes(served)
        argv = argv[:-2] + ["--served", root / "served.json"]
    if release is not None:
        argv += ["--release", release]
    before = snapshot(root)
    rc, out, err = run(check_draft_mod, argv)
    check_outcome(rc, out, err, before, snapshot(root))
    assert rc != 0  # no sample to replay
    event(" ".join(w for w in (err.strip().splitlines() or [""])[-1].split()[:9] if "/" not in w))
