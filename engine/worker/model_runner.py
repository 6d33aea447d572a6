"""Runs the model for one scheduled step: block copies, flattened inputs, forward pass,
logits for the sequences that completed their tokens (and for the prompt positions of those
that asked for prompt logprobs: engine/sample/prompt_logprobs.py), sampling.

Input layout (vLLM v1): the scheduled sequences' new tokens one after another, decodes
first. `slot_mapping[i] = block_table[pos // block_size] * block_size + pos % block_size`
for the i-th token at position `pos` of its sequence.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.attention import AttentionMetadata, get_attn_backend
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu import malloc_policy, zero_pages
from kvpilot.engine.cpu.thread_adapter import adapter_from_env
from kvpilot.engine.layers.gguf_quant import maybe_quantize
from kvpilot.engine.layers.linear import pack_weights_for_cpu
from kvpilot.engine.memory import PeakMemoryProbe, estimate_activation_bytes
from kvpilot.engine.model_loader import iter_weights
from kvpilot.engine.models import cpu_decode_stack
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.sample.prompt_logprobs import PromptLogprobsChunk, PromptRows
from kvpilot.engine.sample.sampler import Sampler
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.core.sequence import Sequence
from kvpilot.engine.worker import block_ops
from kvpilot.engine.worker.step_input import StepBatch

logger = logging.getLogger("kvpilot.engine.worker.model_runner")

SampleResult = tuple[int, dict[int, float] | None]


def check_step_layout(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
    """Checks, once per step where it is prepared, the layout the attention backends and the C
    decode stack (models/cpu_decode_stack.py) read without checking again: input_ids, positions
    and slot_mapping [num_tokens] int64; seq_lens [num_seqs] int32; query_start_loc
    [num_seqs + 1] int32; block_tables [num_seqs, max_num_blocks_per_seq] int32; all contiguous.
    Raises ValueError naming the tensor that is not."""
    n, s = input_ids.shape[0], meta.num_seqs
    for name, t, dtype, shape in (
            ("input_ids", input_ids, torch.int64, (n,)), ("positions", positions, torch.int64, (n,)),
            ("slot_mapping", meta.slot_mapping, torch.int64, (n,)), ("seq_lens", meta.seq_lens, torch.int32, (s,)),
            ("query_start_loc", meta.query_start_loc, torch.int32, (s + 1,)),
            ("block_tables", meta.block_tables, torch.int32, (s, meta.block_tables.shape[-1]))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"step input {name}: {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' strided'}, want contiguous "
                             f"{str(dtype).removeprefix('torch.')} {shape}")


class ModelRunner:
    """One rank's model and paged KV cache: loads the weights, allocates the caches, runs
    steps (`execute`) and samples (vLLM v1 `GPUModelRunner`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(config.model, get_attn_backend(config.attention_backend))
        self.model.load_weights(iter_weights(Path(config.model_path)))
        self.model.eval()
        self.packed_weights_bytes = pack_weights_for_cpu(self.model) if self.device.type == "cpu" else 0
        self.packed_weights_bytes += maybe_quantize(self.model, config.quantization, config.quantized_weights_path,
                                                    self.device, self.dtype)
        if self.device.type == "cpu":
            cpu_decode_stack.apply(self.model)
            malloc_policy.apply()  # reuse freed activation memory (engine/cpu/malloc_policy.py)
        # decode steps' team size from their measured times (engine/cpu/thread_adapter.py)
        self.thread_adapter = adapter_from_env(torch.get_num_threads()) if self.device.type == "cpu" else None
        self._threads_set = torch.get_num_threads()
        self.sampler = Sampler(config.seed)
        self.prompt_logprobs: dict[str, PromptLogprobsChunk] = {}  # this step's, on the driver
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._zero_fresh_blocks = self.device.type != "cpu"  # a CPU pool is zero pages (_allocate)
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters plus CPU-packed and GGUF copies of its weights."""
        plain = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return plain + self.packed_weights_bytes

    def _allocate(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.config.model
        shape = (num_blocks, self.block_size, cfg.num_kv_heads // parallel_state.get_tp_size(), cfg.head_dim)
        layers = range(self.model.start_layer, self.model.end_layer)
        if device.type == "cpu" and self.device.type == "cpu":  # zero and untouched (engine/cpu/zero_pages.py)
            return [(zero_pages.zeroed(shape, self.dtype), zero_pages.zeroed(shape, self.dtype)) for _ in layers]
        pin = device.type == "cpu" and self.device.type == "cuda"
        return [
            (torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin),
             torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin))
            for _ in layers
        ]

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocates the per-layer caches [num_blocks, block_size, num_kv_heads, head_dim]
        on the device and the swap space on the host. A CPU pool is zero pages from the start
        (engine/cpu/zero_pages.py); on a GPU block 0 is zeroed now (block-table padding points
        at it) and the others at their first use (SchedulerOutput.blocks_to_zero). Either way a
        large pool is never touched up front."""
        self.kv_caches = self._allocate(num_blocks, self.device)
        if self._zero_fresh_blocks:
            for k, v in self.kv_caches:
                k[0].zero_()
                v[0].zero_()
        self.swap_caches = self._allocate(num_swap_blocks, torch.device("cpu")) if num_swap_blocks else []

    def profile_peak_activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Runs a dummy step of max_num_batched_tokens prompt tokens over up to
        max_num_seqs sequences (with a temporary cache) and returns its peak extra memory.

        On CPU with a KV-cache space (VLLM_CPU_KVCACHE_SPACE) the cache size does not
        depend on the activation, which only bounds it under gpu_memory_utilization: there
        a full step (seconds to minutes of CPU for 2048 tokens) is replaced by
        `estimate_activation_bytes` and a one-sequence warm-up step, as vLLM's CPU worker
        sizes its cache from the space without profiling."""
        if self.device.type == "cpu" and self.config.cache.cpu_kvcache_space_bytes is not None:
            self._run_dummy_step(min(self.block_size, max_num_batched_tokens), 1, max_model_len)
            return estimate_activation_bytes(
                self.config.model, max_num_batched_tokens, max_num_seqs, parallel_state.get_tp_size(),
                with_logits=self.model.is_last_stage or (parallel_state.get_pp_rank() == 0 and parallel_state.get_tp_rank() == 0))
        with PeakMemoryProbe(self.device) as probe:
            self._run_dummy_step(max_num_batched_tokens, max_num_seqs, max_model_len)
        return probe.peak_bytes

    def _run_dummy_step(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """One step of max_num_batched_tokens prompt tokens over up to max_num_seqs
        sequences, with a temporary zeroed cache that is dropped afterwards."""
        num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
        lens = [max_num_batched_tokens // num_seqs] * num_seqs
        lens[-1] += max_num_batched_tokens - sum(lens)
        lens = [min(n, max_model_len) for n in lens]
        seqs, next_block = [], 0
        for i, n in enumerate(lens):
            seq = Sequence(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1))
            blocks = -(-n // self.block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            seqs.append((seq, n))
        self.kv_caches = self._allocate(next_block, self.device)
        if self._zero_fresh_blocks:  # a CPU pool is zero pages already
            self.kv_caches = [(k.zero_(), v.zero_()) for k, v in self.kv_caches]
        try:
            self.execute(SchedulerOutput(scheduled=seqs))
        finally:
            self.kv_caches = []
            for seq, _ in seqs:
                self.sampler.forget(seq.request_id)

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> dict[str, SampleResult]:
        """Runs one step. Returns {request_id: (token_id, logprobs)} for the sequences
        whose scheduled tokens reach their end (partial prefill chunks sample nothing).
        `sample=False` (tensor-parallel workers) still computes the logits, whose vocabulary
        all-gather every rank must join, but samples nothing and returns {}."""
        self._copy_blocks(out)
        if not out.scheduled:
            return {}
        adapter = self._adapter_for(out)
        if adapter is None:
            return self._run(out, sample)
        rows = len(out.scheduled)
        threads = adapter.threads_for(rows)
        if threads != self._threads_set:
            torch.set_num_threads(threads)
            self._threads_set = threads
        start = time.perf_counter()
        results = self._run(out, sample)
        adapter.record(rows, threads, time.perf_counter() - start)
        return results

    def _adapter_for(self, out: SchedulerOutput):
        """The thread adapter where this step is decode-only and the engine still owns the thread
        count; a count set by hand since the last step stops it (the engine's own count again
        for steps that do not adapt)."""
        adapter = self.thread_adapter
        if adapter is None:
            return None
        if torch.get_num_threads() != self._threads_set:
            logger.info("CPU threads: set to %d by hand; decode steps no longer adapt their thread count",
                        torch.get_num_threads())
            self.thread_adapter = None
            return None
        if all(n == 1 and not seq.is_prefill for seq, n in out.scheduled):
            return adapter
        allowed = adapter.allowed()
        if self._threads_set != allowed:
            torch.set_num_threads(allowed)
            self._threads_set = allowed
        return None

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobsChunk]:
        """The prompt logprobs the steps since the last call computed, by request id."""
        chunks, self.prompt_logprobs = self.prompt_logprobs, {}
        return chunks

    def _run(self, out: SchedulerOutput, sample: bool) -> dict[str, SampleResult]:
        batch = self._prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not len(batch.logits_idx):
            return {}
        logits = self.model.compute_logits(hidden[batch.logits_idx])
        if not sample:
            return {}
        return self._sample([(batch, logits)])

    def _sample(self, batches: list[tuple[StepBatch, torch.Tensor]]) -> dict[str, SampleResult]:
        """Samples the sequences of `batches` (each with its logits [len(logits_idx), vocab])
        at once, after recording their prompt logprobs."""
        parts = []
        for batch, logits in batches:
            n = len(batch.sample_seqs)
            if batch.prompt_rows:
                self.prompt_logprobs.update(batch.prompt_rows.compute(logits[n:]))
            parts.append(logits[:n])
        seqs = [s for batch, _ in batches for s in batch.sample_seqs]
        if not seqs:
            return {}
        results = self.sampler(torch.cat(parts) if len(parts) > 1 else parts[0],
                               [s.request_id for s in seqs], [s.sampling_params for s in seqs])
        return {s.request_id: r for s, r in zip(seqs, results)}

    def _prepare(self, out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows = PromptRows()
        # Decodes first, longest first, so that attention backends can batch decodes of
        # similar lengths together (any order is correct; the results are keyed by id).
        decodes = [(s, n) for s, n in out.scheduled if n == 1 and not s.is_prefill]
        decodes.sort(key=lambda item: -item[0].num_computed_tokens)
        scheduled = decodes + [(s, n) for s, n in out.scheduled if n != 1 or s.is_prefill]
        num_decodes = len(decodes)
        max_blocks = max(len(s.block_table) for s, _ in scheduled)
        tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            end = start + n
            table = np.asarray(seq.block_table, dtype=np.int64)
            tables[i, : len(table)] = table
            ids.extend(seq.token_ids_range(start, end))
            pos = np.arange(start, end, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
            if seq.sampling_params.prompt_logprobs is not None:
                prompt_rows.add(seq, start, end, query_start[-1])
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_idx.append(query_start[-1] - 1)
                sample_seqs.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks)).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            num_decodes=num_decodes,
            query_start_loc_cpu=query_start,
            query_lens_cpu=[b - a for a, b in zip(query_start, query_start[1:])],
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_chunks)).to(dev)
        check_step_layout(input_ids, positions, meta)
        logits_idx = torch.tensor(sample_idx + prompt_rows.row_index, dtype=torch.int64, device=dev)
        return StepBatch(input_ids, positions, meta, logits_idx, sample_seqs, prompt_rows)

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """The step's block operations (engine/worker/block_ops.py) on this runner's caches; fresh
        blocks are zeroed only where the pool is not zero pages (not on CPU)."""
        block_ops.apply(out, self.kv_caches, self.swap_caches, zero_fresh=self._zero_fresh_blocks)
