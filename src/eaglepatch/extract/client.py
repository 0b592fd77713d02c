"""HTTP client for SGLang's native ``/generate`` on one or more servers: token ids in, one new token out.

A server is a patched SGLang replica or SGLang's router (``sglang-router``) in front of replicas;
every server must write its dumps into the one directory the client reads (a shared filesystem
when they run on other machines). Every request carries the client's own ``rid`` and its dump is
named by sha256 of it, so it does not matter which server prefilled a request.

Spreading and failover, kept simple:

- Requests go round robin over the servers that are up (one counter shared by all threads).
- A transient failure (connection refused/reset, timeout, HTTP 429/500/502/503/504, an answer that
  is not JSON) puts that server aside for ``cooldown`` seconds, logged once, and the request is
  sent at once to the next server that is up. A server put aside gets requests again when its
  cooldown has passed; its first answer puts it back (logged).
- When every server that was up has failed the request (or none was up, in which case all are
  tried), that is one failed attempt of the retry policy: wait (exponential backoff, 0.5 s
  doubling, at most 10 s) and go round again, ``retries`` times, then raise ``TransientError``.
  With one server this is exactly the single-server retry policy.
- Any other HTTP error (the request itself is wrong) raises ``RequestError`` without a retry.
- ``generate(ids, server=i)`` sends to server ``i`` only (the run's probe of each server).

A request retried elsewhere after a server died mid-prefill may have been prefilled twice; it
carries the same rid both times, both replicas write the same file through a temporary name and a
rename, so the file is whole either way, and the run writes the sample once.

Flush (``flush``): ``POST /eagle3_dump/flush`` returns once every request the server prefilled
before it is on disk. Behind SGLang's router, which has no such route (it answers 404), every
replica the router lists (``GET /workers``) is flushed. Flushes of one server are coalesced: a
caller whose answer came before a flush of that server started, and that flush succeeded, is
covered by it and sends none. A server (or replica) answering 404 has no flush: ``NoFlush`` (its dump
is off, or it runs a series before the flush; ``run`` tells which from the dump directory).
"""

from __future__ import annotations

import threading
import time

import requests

from ..errors import UsageError

TRANSIENT_STATUS = {429, 500, 502, 503, 504}
WORKERS_TRIES = 3  # GET /workers of a server whose flush answered 404 (is it SGLang's router?)


class TransientError(Exception):
    """A request that failed after every retry on transient errors."""


class RequestError(Exception):
    """The server refused the request (non-transient HTTP error)."""


class NoFlush(Exception):
    """A server (or a replica behind the router) without ``POST /eagle3_dump/flush``: a patched
    server whose dump is off (it adds the route only with ``EAGLE3_DUMP_DIR`` set), an unpatched
    one, or one of a series before the flush. ``url``: that server or replica; ``router``: the
    router it is behind, or None."""

    def __init__(self, url: str, router: str | None = None):
        behind = f" (a replica behind the router {router})" if router else ""
        super().__init__(f"{url}{FLUSH}{behind} answered HTTP 404")
        self.url, self.router = url, router


FLUSH = "/eagle3_dump/flush"


