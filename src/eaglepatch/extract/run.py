"""The extraction run: conversations -> /generate -> validated dumps -> dataset + manifest.

Layout of ``OUT``::

    manifest.json            rewritten (atomically) at the end of every run
    progress.jsonl           one line per completed sample, appended after its file is in place
    .extract-settings.json   the settings the dataset was started with (resume refuses others)
    rows_0-5000/data_<i>.ckpt|.safetensors

A sample is done when ``progress.jsonl`` lists it and its file is on disk with the recorded size;
a rerun skips done samples and does the rest, so a killed run resumes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import dumps as dumps_mod
from .client import RequestError, SGLangClient, TransientError
from .data import load_conversations
from .tokenize import ChatTokenizer
from .writers import FORMATS, write_sample

MANIFEST_FORMAT = "eaglepatch-hidden-states/1"
SETTINGS_FILE = ".extract-settings.json"
PROGRESS_FILE = "progress.jsonl"
MANIFEST_FILE = "manifest.json"


@dataclass
class Options:
    server: str
    model: Path
    data: Path
    dump_dir: Path
    out: Path
    format: str = "specforge"
    tokenizer: Path | None = None
    max_len: int = 2048
    concurrency: int = 4
    dump_timeout: float = 60.0
    request_timeout: float = 600.0
    retries: int = 5
    max_attempts: int = 3
    keep_dumps: bool = False
    limit: int | None = None
    mask: str = "auto"
    trust_remote_code: bool = False
    progress: bool | None = None  # None: only on a terminal


class Fatal(UsageError):
    """A problem that stops the whole run (exit 2)."""


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {path} ({exc.strerror or exc})",
                         "free space or fix permissions on --out and rerun (done samples are kept)") from None


def model_config(model_dir: Path) -> dict:
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{cfg_path} does not exist", "pass the served model's directory (with config.json) as --model")
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config") or cfg  # multimodal wrappers keep the text model's sizes there
    out = {}
    for k in ("vocab_size", "hidden_size", "num_hidden_layers"):
        v = text.get(k, cfg.get(k))
        if not isinstance(v, int):
            raise UsageError(f"{cfg_path} has no integer {k}", "pass the served model's directory as --model")
        out[k] = v
    archs = cfg.get("architectures") or []
    out["architecture"] = archs[0] if archs else None
    return out


@dataclass
class Outcome:
    conv_id: str
    index: int
    status: str  # ok | failed | skipped
    reason: str = ""
    rel: str = ""
    nbytes: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    key: str = ""
    truncated: bool = False
    attempts: int = 0


@dataclass
class State:
    layer_ids: list | None = None
    hf_indices: list | None = None
    dump_meta: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    key_locks: dict = field(default_factory=dict)
    bad_dumps: int = 0


class Extractor:
    def __init__(self, opts: Options, log=None):
        self.o = opts
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.state = State()

    # ---- set-up checks ------------------------------------------------------------------
    def _check_dirs(self) -> None:
        o = self.o
        if o.format not in FORMATS:
            raise UsageError(f"--format {o.format!r} is not known", f"use one of {', '.join(FORMATS)}")
        d = Path(o.dump_dir)
        if not d.is_dir():
            raise UsageError(f"dump directory {d} is not visible on this machine (not an existing directory)",
                             "pass the server's EAGLE3_DUMP_DIR as this machine sees it (a shared mount) with --dump-dir")
        if not os.access(d, os.R_OK | os.X_OK):
            raise UsageError(f"dump directory {d} is not readable by this user",
                             "make it readable or run as a user who can read it")
        if not os.access(d, os.W_OK) and not o.keep_dumps:
            raise UsageError(f"dump directory {d} is not writable by this user (used dumps are removed)",
                             "make it writable or pass --keep-dumps")
        try:
            Path(o.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create --out {o.out} ({exc.strerror})", "pass a writable directory") from None

    def _settings(self, cfg: dict, tok: ChatTokenizer) -> dict:
        o = self.o
        want = {"format": o.format, "max_len": o.max_len, "mask_method": tok.mask_method,
                "model": {"hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_hidden_layers"],
                          "vocab_size": cfg["vocab_size"]},
                "layer_ids": None, "hf_hidden_state_indices": None}
        path = Path(o.out) / SETTINGS_FILE
        if path.is_file():
            have = json.loads(path.read_text())
            for k in ("format", "max_len", "mask_method", "model"):
                if have.get(k) != want[k]:
                    raise UsageError(f"{o.out} holds a dataset made with {k}={have.get(k)!r}, this run has {want[k]!r}",
                                     "rerun with the same settings to resume, or pass a new --out")
            self.state.layer_ids = have.get("layer_ids")
            self.state.hf_indices = have.get("hf_hidden_state_indices")
            self.state.dump_meta = have.get("dump_meta") or {}
            return have
        _atomic_json(path, want)
        return want

    def _save_layers(self, settings: dict) -> None:
        settings = dict(settings, layer_ids=self.state.layer_ids,
                        hf_hidden_state_indices=self.state.hf_indices, dump_meta=self.state.dump_meta)
        _atomic_json(Path(self.o.out) / SETTINGS_FILE, settings)

    # ---- progress record ----------------------------------------------------------------
    def _load_done(self) -> dict:
        path = Path(self.o.out) / PROGRESS_FILE
        done = {}
        if not path.is_file():
            return done
        for raw in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:  # a torn last line of a killed run
                continue
            if not isinstance(rec, dict) or "id" not in rec:
                continue
            if rec.get("skipped"):  # nothing to extract (no assistant tokens): done as well
                done[rec["id"]] = rec
                continue
            f = Path(self.o.out) / (rec.get("file") or "")
            if rec.get("file") and f.is_file() and f.stat().st_size == rec.get("bytes"):
                done[rec["id"]] = rec
        return done

    def _append_done(self, rec: dict) -> None:
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(Path(self.o.out) / PROGRESS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.write(fd, line) != len(line):  # one write on an O_APPEND fd: whole, or torn (ignored on read)
                    raise OSError(28, "short write to progress.jsonl")
            finally:
                os.close(fd)
        except OSError as exc:
            raise Fatal(f"cannot record progress in {self.o.out} ({exc.strerror or exc})",
                        "free space or fix permissions on --out and rerun (done samples are kept)") from None

    # ---- one sample -----------------------------------------------------------------------
    def _key_lock(self, key: str) -> threading.Lock:
        with self.state.lock:
            return self.state.key_locks.setdefault(key, threading.Lock())

    def _check_layers(self, dump) -> None:
        st = self.state
        with st.lock:
            if st.layer_ids is None:
                st.layer_ids, st.hf_indices = list(dump.layer_ids), list(dump.hf_indices)
                st.dump_meta = {k: dump.meta.get(k) for k in (
                    "architecture", "model_path", "hidden_size", "num_hidden_layers", "dtype", "sglang_version",
                    "series_version", "tp_size", "final")}
                self._new_layers = True
                return
        if list(dump.layer_ids) != st.layer_ids:
            raise Fatal(f"the server dumps EAGLE-3 layers {dump.layer_ids} but {self.o.out} holds layers {st.layer_ids}",
                        "restart the server with the dataset's EAGLE3_DUMP_LAYERS, or pass a new --out")

    def _check_model(self, dump, cfg: dict) -> None:
        m = dump.meta
        for k in ("hidden_size", "num_hidden_layers"):
            if int(m[k]) != cfg[k]:
                raise Fatal(f"the server serves a model with {k}={m[k]} but --model {self.o.model} has {k}={cfg[k]} "
                            f"(tokenizer/model mismatch)", "pass the served model's directory as --model")

    def process(self, conv, tok: ChatTokenizer, client: SGLangClient, cfg: dict, probe: bool = False) -> Outcome:
        o = self.o
        enc = tok.encode(conv.messages, o.max_len)
        ids, mask = enc.input_ids, enc.loss_mask
        out = Outcome(conv.id, conv.index, "failed", tokens=len(ids), loss_tokens=sum(mask), truncated=enc.truncated)
        if not ids or not any(mask):
            out.status, out.reason = "skipped", "no assistant tokens" + (" after truncation" if enc.truncated else "")
            return out
        if max(ids) >= cfg["vocab_size"]:
            raise Fatal(f"conversation {conv.id!r} has token id {max(ids)} >= the model's vocab_size "
                        f"{cfg['vocab_size']} (tokenizer/model mismatch)", "use the served model's tokenizer")
        key = dumps_mod.dump_key(ids)
        out.key = key
        path = dumps_mod.dump_path(o.dump_dir, key)
        last = ""
        with self._key_lock(key):
            for attempt in range(1, o.max_attempts + 1):
                out.attempts = attempt
                dumps_mod.remove_quietly(path)  # never read a stale dump of an earlier request
                try:
                    client.generate(ids)
                except RequestError as exc:
                    out.reason = f"server refused the request: {exc}"
                    return out
                except TransientError as exc:
                    last = f"/generate failed: {exc}"
                    if probe or not client.alive():
                        raise Fatal(f"the server at {o.server} stopped answering ({exc})",
                                    "look at the server log, restart it and rerun (done samples are kept)") from None
                    continue
                if not dumps_mod.wait_for(path, o.dump_timeout):
                    if probe:
                        raise Fatal(*self._no_dump_message())
                    last = f"no dump file {path.name} appeared within {o.dump_timeout:g} s"
                    continue
                try:
                    dump = dumps_mod.load_dump(path, ids, hidden_size=None)
                    self._check_model(dump, cfg)
                except dumps_mod.BadDump as exc:
                    last = f"bad dump {exc}"
                    with self.state.lock:
                        self.state.bad_dumps += 1
                    self.log(f"warning: conversation {conv.id!r} attempt {attempt}/{o.max_attempts}: {last}")
                    dumps_mod.remove_quietly(path)
                    continue
                self._check_layers(dump)
                try:
                    rel, nbytes = write_sample(o.format, Path(o.out), conv.index, conv.id, dump, mask)
                except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
                    why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:160]
                    raise Fatal(f"cannot write conversation {conv.id!r} into {o.out} ({why})",
                                "free space or fix permissions on --out and rerun (done samples are kept)") from None
                if not o.keep_dumps:
                    dumps_mod.remove_quietly(path)
                out.status, out.rel, out.nbytes = "ok", rel, nbytes
                return out
        out.reason = last
        return out

    def _no_dump_message(self):
        o = self.o
        others = dumps_mod.any_server_dumps(Path(o.dump_dir))
        if others:
            return (f"/generate answered but no dump for the request appeared in {o.dump_dir} within "
                    f"{o.dump_timeout:g} s, although the directory holds {len(others)} other dump(s)",
                    "look for 'EAGLE3_DUMP_DIR: dump ... failed' in the server log (a full disk?) or raise --dump-timeout")
        return (f"/generate answered but no dump file appeared in {o.dump_dir} within {o.dump_timeout:g} s: "
                f"the server is not the patched sglang, runs without EAGLE3_DUMP_DIR, or writes to a directory "
                f"that is not {o.dump_dir} on this machine",
                "start the patched server with EAGLE3_DUMP_DIR=<dir> and pass that same directory, as this "
                "machine sees it, with --dump-dir")

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> int:
        import fcntl

        self._new_layers = False
        self._check_dirs()
        with open(Path(self.o.out) / ".extract.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"another extract.py is writing {self.o.out}",
                                 "wait for it to finish or pass another --out") from None
            # temporary files of a killed run (never listed in progress.jsonl)
            for tmp in Path(self.o.out).glob("rows_*/.data_*.tmp"):
                tmp.unlink(missing_ok=True)
            return self._run_locked()

    def _run_locked(self) -> int:
        o = self.o
        cfg = model_config(o.model)
        convs = load_conversations(o.data)
        if o.limit is not None:
            convs = convs[: o.limit]
        done = self._load_done()
        pending = [c for c in convs if c.id not in done]
        client = SGLangClient(o.server, timeout=o.request_timeout, retries=o.retries)
        if pending:  # a finished dataset reruns without a server
            self.server_info = client.server_info()
        tok = ChatTokenizer(o.tokenizer or o.model, trust_remote_code=o.trust_remote_code, mask_method=o.mask)
        if len(tok) > cfg["vocab_size"]:
            raise UsageError(f"the tokenizer in {tok.path} has {len(tok)} tokens but the model's vocab_size is "
                             f"{cfg['vocab_size']} (tokenizer/model mismatch)",
                             "pass the served model's own tokenizer with --tokenizer")
        settings = self._settings(cfg, tok)
        t0 = time.monotonic()
        outcomes: list[Outcome] = []
        if pending:
            self.log(f"extracting {len(pending)} of {len(convs)} conversations ({len(convs) - len(pending)} already done) "
                     f"from {o.server} into {o.out} (--format {o.format})")
            outcomes = self._run_pending(pending, tok, client, cfg, settings, done, t0)
        else:
            self.log(f"nothing to do: all {len(convs)} conversations are already in {o.out}")
        wall = time.monotonic() - t0
        self.retried = client.retried
        manifest = self._write_manifest(convs, cfg, tok, outcomes, wall)
        ok = [x for x in outcomes if x.status == "ok"]
        failed = [x for x in outcomes if x.status == "failed"]
        skipped = [x for x in outcomes if x.status == "skipped"]
        toks = sum(x.tokens for x in ok)
        self.log(
            f"summary: {len(ok)} extracted ({toks} tokens, {sum(x.nbytes for x in ok) / 2**20:.1f} MiB) in {wall:.1f} s "
            f"({len(ok) / wall if wall > 0 else 0:.2f} samples/s, {toks / wall if wall > 0 else 0:.0f} tokens/s); "
            f"{len(convs) - len(pending)} already done; {len(skipped)} skipped (no assistant tokens); "
            f"{len(failed)} failed; {self.state.bad_dumps} bad dumps rejected; {self.retried} request retries; "
            f"dataset: {manifest['samples']} samples, {manifest['tokens']} tokens")
        for x in failed:
            self.log(f"failed: {x.conv_id}: {x.reason}")
        return 1 if failed else 0

    def _record(self, x: Outcome, done: dict) -> None:
        rec = {"id": x.conv_id, "index": x.index, "file": x.rel or None, "bytes": x.nbytes, "tokens": x.tokens,
               "loss_tokens": x.loss_tokens, "key": x.key, "truncated": x.truncated}
        if x.status == "skipped":
            rec["skipped"] = x.reason
        self._append_done(rec)
        done[x.conv_id] = rec

    def _run_pending(self, pending, tok, client, cfg, settings, done, t0) -> list:
        from tqdm import tqdm

        o = self.o
        outcomes: list[Outcome] = []
        bar = tqdm(total=len(pending), unit="sample", dynamic_ncols=True, mininterval=0.5, smoothing=0.1,
                   disable=(not sys.stderr.isatty()) if o.progress is None else not o.progress)
        tokens = [0]

        def finish(x: Outcome) -> None:
            outcomes.append(x)
            if x.status == "ok":
                self._record(x, done)
                tokens[0] += x.tokens
            elif x.status == "skipped":
                self._record(x, done)
            elif x.status == "failed":
                bar.write(f"failed: conversation {x.conv_id!r}: {x.reason}", file=sys.stderr)
            if self._new_layers:
                self._new_layers = False
                self._save_layers(settings)
            el = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(f"{tokens[0] / el:.0f} tok/s", refresh=False)
            bar.update(1)

        try:
            # the first request alone: it proves the server writes dumps where we look
            first = self.process(pending[0], tok, client, cfg, probe=True)
            finish(first)
            rest = iter(pending[1:])
            with ThreadPoolExecutor(max_workers=max(1, o.concurrency), thread_name_prefix="extract") as pool:
                inflight = set()
                try:
                    while True:
                        while len(inflight) < max(1, o.concurrency):
                            c = next(rest, None)
                            if c is None:
                                break
                            inflight.add(pool.submit(self.process, c, tok, client, cfg))
                        if not inflight:
                            break
                        fin, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                        for f in fin:
                            finish(f.result())  # a Fatal in a worker stops the run here
                except BaseException:
                    for f in inflight:
                        f.cancel()
                    raise
        finally:
            bar.close()
        return outcomes

    def _write_manifest(self, convs, cfg, tok, outcomes, wall) -> dict:
        o = self.o
        done = self._load_done()
        ids = {c.id for c in convs}
        recs = [r for i, r in done.items() if i in ids and not r.get("skipped")]
        failed = sorted(({"id": x.conv_id, "reason": x.reason} for x in outcomes if x.status == "failed"),
                        key=lambda r: r["id"])
        skipped = sorted(({"id": i, "reason": r["skipped"]} for i, r in done.items() if i in ids and r.get("skipped")),
                         key=lambda r: r["id"])
        st = self.state
        meta = st.dump_meta or {}
        aux_slots = [f"eagle3:{k}" for k in (st.layer_ids or [])]
        manifest = {
            "format": MANIFEST_FORMAT,
            "dataset_format": o.format,
            "layout": ("rows_<a>-<b>/data_<i>.ckpt: torch.save dict input_ids [T], loss_mask [T], "
                       "hidden_state [1,T,H] (final, post-norm), aux_hidden_state [1,T,L*H]")
            if o.format == "specforge" else
            ("rows_<a>-<b>/data_<i>.safetensors: token_ids [T], hidden_states [T,L+1,H] "
             "(aux layers, then final post-norm), loss_mask [T]"),
            "samples": len(recs),
            "tokens": sum(r["tokens"] for r in recs),
            "loss_tokens": sum(r.get("loss_tokens", 0) for r in recs),
            "bytes": sum(r["bytes"] for r in recs),
            "conversations": len(convs),
            "failed": failed,
            "failed_ids": [r["id"] for r in failed],
            "skipped": skipped,
            "eagle3_layer_ids": st.layer_ids,
            "hf_hidden_state_indices": st.hf_indices,
            "aux_order": aux_slots,
            "hidden_states_slots": aux_slots + ["final:post_norm"] if o.format == "speculators" else None,
            "final": meta.get("final", "post_norm"),
            "model": {"path": str(o.model), "served_path": meta.get("model_path"),
                      "architecture": meta.get("architecture") or cfg.get("architecture"),
                      "hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_hidden_layers"],
                      "vocab_size": cfg["vocab_size"], "dtype": meta.get("dtype"), "tp_size": meta.get("tp_size")},
            "sglang_release": meta.get("sglang_version"),
            "series_version": meta.get("series_version"),
            "tokenizer": {"path": tok.path, "mask_method": tok.mask_method, "size": len(tok)},
            "max_len": o.max_len,
            "data": str(o.data),
            "progress": PROGRESS_FILE,
            "last_run": {"wall_s": round(wall, 3), "extracted": sum(1 for x in outcomes if x.status == "ok"),
                         "failed": len(failed), "skipped": sum(1 for x in outcomes if x.status == "skipped"),
                         "bad_dumps_rejected": st.bad_dumps, "request_retries": self.retried},
        }
        _atomic_json(Path(o.out) / MANIFEST_FILE, manifest)
        return manifest


def extract(opts: Options, log=None) -> int:
    return Extractor(opts, log).run()
