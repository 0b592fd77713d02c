"""Process controls the tools share: Ctrl-C held back over sections that must not be cut (git and
GitPython calls, the second half of a transaction), and named stop points for fault tests.

`held_interrupts()` blocks SIGINT for the calling thread (threads and git processes started
inside inherit the block, so a Ctrl-C can neither kill git halfway nor land inside GitPython,
where it was swallowed); a Ctrl-C that arrived meanwhile is delivered when the outermost section
ends, as a KeyboardInterrupt in our own code, which `errors.run_main` turns into one line.

`stop_point(name)`: with EAGLEPATCH_STOP_AT=<name>[,<name>...] in the environment the process
stops itself (SIGSTOP) there, so a test can SIGKILL or SIGINT it at an exact stage. Unset, it
does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

STOP_ENV = "EAGLEPATCH_STOP_AT"
_depth = 0


@contextmanager
def held_interrupts():
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending Ctrl-C lands here


def stop_point(name: str) -> None:
    want = os.environ.get(STOP_ENV)
    if want and name in want.split(","):
        os.kill(os.getpid(), signal.SIGSTOP)
