"""HTTP client for SGLang's native ``/generate`` on one or more servers: token ids in, one new token out.

A server is a patched SGLang replica or SGLang's router (``sglang-router``) in front of replicas;
every server must write its dumps into the one directory the client reads (a shared filesystem
when they run on other machines). The dump key is content-addressed, so it does not matter which
server prefilled a request.

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

A request retried elsewhere after a server died mid-prefill may have been prefilled twice; both
replicas write the same key through a temporary name and a rename, so the file is whole either way,
and the run writes the sample once.
"""

from __future__ import annotations

import threading
import time

import requests

from ..errors import UsageError

TRANSIENT_STATUS = {429, 500, 502, 503, 504}


class TransientError(Exception):
    """A request that failed after every retry on transient errors."""


class RequestError(Exception):
    """The server refused the request (non-transient HTTP error)."""


class SGLangClient:
    def __init__(self, urls, timeout: float = 300.0, retries: int = 5, backoff: float = 0.5, cooldown: float = 30.0,
                 log=None):
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self.timeout = timeout
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

    def describe(self) -> str:
        return self.urls[0] if len(self.urls) == 1 else f"{len(self.urls)} servers ({', '.join(self.urls)})"

    def _session(self, i: int) -> requests.Session:
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = {}
        if i not in sessions:
            sessions[i] = requests.Session()
        return sessions[i]

    def _get_model_info(self, i: int, timeout: float):
        """Server ``i``'s answer to ``GET /get_model_info`` (raises what requests raises)."""
        return self._session(i).get(self.urls[i] + "/get_model_info", timeout=timeout)

    def check_reachable(self) -> None:
        """Every server answers ``/get_model_info`` with JSON, in order; a usage error names the first
        that does not."""
        for i, url in enumerate(self.urls):
            fix = "start it (python -m sglang.launch_server ...) or fix --server"
            if len(self.urls) > 1:
                fix = "start it or leave it out of --server"
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

    def generate(self, input_ids: list, server: int | None = None) -> dict:
        payload = {"input_ids": list(map(int, input_ids)),
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
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
                    return answer
                last = f"{self.urls[i]}: {why}"
                self._failed(i, why)
        raise TransientError(f"{self.retries + 1} attempts failed, last: {last}")

    def _post(self, i: int, payload: dict):
        """(the answer, None), or (None, why a transient failure happened)."""
        try:
            r = self._session(i).post(self.urls[i] + "/generate", json=payload, timeout=self.timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
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
