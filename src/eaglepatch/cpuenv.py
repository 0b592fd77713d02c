"""The heavy CPU environment that runs real SGLang code for the smoke tests.

A virtual environment under ``${EAGLEPATCH_CACHE:-~/.cache/eaglepatch}/cpu-env-<key>`` where
``key`` = sha256(cpu-requirements.txt bytes + python version)[:12]. It is built from nothing when
absent: torch (CPU build) first, then every other pinned requirement with a constraints file that
pins torch, so no dependency can pull a CUDA torch, then the requirements marked ``# no-deps:
MODULE ...`` with ``pip install --no-deps`` (packages whose declared requirements conflict with the
pins, e.g. the trainers whose readers the tests run; what they import is pinned as ordinary
lines), checked by importing the modules the marker names. A file lock serialises concurrent builders;
the environment is marked complete only after the last step, and an incomplete one (an
interrupted build) is wiped and rebuilt. sglang is deliberately not installed: smoke runs put the
tree under test first on PYTHONPATH.

``ensure_env() -> Path`` returns the environment's python. ``python -m eaglepatch.cpuenv`` builds it
and prints that path. With ``EAGLEPATCH_NO_ENV_BUILD`` set (``tools/test.py`` sets it for pytest,
having built every environment the run needs first, with progress) a missing environment is an
error instead of a build nobody sees.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("cpu-requirements.txt")
COMPLETE_MARKER = ".eaglepatch-complete"
# Set to a PyTorch wheel index (e.g. https://download.pytorch.org/whl/cpu) on a machine whose
# package index only has CUDA torch builds; by default the configured index/find-links is used.
TORCH_INDEX_ENV = "EAGLEPATCH_TORCH_INDEX_URL"
NO_BUILD_ENV = "EAGLEPATCH_NO_ENV_BUILD"


def cache_dir() -> Path:
    base = os.environ.get("EAGLEPATCH_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "eaglepatch"


def _py_version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]


def requirements_for(release: str | None) -> Path:
    """The requirement list of the environment that runs sglang ``release`` on CPU:
    ``cpu-requirements-<release>.txt`` when there is one, else the main list (the pinned
    release, which is also the environment the tests run in)."""
    if release:
        own = REQUIREMENTS.with_name("cpu-requirements-%s.txt" % release)
        if own.is_file():
            return own
    return REQUIREMENTS


def env_key(requirements: Path | None = None) -> str:
    h = hashlib.sha256()
    h.update((requirements or REQUIREMENTS).read_bytes())
    h.update(b"\0python=" + _py_version().encode())
    return h.hexdigest()[:12]


def env_dir(requirements: Path | None = None) -> Path:
    return cache_dir() / ("cpu-env-" + env_key(requirements))


def _python_of(d: Path) -> Path:
    return d / "bin" / "python"


def _requirements(requirements: Path | None = None) -> tuple[str, list[str]]:
    """(torch pin, the other pins) from the requirements file."""
    requirements = requirements or REQUIREMENTS
    torch_pin = None
    rest = []
    for raw in requirements.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split("==", 1)[0].strip().lower()
        if name == "torch":
            torch_pin = line
        else:
            rest.append(line)
    if torch_pin is None or "==" not in torch_pin:
        raise RuntimeError("error: %s has no 'torch==<version>' pin; add one" % requirements)
    return torch_pin, rest


def _no_deps(requirements: Path) -> tuple[list[str], list[str]]:
    """(the pins marked '# no-deps: MODULE ...', the modules the build must import) from the file."""
    pins, modules = [], []
    for raw in requirements.read_text().splitlines():
        line, _, comment = (part.strip() for part in raw.partition("#"))
        if line and comment.startswith("no-deps"):
            pins.append(line)
            modules += comment.partition(":")[2].split()
    return pins, modules


_TAG = threading.local()  # the environment a thread is building: its log lines name it (builds run at once)


def _log(msg: str) -> None:
    tag = getattr(_TAG, "key", None)
    sys.stderr.write(("[cpuenv %s] " % tag if tag else "[cpuenv] ") + msg + "\n")  # one write: whole lines when
    sys.stderr.flush()  # several environments build at once


def _run_logged(cmd: list[str], logf: Path, what: str) -> None:
    t0 = time.monotonic()
    _log("%s ..." % what)
    with open(logf, "a") as fh:
        fh.write("\n$ %s\n" % " ".join(cmd))
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        last = t0
        while True:
            try:
                rc = proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - last >= 30:
                    _log("  %s: still running (%.0f s)" % (what, now - t0))
                    last = now
    if rc != 0:
        tail = logf.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(
            "error: %s failed (exit %d; log %s):\n%s\n; fix the requirement or the network and rerun"
            % (what, rc, logf, "\n".join(tail))
        )
    _log("%s done (%.0f s)" % (what, time.monotonic() - t0))


def _build(d: Path, requirements: Path) -> None:
    torch_pin, rest = _requirements(requirements)
    nodeps, modules = _no_deps(requirements)
    rest = [r for r in rest if r not in nodeps]
    t0 = time.monotonic()
    _log("building %s (python %s, %d pinned requirements)" % (d, _py_version(), len(rest) + 1))
    venv.EnvBuilder(with_pip=True, clear=True, symlinks=True).create(d)
    logf = d / "build.log"
    py = str(_python_of(d))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    torch_cmd = pip + [torch_pin]
    if os.environ.get(TORCH_INDEX_ENV):
        torch_cmd += ["--index-url", os.environ[TORCH_INDEX_ENV]]
    _run_logged(torch_cmd, logf, "step 1/4: pip install %s" % torch_pin)
    constraints = d / "constraints.txt"
    constraints.write_text(torch_pin + "\n")
    reqs = d / "requirements.txt"
    reqs.write_text("\n".join(rest) + "\n")
    _run_logged(pip + ["-r", str(reqs), "-c", str(constraints)], logf,
                "step 2/4: pip install %d pinned packages (torch constrained)" % len(rest))
    if nodeps:
        _run_logged(pip + ["--no-deps"] + nodeps, logf, "step 3/4: pip install --no-deps %s" % " ".join(nodeps))
    _log("step 4/4: checking the environment ...")
    check = (
        "import torch, transformers, safetensors, unidiff, git, pyflakes, pytest, tqdm, requests;"
        + "".join("import %s;" % m for m in modules)
        + "print(torch.__version__, transformers.__version__)"
    )
    out = subprocess.run([py, "-c", check], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError("error: the built environment fails its import check:\n%s; rerun" % out.stderr[-2000:])
    want_torch = torch_pin.split("==", 1)[1]
    got_torch = out.stdout.split()[0]
    if got_torch.split("+", 1)[0] != want_torch:
        raise RuntimeError("error: environment has torch %s, wanted %s; rerun" % (got_torch, want_torch))
    freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    (d / "freeze.txt").write_text(freeze)
    (d / COMPLETE_MARKER).write_text("key=%s\npython=%s\nrequirements=%s\n"
                                     % (env_key(requirements), _py_version(), requirements.name))
    _log("environment ready: torch %s (%.0f s)" % (got_torch, time.monotonic() - t0))


def ensure_env(requirements: Path | None = None) -> Path:
    """Return the python of the CPU SGLang environment of ``requirements`` (default: the main
    list), building it first when absent."""
    requirements = requirements or REQUIREMENTS
    d = env_dir(requirements)
    if (d / COMPLETE_MARKER).is_file() and _python_of(d).exists():
        return _python_of(d)
    if os.environ.get(NO_BUILD_ENV):
        raise RuntimeError(
            "error: the CPU environment %s (%s) is not built, and this run does not build one (%s is set: "
            "pytest under tools/test.py); run python3 tools/test.py with this test's file, which builds the "
            "environments its tests need before pytest starts" % (d, requirements.name, NO_BUILD_ENV))
    d.parent.mkdir(parents=True, exist_ok=True)
    lock = d.parent / (d.name + ".lock")
    with open(lock, "w") as lf:
        _TAG.key = env_key(requirements)
        t_wait = time.monotonic()
        try:
            fcntl.flock(lf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log("another process is building %s; waiting for its lock" % d)
            fcntl.flock(lf, fcntl.LOCK_EX)
            _log("lock acquired after %.0f s" % (time.monotonic() - t_wait))
        try:
            if (d / COMPLETE_MARKER).is_file() and _python_of(d).exists():
                return _python_of(d)
            if d.exists():
                _log("removing incomplete environment %s (an earlier build was interrupted)" % d)
                shutil.rmtree(d)
            try:
                _build(d, requirements)
            except BaseException:
                # never leave a half-built env that looks usable; the next run redoes it
                shutil.rmtree(d, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)
            _TAG.key = None
    return _python_of(d)


def main() -> int:
    try:
        print(ensure_env())
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
