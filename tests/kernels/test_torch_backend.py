"""The engine's pure-PyTorch attention backend (the CPU path) against the float64 paged
reference: decode length buckets (tight, split by the workspace cap, unsorted rows) and
extend chunks, plus the bucket planner's own guarantees."""

import random

import pytest
import torch
from paged_cases import DTYPES, HEADS, assert_close_to_ref, make_paged_batch

from kvpilot.engine.attention import torch_backend
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend, plan_decode_buckets
from kvpilot.kernels.reference import paged_extend_attention_ref, write_kv_cache_ref


def _meta(batch, num_decodes) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables, num_decodes=num_decodes,
        query_start_loc_cpu=batch.query_start_loc.tolist(), query_lens_cpu=batch.query_lens_list,
        seq_lens_cpu=batch.seq_lens_list,
    )


def _run(batch, num_decodes, backend=None):
    """The backend's output, on caches whose unused slots hold finite garbage (the
    engine's contract: blocks are zeroed at first use), and the float64 reference."""
    scale = batch.query.shape[-1] ** -0.5
    k_ref, v_ref = batch.k_cache.double(), batch.v_cache.double()
    write_kv_cache_ref(batch.key.double(), batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_extend_attention_ref(batch.query.double(), k_ref, v_ref, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, scale)
    k, v = (torch.where(c.isnan(), 100 * torch.randn_like(c), c) for c in (batch.k_cache, batch.v_cache))
    meta = _meta(batch, num_decodes)
    out = (backend or TorchAttentionBackend()).forward(batch.query, batch.key, batch.value, k, v, meta, scale)
    return out, ref, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("order", ["longest-first", "shuffled"])
def test_decode_buckets_and_extends_match_reference(dtype, order, seed, monkeypatch):
    rng = random.Random(seed)
    bs = 16
    lens = [rng.choice([1, 2, bs, bs + 1, 3 * bs, rng.randint(1, 300)]) for _ in range(24)]
    lens.sort(reverse=True)
    if order == "shuffled":
        rng.shuffle(lens)
    extends = [(0, 5), (bs, 7), (3, bs + 3)]  # fresh prefill, extend after a block, ragged
    seq_lens = lens + [c + q for c, q in extends]
    query_lens = [1] * len(lens) + [q for _, q in extends]
    batch = make_paged_batch(seq_lens, query_lens, *HEADS["gqa"], 64, bs, dtype)
    # A small workspace cap forces buckets to split even when their lengths are close.
    monkeypatch.setattr(torch_backend, "WORKSPACE_BYTES", 6 * batch.k_cache[0].numel() * batch.k_cache.element_size())
    out, ref, meta = _run(batch, num_decodes=len(lens), backend=TorchAttentionBackend(use_cpu_kernel=False))
    decodes, _ = meta.backend_state[torch_backend._PLAN_KEY]
    assert len(decodes) > 1
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close_to_ref(out, ref, dtype, seed)


def test_plan_is_built_once_per_step_and_reused_by_every_layer(seed):
    batch = make_paged_batch([40, 33, 2], [1, 1, 1], *HEADS["mha"], 32, 16, torch.float32)
    backend = TorchAttentionBackend()
    out, ref, meta = _run(batch, 3, backend)
    plan = meta.backend_state[torch_backend._PLAN_KEY]
    again = backend.forward(batch.query, batch.key, batch.value, batch.k_cache.nan_to_num(),
                            batch.v_cache.nan_to_num(), meta, 32**-0.5)
    assert meta.backend_state[torch_backend._PLAN_KEY] is plan
    assert_close_to_ref(out, ref, torch.float32, seed)
    assert_close_to_ref(again, ref, torch.float32, seed)


@pytest.mark.parametrize("trial", range(20))
def test_bucket_plan_covers_rows_in_order_within_padding_and_cap(trial):
    rng = random.Random(trial)
    bs, cap = 16, rng.choice([8, 64, 10_000])
    lens = [rng.randint(1, 2048) for _ in range(rng.randint(0, 200))]
    if trial % 2:
        lens.sort(reverse=True)
    buckets = plan_decode_buckets(lens, bs, cap)
    assert [b[0] for b in buckets] == [0] + [b[1] for b in buckets[:-1]]
    assert (buckets[-1][1] if buckets else 0) == len(lens)
    for s, e, nb in buckets:
        blocks = [-(-n // bs) for n in lens[s:e]]
        assert nb == max(blocks)
        rows = e - s
        assert rows == 1 or rows * nb <= cap
        assert rows == 1 or rows * nb <= max(64, 1.25 * sum(blocks))
    if trial % 2 and cap >= 10_000:
        # Sorted rows of similar lengths share buckets: far fewer buckets than rows.
        assert len(buckets) <= max(1, len(lens) // 4) + 12
