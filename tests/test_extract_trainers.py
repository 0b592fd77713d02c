"""What tools/extract.py writes is read right by the trainers' own code, or refused (issue 43):

- item 2: a speculators export from fp8 dumps. speculators 0.9.0's default ``file`` backend hands
  ``hidden_states`` to training as the file holds them, so an fp8 export read by it trains on the raw
  fp8 codes (up to 448), its scales dropped, without an error; no layout of the file can make that
  backend refuse it (both backends load the same file; the ``fp8`` one only multiplies afterwards).
  The export is therefore written for one backend, ``--hidden-states-backend file`` (the default, as
  speculators'): model-dtype states every backend reads right; ``fp8`` only when asked, and the run's
  last lines, the manifest and a resume name it. Read here through speculators' own backend registry
  (``HiddenStatesBackend.registry[name].from_train_args``, what its train CLI does), its
  ``ArrowDataset`` and ``CollateFn``;
- item 4: ``--format specforge`` without ``--aux-layers`` takes every dumped layer but N-1, which
  SpecForge 0.2.0's draft trains on only when they are exactly three layers (offline it never reads the
  ids, -1 included; its online capture, ``resolve_eagle_capture_layers``, alone refuses negative ones):
  refused at the first dump (exit 2, one line naming three, nothing written), else used and named; read
  with its ``build_offline_eagle3_dataset``;
- item 17: a damaged ``OUT/.extract-settings.json`` is one line naming the file and the fix (it was
  "internal error"), and leaves OUT as it was.

The servers are loopback stand-ins (``extract_fixtures/dumpserver.py``) writing real dump files;
the fp8 one quantises its rows with the dump writer's own arithmetic (``storage.quantize_rows``) into
an ``eagle3-dump/2`` file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
for _m in ("transformers", "safetensors", "datasets", "speculators", "hs_connectors", "specforge"):
    # found, not imported: speculators and datasets cost ~5 s to import, paid at collection by every process
    # that collects the suite (each pytest-xdist worker, the controller, test_cli_help's deal runs); the tests
    # that use them import them themselves (an install that cannot import fails there, it is not skipped)
    if importlib.util.find_spec(_m) is None:
        pytest.skip(f"could not import {_m!r}: No module named {_m!r}", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "extract_fixtures"))

from conftest import one_line_error  # noqa: E402
from dumpserver import DumpServer, expected_rows  # noqa: E402
from test_extract_client import H, N_CONV, N_LAYERS, model, run_cli  # noqa: E402,F401  (model: a fixture)

from eaglepatch.storage import dequantize, quantize_rows  # noqa: E402

LAYERS = [-1, 0, 1, 2, 3]  # the CPU demo's: the embedding, layers 0-2 and N-1 = 3


class FP8DumpServer(DumpServer):
    """The stand-in with ``EAGLE3_DUMP_DTYPE=fp8``: each state as float8_e4m3fn with its float32 scale
    per row (``scale.<name>``), in an ``eagle3-dump/2`` file (the writer's metadata for nothing left out)."""

    def _write(self, rid, ids, action):
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        super()._write(rid, ids, action)
        path = self.dump_dir / f"{__import__('dumpserver').sha(rid)}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
        plain = load_file(str(path))
        out = {"input_ids": plain.pop("input_ids")}
        for name, t in plain.items():
            out[name], out["scale." + name] = quantize_rows(t)
        meta.update({"format": "eagle3-dump/2", "storage_dtype": "float8_e4m3fn", "scale_layout":
                     "per_token_per_state", "left_out": "{}", "vocab_size": "1024"})
        tmp = path.with_name("." + path.name + ".fp8.tmp")
        save_file(out, str(tmp), metadata=meta)
        os.replace(tmp, path)


def truth(ids, k, dtype=torch.float32):
    """The state the fp8 dump of a prompt holds for layer ``k``, dequantised in ``dtype`` (float32: the
    stand-in's model dtype, as our reader yields it; bfloat16: as hs-connectors' FP8Transfer does)."""
    return dequantize(*quantize_rows(expected_rows(ids, k, H)), dtype)


def extract(model, server, out, *extra):
    """tools/extract.py's main() in this process: its exit code and stderr."""
    return run_cli(["--server", server.url, "--model", model.dir, "--data", model.data, "--dump-dir", server.dump_dir,
                    "--out", out, "--no-progress", "--dump-timeout", "5", *extra])


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- item 2: speculators reads the export right with the backend the run names -------------------

def speculators_items(out: Path, backend: str) -> list:
    """speculators 0.9.0 on ``out`` through its backend ``backend``, built as its train CLI builds it
    (``HiddenStatesBackend.registry[...].from_train_args(args, data_path)``), each item of its
    ArrowDataset packed by its CollateFn into the bf16 batch its trainer gets."""
    from hs_connectors import HiddenStatesBackend
    from speculators.train.data import ArrowDataset, CollateFn

    transfer = HiddenStatesBackend.registry[backend].from_train_args(Namespace(hidden_states_path=None), str(out))
    ds = ArrowDataset(max_len=256, datapath=str(out), transfer=transfer, on_missing="raise")
    collate = CollateFn(max_len=256, hidden_size=H, num_target_layers=len(LAYERS) - 1, dtype=torch.bfloat16)
    return [(ds[i], collate([ds[i]])) for i in range(len(ds))]


def speculators_default_backend() -> str:
    """The ``--hidden-states-backend`` speculators 0.9.0 trains with when none is given: the default of
    ``DataArgs.hidden_states_backend`` in its config schema, read from its source (the module imports
    pydantic_settings, which the test environment does not install)."""
    import ast
    import importlib.util

    src = Path(importlib.util.find_spec("speculators").origin).parent / "train" / "config" / "schema.py"
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "DataArgs":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "hidden_states_backend":
                    return next(ast.literal_eval(k.value) for k in item.value.keywords if k.arg == "default")
    raise AssertionError(f"no DataArgs.hidden_states_backend in {src}")


def worst_error(items, dtype=torch.float32) -> float:
    """The largest relative difference, over every item, between what speculators hands training (the
    collated bf16 batch) and the dump's states dequantised in ``dtype``, aux slots and last slot: bf16
    rounding of a float32 value is at most 2**-8 of it (half its 8-bit precision)."""
    def rel(got, want):
        return float(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1)).max())

    worst = 0.0
    for item, batch in items:
        ids = item["input_ids"].tolist()
        T = len(ids)
        aux = torch.cat([truth(ids, k, dtype) for k in LAYERS[:-1]], dim=-1)
        worst = max(worst, rel(batch["hidden_states"][0, :T], aux),
                    rel(batch["verifier_last_hidden_states"][0, :T], truth(ids, 3, dtype)))
    return worst


