"""eaglepatch: versioned EAGLE-3 capture patches for SGLang.

The library behind tools/apply.py, verify.py, export.py, port.py and drift.py: series model and
catalogue (series), upstream tree (tree), release fetcher (fetch), per-hunk matcher (verdicts,
anchors), tree lock (lock), crash-safe transactions (txn), transactional applier (applier,
commit), deterministic export (export), 3-way port in stages (port), static smoke checks
(static_check) and reports (report, drift). docs/design.md, "Conventions", says how they layer.
"""

__version__ = "0.1.0"

# The release the project is pinned to: the default of `apply.py --fetch` and the CI gate.
PINNED_RELEASE = "0.5.9"
