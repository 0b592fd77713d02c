"""The synthetic languages the acceptance target is trained on, and the measures of a target's
greedy output (pure Python: imported everywhere).

EAGLE-3 hands the draft the embedding of the next token, so a target whose next token follows
from the current token alone lets any layer choice look fine. Both languages make the greedy next
token depend on context the current token does not carry:

- ``skip``: two interleaved walks over one fixed random cycle g of ``symbols`` tokens: after the
  user's two start symbols a, b the assistant writes g(a), g(b), g(g(a)), g(g(b)), ...; the next
  token is g of the token two back. The target needs a previous-token head and the table g;
  learnable in a few hundred steps (the CPU toy's language).
- ``copy``: the user writes ``symbols`` distinct tokens (from the first ``alphabet`` symbol words);
  the assistant, given one of them, goes on copying the list from there (``answer_len`` <
  ``symbols`` tokens, no wrap-around). Each token occurs once in the user turn, so the next token
  is found by one unambiguous lookup: the classic induction task (an earlier occurrence of the
  current token, then the token after it). The GPU default. As with ``recall``, a one-layer draft
  cannot do it from its own inputs, and the target's states at j (token j) let it. ``lead``: the
  user turn ends with 0..lead random filler tokens (outside the alphabet) after the list, so the
  distance between an answer token and its copy in the list takes ``symbols - answer_len +
  lead`` values. Without them it takes only ``symbols - answer_len``, and a draft fed nothing
  (the floor) learns to read the answer by position: a shortcut that needs no layer at all.
- ``recall``: the user lists the pairs (k, pi(k)) of a random cyclic permutation pi of ``symbols``
  tokens drawn per sample (from the first ``alphabet`` symbol words; all of them by default), in
  random order; the assistant walks the cycle from a given start: the next token is found only by
  looking the current one up in the context (an induction head). Both toy and GPU use it: a
  one-layer draft cannot look a pair up from its own inputs (at position j it holds the embedding
  of token j+1 only; the pair needs token j too, a second layer), but the target's states at j
  hold token j, so a draft fed the right layers can (the floor control cannot).

Every sample is rendered in the chat format of ``serve.tinychat`` (ids: bos, <|user|>, the user's
symbols, <|eot|>, <|assistant|>, the assistant's symbols, <|eot|>), so the server, tools/extract.py
and the trainer read the same token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..serve import tinychat

LANGUAGES = ("skip", "recall", "copy")
_VOCAB = None


def special(name: str, vocab_size: int) -> int:
    return tinychat.vocab(vocab_size)[name]


def symbol_pool(vocab_size: int) -> list[int]:
    """The token ids a language draws symbols from: tinychat's ``w<i>`` filler words."""
    v = tinychat.vocab(vocab_size)
    return [i for t, i in sorted(v.items(), key=lambda kv: kv[1]) if t.startswith("w") and t[1:].isdigit()]


@dataclass(frozen=True)
class Sample:
    user: list          # symbols of the user turn
    prefix: list        # assistant symbols given in the prompt (recall: the start)
    answer: list        # the assistant symbols the target must produce after the prefix


