"""The launchers refuse bad shapes, dtypes and devices with a ValueError that names the
argument, before anything reaches a kernel."""

import re

import pytest
import torch

from kvpilot.kernels import cache_write, decode_attention, extend_attention
from kvpilot.kernels.cache_write import write_kv_cache
from kvpilot.kernels.decode_attention import paged_decode_attention
from kvpilot.kernels.extend_attention import paged_extend_attention

NB, BS, KVH, H, D, S = 4, 16, 2, 4, 64, 3  # blocks, block size, kv heads, heads, head dim, seqs


def _write_args(**over):
    args = dict(
        key=torch.zeros(5, KVH, D), value=torch.zeros(5, KVH, D),
        k_cache=torch.zeros(NB, BS, KVH, D), v_cache=torch.zeros(NB, BS, KVH, D),
        slot_mapping=torch.arange(5),
    )
    return {**args, **over}


def _decode_args(**over):
    args = dict(
        q=torch.zeros(S, H, D), k_cache=torch.zeros(NB, BS, KVH, D),
        v_cache=torch.zeros(NB, BS, KVH, D), block_tables=torch.zeros(S, 2, dtype=torch.int32),
        seq_lens=torch.ones(S, dtype=torch.int32), scale=0.125,
    )
    return {**args, **over}


def _extend_args(**over):
    args = dict(
        q=torch.zeros(7, H, D), k_cache=torch.zeros(NB, BS, KVH, D),
        v_cache=torch.zeros(NB, BS, KVH, D), block_tables=torch.zeros(S, 2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3, 7], dtype=torch.int32),
        seq_lens=torch.tensor([2, 1, 4], dtype=torch.int32), scale=0.125,
    )
    return {**args, **over}


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


WRITE_CASES = {
    "key heads": (dict(key=torch.zeros(5, 3, D)), "key has shape [5, 3, 64]"),
    "value tokens": (dict(value=torch.zeros(4, KVH, D)), "value has shape"),
    "slot count": (dict(slot_mapping=torch.arange(4)), "slot_mapping has shape [4]"),
    "slot dtype": (dict(slot_mapping=torch.arange(5.0)), "slot_mapping has dtype float32"),
    "key dtype": (dict(key=torch.zeros(5, KVH, D, dtype=torch.int32)), "key has dtype int32"),
    "cache rank": (dict(k_cache=torch.zeros(NB * BS, KVH, D)), "k_cache has shape"),
    "cache pair": (dict(v_cache=torch.zeros(NB, BS, KVH, D, dtype=torch.float16)), "dtypes must match"),
    "cache shape": (dict(v_cache=torch.zeros(NB + 1, BS, KVH, D)), "v_cache has shape"),
    "cache strides": (dict(v_cache=torch.zeros(NB, BS, D, KVH).transpose(2, 3)), "same strides"),
    "empty cache": (dict(k_cache=torch.zeros(0, BS, KVH, D), v_cache=torch.zeros(0, BS, KVH, D)),
                    "empty dimension"),
    "device": (dict(key=_meta(5, KVH, D), value=_meta(5, KVH, D), k_cache=_meta(NB, BS, KVH, D),
                    v_cache=_meta(NB, BS, KVH, D), slot_mapping=_meta(5, dtype=torch.int64)),
               "needs CUDA"),
    "mixed devices": (dict(key=_meta(5, KVH, D)), "one device"),
}

