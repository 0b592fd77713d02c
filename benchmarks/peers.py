#!/usr/bin/env python3
"""The same EAGLE-3 training dataset made four ways, side by side: this project and its peers.

  python3 benchmarks/peers.py --cpu --out peers.json                       # CPU smoke (demo model)
  PYTHONPATH=/tmp/site:src python3 benchmarks/peers.py --model DIR --out $OUT/peers.json   # one GPU

Every method makes, from the same target, the same tokenized conversations and the same layers, a
dataset SpecForge 0.2.0's reader loads (``specforge.data.preprocessing.build_offline_eagle3_dataset``:
``*.ckpt`` files holding ``input_ids`` [T], ``loss_mask`` [T], ``hidden_state`` [1, T, H], the
final post-norm state, and ``aux_hidden_state`` [1, T, 3H], the outputs of decoder layers 0, 1 and 2
(HF hidden-state indices 1, 2, 3) in that order):

- ``limit`` (no dataset: the rate the others are measured against): ``ours``'s server, the same
  ``tools/serve.py`` command (its ``--print``), run without the dump's variables (the patched
  server with the dump off), warmed up as ``ours``'s, then the token ids ``ours`` sends, in bucket
  order, ``ours``'s concurrency, through extract's own client (``/generate``, ``max_new_tokens``
  1); timed from the first request to the last answer, per bucket from the answers' times;
- ``ours``: the patched SGLang server with the dump (``tools/serve.py``) and ``tools/extract.py
  --format specforge``, run as a user runs them (one extract run over every conversation, in bucket
  order; per-bucket times from the samples' completion times);
- ``ours-processes``: ``ours`` with extract's own ``--processes`` (``--extract-processes`` worker
  processes inside one extract run, one dataset, ``ours``'s concurrency; not among the defaults: whether
  one extract process is what holds ``ours`` back);
- ``ours-fp8-disk``: ``ours-processes`` storing fp8 (the server's ``--dump-dtype fp8 --rebuildable omit``,
  extract's ``--format compact``: half the bytes), dumps and dataset on ``--disk-dir`` (a real disk),
  read back through ``eaglepatch.compact.CompactDataset`` (SpecForge's view) for the checks; not among
  the defaults;
- ``ours-fp8``: ``ours-fp8-disk`` with its dumps in ``--dump-dir`` and its dataset in the work
  directory, as ``ours``'s (on the GPU both in /dev/shm: fp8 without the disk); not among the defaults;
- ``ours-mooncake``: ``ours-processes`` with the server's Mooncake sink (``serve.py --sink mooncake``, a
  ``mooncake_master`` the run starts) and extract reading each answer's states from the store
  (``--mooncake-master``), deleting them as it writes each sample: no dump file at all; between its
  phases the store is cleared (the warm-up's objects nobody reads); GPU: needs ``--mooncake-site``; not
  among the defaults;
- ``hf``: transformers' ``DeepseekV3ForCausalLM`` with forward hooks, padded batches of similar
  lengths, one ``torch.save`` per sample (how DeepSpec and ModelOpt's HF path do it), bf16 on a GPU,
  at the best of a few batch sizes tried first on a subset (the sweep is reported);
- ``specforge``: SpecForge 0.2.0's own offline capture API
  (``specforge.offline_capture.load_offline_eagle3_capture``, the SGLang backend its
  ``prepare_hidden_states.py`` uses; the package has no other backend), against the unpatched
  sglang that is installed; it pins sglang 0.5.14, and when it cannot run its refusal is reported;
- ``sglang-json``: unpatched SGLang's own ``return_hidden_states`` over HTTP (JSON): one pass on a
  plain server for the final state, one on an EAGLE-3 server (a draft naming the three layers, dummy
  draft weights) for the aux states, upstream's only way to return them.

Figures per method: dataset tokens/s (first request to last sample written; model load and server
start reported apart), the same including start-up, GB per million tokens, the peak resident memory
of the method's processes (and of the GPU, device-wide, over the baseline), tokens/s per prompt-length
bucket, and each dataset's rows against a float32 transformers reference on a sample of conversations
(per state: max abs error, and max relative row error |x_t - ref_t| / |ref_t|, the verdict's measure).
Each method gets ``--method-s`` seconds of work, shared among the buckets (unused time passes on);
what a method did not reach is reported "not measured", never estimated. ``--budget-s``: no method is
started once the run has used it. ``--repeats N``: ``limit`` and ``ours`` make N timed passes on one
server each (the others one); each pass's figures are kept (``repetitions``), with the min and the
median overall and per bucket (``over_repetitions``); ``ratio_to_limit``: each method's tokens/s
over the limit's, overall and per bucket, pass i over the limit's pass i, with the min and the
median (none without a measured ``limit``: the JSON says why, nothing is estimated).

Exit: 0 done; 1 a method's dataset failed its reference check, this project's method did not run or
lost samples in a pass (``losses``: the server's failed writes, extract's failed conversations, no sample
at all), or --check failed; 2 usage error (one line, nothing written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
for _p in (SRC, REPO / "tests" / "extract_fixtures"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from eaglepatch.errors import UsageError  # noqa: E402

METHODS = ("limit", "ours", "ours-processes", "ours-fp8", "ours-fp8-disk", "ours-mooncake", "hf", "specforge",
           "sglang-json")
OURS = ("ours", "ours-processes", "ours-fp8", "ours-fp8-disk", "ours-mooncake")  # this project's: each must run
# how each of ours's methods runs: extract's worker processes (False: its threads alone), the server's fp8
# storage (extract then keeps it: --format compact), where the dumps and dataset go ("dump": --dump-dir and the
# work directory; "disk": --disk-dir), and the sink (file, or the Mooncake store and no dump file)
OURS_VARIANTS = {
    "ours": dict(processes=False, fp8=False, place="dump", sink="file"),
    "ours-processes": dict(processes=True, fp8=False, place="dump", sink="file"),
    "ours-fp8": dict(processes=True, fp8=True, place="dump", sink="file"),
    "ours-fp8-disk": dict(processes=True, fp8=True, place="disk", sink="file"),
    "ours-mooncake": dict(processes=True, fp8=False, place="dump", sink="mooncake"),
}
# ours-mooncake's store: room for the objects of the requests in flight and those extract has not read yet
MOONCAKE_MB = {"cpu": dict(segment_mb=1024, buffer_mb=256), "gpu": dict(segment_mb=24576, buffer_mb=2048)}
# fp8 e4m3 with one scale per token and state rounds a value by at most 1/16; a row measured 0.025-0.032
# from float32 (docs/benchmarks.md section 8): the fp8 method's tolerance is the profile's plus this
FP8_ROW_TOL = 0.05
DEFAULT_METHODS = ("limit", "ours", "hf", "specforge", "sglang-json")
WARM_WAVES = 4  # a warm-up round: this many times the timed pass's requests in flight
WARM_STABLE = 2  # the warm-up ends once this many rounds in a row each ran within 10% of the one before
# after its warm-up each server of the goal's ratio (the limit and ours's) makes this many untimed passes of the
# real conversations: on one H100 (2026-12-06) the limit's first timed pass after a settled warm-up ran at 53.5k
# and 57.9k tokens/s, the next ones at 79-94k; ours's first at 21.6k against 37.5k (run 16), ours-processes's at
# 36.6k against 53.4k on an H200 (run 17): without it the worst repetition is the server's warm-up
WARM_PASSES = 1


def steady(rates, stable: int = WARM_STABLE, within: float = 0.1) -> bool:
    """Whether the last ``stable`` rates each came within ``within`` of the one before them."""
    r = list(rates)
    if len(r) < stable + 1:
        return False
    return all(abs(b - a) <= within * a for a, b in zip(r[-stable - 1:-1], r[-stable:]))


REPEATED = ("limit",) + OURS  # the methods --repeats makes several timed passes of (one server start each)
AUX_HF = (1, 2, 3)  # HF hidden-state indices of the aux states: outputs of decoder layers 0, 1, 2
T0 = time.monotonic()

# Sizes per profile. GPU: ShareGPT-like lengths (log-normal around a median, clipped), >= 1000
# conversations; hidden 7168 costs 57 KB per dataset token, so ~0.5 M tokens is ~28 GB per dataset
# (each is deleted once measured, unless --keep-work).
PROFILES = {
    "cpu": dict(conversations=24, min_len=24, max_len=600, median=110, sigma=0.8, extract_max_len=1000,
                buckets=[24, 64, 128, 256, 601], sample_per_bucket=2, tol=1e-3, method_s=90.0, budget_s=400.0,
                concurrency=4, hf_budgets=[256, 1024], json_concurrency=2, dtype="float32", warm_s=3.0),
    "gpu": dict(conversations=1000, min_len=100, max_len=4000, median=350, sigma=0.8, extract_max_len=4096,
                buckets=[100, 250, 500, 1000, 2000, 4001], sample_per_bucket=1, tol=0.1, method_s=45.0,
                budget_s=400.0, concurrency=32, hf_budgets=[8192, 32768, 65536], json_concurrency=8,
                dtype="bfloat16", warm_s=30.0),
}
GPU_SAMPLE_MAX_LEN = 2000  # reference conversations on the GPU: the first of each bucket up to this length


def say(msg: str) -> None:
    print("[peers %5.0fs] %s" % (time.monotonic() - T0, msg), file=sys.stderr, flush=True)


# ---- conversations -------------------------------------------------------------------------------

def make_conversations(n: int, prof: dict, words: list, seed: int = 31) -> list:
    """``n`` ShareGPT-form records whose rendered length (in the tinychat word-level tokenizer, about
    one token per word plus two per turn) follows a log-normal around ``median``, clipped to
    [min_len, max_len]; 1-4 exchanges, a system prompt in some."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        target = int(min(prof["max_len"], max(prof["min_len"], rng.lognormvariate(math.log(prof["median"]),
                                                                                     prof["sigma"]))))
        budget = target - 1
        turns = []
        if rng.random() < 0.3:
            k = min(budget - 6, rng.randint(4, 20))
            if k > 0:
                turns.append(("system", k))
                budget -= k + 2
        pairs = rng.randint(1, 4)
        while budget > 8 and pairs > 0:
            share = budget if pairs == 1 else max(6, int(budget * rng.uniform(0.3, 0.7)))
            share = min(share, budget)
            u = max(2, int(share * rng.uniform(0.2, 0.6)))
            a = max(1, share - u - 4)
            turns += [("human", u), ("gpt", a)]
            budget -= u + a + 4
            pairs -= 1
        if not turns or turns[-1][0] != "gpt":
            turns += [("human", 2), ("gpt", 2)]
        conv = [{"from": r, "value": " ".join(rng.choice(words) for _ in range(k))} for r, k in turns]
        recs.append({"id": "peer-%04d" % i, "conversations": conv})
    return recs


def tokenizer_words(vocab_size: int) -> list:
    from eaglepatch.serve import tinychat

    return tinychat.WORDS + ["w%d" % i for i in range(vocab_size - len(tinychat.SPECIALS) - len(tinychat.WORDS))]


def bucket_of(n: int, edges: list) -> int:
    for j in range(len(edges) - 1):
        if edges[j] <= n < edges[j + 1]:
            return j
    return len(edges) - 2 if n >= edges[-1] else 0


# ---- processes and their memory --------------------------------------------------------------------

def _proc_table() -> dict:
    """pid -> (ppid, rss bytes) of every live process."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            rss = int((d / "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] != "Z":
            out[int(d.name)] = (int(fields[1]), rss)
    return out


def gpu_used_bytes() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=10)
        return int(r.stdout.strip().splitlines()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class Sampler:
    """Peak resident memory of the processes started for a method (and all their descendants), and
    peak device memory in use over the baseline taken at start (nvidia-smi, device 0), every 0.5 s."""

    def __init__(self, gpu: bool):
        self.roots: set = set()
        self.peak_rss = 0
        self.gpu = gpu
        self.base_gpu = gpu_used_bytes() if gpu else None
        self.peak_gpu = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def add(self, pid: int) -> None:
        self.roots.add(pid)

    def _sample(self) -> None:
        table = _proc_table()
        kids: dict = {}
        for pid, (ppid, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        seen, todo = set(), [p for p in self.roots if p in table]
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(kids.get(p, []))
        self.peak_rss = max(self.peak_rss, sum(table[p][1] for p in seen))
        if self.gpu and self.base_gpu is not None:
            used = gpu_used_bytes()
            if used is not None:
                self.peak_gpu = max(self.peak_gpu, used - self.base_gpu)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._sample()
            except Exception:  # a process that ended between reads
                pass

    def close(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_rss_bytes": self.peak_rss,
                "peak_gpu_bytes": self.peak_gpu if self.gpu and self.base_gpu is not None else None}


LIVE: dict[int, subprocess.Popen] = {}  # started and not yet stopped: what a stopped run must stop


def start(cmd, log: Path, env=None, sampler: Sampler | None = None) -> subprocess.Popen:
    fh = open(log, "a")
    p = subprocess.Popen([str(c) for c in cmd], env=env, stdout=fh, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    fh.close()
    LIVE[p.pid] = p
    if sampler:
        sampler.add(p.pid)
    return p


def stop(p: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace`` seconds (tools/serve.py drains the dump
    and stops its server's own group on SIGTERM)."""
    LIVE.pop(p.pid, None)
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def wait_http(p: subprocess.Popen, url: str, log: Path, timeout: float) -> float:
    """Seconds until ``url``/health_generate answers 200; raises NotReady (log tail) otherwise."""
    import cpuserver
    import requests

    return cpuserver.wait_ready(p, url, log, log.stem, timeout=timeout,
                                ready=lambda u: requests.get(u + "/health_generate", timeout=60).status_code == 200)


