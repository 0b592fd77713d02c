"""Chat-template tokenization with the model's Hugging Face tokenizer and an assistant loss mask.

Two ways to find the assistant tokens:

- ``generation``: the template marks assistant output with ``{% generation %}`` blocks, and
  transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` returns the mask.
- ``offsets``: any other template. Each assistant turn is located by rendering the conversation
  with that turn's content replaced by a unique marker: the marker must appear exactly once, and
  putting the content back must give the real rendering, so the turn's characters are known
  exactly even when the template rewrites earlier turns (and words of the reply that also occur
  in another turn are never matched). The turn's end-of-turn marker is what the template writes
  after the content when the turn is the last message (trailing whitespace excluded); it must
  follow the content in the full rendering too. Tokens whose character offsets overlap a turn
  get mask 1. This needs a fast tokenizer (offset mapping).

A turn that cannot be located, or a generation mask that is all zero although the conversation
has assistant turns, raises ``MaskError``: that sample fails with the reason, it is never written
with a wrong or empty mask.

Thread safety: transformers caches one compiled template per template string, and that template
carries one ``AssistantTracker`` shared by every caller, so concurrent renders corrupt each
other's masks. Every render of a chat template in this process goes through ``_RENDER_LOCK``.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
MARKER = "EAGLEPATCHTURNMARKER7F3A"  # one word, no markup: templates copy it through unchanged
_RENDER_LOCK = threading.Lock()


class MaskError(Exception):
    """The assistant tokens of this conversation cannot be determined; the message says why."""


@dataclass
class Encoded:
    input_ids: list
    loss_mask: list
    truncated: bool


class ChatTokenizer:
    def __init__(self, path: Path | str, trust_remote_code: bool = False, mask_method: str = "auto"):
        try:
            from transformers import AutoTokenizer
        except ImportError:  # pragma: no cover - environment problem
            raise UsageError("transformers is not installed",
                             "pip install -e '.[extract-specforge]' (from the eaglepatch checkout)") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise UsageError(f"cannot load a tokenizer from {path} ({type(exc).__name__}: {str(exc)[:200]})",
                             "pass the model's Hugging Face tokenizer directory with --tokenizer") from None
        self.path = str(path)
        template = getattr(self.tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default") or next(iter(template.values()), None)
        if not template or not isinstance(template, str):
            raise UsageError(f"the tokenizer in {path} has no chat template",
                             "use the model's tokenizer (its tokenizer_config.json holds chat_template)")
        self.template = template
        has_gen = bool(GENERATION_TAG.search(template))
        if mask_method == "auto":
            mask_method = "generation" if has_gen else "offsets"
        if mask_method == "generation" and not has_gen:
            raise UsageError("--mask generation: the chat template has no {% generation %} block",
                             "use --mask offsets (or auto)")
        if mask_method == "offsets" and not self.tok.is_fast:
            raise UsageError(f"the tokenizer in {path} is not a fast tokenizer (no offset mapping)",
                             "use a tokenizer.json based tokenizer or a template with {% generation %} blocks")
        self.mask_method = mask_method

    def __len__(self) -> int:
        return len(self.tok)

    def _apply(self, messages, **kw):
        with _RENDER_LOCK:
            return self.tok.apply_chat_template(messages, **kw)

    def _render(self, messages) -> str:
        return self._apply(messages, tokenize=False, add_generation_prompt=False)

    # ---- generation blocks -----------------------------------------------------------------
    def _encode_generation(self, messages):
        out = self._apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                          add_generation_prompt=False)
        ids = list(out["input_ids"])
        mask = [int(bool(x)) for x in out["assistant_masks"]]
        if not any(mask) and any(m["role"] == "assistant" for m in messages):
            raise MaskError("the chat template's {% generation %} blocks marked no token although the "
                            "conversation has assistant turns")
        return ids, mask

    # ---- offsets ---------------------------------------------------------------------------
    def _turn_span(self, messages, i: int, text: str) -> tuple[int, int]:
        """Character span of assistant turn ``i`` (content and end-of-turn marker) in ``text``."""
        content = messages[i]["content"]
        where = f"assistant turn {sum(1 for m in messages[:i] if m['role'] == 'assistant') + 1}"
        if MARKER in content:
            raise MaskError(f"{where} contains the marker word {MARKER}")
        marked = [dict(m) for m in messages]
        marked[i]["content"] = MARKER
        full = self._render(marked)
        if full.count(MARKER) != 1:
            raise MaskError(f"cannot locate {where}: the chat template renders its content "
                            f"{full.count(MARKER)} times (dropped or repeated)")
        pos = full.index(MARKER)
        if full[:pos] + content + full[pos + len(MARKER):] != text:
            raise MaskError(f"cannot locate {where}: the chat template does not copy its content verbatim")
        upto = self._render(marked[: i + 1])
        if upto.count(MARKER) != 1:
            raise MaskError(f"cannot locate the end of {where} (the conversation cut after it renders "
                            f"the turn {upto.count(MARKER)} times)")
        tail = upto[upto.index(MARKER) + len(MARKER):].rstrip()
        end = pos + len(content)
        if not text.startswith(tail, end):
            raise MaskError(f"cannot locate the end of {where}: the end-of-turn text {tail[:40]!r} does not "
                            f"follow it in the full conversation")
        return pos, end + len(tail)

    def _encode_offsets(self, messages):
        text = self._render(messages)
        spans = [self._turn_span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(e > s and any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
        if spans and not any(mask):
            raise MaskError("the assistant turns were located but cover no token")
        return ids, mask

    def encode(self, messages, max_len: int | None = None) -> Encoded:
        """Token ids and loss mask; raises MaskError when the mask cannot be trusted."""
        try:
            if self.mask_method == "generation":
                ids, mask = self._encode_generation(messages)
            else:
                ids, mask = self._encode_offsets(messages)
        except MaskError:
            raise
        except Exception as exc:  # a template that raises on this conversation (raise_exception, bad roles)
            raise MaskError(f"the chat template fails on this conversation ({type(exc).__name__}: "
                            f"{str(exc)[:160]})") from None
        truncated = bool(max_len) and len(ids) > max_len
        if truncated:
            ids, mask = ids[:max_len], mask[:max_len]
        return Encoded(ids, mask, truncated)