DECODE_CASES = {
    "q head_dim": (dict(q=torch.zeros(S, H, 32)), "q has shape [3, 4, 32]"),
    "q rank": (dict(q=torch.zeros(S, H * D)), "q has shape"),
    "heads not a multiple": (dict(q=torch.zeros(S, 3, D)), "num_heads 3 is not a multiple"),
    "q dtype vs cache": (dict(q=torch.zeros(S, H, D, dtype=torch.bfloat16)), "dtypes must match"),
    "q integer": (dict(q=torch.zeros(S, H, D, dtype=torch.int64)), "q has dtype int64"),
    "table rows": (dict(block_tables=torch.zeros(S + 1, 2, dtype=torch.int32)), "block_tables has shape"),
    "table dtype": (dict(block_tables=torch.zeros(S, 2)), "block_tables has dtype float32"),
    "seq_lens count": (dict(seq_lens=torch.ones(S - 1, dtype=torch.int32)), "seq_lens has shape"),
    "seq_lens dtype": (dict(seq_lens=torch.ones(S, dtype=torch.int16)), "seq_lens has dtype int16"),
    "head_dim too big": (dict(q=torch.zeros(S, H, 512), k_cache=torch.zeros(NB, BS, KVH, 512),
                              v_cache=torch.zeros(NB, BS, KVH, 512)), "head_dim 512 exceeds"),
    "out shape": (dict(out=torch.zeros(S, H, D + 1)), "out has shape"),
    "out dtype": (dict(out=torch.zeros(S, H, D, dtype=torch.float16)), "dtypes must match"),
    "splits": (dict(num_kv_splits=0), "num_kv_splits must be in [1, 256]"),
    "mixed devices": (dict(seq_lens=_meta(S, dtype=torch.int32)), "one device"),
}

EXTEND_CASES = {
    "q head_dim": (dict(q=torch.zeros(7, H, 80)), "q has shape [7, 4, 80]"),
    "heads not a multiple": (dict(q=torch.zeros(7, 5, D)), "num_heads 5 is not a multiple"),
    "q dtype vs cache": (dict(q=torch.zeros(7, H, D, dtype=torch.float16)), "dtypes must match"),
    "start_loc count": (dict(query_start_loc=torch.tensor([0, 2, 7], dtype=torch.int32)),
                        "query_start_loc has shape [3], expected [num_seqs + 1] = [4]"),
    "start_loc dtype": (dict(query_start_loc=torch.tensor([0.0, 2, 3, 7])), "query_start_loc has dtype"),
    "table rows": (dict(block_tables=torch.zeros(S - 1, 2, dtype=torch.int32)), "block_tables has shape"),
    "seq_lens rank": (dict(seq_lens=torch.ones(S, 1, dtype=torch.int32)), "seq_lens has shape"),
    "out shape": (dict(out=torch.zeros(6, H, D)), "out has shape"),
    "cache dtype": (dict(k_cache=torch.zeros(NB, BS, KVH, D, dtype=torch.float64),
                         v_cache=torch.zeros(NB, BS, KVH, D, dtype=torch.float64)), "k_cache has dtype float64"),
    "mixed devices": (dict(q=_meta(7, H, D)), "one device"),
}


@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_write_kv_cache_rejects(case):
    over, message = WRITE_CASES[case]
    with pytest.raises(ValueError, match=r"^write_kv_cache: .*" + re.escape(message)):
        write_kv_cache(**_write_args(**over))


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_paged_decode_attention_rejects(case):
    over, message = DECODE_CASES[case]
    with pytest.raises(ValueError, match=r"^paged_decode_attention: .*" + re.escape(message)):
        paged_decode_attention(**_decode_args(**over))


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_paged_extend_attention_rejects(case):
    over, message = EXTEND_CASES[case]
    with pytest.raises(ValueError, match=r"^paged_extend_attention: .*" + re.escape(message)):
        paged_extend_attention(**_extend_args(**over))


def test_cpu_tensors_are_refused_when_not_interpreting(monkeypatch):
    # Compiled (not interpreted) kernels need CUDA; the message says how to run on a CPU.
    for module in (cache_write, decode_attention, extend_attention):
        monkeypatch.setattr(module, "is_interpreted", lambda kernel: False)
    hint = "needs CUDA (or set TRITON_INTERPRET=1"
    with pytest.raises(ValueError, match=re.escape(hint)):
        write_kv_cache(**_write_args())
    with pytest.raises(ValueError, match=re.escape(hint)):
        paged_decode_attention(**_decode_args())
    with pytest.raises(ValueError, match=re.escape(hint)):
        paged_extend_attention(**_extend_args())
