"""``tools/check_draft.py --serve`` (issue 32): the draft served by a real sglang with EAGLE-3 on the
GPU, the held-out answers sent to it, and the figures read from each response's ``meta_info``,
written in the JSON ``--served`` reads (so a run's figures can be checked again without a GPU).

- ``plan``: which sglang serves, checked before anything is loaded or started: a patched tree laid
  from ``--patched-files`` over ``--site``'s release (as ``tools/acceptance.py`` lays it), a
  given ``--sglang-parent``, or (``--unpatched``) ``--site``'s or this Python's sglang as it is;
  its release must be ``--release``, and it must carry the series unless ``--unpatched``. A
  machine without CUDA is refused first: sglang's EAGLE-3 decoding runs CUDA and Triton kernels.
- ``requests_of``: one request per answer of the held-out data, exactly the requests the
  prediction replays (``check.request_spans``): prompt ids[:P], greedy, ``max_new_tokens`` T - P,
  ``ignore_eos``; the data's ids[P:T] to compare the served answer with.
- ``served_figures``: the accept length sum(C-1)/sum(V) over the responses' ``completion_tokens``
  and ``spec_verify_ct`` (as ``tools/acceptance.py`` measures it), the per-position rates from
  sglang's histogram of correct drafts per verify (``spec_correct_drafts_histogram``; releases
  without it give none), and how many served answers equal the data's.
- ``Serving``: start the server (``pipeline.Server``'s process handling: its own process group, a
  log, /health), send every request, stop it, write the figures.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import RefusedError, UsageError
from . import language as lang_mod
from .pipeline import Server

SRC = Path(__file__).resolve().parents[2]
NO_GPU_FIX = ("run it on a GPU machine, or check without serving: --states DIR replays the draft on what the release "
              "feeds it, --served FILE takes a GPU run's figures")
# check_draft's own flags: a --server-args that sets one of them is refused (the flags say it)
OWN_FLAGS = {"--model-path": "--target", "--model": "--target", "--speculative-algorithm": "--serve",
             "--speculative-draft-model-path": "--draft", "--speculative-num-steps": "--steps",
             "--speculative-eagle-topk": "--topk", "--speculative-num-draft-tokens": "--draft-tokens",
             "--tp-size": "--tp", "--tp": "--tp", "--port": "--port", "--host": "--port"}
# TP > 1 on sglang 0.5.17: the FlashInfer all-reduce fusion is on by default there, and an Engine on
# two H200s hung with it (no forward ran; docs/gpu.md); turned off where the tree has the switch
FUSION_OFF = "--enforce-disable-flashinfer-allreduce-fusion"


@dataclass
class Plan:
    parent: Path            # the directory holding the sglang package that serves
    site: Path | None       # its dependencies (the unpacked bundle), after it on PYTHONPATH
    release: str
    patched: bool
    source: str             # where the tree came from, in words
    tp: int
    port: int
    server_args: list
    timeout_s: float
    served_out: Path
    log: Path
    tmp: Path | None = None  # a patched tree laid for this run, removed by ``cleanup``

    def cleanup(self):
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def require_cuda() -> None:
    """A one-line usage error where no CUDA device is visible (or torch is missing)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise UsageError("--serve needs a CUDA GPU, and this Python has no torch (sglang's EAGLE-3 decoding runs "
                         "CUDA and Triton kernels)", NO_GPU_FIX)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--serve needs a CUDA GPU: torch sees none here, and sglang's EAGLE-3 decoding runs CUDA and "
                         "Triton kernels (none on CPU)", NO_GPU_FIX)


def _release_of(parent: Path, site: Path | None) -> str | None:
    from ..tree import version_from_dist_info, version_from_version_py

    return version_from_version_py(parent) or version_from_dist_info(parent) or (
        version_from_dist_info(site) if site else None)