def log_tail(log: Path, n: int = 1) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    errs = [x for x in lines if re.search(r"(Error|Exception|error:)", x)]
    return " | ".join((errs or lines)[-n:])[:400]


def flush_counts(url: str) -> dict:
    """The dump writer's counts after the run (``POST /eagle3_dump/flush``), or why there are none."""
    import requests

    try:
        return requests.post(url + "/eagle3_dump/flush", json={}, timeout=120).json()
    except Exception as exc:  # noqa: BLE001 - a figure for the record, not a verdict
        return {"error": "%s: %s" % (type(exc).__name__, str(exc)[:200])}


def disk_write_rate(directory: Path, nbytes: int) -> dict:
    """The sequential write rate of ``directory``'s disk: ``nbytes`` of random bytes (compression-proof)
    in 64 MiB writes, then fsync, timed; the file removed. It bounds a method whose bytes go there."""
    chunk = os.urandom(min(nbytes, 64 << 20))
    path = directory / (".peers-disk-probe-%d" % os.getpid())
    t = time.monotonic()
    try:
        with open(path, "wb", buffering=0) as f:
            done = 0
            while done < nbytes:
                done += f.write(chunk[:nbytes - done])
            os.fsync(f.fileno())
        secs = time.monotonic() - t
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": nbytes, "seconds": round(secs, 3), "gb_per_s": round(nbytes / 1e9 / secs, 3),
            "how": "one file, 64 MiB writes, one fsync (peers.disk_write_rate)"}


LOSS_COUNTS = ("failed", "dropped")  # the dump writer's counts of requests whose states it did not deliver


CLEAR_STORE = ("import sys; from eaglepatch.mooncake import StoreReader; r = StoreReader(sys.argv[1], sys.argv[2]); "
               "n = r.clear(); r.close(); print('removed', n)")


def clear_store(python: str, env: dict, master) -> int:
    """Remove every request object of ``master``'s store (this run's own; ``StoreReader.clear``) in a
    client of ``python`` and ``env`` (mooncake on its path); the keys removed."""
    got = subprocess.run([python, "-c", CLEAR_STORE, master.address, master.metadata], env=env, text=True,
                         capture_output=True, timeout=120)
    last = (got.stdout.strip().splitlines() or [""])[-1].split()
    if got.returncode != 0 or len(last) != 2 or last[0] != "removed":
        raise RuntimeError("clearing the Mooncake store failed: " + " ".join((got.stderr or got.stdout).split()[-30:]))
    return int(last[1])


def pass_losses(before: dict, after: dict, xlog: Path) -> dict:
    """What one pass of ours lost: the server's failed and dropped writes over it (its flush counts
    before and after; None where either is missing) and the conversations extract gave up on."""
    out = {k: after[k] - before[k] if isinstance(before.get(k), int) and isinstance(after.get(k), int) else None
           for k in LOSS_COUNTS}
    try:
        text = xlog.read_text(errors="replace")
    except OSError:
        text = ""
    out["conversations_failed"] = sum(line.startswith("failed: conversation ") for line in text.splitlines())
    return out


def loss_verdict(losses: dict, samples: int, work_s: float, cut: bool) -> str | None:
    """Why a pass of ours is a failure (None: it is not): the server failed a write, or dropped a
    chunked request in a pass that was not ``cut`` (stopping extract aborts what it has in flight), its
    counts could not be read, extract gave up on a conversation, or no sample came at all."""
    why = ["the server %s %d write(s)" % (k, n) for k, n in losses.items()
           if k in LOSS_COUNTS and n and not (k == "dropped" and cut)]
    why += ["the server's dump counts could not be read (%s)" % k for k, n in losses.items()
            if k in LOSS_COUNTS and n is None][:1]
    if losses.get("conversations_failed"):
        why.append("extract failed %d conversation(s)" % losses["conversations_failed"])
    if not samples:
        why.append("no sample in %.0f s of work" % work_s)
    return "; ".join(why) + " (extract's log: what failed and why)" if why else None


