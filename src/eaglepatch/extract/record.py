"""What a run records in OUT: settings, progress and the manifest.

- ``.extract-settings.json``: the settings the dataset was started with (format, max length, mask
  method, chat template hash, model sizes, then the layout and the first dump's provenance,
  ``PROVENANCE``, once the first dump is seen); written before the first sample is recorded; a
  resume with other settings is refused, and so is every dump of another provenance.
- ``progress.jsonl``: one line per finished sample (written, or skipped for having no assistant
  token), appended after its file is in place. A sample is done when its latest line carries the
  fingerprint of the conversation as the input has it now and its file has the recorded size;
  a conversation edited between runs is extracted again (into the same file, named by its id).
- ``.extract-requests.jsonl``: the rid of every request sent (appended before it is sent); the dump
  files of requests no sample used are removed at the start and the end of every run, and only the
  requests whose file may still come stay listed (``dumps.sweep_unused``).
- ``manifest.json``: rewritten atomically at the end of every run, listing the done samples of every
  conversation in the input file (``--limit`` limits what a run extracts, not what the dataset
  holds); sample files no done record names are deleted first (``remove_orphans``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

from .. import conventions
from ..errors import UsageError
from . import drafts
from .writers import SAMPLE_EXT, SAMPLES_DIR, layout_problem, manifest_storage

MANIFEST_FORMAT = "eaglepatch-hidden-states/2"
SETTINGS_FILE = ".extract-settings.json"
PROGRESS_FILE = "progress.jsonl"
MANIFEST_FILE = "manifest.json"
_NO_FILE = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)  # what Path.is_file() reads as "no file"
COMPARED = ("format", "max_len", "mask_method", "chat_template_sha256", "model")
# the dump metadata every dump of a dataset must share with its first: recorded in the settings file
# (``dump_meta``) with the first sample, compared with every dump of every run (``run.Extractor.validate``)
PROVENANCE = ("model_path", "architecture", "dtype", "hidden_size", "num_hidden_layers", "eagle3_layer_ids",
              "hf_hidden_state_indices", "final", "series_version", "sglang_version", "storage_dtype", "scale_layout",
              "left_out")
# the dump's storage layout (docs/design.md, "Compact storage"): a dataset holds dumps of one layout;
# an eagle3-dump/1 file (and a dataset recorded before these fields) is ``dumps.storage_meta``'s
# plain layout: the model dtype, no scales, nothing left out
STORAGE_PROVENANCE = ("storage_dtype", "scale_layout", "left_out")


# the rids of the requests the dataset's runs sent (one line each, before the request): their dump files
# are this client's own, removed when no sample used them (``dumps.sweep_unused``; ``run.Extractor``)
REQUESTS_FILE = ".extract-requests.jsonl"


class Fatal(UsageError):
    """A problem that stops the whole run (exit 2)."""


def atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise Fatal(f"cannot write {path} ({exc.strerror or exc})",
                    "free space or fix permissions on --out and rerun (done samples are kept)") from None


def read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path} ({type(exc).__name__})",
                         "pass a new --out (this one is not a dataset written by tools/extract.py)") from None


class Settings:
    """The settings file: checked against this run's at start, written with the first sample."""

    def __init__(self, out: Path, want: dict):
        self.path = Path(out) / SETTINGS_FILE
        self.data = dict(want, layout=None, dump_meta={})
        self.saved = False
        if self.path.is_file():
            have = read_json(self.path, "the settings file")
            why = "it is not a settings object" if not isinstance(have, dict) else settings_problem(have)
            if why:
                raise UsageError(f"{self.path} was edited or damaged: {why}",
                                 f"pass a new --out, or remove {out} and extract again (tools/extract.py writes that "
                                 f"file with the first sample; it is not meant to be edited)")
            for k in COMPARED:
                if have.get(k) != want[k]:
                    raise UsageError(f"{out} holds a dataset made with {k}={have.get(k)!r}, this run has {want[k]!r}",
                                     "rerun with the same settings to resume, or pass a new --out")
            self.data.update(layout=have.get("layout"), dump_meta=have.get("dump_meta") or {})
            self.saved = True

    def save(self) -> None:
        atomic_json(self.path, self.data)
        self.saved = True


_DUMP_LISTS = ("eagle3_layer_ids", "hf_hidden_state_indices")  # recorded as lists of integers


def settings_problem(have: dict) -> str:
    """Why the settings object ``have`` is not one tools/extract.py writes ('' when it is): the
    fields later stages read (the layout, the first dump's provenance) checked, so a damaged file is
    one line at the start, never a crash in the middle of a run."""
    lay = have.get("layout")
    if lay is not None:
        why = layout_problem(lay)
        if why:
            return why
    meta = have.get("dump_meta")
    if meta is None:
        return ""
    if not isinstance(meta, dict):
        return "its dump_meta is not an object"
    for k, v in meta.items():
        if k in _DUMP_LISTS:
            if not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
                return f"its dump_meta {k} {str(v)[:60]} is not a list of integers"
        elif v is not None and not isinstance(v, str):
            return f"its dump_meta {str(k)[:40]} {str(v)[:40]} is not a string"
    rule = meta.get("layer_id_reading")
    if rule is not None and rule not in conventions.RULES:
        return f"its dump_meta layer_id_reading {rule[:40]!r} is not one of {', '.join(conventions.RULES)}"
    return ""


