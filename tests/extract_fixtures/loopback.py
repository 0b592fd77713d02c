"""A ThreadingHTTPServer on a free loopback port, run in a thread, as a context manager."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class LoopbackServer:
    def _serve(self, handler) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
