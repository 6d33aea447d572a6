"""The C paged decode-attention kernel for CPU (engine/attention/cpu_decode.py) against the
float64 paged reference, its use by the torch backend in float32, and the fallback to the
torch buckets where it cannot be built."""

import random

import pytest
import torch
from paged_cases import HEADS, assert_close_to_ref, make_paged_batch

from kvpilot.engine.attention import torch_backend
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref, write_kv_cache_ref


@pytest.fixture
def kernel():
    if cpu_decode.load() is None:
        pytest.fail("the CPU decode kernel did not build here (a C compiler is part of `make install`)")
    return cpu_decode


def _decode_batch(seq_lens, heads, head_dim, block_size):
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), *heads, head_dim, block_size, torch.float32)
    batch.write_new_tokens()
    return batch


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (80, 1), (32, 5)])
@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "split-over-threads"])
def test_kernel_matches_reference_on_ragged_lengths(kernel, heads, head_dim, block_size, split, seed, monkeypatch):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, block_size, block_size + 1, rng.randint(1, 200)]) for _ in range(9)]
    batch = _decode_batch(lens, heads, head_dim, block_size)
    if split:  # every size takes a parallel region of 3 OpenMP threads, rows shared out dynamically
        monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_WORK", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, scale)
    out = torch.full_like(batch.query, float("nan"))
    # The cache's unused slots are NaN: a read past a sequence's end or through padding shows.
    kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, scale, out)
    assert_close_to_ref(out, ref, torch.float32, seed)


def test_kernel_reads_strided_query_rows(kernel, seed):
    batch = _decode_batch([17, 3, 40], HEADS["gqa"], 64, 16)
    wide = torch.randn(3, 10, 64)
    wide[:, :6] = batch.query  # q as a view into a fused qkv tensor, as the model passes it
    ref = paged_decode_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, 0.125)
    out = torch.empty(3, 6, 64)
    kernel.paged_decode_attention(wide[:, :6], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  0.125, out)
    assert_close_to_ref(out, ref, torch.float32, seed)


def test_kernel_refuses_other_dtypes_and_mismatched_shapes(kernel):
    batch = _decode_batch([5], HEADS["mha"], 32, 4)
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        kernel.paged_decode_attention(batch.query.bfloat16(), batch.k_cache, batch.v_cache, batch.block_tables,
                                      batch.seq_lens, 1.0, torch.empty_like(batch.query))
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables.long(),
                                      batch.seq_lens, 1.0, torch.empty_like(batch.query))


