"""What the files a series creates hold in a ported series: `new_file_content` decides. The
package the series add comes from `sglang-overlay/`, generated for the new release
(`eaglepatch.overlay.release_files`: its `release.py` names the release, the series version and
how unpatched sglang of that release reads draft ids); any other created file keeps its content
with its `SERIES_RELEASE` / `SERIES_VERSION` string constants set for the new release."""

from __future__ import annotations

import re

STAMP_RE = re.compile(rb'^(SERIES_RELEASE|SERIES_VERSION) = "([^"\n]*)"$', re.M)


def stamp(data: bytes, release: str, series_version: str) -> bytes:
    """Set SERIES_RELEASE / SERIES_VERSION string constants in a file the series creates."""
    def sub(m):
        val = release if m.group(1) == b"SERIES_RELEASE" else series_version
        return m.group(1) + b' = "' + val.encode() + b'"'
    return STAMP_RE.sub(sub, data)


def new_file_content(old_content: bytes, path: str, release: str, series_version: str,
                     overlay_files: dict | None = None) -> bytes:
    """What the ported series creates at `path`, given what the old series created there."""
    if overlay_files is not None and path in overlay_files:
        return overlay_files[path]
    return stamp(old_content, release, series_version)
