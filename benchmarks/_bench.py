"""Shared plumbing of the benchmarks: run inside the cached CPU SGLang environment with a
patched (or upstream) sglang 0.5.9 first on PYTHONPATH, and summarise repetitions.

A benchmark script calls ``enter_env(patched=...)`` first thing. Under a plain ``python3`` it
builds what is needed (the environment through ``eaglepatch.cpuenv.ensure_env``, the release
through ``eaglepatch.fetch``, the patched tree through ``eaglepatch.smoke.tree``) and re-runs the
same script with the environment's python; inside the environment it returns the package
parent in use.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
SERIES = REPO / "patches" / "sglang-0.5.9"
STUBS = SRC / "eaglepatch" / "smoke" / "stubs"
SMOKE = SRC / "eaglepatch" / "smoke"
INNER = "EAGLEPATCH_BENCH_INNER"

if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def log(msg: str) -> None:
    print("[bench] " + msg, file=sys.stderr, flush=True)


def build_tree(dest: Path, patched: bool) -> Path:
    """A package parent holding sglang 0.5.9, with the product series applied when patched."""
    from eaglepatch.fetch import unpacked_release
    from eaglepatch.smoke.tree import patched_tree

    release = unpacked_release("0.5.9", quiet=True)
    if patched:
        # product series only: the smoke-only attention route would change the timed path
        return patched_tree(release, SERIES, dest, smoke=False)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(release / "sglang", dest / "sglang",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def env_python() -> Path:
    from eaglepatch.cpuenv import ensure_env

    return ensure_env()


def pythonpath(tree: Path) -> str:
    return os.pathsep.join([str(tree), str(STUBS), str(SMOKE), str(SRC)])


def inner_env(tree: Path) -> dict:
    env = dict(os.environ)
    env[INNER] = str(tree)
    env["PYTHONPATH"] = pythonpath(tree)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def enter_env(patched: bool = True) -> Path:
    """Re-run this script inside the CPU environment (returns there the package parent)."""
    if os.environ.get(INNER):
        return Path(os.environ[INNER])
    py = env_python()
    work = Path(tempfile.mkdtemp(prefix="eaglepatch-bench-"))
    try:
        tree = build_tree(work / "pp", patched)
        rc = subprocess.call([str(py), *sys.argv], env=inner_env(tree))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(rc)


def min_median(values: list) -> dict:
    """{"min", "median", "all"} of a list of numbers (the JSON of the GIL benchmarks)."""
    return {"min": min(values), "median": statistics.median(values), "all": values}


def in_torch_env() -> None:
    """Under a python without torch, safetensors or psutil: run this script again in the project's
    cached CPU environment (built when missing); returns where they import."""
    try:
        import psutil  # noqa: F401
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        from eaglepatch.cpuenv import ensure_env

        sys.exit(subprocess.call([str(ensure_env()), *sys.argv]))


def counts(text: str) -> list:
    """'100,500' -> [100, 500]; [] when any is not a whole number >= 1 (the caller's usage error)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return []
    return out if out and min(out) >= 1 else []


def forward_args(ap, writers: str) -> None:
    """The options of the benchmarks that write forwards of prompts beside a busy thread
    (writer_procs, commit_gil); ``writers``: what a writer is there."""
    ap.add_argument("--dir", default="/dev/shm", help="parent of the directory the files go to (default /dev/shm)")
    ap.add_argument("--requests", type=int, default=32, help="prompts per forward (default 32)")
    ap.add_argument("--tokens", default="100,500", help="rows per prompt, comma list (default 100,500)")
    ap.add_argument("--writers", type=int, default=4, help=f"writer {writers} (default 4)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per configuration (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--out", help="write the JSON here too")


def forward_usage(a) -> "str | None":
    """The one-line usage error of ``forward_args``' values (None: they are fine)."""
    if not counts(a.tokens) or a.requests < 1 or a.writers < 1 or a.seconds <= 0 or a.reps < 1:
        return ("error: --tokens takes counts >= 1, and --requests, --writers, --seconds and --reps positive "
                "values; fix: e.g. --tokens 100,500 --requests 32 --writers 4 --seconds 3 --reps 3")
    if not Path(a.dir).is_dir():
        return f"error: --dir {a.dir}: not a directory; fix: pass an existing directory, e.g. /dev/shm"
    return None


def busy(until) -> int:
    """The scheduler's stand-in: this thread runs Python all the time until ``until()`` is true; the
    rounds of 1,000 loop steps it made."""
    rounds = 0
    while not until():
        for _ in range(1000):
            pass
        rounds += 1
    return rounds


class swept:
    """``with swept(d):`` another process removes the ``*.safetensors`` files written into ``d`` every
    0.1 s (a removal by the measured process would give the GIL away too); at the end, all of them."""

    def __init__(self, d: Path):
        self.d = Path(d)

    def __enter__(self):
        self.p = subprocess.Popen(["sh", "-c", f"while :; do find '{self.d}' -name '*.safetensors' -delete; "
                                               f"sleep 0.1; done"], start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        for f in self.d.iterdir():
            f.unlink(missing_ok=True)


def emit(res: dict, out) -> None:
    """Print the JSON of a result, and write it to ``out`` too when given."""
    import json

    text = json.dumps(res, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def summary(values) -> str:
    """'median (min..max, n=N)' of a list of numbers."""
    v = sorted(values)
    med = statistics.median(v)
    return "%.3g (%.3g..%.3g, n=%d)" % (med, v[0], v[-1], len(v))


def median(values) -> float:
    return statistics.median(values)


def spread_pct(values) -> float:
    """(max - min) / median, in percent."""
    m = statistics.median(values)
    return 100.0 * (max(values) - min(values)) / m if m else 0.0


def table(header, rows) -> str:
    """A Markdown table (so results paste into docs/benchmarks.md as they are)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine() -> str:
    import platform

    return "%s, %d cores, python %s" % (platform.machine(), os.cpu_count() or 0, platform.python_version())


class FakeMode:  # the one attribute DumpWriter.submit reads from ForwardMode
    name = "EXTEND"


class Batch:
    """The fields of ForwardBatch that DumpWriter.submit reads, for requests in one prefill."""

    def __init__(self, input_ids, seq_lens):
        self.forward_mode = FakeMode()
        self.input_ids = input_ids
        self.extend_seq_lens_cpu = list(seq_lens)
        self.extend_prefix_lens_cpu = [0] * len(seq_lens)


def make_states(tokens: int, hidden: int, layer_ids, dtype, seed: int = 0):
    """(Batch, captured dict keyed by capture index, final) of random states, one request."""
    import torch

    from sglang.srt.eagle3_capture.settings import capture_index

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100000, (tokens,), generator=g, dtype=torch.int64)
    captured = {capture_index(k): torch.randn(tokens, hidden, generator=g).to(dtype) for k in layer_ids}
    final = torch.randn(tokens, hidden, generator=g).to(dtype)
    return Batch(ids, [tokens]), captured, final


def metadata():
    return {"format": "eagle3-dump/1", "architecture": "bench", "model_path": "bench"}


def base_args(ap) -> None:
    """The options naming the base overlay of the benchmarks that compare two (commit_gil, handovers_gil)."""
    ap.add_argument("--base", default="HEAD", help="git revision whose overlay is the base (default HEAD)")
    ap.add_argument("--base-overlay", help="the base's overlay directory instead (a machine without the git history)")


def base_usage(a) -> "str | None":
    """The one-line usage error of ``base_args``' values (None: they are fine)."""
    if a.base_overlay and not (Path(a.base_overlay) / "sglang").is_dir():
        return f"error: --base-overlay {a.base_overlay}: no sglang/ in it; fix: pass a copy of sglang-overlay/"
    if not a.base_overlay and subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "-q",
                                              a.base + "^{commit}"], capture_output=True).returncode:
        return f"error: --base {a.base}: not a revision of this repository; fix: e.g. --base HEAD"
    return None


def base_overlay(a, scratch: Path) -> "tuple[Path, str]":
    """(the base's overlay directory, its name in reports): ``--base-overlay`` as given, or ``--base``'s
    overlay taken with ``git archive`` into ``scratch`` and its short revision."""
    if a.base_overlay:
        return Path(a.base_overlay), a.base_overlay
    data = subprocess.run(["git", "-C", str(REPO), "archive", a.base, "sglang-overlay"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=data, check=True)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", a.base], capture_output=True,
                         text=True).stdout.strip()
    return scratch / "sglang-overlay", rev
