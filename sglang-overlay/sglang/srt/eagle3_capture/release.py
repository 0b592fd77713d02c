"""The sglang release this copy of the package is generated for.

tools/export.py writes this file for each series from its manifest.json; the copy in the
overlay holds the pinned release's values. Everything else in the package is the same for
every release and detects release differences at run time.
"""

SERIES_RELEASE = "0.5.9"
SERIES_VERSION = "0.5.9-4"
# How unpatched sglang SERIES_RELEASE maps EAGLE-3 draft-config ids to capture indices:
# "plus_one" (id k -> k + 1) or "plus_one_if_first_is_one" (k + 1 only when the first id is 1).
UPSTREAM_EAGLE_ID_MAPPING = "plus_one"
# How this copy reaches sglang: "series" (a patched tree: the upstream files call the package)
# or "plugin" (the eaglepatch-capture wheel: sglang's plugin loader installs the hooks).
DELIVERY = "series"
