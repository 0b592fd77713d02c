"""Assistant loss masks (eaglepatch.extract.tokenize) with real transformers chat templates:
many threads encoding at once, a template that rewrites earlier turns, and turns that cannot be
located (that sample fails with a reason, it is never written with a wrong or empty mask).

The end-to-end side (a failing sample listed in the manifest, the rest extracted) is in
test_extract.py. Runs in the CPU environment (tools/test.py).
"""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglepatch.extract.data import load_conversations  # noqa: E402
from eaglepatch.extract.tokenize import ChatTokenizer, MaskError  # noqa: E402
from eaglepatch.serve import tinychat  # noqa: E402

THREADS, ENCODES = 8, 500


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("masks")
    b = tinychat.build_tokenizer
    return {
        "gen": ChatTokenizer(b(root / "gen")),
        "off": ChatTokenizer(b(root / "off", generation=False)),
        "rewrite-gen": ChatTokenizer(b(root / "rewrite-gen", template=tinychat.REWRITE)),
        "rewrite-off": ChatTokenizer(b(root / "rewrite-off", generation=False, template=tinychat.REWRITE)),
        "drop-off": ChatTokenizer(b(root / "drop-off", generation=False, template=tinychat.DROP)),
        "hf": __import__("transformers").AutoTokenizer.from_pretrained(str(root / "gen")),
    }


@pytest.fixture(scope="module")
def convs(tmp_path_factory):
    p = tinychat.write_jsonl(tmp_path_factory.mktemp("conv") / "c.jsonl", tinychat.conversations(40, seed=11))
    return [c.messages for c in load_conversations(p)]


def assistant_tokens(hf, messages) -> list:
    """What the mask must select: each assistant turn's words, then its end-of-turn token."""
    eot = hf.convert_tokens_to_ids("<|eot|>")
    want = []
    for m in messages:
        if m["role"] == "assistant":
            want += hf.convert_tokens_to_ids(m["content"].split()) + [eot]
    return want


def masked(enc) -> list:
    return [t for t, k in zip(enc.input_ids, enc.loss_mask) if k]


def test_many_threads_many_encodes_zero_wrong_masks(toks, convs):
    """transformers caches one compiled template, with one AssistantTracker, per template string:
    concurrent generation-mask encodes used to corrupt each other's masks (1 in ~4000) or raise
    'AssistantTracker should not be reused'. Every render now goes through one lock."""
    tok = toks["gen"]
    want = [tok.encode(m) for m in convs]
    wrong, errors = [], []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ENCODES):
            i = rng.randrange(len(convs))
            try:
                got = tok.encode(convs[i])
            except Exception as exc:  # noqa: BLE001 - counted, then asserted on
                errors.append(repr(exc))
                continue
            if (got.input_ids, got.loss_mask) != (want[i].input_ids, want[i].loss_mask):
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(wrong), errors[:3]) == (0, []), f"{len(wrong)} wrong masks of {THREADS * ENCODES}"
    print(f"\nmask figures: {THREADS} threads x {ENCODES} encodes: 0 wrong masks, 0 errors")


def test_offsets_equal_generation_and_include_the_end_of_turn(toks, convs):
    hf = toks["hf"]
    for m in convs:
        a, b = toks["gen"].encode(m), toks["off"].encode(m)
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
        assert masked(b) == assistant_tokens(hf, m)


def test_template_that_rewrites_earlier_turns(toks):
    """The first line names the conversation's length, so no rendering of a prefix is a prefix of
    the whole; the user's turn repeats the assistant's reply word for word. The reply (and only
    the reply, with its end-of-turn token) is masked, as the template's own generation blocks say."""
    hf = toks["hf"]
    conv = [{"role": "user", "content": "red green blue"}, {"role": "assistant", "content": "red green blue"},
            {"role": "user", "content": "cat dog red green blue"}, {"role": "assistant", "content": "red green blue"}]
    off, gen = toks["rewrite-off"].encode(conv), toks["rewrite-gen"].encode(conv)
    assert off.input_ids == gen.input_ids
    assert off.loss_mask == gen.loss_mask
    assert masked(off) == assistant_tokens(hf, conv)
    # the user's copy of the words is not masked: the first masked token comes after '<|assistant|>'
    first = off.loss_mask.index(1)
    assert off.input_ids[first - 1] == hf.convert_tokens_to_ids("<|assistant|>")
    # shown failing: a mask that picks the user's copy (what a text search finds first) differs
    text = toks["rewrite-off"]._render(conv)
    wrong_start = text.index("red green blue")
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    found = [int(wrong_start <= s < wrong_start + len("red green blue")) for s, _ in enc["offset_mapping"]]
    assert found != off.loss_mask


def test_turn_that_cannot_be_located_fails_loudly(toks, convs):
    """A template that drops earlier assistant turns' content: the earlier turn cannot be located,
    the encode raises (the sample fails with this reason); one-turn conversations still encode."""
    tok = toks["drop-off"]
    two = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good day"},
           {"role": "user", "content": "and then"}, {"role": "assistant", "content": "bye now"}]
    with pytest.raises(MaskError, match="cannot locate assistant turn 1: the chat template renders its content 0 times"):
        tok.encode(two)
    one = two[:2]
    assert masked(tok.encode(one)) == assistant_tokens(toks["hf"], one)


def test_generation_mask_all_zero_fails(tmp_path, toks):
    """{% generation %} blocks that cover nothing although the conversation has assistant turns:
    the sample fails, it is not recorded as 'no assistant tokens'."""
    tmpl = tinychat.TEMPLATE.replace("{% generation %}{{ m['content'] }} <|eot|>{% endgeneration %}",
                                     "{{ m['content'] }} <|eot|>{% if false %}{% generation %}{% endgeneration %}{% endif %}")
    tok = ChatTokenizer(tinychat.build_tokenizer(tmp_path / "t", template=tmpl))
    assert tok.mask_method == "generation"
    with pytest.raises(MaskError, match="marked no token although the conversation has assistant turns"):
        tok.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    # a conversation without an assistant turn is not an error (the run records it as skipped)
    assert not any(tok.encode([{"role": "user", "content": "hi"}]).loss_mask)
