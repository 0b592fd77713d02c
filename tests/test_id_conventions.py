"""Drafts keep their meaning: on every release with a series, the patched tree feeds an EAGLE-3
draft exactly the hidden states unpatched SGLang of that release feeds it, wherever upstream
serves the id list, and the documented reading (eaglepatch.conventions) where it does not.

Both sides run the real code of the release: ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``
taken with ``ast`` from the release's own ``deepseek_v2.py`` (fetched from the package index), and
the same method of the patched file (``git apply`` of the series), which calls the series'
``eagle3_capture`` package as the series adds it to that release. Which indices upstream's capture
can reach is read from the release's code too (index 0 fails where DeepseekV2Model.forward adds
``hidden_states + residual`` with the residual still None; index N is never in the layer loop).
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "src"))

torch = pytest.importorskip("torch")

from eaglepatch import conventions, fetch, guard, overlay  # noqa: E402
from eaglepatch.applier import git_apply  # noqa: E402
from eaglepatch.series import PACKAGE, available_series, load_series  # noqa: E402

RELEASES = sorted(available_series(), key=lambda r: tuple(int(x) for x in r.split(".")))
DEEPSEEK = f"{PACKAGE}/srt/models/deepseek_v2.py"
N_BIG = 61  # Kimi-K2.5 / DeepSeek-V3


def _method(source: bytes, env: dict):
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture")
    ns = dict(env)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "deepseek_v2.py", "exec"), ns)
    return ns[fn.name]


class Release:
    """One release: its upstream method, its patched method and what upstream's capture reaches."""

    _count = 0

    def __init__(self, release: str, pkg_root: Path, upstream_mapping: str | None = None):
        root = fetch.unpacked_release(release, quiet=True)
        series = load_series(REPO / "patches" / f"sglang-{release}")
        originals = {}
        for rel in series.files():
            p = root / rel
            originals[rel] = p.read_bytes() if p.is_file() else None
        res = git_apply(originals, series.patches)
        assert res.error is None, res.error
        patched = res.final
        self.release = release
        self.upstream_source = originals[DEEPSEEK]
        # the series' package as the series adds it to this release (optionally with another
        # upstream convention declared: the controls below)
        Release._count += 1
        for rel, data in patched.items():
            if data is not None and rel.startswith(f"{PACKAGE}/srt/eagle3_capture/"):
                if upstream_mapping is not None and rel.endswith("/release.py"):
                    data = data.replace(b'UPSTREAM_EAGLE_ID_MAPPING = "plus_one_if_first_is_one"',
                                        f'UPSTREAM_EAGLE_ID_MAPPING = "{upstream_mapping}"'.encode())
                (pkg_root / rel).parent.mkdir(parents=True, exist_ok=True)
                (pkg_root / rel).write_bytes(data)
        self.pkg = overlay.import_package(f"e3c_ids_{Release._count}", root=pkg_root)
        env = {"Optional": typing.Optional, "List": typing.List}
        self.upstream = _method(self.upstream_source, env)
        self.patched = _method(patched[DEEPSEEK], dict(env, eagle3_capture=self.pkg))
        site = conventions.capture_semantics(release).get("capture_site", "model_loop")
        self.embed_ok = site == "decoder_layer"
        self._check_capture_site(root, site)

    def _check_capture_site(self, root: Path, site: str) -> None:
        """The declared capture site against the release's code: index 0 works exactly where the
        capture reads the residual after the layer's input norm made it (decoder_layer)."""
        sem = guard.tree_semantics(root)
        if site == "model_loop":
            assert sem.embed_ok is False  # hidden_states + residual with residual None at layer 0
        else:  # the layer's boundary captures the residual its input step made (the embedding at 0)
            found = []
            for path in sorted((root / PACKAGE / "srt" / "layers").rglob("*.py")):
                for fn in ast.walk(ast.parse(path.read_bytes())):
                    if not isinstance(fn, ast.FunctionDef):
                        continue
                    text = ast.unparse(fn)
                    prepare = re.search(r"self\._?prepare\w*\(", text)
                    for call in ("captured_last_layer_outputs.append(", "capture_gathered.capture("):
                        if call in text and prepare:
                            assert prepare.start() < text.index(call), (path, fn.name)
                            found.append(fn.name)
            assert found, f"no decoder-layer capture found in sglang {self.release}'s layers/"

    @staticmethod
    def _model(n):
        return SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                               config=SimpleNamespace(num_hidden_layers=n),
                               model=SimpleNamespace(layers_to_capture=[], norm=torch.nn.Identity()),
                               capture_aux_hidden_states=False)

    def upstream_feeds(self, ids, n):
        """The capture indices unpatched sglang feeds the draft, in order, or None: it cannot serve
        the list (an index its capture never reaches, or a layer twice: the draft's fc expects
        len(ids) states; 0.5.17+'s packer asserts the count)."""
        m = self._model(n)
        self.upstream(m, None if ids is None else list(ids))
        lt = list(m.model.layers_to_capture)
        lo = 0 if self.embed_ok else 1
        reach = [i for i in range(n) if i >= lo]
        captured = [i for i in reach if i in lt]
        if ids is not None and (len(captured) != len(ids) or len(set(lt)) != len(lt)):
            return None
        return captured

    def patched_feeds(self, ids, n):
        """What the patched tree feeds the draft (capture indices in order), or the refusal's text."""
        m = self._model(n)
        try:
            self.patched(m, None if ids is None else list(ids))
        except self.pkg.DumpConfigError as exc:
            return str(exc)
        state = m._eagle3_capture_state
        order = state.eagle_order
        assert m.model.layers_to_capture == [i for i in order if i < n]
        assert bool(m.model.norm._forward_hooks) == (n in order)
        assert m.capture_aux_hidden_states
        return order


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """Release objects by name, made once per module (their packages under pytest's tmp dir)."""
    made = {}

    def get(r: str) -> Release:
        if r not in made:
            made[r] = Release(r, tmp_path_factory.mktemp(f"ids-{r}"))
        return made[r]

    return get


