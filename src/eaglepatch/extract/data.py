"""Conversations from JSONL: OpenAI ``messages`` and ShareGPT ``conversations`` records.

Each line is one conversation. Accepted forms::

    {"id": "a1", "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"id": "a2", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}

The id is taken from ``id`` (else ``conversation_id``/``uuid``), or ``line-<n>`` (1-based line
number) when absent. Ids must be unique: they key resume.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import UsageError

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer"}


@dataclass
class Conversation:
    id: str
    index: int  # 0-based position in the file (among conversations)
    line: int  # 1-based line number
    messages: list  # [{"role": ..., "content": ...}]

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the normalized messages: a done sample whose conversation changed is redone."""
        blob = json.dumps(self.messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise UsageError(f"{where}: only text content parts are supported, got {str(p)[:60]!r}",
                                 "drop image/audio parts from the data")
        return "".join(parts)
    if content is None:
        return ""
    raise UsageError(f"{where}: message content is {type(content).__name__}, not text", "use a string")


def normalize_messages(rec: dict, where: str) -> list:
    """One record's messages (OpenAI or ShareGPT form) as [{"role", "content"}]; ``where`` prefixes errors."""
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list):
            raise UsageError(f"{where}: 'messages' is not a list", "write each conversation as a list of messages")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise UsageError(f"{where}: message {j} has no 'role'", "give every message a role and content")
            role = m["role"]
            if not isinstance(role, str) or role not in OPENAI_ROLES:
                raise UsageError(f"{where}: message {j} has unknown role {role!r}",
                                 "use system/user/assistant/tool")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(m.get("content"), f"{where} message {j}")})
        return out
    if "conversations" in rec:
        turns = rec["conversations"]
        if not isinstance(turns, list):
            raise UsageError(f"{where}: 'conversations' is not a list", "write each conversation as a list of turns")
        out = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict):
                raise UsageError(f"{where}: turn {j} is not an object", "use {\"from\": ..., \"value\": ...}")
            src = t.get("from", t.get("role"))
            role = SHAREGPT_ROLES.get(str(src).lower())
            if role is None:
                raise UsageError(f"{where}: turn {j} has unknown speaker {src!r}",
                                 "use from = human/gpt/system (ShareGPT) or role = user/assistant/system")
            out.append({"role": role, "content": _content_text(t.get("value", t.get("content")),
                                                               f"{where} turn {j}")})
        return out
    raise UsageError(f"{where}: neither 'messages' nor 'conversations' in the record",
                     "use the OpenAI {\"messages\": [...]} or ShareGPT {\"conversations\": [...]} form")


def load_conversations(path: Path | str) -> list[Conversation]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"data file {path} does not exist", "pass a JSONL file with --data")
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise UsageError(f"cannot read data file {path} ({exc.strerror})", "pass a readable JSONL file") from None
    convs: list[Conversation] = []
    seen: dict[str, int] = {}
    for n, blob in enumerate(lines, 1):
        try:
            raw = blob.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path}:{n}: not UTF-8 (byte {blob[exc.start]:#04x} at column {exc.start + 1})",
                             "convert the data file to UTF-8 (e.g. iconv -t UTF-8)") from None
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg})", "write one JSON object per line") from None
        except RecursionError:
            raise UsageError(f"{where}: JSON nested too deeply", "write one flat JSON object per line") from None
        if not isinstance(rec, dict):
            raise UsageError(f"{where}: a line is not a JSON object", "write one JSON object per line")
        rid = rec.get("id", rec.get("conversation_id", rec.get("uuid")))
        sid = str(rid) if rid is not None else f"line-{n}"
        if sid in seen:
            raise UsageError(f"{where}: duplicate conversation id {sid!r} (first at line {seen[sid]})",
                             "give every conversation a unique 'id' (resume is keyed by it)")
        seen[sid] = n
        msgs = normalize_messages(rec, where)
        convs.append(Conversation(id=sid, index=len(convs), line=n, messages=msgs))
    if not convs:
        raise UsageError(f"data file {path} holds no conversations", "pass a non-empty JSONL file")
    return convs
