"""``--processes P``: stages 2-5 in P worker processes, each with its own interpreter and memory.

One extract process is a ceiling of its own: its worker threads share one GIL (the chat template,
the HTTP client and JSON are pure Python, and every torch call of the sample path takes the GIL
back from them) and one address space (page faults and unmaps of every dump under one memory
lock). With ``--processes P`` the run's ``--concurrency`` threads are dealt over P processes
(``spawn``: a clean interpreter each), which take conversations from one queue, send their requests,
read, validate and write the samples, and hand each outcome back; this process alone records them
(``progress.jsonl``, the settings, the manifest), exactly as with threads.

What the workers check is what the threads check, against a state this process fixed first: the
processes start with the run and load what they need (interpreter, torch, tokenizer: seconds each,
which would otherwise come after this process's own start-up) while this process reads the inputs,
probes each server and extracts one conversation at a time until a dump has fixed the dataset's
provenance and layout; only then does each worker get that state (``Workers.run``'s setup: the state,
the model config, the draft, the chat template's sha256 and the mask method) and take
conversations, so every dump a worker reads is compared with the same provenance, layout and layer
ids, and never fixes them itself. A worker's tokenizer must have the dataset's chat template (its
sha256) and mask method, or the run stops. Each worker loads
what it needs once: the tokenizer, and for compact dumps that leave states out, the weights they are
rebuilt from (``storage.Rebuilder``, read from --model on first use: P copies of the embedding).

A problem that stops the run in a worker (``Fatal``, a layout error, a full disk) stops it here with
the same one line; a worker that dies (killed, out of memory) stops it too, naming its exit, and
the samples it had not handed back are not recorded: the next run extracts them. On a stop the
workers take no new conversation, finish the ones in hand (as the threads do) and exit; one still
running after ``request_timeout`` is killed.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback

from ..errors import UsageError
from .record import Fatal

JOIN_MARGIN_S = 30.0  # beyond --request-timeout, how long a stopping worker may take before it is killed


def shares(total: int, parts: int) -> list[int]:
    """``total`` threads dealt over ``parts`` processes as evenly as they go (the first get one more)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def worker_state(ex) -> dict:
    """What a worker's Extractor checks every dump against, taken from this one once a dump fixed the
    dataset: provenance, layout, layer ids, layer-id reading (recording stays here)."""
    return {"provenance": ex.provenance, "layout": ex.layout, "dump_ids": ex.dump_ids, "reading": ex.reading}


def _exc_message(exc: BaseException) -> tuple:
    """An exception as plain data (an EaglepatchError does not survive pickling: it needs its fix)."""
    from ..errors import EaglepatchError

    if isinstance(exc, EaglepatchError):
        return ("usage", type(exc).__name__, exc.problem, exc.fix, exc.exit_code)
    if isinstance(exc, OSError):
        return ("os", exc.errno, exc.strerror or str(exc), exc.filename)
    return ("bug", type(exc).__name__, str(exc), traceback.format_exc(limit=8))


def _raise(msg: tuple, worker: int):
    """Raise here what worker ``worker`` reported (``_exc_message``)."""
    kind = msg[0]
    if kind == "usage":
        _, name, problem, fix, code = msg
        cls = Fatal if name == "Fatal" else UsageError
        raise cls(problem, fix, exit_code=code)
    if kind == "os":
        _, errno, strerror, filename = msg
        raise OSError(errno, strerror, filename)
    _, name, text, tb = msg
    if os.environ.get("EAGLEPATCH_DEBUG"):
        import sys

        print(f"extract worker process {worker}:\n{tb}", file=sys.stderr, flush=True)
    raise RuntimeError(f"extract worker process {worker}: {name}: {text}")


# ---- the worker process --------------------------------------------------------------------------