def documented(rule: str, ids, n):
    """The documented reading (conventions' table): sorted capture indices, or None (refused)."""
    idx = conventions.capture(rule, list(ids))
    if not idx or len(set(idx)) != len(idx) or not all(0 <= i <= n for i in idx):
        return None
    return sorted(idx)


def exhaustive_lists(lo=-2, hi=7, max_len=3):
    for length in range(1, max_len + 1):
        yield from itertools.product(range(lo, hi + 1), repeat=length)


def random_lists(n, count, seed):
    rnd = random.Random(seed)
    for _ in range(count):
        length = rnd.choice([1, 2, 3, 3, 3, 4, 5])
        pool = [-1, 0, 1, 2, n // 2, n - 3, n - 2, n - 1, n, n + 1] + list(range(-2, n + 2))
        yield tuple(rnd.choice(pool) for _ in range(length))


def mismatches(rel: Release, lists, n):
    """(ids, upstream, patched) wherever the patched tree departs from upstream or the table."""
    rule = conventions.release_rule(rel.release)
    bad, served = [], 0
    for ids in lists:
        up = rel.upstream_feeds(ids, n)
        got = rel.patched_feeds(ids, n)
        if up is not None:
            served += 1
            if got != up:
                bad.append((ids, up, got))
        else:
            want = documented(rule, ids, n)
            if (want is None) != isinstance(got, str) or (want is not None and got != want):
                bad.append((ids, want, got))
    return bad, served


@pytest.mark.parametrize("r", RELEASES)
def test_patched_feeds_what_upstream_feeds_wherever_upstream_serves(r, release):
    rel = release(r)
    small = list(exhaustive_lists())  # 1110 lists on a 6-layer model
    big = list(random_lists(N_BIG, 2000, seed=sum(map(ord, r))))
    named = [(2, 30, 58), (1, 29, 57), (-1, 2, 30), (-1, 1, 2), (0, 2, 3), (3, 31, 59), (2, 31, 59),
             (1, 30, 58), (29, 1, 57), (60,), (2, 30, 61), (1, 29, 60)]
    bad_small, served_small = mismatches(rel, small, 6)
    bad_big, served_big = mismatches(rel, big + named, N_BIG)
    print(f"sglang {r}: upstream serves {served_small}/{len(small)} lists (6 layers), "
          f"{served_big}/{len(big) + len(named)} (61 layers); departures {len(bad_small) + len(bad_big)}")
    assert not bad_small and not bad_big, (bad_small + bad_big)[:5]
    assert served_small > 50 and served_big > 500  # the property covers lists upstream really serves
    # no ids: upstream's default [2, N//2, N-3] on both
    assert rel.patched_feeds(None, N_BIG) == rel.upstream_feeds(None, N_BIG) == [2, 30, 58]


def test_the_documented_readings(release):
    """The README's table, row by row, on the real methods (61 layers)."""
    want = {  # release -> ids -> (upstream, patched); None: not served / refused
        "0.5.9": {(1, 29, 57): ([2, 30, 58], [2, 30, 58]), (2, 30, 58): ([3, 31, 59], [3, 31, 59]),
                  (-1, 1, 2): (None, [0, 2, 3]), (1, 29, 60): (None, [2, 30, 61]), (0, 2, 3): ([1, 3, 4], [1, 3, 4])},
        "0.5.17": {(1, 29, 57): ([2, 30, 58], [2, 30, 58]), (2, 30, 58): ([2, 30, 58], [2, 30, 58]),
                   (-1, 1, 2): (None, [0, 2, 3]), (1, 29, 60): (None, [2, 30, 61]), (0, 2, 3): ([0, 2, 3], [0, 2, 3]),
                   (2, 30, 61): (None, [2, 30, 61])},
    }
    want["0.5.23"] = want["0.5.17"]
    for r, rows in want.items():
        rel = release(r)
        for ids, (up, pa) in rows.items():
            assert rel.upstream_feeds(ids, N_BIG) == up, (r, ids)
            assert rel.patched_feeds(ids, N_BIG) == pa, (r, ids)


def test_the_old_reading_fails_the_property(tmp_path):
    """Control: the series as it read ids before (k -> k + 1 for every list on 0.5.14+) departs
    from unpatched 0.5.17 on lists upstream serves, [2, 30, 58] among them."""
    old = Release("0.5.17", tmp_path, upstream_mapping="plus_one")
    bad, _ = mismatches(old, list(random_lists(N_BIG, 300, seed=7)) + [(2, 30, 58)], N_BIG)
    assert ((2, 30, 58), [2, 30, 58], [3, 31, 59]) in bad
    assert len(bad) > 50


@pytest.mark.parametrize("r", RELEASES)
def test_round_trip_dataset_draft_config_served(r, release):
    """Dataset layers H (HF indices) on release R -> the draft ids written for R -> what patched R
    feeds that draft == H; unpatched R feeds it H too wherever its capture reaches H. The dump
    reads EAGLE3_DUMP_LAYERS by the same rule, so dumping with those ids writes H."""
    rel = release(r)
    rule = conventions.release_rule(r)
    up_rule = conventions.release_rule(r, unpatched=True)
    sets = [tuple(c) for k in (1, 2, 3) for c in itertools.combinations(range(0, 7), k)]
    rnd = random.Random(3)
    sets += [tuple(sorted(rnd.sample(range(0, N_BIG + 1), 3))) for _ in range(300)]
    for hf in sets:
        n = 6 if max(hf) <= 6 else N_BIG
        ids = conventions.ids_for(rule, list(hf))
        if ids is None:
            assert hf == (1,), hf  # the only set no list names on 0.5.14+ (a lone 1 reads as 2)
            continue
        assert rel.patched_feeds(ids, n) == list(hf), (r, hf, ids)
        settings = rel.pkg.settings.DumpSettings.from_env({"EAGLE3_DUMP_DIR": "/d",
                                                            "EAGLE3_DUMP_LAYERS": ",".join(map(str, ids))})
        assert settings.capture_indices(n) == list(hf)
        reachable = all((i >= 1 or rel.embed_ok) and i <= n - 1 for i in hf)
        if reachable:
            assert rel.upstream_feeds(ids, n) == list(hf), (r, hf, ids)
            assert conventions.ids_for(up_rule, list(hf)) == ids  # one list serves both trees
