"""A tiny chat tokenizer built offline with ``tokenizers`` and a synthetic conversation set: the
CPU demo's (``tools/serve.py --cpu-demo``) and the extract tests'.

The tokenizer is word-level (whitespace split) with exactly ``vocab_size`` entries, so every id
fits the tiny DeepSeek-V3 checkpoint (vocab 1024; bos 0, eos 1). Its chat template marks
assistant output with ``{% generation %}`` blocks (or not, with ``generation=False``) and is
saved in tokenizer_config.json, so ``AutoTokenizer.from_pretrained(dir)`` loads it. Other templates:
``REWRITE`` (a header that depends on the whole conversation, so no rendering of a prefix is a
prefix of the full one) and ``DROP`` (earlier assistant turns rendered without their content).

Importing this module imports nothing heavy; ``build_tokenizer`` needs ``tokenizers`` and
``transformers`` (the CPU environment has both): ``python -m eaglepatch.serve.tinychat DEST`` builds
the default tokenizer at DEST.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|bos|>", "<|eot|>", "<|unk|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
WORDS = (
    "the a an and or but if then so because when while where what which who how why is are was were be been "
    "have has had do does did can could will would should may might must not no yes please thank you hello "
    "model layer hidden state token draft target server dump file train data set test run fast slow small big "
    "one two three four five six seven eight nine ten first last next before after up down in out on off "
    "cat dog bird fish tree river mountain city road car bus plane ship book paper pen code bug fix patch "
    "red green blue black white light dark warm cold new old good bad right wrong open close start stop"
).split()

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "<|assistant|> {% generation %}{{ m['content'] }} <|eot|>{% endgeneration %} "
    "{% else %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} <|eot|> "
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


# the conversation's length in the first line: every earlier rendering differs from the full one's start
REWRITE = TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}<|system|> {{ WORDS[messages|length] }} <|eot|> ")
# only the last assistant turn keeps its content (as templates that strip earlier reasoning do)
DROP = TEMPLATE.replace("{{ m['content'] }} <|eot|>{% endgeneration %}",
                        "{% if loop.last %}{{ m['content'] }}{% else %}dark{% endif %} <|eot|>{% endgeneration %}")
assert REWRITE != TEMPLATE and DROP != TEMPLATE
WORD_LIST = "{% set WORDS = ['zero','one','two','three','four','five','six','seven','eight','nine','ten'] %}"
REWRITE = WORD_LIST + REWRITE


def vocab(vocab_size: int = 1024) -> dict:
    toks = SPECIALS + WORDS
    toks += [f"w{i}" for i in range(vocab_size - len(toks))]
    assert len(toks) == vocab_size and len(set(toks)) == vocab_size
    return {t: i for i, t in enumerate(toks)}


def build_tokenizer(dest: Path, vocab_size: int = 1024, generation: bool = True, template: str = TEMPLATE) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(WordLevel(vocab(vocab_size), unk_token="<|unk|>"))
    tk.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|bos|>", eos_token="<|eot|>",
                                   unk_token="<|unk|>", pad_token="<|pad|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[4:]})
    tmpl = template if generation else template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    fast.chat_template = tmpl
    fast.save_pretrained(str(dest))
    return dest


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    pool = WORDS + [f"w{rng.randrange(0, 800)}" for _ in range(20)]
    return " ".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))


def conversations(n: int, seed: int = 7) -> list[dict]:
    """``n`` records: even ones in OpenAI form, odd ones in ShareGPT form; 1-3 exchanges each,
    some with a system prompt, lengths from a few to ~150 tokens."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        turns = []
        if rng.random() < 0.4:
            turns.append(("system", _sentence(rng, 3, 12)))
        for _ in range(rng.randint(1, 3)):
            turns.append(("user", _sentence(rng, 2, 25)))
            turns.append(("assistant", _sentence(rng, 1, 30)))
        if i % 2 == 0:
            recs.append({"id": f"conv-{i:03d}", "messages": [{"role": r, "content": c} for r, c in turns]})
        else:
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            recs.append({"id": f"conv-{i:03d}", "conversations": [{"from": names[r], "value": c} for r, c in turns]})
    return recs


def write_jsonl(path: Path, recs) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return Path(path)


if __name__ == "__main__":
    import sys

    build_tokenizer(Path(sys.argv[1]))