def _worker_main(i: int, extractor, intra_op, opts, threads: int, cores: int, setup, tasks, results, stop) -> None:
    """Worker process ``i``: loads what it needs from the options, waits for the run's
    setup (one item of ``setup``: ``Workers.run``'s dict, or None: end), then ``threads`` threads take conversations
    from ``tasks`` until ``None`` or ``stop``; each outcome (and this worker's stage seconds and client
    counters so far) goes to ``results``; ("exit", ...) last. Ctrl-C is the parent's to handle (ignored
    here); a parent that is gone ends the worker. ``extractor``, ``intra_op``: run's ``Extractor``
    class and ``intra_op_threads`` (passed, not imported: run imports this module)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    ex = None
    try:
        from .inputs import Inputs, template_sha256
        from .tokenize import ChatTokenizer

        from .client import SGLangClient

        ex = extractor(opts, log=lambda m: results.put(("log", i, m)))
        tok = ChatTokenizer(opts.tokenizer or opts.model, trust_remote_code=opts.trust_remote_code, mask_method=opts.mask)
        client = SGLangClient(opts.servers, timeout=opts.request_timeout, retries=opts.retries, log=ex.log,
                              flush_timeout=opts.dump_timeout)
        if opts.mooncake_master is not None:
            ex.open_store()
        given = _wait_for_setup(setup, stop, parent)
        if given is None:  # the run ended (or stopped) before a dump fixed the dataset: nothing to do
            _close_store(ex)
            results.put(("exit", i, None))
            return
        have = template_sha256(tok)
        if have != given["template_sha"] or tok.mask_method != given["mask_method"]:
            raise Fatal(f"extract worker process {i} loaded a chat template with sha256 {have[:12]} and mask method "
                        f"{tok.mask_method}, the dataset's are {given['template_sha'][:12]} and {given['mask_method']} "
                        f"(the tokenizer directory changed during the run)",
                        "leave --tokenizer/--model unchanged while extract runs, and rerun")
        ex.draft = given["draft"]
        inp = Inputs(given["cfg"], [], [], tok, {}, [], None, given["draft"])
        client._router = list(given["routers"])  # the servers the parent found to be SGLang's router (flushed per replica)
        for k, v in given["state"].items():
            setattr(ex, k, v)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        results.put(("error", i, _exc_message(exc)))
        _close_store(ex)
        results.put(("exit", i, None))
        return

    def counters() -> dict:
        with ex.lock:
            stage = dict(ex.stage_s)
        return {"stage_s": stage, "bad_dumps": ex.bad_dumps, "answered": list(client.answered),
                "put_aside": list(client.put_aside), "flushes": list(client.flushes), "retried": client.retried}

    def loop() -> None:
        while not stop.is_set():
            if os.getppid() != parent:  # the parent is gone (killed): nobody records what this would do
                stop.set()
                return
            try:
                conv = tasks.get(timeout=0.5)
            except queue.Empty:
                continue
            if conv is None:
                return
            try:
                x = ex.process(conv, inp, client)
            except BaseException as exc:  # noqa: BLE001
                results.put(("error", i, _exc_message(exc)))
                stop.set()
                return
            results.put(("done", i, x, counters()))

    try:
        with intra_op(threads, cores):
            pool = [threading.Thread(target=loop, name=f"extract-{i}-{k}", daemon=True) for k in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
    finally:
        _close_store(ex)
        results.put(("exit", i, counters()))


def _wait_for_setup(setup, stop, parent: int):
    """The run's setup for this worker (``setup``'s next item: ``Workers.run``'s dict), or None when the
    run ends first: None sent, ``stop`` set, or the parent gone."""
    while not stop.is_set() and os.getppid() == parent:
        try:
            return setup.get(timeout=0.5)
        except queue.Empty:
            continue
    return None


def _close_store(ex) -> None:
    if ex is not None and ex.store is not None:
        ex.store.close()


# ---- the parent ----------------------------------------------------------------------------------

class Workers:
    """The run's ``ex.o.processes`` worker processes, started with the run (``__init__``: each loads its
    interpreter, torch and tokenizer while this process reads the inputs and fixes the dataset's
    state), then handed that state and the remaining conversations (``run``); ``close`` ends them.
    ``intra_op``: run's ``intra_op_threads``, which each worker sets its torch threads with."""

    def __init__(self, ex, intra_op):
        import multiprocessing

        o = self.o = ex.o
        self.ex = ex
        ctx = multiprocessing.get_context("spawn")
        self.setup, self.tasks, self.results, self.stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
        cores = len(os.sched_getaffinity(0))
        self.split = shares(o.concurrency, o.processes)
        self.sent = False  # the setup went out: from then on a worker may hold conversations
        self.closed = False
        self.procs = [ctx.Process(target=_worker_main, name=f"extract-worker-{i}",
                                  args=(i, type(ex), intra_op, o, n, max(1, cores // o.processes), self.setup,
                                        self.tasks, self.results, self.stop), daemon=True)
                      for i, n in enumerate(self.split)]
        for p in self.procs:
            p.start()

    def _look_at_workers(self, exited: set) -> None:
        """Stop the run (one line) if a worker not yet exited has died."""
        for i, p in enumerate(self.procs):
            if i not in exited and not p.is_alive() and p.exitcode != 0:
                raise Fatal(f"extract worker process {i} (pid {p.pid}) ended without finishing "
                            f"({_exit_text(p.exitcode)}); the samples it had in hand are not recorded",
                            "look for the cause (memory: dmesg), then run the same command again: done "
                            "samples are kept and the rest are extracted")

    def run(self, inp, client, rest, finish_one) -> dict:
        """Stages 2-5 of the conversations left in the iterator ``rest``, checked against the state
        ``ex`` holds now (``worker_state``), each outcome passed to ``finish_one`` here as it comes
        back. Returns the workers' counters (summed stage seconds, bad dumps, per-server
        answered/put aside/flushes, retries)."""
        o, ex, procs, tasks, results = self.o, self.ex, self.procs, self.tasks, self.results
        ex.log(f"{o.processes} worker processes, {'+'.join(map(str, self.split))} threads")
        setup = {"state": worker_state(ex), "cfg": inp.cfg, "draft": inp.draft, "mask_method": inp.tok.mask_method,
                 # the dataset's, as recorded (read_inputs checked it)
                 "template_sha": inp.settings.data["chat_template_sha256"], "routers": list(client._router)}
        for _ in procs:
            self.setup.put(setup)
        self.sent = True
        counters: dict = {}  # worker -> its latest figures (the stage line reads them as they come)
        ex.child_counters = counters
        exited: set = set()
        inflight = 0
        look_at = 0.0  # when to look next whether every worker is alive
        ended = False  # every conversation handed out and the end sent
        while len(exited) < len(procs):
            while not ended and inflight < o.concurrency:
                c = next(rest, None)
                if c is None:
                    for _ in range(o.concurrency):
                        tasks.put(None)
                    ended = True
                    break
                tasks.put(c)
                inflight += 1
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                msg = None
            if time.monotonic() >= look_at or msg is None:  # a worker that died sends nothing: look at them
                look_at = time.monotonic() + 0.5
                self._look_at_workers(exited)
            if msg is None:
                continue
            kind, i = msg[0], msg[1]
            if kind == "log":
                ex.log(msg[2])
            elif kind == "done":
                inflight -= 1
                counters[i] = msg[3]
                x = msg[2]
                if x.status == "failed" and x.rid:  # (its dump, if one comes late, is swept by the next run)
                    ex.unused.add(x.rid)
                finish_one(x)
            elif kind == "error":
                _raise(msg[2], i)
            elif kind == "exit":
                exited.add(i)
                if msg[2] is not None:
                    counters[i] = msg[2]
        return counters

    def close(self) -> None:
        """End the workers. Before the setup went out they hold nothing and are killed at once (a run that
        ends early, on an error or with nothing to do, does not wait for their start-up); after it, a
        worker takes no new conversation and finishes what it holds, at most ``request_timeout`` +
        ``JOIN_MARGIN_S``, and the rest are killed. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        _stop_workers(self.procs, self.o.request_timeout + JOIN_MARGIN_S if self.sent else 0.0)
        for q in (self.setup, self.tasks, self.results):
            q.cancel_join_thread()
            q.close()


def _stop_workers(procs, wait_s: float) -> None:
    """Wait for the workers to finish what they hold (``stop`` is set), at most ``wait_s``; kill the rest."""
    end = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _exit_text(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def merge(ex, client, counters: dict) -> None:
    """Add the workers' counters into this process's stage seconds and client figures (for the
    manifest's last_run and the summary)."""
    for c in counters.values():
        if not c:
            continue
        with ex.lock:
            for k, v in c["stage_s"].items():
                ex.stage_s[k] = ex.stage_s.get(k, 0.0) + v
        ex.bad_dumps += c["bad_dumps"]
        for name in ("answered", "put_aside", "flushes"):
            mine = getattr(client, name)
            for j, v in enumerate(c[name]):
                mine[j] += v
        client.retried += c["retried"]
