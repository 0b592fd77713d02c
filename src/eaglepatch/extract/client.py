"""HTTP client for SGLang's native ``/generate``: token ids in, one new token out.

Transient failures (connection refused/reset, timeouts, HTTP 429/500/502/503/504) are retried
with exponential backoff; other HTTP errors are not (the request itself is wrong).
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
    def __init__(self, url: str, timeout: float = 300.0, retries: int = 5, backoff: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._local = threading.local()
        self.retried = 0  # number of transient failures that were retried (all threads)
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def server_info(self) -> dict:
        """``/get_model_info`` (and ``/get_server_info`` when present); fails with a usage error
        when the server cannot be reached."""
        try:
            r = self._session().get(self.url + "/get_model_info", timeout=min(self.timeout, 30))
        except requests.RequestException as exc:
            raise UsageError(f"cannot reach the SGLang server at {self.url} ({type(exc).__name__})",
                             "start it (python -m sglang.launch_server ...) or fix --server") from None
        if r.status_code != 200:
            raise UsageError(f"{self.url}/get_model_info answered HTTP {r.status_code}",
                             "point --server at an SGLang server (http://HOST:PORT)")
        try:
            info = r.json()
        except ValueError:
            raise UsageError(f"{self.url}/get_model_info did not answer JSON",
                             "point --server at an SGLang server (http://HOST:PORT)") from None
        try:
            s = self._session().get(self.url + "/get_server_info", timeout=min(self.timeout, 30))
            if s.status_code == 200:
                info["server_info"] = s.json()
        except (requests.RequestException, ValueError):
            pass
        return info

    def alive(self) -> bool:
        try:
            return self._session().get(self.url + "/get_model_info", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def generate(self, input_ids: list) -> dict:
        payload = {"input_ids": list(map(int, input_ids)),
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(min(self.backoff * (2 ** (attempt - 1)), 10.0))
            try:
                r = self._session().post(self.url + "/generate", json=payload, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as exc:
                last = f"{type(exc).__name__}: {str(exc)[:160]}"
                self._local.session = None  # drop a possibly broken connection
                continue
            if r.status_code in TRANSIENT_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:160]}"
                continue
            if r.status_code != 200:
                raise RequestError(f"HTTP {r.status_code}: {r.text[:300]}")
            try:
                return r.json()
            except ValueError:
                last = "answer is not JSON"
                continue
        raise TransientError(f"{self.retries + 1} attempts failed, last: {last}")