class Language:
    def __init__(self, kind: str, vocab_size: int, symbols: int, answer_len: int, seed: int,
                 alphabet: int | None = None, lead: int = 0):
        if kind not in LANGUAGES:
            raise ValueError(kind)
        pool = symbol_pool(vocab_size)
        if symbols > len(pool) or (alphabet is not None and not symbols <= alphabet <= len(pool)):
            raise ValueError("%d symbols (alphabet %s) do not fit a vocabulary of %d" % (symbols, alphabet, vocab_size))
        if kind == "copy" and not 0 < answer_len < symbols:
            raise ValueError("copy: the answer (%d tokens) must be shorter than the list (%d symbols)"
                             % (answer_len, symbols))
        self.kind, self.vocab_size, self.symbols, self.answer_len = kind, vocab_size, symbols, answer_len
        self.pool = pool if alphabet is None else pool[:alphabet]
        if lead and (kind != "copy" or alphabet is None or len(pool) - alphabet < lead):
            raise ValueError("lead (%d filler tokens) needs the copy language and %d symbol words beyond its "
                             "alphabet" % (lead, lead))
        self.lead, self.fillers = lead, pool[len(self.pool):len(self.pool) + lead]
        rng = random.Random("%s-%d" % (kind, seed))
        cyc = rng.sample(pool, symbols)  # skip: one fixed cycle over the first `symbols` words
        self.g = {cyc[i]: cyc[(i + 1) % symbols] for i in range(symbols)}
        self.bos, self.eot = special("<|bos|>", vocab_size), special("<|eot|>", vocab_size)
        self.user_id, self.asst_id = special("<|user|>", vocab_size), special("<|assistant|>", vocab_size)

    def sample(self, rng: random.Random) -> Sample:
        n = self.answer_len
        if self.kind == "skip":
            a, b = rng.sample(sorted(self.g), 2)
            out, x, y = [], a, b
            while len(out) < n:
                x, y = y, self.g[x]
                out.append(y)
            return Sample([a, b], [], out)
        if self.kind == "copy":
            seq = rng.sample(self.pool, self.symbols)
            start = rng.randrange(self.symbols - n)
            fill = [rng.choice(self.fillers) for _ in range(rng.randint(0, self.lead))] if self.lead else []
            return Sample(seq + fill, [seq[start]], seq[start + 1:start + 1 + n])
        cyc = rng.sample(self.pool, self.symbols)
        succ = {cyc[i]: cyc[(i + 1) % self.symbols] for i in range(self.symbols)}
        keys = list(cyc)
        rng.shuffle(keys)
        user = [t for k in keys for t in (k, succ[k])]
        start = rng.choice(cyc)
        walk, x = [], start
        while len(walk) < n:
            x = succ[x]
            walk.append(x)
        return Sample(user, [start], walk)

    def rule_next(self, s: Sample, ids: list) -> list:
        """For each token of ``ids`` (the assistant's symbols, prefix first), the token the
        language's rule puts after it in sample ``s`` (None where the rule does not apply): recall,
        the successor the user's pairs give; skip, g of the token two back."""
        if self.kind in ("recall", "copy"):
            pairs = zip(s.user[0::2], s.user[1::2]) if self.kind == "recall" else zip(s.user, s.user[1:])
            succ = dict(pairs)
            return [succ.get(t) for t in ids]
        seq = list(s.user) + list(ids)
        off = len(s.user)
        return [self.g.get(seq[off + i - 1]) if off + i - 1 >= 0 else None for i in range(len(ids))]

    def prompt_ids(self, s: Sample) -> list:
        return [self.bos, self.user_id, *s.user, self.eot, self.asst_id, *s.prefix]

    def full_ids(self, s: Sample, answer=None) -> list:
        return self.prompt_ids(s) + list(s.answer if answer is None else answer) + [self.eot]

    def words(self, ids) -> str:
        inv = {i: t for t, i in tinychat.vocab(self.vocab_size).items()}
        return " ".join(inv[int(i)] for i in ids)


# ---- measures of greedy output -------------------------------------------------------------------

def bigram_predictability(train: list, held: list) -> float:
    """Share of held-out next tokens that a current-token lookup table (the most frequent successor
    of each token in ``train``) predicts. Each item: a token list (context end + continuation)."""
    from collections import Counter, defaultdict

    succ = defaultdict(Counter)
    for seq in train:
        for a, b in zip(seq, seq[1:]):
            succ[a][b] += 1
    table = {a: c.most_common(1)[0][0] for a, c in succ.items()}
    hit = total = 0
    for seq in held:
        for a, b in zip(seq, seq[1:]):
            hit += table.get(a) == b
            total += 1
    return hit / total if total else 0.0


def loops(seq: list, max_period: int = 8) -> bool:
    """Whether the second half of ``seq`` repeats with a period of at most ``max_period`` tokens."""
    tail = list(seq[len(seq) // 2:])
    for p in range(1, max_period + 1):
        if len(tail) >= 2 * p and all(tail[i] == tail[i - p] for i in range(p, len(tail))):
            return True
    return False


def chain_accept_length(acc: list) -> float:
    """1 + a1 + a1*a2 + ...: the accept length per verify a chain draft with step accuracies acc reaches."""
    out, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        out += prod
    return out


def chain_accept_length_at(acc: list, tokens: int) -> float:
    """What sum(C - 1)/sum(V) comes to in expectation when each request generates ``tokens`` tokens
    after the prefill's, for a chain draft whose step k is right with probability acc[k] given the
    steps before it right: the last verify of a request is cut at its end, so short answers
    accept less per verify than 1 + a1 + a1*a2 + ... (which is the limit of long ones). Exact:
    E[V] by dynamic programming over the tokens left."""
    n = len(acc)
    reach = [1.0]  # reach[k]: probability the first k steps are all right
    for a in acc:
        reach.append(reach[-1] * a)
    ev = [0.0] * (tokens + 1)  # ev[r]: expected verifies for r tokens left
    for r in range(1, tokens + 1):
        m = min(n, r - 1)  # a verify commits at most m draft tokens plus its own
        e = 1.0
        for k in range(m + 1):  # exactly k draft tokens accepted
            pk = reach[k] * ((1 - acc[k]) if k < m else 1.0)
            e += pk * ev[r - k - 1]
        ev[r] = e
    return tokens / ev[tokens] if tokens else 0.0


def served_accept_length(metas: list) -> dict:
    """sum(C - 1) / sum(V) over the responses' meta_info (completion_tokens C, spec_verify_ct V):
    the prefill's token is no verify's."""
    c = sum(int(m["completion_tokens"]) - 1 for m in metas)
    v = sum(int(m["spec_verify_ct"]) for m in metas)
    return {"accept_length": c / v if v else None, "tokens_after_prefill": c, "verify_ct": v,
            "requests": len(metas)}