def load_done(out: Path, convs) -> dict:
    """Conversation id -> its progress record, for the samples that are done (see the module doc)."""
    path = Path(out) / PROGRESS_FILE
    if not path.is_file():
        return {}
    fps = {c.id: c.fingerprint for c in convs}
    latest = {}
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror})", "fix the permissions on --out, or pass a new --out") from None
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:  # a torn last line of a killed run
            continue
        if isinstance(rec, dict) and isinstance(rec.get("id"), str):
            latest[rec["id"]] = rec
    done = {}
    for cid, rec in latest.items():
        if cid not in fps or rec.get("fp") != fps[cid]:
            continue
        if rec.get("skipped"):
            done[cid] = rec
            continue
        if not rec.get("file"):
            continue
        try:
            st = (Path(out) / str(rec["file"])).stat()
        except ValueError:  # a path Path.is_file() would call no file (a NUL in it)
            continue
        except OSError as exc:  # no file there: extracted again; other errors propagate, as from is_file()
            if exc.errno in _NO_FILE:
                continue
            raise
        if stat.S_ISREG(st.st_mode) and st.st_size == rec.get("bytes"):
            done[cid] = rec
    return done


def append_progress(out: Path, rec: dict) -> None:
    line = (json.dumps(rec, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(Path(out) / PROGRESS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if os.write(fd, line) != len(line):  # one write on an O_APPEND fd: whole, or torn (ignored on read)
                raise OSError(28, "short write to progress.jsonl")
        finally:
            os.close(fd)
    except OSError as exc:
        raise Fatal(f"cannot record progress in {out} ({exc.strerror or exc})",
                    "free space or fix permissions on --out and rerun (done samples are kept)") from None


def note_request(out: Path, rid: str, dump_dir: Path) -> None:
    """Record that this client sends a request ``rid`` whose dump file lands in ``dump_dir`` (before it
    is sent: a run killed after it still knows the file is its own)."""
    line = (json.dumps({"rid": rid, "dir": str(dump_dir), "t": round(time.time(), 3)}) + "\n").encode()
    try:
        fd = os.open(Path(out) / REQUESTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write on an O_APPEND fd: whole, or torn (ignored on read)
        finally:
            os.close(fd)
    except OSError as exc:
        raise Fatal(f"cannot record a request in {out} ({exc.strerror or exc})",
                    "free space or fix permissions on --out and rerun (done samples are kept)") from None


def read_requests(out: Path) -> list:
    """The requests ``note_request`` recorded (torn or foreign lines skipped)."""
    try:
        text = (Path(out) / REQUESTS_FILE).read_text(errors="replace")
    except OSError:
        return []
    entries = []
    for raw in text.splitlines():
        try:
            e = json.loads(raw)
        except ValueError:
            continue
        if isinstance(e, dict):
            entries.append(e)
    return entries


def write_requests(out: Path, entries: list) -> None:
    """Keep only ``entries`` in the requests file (none: no file)."""
    path = Path(out) / REQUESTS_FILE
    if not entries:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the old file stays: a later run looks at its requests again


def remove_orphans(out: Path, fmt: str, done: dict) -> int:
    """Delete the sample files under ``out`` that no done record names (conversations removed from the
    input, or edited since and not extracted again: SpecForge's reader takes every .ckpt under OUT);
    returns how many. Sample directories left empty go too."""
    mine = {rec["file"] for rec in done.values() if rec.get("file")}
    n = 0
    for p in sorted(Path(out).glob(f"{SAMPLES_DIR}/*/*.{SAMPLE_EXT[fmt]}")):
        if p.relative_to(out).as_posix() not in mine:
            p.unlink()
            n += 1
            try:
                p.parent.rmdir()
            except OSError:  # not empty
                pass
    return n


def _draft_config(meta: dict, hf_aux) -> dict | None:
    if hf_aux is None:
        return None
    rule = conventions.dump_rule(meta)
    return {"eagle_config": conventions.draft_eagle_config(rule, hf_aux), "sglang_release": meta.get("sglang_version"),
            "layer_id_reading": rule}


def manifest(o, cfg: dict, tok, settings: Settings, convs, done: dict, outcomes, last_run: dict, draft=None) -> dict:
    """The manifest of ``o.out``: what the dataset holds, in both layer conventions. ``draft``
    (``--format dflash|dspark``): the draft's ``drafts.DraftLayers``, recorded as ``draft`` (its ids as
    its family reads them on the release and model file that dumped, and their HF indices)."""
    recs = [done[c.id] for c in convs if c.id in done and not done[c.id].get("skipped")]
    failed = sorted(({"id": x.conv_id, "reason": x.reason} for x in outcomes if x.status == "failed"),
                    key=lambda r: r["id"])
    skipped = sorted(({"id": c.id, "reason": done[c.id]["skipped"]} for c in convs
                      if c.id in done and done[c.id].get("skipped")), key=lambda r: r["id"])
    lay = settings.data.get("layout") or {}
    meta = settings.data.get("dump_meta") or {}
    aux = lay.get("aux")
    hf_aux = [k + 1 for k in aux] if aux is not None else None
    n = cfg["num_hidden_layers"]
    m = {
        "format": MANIFEST_FORMAT,
        "dataset_format": o.format,
        "samples": len(recs),
        "tokens": sum(r["tokens"] for r in recs),
        "loss_tokens": sum(r.get("loss_tokens", 0) for r in recs),
        "bytes": sum(r["bytes"] for r in recs),
        "files": [r["file"] for r in recs],
        "conversations": len(convs),
        "failed": failed,
        "failed_ids": [r["id"] for r in failed],
        "skipped": skipped,
        "eagle3_layer_ids": aux,
        "hf_hidden_state_indices": hf_aux,
        "dump_layer_ids": meta.get("eagle3_layer_ids"),
        # the eagle_config a draft trained on this dataset needs on the sglang release that dumped it
        # (the ids read as that release reads them: eaglepatch.conventions, README "Layer ids")
        "sglang_draft_config": _draft_config(meta, hf_aux) if draft is None else drafts.sglang_draft_config(draft),
        "final": {"specforge": "post_norm", "dspark": "post_norm", "compact": meta.get("final")}.get(o.format),
        "model": {"path": str(o.model), "served_path": meta.get("model_path"),
                  "architecture": meta.get("architecture") or cfg.get("architecture"),
                  "hidden_size": cfg["hidden_size"], "num_hidden_layers": n,
                  "vocab_size": cfg["vocab_size"], "dtype": meta.get("dtype"), "tp_size": meta.get("tp_size")},
        "sglang_release": meta.get("sglang_version"),
        "series_version": meta.get("series_version"),
        # the dump metadata every sample's dump shared (the first dump's, compared with every later one)
        "dump_provenance": {k: meta.get(k) for k in PROVENANCE if k in meta},
        "tokenizer": {"path": tok.path, "mask_method": tok.mask_method, "size": len(tok)},
        "max_len": o.max_len,
        # how the samples hold the states (dtype, scales, states rebuilt from the model directory) and
        # which reader takes them: tools/guard.py refuses a dataset the draft's trainer cannot read
        "storage": manifest_storage(o.format, meta, o.hidden_states_backend if o.format == "speculators" else None),
        "data": str(o.data),
        "progress": PROGRESS_FILE,
        "last_run": last_run,
    }
    if draft is not None:
        m["draft"] = drafts.manifest_block(draft)
    if o.format in ("dflash", "dspark"):
        m["layout"] = ("samples/<hh>/<id>-<hash>.ckpt: torch.save dict input_ids [T], loss_mask [T], "
                       "hidden_states [T,L*H] (the draft's layers ascending, as SGLang feeds them)"
                       + (", target_last_hidden_states [T,H] (final, post-norm)" if o.format == "dspark" else ""))
    elif o.format == "specforge":
        m["layout"] = ("samples/<hh>/<id>-<hash>.ckpt: torch.save dict input_ids [T], loss_mask [T], "
                       "hidden_state [1,T,H] (final, post-norm), aux_hidden_state [1,T,L*H] (aux layers ascending)")
    elif o.format == "compact":
        m["layout"] = ("samples/<hh>/<id>-<hash>.safetensors: the dump's tensors as the server stored them "
                       "(<state> [T,H] in the storage dtype with its float32 scale [T,1] when fp8, an embedding of "
                       "image or input_embeds rows only with their positions, input_ids [T], loss_mask [T]) and its "
                       "metadata; states left out are rebuilt from the model directory; read "
                       "with eaglepatch.compact.CompactDataset(OUT, MODEL_DIR)")
    else:
        m["layout"] = ("datasets save_to_disk table (input_ids, loss_mask, seq_len) + hidden_states/hs_<row>.safetensors: "
                       "token_ids [T], hidden_states [T,L+1,H] (aux layers ascending, then layer N-1 before the final norm)")
        # speculators' own fields, in its (and vLLM's) HF-index convention: 0 = embedding, N = last layer pre-norm
        m["speculators"] = {"hidden_states_backend": m["storage"]["speculators_backend"],
                            "eagle_aux_hidden_state_layer_ids": hf_aux, "target_layer_ids": hf_aux,
                            "hidden_states_layer_ids": hf_aux + [n] if hf_aux is not None else None,
                            "verifier_last_hidden_state": {"hf_index": n, "eagle3_id": n - 1, "norm": "pre_norm"},
                            "data_path": ".", "hidden_states_path": "hidden_states", "token_freq_path": "token_freq.pt"}
    return m
