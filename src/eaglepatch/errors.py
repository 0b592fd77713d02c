"""Errors that the command-line tools turn into one line and an exit code."""

from __future__ import annotations


class EaglepatchError(Exception):
    """A problem with a fix. ``exit_code`` is 2 for usage/input errors, 1 for refusals."""

    exit_code = 2

    def __init__(self, problem: str, fix: str, exit_code: int | None = None):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code

    def line(self) -> str:
        """`error: <problem>; <fix>`, always one line (newlines inside become spaces)."""
        return " ".join(f"error: {self.problem}; {self.fix}".split())


class UsageError(EaglepatchError):
    """Bad arguments or input: not an sglang tree, unknown release, malformed patch (exit 2)."""

    exit_code = 2


class RefusedError(EaglepatchError):
    """The tool refused to act and left every file as it was (exit 1)."""

    exit_code = 1


def run_main(body) -> int:
    """Run a CLI body and return its exit code. Whatever happens, stderr gets at most one
    `error: <problem>; <fix>` line and no traceback: EaglepatchError -> its line and exit code;
    Ctrl-C -> exit 2; an OS error that escaped the library (a path, permissions, a full disk) ->
    exit 2; anything else is a bug, reported in one line (EAGLEPATCH_DEBUG=1 re-raises it)."""
    import os
    import sys

    def fail(line: str, code: int) -> int:
        try:
            sys.stdout.flush()
        except OSError:
            pass
        print(" ".join(line.split()), file=sys.stderr)
        return code

    try:
        return body() or 0
    except EaglepatchError as exc:
        return fail(exc.line(), exc.exit_code)
    except KeyboardInterrupt:
        return fail("error: interrupted; run the command again (an interrupted change is finished or undone "
                    "by the next run that writes the tree)", 2)
    except OSError as exc:
        if os.environ.get("EAGLEPATCH_DEBUG"):
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        return fail(f"error: {exc.strerror or exc}{where}; check that path (permissions, free space) and run again", 2)
    except Exception as exc:
        if os.environ.get("EAGLEPATCH_DEBUG"):
            raise
        return fail(f"error: internal error ({exc.__class__.__name__}: {exc}); please report it with the command "
                    "(EAGLEPATCH_DEBUG=1 shows the traceback)", 2)
