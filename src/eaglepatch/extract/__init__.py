"""Extraction client: conversations in, a training-ready hidden-state dataset out.

``python tools/extract.py --server URL --model MODEL_DIR --data conv.jsonl --dump-dir DIR --out OUT``
sends each conversation's chat-template token ids to a patched SGLang server (``/generate``,
one new token), waits for the server's per-request dump file, validates it and writes the sample
in SpecForge or speculators form, with a manifest and resume.
"""

from .run import Extractor, Options, extract

__all__ = ["Extractor", "Options", "extract"]
