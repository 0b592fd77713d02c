"""The extraction run, stage by stage:

1. read      the conversations, the model's sizes, the tokenizer and what OUT already holds
             (``inputs.read_inputs``); nothing is written before all of it checks out;
2. tokenize  a conversation with the chat template: token ids and assistant loss mask (``tokenize``);
3. request   ``/generate`` with the ids, one new token and the sample's own rid; when its dump file
             (named by sha256 of the rid) is not there yet, flush the server (``request``);
4. validate  the dump against what was sent (rid, prompt, ids, shapes) and against the dataset's
             provenance: the first dump's model, dtype, layers, versions and storage layout; a
             compact dump's fp8 states are dequantised and its left-out states rebuilt from
             --model's weights (``storage.Rebuilder``) (``validate``);
5. write     the sample file in the chosen format (``write``);
6. record    the sample in progress.jsonl (``record``); after the last sample the format's index
             (speculators) and manifest.json (``finish``).

Stages 2-5 run on ``--concurrency`` worker threads, one conversation each; stage 6 runs on the
main thread. With ``--processes P`` the threads are dealt over P worker processes (``procs``: a GIL
and an address space each), which start once a dump has fixed the dataset's provenance and layout;
this process still records every sample. Requests are spread over the ``--server`` URLs (replicas, or one SGLang router) by
``client.SGLangClient``: round robin over the servers that are up, a failed server put aside for a
while and the request sent to the next one. Before the threads start, one conversation is sent
alone to each server in turn: it proves that server writes dumps where we look (behind a router,
the replica the router picks), and the first fixes the dataset's layout
(``writers.resolve_layout``). Every dump is validated, whichever server wrote it, and each sample
is written and recorded once, by this process. A sample's rid is the same on every try of it, on
any server, so two tries converge on one file and two samples never share one: no lock per file.

The dataset's provenance (``PROVENANCE``: the first dump's model path, architecture, dtype, sizes,
layers, final state, series and sglang versions, storage layout) is recorded with the first
sample and compared with every later dump, in this run and in every resumed one: a dump of
another model, dtype, layer set, series or storage layout stops the run (exit 2) before its sample is written, naming the field, both
values and the server.

Every request's rid is recorded in OUT (``record.REQUESTS_FILE``) before it is sent. At the start
and at the end of every run (also one stopped by an error or Ctrl-C), the dump files of recorded
requests that no sample used (failed samples, a killed run's requests in flight) are reported and
removed (kept with ``--keep-dumps``): only files named by this dataset's own rids and holding them,
never another client's (``sweep_unused``).

At the end (``finish``) the dataset is made to hold exactly the samples of the conversations in
``--data`` as it is now: sample files of conversations removed from it (or edited since and not
extracted again) are deleted, then the speculators table and the manifest are written from the
same list. OUT is locked (flock on the directory) for the whole run; a run that fails before
recording any sample leaves no file behind.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import conventions
from ..errors import UsageError
from ..mooncake import StoreError
from ..storage import Rebuilder
from . import drafts
from . import dumps as dumps_mod
from . import record as rec_mod
from .client import NoFlush, RequestError, SGLangClient, TransientError
from .inputs import Inputs, Options, check_options, read_inputs
from .record import PROVENANCE, STORAGE_PROVENANCE, Fatal
from .tokenize import MaskError
from .writers import (FP8, Layout, check_backend, layers_arg, publish_speculators, resolve_layout, restart_with,
                      sample_rel, specforge_trains, speculators_train_flags, stale_temporaries,
                      write_sample)

__all__ = ["Extractor", "Options", "Outcome", "extract"]

_LISTS = ("eagle3_layer_ids", "hf_hidden_state_indices")
STAGES = ("tokenize", "generate", "wait_for_file", "read_validate", "write", "record")
UNUSED_KEEP_S = 24 * 3600  # a request without its file is looked for this long (a server may write it late)


def _serve_tool() -> str:
    """tools/serve.py as a path that works from the current directory (else as the README names it)."""
    p = Path(__file__).resolve().parents[3] / "tools" / "serve.py"
    if not p.is_file():
        return "tools/serve.py"
    try:
        rel = os.path.relpath(p)
    except ValueError:
        return str(p)
    return rel if not rel.startswith("..") else str(p)


_SERVE = _serve_tool()


@dataclass
class Outcome:
    conv_id: str
    index: int
    fp: str
    status: str  # ok | failed | skipped
    reason: str = ""
    rel: str = ""
    nbytes: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    key: str = ""
    rid: str = ""
    truncated: bool = False
    attempts: int = 0


# ---- the run ------------------------------------------------------------------------------------

@contextmanager
def intra_op_threads(workers: int, cores: int | None = None):
    """torch's intra-op threads while ``workers`` threads run samples: this process's cores over the
    workers (at least 1, never more than torch had), restored on exit. Each worker thread that runs a
    torch op gets its own team of intra-op threads, so 32 workers at torch's default of 16 held ~500
    threads on a 16-core host and moved samples 1.13-1.27x slower than with one intra-op thread each
    (benchmarks/extract_threads.py, docs/peers.md)."""
    import torch

    before = torch.get_num_threads()
    cores = cores or len(os.sched_getaffinity(0))
    want = min(before, max(1, cores // max(1, workers)))
    torch.set_num_threads(want)
    try:
        yield want
    finally:
        torch.set_num_threads(before)


class Extractor:
    def __init__(self, opts: Options, log=None):
        self.o = opts
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.lock = threading.Lock()
        self.layout: Layout | None = None
        self.dump_ids: list | None = None
        self.provenance: dict | None = None  # field -> value every dump must have (PROVENANCE)
        self.bad_dumps = 0
        self.unused: set = set()  # rids of this run's requests whose dump no sample has used yet
        self.earlier_removed = 0  # unused dump files of earlier runs removed at the start
        self.reading: str | None = None  # the dataset's layer-id reading (its first dump's), once known
        self.draft = None  # --format dflash|dspark: the draft's ``drafts.DraftSpec`` (``read_inputs``)
        # what rebuilds the states a compact dump leaves out: --model's weights, read on first use
        self.rebuilder = Rebuilder(opts.model)
        # seconds spent per stage, summed over the worker threads (``record`` on the main thread): where
        # a slow run's time goes
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self.finished = 0  # samples of this run recorded so far (finished, failed or skipped)
        self.store = None  # --mooncake-master: the ``eaglepatch.mooncake.StoreReader`` (``open_store``)
        self.workers = None  # --processes: the worker processes (``procs.Workers``), started with the run
        self.intra_op = None  # torch's intra-op threads while the workers run (``intra_op_threads``)
        self.child_counters: dict = {}  # --processes: each worker process's figures so far (``procs``)

    def _spent(self, stage: str, since: float) -> float:
        now = time.monotonic()
        with self.lock:
            self.stage_s[stage] += now - since
        return now

    def stage_line(self) -> str:
        """Seconds per stage so far, one line: where a slow run's time goes."""
        with self.lock:
            spent = dict(self.stage_s)
        for c in list(self.child_counters.values()):  # --processes: the workers' seconds too
            for k, v in (c or {}).get("stage_s", {}).items():
                spent[k] = spent.get(k, 0.0) + v
        threads = ("" if self.intra_op is None or self.o.processes > 1
                   else f"; torch intra-op threads {self.intra_op}")
        return (f"time per stage, summed over the {self.o.concurrency} workers (record: the main thread): "
                + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in spent.items()) + threads)

    def serve_hint(self) -> str:
        """How to start the patched server with the dump on for this run (its flag form)."""
        o = self.o
        if o.mooncake_master is not None:
            return (f"python3 {_SERVE} --model-path {o.model} --dump-dir {o.dump_dir or 'DIR'} --sink mooncake "
                    f"--mooncake-master {o.mooncake_master} --mooncake-metadata {o.mooncake_metadata}")
        return f"python3 {_SERVE} --model-path {o.model} --dump-dir {o.dump_dir}"

    def open_store(self) -> None:
        """--mooncake-master: connect to the store (once the conversations to extract are known)."""
        from ..mooncake import StoreReader

        o = self.o
        try:
            self.store = StoreReader(o.mooncake_master, o.mooncake_metadata)
        except ImportError as exc:
            raise UsageError(f"--mooncake-master reads the store with the mooncake package, which this Python cannot "
                             f"import ({type(exc).__name__}: {exc})",
                             "pip install mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine, -cuda13) "
                             "into the Python that runs extract.py (its native code needs Debian's libibverbs1)") \
                from None
        except StoreError as exc:
            raise UsageError(str(exc), "pass the server's EAGLE3_DUMP_MOONCAKE_MASTER and "
                             "EAGLE3_DUMP_MOONCAKE_METADATA (its mooncake_master must run)") from None

    def run(self) -> int:
        o = self.o
        check_options(o)
        check_backend(o.format, o.hidden_states_backend)
        if o.processes > 1:  # they load (seconds each) while this process reads the inputs; closed below
            from . import procs

            self.workers = procs.Workers(self, intra_op_threads)
        try:
            return self._run_checked(o)
        finally:
            if self.workers is not None:
                self.workers.close()
                self.workers = None

    def _run_checked(self, o) -> int:
        import fcntl

        client = SGLangClient(o.servers, timeout=o.request_timeout, retries=o.retries, log=self.log,
                              flush_timeout=o.dump_timeout)
        # the server is asked before the tokenizer loads (transformers takes seconds to import); a finished
        # dataset reruns without a server
        def check_server():
            client.check_reachable(self.serve_hint())
            if o.mooncake_master is not None:
                self.open_store()

        inp = read_inputs(o, check_server=check_server)
        self.draft = inp.draft
        out = Path(o.out)
        created = not out.exists()
        top = out  # the outermost directory this run creates
        while not top.parent.exists():
            top = top.parent
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise UsageError(f"cannot create --out {out} ({exc.strerror})", "pass a writable directory") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"another extract.py is writing {out}", "wait for it to finish or pass another --out") from None
            for tmp in stale_temporaries(out):  # temporary files of a killed run (never listed as done)
                tmp.unlink(missing_ok=True)
            return self._run_locked(inp, client)
        finally:
            os.close(fd)
            if self.store is not None:
                self.store.close()
                self.store = None
            if not inp.settings.saved:  # nothing recorded: no state of this run stays (its requests swept)
                (out / rec_mod.REQUESTS_FILE).unlink(missing_ok=True)
            if created and not inp.settings.saved:  # nothing recorded: leave no directory behind
                _remove_empty_tree(top)

    def _run_locked(self, inp: Inputs, client: SGLangClient) -> int:
        o = self.o
        if inp.settings.data.get("layout"):
            self.layout = self._recorded_layout(inp)
        recorded = inp.settings.data.get("dump_meta") or {}
        if recorded:  # a resumed dataset: every dump of this run is compared with its first
            recorded = dict(recorded, **dumps_mod.storage_meta(recorded))  # recorded before issue 30: plain
            self.provenance = {k: _norm(k, recorded[k]) for k in PROVENANCE if k in recorded}
            self.reading = recorded.get("layer_id_reading")
        self.earlier_removed = self.sweep_unused(inp, earlier=True)
        t0 = time.monotonic()
        outcomes: list[Outcome] = []
        if inp.pending:
            self.log(f"extracting {len(inp.pending)} of {len(inp.convs)} conversations "
                     f"({len(inp.convs) - len(inp.pending)} already done) from {client.describe()} into {o.out} "
                     f"(--format {o.format})")
            try:
                with intra_op_threads(o.concurrency) as self.intra_op:
                    outcomes = self._run_pending(inp, client, t0)
            except BaseException as exc:  # a stopped run reports and removes its unused dumps too
                if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (tools/extract.py)
                    self.log(f"stopped: {self.finished} sample(s) of this run finished and recorded (kept: the same "
                             f"command goes on from there); {self.stage_line()}")
                try:
                    self.sweep_unused(inp, earlier=False)
                except Exception:  # the stop's own error is the one to report
                    pass
                raise
        else:
            self.log(f"nothing to do: all {len(inp.convs)} conversations are already in {o.out}")
        return self.finish(inp, outcomes, time.monotonic() - t0, client)

    def _recorded_layout(self, inp: Inputs) -> Layout:
        """The layout the dataset was started with; a speculators export for another
        ``--hidden-states-backend`` than this run's is refused (its samples would mix fp8 and model-dtype
        states). Datasets from before the flag recorded none: an fp8 dump's export was fp8."""
        lay = Layout.from_json(inp.settings.data["layout"])
        if lay.format != "speculators":
            return lay
        have = lay.backend or ("fp8" if (inp.settings.data.get("dump_meta") or {}).get("storage_dtype") == FP8
                               else "file")
        if have != self.o.hidden_states_backend:
            raise UsageError(f"{self.o.out} holds a speculators export for --hidden-states-backend {have}, this run "
                             f"asks {self.o.hidden_states_backend}",
                             f"rerun with --hidden-states-backend {have} to resume, or pass a new --out")
        lay = Layout(lay.format, lay.aux, lay.last, lay.num_layers, have)
        inp.settings.data["layout"] = lay.to_json()  # as recorded from now on (written with the next record)
        return lay

    def sweep_unused(self, inp: Inputs, earlier: bool) -> int:
        """Report, and remove (not with ``--keep-dumps``), the dump files of this dataset's own requests
        that no sample used: at the start (``earlier``: what killed or failed runs left) and at the end
        of the run (what this run's failed samples left). Only requests recorded in
        ``REQUESTS_FILE`` are looked at, so no other client's file is touched. Returns how many were
        removed."""
        o = self.o
        out = Path(o.out)
        entries = rec_mod.read_requests(out)
        if not entries:
            return 0
        used = {r["rid"] for r in inp.done.values() if isinstance(r.get("rid"), str)}
        sw = dumps_mod.sweep_unused(entries, used, o.keep_dumps, time.time(), UNUSED_KEEP_S)
        rec_mod.write_requests(out, sw.pending)
        where = ", ".join(sorted({str(p.parent) for p in sw.removed + sw.left}))
        who = (f"earlier runs on {out} requested and never used (failed or interrupted samples)" if earlier else
               "this run requested and did not use (failed samples, or files written after it gave up on them)")
        if sw.removed:
            self.log(f"removed {len(sw.removed)} dump file(s) from {where} that {who}")
        if sw.left:
            why = "--keep-dumps" if o.keep_dumps else "they could not be removed"
            self.log(f"{len(sw.left)} dump file(s) in {where} that {who} are left there ({why})")
        late = [e for e in sw.pending if e["rid"] in self.unused] if not earlier else []
        if late and inp.settings.saved:  # (a run that recorded nothing keeps no state: ``run``)
            self.log(f"{len(late)} request(s) of this run's failed samples have no dump file yet; the next run on "
                     f"{out} removes any that appears")
        return len(sw.removed)

    def _run_pending(self, inp: Inputs, client: SGLangClient, t0: float) -> list:
        from tqdm import tqdm

        o = self.o
        outcomes: list[Outcome] = []
        bar = tqdm(total=len(inp.pending), unit="sample", dynamic_ncols=True, mininterval=0.5, smoothing=0.1,
                   disable=(not sys.stderr.isatty()) if o.progress is None else not o.progress)
        tokens = [0]
        said = [t0]  # when the last progress line was written (without the bar)

        def finish_one(x: Outcome) -> None:
            outcomes.append(x)
            self.finished += 1
            t = time.monotonic()
            self.record(x, inp)
            self._spent("record", t)
            if x.status == "ok":
                tokens[0] += x.tokens
            elif x.status == "failed":
                bar.write(f"failed: conversation {x.conv_id!r}: {x.reason}", file=sys.stderr)
            if bar.disable and t - said[0] >= o.log_every:
                said[0] = t
                self.log(f"progress: {len(outcomes)}/{len(inp.pending)} samples, {tokens[0] / max(t - t0, 1e-9):.0f} "
                         f"tokens/s, {sum(client.flushes)} flushes; {self.stage_line()}")
            bar.set_postfix_str(f"{tokens[0] / max(time.monotonic() - t0, 1e-9):.0f} tok/s", refresh=False)
            bar.update(1)

        try:
            # each server alone until one conversation has been sent to it: it proves the server writes
            # dumps where we look
            rest = iter(inp.pending)
            for server in range(len(client.urls)):
                for c in rest:
                    x = self.process(c, inp, client, probe=server)
                    finish_one(x)
                    if x.attempts:
                        break
            if o.processes > 1:
                self._run_in_processes(inp, client, rest, finish_one)
                return outcomes
            with ThreadPoolExecutor(max_workers=o.concurrency, thread_name_prefix="extract") as pool:
                inflight: set = set()
                try:
                    while True:
                        while len(inflight) < o.concurrency:
                            c = next(rest, None)
                            if c is None:
                                break
                            inflight.add(pool.submit(self.process, c, inp, client))
                        if not inflight:
                            break
                        fin, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                        for f in fin:
                            finish_one(f.result())  # a Fatal in a worker stops the run here
                except BaseException:
                    for f in inflight:
                        f.cancel()
                    raise
        finally:
            bar.close()
        return outcomes

    def _run_in_processes(self, inp: Inputs, client: SGLangClient, rest, finish_one) -> None:
        """--processes: one conversation at a time here until a dump has fixed the dataset's provenance
        and layout (the workers compare every dump with them and never fix them), then the rest in the
        worker processes (``procs``)."""
        from . import procs

        while self.dump_ids is None:
            c = next(rest, None)
            if c is None:
                return
            finish_one(self.process(c, inp, client))
        first = next(rest, None)
        if first is None:
            return
        try:
            counters = self.workers.run(inp, client, itertools.chain([first], rest), finish_one)
        finally:  # on a stop too: no worker holds a conversation or a dump once this run records or sweeps
            self.workers.close()
        procs.merge(self, client, counters)
        self.child_counters = {}

    # ---- stages 2-5, one conversation ---------------------------------------------------------
    def process(self, conv, inp: Inputs, client: SGLangClient, probe: int | None = None) -> Outcome:
        o = self.o
        out = Outcome(conv.id, conv.index, conv.fingerprint, "failed")
        t = time.monotonic()
        enc = self.tokenize(conv, inp, out)
        self._spent("tokenize", t)
        if enc is None:
            return out
        ids, mask = enc.input_ids, enc.loss_mask
        # the sample's own request id, sent with every try on any server: its file is no other's
        out.rid = dumps_mod.new_rid()
        out.key = dumps_mod.rid_key(out.rid)
        path = None  # --mooncake-master: no file; the answer's handle names the request's object
        if self.store is None:
            path = dumps_mod.dump_path(o.dump_dir, out.key)
            rec_mod.note_request(Path(o.out), out.rid, Path(o.dump_dir))  # before it is sent: the file is ours
        with self.lock:
            self.unused.add(out.rid)
        last = ""
        for attempt in range(1, o.max_attempts + 1):
            out.attempts = attempt
            if path is None and attempt > 1:  # never read an object of an earlier try (a bad or a late one)
                self._forget(out.key)
            last, retry, url, src = self.request(ids, out.rid, path, client, probe)
            if last and not retry:
                out.reason = last
                return out
            if last:
                self.log(f"warning: conversation {conv.id!r} attempt {attempt}/{o.max_attempts}: {last}")
                continue
            t = time.monotonic()
            try:
                dump = self.validate(src, ids, out.rid, inp.cfg, url)
            except dumps_mod.BadDump as exc:
                self._spent("read_validate", t)
                last = f"bad dump from {url}: {exc}"
                with self.lock:
                    self.bad_dumps += 1
                self.log(f"warning: conversation {conv.id!r} attempt {attempt}/{o.max_attempts}: {last}")
                if path is not None:
                    dumps_mod.remove_quietly(path)
                continue
            except StoreError as exc:
                self._spent("read_validate", t)
                last = f"cannot read the states {url} answered with from the Mooncake store: {exc}"
                if probe is not None:  # the first request of a server: the store is not the one it puts into
                    raise Fatal(f"the first request sent to {url}: {last}",
                                "pass the server's own EAGLE3_DUMP_MOONCAKE_MASTER and EAGLE3_DUMP_MOONCAKE_METADATA "
                                "as --mooncake-master and --mooncake-metadata (or raise --dump-timeout)") from None
                self.log(f"warning: conversation {conv.id!r} attempt {attempt}/{o.max_attempts}: {last}")
                continue
            t = self._spent("read_validate", t)
            self.write(conv, dump, mask, out)
            if not o.keep_dumps and path is not None:  # (an object is deleted as it is read)
                dumps_mod.remove_quietly(path)
            self._spent("write", t)
            with self.lock:
                self.unused.discard(out.rid)
            return out
        out.reason = last
        if path is None and not o.keep_dumps:
            self._forget(out.key)
        return out

    def _forget(self, key: str) -> None:
        """Delete the request's object from the store, if there (a failed try's)."""
        try:
            self.store.delete(key)
        except Exception:  # noqa: BLE001 - the server removes what nobody deleted after its TTL
            pass

    def tokenize(self, conv, inp: Inputs, out: Outcome):
        """Stage 2. The encoding, or None with ``out`` marked skipped/failed."""
        try:
            enc = inp.tok.encode(conv.messages, self.o.max_len)
        except MaskError as exc:
            out.reason = f"loss mask: {exc}"
            return None
        out.tokens, out.loss_tokens, out.truncated = len(enc.input_ids), sum(enc.loss_mask), enc.truncated
        if not enc.input_ids or not any(enc.loss_mask):
            # no assistant turn at all, or none left after truncation (a mask that misses present turns
            # raised MaskError above)
            out.status = "skipped"
            out.reason = "no assistant tokens" + (" after truncation" if enc.truncated else "")
            return None
        if self.draft is not None and not drafts.has_two_consecutive(enc.loss_mask):
            out.status = "skipped"  # SpecForge's DFlash/DSpark readers raise on such a sample, mid-training
            out.reason = ("no two consecutive assistant tokens (SpecForge 0.2.0's DFlash and DSpark readers refuse "
                          "such a sample)")
            return None
        if max(enc.input_ids) >= inp.cfg["vocab_size"]:
            raise Fatal(f"conversation {conv.id!r} has token id {max(enc.input_ids)} >= the model's vocab_size "
                        f"{inp.cfg['vocab_size']} (tokenizer/model mismatch)", "use the served model's tokenizer")
        return enc

    def request(self, ids, rid: str, path: Path | None, client: SGLangClient, probe: int | None) -> tuple:
        """Stage 3. ('', _, url, source) once the dump file is there (source: its path), else (why not,
        whether a retry may help, url, None); url: the server that answered. When the file is not
        there after the answer, the server is flushed once (its replicas, behind the router) and the
        file read again; the probe always flushes, so a server without the flush is refused at once.
        ``probe``: send to that server only, and stop the run if it fails. ``path`` None
        (--mooncake-master): source is the answer's handle of the request's store object
        (``store_handle``), read by ``validate``."""
        o = self.o
        if path is not None:
            dumps_mod.remove_quietly(path)  # never read a file of an earlier try (a bad one, or a late write)
        t = time.monotonic()
        try:
            answer, i = client.generate(ids, rid=rid, server=probe)
        except RequestError as exc:
            self._spent("generate", t)
            return f"server refused the request: {exc}", False, "", None
        except TransientError as exc:
            self._spent("generate", t)
            if probe is not None or not client.alive():
                who = (f"the server at {client.urls[probe or 0]} stopped answering"
                       if probe is not None or len(client.urls) == 1
                       else f"none of the {len(client.urls)} servers answers")
                raise Fatal(f"{who} ({exc})",
                            "look at the server logs, restart them and rerun (done samples are kept)") from None
            return f"/generate failed: {exc}", True, "", None
        answered, url = self._spent("generate", t), client.urls[i]
        handle = (answer.get("meta_info") or {}).get("eagle3_dump") if isinstance(answer, dict) else None
        if path is None:
            return self.store_handle(handle, rid, url)
        if isinstance(handle, dict) and handle.get("sink") == "mooncake":
            raise Fatal(f"the server at {url} puts each request's states into a Mooncake Store (its answers carry the "
                        f"Mooncake sink's handle), not into dump files in --dump-dir",
                        "read the store: pass --mooncake-master and --mooncake-metadata (the server's "
                        "EAGLE3_DUMP_MOONCAKE_MASTER and EAGLE3_DUMP_MOONCAKE_METADATA) instead of --dump-dir")
        problems = []
        if probe is not None or not path.exists():
            try:
                problems = client.flush(i, answered)
            except NoFlush as exc:
                raise Fatal(*self.no_flush(exc, ids, path)) from None
            finally:
                self._spent("wait_for_file", answered)
        if path.exists():
            return "", False, url, path
        said = (answer.get("meta_info") or {}).get("id") if isinstance(answer, dict) else None
        what = f"rid {rid} (key {path.stem}) from {url}"
        if isinstance(said, str) and said != rid:
            what += f", which answered with rid {said!r}"
        if problems:
            what += f" ({'; '.join(problems)})"
        if probe is not None:
            raise Fatal(*dumps_mod.no_dump_message(Path(o.dump_dir), what, path.stem))
        return f"no dump file {path.name} for {what} after the flush", True, url, None

    def store_handle(self, handle, rid: str, url: str) -> tuple:
        """``request``'s answer for an answer's ``meta_info["eagle3_dump"]`` with --mooncake-master:
        ('', _, url, handle) for the Mooncake sink's handle of this very request; a retry for a request
        the server did not put into the store; Fatal for a server without the Mooncake sink."""
        if not isinstance(handle, dict):
            raise Fatal(f"the server at {url} answered without meta_info['eagle3_dump'], the handle --mooncake-master "
                        f"reads the request's states by (its dump is off, or it runs a series before the Mooncake "
                        f"sink)", f"restart it with this checkout's series and the Mooncake sink: {self.serve_hint()}")
        if handle.get("sink") != "mooncake":
            raise Fatal(f"the server at {url} dumps to the {handle.get('sink')!r} sink (dump files), and "
                        f"--mooncake-master reads a Mooncake Store",
                        f"read its files with --dump-dir DIR (its EAGLE3_DUMP_DIR) instead of --mooncake-master and "
                        f"--mooncake-metadata, or restart it with the Mooncake sink: {self.serve_hint()}")
        state, key = handle.get("state"), dumps_mod.rid_key(rid)
        if handle.get("key") != key:
            return (f"the server at {url} answered rid {rid} with the handle of another object "
                    f"({str(handle.get('key'))[:80]!r}, not {key})"), True, url, None
        if isinstance(state, str) and state.startswith(("not dumped", "failed", "gone")):
            return f"the server at {url} did not put rid {rid} (key {key}) into the store: {state}", True, url, None
        return "", False, url, handle

    def no_flush(self, exc: NoFlush, ids, path: Path) -> tuple[str, str]:
        """(problem, fix) for a server (or replica) without ``POST /eagle3_dump/flush``. A patched
        server adds the route only when its dump is on, so a server that wrote no file for the request
        runs with the dump off; one that wrote it (by the rid, or by the prompt as series before issue
        19 named files) runs a series before the flush."""
        prompt = dumps_mod.dump_path(self.o.dump_dir, dumps_mod.prompt_key(ids))
        for _ in range(10):  # a series before the flush writes on a thread of its own: a moment later
            if path.exists() or prompt.exists():
                return (f"{exc}: it writes dump files but runs a patch series without the dump flush (before "
                        f"0.5.9-4, 0.5.17-3, 0.5.23-4)",
                        "upgrade the series on every server (python3 tools/apply.py, or python3 tools/serve.py "
                        f"--sglang ROOT) and restart it: {self.serve_hint()}")
            time.sleep(0.1)
        return (f"{exc}: the dump is off on that server (it was started without EAGLE3_DUMP_DIR; a patched server "
                f"adds the flush only with its dump on) and it wrote no dump file for the request",
                f"restart it with the dump on: {self.serve_hint()} (it sets EAGLE3_DUMP_DIR); an unpatched server, "
                f"or one of a series before 0.5.9-4, 0.5.17-3, 0.5.23-4, has no flush either: upgrade it with this "
                f"checkout's series")

    def validate(self, src, ids, rid: str, cfg: dict, url: str):
        """Stage 4. The dump (``load``), checked (``check``)."""
        return self.check(self.load(src, ids, rid), cfg, url)

    def load(self, src, ids, rid: str):
        """The dump of the request: from its file (``src`` a path), or from the store object its answer's
        handle names (``src`` the handle, a dict; the object deleted once read, not with --keep-dumps; StoreError
        when it cannot be read within --dump-timeout), checked against the request (rid, prompt, ids);
        BadDump for a dump to retry."""
        if not isinstance(src, dict):  # a dump file's path
            dump = dumps_mod.load_dump(src, ids, hidden_size=None, need_final=False, rid=rid, rebuilder=self.rebuilder)
            dumps_mod.check_dump_dirs(dump.meta, self.o.dump_dir)  # a server spreading over directories not all listed
            return dump
        tensors, meta = self.store.tensors(src, timeout=self.o.dump_timeout, delete=not self.o.keep_dumps)
        return dumps_mod.request_dump(Path("mooncake:" + src["key"]), meta, tensors, ids, hidden_size=None,
                                      need_final=False, rid=rid, rebuilder=self.rebuilder)

    def check(self, dump, cfg: dict, url: str):
        """The dump checked against the model, the dataset's provenance and layout (the first dump fixes
        them); Fatal for a server that does not match the dataset (``url``: the server that answered)."""
        m = _provenance_meta(dump)
        for k in ("hidden_size", "num_hidden_layers"):
            if str(m[k]) != str(cfg[k]):
                raise Fatal(f"the server at {url} serves a model with {k}={m[k]} but --model {self.o.model} has "
                            f"{k}={cfg[k]} (tokenizer/model mismatch)", "pass the served model's directory as --model")
        with self.lock:
            if self.provenance is None:  # the dataset's first dump
                self.provenance = {k: _norm(k, m.get(k)) for k in PROVENANCE}
            self._check_provenance(dump, url)
            if self.dump_ids is None:
                self._first_dump(dump, cfg)
        last = self.layout.last
        if last is not None and dump.final is not None and dump.layers[f"layer.{last}"].equal(dump.final):
            raise Fatal(f"the dump's layer.{last} equals the post-norm final state: the server stores the normalised "
                        f"state as the last layer's output (speculators would normalise it twice)",
                        "serve with a series whose EAGLE-3 id N-1 is the last layer's output before the final norm "
                        "(series version 0.5.9-2 or later)")
        return dump

    def _check_provenance(self, dump, url: str) -> None:
        """Fatal when ``dump`` (written by the server at ``url``) differs from the dataset's first dump in
        a ``PROVENANCE`` field."""
        seen = _provenance_meta(dump)
        for k, want in self.provenance.items():
            have = _norm(k, seen.get(k))
            if have != want:
                fix = ("serve the dataset's model with its dtype, layers and patch series on every server to resume, "
                       "or pass a new --out")
                if k in STORAGE_PROVENANCE:
                    fix = ("restart every server with the dataset's storage (EAGLE3_DUMP_DTYPE, "
                           "EAGLE3_DUMP_REBUILDABLE) to resume, or pass a new --out")
                if k in _LISTS and isinstance(want, list):
                    rule = self.reading or conventions.dump_rule(dump.meta)
                    layers = [h - 1 for h in want] if k == "hf_hidden_state_indices" else want
                    fix = (f"restart every server with the dataset's layers ({restart_with(rule, layers)}) to resume, "
                           f"or pass a new --out")
                raise Fatal(f"the dump {dump.path.name} from {url} has {k}={have!r} but the dataset {self.o.out} was "
                            f"extracted from dumps with {k}={want!r}", fix)

    def _first_dump(self, dump, cfg: dict) -> None:
        """The layout from the first dump; it must equal the one the dataset was started with."""
        rule = conventions.dump_rule(dump.meta)  # --aux-layers reads as this server reads draft ids
        if self.draft is not None:  # DFlash/DSpark: the draft's ids read as its family reads them there
            dl = drafts.draft_layers(self.draft, dump.meta)
            lay = drafts.resolve_layout(self.o.format, dl, dump.layer_ids, dump.final is not None,
                                        cfg["num_hidden_layers"])  # LayoutError: exit 2
            if self.layout is None:
                self.log(f"layers: the {dl.describe()}; hidden_states holds them in layer order"
                         + (", target_last_hidden_states the post-norm final state" if self.o.format == "dspark"
                            else ""))
                if list(self.draft.ids) != sorted(self.draft.ids):
                    self.log(f"warning: the draft names its layers out of layer order ({list(self.draft.ids)}); SGLang "
                             f"feeds them in layer order, as hidden_states holds them (a Hugging Face forward that "
                             f"concatenates them in the config's order feeds the draft something else)")
            self._take_layout(lay, dump, rule)
            return
        want = self.layout.aux if self.layout else (
            conventions.layer_output_ids(rule, self.o.aux_layers) if self.o.aux_layers is not None else None)
        lay = resolve_layout(self.o.format, dump.layer_ids, dump.final is not None, cfg["num_hidden_layers"],
                             list(want) if want is not None else None, rule=rule,
                             asked=self.o.aux_layers if self.layout is None else None,
                             backend=self.o.hidden_states_backend)  # LayoutError: exit 2
        if self.layout is None and self.o.format == "specforge":
            if want is None:
                self.log(f"aux layers: EAGLE-3 ids {list(lay.aux)} (every dumped layer but the last, before the "
                         f"norm: --aux-layers={layers_arg(rule, lay.aux)}); pass --aux-layers= to choose others")
            elif not specforge_trains(lay.aux):
                self.log(f"warning: --aux-layers={','.join(map(str, self.o.aux_layers))} (EAGLE-3 ids "
                         f"{list(lay.aux)}) are not three layers: SpecForge 0.2.0's draft trains on exactly three; "
                         f"its reader loads the dataset, its trainer refuses it")
        self._take_layout(lay, dump, rule)

    def _take_layout(self, lay: Layout, dump, rule: str) -> None:
        """``lay`` (from the first dump) as the dataset's layout, which must be the one it was started with."""
        if self.layout is not None and lay != self.layout:
            layers = (self.provenance or {}).get("eagle3_layer_ids")
            how = f" ({restart_with(rule, layers)})" if isinstance(layers, list) else ""
            raise Fatal(f"the server's dump gives layout {lay.to_json()} but {self.o.out} holds {self.layout.to_json()}",
                        f"restart the server with the dataset's layers{how}, or pass a new --out")
        self.layout, self.dump_ids = lay, list(dump.layer_ids)
        seen = _provenance_meta(dump)
        self.dump_meta = {k: seen.get(k) for k in (*PROVENANCE, "tp_size")}
        self.dump_meta.update({k: _norm(k, dump.meta.get(k)) for k in _LISTS})
        self.dump_meta["layer_id_reading"] = rule
        self.reading = self.reading or rule

    def write(self, conv, dump, mask, out: Outcome) -> None:
        """Stage 5."""
        o = self.o
        rel = sample_rel(o.format, conv.id)
        try:
            nbytes = write_sample(self.layout, Path(o.out), rel, conv.id, dump, mask)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:160]
            raise Fatal(f"cannot write conversation {conv.id!r} into {o.out} ({why})",
                        "free space or fix permissions on --out and rerun (done samples are kept)") from None
        out.status, out.rel, out.nbytes = "ok", rel, nbytes

    # ---- stage 6: record ----------------------------------------------------------------------
    def record(self, x: Outcome, inp: Inputs) -> None:
        if x.status == "failed":
            return
        st = inp.settings
        layout = self.layout.to_json() if self.layout is not None else None
        if layout is not None and st.data.get("layout") != layout:
            st.data.update(layout=layout, dump_meta=self.dump_meta)
            st.save()
        elif not st.saved:
            st.save()
        rec = {"id": x.conv_id, "index": x.index, "fp": x.fp, "file": x.rel or None, "bytes": x.nbytes,
               "tokens": x.tokens, "loss_tokens": x.loss_tokens, "key": x.key, "rid": x.rid or None,
               "truncated": x.truncated}
        if x.status == "skipped":
            rec["skipped"] = x.reason
        rec_mod.append_progress(Path(self.o.out), rec)
        inp.done[x.conv_id] = rec

    def finish(self, inp: Inputs, outcomes: list, wall: float, client: SGLangClient) -> int:
        """Stage 6, after the last sample: the dataset made to hold exactly the samples of ``--data`` as it
        is now (every conversation of the file, also those past ``--limit``), then the speculators table
        and the manifest from that one list."""
        o = self.o
        out = Path(o.out)
        try:
            removed = rec_mod.remove_orphans(out, o.format, inp.done)
        except OSError as exc:
            raise Fatal(f"cannot remove stale samples from {out} ({exc.strerror or exc})",
                        "fix permissions on --out and rerun (done samples are kept)") from None
        if removed:
            self.log(f"removed {removed} sample file(s) of conversations no longer in {o.data} "
                     f"(removed from it, or edited and not extracted again)")
        ok = [x for x in outcomes if x.status == "ok"]
        failed = [x for x in outcomes if x.status == "failed"]
        skipped = [x for x in outcomes if x.status == "skipped"]
        retried = client.retried
        unused = self.sweep_unused(inp, earlier=False)
        last_run = {"wall_s": round(wall, 3), "extracted": len(ok), "failed": len(failed), "skipped": len(skipped),
                    "bad_dumps_rejected": self.bad_dumps, "request_retries": retried, "stale_samples_removed": removed,
                    "unused_dumps_removed": {"earlier_runs": self.earlier_removed, "this_run": unused},
                    "servers": [{"url": u, "answered": n, "put_aside": a, "flushes": f}
                                for u, n, a, f in zip(client.urls, client.answered, client.put_aside, client.flushes)],
                    "stage_seconds": {k: round(v, 3) for k, v in self.stage_s.items()},
                    "concurrency": o.concurrency}
        draft = None
        meta = inp.settings.data.get("dump_meta")
        if self.draft is not None and meta:  # the draft's layers as the dataset's dumps read them
            draft = drafts.draft_layers(self.draft, meta)
        man = rec_mod.manifest(o, inp.cfg, inp.tok, inp.settings, inp.all_convs, inp.done, outcomes, last_run, draft)
        if inp.settings.saved:  # the table first: a manifest is never written beside a stale table
            if o.format == "speculators":
                try:
                    publish_speculators(out, man["files"])
                except OSError as exc:
                    raise Fatal(f"cannot write the speculators table into {out} ({exc.strerror or exc})",
                                "free space or fix permissions on --out and rerun (done samples are kept)") from None
            rec_mod.atomic_json(out / rec_mod.MANIFEST_FILE, man)
        toks = sum(x.tokens for x in ok)
        self.log(
            f"summary: {len(ok)} extracted ({toks} tokens, {sum(x.nbytes for x in ok) / 2**20:.1f} MiB) in {wall:.1f} s "
            f"({len(ok) / wall if wall > 0 else 0:.2f} samples/s, {toks / wall if wall > 0 else 0:.0f} tokens/s); "
            f"{len(inp.convs) - len(inp.pending)} already done; {len(skipped)} skipped "
            f"({'no two consecutive' if self.draft is not None else 'no'} assistant tokens); "
            f"{len(failed)} failed; {self.bad_dumps} bad dumps rejected; {retried} request retries; "
            f"dataset: {man['samples']} samples, {man['tokens']} tokens")
        if draft is not None and man["samples"]:
            cfg = f", model.draft_model_config={Path(draft.spec.config).parent}" if draft.spec.config else ""
            self.log(f"train with SpecForge 0.2.0 (offline): training.strategy={o.format}, "
                     f"data.hidden_states_path={out}{cfg}")
        if o.format == "speculators" and man["samples"]:
            self.log(f"train with speculators: {speculators_train_flags(man, out)}")
        if outcomes:
            self.log(f"{self.stage_line()}; {sum(client.flushes)} flushes")
        if len(client.urls) > 1 and outcomes:
            self.log("requests answered per server: " + ", ".join(
                f"{u} {n}" + (f" (put aside {a}x)" if a else "")
                for u, n, a in zip(client.urls, client.answered, client.put_aside)))
        for x in failed:
            self.log(f"failed: {x.conv_id}: {x.reason}")
        return 1 if failed else 0


def _provenance_meta(dump) -> dict:
    """The dump's metadata with its storage layout spelled out (``dumps.storage_meta``: a plain
    ``eagle3-dump/1`` file's too), as the provenance compares and records it."""
    return dict(dump.meta, **dumps_mod.storage_meta(dump.meta))


def _norm(field: str, value):
    """A provenance value as compared: layer lists as lists of ints (the metadata holds JSON, the
    settings file lists), ``left_out`` as JSON text with sorted keys, the rest as strings (None:
    absent)."""
    if value is None:
        return None
    if field == "left_out":
        try:
            return json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        except (TypeError, ValueError):
            return str(value)
    if field in _LISTS:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return value
        return [int(x) for x in value] if isinstance(value, list) else value
    return str(value)

def _remove_empty_tree(root: Path) -> None:
    """Remove ``root`` and the directories under it that hold no file (a run that recorded nothing)."""
    for d, _, files in os.walk(root, topdown=False):
        if not files:
            try:
                os.rmdir(d)
            except OSError:
                pass


def extract(opts: Options, log=None) -> int:
    return Extractor(opts, log).run()