class SGLangClient:
    def __init__(self, urls, timeout: float = 300.0, retries: int = 5, backoff: float = 0.5, cooldown: float = 30.0,
                 log=None, flush_timeout: float = 60.0):
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        self.retries = retries
        self.backoff = backoff
        self.cooldown = cooldown
        self.log = log or (lambda m: None)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._next = 0
        self._aside_until = [0.0] * len(self.urls)  # 0: up; else put aside until then (monotonic)
        self.answered = [0] * len(self.urls)  # requests answered, per server
        self.put_aside = [0] * len(self.urls)  # times a server was put aside
        self.retried = 0  # transient failures followed by another try (all threads, all servers)
        self.flushes = [0] * len(self.urls)  # flush rounds sent, per server
        self._flush_locks = [threading.Lock() for _ in self.urls]
        self._flushed_at = [float("-inf")] * len(self.urls)  # start (monotonic) of the last good flush round
        self._router = [False] * len(self.urls)  # the server is SGLang's router: flush its replicas

    def describe(self) -> str:
        return self.urls[0] if len(self.urls) == 1 else f"{len(self.urls)} servers ({', '.join(self.urls)})"

    def _session(self, i) -> requests.Session:
        """This thread's session for server ``i`` (or for a replica's URL behind the router)."""
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = {}
        if i not in sessions:
            sessions[i] = requests.Session()
        return sessions[i]

    def _get_model_info(self, i: int, timeout: float):
        """Server ``i``'s answer to ``GET /get_model_info`` (raises what requests raises)."""
        return self._session(i).get(self.urls[i] + "/get_model_info", timeout=timeout)

    def check_reachable(self, start: str = "python3 tools/serve.py --model-path MODEL --dump-dir DIR") -> None:
        """Every server answers ``/get_model_info`` with JSON and is past its warm-up (``/health`` not
        503), in order; a usage error names the first that is not, and how to ``start`` one (the
        patched server with the dump on)."""
        for i, url in enumerate(self.urls):
            fix = f"start it with {start} (the patched SGLang with the dump on) or fix --server"
            if len(self.urls) > 1:
                fix = f"start it ({start}) or leave it out of --server"
            try:
                r = self._get_model_info(i, min(self.timeout, 30))
            except (requests.RequestException, ValueError) as exc:  # ValueError: a URL urllib3 cannot parse
                raise UsageError(f"cannot reach the SGLang server at {url} ({type(exc).__name__})", fix) from None
            if r.status_code != 200:
                raise UsageError(f"{url}/get_model_info answered HTTP {r.status_code}",
                                 "point --server at an SGLang server or router (http://HOST:PORT)")
            try:
                r.json()
            except ValueError:
                raise UsageError(f"{url}/get_model_info did not answer JSON",
                                 "point --server at an SGLang server or router (http://HOST:PORT)") from None
            try:  # SGLang answers 503 while its warm-up runs (requests before its end are not dumped)
                starting = self._session(i).get(url + "/health", timeout=min(self.timeout, 30)).status_code == 503
            except requests.RequestException:
                starting = False
            if starting:
                raise UsageError(f"the server at {url} is starting or stopping (its /health answers 503); requests "
                                 f"sent before its warm-up ends are not dumped",
                                 "wait until its log says 'The server is fired up and ready to roll!' and rerun")

    def alive(self) -> bool:
        """Whether any server answers ``/get_model_info``."""
        for i in range(len(self.urls)):
            try:
                if self._get_model_info(i, 30).status_code == 200:
                    return True
            except requests.RequestException:
                continue
        return False

    def _round(self, pinned: int | None) -> list:
        """The servers to try, in order, for one attempt: the next ones round robin that are up,
        or all of them when none is."""
        if pinned is not None:
            return [pinned]
        n = len(self.urls)
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % n
            order = [(start + k) % n for k in range(n)]
            now = time.monotonic()
            up = [i for i in order if self._aside_until[i] <= now]
        return up or order

    def _failed(self, i: int, why: str) -> None:
        if len(self.urls) == 1:
            return
        with self._lock:
            was_up = self._aside_until[i] == 0.0
            self._aside_until[i] = time.monotonic() + self.cooldown
            if was_up:
                self.put_aside[i] += 1
        if was_up:
            self.log(f"warning: server {self.urls[i]} failed ({why}); its requests go to the other servers, "
                     f"it is tried again in {self.cooldown:g} s")

    def _answered(self, i: int) -> None:
        with self._lock:
            self.answered[i] += 1
            back = self._aside_until[i] != 0.0
            self._aside_until[i] = 0.0
        if back:
            self.log(f"server {self.urls[i]} answers again")

    def generate(self, input_ids: list, rid: str | None = None, server: int | None = None) -> tuple[dict, int]:
        """(the answer, the index of the server that gave it); ``rid`` goes with every try."""
        payload = {"input_ids": list(map(int, input_ids)),
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if rid is not None:
            payload["rid"] = rid
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * (2 ** (attempt - 1)), 10.0))
            for i in self._round(server):
                if last is not None:
                    with self._lock:
                        self.retried += 1
                answer, why = self._post(i, payload)
                if why is None:
                    return answer, i
                last = f"{self.urls[i]}: {why}"
                self._failed(i, why)
        raise TransientError(f"{self.retries + 1} attempts failed, last: {last}")

    def _post(self, i: int, payload: dict):
        """(the answer, None), or (None, why a transient failure happened)."""
        try:
            r = self._session(i).post(self.urls[i] + "/generate", json=payload, timeout=self.timeout)
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as exc:
            # a server (or a router's replica) that dies mid-answer cuts the body: IncompleteRead
            self._local.sessions.pop(i, None)  # drop a possibly broken connection
            return None, f"{type(exc).__name__}: {str(exc)[:160]}"
        if r.status_code in TRANSIENT_STATUS:
            return None, f"HTTP {r.status_code}: {r.text[:160]}"
        if r.status_code != 200:
            raise RequestError(f"HTTP {r.status_code}: {r.text[:300]}")
        try:
            out = r.json()
        except ValueError:
            return None, "answer is not JSON"
        self._answered(i)
        return out, None

    # ---- flush -------------------------------------------------------------------------------
    def flush(self, i: int, since: float) -> list:
        """Make every request server ``i`` answered before ``since`` (``time.monotonic()``) be on disk:
        one flush round, unless a round that started after ``since`` succeeded already. Returns the
        problems of the round (a replica or server that could not be flushed, one line each; empty:
        all flushed); raises ``NoFlush`` for a server without the endpoint."""
        with self._flush_locks[i]:
            if self._flushed_at[i] >= since:
                return []
            start = time.monotonic()
            problems = self._flush_round(i)
            with self._lock:
                self.flushes[i] += 1
            if not problems:
                self._flushed_at[i] = start
            return problems

    def _flush_round(self, i: int) -> list:
        url = self.urls[i]
        if not self._router[i]:
            status, why = self._flush_one(i, url)
            if status != 404:
                if why and status is None:  # it answered the request, then went away
                    self._failed(i, why)
                return [f"{url}{FLUSH}: {why}"] if why else []
            replicas, why = self._replicas(i)
            if why:  # no answer at /workers: unknown whether a router, so neither NoFlush nor a router yet
                return [f"{url}{FLUSH} answered HTTP 404 and {url}/workers did not answer: {why}"]
            if replicas is None:
                raise NoFlush(url)
            self._router[i] = True
            self.log(f"{url} is SGLang's router ({len(replicas)} replicas): its replicas are flushed directly")
        else:
            replicas, why = self._replicas(i)
            if replicas is None:
                return [f"{url}/workers: {why or 'the router does not list its replicas'}"]
        problems = []
        for r in replicas:
            status, why = self._flush_one(r, r)
            if status == 404:
                raise NoFlush(r, router=url)
            if why:
                problems.append(f"{r}{FLUSH} (behind {url}): {why}")
        return problems

    def _flush_one(self, session_key, url: str) -> tuple:
        """(HTTP status or None, why it did not flush or '') of one ``POST /eagle3_dump/flush``."""
        try:
            r = self._session(session_key).post(url + FLUSH, json={"timeout": self.flush_timeout},
                                                timeout=self.flush_timeout + 30)
        except (requests.ConnectionError, requests.Timeout) as exc:
            self._local.sessions.pop(session_key, None)
            return None, f"{type(exc).__name__}: {str(exc)[:160]}"
        if r.status_code == 404:
            return 404, "HTTP 404"
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code == 200 and isinstance(body, dict) and body.get("flushed") is True:
            return 200, ""
        detail = body.get("error") if isinstance(body, dict) and body.get("error") else r.text[:160]
        return r.status_code, f"HTTP {r.status_code}: {detail}"

    def _replicas(self, i: int) -> tuple:
        """(the replica URLs SGLang's router at server ``i`` lists (``GET /workers``), '');
        (None, '') when the server is no router (an answer without a list of workers); (None, why)
        when ``/workers`` gave no answer (no connection, a timeout, a transient status) in
        ``WORKERS_TRIES`` tries on a fresh connection each: a busy router is not taken for no router."""
        why = ""
        for k in range(WORKERS_TRIES):
            if k:
                time.sleep(self.backoff * k)
            try:
                r = self._session(i).get(self.urls[i] + "/workers", timeout=min(self.timeout, 30))
            except requests.RequestException as exc:
                self._local.sessions.pop(i, None)  # drop a possibly broken connection
                why = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            if r.status_code in TRANSIENT_STATUS:
                why = f"HTTP {r.status_code}: {r.text[:160]}"
                continue
            try:
                workers = r.json().get("workers") if r.status_code == 200 else None
            except (ValueError, AttributeError):
                workers = None
            if not isinstance(workers, list) or not all(isinstance(w, dict) and isinstance(w.get("url"), str)
                                                        for w in workers):
                return None, ""
            return [w["url"].rstrip("/") for w in workers], ""
        return None, why
