"""Child processes that drive the overlay's real DumpWriter, for the tests that signal them, stop
them and read what they leave (tests/test_stops.py, tests/test_states.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PREAMBLE = '''
import os, signal, sys, threading, time
import torch
sys.path.insert(0, {src!r})
from eaglepatch.overlay import import_package
import_package("e3c_child")
dump_mod = __import__("e3c_child.dump", fromlist=["DumpWriter"])
identity = sys.modules["e3c_child.identity"]


class M:
    name = "EXTEND"


class B:
    """A prefill ForwardBatch of ``rids``, ``n`` rows each (of prompts ``total`` rows long)."""

    def __init__(self, rids, n=8, total=None):
        self.forward_mode, self.input_ids = M(), torch.arange(n * len(rids))
        self.extend_seq_lens_cpu = [n] * len(rids)
        self.extend_prefix_lens_cpu = [0] * len(rids)
        self._eagle3_requests = [identity.RequestInfo(r, total or n) for r in rids]


def forward(w, rids, n=8, total=None):
    w.submit(B(rids, n, total), {{2: torch.randn(n * len(rids), 8)}}, None)
'''


def script(body: str, **values) -> str:
    """The preamble, then ``body`` (dedented) with ``values`` put in as ``{name}`` fields."""
    return PREAMBLE.format(src=str(REPO / "src")) + textwrap.dedent(body).format(**values)
