"""A stand-in for SGLang's HTTP front during its warm-up request (tests only): ``/get_model_info``
answers 200 at once, ``/health`` 503 until ``seconds`` have passed and 200 after, as SGLang does.
In-process (``warming_server``) or as the server process itself (``python warmkit.py PORT SECONDS
STATE``: STATE gets one JSON line per /health request, and the first line says when warm-up ends,
in time.monotonic(), which is system-wide on Linux)."""

import contextlib
import http.server
import json
import sys
import threading
import time


def _handler(state, record=None):

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            up = time.monotonic() >= state["until"]
            if self.path == "/health":
                state["health"].append(up)
                if record:
                    record(up)
            code = 200 if self.path == "/get_model_info" or (self.path == "/health" and up) else 503
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    return H


@contextlib.contextmanager
def warming_server(seconds: float):
    """Yields ``(url, state)``; ``state["until"]`` is when warm-up ends (time.monotonic()) and
    ``state["health"]`` records, per /health request, whether it was answered 200."""
    state = {"until": time.monotonic() + seconds, "health": []}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield "http://127.0.0.1:%d" % httpd.server_address[1], state
    finally:
        httpd.shutdown()


def main(argv):
    port, seconds, path = int(argv[0]), float(argv[1]), argv[2]
    state = {"until": time.monotonic() + seconds, "health": []}
    lock = threading.Lock()
    with open(path, "w") as f:
        f.write(json.dumps({"until": state["until"]}) + "\n")

    def record(up):
        with lock, open(path, "a") as f:
            f.write(json.dumps({"health": up, "at": time.monotonic()}) + "\n")

    http.server.ThreadingHTTPServer(("127.0.0.1", port), _handler(state, record)).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
