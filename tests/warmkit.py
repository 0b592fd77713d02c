"""A stand-in for SGLang's HTTP front during its warm-up request (tests only): ``/get_model_info``
answers 200 at once, ``/health`` 503 until ``seconds`` have passed and 200 after, as SGLang does."""

import contextlib
import http.server
import threading
import time


@contextlib.contextmanager
def warming_server(seconds: float):
    """Yields ``(url, state)``; ``state["until"]`` is when warm-up ends (time.monotonic()) and
    ``state["health"]`` records, per /health request, whether it was answered 200."""
    state = {"until": time.monotonic() + seconds, "health": []}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            up = time.monotonic() >= state["until"]
            if self.path == "/health":
                state["health"].append(up)
            code = 200 if self.path == "/get_model_info" or (self.path == "/health" and up) else 503
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield "http://127.0.0.1:%d" % httpd.server_address[1], state
    finally:
        httpd.shutdown()
