"""Tokenizer resolution for the load (benchmarks and tuner trials): the engine's model names
first, then Hugging Face names or directories, then `.gguf` files. transformers and the
engine's loader are imported inside the call, so the torch-free tuner can import this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(name: str) -> Any:
    """The tokenizer for `name`: a kvpilot model name (e.g. the builtin
    `smollm2-135m-instruct`) through `kvpilot.engine.model_loader.load_tokenizer`, a local
    Hugging Face directory or hub name, or a path to a `.gguf` file (parsed by transformers,
    15-20 s for SmolLM2). Raises ValueError when nothing can load it."""
    path = Path(name)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise ValueError(f"cannot load tokenizer {name!r}: transformers is not installed") from exc
    if path.suffix == ".gguf" and path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    errors = []
    try:
        from kvpilot.engine.model_loader import load_tokenizer as engine_load_tokenizer
    except ImportError:
        engine_load_tokenizer = None
    if engine_load_tokenizer is not None:
        try:
            return engine_load_tokenizer(name)
        except Exception as exc:  # noqa: BLE001 - fall through to the plain Hugging Face loader
            errors.append(f"kvpilot: {exc}")
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001
        errors.append(f"transformers: {exc}")
    raise ValueError(f"cannot load tokenizer {name!r} ({'; '.join(errors)}); pass --tokenizer")