def serving_tree(release: str, unpatched: bool, site: Path | None = None, patched_files: Path | None = None,
                 sglang_parent: Path | None = None) -> tuple[Path, str, Path | None]:
    """(package parent, where it came from, a temporary directory to remove or None): the sglang
    that serves, checked to be ``release`` and to carry the series unless ``unpatched``. With
    ``patched_files`` the series' files are laid over a copy of ``site``'s sglang in a temporary
    directory (``gpucheck.patched_files.lay_patched_files``, which refuses files made for another
    release); without ``sglang_parent`` or ``site``, the sglang this Python imports."""
    import importlib.util

    from .. import guard

    tmp = None
    if patched_files is not None and sglang_parent is not None:
        raise UsageError("--patched-files and --sglang-parent both name the patched sglang", "pass one of them")
    if unpatched and (patched_files is not None):
        raise UsageError("--unpatched serves the release as it is, and --patched-files lays the series over it",
                         "drop one of them")
    for flag, p in (("--site", site), ("--patched-files", patched_files), ("--sglang-parent", sglang_parent)):
        if p is not None and not Path(p).is_dir():
            raise UsageError(f"{flag} {p} is not a directory", f"pass {flag} a directory (tools/check_draft.py --help)")
    if patched_files is not None:
        if site is None:
            raise UsageError("--patched-files are laid over a release, and no --site names it",
                             "pass --site SITE (sh .gpu-bundle/unpack.sh SITE)")
        try:
            made_for = json.loads((Path(patched_files) / "patched-files.json").read_text()).get("release")
        except (OSError, ValueError, AttributeError):
            made_for = None
        if made_for is not None and made_for != release:
            raise UsageError(f"--patched-files {patched_files} were made for sglang {made_for}, not --release "
                             f"{release}",
                             f"pass --release {made_for}, or make them for {release}: python3 tools/gpucheck.py "
                             f"--make-patched-files --series patches/sglang-{release}")
        from ..gpucheck.patched_files import lay_patched_files

        tmp = Path(tempfile.mkdtemp(prefix="eaglepatch-check-draft-"))
        try:
            parent = lay_patched_files(patched_files, site, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        source = f"the series' patched files {patched_files} laid over {site}"
    elif sglang_parent is not None:
        parent, source = Path(sglang_parent), f"--sglang-parent {sglang_parent}"
    elif site is not None:
        parent, source = Path(site), f"--site {site}"
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise UsageError("no sglang to serve with: this Python imports none and no --site or --sglang-parent names "
                             "one", "pass --site SITE --patched-files DIR (the GPU bundle) or --sglang-parent DIR")
        parent = Path(list(spec.submodule_search_locations)[0]).parent
        source = f"this Python's sglang ({parent})"
    try:
        found = _release_of(parent, site)
        if found != release:
            raise UsageError(f"the sglang that would serve ({source}) is {found or 'of no release it names'}, not "
                             f"--release {release}", f"pass --release {found}" if found else
                             "pass the sglang of the release you serve")
        sem = guard.tree_semantics(parent)
        if sem.series == unpatched:
            raise UsageError(f"the sglang that would serve ({source}) is {'patched' if sem.series else 'unpatched'}, "
                             f"and the check is for sglang {release} {'unpatched' if unpatched else 'with the series'}",
                             "drop --unpatched" if unpatched else "pass --patched-files DIR or --sglang-parent DIR "
                             "(a patched tree), or add --unpatched")
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return parent, source, tmp


def parse_server_args(text: str | None) -> list:
    """``--server-args`` as a list of flags; one that check_draft sets itself is refused."""
    try:
        args = shlex.split(text or "")
    except ValueError as exc:
        raise UsageError(f"--server-args {text!r}: {exc}", "quote it as a shell would, e.g. --server-args "
                         "'--mem-fraction-static 0.5 --attention-backend triton'") from None
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise UsageError(f"--server-args sets {flag}, which check_draft sets from its own flags",
                             f"pass {OWN_FLAGS[flag]} instead")
    return args


def plan(release: str, unpatched: bool, site, patched_files, sglang_parent, tp: int, port: int, server_args,
         timeout_s: float, served_out: Path, log: Path) -> Plan:
    """Everything ``--serve`` can be refused for, in one line each, before anything is loaded:
    no CUDA, the settings, the tree (``serving_tree``), a taken port (exit 1)."""
    import math

    from ..serve import refuse_taken_port

    require_cuda()
    if not isinstance(tp, int) or tp < 1:
        raise UsageError(f"--tp {tp}: the tensor-parallel size is 1 or more", "pass e.g. --tp 8")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"--port {port}: not a port", "pass 1024 to 65535, e.g. --port 30000")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s >= 10):
        raise UsageError(f"--serve-timeout-s {timeout_s}: at least 10 seconds", "pass e.g. --serve-timeout-s 900")
    args = parse_server_args(server_args)
    parent, source, tmp = serving_tree(release, unpatched, site and Path(site), patched_files and Path(patched_files),
                                       sglang_parent and Path(sglang_parent))
    try:
        refuse_taken_port("127.0.0.1", port, "the check's server", "stop that process or pass another --port")
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Plan(parent=Path(parent), site=site and Path(site), release=release, patched=not unpatched, source=source,
                tp=tp, port=port, server_args=args, timeout_s=float(timeout_s), served_out=Path(served_out),
                log=Path(log), tmp=tmp)


