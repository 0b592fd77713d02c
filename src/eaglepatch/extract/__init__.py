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

# What each --format imports: module -> the project extra's requirement that provides it (pyproject.toml
# extras extract-specforge and extract-speculators; tests/test_extract_deps.py keeps the two in step).
# Both formats need torch: SpecForge's samples are torch.save files, speculators' token_freq.pt too.
NEEDS = {
    "specforge": {"torch": "torch", "transformers": "transformers", "jinja2": "jinja2", "safetensors": "safetensors",
                  "numpy": "numpy", "requests": "requests", "tqdm": "tqdm"},
}
NEEDS["speculators"] = dict(NEEDS["specforge"], datasets="datasets")
NEEDS["compact"] = dict(NEEDS["specforge"])  # safetensors samples, read back by eaglepatch.compact
NEEDS["dflash"] = NEEDS["dspark"] = dict(NEEDS["specforge"])  # torch.save samples, as SpecForge's EAGLE-3 ones
# the project extra that installs a format's needs (pyproject.toml), where it is another format's
EXTRA = {"dflash": "specforge", "dspark": "specforge"}
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def missing_modules(fmt: str) -> list:
    """The modules ``--format fmt`` needs that this interpreter cannot import (none imported here)."""
    import importlib.util

    return [m for m in NEEDS[fmt] if importlib.util.find_spec(m) is None]


def install_fix(fmt: str, missing) -> str:
    """How to install what ``--format fmt`` misses: CPU torch first (a plain ``pip install torch``
    pulls the CUDA build and its nvidia-* wheels), then the format's extra."""
    extra = f"pip install -e '.[extract-{EXTRA.get(fmt, fmt)}]' (from the eaglepatch checkout)"
    if "torch" in missing:
        return f"{CPU_TORCH} (the CPU build; a plain pip install torch pulls CUDA), then {extra}"
    return extra


def detached_dash_value(argv, flag: str = "--aux-layers"):
    """A ``UsageError`` when ``flag`` (or an abbreviation argparse would take) is followed by a
    separate value that starts with '-' and is not a plain number (``--aux-layers -1,2``): argparse
    reads such a value as an option and says only "expected one argument". None otherwise."""
    import re

    from ..errors import UsageError

    for i, arg in enumerate(argv[:-1]):
        if len(arg) >= 3 and flag.startswith(arg):
            value = argv[i + 1]
            if re.match(r"-[0-9]", value) and not re.fullmatch(r"-[0-9]+|-[0-9]*\.[0-9]+", value):
                return UsageError(f"{arg} {value}: a value that starts with '-' must be joined to its flag with '='",
                                  f"write {flag}={value}")
    return None


def __getattr__(name):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
