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
        return f"error: {self.problem}; {self.fix}"


class UsageError(EaglepatchError):
    """Bad arguments or input: not an sglang tree, unknown release, malformed patch (exit 2)."""

    exit_code = 2


class RefusedError(EaglepatchError):
    """The tool refused to act and left every file as it was (exit 1)."""

    exit_code = 1


def run_main(body) -> int:
    """Run a CLI body; turn EaglepatchError into one `error: <problem>; <fix>` line and its exit code."""
    import sys

    try:
        return body() or 0
    except EaglepatchError as exc:
        sys.stdout.flush()
        print(exc.line(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; run the command again (an unfinished transaction is recovered)",
              file=sys.stderr)
        return 2