# ---- requests and figures (pure: tested on CPU) -------------------------------------------------------

def requests_of(files: list, prompt_answer_tokens: int = 0) -> list:
    """One request per answer of the held-out samples ``files`` (read as the prediction reads them,
    ``train.read_sample``), the answers ``check.request_spans`` gives: {"prompt": ids[:P],
    "max_new_tokens": T - P, "answer": ids[P:T], "sample": file name}."""
    from . import train
    from .check import request_spans

    out = []
    for f in files:
        s = train.read_sample(f)
        ids, mask = s["input_ids"][0].tolist(), s["loss_mask"][0].tolist()
        for P, T in request_spans(ids, mask, prompt_answer_tokens):
            out.append({"prompt": ids[:P], "max_new_tokens": T - P, "answer": ids[P:T], "sample": Path(f).name})
    return out


def served_figures(outs: list, reqs: list, steps: int, how: str, server: dict | None = None) -> dict:
    """The figures of served responses ``outs`` (sglang's /generate answers, each with
    ``output_ids`` and ``meta_info``) to the requests ``reqs`` (``requests_of``), in the format
    ``check.read_served`` reads: ``accept_length`` sum(C-1)/sum(V) over ``completion_tokens`` C and
    ``spec_verify_ct`` V; ``per_position`` and ``at_least`` from the summed
    ``spec_correct_drafts_histogram`` (index a: the verifies that accepted a draft tokens), None
    where the release reports none; ``answers_equal_to_data`` of ``requests_compared`` and each
    differing request's first differing answer token (``first_difference_at``). A response with
    no ``spec_verify_ct`` (speculative decoding off) is refused."""
    if len(outs) != len(reqs):
        raise RefusedError(f"the server answered {len(outs)} of {len(reqs)} requests", "read its log")
    metas = []
    hist = [0] * (steps + 1)
    have_hist = True
    for k, o in enumerate(outs):
        m = o.get("meta_info") if isinstance(o, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("spec_verify_ct"), int) \
                or not isinstance(m.get("completion_tokens"), int):
            raise RefusedError(f"response {k} has no spec_verify_ct / completion_tokens in its meta_info: the server "
                               f"did not decode speculatively", "read the server log (was the draft loaded?)")
        metas.append(m)
        h = m.get("spec_correct_drafts_histogram")
        if isinstance(h, list) and all(isinstance(x, int) for x in h) and len(h) <= steps + 1:
            for a, c in enumerate(h):
                hist[a] += c
        else:
            have_hist = False
    base = lang_mod.served_accept_length(metas)
    if not base["verify_ct"]:
        raise RefusedError("the server verified no draft token in %d requests (spec_verify_ct 0 in every response)"
                           % len(outs), "read the server log: EAGLE-3 did not run")
    per = at_least = None
    if have_hist and sum(hist):
        tail = [sum(hist[a:]) for a in range(steps + 1)]  # tail[k]: verifies that accepted at least k
        per = [round(tail[k] / tail[k - 1], 4) if tail[k - 1] else None for k in range(1, steps + 1)]
        at_least = [round(tail[k] / tail[0], 4) for k in range(1, steps + 1)]
    diffs = []
    for k, (o, r) in enumerate(zip(outs, reqs)):
        got, want = list(o.get("output_ids") or []), r["answer"]
        if got[:len(want)] != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            diffs.append({"request": k, "sample": r.get("sample"), "at": at})
    return {"accept_length": round(base["accept_length"], 4), "per_position": per, "at_least": at_least,
            "per_position_how": ("sglang's spec_correct_drafts_histogram summed over the responses: rate of draft "
                                 "token k accepted given 1..k-1 were; the server reports no room, so a verify near an "
                                 "answer's end counts as one that had room for every token" if per else
                                 "none: the responses carry no spec_correct_drafts_histogram"),
            "requests": len(outs), "verify_ct": base["verify_ct"], "tokens_after_prefill": base["tokens_after_prefill"],
            "answers_equal_to_data": len(reqs) - len(diffs), "requests_compared": len(reqs),
            "first_difference_at": diffs, "how": how, "server": server or {}}


