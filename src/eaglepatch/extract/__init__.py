"""Extraction client: conversations in, a training-ready hidden-state dataset out.

``python tools/extract.py --server URL --model MODEL_DIR --data conv.jsonl --dump-dir DIR --out OUT``
sends each conversation's chat-template token ids to a patched SGLang server (``/generate``,
one new token; several servers, or SGLang's router in front of replicas: ``client``), waits for
the server's per-request dump file, validates it and writes the sample in SpecForge or
speculators form, with a manifest and resume (stages: ``run``).

Importing the package imports nothing heavy: ``Options``, ``Extractor`` and ``extract`` load
``run`` (and through it requests, torch, transformers) on first use.
"""

__all__ = ["Extractor", "Options", "extract"]


def __getattr__(name):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
