"""The tools' argument parsers: `--help` shows every default and the exit codes.

`parser(prog, doc)` takes the tool's docstring: its first paragraph is the description, its
`Exit:` line (up to the next blank line) becomes the `exit codes:` epilog, so the two cannot
drift apart.
"""

from __future__ import annotations

import argparse
import textwrap

# What the tools import from pyproject.toml's [project] dependencies (module -> the requirement that
# provides it), which `pip install -e .` installs; tests/test_cli_properties.py keeps the two in step.
DEPENDENCIES = {"unidiff": "unidiff", "git": "GitPython", "pyflakes": "pyflakes", "tqdm": "tqdm",
                "packaging": "packaging"}
INSTALL = "pip install -e . (from the eaglepatch checkout, into the Python that runs the tools)"


def missing_modules(modules) -> list:
    """The modules of ``modules`` this interpreter cannot import (found, not imported)."""
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(tool: str, *modules: str, fix: str = INSTALL) -> None:
    """A one-line usage error, before anything is read or written, naming the packages that provide
    the ``modules`` (``DEPENDENCIES``) this interpreter lacks and how to install them: what a tool
    run before ``pip install -e .`` says instead of an internal error."""
    missing = missing_modules(modules)
    if missing:
        from .errors import UsageError

        names = [DEPENDENCIES.get(m, m) for m in missing]
        raise UsageError(f"{tool} needs the Python package(s) {', '.join(names)}, which "
                         f"{'is' if len(names) == 1 else 'are'} not installed", fix)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, less the defaults that say nothing (None, False,
    an empty list) or that the help text already states; the epilog keeps its lines. A nargs='*'
    option whose metavar is written out in brackets (`[RELEASE [DEST]]`) is shown as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if text == argparse.SUPPRESS or "default" in text.lower():
            return text
        if action.default is None or action.default is False or action.default == []:
            return text
        return super()._get_help_string(action)

    def _format_args(self, action, default_metavar):
        if action.nargs == argparse.ZERO_OR_MORE and isinstance(action.metavar, str) \
                and action.metavar.startswith("["):
            return action.metavar
        return super()._format_args(action, default_metavar)


def exit_codes(doc: str) -> str:
    """What follows `Exit:` in a tool's docstring, up to the next blank line, as one line."""
    para = next((p for p in doc.split("\n\n") if "Exit:" in p), None)
    if para is None:
        raise ValueError("the tool's docstring has no 'Exit:' line")
    return " ".join(para.split("Exit:", 1)[1].split())


def parser(prog: str, doc: str, whole_doc: bool = False, **kw) -> argparse.ArgumentParser:
    """The parser of a tool whose docstring is `doc`: described by its first paragraph (with
    whole_doc, by all of it but the Exit paragraph), the exit codes as the epilog."""
    paras = doc.strip().split("\n\n")
    description = "\n\n".join(p for p in paras if "Exit:" not in p) if whole_doc else paras[0]
    epilog = textwrap.fill("exit codes: " + exit_codes(doc), width=100, subsequent_indent="  ")
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=HelpFormatter, **kw)
