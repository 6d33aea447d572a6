"""Attention backends over the paged KV cache. `get_attn_backend(name)` returns one:
'torch' (pure PyTorch, the default on CPU) or 'triton' (Triton kernels, the default on
CUDA). Raises ValueError for an unknown name."""

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "triton")


def default_backend(device: str) -> str:
    """The attention backend name for a torch device string: 'triton' on CUDA, 'torch' elsewhere."""
    return "triton" if device.startswith("cuda") else "torch"


def get_attn_backend(name: str) -> AttentionBackend:
    """A new backend instance for `name` ('torch' or 'triton', imported lazily). Raises
    ValueError for any other name."""
    if name == "torch":
        from kvpilot.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attn_backend", "default_backend", "BACKENDS"]
