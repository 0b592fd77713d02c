"""eaglepatch: versioned EAGLE-3 capture patches for SGLang.

The library behind tools/apply.py, tools/verify.py and tools/export.py:
series model (series), upstream tree (tree), release fetcher (fetch), per-hunk
matcher (verdicts, anchors), transactional applier (applier), deterministic
export (export), static smoke checks (static_check) and reports (report).
"""

__version__ = "0.1.0"

# The release the project is pinned to: the default of `apply.py --fetch` and the CI gate.
PINNED_RELEASE = "0.5.9"
