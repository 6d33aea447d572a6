"""Random sampling of one token per row in one pass over float32 CPU logits (csrc/sample.c): the
Gumbel-max trick with counter-based draws, the exponential race of vLLM's sampler without the
[rows, vocab] probability and noise tensors. engine/sample/sampler.py uses it for random rows
with a temperature and no top-k, top-p or min-p.
Source: Maddison, Tarlow and Minka, A* sampling (NeurIPS 2014); vLLM v1
`vllm/v1/sample/ops/topk_topp_sampler.py` `random_sample`.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu.loader import kernel_range, load

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _lib() -> ctypes.CDLL:
    lib = load("sample")
    if lib.kvp_sample_gumbel.argtypes is None:
        lib.kvp_sample_gumbel.restype = None
        lib.kvp_sample_gumbel.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I]
    return lib


def available() -> bool:
    """Whether the install built the sampling kernel for this CPU."""
    try:
        _lib()
    except (OSError, ValueError, RuntimeError):  # loader.KernelsNotBuilt is a RuntimeError
        return False
    return True


def gumbel_sample(logits: torch.Tensor, inv_temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32 CPU with contiguous rows; inv_temperature [rows] float32 (1 / T);
    keys [rows] int64, the row's draws (the same key and logits give the same token) -> [rows]
    int64: each row's sampled token, a draw from softmax(logits / T) (argmax of logits / T plus
    Gumbel noise), or -1 for a row with no finite logit. Uses torch.get_num_threads() threads.
    Raises ValueError on other shapes or dtypes, loader.KernelsNotBuilt where the install built no
    kernels."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if (rows < 0 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1
            or inv_temperature.shape != (rows,) or inv_temperature.dtype != torch.float32
            or keys.shape != (rows,) or keys.dtype != torch.int64):
        raise ValueError(f"gumbel_sample: want logits [rows, vocab] float32 CPU rows contiguous, inv_temperature "
                         f"[rows] float32, keys [rows] int64; got {tuple(logits.shape)} {logits.dtype}, "
                         f"{tuple(inv_temperature.shape)} {inv_temperature.dtype}, {tuple(keys.shape)} {keys.dtype}")
    inv_t, keys = inv_temperature.contiguous(), keys.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    with kernel_range("sample_gumbel"):
        _lib().kvp_sample_gumbel(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], inv_t.data_ptr(),
                                 keys.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
