"""Chat-template tokenization with the model's Hugging Face tokenizer and an assistant loss mask.

Two ways to find the assistant tokens:

- ``generation``: the template marks assistant output with ``{% generation %}`` blocks, and
  transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` returns the mask.
- ``offsets``: any other template. For each assistant turn i the conversation is rendered up to
  the turn's start (``messages[:i]`` with the generation prompt) and up to its end
  (``messages[:i+1]``); the characters in between are the turn (content and end-of-turn marker).
  When a template rewrites earlier turns (so the renderings are not prefixes of each other), the
  turn's content is searched in the full text after the previous turn instead. Tokens whose
  character offsets overlap a turn get mask 1. This needs a fast tokenizer (offset mapping).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
            raise UsageError("transformers is not installed", "pip install transformers tokenizers") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise UsageError(f"cannot load a tokenizer from {path} ({type(exc).__name__}: {str(exc)[:200]})",
                             "pass the model's Hugging Face tokenizer directory with --tokenizer") from None
        self.path = str(path)
        template = self.tok.chat_template
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default") or next(iter(template.values()))
        if not template:
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

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode_generation(self, messages):
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True, add_generation_prompt=False)
        ids = list(out["input_ids"])
        mask = [int(bool(x)) for x in out["assistant_masks"]]
        return ids, mask

    def _assistant_spans(self, messages, text: str):
        spans = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            span = None
            try:
                before = self._render(messages[:i], add_generation_prompt=True) if i else ""
                upto = self._render(messages[: i + 1], add_generation_prompt=False)
            except Exception:
                before = upto = None
            if (before is not None and upto.startswith(before) and text.startswith(upto)
                    and len(upto) > len(before) and len(before) >= cursor):
                span = (len(before), len(upto))
            elif m["content"]:
                pos = text.find(m["content"], cursor)
                if pos >= 0:
                    span = (pos, pos + len(m["content"]))
            if span is not None:
                spans.append(span)
                cursor = span[1]
        return spans

    def _encode_offsets(self, messages):
        text = self._render(messages, add_generation_prompt=False)
        spans = self._assistant_spans(messages, text)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = []
        for s, e in enc["offset_mapping"]:
            hit = e > s and any(s < b and e > a for a, b in spans)
            mask.append(int(hit))
        return ids, mask

    def encode(self, messages, max_len: int | None = None) -> Encoded:
        if self.mask_method == "generation":
            ids, mask = self._encode_generation(messages)
        else:
            ids, mask = self._encode_offsets(messages)
        truncated = bool(max_len) and len(ids) > max_len
        if truncated:
            ids, mask = ids[:max_len], mask[:max_len]
        return Encoded(ids, mask, truncated)
