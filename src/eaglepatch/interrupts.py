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
import sys
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


@contextmanager
def completing():
    """Like `held_interrupts`, for the part of a change after its commit point: a Ctrl-C that
    arrives meanwhile is taken (not delivered) when the block has completed, and stderr says the
    change was completed, so the run goes on to report its success instead of exiting as
    interrupted. Only the outermost section takes it; nested, it is `held_interrupts`."""
    if threading.current_thread() is not threading.main_thread() or _depth > 0:
        with held_interrupts():
            yield
        return
    ok = False
    with held_interrupts():
        try:
            yield
            ok = True
        finally:
            if signal.SIGINT in signal.sigpending():
                signal.sigwait({signal.SIGINT})  # take it: the change it came after is complete
                if ok:
                    print("eaglepatch: interrupted after the commit point; the change was completed first",
                          file=sys.stderr, flush=True)


def stop_point(name: str) -> None:
    want = os.environ.get(STOP_ENV)
    if want and name in want.split(","):
        os.kill(os.getpid(), signal.SIGSTOP)