def test_the_speculators_export_of_fp8_dumps_is_read_right_by_the_backend_the_run_names(model, tmp_path):
    """fp8 dumps, ``--format speculators``: by default the export is what speculators' default backend
    (read from its own config schema: ``file``) reads right, the run's last lines say so; with
    ``--hidden-states-backend fp8`` it is the fp8 layout its fp8 backend dequantises, the run names
    that flag, and a resume with the other backend is refused. Before issue 43 the default export of
    an fp8 dump was fp8, which speculators' default backend handed to training as raw codes."""
    assert speculators_default_backend() == "file"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    with FP8DumpServer(dumps, LAYERS, H, N_LAYERS) as s:
        default, fp8 = tmp_path / "default", tmp_path / "fp8"
        p = extract(model, s, default, "--format", "speculators")
        assert p.returncode == 0, p.stderr[-3000:]
        # the default backend, and the fp8 one (it passes a file without scales on), read the dump's values
        assert worst_error(speculators_items(default, "file")) <= 2 ** -8
        assert worst_error(speculators_items(default, "fp8")) <= 2 ** -8
        assert f"train with speculators: --data-path {default} --hidden-states-backend file --target-layer-ids " \
               f"0 1 2 3" in p.stderr, p.stderr[-2000:]
        man = json.loads((default / "manifest.json").read_text())
        assert man["storage"]["speculators_backend"] == man["speculators"]["hidden_states_backend"] == "file"
        assert man["storage"]["dtype"] == "float32" and man["samples"] == N_CONV

        p = extract(model, s, fp8, "--format", "speculators", "--hidden-states-backend", "fp8")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "--hidden-states-backend fp8 --target-layer-ids 0 1 2 3" in p.stderr, p.stderr[-2000:]
        man = json.loads((fp8 / "manifest.json").read_text())
        assert man["storage"]["speculators_backend"] == "fp8" and man["storage"]["dtype"] == "float8_e4m3fn"
        assert worst_error(speculators_items(fp8, "fp8"), torch.bfloat16) == 0  # FP8Transfer's own arithmetic
        assert worst_error(speculators_items(fp8, "fp8")) <= 2 ** -7  # its bf16 scale and product: two roundings
        # the reading the default now avoids: the same fp8 files through the file backend are raw codes
        assert worst_error(speculators_items(fp8, "file")) > 1

        # a resume with the other backend would mix fp8 and float32 samples: refused, nothing touched
        before = snapshot(fp8)
        p = extract(model, s, fp8, "--format", "speculators")
        line = one_line_error(p)
        assert p.returncode == 2 and "holds a speculators export for --hidden-states-backend fp8, this run asks " \
                                     "file" in line and "--hidden-states-backend fp8 to resume" in line, line
        assert snapshot(fp8) == before
        # a dataset from before the flag recorded no backend: its fp8 dumps made an fp8 export
        settings = fp8 / ".extract-settings.json"
        st = json.loads(settings.read_text())
        del st["layout"]["backend"]
        settings.write_text(json.dumps(st))
        line = one_line_error(extract(model, s, fp8, "--format", "speculators"))
        assert "holds a speculators export for --hidden-states-backend fp8" in line, line
        p = extract(model, s, fp8, "--format", "speculators", "--hidden-states-backend", "fp8")
        assert p.returncode == 0 and "nothing to do" in p.stderr, p.stderr[-2000:]

        line = one_line_error(extract(model, s, tmp_path / "sf", "--format", "specforge",
                                      "--hidden-states-backend", "fp8", "--aux-layers=0,1,2"))
        assert "--hidden-states-backend fp8 is speculators' and --format is specforge" in line, line
        assert not (tmp_path / "sf").exists()