def _mixed_step(seed):
    """Decodes plus a fresh prefill and an extend, the backend's output and the reference."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 120) for _ in range(6)]
    extends = [(0, 5), (20, 3)]
    batch = make_paged_batch(lens + [c + q for c, q in extends], [1] * 6 + [q for _, q in extends],
                             *HEADS["gqa"], 64, 16, torch.float32)
    k_ref, v_ref = batch.k_cache.double(), batch.v_cache.double()
    write_kv_cache_ref(batch.key.double(), batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_extend_attention_ref(batch.query.double(), k_ref, v_ref, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, 0.125)
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, num_decodes=6, query_start_loc_cpu=batch.query_start_loc.tolist(),
        query_lens_cpu=batch.query_lens_list, seq_lens_cpu=batch.seq_lens_list)
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, batch.k_cache.nan_to_num(),
                                          batch.v_cache.nan_to_num(), meta, 0.125)
    decodes, _ = meta.backend_state[torch_backend._PLAN_KEY]
    return out, ref, decodes


def test_backend_runs_float32_decodes_fused_beside_extends(kernel, seed):
    out, ref, decodes = _mixed_step(seed)
    assert [g.block_ids for g in decodes] == [None]  # one fused call, no gather
    assert_close_to_ref(out, ref, torch.float32, seed)


def test_loading_the_kernel_keeps_the_process_ieee_subnormals(kernel):
    """Loading the library must not change the process's floating-point state. GCC links
    crtfastmath.o into a shared object linked with -ffast-math; its constructor sets the
    MXCSR FTZ/DAZ bits (GCC manual, -ffast-math: "...may link startup files that change the
    default FPU control word"), after which every float op in the server flushes subnormals
    (hypothesis refuses to run, numpy gives 0 for 5e-324 * 1.0). Checked in a fresh process
    because the kernel is loaded once per process; every library of every variant this CPU runs."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from kvpilot.kernels.cpu import build, loader\n"
            "for v in loader.variants_runnable():\n"
            "    for name in build.LIBRARIES: loader.load(name, v)\n"
            "tiny = float.fromhex('0x0.0000000000001p-1022')\n"
            "sys.exit(0 if tiny * 1.0 > 0.0 else 3)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"subnormals flushed after loading the kernel (rc {run.returncode}): {run.stderr[-800:]}"


def test_kernel_runs_on_torchs_openmp_runtime(kernel):
    """The library is built with -fopenmp and its DT_NEEDED libgomp.so.1 resolves, by soname,
    to the runtime torch already loaded (ld.so reuses a loaded object of the same soname):
    one OpenMP runtime in the process, so the attention's parallel region reuses the threads
    of torch's matmuls instead of a second team spinning beside them."""
    from pathlib import Path

    assert b"GOMP_parallel" in Path(kernel.load()._name).read_bytes()  # the OpenMP build won
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(runtimes) == 1, runtimes
    assert Path(torch.__file__).parent in Path(runtimes.pop()).parents


@pytest.mark.parametrize("lens", [[700], [700, 1, 129, 300]], ids=["one-sequence", "beside-short-ones"])
@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("threads", [2, 3])
def test_long_sequences_cut_into_parts_over_threads_match_reference(kernel, lens, block_size, threads, seed,
                                                                    monkeypatch):
    """With more threads than long sequences, each is cut into parts of >= 128 tokens (a multiple
    of block_size) attended on different threads and merged by their maxima and sums
    (paged_attention_v2's reduce): one 700-token sequence beside short ones, lengths around part
    boundaries included; NaN in unused cache slots shows any read past a part or a sequence."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    batch = _decode_batch(lens, HEADS["gqa"], 64, block_size)
    assert cpu_decode.attention_threads(lens, 2) == threads
    ref = paged_decode_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, 0.125)
    out = torch.full_like(batch.query, float("nan"))
    kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  0.125, out)
    assert_close_to_ref(out, ref, torch.float32, seed)
    # Skewed scores: a part whose maximum is far below another's must be weighted down, not lost.
    batch.query.mul_(40.0)
    ref = paged_decode_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, 0.125)
    kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  0.125, out)
    assert_close_to_ref(out, ref, torch.float32, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planned_width_not_the_running_team_decides_the_parts(kernel, dtype, seed):
    """The engine may run a decode step on fewer threads than it planned
    (engine/cpu/thread_adapter.py): with the planned width set, a long sequence is cut into the
    same parts and merged the same way on 1 thread as on 2, so the output is bit-identical;
    without it, the parts follow the running count and the last float32 bits differ."""
    from kvpilot.kernels.cpu import threads as cpu_threads

    batch = make_paged_batch([900, 37, 300], [1, 1, 1], *HEADS["gqa"], 64, 16, dtype)
    batch.write_new_tokens()

    def run(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        out = torch.empty_like(batch.query)
        kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                      batch.seq_lens, 0.125, out)
        return out

    saved = torch.get_num_threads()
    try:
        cpu_threads.set_partition_width(2)
        assert kernel.attention_threads([900, 37, 300], 3) == 2
        assert torch.equal(run(2), run(1))
        cpu_threads._width.clear()  # no plan: torch's count decides, one part per sequence on 1 thread
        if dtype == torch.float32:  # (bf16's rounding of the output can hide the difference)
            assert not torch.equal(run(2), run(1))
    finally:
        cpu_threads._width.clear()
        torch.set_num_threads(saved)
