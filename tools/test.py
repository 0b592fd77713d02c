#!/usr/bin/env python3
"""The project's test command.

  python3 tools/test.py [PYTEST ARGS...]

Builds (or reuses) the cached CPU SGLang environment (eaglepatch.cpuenv: a venv under
${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}/cpu-env-<key>, about 3 minutes the first time), then runs
`<env python> -m pytest tests` with PYTHONPATH=src and the given arguments (test paths given
as arguments replace `tests`). Exits with pytest's
status; pytest's "no tests collected" (5) counts as a failure.
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch import cpuenv  # noqa: E402


def main(argv: list[str]) -> int:
    try:
        py = cpuenv.ensure_env()
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # `tests` unless the arguments name test paths themselves (e.g. tests/test_functional.py)
    paths = [a for a in argv if not a.startswith("-") and (REPO / a.split("::")[0]).exists()]
    cmd = [str(py), "-m", "pytest"] + ([] if paths else ["tests"]) + argv
    print("$ PYTHONPATH=src %s" % " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    if rc == 5:
        print("error: pytest collected no tests; that is a failure here", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
