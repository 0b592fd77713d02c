"""The files a series creates name the release they were made for (`SERIES_RELEASE` and
`SERIES_VERSION` string constants). A port rewrites them for the new release: `new_file_content`
is the one function that decides what a created file holds in the ported series."""

from __future__ import annotations

import re

STAMP_RE = re.compile(rb'^(SERIES_RELEASE|SERIES_VERSION) = "([^"\n]*)"$', re.M)


def stamp(data: bytes, release: str, series_version: str) -> bytes:
    """Set SERIES_RELEASE / SERIES_VERSION string constants in a file the series creates."""
    def sub(m):
        val = release if m.group(1) == b"SERIES_RELEASE" else series_version
        return m.group(1) + b' = "' + val.encode() + b'"'
    return STAMP_RE.sub(sub, data)


def new_file_content(old_content: bytes, path: str, release: str, series_version: str) -> bytes:
    """What the ported series creates at `path`, given what the old series created there."""
    return stamp(old_content, release, series_version)