def write_served(figs: dict, path: Path) -> Path:
    from ..outputs import write_atomic

    write_atomic(path, json.dumps(figs, indent=2) + "\n", "--served-out")
    return Path(path)


# ---- the server ----------------------------------------------------------------------------------------

def server_argv(p: Plan, target: Path, draft: Path, steps: int, topk: int, draft_tokens: int) -> list:
    argv = ["--model-path", str(target), "--host", "127.0.0.1", "--port", str(p.port), "--tp-size", str(p.tp),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]
    if p.tp > 1 and FUSION_OFF not in p.server_args:
        srt = p.parent / "sglang" / "srt"
        sources = [srt / "server_args.py", *sorted((srt / "arg_groups").rglob("*.py"))]
        if any("enforce_disable_flashinfer_allreduce_fusion" in f.read_text(errors="replace")
               for f in sources if f.is_file()):
            argv.append(FUSION_OFF)
    return [sys.executable, "-m", "sglang.launch_server", *argv, *p.server_args]


def server_env(p: Plan) -> dict:
    """This environment without the dump's variables (the check's server dumps nothing), NVLink
    multicast off unless set, the tree first on PYTHONPATH, then the site, this project's src."""
    from .pipeline import MULTICAST_OFF

    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_DUMP_")}
    env.update({k: env.get(k, v) for k, v in MULTICAST_OFF.items()})
    paths = [str(p.parent)] + ([str(p.site)] if p.site and p.site != p.parent else []) + [str(SRC)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # the target and draft are directories
        env.setdefault(k, "1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


class CheckServer(Server):
    """``pipeline.Server``'s process handling (its own process group, the log, /health, stop),
    without an acceptance run behind it: the argv and environment are the check's."""

    def __init__(self, p: Plan, argv: list, say):
        self.run = types.SimpleNamespace(say=say)
        self.name, self.port, self.url = "check", p.port, f"http://127.0.0.1:{p.port}"
        self.argv, self.env, self.log, self.proc = argv, server_env(p), p.log, None


class _Stopped(RefusedError):
    def __init__(self):
        super().__init__("stopped by SIGTERM while serving (the server was stopped)", "run it again")


def _post(url: str, req: dict, timeout: float) -> dict:
    body = json.dumps({"input_ids": req["prompt"], "sampling_params": {
        "temperature": 0.0, "max_new_tokens": req["max_new_tokens"], "ignore_eos": True}}).encode()
    r = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=timeout) as resp:
        return json.loads(resp.read())


class Serving:
    """``i.draft`` served on ``i.target`` as plan ``p`` says. ``start``: the requests
    (``requests_of``) and the server's start (``check.check`` calls it once the inputs are checked,
    so the server starts while the prediction runs); ``finish``: wait for it, send every request,
    stop it, write the figures to ``p.served_out`` and return that path; ``stop``: stop it (also
    on SIGTERM while it runs: the server is in its own process group and would outlive us)."""

    def __init__(self, p: Plan, i, say=print):
        self.p, self.i, self.say = p, i, say
        self.srv = self.prev = None

    def start(self) -> None:
        from . import train

        p, i = self.p, self.i
        self.reqs = requests_of(train.sample_files(Path(i.data)), i.prompt_answer_tokens)
        if not self.reqs:
            raise UsageError(f"--data {i.data} holds no answer of two tokens or more to serve", "pass held-out "
                             "conversations with assistant answers")
        self.argv = server_argv(p, Path(i.target).absolute(), Path(i.draft).absolute(), i.steps, i.topk,
                                i.draft_tokens)
        self.end = time.monotonic() + p.timeout_s
        if _main_thread():
            def stop_on_term(signum, frame):
                raise _Stopped()

            self.prev = signal.signal(signal.SIGTERM, stop_on_term)
        self.say("serve: starting sglang %s (%s) with EAGLE-3, steps %d, topk %d, draft tokens %d, TP %d on port %d; "
                 "log %s" % (p.release, p.source, i.steps, i.topk, i.draft_tokens, p.tp, p.port, p.log))
        self.t0 = time.monotonic()
        self.srv = CheckServer(p, self.argv, self.say)
        self.srv.start()

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.srv = None
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)
            self.prev = None

    def finish(self) -> Path:
        from concurrent.futures import ThreadPoolExecutor

        from . import progress

        p, i, reqs = self.p, self.i, self.reqs
        try:
            self.srv.wait_ready(timeout=max(self.end - time.monotonic(), 5))
            start_s = round(time.monotonic() - self.t0, 1)
            t1 = time.monotonic()
            done, url = [], self.srv.url

            def one(r):
                left = self.end - time.monotonic()
                if left <= 0:
                    raise RefusedError(f"--serve-timeout-s {p.timeout_s:.0f} spent before every request was answered",
                                       "pass a larger --serve-timeout-s")
                try:
                    out = _post(url, r, left)
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    raise RefusedError(f"the server did not answer a request ({type(exc).__name__}: "
                                       f"{str(exc)[:200]})", f"read its log {p.log}") from None
                done.append(1)
                return out

            pool = ThreadPoolExecutor(min(32, len(reqs)))
            try:
                with progress.ticking(self.say, "serve", lambda: "%d/%d requests answered" % (len(done), len(reqs))):
                    outs = list(pool.map(one, reqs))
            finally:  # on an error or SIGTERM: no waiting for requests in flight (stopping the server ends them)
                pool.shutdown(wait=False, cancel_futures=True)
            generate_s = round(time.monotonic() - t1, 1)
        finally:
            self.stop()
        how = ("served: sglang %s %s (%s), EAGLE-3 steps %d, topk %d, draft tokens %d, TP %d; %d requests, one per "
               "held-out answer, greedy (temperature 0, ignore_eos), max_new_tokens the answer's length%s; accept "
               "length sum(C-1)/sum(V) over the responses' meta_info" % (
                   p.release, "with the series" if p.patched else "unpatched", p.source, i.steps, i.topk,
                   i.draft_tokens, p.tp, len(reqs), " (its first %d tokens sent with the prompt)"
                   % i.prompt_answer_tokens if i.prompt_answer_tokens else ""))
        server = {"argv": self.argv[1:], "release": p.release, "patched": p.patched, "source": p.source, "tp": p.tp,
                  "start_s": start_s, "generate_s": generate_s, "log": str(p.log)}
        figs = served_figures(outs, reqs, i.steps, how, server)
        self.say("served: accept length %.4f over %d requests (%d verifies), %d of %d answers equal the data's; "
                 "server ready after %.0f s, requests %.1f s" % (
                     figs["accept_length"], figs["requests"], figs["verify_ct"], figs["answers_equal_to_data"],
                     figs["requests_compared"], start_s, generate_s))
        return write_served(figs, p.served_out)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