# ---- item 4: SpecForge's aux layers by default --------------------------------------------------

def specforge_resolves(ids) -> list:
    """SpecForge 0.2.0's own resolution of a draft config's capture layers (ValueError when it refuses)."""
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    return resolve_eagle_capture_layers(cfg, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                                        SimpleNamespace(num_hidden_layers=N_LAYERS))


def test_specforge_without_aux_layers_refuses_layers_its_trainer_refuses(model, tmp_path):
    """The CPU demo's dump (-1, 0, 1, 2 and N-1 = 3): every layer but N-1 is four layers, and SpecForge's
    draft takes exactly three; the run stops at its first dump in one line naming three, and leaves no
    OUT. Those three, passed, give a dataset SpecForge reads (and whose draft config even its online
    resolution takes). A server dumping three layers and N-1: the default is those three, and the run
    says so."""
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    from eaglepatch import conventions

    with pytest.raises(ValueError, match="exactly three non-negative"):  # four layers: no draft of SpecForge's
        specforge_resolves(conventions.ids_for(conventions.PLUS_ONE, [0, 1, 2, 3]))  # the old default's ids
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    with DumpServer(dumps, LAYERS, H, N_LAYERS) as s:
        p = extract(model, s, tmp_path / "sf", "--format", "specforge")
        line = one_line_error(p)
        assert p.returncode == 2 and "--format specforge without --aux-layers takes every dumped layer but the " \
                                     "last (EAGLE-3 id 3): [-1, 0, 1, 2]" in line and \
               "pass --aux-layers=0,1,2" in line, line
        assert not (tmp_path / "sf").exists()
        p = extract(model, s, tmp_path / "sf", "--format", "specforge", "--aux-layers=0,1,2")
        assert p.returncode == 0, p.stderr[-3000:]
    man = json.loads((tmp_path / "sf" / "manifest.json").read_text())
    assert specforge_resolves(man["sglang_draft_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == \
        [0, 1, 2]
    ds = build_offline_eagle3_dataset(str(tmp_path / "sf"), max_len=256)
    assert len(ds) == N_CONV and ds[0]["hidden_state"].shape[-1] == 3 * H

    dumps = tmp_path / "dumps3"
    dumps.mkdir()
    with DumpServer(dumps, [0, 1, 2, 3], H, N_LAYERS) as s:
        p = extract(model, s, tmp_path / "sf3", "--format", "specforge")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "aux layers: EAGLE-3 ids [0, 1, 2] (every dumped layer but the last" in p.stderr, p.stderr[-2000:]
    man = json.loads((tmp_path / "sf3" / "manifest.json").read_text())
    assert specforge_resolves(man["sglang_draft_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == \
        [0, 1, 2]
    assert len(build_offline_eagle3_dataset(str(tmp_path / "sf3"), max_len=256)) == N_CONV

    # the embedding among three layers (the drafts tools/acceptance.py trains: [-1, 1, 2]) is no refusal:
    # offline, SpecForge trains on the three states whatever their ids
    dumps = tmp_path / "dumps-1"
    dumps.mkdir()
    with DumpServer(dumps, [-1, 1, 2, 3], H, N_LAYERS) as s:
        p = extract(model, s, tmp_path / "sf-1", "--format", "specforge")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "aux layers: EAGLE-3 ids [-1, 1, 2]" in p.stderr, p.stderr[-2000:]
    ds = build_offline_eagle3_dataset(str(tmp_path / "sf-1"), max_len=256)
    assert len(ds) == N_CONV and ds[0]["hidden_state"].shape[-1] == 3 * H


# ---- item 17: a damaged settings file -----------------------------------------------------------

DAMAGES = {
    "layout not an object": lambda st: st.update(layout="x"),
    "layout without aux": lambda st: st["layout"].pop("aux"),
    "aux of strings": lambda st: st["layout"].update(aux=["0", "1", "2"]),
    "unknown format": lambda st: st["layout"].update(format="parquet"),
    "unknown backend": lambda st: st["layout"].update(backend="gpu"),
    "dump_meta a list": lambda st: st.update(dump_meta=[1, 2]),
    "layer ids not integers": lambda st: st["dump_meta"].update(eagle3_layer_ids=["a"]),
    "unknown reading": lambda st: st["dump_meta"].update(layer_id_reading="sideways"),
    "a number for a string": lambda st: st["dump_meta"].update(dtype=7),
}


def test_a_damaged_settings_file_is_one_line_naming_it(model, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    out = tmp_path / "ds"
    with DumpServer(dumps, LAYERS, H, N_LAYERS) as s:
        args = ("--format", "specforge", "--aux-layers=0,1,2")
        assert extract(model, s, out, *args).returncode == 0
        settings = out / ".extract-settings.json"
        good = settings.read_text()
        for what, damage in DAMAGES.items():
            st = json.loads(good)
            damage(st)
            settings.write_text(json.dumps(st))
            before = snapshot(out)
            p = extract(model, s, out, *args)
            line = one_line_error(p)
            assert p.returncode == 2 and "internal error" not in line, (what, line)
            assert f"{settings} was edited or damaged" in line and "pass a new --out" in line, (what, line)
            assert snapshot(out) == before, what
        settings.write_text(good)
        p = extract(model, s, out, *args)
        assert p.returncode == 0 and "nothing to do" in p.stderr, p.stderr[-2000:]
