"""Shapes of the models kvpilot ships (builtin://NAME), for validation and KV-cache sizing.

The operator uses them to refuse parallel sizes that cannot split the model; the tuner uses
`kv_cache_bytes_per_token` to drop configurations that cannot fit before trying them.
"""
from __future__ import annotations

from dataclasses import dataclass

BUILTIN_SCHEME = "builtin://"
# Where the engine images bake the builtin models, converted to safetensors (images/Containerfile,
# KVPILOT_BUILTIN_MODELS_DIR): `kvpilot serve` finds them by alias, `vllm serve` (runtime vllm on
# the kvpilot vLLM CPU image) is given the directory.
IMAGE_MODELS_DIR = "/opt/kvpilot/models"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of one decoder-only transformer."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_params: int

    def kv_cache_bytes_per_token(self, dtype: str = "auto") -> int:
        """Bytes of K and V one token occupies over all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def weight_bytes(self, dtype: str = "auto") -> int:
        """Bytes of the weights in memory: num_params x bytes per element of dtype (KeyError on an
        unknown dtype)."""
        return self.num_params * DTYPE_BYTES[dtype]


BUILTIN_MODELS: dict[str, ModelShape] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, tied embeddings).
    "smollm2-135m-instruct": ModelShape(
        name="smollm2-135m-instruct", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        hidden_size=576, vocab_size=49152, max_position_embeddings=8192, num_params=134_515_008,
    ),
}


def builtin_model(source: str) -> ModelShape | None:
    """The shape named by a builtin://NAME source; None for other sources or unknown names."""
    if not source.startswith(BUILTIN_SCHEME):
        return None
    return BUILTIN_MODELS.get(source[len(BUILTIN_SCHEME):])


def is_gguf_source(source: str) -> bool:
    """Whether the engine loads `source` from a GGUF file: a builtin model (`builtin://NAME` or a
    bare builtin alias, each a GGUF shipped in a wheel) or a path ending in .gguf."""
    return is_builtin(source) or source in BUILTIN_MODELS or source.endswith(".gguf")


def image_model_path(source: str) -> str:
    """The directory a kvpilot engine image holds builtin model `source` in (IMAGE_MODELS_DIR/NAME)."""
    return f"{IMAGE_MODELS_DIR}/{source.removeprefix(BUILTIN_SCHEME)}"


def is_builtin(source: str) -> bool:
    """Whether source names a model shipped with kvpilot (builtin://NAME)."""
    return source.startswith(BUILTIN_SCHEME)
