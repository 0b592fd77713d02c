"""GPU-check instrumentation, on PYTHONPATH only for the check's own engine processes.

Python imports the first ``sitecustomize`` on sys.path at start-up, in every process (sglang's
scheduler processes included). This one installs ``eaglepatch_spy`` when EAGLEPATCH_SPY_DIR is
set, then runs the sitecustomize it shadows, if any.
"""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("EAGLEPATCH_SPY_DIR"):
    if _here not in sys.path:
        sys.path.insert(0, _here)
    import eaglepatch_spy

    eaglepatch_spy.install()


def _chain():
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) != _here:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


_chain()