def progress_lines(log: Path) -> list:
    """extract.py's progress and summary lines (seconds per stage: where the client's time went)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [x for x in text.splitlines() if x.startswith(("progress: ", "summary: ", "time per stage"))][-40:]


# ---- the plan shared with the workers ------------------------------------------------------------

def sample_rel(conv_id: str, fmt: str = "specforge") -> str:
    from eaglepatch.extract.writers import sample_rel as rel

    return rel(fmt, conv_id)


def file_system(path: Path) -> str:
    """The file system type /proc/mounts gives for the mount holding ``path`` ("tmpfs" is memory)."""
    best, kind = "", "unknown"
    try:
        real = str(Path(path).resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            w = line.split()
            if len(w) > 2 and (real == w[1] or real.startswith(w[1].rstrip("/") + "/")) and len(w[1]) > len(best):
                best, kind = w[1], w[2]
    except OSError:
        pass
    return kind


def save_sample(out: Path, conv_id: str, ids, mask, final, aux) -> int:
    """One SpecForge .ckpt at ``out``/``sample_rel`` (written to a temporary name, then renamed). The
    tensors are cloned: ``torch.save`` of a view writes its whole storage (a padded batch's)."""
    import torch

    path = out / sample_rel(conv_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    torch.save({"input_ids": ids.to(torch.int64).clone(), "loss_mask": mask.to(torch.int64).clone(),
                "hidden_state": final.clone().unsqueeze(0), "aux_hidden_state": aux.clone().unsqueeze(0)},
               str(tmp))
    os.replace(tmp, path)
    return path.stat().st_size


class Deadlines:
    """Per-bucket deadlines: each bucket gets the time left divided by the buckets left."""

    def __init__(self, total_s: float, n: int):
        self.end = time.monotonic() + total_s
        self.left = n

    def next(self) -> float:
        d = time.monotonic() + max(0.0, self.end - time.monotonic()) / max(1, self.left)
        self.left -= 1
        return d


def bucket_record(b: dict, done: list, t0: float, t1: float) -> dict:
    toks = sum(n for _, n in done)
    return {"bucket": b["name"], "samples_planned": len(b["convs"]), "samples_done": len(done), "tokens": toks,
            "seconds": round(t1 - t0, 3), "tokens_per_s": round(toks / (t1 - t0), 1) if done and t1 > t0 else None}


def buckets_by_completion(buckets: list, finished: dict, start: float) -> list:
    """Per-bucket records of one pass over every bucket in order, from each sample's completion time
    (``finished``: id -> wall-clock time): a bucket runs from the last completion of the one before
    it (the first from ``start``) to its own last; with requests in flight at once they overlap at
    a bucket's edges."""
    recs, prev = [], start
    for b in buckets:
        done = [(c["id"], c["n"]) for c in b["convs"] if c["id"] in finished]
        end = max([finished[i] for i, _ in done], default=prev)
        recs.append(bucket_record(b, done, prev, max(end, prev)))
        prev = max(end, prev)
    return recs


def spread(values: list) -> dict:
    """The figures of the repetitions, with their min and median; when a repetition has no number
    (a bucket it did not reach), min and median are "not measured" too."""
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if values and len(nums) == len(values):
        return {"per_repetition": values, "min": min(nums), "median": round(statistics.median(nums), 6)}
    return {"per_repetition": values, "min": "not measured", "median": "not measured",
            "why": "%d of %d repetition(s) measured it" % (len(nums), len(values))}


def ratio(a, b):
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return round(a / b, 4) if ok and b > 0 else "not measured"


def bucket_rate(rep: dict, name: str):
    return next((b["tokens_per_s"] for b in rep["buckets"] if b["bucket"] == name), "not measured")


# ---- workers (run as `peers.py --worker NAME --plan FILE`) ------------------------------------------

def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


def worker_reference(plan: dict) -> dict:
    import torch

    from eaglepatch.gpucheck.reference import Reference

    t = time.monotonic()
    ref = Reference(Path(plan["model"]), device=plan["device"])
    inputs = torch.load(plan["inputs"], weights_only=True)
    out = {}
    for cid in plan["sample_ids"]:
        ids = inputs[cid]["input_ids"]
        out[cid] = {"input_ids": ids, "loss_mask": inputs[cid]["loss_mask"], **ref.states(ids.tolist())}
    torch.save(out, plan["reference"])
    return {"seconds": round(time.monotonic() - t, 1), "samples": len(out)}


def worker_hf(plan: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dev = plan["device"]
    dtype = getattr(torch, plan["dtype"])
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(plan["model"], dtype=dtype)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(plan["model"], torch_dtype=dtype)
    base = model.model.to(dev).eval()
    del model.lm_head  # the dataset needs no logits: the base model alone runs
    seen = {}
    for h in AUX_HF:
        base.layers[h - 1].register_forward_hook(lambda m, a, o, h=h: seen.__setitem__(h, _first(o)))
    inputs = torch.load(plan["inputs"], weights_only=True)
    startup = time.monotonic() - t0
    out = Path(plan["dataset"])

    def batches(convs, budget):
        cur, longest = [], 0
        for c in sorted(convs, key=lambda c: c["n"]):
            if cur and max(longest, c["n"]) * (len(cur) + 1) > budget:
                yield cur
                cur, longest = [], 0
            cur.append(c)
            longest = max(longest, c["n"])
        if cur:
            yield cur

    @torch.no_grad()
    def forward(group):
        T = max(c["n"] for c in group)
        ids = torch.zeros(len(group), T, dtype=torch.long)
        att = torch.zeros(len(group), T, dtype=torch.long)
        for r, c in enumerate(group):
            x = inputs[c["id"]]["input_ids"]
            ids[r, :len(x)] = x
            att[r, :len(x)] = 1
        seen.clear()
        final = base(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False).last_hidden_state
        return final, [seen[h] for h in AUX_HF]

    def sync():
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    # the best batch size: each token budget on the same few batches of the middle bucket, no writes
    OOM = getattr(torch, "OutOfMemoryError", RuntimeError)
    sweep = []
    mid = plan["buckets"][len(plan["buckets"]) // 2]["convs"] or plan["buckets"][0]["convs"]
    probe = mid[: max(4, len(mid) // 4)]
    for budget in plan["hf_budgets"]:
        try:
            forward(next(batches(probe, budget)))  # warm-up at this shape
            sync()
            t = time.monotonic()
            n = 0
            for g in batches(probe, budget):
                forward(g)
                n += sum(c["n"] for c in g)
            sync()
            sweep.append({"tokens_per_batch": budget, "tokens_per_s": round(n / (time.monotonic() - t), 1)})
        except OOM as exc:
            sweep.append({"tokens_per_batch": budget, "error": str(exc)[:120]})
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    ok = [s for s in sweep if "tokens_per_s" in s]
    best = max(ok, key=lambda s: s["tokens_per_s"])["tokens_per_batch"] if ok else plan["hf_budgets"][0]
    sweep_s = time.monotonic() - t0 - startup

    dl = Deadlines(plan["method_s"], len(plan["buckets"]))
    recs, total_bytes, split = [], 0, 0
    w0 = time.monotonic()
    for b in plan["buckets"]:
        deadline = dl.next()
        t = time.monotonic()
        done = []
        todo = list(batches(b["convs"], best))
        while todo:
            if time.monotonic() >= deadline:
                break
            g = todo.pop(0)
            try:
                final, aux = forward(g)
            except OOM:  # long prompts at the sweep's budget: halve the batch and go on
                seen.clear()
                if dev.startswith("cuda"):
                    torch.cuda.empty_cache()
                if len(g) == 1:
                    raise
                split += 1
                todo[:0] = [g[:len(g) // 2], g[len(g) // 2:]]
                continue
            final, aux = final.cpu(), [a.cpu() for a in aux]
            for r, c in enumerate(g):
                n = c["n"]
                x = inputs[c["id"]]
                total_bytes += save_sample(out / b["name"], c["id"], x["input_ids"], x["loss_mask"], final[r, :n],
                                           torch.cat([a[r, :n] for a in aux], dim=-1))
                done.append((c["id"], n))
        recs.append(bucket_record(b, done, t, time.monotonic()))
    return {"startup_s": round(startup, 2), "batch_sweep": sweep, "batch_sweep_s": round(sweep_s, 2),
            "tokens_per_batch": best, "batches_halved_after_oom": split, "work_s": round(time.monotonic() - w0, 3), "buckets": recs,
            "device": dev, "dtype": plan["dtype"]}


def worker_specforge(plan: dict) -> dict:
    """SpecForge 0.2.0's offline capture API on the unpatched sglang first on PYTHONPATH."""
    import importlib.metadata as md

    import torch

    info = {}
    for pkg in ("specforge", "sglang"):
        try:
            info[pkg + "_version"] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg + "_version"] = None
    try:
        import sglang

        info["sglang_version"] = getattr(sglang, "__version__", info["sglang_version"])
    except Exception as exc:
        return dict(info, refused="sglang does not import (%s: %s)" % (type(exc).__name__, str(exc)[:200]))
    t0 = time.monotonic()
    try:
        from specforge.distributed import init_distributed
        from specforge.offline_capture import load_offline_eagle3_capture

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(plan["free_port"]))
        init_distributed(tp_size=1)
        kw = dict(plan["specforge_server_args"])
        cap = load_offline_eagle3_capture(plan["model"], torch_dtype=getattr(torch, plan["dtype"]), **kw)
        cap.set_capture_layers(plan["unpatched_draft_ids"])
    except BaseException as exc:  # ImportError of a module sglang 0.5.14 has, a CUDA-only call, ...
        import traceback

        tb = traceback.extract_tb(exc.__traceback__)
        where = "%s:%d" % (Path(tb[-1].filename).name, tb[-1].lineno) if tb else "?"
        return dict(info, refused="%s: %s (at %s)" % (type(exc).__name__, str(exc)[:240], where),
                    seconds_to_refusal=round(time.monotonic() - t0, 2))
    startup = time.monotonic() - t0
    inputs = torch.load(plan["inputs"], weights_only=True)
    out = Path(plan["dataset"])
    dl = Deadlines(plan["method_s"], len(plan["buckets"]))
    recs = []
    w0 = time.monotonic()
    for b in plan["buckets"]:
        deadline = dl.next()
        t = time.monotonic()
        done = []
        for c in b["convs"]:  # one request per call: its rows are split per request, padding would be real tokens
            if time.monotonic() >= deadline:
                break
            x = inputs[c["id"]]
            ids = x["input_ids"].view(1, -1)
            got = cap.capture(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=x["loss_mask"].view(1, -1))
            save_sample(out / b["name"], c["id"], x["input_ids"], x["loss_mask"], got.last_hidden_states[0].cpu(),
                        got.hidden_states[0].cpu())
            done.append((c["id"], c["n"]))
        recs.append(bucket_record(b, done, t, time.monotonic()))
    return dict(info, startup_s=round(startup, 2), work_s=round(time.monotonic() - w0, 3), buckets=recs)


def _rows(meta: dict, n: int):
    """The prompt rows of a /generate answer's ``meta_info["hidden_states"]``."""
    hs = meta.get("hidden_states")
    if not hs:
        raise ValueError("no hidden_states in the answer")
    first = hs[0]
    rows = first if first and isinstance(first[0], list) else hs
    if len(rows) < n:  # upstream returns one row per token it prefilled, none for a cached prefix
        raise ValueError("hidden_states holds %d rows for a %d-token prompt: the rows of a prefix the server "
                         "took from its radix cache are not returned; run it with --disable-radix-cache"
                         % (len(rows), n))
    return rows[:n]


def worker_json(plan: dict) -> dict:
    """The client of sglang-json: one pass over the buckets against ``plan["url"]``; ``final`` keeps
    each prompt's rows in a scratch file, ``aux`` joins them with the aux rows into the dataset."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    import requests
    import torch

    dtype = getattr(torch, plan["dtype"])
    inputs = torch.load(plan["inputs"], weights_only=True)
    scratch, out, which = Path(plan["scratch"]), Path(plan["dataset"]), plan["pass"]
    local = threading.local()  # a requests.Session per client thread
    json_bytes = [0]
    lock = threading.Lock()
    state = {"deadline": 0.0, "open": None}

    def one(c):
        x = inputs[c["id"]]
        if not hasattr(local, "session"):
            local.session = requests.Session()
        left = state["deadline"] - time.monotonic()
        r = local.session.post(plan["url"] + "/generate", timeout=(10, max(1.0, left + 5)), json={
            "input_ids": x["input_ids"].tolist(), "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        r.raise_for_status()
        with lock:
            json_bytes[0] += len(r.content)
        rows = torch.tensor(_rows(r.json()["meta_info"], c["n"]), dtype=torch.float32).to(dtype)
        name = sample_rel(c["id"]).rsplit("/", 1)[1] + ".pt"
        with lock:  # written only while its bucket is open: an answer after the bucket's time is dropped
            if state["open"] != c["bucket"]:
                return None
            if which == "final":
                scratch.mkdir(parents=True, exist_ok=True)
                torch.save(rows, str(scratch / name))
            else:
                final = torch.load(str(scratch / name), weights_only=True)
                save_sample(out / c["bucket"], c["id"], x["input_ids"], x["loss_mask"], final, rows)
                (scratch / name).unlink()
        return c["id"], c["n"]

    dl = Deadlines(plan["method_s"], len(plan["buckets"]))
    recs, errors, abandoned = [], [], 0
    w0 = time.monotonic()
    for b in plan["buckets"]:
        deadline = dl.next()
        state["deadline"], state["open"] = deadline, b["name"]
        t = time.monotonic()
        done = []
        todo = [dict(c, bucket=b["name"]) for c in b["convs"]
                if which == "final" or (scratch / (sample_rel(c["id"]).rsplit("/", 1)[1] + ".pt")).is_file()]
        it = iter(todo)
        running = set()
        # a pool per bucket: requests still running at the deadline are abandoned (their answers are
        # not written), and the next bucket does not queue behind them
        pool = ThreadPoolExecutor(plan["json_concurrency"])
        while True:
            while len(running) < plan["json_concurrency"] and time.monotonic() < deadline:
                c = next(it, None)
                if c is None:
                    break
                running.add(pool.submit(one, c))
            if not running:
                break
            fin, running = wait(running, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            for f in fin:
                try:
                    f.result()
                except Exception as exc:
                    errors.append("%s: %s" % (type(exc).__name__, str(exc)[:200]))
            if time.monotonic() >= deadline and running:
                abandoned += len(running)
                break
        with lock:
            state["open"] = None
        t1 = time.monotonic()
        pool.shutdown(wait=False, cancel_futures=True)
        # what this bucket wrote, from the files (final: the scratch rows; aux: the dataset's samples)
        for c in todo:
            name = sample_rel(c["id"]).rsplit("/", 1)[1] + ".pt"
            if (scratch / name).is_file() if which == "final" else (out / b["name"] / sample_rel(c["id"])).is_file():
                done.append((c["id"], c["n"]))
        rec = bucket_record(b, done, t, t1)
        rec["samples_planned"] = len(todo)
        recs.append(rec)
    return {"work_s": round(time.monotonic() - w0, 3), "buckets": recs, "errors": errors[:5],
            "error_count": len(errors), "json_bytes": json_bytes[0], "requests_abandoned_at_deadline": abandoned}


def worker_limit(plan: dict) -> dict:
    """The limit's client: ``plan["warm_passes"]`` untimed passes (their figures kept apart, as
    ``warm_passes``), then ``plan["repeats"]`` timed passes, each over the token ids ``ours`` sends
    in bucket order with ``concurrency`` requests in flight, through extract's own client (its
    ``/generate`` body: the ids, ``max_new_tokens`` 1, temperature 0, a rid of its own). A pass runs
    from its first request to its last answer, ``method_s`` at most: an answer after that is not
    counted, and the pass waits for it (the server is still prefilling it) before the next starts.
    Writes nothing but its result."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    import torch

    from eaglepatch.extract.client import SGLangClient
    from eaglepatch.extract.dumps import new_rid

    inputs = torch.load(plan["inputs"], weights_only=True)
    order = [c for b in plan["buckets"] for c in b["convs"]]
    ids = {c["id"]: inputs[c["id"]]["input_ids"].tolist() for c in order}
    client = SGLangClient(plan["url"])
    conc = plan["concurrency"]

    def one(cid):
        client.generate(ids[cid], rid=new_rid())
        return cid, time.time()

    reps = []
    for _ in range(plan["warm_passes"] + plan["repeats"]):
        finished, errors, after = {}, [], 0
        it = iter(order)
        running = set()
        pool = ThreadPoolExecutor(conc)
        first = time.time()
        end = first + plan["method_s"]
        while True:
            while len(running) < conc and time.time() < end:
                c = next(it, None)
                if c is None:
                    break
                running.add(pool.submit(one, c["id"]))
            if not running:
                break
            fin, running = wait(running, timeout=max(0.0, end - time.time()), return_when=FIRST_COMPLETED)
            for f in fin:
                try:
                    cid, t = f.result()
                except Exception as exc:  # counted and reported; the conversation is not
                    errors.append("%s: %s" % (type(exc).__name__, str(exc)[:200]))
                    continue
                if t <= end:
                    finished[cid] = t
                else:
                    after += 1
            if time.time() >= end:
                break
        late = after + len(running)
        wait(running, timeout=plan["drain_s"])
        pool.shutdown(wait=False, cancel_futures=True)
        reps.append({"buckets": buckets_by_completion(plan["buckets"], finished, first),
                     "work_s": round(max(finished.values(), default=first) - first, 3), "answers": len(finished),
                     "answers_after_the_time": late, "error_count": len(errors), "errors": errors[:5]})
    warm = [{"answers": r["answers"], "work_s": r["work_s"],
             "tokens_per_s": round(sum(b["tokens"] for b in r["buckets"]) / r["work_s"], 1) if r["work_s"] else None}
            for r in reps[:plan["warm_passes"]]]
    return {"warm_passes": warm, "repetitions": reps[plan["warm_passes"]:]}


WORKERS = {"reference": worker_reference, "hf": worker_hf, "specforge": worker_specforge, "json": worker_json,
           "limit": worker_limit}


def run_worker(name: str, plan_file: Path) -> int:
    plan = json.loads(plan_file.read_text())
    res = WORKERS[name](plan)
    Path(plan["result"]).write_text(json.dumps(res, indent=2) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads of abandoned requests (sglang-json) are not waited for


# ---- the driver -----------------------------------------------------------------------------------

class Run:
    def __init__(self, a, prof: dict):
        self.a, self.prof = a, prof
        self.gpu = not a.cpu
        self.work = Path(a.work).absolute() if a.work else Path(tempfile.mkdtemp(prefix="eaglepatch-peers-"))
        self.extra_dumps: list[Path] = []  # --dump-dir's subdirectories (dumps_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: dict = {}
        self.env_py = sys.executable

    # -- set-up --
    def prepare(self) -> None:
        import torch

        from eaglepatch.extract.data import load_conversations
        from eaglepatch.extract.tokenize import ChatTokenizer

        w = self.work
        if self.gpu:
            self.model, self.tokenizer = self.gpu_model()
            self.release = self.site_release()
        else:
            say("preparing the CPU demo (tools/serve.py --cpu-demo --print): model, tokenizer, patched tree")
            r = subprocess.run([self.env_py, str(REPO / "tools" / "serve.py"), "--cpu-demo", str(w / "demo"),
                                "--layers=" + ",".join(map(str, self.dump_ids("0.5.9"))), "--print"],
                               cwd=REPO, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError("tools/serve.py --cpu-demo --print failed: " + r.stderr[-1500:])
            info = json.loads((w / "demo" / "serve.json").read_text())
            self.model = self.tokenizer = Path(info["model"])
            self.release = "0.5.9"
        cfg = json.loads((self.model / "config.json").read_text())
        self.num_layers, self.hidden, self.vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
        if self.num_layers < 4:
            raise UsageError("--model has %d layers; the benchmark reads the outputs of layers 0, 1, 2" % self.num_layers,
                             "pass a model with at least 4 decoder layers")
        n = self.a.conversations or self.prof["conversations"]
        recs = make_conversations(n, self.prof, tokenizer_words(self.vocab))
        (w / "data").mkdir(exist_ok=True)
        allf = w / "data" / "all.jsonl"
        allf.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tok = ChatTokenizer(self.tokenizer)
        ml = self.prof["extract_max_len"]
        inputs, convs = {}, []
        for c in load_conversations(allf):
            e = tok.encode(c.messages, ml)
            inputs[c.id] = {"input_ids": torch.tensor(e.input_ids, dtype=torch.int64),
                            "loss_mask": torch.tensor(e.loss_mask, dtype=torch.int64)}
            convs.append({"id": c.id, "n": len(e.input_ids)})
        torch.save(inputs, str(w / "inputs.pt"))
        edges = self.prof["buckets"]
        self.buckets = []
        for j in range(len(edges) - 1):
            mine = [c for c in convs if bucket_of(c["n"], edges) == j]
            name = "b%d-%d-%d" % (j, edges[j], edges[j + 1] - 1)
            self.buckets.append({"name": name, "lo": edges[j], "hi": edges[j + 1] - 1, "convs": mine})
        self.buckets = [b for b in self.buckets if b["convs"]]
        by_id = {r["id"]: r for r in recs}
        (w / "data" / "ordered.jsonl").write_text(
            "".join(json.dumps(by_id[c["id"]]) + "\n" for b in self.buckets for c in b["convs"]))
        k = self.prof["sample_per_bucket"]
        cap = GPU_SAMPLE_MAX_LEN if self.gpu else 10 ** 9
        self.sample_ids = [c["id"] for b in self.buckets for c in b["convs"][:k] if c["n"] <= cap]
        self.tokens_total = sum(c["n"] for c in convs)
        self.results["conversations"] = {
            "count": len(convs), "tokens": self.tokens_total, "min_tokens": min(c["n"] for c in convs),
            "max_tokens": max(c["n"] for c in convs), "median_tokens": sorted(c["n"] for c in convs)[len(convs) // 2],
            "buckets": [{"bucket": b["name"], "conversations": len(b["convs"]), "tokens": sum(c["n"] for c in b["convs"])}
                        for b in self.buckets],
            "generator": "make_conversations (seeded, ShareGPT form)", "reference_sample": self.sample_ids}
        say("%d conversations, %d tokens (%d..%d), buckets %s; reference sample %d conversations"
            % (len(convs), self.tokens_total, self.results["conversations"]["min_tokens"],
               self.results["conversations"]["max_tokens"],
               ", ".join("%s:%d" % (b["name"], len(b["convs"])) for b in self.buckets), len(self.sample_ids)))

    def dump_ids(self, release: str, unpatched: bool = False) -> list:
        from eaglepatch import conventions

        rule = conventions.release_rule(release, unpatched=unpatched, patches_root=REPO / "patches")
        ids = conventions.ids_for(rule, list(AUX_HF))
        if ids is None:
            raise UsageError("sglang %s cannot name HF indices %s" % (release, list(AUX_HF)), "use another release")
        return ids

    def site_release(self) -> str:
        import importlib.metadata as md
        import importlib.util

        spec = importlib.util.find_spec("sglang")
        if spec is None:
            raise UsageError("no sglang on this python's path", "run with PYTHONPATH=/tmp/site:src (docs/gpu.md)")
        self.site = Path(self.a.site or Path(spec.origin).resolve().parent.parent)
        try:
            return md.version("sglang")
        except md.PackageNotFoundError:
            text = (self.site / "sglang" / "version.py").read_text()
            return re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text).group(1)

    def gpu_model(self):
        m = Path(self.a.model).absolute()
        if not (m / "config.json").is_file():
            from eaglepatch.gpucheck import models
            from eaglepatch.gpucheck.reference import build_checkpoint

            cfg = dict(models.THROUGHPUT_MODEL, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
            say("building the target at %s: DeepSeek-V3 widths (hidden 7168), 4 layers, 8 experts top-2, seeded "
                "weights shaped as the GPU check's, drawn on the CPU (4.1 G values)" % m)
            build_checkpoint(m, cfg)
        tok = m
        if not (m / "tokenizer_config.json").is_file():
            from eaglepatch.serve import tinychat

            tok = self.work / "tokenizer"
            vocab = json.loads((m / "config.json").read_text())["vocab_size"]
            if not (tok / "tokenizer_config.json").is_file():
                tinychat.build_tokenizer(tok, vocab_size=vocab)
        return m, tok

    def plan(self, name: str, **kw) -> Path:
        import cpuserver

        d = self.work / name
        d.mkdir(parents=True, exist_ok=True)
        p = {"model": str(self.model), "tokenizer": str(self.tokenizer), "inputs": str(self.work / "inputs.pt"),
             "device": "cuda" if self.gpu else "cpu", "dtype": self.prof["dtype"],
             "buckets": [{"name": b["name"], "convs": b["convs"]} for b in self.buckets],
             "method_s": self.method_s(), "hf_budgets": self.prof["hf_budgets"], "sample_ids": self.sample_ids,
             "reference": str(self.work / "reference.pt"), "dataset": str(d / "dataset"), "result": str(d / "result.json"),
             "free_port": cpuserver.free_port(), "json_concurrency": self.prof["json_concurrency"]}
        p.update(kw)
        f = d / ("plan-%s.json" % kw.get("pass", name))
        f.write_text(json.dumps(p, indent=2))
        Path(p["result"]).unlink(missing_ok=True)
        return f

    def wait_s(self) -> float:
        """How long a server start or a worker may take: never far past the budget (a GPU call has a
        hard limit), at least a minute."""
        return max(60.0, min(900.0, (self.a.budget_s or self.prof["budget_s"]) + 150 - (time.monotonic() - T0)))

    def method_s(self, who: str | None = None) -> float:
        """Seconds of work per pass: --method-s, cut to what --budget-s leaves (less 20 s), 5 at least;
        ``who``: say it when the budget cut it (a pass cut below extract's own start-up measures nothing)."""
        want = self.a.method_s or self.prof["method_s"]
        left = (self.a.budget_s or self.prof["budget_s"]) - (time.monotonic() - T0) - 20
        got = max(5.0, min(want, left))
        if who and got < want:
            say("%s: %.0f s of work per pass, not %.0f: --budget-s %.0f leaves no more (pass a larger --budget-s)"
                % (who, got, want, self.a.budget_s or self.prof["budget_s"]))
        return got

    def worker(self, name: str, plan_file: Path, env: dict, sampler: Sampler | None, timeout: float) -> dict:
        log = plan_file.parent / ("worker-%s.log" % plan_file.stem)
        p = start([self.env_py, str(Path(__file__).resolve()), "--worker", name, "--plan", str(plan_file)], log,
                  env=env, sampler=sampler)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(p, grace=5)
            return {"failed": "worker %s ran past %.0f s; log %s: %s" % (name, timeout, log, log_tail(log))}
        res = Path(json.loads(plan_file.read_text())["result"])
        if p.returncode != 0 or not res.is_file():
            return {"failed": "worker %s exited %s: %s" % (name, p.returncode, log_tail(log, 2))}
        return json.loads(res.read_text())

    def base_env(self, tree: Path | None = None, cpu_stubs: bool = True) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
        paths = [str(SRC)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        if tree is not None:
            paths.insert(0, str(tree))
            if not self.gpu and cpu_stubs:
                from eaglepatch.smoke import STUBS

                paths.insert(1, str(STUBS))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if self.gpu:
            from eaglepatch.gpucheck.check import MULTICAST_OFF

            for k, v in MULTICAST_OFF.items():
                env.setdefault(k, v)
        else:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        return env

    def upstream_tree(self) -> Path:
        """The unpatched sglang the peers run: on the GPU the installed one (None: first on the path);
        on CPU upstream 0.5.9 plus only the series' test-only smoke patch (torch_native DeepSeek
        attention routed to MLA: upstream's MHA prefill there is silently wrong on CPU, a CPU-only
        upstream bug unrelated to hidden states), none of the series' product patches."""
        if self.gpu:
            return None
        dest = self.work / "upstream"
        if not (dest / "sglang").is_dir():
            from eaglepatch.fetch import unpacked_release
            from eaglepatch.smoke.tree import patched_tree

            patched_tree(unpacked_release("0.5.9", quiet=True), REPO / "patches" / "sglang-0.5.9", dest, smoke=True,
                         product=False)
        return dest

    def server_flags(self, port: int) -> list:
        """launch_server flags of the unpatched sglang-json servers. Both profiles turn the radix cache off
        (DUMP_FLAGS, which cpu_flags holds): every prompt starts with the same BOS token, and upstream
        returns no row for a cached prefix, so with the cache on every answer after the first came back
        a row short (the H200, 2026-12-04)."""
        from eaglepatch.serve import DUMP_FLAGS, cpu_flags

        if not self.gpu:
            return cpu_flags(self.model, self.tokenizer, "127.0.0.1", port)
        return ["--model-path", str(self.model), "--tokenizer-path", str(self.tokenizer), "--host", "127.0.0.1",
                "--port", str(port), *DUMP_FLAGS, *self.gpu_engine_flags()]

    def gpu_engine_flags(self) -> list:
        return ["--dtype", "bfloat16", "--attention-backend", "triton", "--disable-cuda-graph",
                "--context-length", str(self.prof["extract_max_len"] + 512), "--chunked-prefill-size", "8192",
                "--mem-fraction-static", "0.6", "--random-seed", "0", "--grammar-backend", "none"]

    def warm_server(self, url: str, who: str, hidden: bool = False) -> dict:
        """Untimed warm-up of a fresh server, as the HF method warms each batch shape before its sweep:
        rounds of ``WARM_WAVES`` waves of ``concurrency`` plain ``/generate`` requests each (random ids,
        lengths drawn from every bucket; ``json_concurrency`` in flight when ``hidden``, as in its timed
        pass), until ``WARM_STABLE`` rounds in a row each run within 10% of the one before, or ``warm_s``
        is spent (an H100 limit server stopped after 9 rounds of one wave at 54k tokens/s, then timed
        36k, 62k, 90k in its three passes: one-wave rounds are too short to tell). A first start compiles Triton kernels for
        each new batch shape (seconds each), which a user's hours-long run pays once; the figures after
        it are the server's steady state. ``hidden``: the requests ask for ``return_hidden_states``
        (the sglang-json passes)."""
        from concurrent.futures import ThreadPoolExecutor

        import requests

        limit = self.prof["warm_s"] if self.a.warm_s is None else self.a.warm_s
        rec = {"warm_s_limit": limit, "rounds": []}
        if limit <= 0:
            return rec
        rng = random.Random(5)
        n = self.prof["json_concurrency" if hidden else "concurrency"]  # as many in flight as the timed pass
        edges = self.prof["buckets"]
        t0 = time.monotonic()

        def one(length: int) -> None:
            ids = [rng.randrange(3, self.vocab) for _ in range(length)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            if hidden:
                body["return_hidden_states"] = True
            requests.post(url + "/generate", json=body, timeout=max(10.0, limit + 30)).raise_for_status()

        with ThreadPoolExecutor(n) as pool:
            while time.monotonic() - t0 < limit:
                lengths = [rng.randrange(edges[j % (len(edges) - 1)], edges[j % (len(edges) - 1) + 1])
                           for j in range(n * WARM_WAVES)]
                t = time.monotonic()
                try:
                    list(pool.map(one, lengths))
                except Exception as exc:  # noqa: BLE001 - the timed pass reports the server's errors
                    rec["error"] = "%s: %s" % (type(exc).__name__, str(exc)[:200])
                    break
                rate = sum(lengths) / max(time.monotonic() - t, 1e-9)
                rec["rounds"].append({"requests": len(lengths), "tokens": sum(lengths), "tokens_per_s": round(rate, 1)})
                if steady(r["tokens_per_s"] for r in rec["rounds"]):
                    break
        rec["warm_s"] = round(time.monotonic() - t0, 2)
        say("%s: warm-up %d round(s) in %.0f s (tokens/s per round: %s)" % (
            who, len(rec["rounds"]), rec["warm_s"], ", ".join("%.0f" % r["tokens_per_s"] for r in rec["rounds"])))
        return rec

    def dumps_dir(self) -> Path:
        """Where ours's server writes its dump files while extract reads them: WORK/dumps, or with
        --dump-dir a new subdirectory of it (on /dev/shm the dump never reaches the disk, so the
        disk takes the bytes once: the dataset)."""
        if not self.a.dump_dir:
            return self.work / "dumps"
        d = Path(tempfile.mkdtemp(prefix="peers-dumps-", dir=self.a.dump_dir))
        self.extra_dumps.append(d)
        return d

    def drop_extra_dumps(self) -> None:
        """--dump-dir's subdirectories lie outside the work directory (on /dev/shm: memory), so they are
        removed even with --keep-work."""
        while self.extra_dumps:
            shutil.rmtree(self.extra_dumps.pop(), ignore_errors=True)

    # -- methods --
    def serve_cmd(self, port: int, dumps: Path, dump_flags: tuple = ()) -> list:
        """``tools/serve.py``'s command line of ours's server (GPU: the installed sglang with the series'
        patched files laid over it, dumps in ``dumps``; CPU: the demo, dumps in its own directory), with
        serve.py's ``dump_flags`` (e.g. ``--dump-dtype fp8``). The limit's server is the command this
        prints with ``--print``."""
        serve = [self.env_py, REPO / "tools" / "serve.py", *dump_flags]
        ids = ",".join(map(str, self.dump_ids(self.release)))
        if not self.gpu:
            return serve + ["--cpu-demo", self.work / "demo", "--layers=" + ids, "--port", port]
        from eaglepatch.gpucheck.patched_files import lay_patched_files

        pp = lay_patched_files(Path(self.a.patched_files or REPO / ".gpu-patched"), self.site, self.work / "patched")
        return serve + ["--model-path", self.model, "--dump-dir", dumps, "--layers=" + ids, "--sglang", pp, "--series",
                        REPO / "patches" / ("sglang-" + self.release), "--port", port, "--python", self.env_py, "--",
                        "--tokenizer-path", self.tokenizer, *self.gpu_engine_flags()]

    def method_limit(self, s: Sampler) -> dict:
        """ours's server with the dump off: the line ``tools/serve.py --print`` gives for ours's command,
        run without its EAGLE3_DUMP_* variables (the patched server without EAGLE3_DUMP_DIR has no
        dump, and no flush route: checked), in a temporary directory of its own as serve.py runs it."""
        import cpuserver
        import requests

        from eaglepatch.serve import Plan, launch_environ

        d = self.work / "limit"
        d.mkdir(exist_ok=True)
        port = cpuserver.free_port()
        url = "http://127.0.0.1:%d" % port
        log = d / "server.log"
        cmd = self.serve_cmd(port, d / "dump-off")
        cmd.insert(2, "--print")  # serve.py's own flag: before any "--" (what follows goes to launch_server)
        r = subprocess.run([str(c) for c in cmd], env=self.base_env(), cwd=REPO, capture_output=True, text=True,
                           timeout=self.wait_s())
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            return {"refused": "tools/serve.py --print exited %s: %s" % (r.returncode, r.stderr.strip()[-300:])}
        words = shlex.split(lines[-1])
        k = 0
        while k < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[k], re.S):
            k += 1
        assigned = dict(w.split("=", 1) for w in words[:k])
        dropped = sorted(v for v in assigned if v.startswith("EAGLE3_DUMP_"))
        env, tmp = launch_environ(Plan(words[k:], dict(self.base_env(), **{v: x for v, x in assigned.items()
                                                                          if v not in dropped}), url))
        p = start(words[k:], log, env=env, sampler=s)
        try:
            try:
                startup = wait_http(p, url, log, self.wait_s())
            except Exception:
                return {"refused": "the dump-off server did not start: " + log_tail(log, 2), "log": str(log)}
            say("limit: dump-off server ready in %.0f s (%s)" % (startup, url))
            code = requests.post(url + "/eagle3_dump/flush", json={}, timeout=60).status_code
            if code != 404:
                return {"failed": "the dump-off server answers POST /eagle3_dump/flush with HTTP %d: its dump is on"
                                  % code}
            warm = self.warm_server(url, "limit")
            method_s = self.method_s("limit")
            plan = self.plan("limit", url=url, concurrency=self.prof["concurrency"], repeats=self.a.repeats,
                             warm_passes=WARM_PASSES if warm["rounds"] else 0,
                             method_s=method_s, drain_s=60)
            res = self.worker("limit", plan, self.base_env(), s,
                              (self.a.repeats + WARM_PASSES) * (method_s + 60) + self.wait_s())
        finally:
            stop(p)
            shutil.rmtree(tmp, ignore_errors=True)
        if "failed" in res:
            return res
        if not any(rep["answers"] for rep in res["repetitions"]):
            e = res["repetitions"][0]
            return dict(res, failed="no answer in time, %d request(s) failed%s" % (
                e["error_count"], (": " + e["errors"][0]) if e["errors"] else ""))
        warm["passes"] = res.pop("warm_passes", [])  # the untimed passes of the real conversations, after the rounds
        return dict(res, startup_s=round(startup, 2), warmup=warm, method_s_per_repetition=round(method_s, 1),
                    server="the patched sglang %s of ours, the same tools/serve.py command (its --print line) run "
                           "without %s: the dump off" % (self.release, ", ".join(dropped) or "any EAGLE3_DUMP_ variable"),
                    dump_route="POST /eagle3_dump/flush answered 404 (no dump)",
                    client="tools/extract.py's SGLangClient: /generate with the ids, max_new_tokens 1, %d in flight"
                           % self.prof["concurrency"])

    def method_ours_processes(self, s: Sampler) -> dict:
        """``ours`` with one extract run whose samples are made in ``--extract-processes`` worker processes
        (extract's ``--processes``): one dataset, ``--concurrency`` as ``ours``'s."""
        return self.method_ours(s, "ours-processes")

    def method_ours_fp8(self, s: Sampler) -> dict:
        """``ours-processes`` storing fp8 (the server's fp8 states with the rebuildable ones left out, extract's
        ``--format compact``), its dumps in ``--dump-dir`` and its dataset in the work directory."""
        return self.method_ours(s, "ours-fp8")

    def method_ours_fp8_disk(self, s: Sampler) -> dict:
        """``ours-fp8`` with its dumps and dataset on ``--disk-dir``."""
        return self.method_ours(s, "ours-fp8-disk")

    def method_ours_mooncake(self, s: Sampler) -> dict:
        """``ours-processes`` through the Mooncake sink: the server puts each request's states into the store
        of a ``mooncake_master`` this method starts, extract reads them from it (``--mooncake-master``)."""
        return self.method_ours(s, "ours-mooncake")

    def disk_dir(self, name: str) -> Path:
        """ours-fp8-disk's directory for its dumps and datasets: a new subdirectory of --disk-dir
        (removed after the method, as --dump-dir's), or WORK/NAME."""
        if not (self.gpu and self.a.disk_dir):
            return self.work / name
        d = Path(tempfile.mkdtemp(prefix="peers-disk-", dir=self.a.disk_dir))
        self.extra_dumps.append(d)
        return d

    def mooncake_site(self) -> Path:
        """The site holding the mooncake package and its ``mooncake_master``: --mooncake-site, or on CPU
        the project's own (``eaglepatch.mooncake.ensure_site``, its Debian libraries first)."""
        if self.a.mooncake_site:
            return Path(self.a.mooncake_site)
        from eaglepatch import mooncake, sysdeps

        sysdeps.ensure()
        return mooncake.ensure_site(Path(self.env_py))

    def ours_places(self, name: str) -> tuple:
        """(the server's dump directory, extract's output directory) of ours's method ``name``."""
        v = OURS_VARIANTS[name]
        d = self.work / name
        out_dir = self.disk_dir(name) if v["place"] == "disk" else d
        if not self.gpu:
            dumps = self.work / "demo" / "dumps"
        elif v["place"] == "disk":
            dumps = out_dir / "dumps"
            dumps.mkdir(exist_ok=True)
        else:
            dumps = self.dumps_dir()
        return dumps, out_dir

    def method_ours(self, s: Sampler, name: str = "ours") -> dict:
        import cpuserver
        import requests

        from eaglepatch import mooncake

        v = OURS_VARIANTS[name]
        processes = self.a.extract_processes if v["processes"] else 1
        d = self.work / name
        d.mkdir(exist_ok=True)
        port = cpuserver.free_port()
        url = "http://127.0.0.1:%d" % port
        log = d / "server.log"
        ids = self.dump_ids(self.release)
        dumps, out_dir = self.ours_places(name)
        # the disk's own rate bounds a method whose dumps and dataset go there (run 19: 0.16 of the limit)
        probe = disk_write_rate(out_dir, (4 << 30) if self.gpu else (64 << 20)) if v["place"] == "disk" else None
        flags = ["--dump-dtype", "fp8", "--rebuildable", "omit"] if v["fp8"] else []
        if self.a.dump_writers:
            flags += ["--dump-writers", str(self.a.dump_writers)]
        if self.a.dump_gil_switch_ms:
            flags += ["--dump-gil-switch-ms", "%g" % self.a.dump_gil_switch_ms]
        env = self.base_env()
        master, store = None, MOONCAKE_MB["gpu" if self.gpu else "cpu"]
        if v["sink"] == "mooncake":
            site = self.mooncake_site()
            env = mooncake.with_site(env, site)
            master = mooncake.Master(site, d / "master.log").start()
            flags += ["--sink", "mooncake", "--mooncake-host", "127.0.0.1", "--mooncake-ttl-s", "600",
                      "--mooncake-segment-mb", str(store["segment_mb"]), "--mooncake-buffer-mb", str(store["buffer_mb"])]
        where = ["--mooncake-master", master.address, "--mooncake-metadata", master.metadata] if master else []
        serve = self.serve_cmd(port, dumps, tuple(flags + where))
        t0 = time.monotonic()
        p = start(serve, log, env=env, sampler=s)
        try:
            startup = wait_http(p, url, log, self.wait_s())
        except Exception:
            stop(p)
            if master is not None:
                master.stop()
            return {"refused": "the patched server did not start: " + log_tail(log, 2), "log": str(log)}
        say("%s: server ready in %.0f s (%s)" % (name, startup, url))

        cleared = []

        def clear_dumps(after: str):  # the directory and the store are the run's own: what a phase left
            requests.post(url + "/eagle3_dump/flush", json={}, timeout=120)  # (flushed first) is removed
            for f in Path(dumps).glob("*.safetensors"):
                f.unlink()
            if master is not None:  # nobody reads the warm-up's objects: left, they filled an H100 run's store
                cleared.append({"after": after, "keys_removed": clear_store(self.env_py, env, master)})

        def one_pass(k: int) -> dict:
            return self.ours_pass(url, dumps, d, k, method_s, env, s, processes,
                                  out_dir if v["fp8"] else None, master)

        reps = []
        try:
            warm = self.warm_server(url, name)
            method_s = self.method_s(name)
            warm["passes"] = []
            for i in range(WARM_PASSES if warm["rounds"] else 0):  # untimed, as the limit's: the same extract run
                clear_dumps("warm-up rounds" if i == 0 else "untimed pass %d" % i)
                w = one_pass(-1)
                warm["passes"].append({k: w.get(k) for k in ("answers", "samples_done", "work_s", "tokens_per_s",
                                                             "losses", "failed")
                                       if w.get(k) is not None})
                if "failed" in w:  # as a timed pass's: the passes after it would lose the same samples
                    return {"failed": "untimed pass %d: %s" % (i + 1, w["failed"]), "warmup": warm,
                            **({"store_cleared": cleared} if master is not None else {})}
            if warm["rounds"]:
                clear_dumps("untimed pass %d" % WARM_PASSES if WARM_PASSES else "warm-up rounds")
            for k in range(self.a.repeats):
                if k:
                    clear_dumps("repetition %d" % k)
                rep = one_pass(k)
                if "failed" in rep:
                    return {"failed": "repetition %d: %s" % (k + 1, rep["failed"]), "repetitions": reps,
                            "failed_repetition": rep, **({"store_cleared": cleared} if master is not None else {})}
                reps.append(rep)
        finally:
            stop(p)
            if master is not None:
                master.stop()
        return {"startup_s": round(startup + reps[0]["client_startup_s"], 2), "server_startup_s": round(startup, 2),
                "client_startup_s": reps[0]["client_startup_s"], "warmup": warm, "repetitions": reps,
                "method_s_per_repetition": round(method_s, 1), "bucket_times": "from the sample files' modification times",
                "server": "patched sglang %s (tools/serve.py), EAGLE3_DUMP_LAYERS=%s, final on"
                          % (self.release, ",".join(map(str, ids))),
                "server_dump_flags": " ".join(flags),
                "dump_writers": self.a.dump_writers or "the server's default (EAGLE3_DUMP_WRITERS unset)",
                "dump_gil_switch_ms": self.a.dump_gil_switch_ms or "Python's own (EAGLE3_DUMP_GIL_SWITCH_MS unset)",
                "extract_worker_processes": processes,
                **({"sink": "mooncake: a mooncake_master of this run, extract --mooncake-master (no dump file)",
                    "mooncake_store_mb": store, "store_cleared": cleared} if master is not None else
                   {"sink": "file", "dump_dir": str(dumps), "dump_file_system": file_system(dumps)}),
                **({"storage": "fp8 states, rebuildable ones left out (serve.py --dump-dtype fp8 --rebuildable omit; "
                               "extract --format compact)", "dataset_dir": str(out_dir),
                    "dataset_file_system": file_system(out_dir)} if v["fp8"] else {}),
                **({"disk_dir": str(out_dir), "disk_file_system": file_system(out_dir), "disk_write_rate": probe}
                   if v["place"] == "disk" else {}),
                "start_to_ready_s": round(time.monotonic() - t0, 1)}

    def ours_pass(self, url: str, dumps: Path, d: Path, k: int, method_s: float, env: dict, s: Sampler,
                  processes: int = 1, compact_in: Path | None = None, master=None) -> dict:
        """One timed ``tools/extract.py`` run (repetition ``k``) over every conversation into a new
        dataset, stopped as a user stops it once ``method_s`` is spent; its dataset checked (reader,
        reference) and, unless --keep-work, removed before the next (hidden 7168: tens of GB each).
        ``processes`` > 1: with ``--processes`` (its samples made in that many worker processes).
        ``compact_in``: ``--format compact`` (fp8 as the dump stored it), the dataset in that directory.
        ``k`` -1: the untimed pass after the warm-up (``WARM_PASSES``): its dataset is not checked, and
        always removed. ``master``: the states come from that Mooncake master's store, not from ``dumps``."""
        fmt = "specforge" if compact_in is None else "compact"
        tag = "-warm" if k < 0 else "" if k == 0 else "-rep%d" % (k + 1)
        out = (d if compact_in is None else compact_in) / ("dataset" + tag)
        xlog = d / ("extract%s.log" % tag)
        w0, wall0 = time.monotonic(), time.time()
        cmd = [self.env_py, REPO / "tools" / "extract.py", "--server", url, "--model", self.model,
               "--tokenizer", self.tokenizer, "--data", self.work / "data" / "ordered.jsonl",
               *(["--mooncake-master", master.address, "--mooncake-metadata", master.metadata] if master is not None
                 else ["--dump-dir", dumps]),
               "--out", out, "--format", fmt, "--max-len", self.prof["extract_max_len"],
               "--concurrency", self.prof["concurrency"], "--no-progress", "--log-every", "5"]
        if processes > 1:
            cmd += ["--processes", processes]
        before = flush_counts(url)  # the server's counts: its losses in this pass are the difference
        x = start(cmd, xlog, env=env, sampler=s)
        first = None  # when extract.py, its imports and tokenizing done, sends its first request
        deadline = w0 + method_s
        try:
            while x.poll() is None and time.monotonic() < deadline:
                if first is None and xlog.is_file() and "extracting " in xlog.read_text(errors="replace"):
                    first = time.time()
                time.sleep(0.1)
        finally:
            cut = x.poll() is None  # time is up: stopped as a user stops it (SIGTERM: records, exits 2)
            if cut:
                stop(x, grace=10)
        dump_counts = flush_counts(url)
        losses = pass_losses(before, dump_counts, xlog)
        client_startup = (first - wall0) if first else 0.0
        # per bucket, from the samples' completion times (the data file is in bucket order)
        times = {c["id"]: p.stat().st_mtime for b in self.buckets for c in b["convs"]
                 for p in [out / sample_rel(c["id"], fmt)] if p.is_file()}
        recs = buckets_by_completion(self.buckets, times, first or wall0)
        if x.returncode != 0 and not cut:
            return {"failed": "tools/extract.py exited %s: %s" % (x.returncode, log_tail(xlog, 2))}
        try:  # extract's own figure: first request to the manifest
            wall = json.loads((out / "manifest.json").read_text())["last_run"]["wall_s"]
        except (OSError, ValueError, KeyError, TypeError):
            wall = None
        rep = {"buckets": recs, "client_startup_s": round(client_startup, 2), "dump_counts": dump_counts,
               "losses": losses, "extract_progress": progress_lines(xlog),
               "work_s": round(time.monotonic() - w0 - client_startup, 3),
               "extract_exit": x.returncode, "extract_own_wall_s": wall}
        if processes > 1:
            rep.update(extract_worker_processes=processes)
        lost = loss_verdict(losses, len(times), rep["work_s"], cut)
        if k < 0:
            shutil.rmtree(out, ignore_errors=True)
            toks = sum(b["tokens"] for b in recs)
            return dict(rep, answers=len(times), samples_done=len(times),
                        tokens_per_s=round(toks / rep["work_s"], 1) if rep["work_s"] > 0 else None,
                        **({"failed": lost} if lost else {}))
        if lost:  # a sample the dataset lacks is no figure of ours: the method fails (exit 1), its record kept
            shutil.rmtree(out, ignore_errors=True)
            return dict(rep, samples_done=len(times), failed=lost)
        t = time.monotonic()
        rep.update(self.check_rep(out, len(times), fmt))
        rep["check_s"] = round(time.monotonic() - t, 2)  # the reader and reference checks: not in the timed work
        if not self.a.keep_work:
            t = time.monotonic()
            shutil.rmtree(out, ignore_errors=True)
            rep["remove_s"] = round(time.monotonic() - t, 2)
        return rep

    def method_hf(self, s: Sampler) -> dict:
        return self.worker("hf", self.plan("hf"), self.base_env(), s, self.method_s() + self.wait_s())

    def method_specforge(self, s: Sampler) -> dict:
        tree = self.upstream_tree()
        dev = "cuda" if self.gpu else "cpu"
        kw = {"tokenizer_path": str(self.tokenizer), "device": dev, "mem_fraction_static": 0.6 if self.gpu else 0.5,
              "context_length": self.prof["extract_max_len"] + 512, "disable_radix_cache": True}
        if self.gpu:
            kw["attention_backend"] = "triton"
        else:
            kw.update(attention_backend="torch_native", max_total_tokens=4096)
        plan = self.plan("specforge", specforge_server_args=kw,
                         unpatched_draft_ids=self.dump_ids(self.release, unpatched=True))
        res = self.worker("specforge", plan, self.base_env(tree), s, self.method_s() + self.wait_s())
        if "refused" in res:
            res["refused"] += " (SpecForge 0.2.0 requires sglang==0.5.14; installed: %s)" % res.get("sglang_version")
        res["backend"] = ("SGLang (specforge.offline_capture, the only backend SpecForge 0.2.0 ships; its "
                          "prepare_hidden_states.py uses it) on the installed unpatched sglang %s; SpecForge pins "
                          "sglang==0.5.14" % self.release)
        return res

    def method_sglang_json(self, s: Sampler) -> dict:
        import cpuserver

        tree = self.upstream_tree()
        env = self.base_env(tree)
        d = self.work / "sglang-json"
        d.mkdir(exist_ok=True)
        draft = d / "draft"
        draft.mkdir(exist_ok=True)
        ids = self.dump_ids(self.release, unpatched=True)
        if self.gpu:
            from eaglepatch.gpucheck.models import draft_config

            cfg = draft_config(json.loads((self.model / "config.json").read_text()), ids)
        else:
            from eaglepatch.smoke.tinyconfig import draft_config

            cfg = draft_config(ids)
        (draft / "config.json").write_text(json.dumps(cfg, indent=2))
        spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "1",
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
        if self.gpu:  # the draft's KV pool is sized by the target's token count: on the H200 the MLA target's
            # (about 576 values a token a layer) made the draft's MHA pool ask for 173 GiB; 256K tokens hold
            # the json concurrency's prompts many times over
            spec += ["--max-total-tokens", "262144"]
        passes = {}
        total_start = 0.0
        for which, extra in (("final", []), ("aux", spec)):
            port = cpuserver.free_port()
            url = "http://127.0.0.1:%d" % port
            log = d / ("server-%s.log" % which)
            cmd = [self.env_py, "-m", "sglang.launch_server", *self.server_flags(port), "--enable-return-hidden-states",
                   *extra]
            p = start(cmd, log, env=env, sampler=s)
            try:
                try:
                    st = wait_http(p, url, log, self.wait_s())
                except Exception:
                    passes[which] = {"refused": "the unpatched %s server did not start: %s" % (
                        "EAGLE-3 (--speculative-algorithm EAGLE3)" if extra else "plain", log_tail(log, 2))}
                    break
                total_start += st
                say("sglang-json: %s-pass server ready in %.0f s" % (which, st))
                warm = self.warm_server(url, "sglang-json %s pass" % which, hidden=True)
                plan = self.plan("sglang-json", url=url, scratch=str(d / "scratch"), **{"pass": which})
                res = self.worker("json", plan, self.base_env(), s, self.method_s() + self.wait_s())
                res["startup_s"] = round(st, 2)
                res["warmup"] = warm
                if res.get("error_count") and not any(b["samples_done"] for b in res.get("buckets", ())):
                    res["failed"] = "no sample written, %d answer(s) unusable: %s" % (res["error_count"],
                                                                                  res["errors"][0])
                passes[which] = res
                if "failed" in res:
                    break
            finally:
                stop(p)
        out = {"passes": passes, "server_flags": "unpatched sglang %s, --enable-return-hidden-states; aux pass: EAGLE-3 "
                                                 "draft ids %s (dummy weights)" % (self.release, ids)}
        bad = [w for w in ("final", "aux") if w not in passes or "refused" in passes[w] or "failed" in passes[w]]
        if bad:
            w = bad[0]
            why = (passes.get(w) or {}).get("refused") or (passes.get(w) or {}).get("failed") or "not run"
            out["refused" if "failed" not in (passes.get(w) or {}) else "failed"] = "%s pass: %s" % (w, why)
            fp = passes.get("final") or {}
            if fp.get("buckets"):  # what the final pass did measure: its figures and its rows against the reference
                toks = sum(b["tokens"] for b in fp["buckets"])
                secs = sum(b["seconds"] for b in fp["buckets"])
                fp["tokens_per_s"] = round(toks / secs, 1) if toks and secs else None
                for b in fp["buckets"]:
                    if not b["samples_done"]:
                        b["tokens_per_s"] = "not measured"
                fp["reference"] = check_final_rows(d / "scratch", self.work / "reference.pt", self.prof["tol"])
            return out
        # the dataset's buckets: a sample exists once both passes have it; time = both passes
        recs = []
        for bf, ba in zip(passes["final"]["buckets"], passes["aux"]["buckets"]):
            r = dict(ba)
            r["samples_planned"] = bf["samples_planned"]
            r["seconds"] = round(bf["seconds"] + ba["seconds"], 3)
            r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1) if r["samples_done"] and r["seconds"] else None
            recs.append(r)
        out.update(startup_s=round(total_start, 2), work_s=round(passes["final"]["work_s"] + passes["aux"]["work_s"], 3),
                   buckets=recs, json_bytes=passes["final"]["json_bytes"] + passes["aux"]["json_bytes"])
        return out

    # -- checks --
    def check_rep(self, ds: Path, done: int, fmt: str = "specforge") -> dict:
        """A pass's dataset: its size, its reader on it (SpecForge's; a compact one's
        ``CompactDataset`` in SpecForge's view) and its rows against the reference."""
        if fmt == "compact":
            size = sum(p.stat().st_size for p in ds.rglob("*.safetensors")) if ds.is_dir() else 0
            return {"dataset": str(ds), "dataset_bytes": size, "format": fmt,
                    "reader": compact_reader_check(ds, self.model, done, self.prof["extract_max_len"]),
                    "reference": check_dataset(ds, self.work / "reference.pt", self.prof["tol"] + FP8_ROW_TOL,
                                               model=self.model)}
        size = sum(p.stat().st_size for p in ds.rglob("*.ckpt")) if ds.is_dir() else 0
        return {"dataset": str(ds), "dataset_bytes": size, "reader": reader_check(ds, done, self.prof["extract_max_len"]),
                "reference": check_dataset(ds, self.work / "reference.pt", self.prof["tol"])}

    def finish_method(self, name: str, res: dict, mem: dict, wall: float) -> dict:
        """The method's record: every repetition's figures (``repetitions``: ``limit`` and ``ours``
        make --repeats passes, the others one), the first one's at the top level (as one pass
        reports them), and per method and bucket the min and median over the repetitions."""
        r = {"method": name, **{k: v for k, v in res.items() if k not in ("buckets", "repetitions")}, **mem,
             "wall_s_including_startup": round(wall, 1)}
        if "refused" in res or "failed" in res:
            r["status"] = "refused" if "refused" in res else "failed"
            if res.get("repetitions"):  # the passes made before it failed, for the record
                r["repetitions_before_the_failure"] = res["repetitions"]
            return r
        planned = sum(len(b["convs"]) for b in self.buckets)
        reps = res.get("repetitions") or [{"buckets": res.get("buckets", [])}]
        for rep in reps:
            recs = rep["buckets"]
            done = sum(b["samples_done"] for b in recs)
            toks = sum(b["tokens"] for b in recs)
            secs = sum(b["seconds"] for b in recs)
            for b in recs:
                if not b["samples_done"]:
                    b["tokens_per_s"] = "not measured"
            rep.update(samples_done=done, complete=done == planned, tokens_done=toks,
                       tokens_per_s=round(toks / secs, 1) if secs and toks else None)
            if name == "limit":
                continue
            if "reference" not in rep:  # a method that leaves its dataset in WORK/NAME/dataset
                rep.update(self.check_rep(self.work / name / "dataset", done))
            size = rep["dataset_bytes"]
            rep["gb_per_million_tokens"] = round(size / 1e9 / (toks / 1e6), 3) if toks else None
        all_toks = sum(rep["tokens_done"] for rep in reps)
        r.update({k: v for k, v in reps[0].items() if k != "buckets"})
        r.update(status="measured", samples_planned=planned, buckets=reps[0]["buckets"], repetitions=reps,
                 tokens_per_s_including_startup=round(all_toks / wall, 1) if wall and all_toks else None,
                 over_repetitions={"repeats": len(reps),
                                   "tokens_per_s": spread([rep["tokens_per_s"] for rep in reps]),
                                   "buckets": {b["name"]: spread([bucket_rate(rep, b["name"]) for rep in reps])
                                               for b in self.buckets}})
        if self.a.repeats > 1 and name not in REPEATED:
            r["over_repetitions"]["note"] = "--repeats makes passes of %s only: this method ran once" % " and ".join(
                REPEATED)
        if name == "limit":
            r.update(dataset=None, why_no_dataset="the limit prefills and writes nothing: the rate the dataset "
                                                  "methods are measured against")
        return r

    def ratio_to_limit(self) -> dict:
        """Each measured method's tokens/s over the limit's, overall and per bucket, repetition i over
        the limit's repetition i (as many pairs as both have), with the min and the median; none
        without a measured limit."""
        m = self.results["methods"]
        lim = m.get("limit")
        if lim is None:
            return {"computed": False, "why": "limit was not among the methods run (--methods %s); no ratio is "
                                              "estimated" % ",".join(m)}
        if lim.get("status") != "measured":
            return {"computed": False, "why": "limit was %s (%s); no ratio is estimated" % (
                lim.get("status"), lim.get("refused") or lim.get("failed") or lim.get("reason"))}
        L = lim["repetitions"]
        out = {"computed": True, "limit_tokens_per_s": lim["over_repetitions"]["tokens_per_s"],
               "pairing": "repetition i of a method over repetition i of limit", "methods": {}, "not_compared": {}}
        for name, v in m.items():
            if name == "limit":
                continue
            if v.get("status") != "measured":
                out["not_compared"][name] = v.get("status")
                continue
            R = v["repetitions"]
            n = min(len(R), len(L))
            out["methods"][name] = {
                "repetitions_paired": n,
                "overall": spread([ratio(R[i]["tokens_per_s"], L[i]["tokens_per_s"]) for i in range(n)]),
                "buckets": {b["name"]: spread([ratio(bucket_rate(R[i], b["name"]), bucket_rate(L[i], b["name"]))
                                               for i in range(n)]) for b in self.buckets}}
        return out

    def write(self, partial: bool) -> None:
        out = Path(self.a.out)
        self.results["partial"] = partial
        self.results["elapsed_s"] = round(time.monotonic() - T0, 1)
        tmp = out.with_name("." + out.name + ".tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, out)

    def run(self) -> int:
        import platform

        import importlib.metadata as md

        def version(pkg):
            try:
                return md.version(pkg)
            except md.PackageNotFoundError:
                return None

        self.results.update(benchmark="peers", profile="gpu" if self.gpu else "cpu", machine={
            "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "versions": {p: version(p) for p in ("torch", "transformers", "specforge", "safetensors")}},
            argv=sys.argv[1:],
            note=None if self.gpu else "CPU smoke: a 4-layer hidden-256 model on a CPU; figures prove the "
                                       "plumbing, not performance", methods={})
        self.prepare()
        self.results.update(model=str(self.model), sglang=self.release, aux_hf_indices=list(AUX_HF),
                            layers={"aux": "outputs of decoder layers 0, 1, 2 (HF hidden-state indices 1, 2, 3)",
                                    "hidden_state": "final, after the model's last norm"},
                            tolerance={"max_row_rel": self.prof["tol"]}, budget_s=self.a.budget_s or self.prof["budget_s"])
        if time.monotonic() - T0 < self.results["budget_s"]:  # else no method will start: no reference needed
            say("float32 reference of %d conversations (transformers, %s)" % (len(self.sample_ids),
                                                                               "cuda" if self.gpu else "cpu"))
            ref = self.worker("reference", self.plan("reference"), self.base_env(), None, 1200)
            if "failed" in ref:
                raise RuntimeError("the float32 reference failed: " + ref["failed"])
            self.results["reference_run"] = ref
        self.write(True)
        rc = 0
        for name in self.methods:
            budget = self.a.budget_s or self.prof["budget_s"]
            if time.monotonic() - T0 >= budget:
                self.results["methods"][name] = {"method": name, "status": "not measured",
                                                 "reason": "--budget-s %g spent before it started" % budget}
                say("%s: not measured (budget spent)" % name)
                continue
            say("%s: starting (%.0f s of work at most)" % (name, self.method_s()))
            s = Sampler(self.gpu)
            t = time.monotonic()
            try:
                res = getattr(self, "method_" + name.replace("-", "_"))(s)
            except Exception as exc:
                res = {"failed": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
            mem = s.close()
            r = self.finish_method(name, res, mem, time.monotonic() - t)
            self.results["methods"][name] = r
            if r["status"] == "measured":
                for i, rep in enumerate(r["repetitions"]):
                    say("%s%s: %d/%d samples, %s tokens/s" % (
                        name, " repetition %d" % (i + 1) if len(r["repetitions"]) > 1 else "", rep["samples_done"],
                        r["samples_planned"], rep["tokens_per_s"]) + (
                        ", %s GB per M tokens, reference %s (max row error %s)" % (
                            rep["gb_per_million_tokens"], rep["reference"]["verdict"],
                            rep["reference"].get("max_row_rel")) if "reference" in rep else ""))
                if any(rep.get("reference", {}).get("verdict") == "fail" for rep in r["repetitions"]):
                    rc = 1
            else:
                say("%s: %s: %s" % (name, r["status"], res.get("refused") or res.get("failed")))
                if name in OURS:
                    rc = 1  # the project's own method must run
            if not self.a.keep_work:  # datasets of hidden 7168 are tens of GB: one at a time on the disk
                for sub in ("dataset", "scratch", *(x.name for x in (self.work / name).glob("dataset-rep*"))):
                    shutil.rmtree(self.work / name / sub, ignore_errors=True)
                shutil.rmtree(self.work / "dumps", ignore_errors=True)
            self.drop_extra_dumps()
            self.write(True)
        self.summarize()
        self.results["plot"] = plot(self.results, Path(self.a.out).with_suffix(".png"))
        self.write(False)
        for line in self.summary_lines():
            say(line)
        say("wrote %s" % self.a.out)
        return rc

    def summary_lines(self) -> list:
        """The lines said at the end: per method its tokens/s over the repetitions and its ratio to the
        limit, overall and per bucket (min / median)."""
        def mm(x):
            return "%s / %s" % (x["min"], x["median"])

        ratios = self.results["ratio_to_limit"]
        lines = []
        for name, v in self.results["methods"].items():
            if v.get("status") != "measured":
                lines.append("summary: %s %s" % (name, v.get("status")))
                continue
            o = v["over_repetitions"]
            line = "summary: %s tokens/s min / median %s over %d repetition(s)" % (name, mm(o["tokens_per_s"]),
                                                                                     o["repeats"])
            mine = ratios.get("methods", {}).get(name)
            if mine:
                line += "; ratio to limit min / median %s; per bucket %s" % (mm(mine["overall"]), ", ".join(
                    "%s %s" % (b, mm(x)) for b, x in mine["buckets"].items()))
            lines.append(line)
        if not ratios["computed"]:
            lines.append("summary: no ratio to the limit: " + ratios["why"])
        return lines

    def summarize(self) -> None:
        m = self.results["methods"]
        self.results["ratio_to_limit"] = self.ratio_to_limit()
        ok = {k: v for k, v in m.items() if v.get("status") == "measured" and v.get("tokens_per_s")}
        peers = {k: v["tokens_per_s"] for k, v in ok.items() if k not in OURS + ("limit",)}
        s = {"tokens_per_s": {k: v["tokens_per_s"] for k, v in ok.items()}}
        if "ours" in ok and peers:
            best = max(peers, key=peers.get)
            s["fastest_peer"] = best
            s["ours_over_fastest_peer"] = round(ok["ours"]["tokens_per_s"] / peers[best], 3)
            per = {}
            for b in ok["ours"]["buckets"]:
                theirs = [x["tokens_per_s"] for k, v in ok.items() if k in peers for x in v["buckets"]
                          if x["bucket"] == b["bucket"] and isinstance(x["tokens_per_s"], (int, float))]
                if isinstance(b["tokens_per_s"], (int, float)) and theirs:
                    per[b["bucket"]] = round(b["tokens_per_s"] / max(theirs), 3)
            s["ours_over_fastest_peer_per_bucket"] = per
            if self.gpu:
                s["goal_5x_met"] = s["ours_over_fastest_peer"] >= 5
        r = self.results["ratio_to_limit"]
        s["ratio_to_limit"] = ({k: {"min": v["overall"]["min"], "median": v["overall"]["median"]}
                                for k, v in r["methods"].items()} if r["computed"] else r["why"])
        self.results["summary"] = s


def reader_check(ds: Path, expected: int, max_len: int) -> dict:
    """SpecForge's own reader on the dataset: how many samples it finds, and its first sample's shapes."""
    try:
        from specforge.data.preprocessing import build_offline_eagle3_dataset
    except Exception as exc:
        return {"loaded": None, "why": "specforge not importable here (%s: %s)" % (type(exc).__name__, str(exc)[:120])}
    try:
        d = build_offline_eagle3_dataset(str(ds), max_len=max_len)
        n = len(d)
        first = d[0] if n else {}
        return {"loaded": True, "samples": n, "matches": n == expected,
                "first": {k: list(v.shape) for k, v in first.items() if hasattr(v, "shape")}}
    except Exception as exc:
        return {"loaded": False, "why": "%s: %s" % (type(exc).__name__, str(exc)[:200])}


def compact_reader_check(ds: Path, model: Path, expected: int, max_len: int) -> dict:
    """A compact dataset's reader, ``eaglepatch.compact.CompactDataset`` in SpecForge's view (what it
    yields is SpecForge's reader's items, tensor for tensor: tests/test_compact.py): how many samples
    it finds, and its first item's shapes."""
    try:
        from eaglepatch.compact import CompactDataset

        d = CompactDataset(ds, model, yields="specforge", max_len=max_len)
        n = len(d)
        first = d[0] if n else {}
        return {"loaded": True, "reader": "eaglepatch.compact.CompactDataset(yields='specforge')", "samples": n,
                "matches": n == expected, "first": {k: list(v.shape) for k, v in first.items() if hasattr(v, "shape")}}
    except Exception as exc:
        return {"loaded": False, "why": "%s: %s" % (type(exc).__name__, str(exc)[:200])}


def _compact_as_specforge(path: Path, rebuilder) -> dict:
    """A compact sample in a .ckpt's keys, read by extract's own ``writers.read_sample`` (the dump
    decoded: fp8 states dequantised, rebuilt states rebuilt; aux layers in the sample's order)."""
    from eaglepatch.extract.writers import read_sample

    s = read_sample("compact", path, rebuilder)
    return {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "aux_hidden_state": s["aux"][None],
            "hidden_state": s["final"][None]}


def check_dataset(ds: Path, ref_file: Path, tol: float, model: Path | None = None) -> dict:
    """A dataset's sample rows against the float32 reference: input ids and loss mask equal, and per
    state (aux layers, final) the max abs error and the max relative row error; verdict by the latter.
    ``model``: the dataset is ``--format compact`` (its samples read with that model directory's
    rebuilder, as SpecForge's view of ``CompactDataset``), else SpecForge .ckpt files."""
    import torch

    ref = torch.load(str(ref_file), weights_only=True)
    per, worst, worst_abs, missing = {}, 0.0, 0.0, []
    bad = []
    rebuilder = None
    if model is not None:
        from eaglepatch.storage import Rebuilder

        rebuilder = Rebuilder(model)
    for cid, r in ref.items():
        hits = sorted(Path(ds).glob("**/" + sample_rel(cid, "specforge" if model is None else "compact")))
        if not hits:
            missing.append(cid)
            continue
        d = (torch.load(str(hits[0]), weights_only=True) if model is None
             else _compact_as_specforge(hits[0], rebuilder))
        if not torch.equal(d["input_ids"], r["input_ids"]) or not torch.equal(d["loss_mask"].to(torch.int64),
                                                                              r["loss_mask"].to(torch.int64)):
            bad.append("%s: input_ids or loss_mask differ" % cid)
            continue
        aux = d["aux_hidden_state"][0].float()
        fin = d["hidden_state"][0].float()
        H = fin.shape[-1]
        if aux.shape[-1] != H * len(AUX_HF) or aux.shape[0] != r["input_ids"].numel():
            bad.append("%s: aux_hidden_state shape %s" % (cid, list(aux.shape)))
            continue
        states = {"aux.hf%d" % h: (aux[:, i * H:(i + 1) * H], r["layer.%d" % (h - 1)]) for i, h in enumerate(AUX_HF)}
        states["final"] = (fin, r["final"])
        for name, (x, y) in states.items():
            err = (x - y).abs()
            rel = float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).max())
            a = float(err.max())
            e = per.setdefault(name, {"max_abs": 0.0, "max_row_rel": 0.0})
            e["max_abs"], e["max_row_rel"] = max(e["max_abs"], a), max(e["max_row_rel"], rel)
            worst, worst_abs = max(worst, rel), max(worst_abs, a)
    checked = len(ref) - len(missing) - len(bad)
    if bad:
        verdict = "fail"
    elif not checked:
        verdict = "not checked"
    else:
        verdict = "pass" if worst <= tol else "fail"
    return {"verdict": verdict, "tolerance_row_rel": tol, "checked": checked, "missing": missing, "problems": bad,
            "max_row_rel": round(worst, 7), "max_abs": round(worst_abs, 7),
            "states": {k: {kk: round(vv, 7) for kk, vv in v.items()} for k, v in per.items()}}


def check_final_rows(scratch: Path, ref_file: Path, tol: float) -> dict:
    """The final-state rows a JSON pass kept (``scratch``/<sample name>.pt) against the reference."""
    import torch

    ref = torch.load(str(ref_file), weights_only=True)
    worst = worst_abs = 0.0
    checked = 0
    for cid, r in ref.items():
        f = scratch / (sample_rel(cid).rsplit("/", 1)[1] + ".pt")
        if not f.is_file():
            continue
        x, y = torch.load(str(f), weights_only=True).float(), r["final"]
        if x.shape != y.shape:
            return {"verdict": "fail", "problems": ["%s: final rows of shape %s" % (cid, list(x.shape))]}
        worst = max(worst, float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).max()))
        worst_abs = max(worst_abs, float((x - y).abs().max()))
        checked += 1
    verdict = "not checked" if not checked else ("pass" if worst <= tol else "fail")
    return {"verdict": verdict, "checked": checked, "state": "final", "max_row_rel": round(worst, 7),
            "max_abs": round(worst_abs, 7), "tolerance_row_rel": tol}


def plot(results: dict, png: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return {"written": False, "why": "matplotlib not installed"}
    ms = [(k, v) for k, v in results["methods"].items() if v.get("status") == "measured"]
    if not ms:
        return {"written": False, "why": "no method measured"}
    names = [b["bucket"] for b in results["conversations"]["buckets"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(ms)
    for i, (k, v) in enumerate(ms):
        ys = {b["bucket"]: b["tokens_per_s"] for b in v["buckets"]}
        vals = [ys.get(n) if isinstance(ys.get(n), (int, float)) else 0 for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=k)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels([n.split("-", 1)[1] + " tok" for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("dataset tokens/s")
    ax.set_title("EAGLE-3 dataset, tokens/s per prompt length (%s)" % (
        results["profile"] if results["profile"] == "gpu" else "CPU smoke: not a performance figure"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(png), dpi=120)
    return {"written": True, "path": str(png)}


def stop_on_signals() -> list:
    """SIGTERM, SIGHUP and SIGINT end the run as an exception (exit 128 + the signal), so every
    ``finally`` on the way out stops the servers and workers it started: killed by the signal's default
    action, the run left its servers running and their ports taken. A second signal while those stop is
    ignored. Returns the list the signal's name goes in."""
    got: list = []

    def on_signal(num, _frame):
        if got:
            return
        got.append(signal.Signals(num).name)
        raise SystemExit(128 + num)

    for num in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(num, on_signal)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="peers.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: the CPU demo's tiny model, small sizes")
    ap.add_argument("--model", help="GPU: the target's directory (built there, DeepSeek-V3 widths, when it has no "
                                    "config.json)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma list of " + ", ".join(METHODS) + " (default: " + ",".join(DEFAULT_METHODS) + ")")
    ap.add_argument("--out", help="results JSON (the plot goes beside it as .png)")
    ap.add_argument("--budget-s", type=float, help="start no method once the run has used this (cpu 400, gpu 400)")
    ap.add_argument("--method-s", type=float, help="seconds of work per method (cpu 90, gpu 45)")
    ap.add_argument("--conversations", type=int, help="number of conversations (cpu 24, gpu 1000)")
    ap.add_argument("--extract-processes", type=int, default=4,
                    help="worker processes of ours-processes, ours-fp8, ours-fp8-disk and ours-mooncake "
                         "(extract.py --processes; default 4)")
    ap.add_argument("--dump-writers", type=int, help="the dump's writer threads in every server of ours's methods "
                    "(serve.py --dump-writers; default: the server's own, EAGLE3_DUMP_WRITERS unset)")
    ap.add_argument("--dump-gil-switch-ms", type=float, help="the GIL switch interval of every server of ours's "
                    "methods, milliseconds (serve.py --dump-gil-switch-ms; default: Python's 5 ms, "
                    "EAGLE3_DUMP_GIL_SWITCH_MS unset)")
    ap.add_argument("--mooncake-site", help="ours-mooncake: the site directory holding the mooncake package and its "
                    "mooncake_master (GPU: required; CPU: default the project's own, built once and cached)")
    ap.add_argument("--disk-dir", help="GPU: ours-fp8-disk's dump files and datasets go to a new subdirectory "
                    "of DIR, removed after the method (default: WORK); the JSON names its file system")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes of limit and ours, each on its one server "
                                                           "(default 1): min and median over them, and the ratio "
                                                           "to the limit per pass")
    ap.add_argument("--warm-s", type=float, help="untimed warm-up of each fresh server at most this long (cpu 3, "
                                                 "gpu 30; 0: none): Triton compiles a kernel per new batch shape")
    ap.add_argument("--work", help="working directory (default: a new temporary one, removed at the end)")
    ap.add_argument("--dump-dir", help="GPU: ours's server writes its dump files in a new subdirectory of DIR, "
                    "removed after the method (default: WORK/dumps); on /dev/shm the disk takes the bytes once")
    ap.add_argument("--keep-work", action="store_true", help="keep the working directory and every dataset")
    ap.add_argument("--site", help="GPU: the site directory holding the installed sglang (default: where it is found)")
    ap.add_argument("--patched-files", help="GPU: the series' patched files (default .gpu-patched; docs/gpu.md)")
    ap.add_argument("--plot", metavar="RESULTS", help="only draw the PNG of an earlier run's JSON (beside it; needs "
                                                      "matplotlib, not torch)")
    ap.add_argument("--check", metavar="DATASET", help="only check DATASET against --reference (exit 1 if it fails)")
    ap.add_argument("--reference", help="with --check: a reference.pt of an earlier run (its --work)")
    ap.add_argument("--tol", type=float, help="with --check: the max relative row error (default the CPU profile's)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return run_worker(a.worker, Path(a.plan))
    try:
        if a.plot:
            if not Path(a.plot).is_file():
                raise UsageError("--plot %s: no such file" % a.plot, "pass the JSON an earlier run wrote with --out")
            got = plot(json.loads(Path(a.plot).read_text()), Path(a.plot).with_suffix(".png"))
            print(json.dumps(got))
            return 0 if got["written"] else 1
        if a.check:
            if not a.reference or not Path(a.reference).is_file() or not Path(a.check).is_dir():
                raise UsageError("--check needs a dataset directory and --reference FILE", "pass both, e.g. "
                                 "--check WORK/hf/dataset --reference WORK/reference.pt")
            res = check_dataset(Path(a.check), Path(a.reference), a.tol if a.tol is not None else PROFILES["cpu"]["tol"])
            if a.out:
                Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
            print(json.dumps(res, indent=2))
            return 0 if res["verdict"] == "pass" else 1
        if a.cpu == bool(a.model):
            raise UsageError("pass exactly one of --cpu and --model DIR", "--cpu for the CPU smoke, --model DIR on a GPU")
        if not a.out:
            raise UsageError("--out is required", "pass --out results.json")
        for flag, value, e_g in (("--dump-dir", a.dump_dir, "/dev/shm"), ("--disk-dir", a.disk_dir, "/var/tmp")):
            if value and a.cpu:
                raise UsageError("%s is for the GPU profile (the CPU demo keeps its dumps in its own directory)" % flag,
                                 "drop %s, or run with --model DIR" % flag)
            if value and not Path(value).is_dir():
                raise UsageError("%s %s: not an existing directory" % (flag, value),
                                 "create it first or pass another, e.g. %s" % e_g)
        out = Path(a.out)
        if not out.parent.is_dir() or out.is_dir():
            raise UsageError("--out %s: its directory does not exist (or it is a directory)" % out,
                             "pass a file path in an existing directory")
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise UsageError("--methods %r: unknown %s" % (a.methods, unknown or "(empty)"),
                             "pass a comma list of " + ",".join(METHODS))
        for flag in ("budget_s", "method_s"):
            if getattr(a, flag) is not None and getattr(a, flag) <= 0:
                raise UsageError("--%s must be positive" % flag.replace("_", "-"), "pass seconds > 0")
        if a.warm_s is not None and not 0 <= a.warm_s < float("inf"):
            raise UsageError("--warm-s must be 0 or more seconds", "pass e.g. --warm-s 30, or 0 for no warm-up")
        if a.extract_processes < 2:
            raise UsageError("--extract-processes must be >= 2 (ours is extract with its threads alone)",
                             "pass the number of extract.py --processes of ours-processes, e.g. --extract-processes 4")
        from eaglepatch.serve import MAX_GIL_SWITCH_MS, MAX_WRITERS

        if a.dump_writers is not None and not 1 <= a.dump_writers <= MAX_WRITERS:
            raise UsageError("--dump-writers %d: not between 1 and %d" % (a.dump_writers, MAX_WRITERS),
                             "pass the dump's writer threads, e.g. --dump-writers 8, or leave it out")
        if a.dump_gil_switch_ms is not None and not 0 < a.dump_gil_switch_ms <= MAX_GIL_SWITCH_MS:
            raise UsageError("--dump-gil-switch-ms %g: not above 0 and at most %g" % (a.dump_gil_switch_ms,
                                                                                     MAX_GIL_SWITCH_MS),
                             "pass milliseconds, e.g. --dump-gil-switch-ms 1, or leave it out")
        if a.mooncake_site and not (Path(a.mooncake_site) / "mooncake" / "mooncake_master").is_file():
            raise UsageError("--mooncake-site %s holds no mooncake/mooncake_master" % a.mooncake_site,
                             "pass the site directory the mooncake package is installed in")
        if "ours-mooncake" in methods and a.model and not a.mooncake_site:
            raise UsageError("ours-mooncake on the GPU needs --mooncake-site DIR (the bundle carries no mooncake)",
                             "carry the mooncake wheels and pass --mooncake-site, or drop ours-mooncake")
        if a.repeats < 1:
            raise UsageError("--repeats must be >= 1", "pass the number of timed passes, e.g. --repeats 3")
        if a.conversations is not None and a.conversations < 1:
            raise UsageError("--conversations must be >= 1", "pass a positive count")
        if a.model:
            import importlib.util

            if importlib.util.find_spec("torch") is None:
                raise UsageError("torch is not importable", "run with PYTHONPATH=/tmp/site:src (docs/gpu.md)")
            pf = Path(a.patched_files or REPO / ".gpu-patched")
            if set(OURS) & set(methods) and not (pf / "patched-files.json").is_file():
                raise UsageError("%s holds no patched files of the series (patched-files.json)" % pf,
                                 "make them here with python3 tools/gpucheck.py --make-patched-files --series "
                                 "patches/sglang-0.5.17 and carry .gpu-patched, or pass --patched-files DIR")
            if Path(a.model).exists() and not Path(a.model).is_dir():
                raise UsageError("--model %s is a file" % a.model, "pass a model directory (or a new one to build)")
        else:
            inner = os.environ.get("EAGLEPATCH_PEERS_INNER")
            import importlib.util

            if not inner and importlib.util.find_spec("torch") is None:
                from eaglepatch.cpuenv import ensure_env

                py = ensure_env()
                return subprocess.call([str(py), str(Path(__file__).resolve()), *(argv or sys.argv[1:])],
                                       env=dict(os.environ, EAGLEPATCH_PEERS_INNER="1"))
    except UsageError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    from eaglepatch import shm

    prof = dict(PROFILES["gpu" if a.model else "cpu"])
    r = Run(a, prof)
    r.methods = methods
    before = shm.snapshot()
    stopped_by = stop_on_signals()
    try:
        return r.run()
    except UsageError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    except SystemExit:
        if stopped_by:  # the finally blocks on the way out stopped the servers and workers they started
            r.results.update(stopped_by=stopped_by[0])
            try:
                r.write(True)
                said = "%s says partial" % a.out
            except OSError as exc:  # a full disk: the run is over all the same, in one line
                said = "%s not written (%s)" % (a.out, exc.strerror or exc)
            say("stopped by %s: every server and worker it started is stopped; %s" % (stopped_by[0], said))
        raise
    finally:
        for p in list(LIVE.values()):  # none left unless a start raced the signal; stop them all the same
            stop(p, grace=10)
        r.drop_extra_dumps()
        if not a.keep_work and not a.work:
            shutil.rmtree(r.work, ignore_errors=True)
        gone = shm.sweep(before)  # semaphores of servers that died (a crashed start, a SIGKILL)
        if gone:
            say("removed %d semaphore(s) that dead server processes left in /dev/shm" % len(gone))


if __name__ == "__main__":
    sys.exit(main())
