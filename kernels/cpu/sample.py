"""Random sampling of one token per row straight from float32 CPU logits (csrc/sample.c): inverse
transform sampling over exp((logits - max) / T), one exp per logit and one 53-bit uniform per row
from a key, without the [rows, vocab] probability and noise tensors of torch's path.
engine/sample/sampler.py uses it for random rows with a temperature and no top-k, top-p or min-p.
Source: Devroye, Non-Uniform Random Variate Generation (1986), ch. 2; FlashInfer
`sampling_from_probs`; vLLM v1 `vllm/v1/sample/ops/topk_topp_sampler.py` `random_sample`.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu.loader import kernel_range, load

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _lib(variant: str | None = None) -> ctypes.CDLL:
    lib = load("sample", variant)
    if lib.kvp_sample_rows.argtypes is None:
        lib.kvp_sample_rows.restype = None
        lib.kvp_sample_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I]
    return lib


def available() -> bool:
    """Whether the install built the sampling kernel for this CPU."""
    try:
        _lib()
    except (OSError, ValueError, RuntimeError):  # loader.KernelsNotBuilt is a RuntimeError
        return False
    return True


def sample_from_logits(logits: torch.Tensor, inv_temperature: torch.Tensor, keys: torch.Tensor,
                       variant: str | None = None) -> torch.Tensor:
    """logits [rows, vocab] float32 CPU with contiguous rows; inv_temperature [rows] float32 (1 / T);
    keys [rows] int64, the row's draw (the same key and logits give the same token) -> [rows]
    int64: each row's sampled token, a draw from softmax(logits / T) (the first token whose running
    sum of exp((logits - max) / T) passes u times their total, u uniform in [0, 1) from the key;
    NaN logits and terms below e^-87 count as no mass), or -1 for a row with no finite logit.
    Uses torch.get_num_threads() threads; `variant`: another kernel build of this CPU's (tests).
    Raises ValueError on other shapes or dtypes, loader.KernelsNotBuilt where the install built no
    kernels."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if (rows < 0 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1
            or inv_temperature.shape != (rows,) or inv_temperature.dtype != torch.float32
            or keys.shape != (rows,) or keys.dtype != torch.int64):
        raise ValueError(f"sample_from_logits: want logits [rows, vocab] float32 CPU rows contiguous, inv_temperature "
                         f"[rows] float32, keys [rows] int64; got {tuple(logits.shape)} {logits.dtype}, "
                         f"{tuple(inv_temperature.shape)} {inv_temperature.dtype}, {tuple(keys.shape)} {keys.dtype}")
    inv_t, keys = inv_temperature.contiguous(), keys.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    with kernel_range("sample_rows"):
        _lib(variant).kvp_sample_rows(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], inv_t.data_ptr(),
                                 keys.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
