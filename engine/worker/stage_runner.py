"""One rank of a tensor x pipeline parallel engine: a ModelRunner that holds its stage's
layers (and their KV cache) and runs a step as micro-batches passed along the pipeline.

Every rank gets the same step inputs (the executor broadcasts them) and computes the same
micro-batch split. Per micro-batch m:

    stage 0:       embed -> its layers -> send IntermediateTensors(m) to stage 1
    stage s:       recv(m) -> its layers -> send(m) to stage s+1
    last stage:    recv(m) -> its layers -> norm -> logits of m's rows to sample, then
                   of its rows with prompt logprobs (tp rank 0 sends them to the driver)
    driver (rank 0, stage 0, tp rank 0): after its sends, receives every m's logits,
                   records the prompt logprobs and samples once over all rows, in the
                   step's order, as one process does.

What overlaps: within a step that is large enough to cut (engine/distributed/pipeline.py,
MicroBatchPolicy: prefills and large batches), stage s computes micro-batch m+1 while
stage s+1 computes m (sends are asynchronous, so a stage goes on to m+1 at once), so
with M micro-batches and P stages the busy share of a stage is M / (M + P - 1). Small
steps (typical decode) run as one micro-batch: the stages take turns.

What does not overlap: consecutive steps. Step n+1 is scheduled only after step n's tokens are sampled, so the pipeline
drains at every step boundary, and the driver's scheduling, sampling and detokenizing run
while the other stages idle. vLLM overlaps steps with "virtual engines" (v0: pp
independent schedulers over disjoint requests) or asynchronous scheduling (v1); both change
the scheduler's semantics, which this engine keeps.
Source: vLLM `vllm/v1/worker/gpu_model_runner.py` (IntermediateTensors between ranks);
Huang et al., GPipe (2019) for the micro-batch schedule.
"""

from __future__ import annotations

import torch

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.memory import RankMemory
from kvpilot.engine.worker.model_runner import ModelRunner, SampleResult
from kvpilot.engine.distributed.parallel_layout import RankPosition, rank_kv_bytes_per_token
from kvpilot.engine.distributed.pipeline import MicroBatchPolicy, StageLink, split_micro_batches
from kvpilot.engine.core.scheduler import SchedulerOutput


class StageRunner(ModelRunner):
    """A ModelRunner for one rank of a multi-rank engine. `execute` returns the sampled
    tokens on the driver (rank 0) and {} elsewhere. micro_batching: how a step is cut
    (never with one stage)."""

    def __init__(self, config: EngineConfig, position: RankPosition, micro_batching: MicroBatchPolicy) -> None:
        super().__init__(config)
        self.position = position
        self.micro_batching = micro_batching if position.pp_size > 1 else MicroBatchPolicy(1)
        self.link = StageLink(
            None if position.is_first_stage else position.prev_rank,
            None if position.is_last_stage else position.next_rank,
            self.device,
        )
        self._last_stage_rank0 = (position.pp_size - 1) * position.tp_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, sample: bool = True) -> dict[str, SampleResult]:
        """Runs this rank's part of one step (see the module docstring). `sample` is
        accepted for ModelRunner's signature; only the driver samples."""
        self._copy_blocks(out)
        if not out.scheduled:
            return {}
        pos, model = self.position, self.model
        batches = [self._prepare(SchedulerOutput(scheduled=mb))
                   for mb in split_micro_batches(out.scheduled, self.micro_batching.count(out.scheduled))]
        local_logits = []
        try:
            for m, batch in enumerate(batches):
                intermediate = None
                if not pos.is_first_stage:
                    shapes = model.intermediate_shapes(len(batch.input_ids))
                    intermediate = self.link.recv_intermediate(shapes, m).wait()
                result = model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, intermediate)
                if not pos.is_last_stage:
                    self.link.send_intermediate(result, m)
                elif len(batch.logits_idx):
                    logits = model.compute_logits(result[batch.logits_idx])
                    if pos.sends_logits:
                        self.link.send_logits(logits, m)
                    else:
                        local_logits.append(logits)
            if pos.rank == 0 and not pos.is_last_stage:  # after the sends: NCCL runs p2p in issue order
                vocab = self.config.model.vocab_size
                pending = [self.link.recv_logits(self._last_stage_rank0, len(b.logits_idx), vocab, m)
                           for m, b in enumerate(batches) if len(b.logits_idx)]
                local_logits = [p.wait() for p in pending]
        finally:
            self.link.flush()
        if pos.rank != 0 or not local_logits:
            return {}
        return self._sample(list(zip([b for b in batches if len(b.logits_idx)], local_logits)))

    def memory_report(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> RankMemory:
        """Profiles a full step (every rank must call this together) and returns this
        rank's weights, peak activation and KV bytes per block."""
        activation = self.profile_peak_activation_bytes(max_num_batched_tokens, max_num_seqs, max_model_len)
        return rank_memory(self, self.position.rank, activation)


def rank_memory(runner: ModelRunner, rank: int, activation_bytes: int) -> RankMemory:
    """`runner`'s share of memory as a RankMemory (block bytes from its config)."""
    cfg = runner.config
    per_token = rank_kv_bytes_per_token(cfg.model, cfg.parallel, rank)
    return RankMemory(rank, runner.weights_bytes, activation_bytes, cfg.cache.block_size * per_token)
