"""Continuous-batching scheduler with a per-step token budget, chunked prefill and
preemption (recompute or swap). Source: vLLM v1 `Scheduler` (num_computed_tokens catch-up),
vLLM v0 default policy for chunked prefill off, vLLM's performance guide for the warning."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvpilot.engine.core.block_manager import BlockManager
from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger("kvpilot.engine.core.scheduler")


@dataclass
class SchedulerOutput:
    """One step's work. `scheduled` lists (sequence, num_scheduled_tokens), decodes first.
    Block operations run before the forward pass, in the order zero, swap-out, swap-in,
    copy (a zeroed block is never a copy's source)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)  # first use since allocation
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens the step feeds the model: the sum of num_scheduled_tokens over `scheduled`
        (<= max_num_batched_tokens)."""
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Each step, gives every sequence tokens so that its num_computed_tokens catches up
    with its length: running sequences first, then swapped, then waiting ones; preempts the
    newest when KV blocks run out. Invariant: sum of num_scheduled_tokens <=
    max_num_batched_tokens; no request is admitted while len(running) >= max_num_seqs
    (after a live lowering of max_num_seqs, the excess finishes rather than being dropped)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._requests: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ queues
    def add_request(self, seq: Sequence) -> None:
        """Queues a new sequence at the tail of `waiting` (FCFS). Raises ValueError when its
        request_id is already in use by an unfinished request."""
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Removes the request wherever it is and frees its blocks at once."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or swapped (not yet finished or aborted)."""
        return bool(self._requests)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plans one engine step: how many tokens each sequence computes this step.

        Every sequence tries to catch up its num_computed_tokens with num_tokens (vLLM v1: no
        separate prefill and decode phases). A token budget of max_num_batched_tokens is spent
        in order; a sequence gets min(its uncomputed tokens, what is left of the budget).
        - Chunked prefill on: running decodes, then running prefill chunks, then swapped
          sequences (swap-in), then waiting ones (chunked to the budget); no sequence is
          admitted in a step that preempted, nor from `waiting` while any sequence is swapped.
        - Chunked prefill off (vLLM v0 policy): whole prompts from `waiting` if no sequence is
          swapped (a prompt that exceeds the remaining budget waits); a step with no prefill
          schedules the running decodes, then swap-ins.
        Admission stops when len(running) reaches max_num_seqs or the block manager has no room.
        When a running sequence cannot get KV slots, the newest running sequence is preempted
        (swapped to host if preemption_mode is 'swap' and there is swap space, else its blocks
        are freed, num_computed_tokens reset to 0 and it goes back to the head of `waiting`)
        until the slots fit or the sequence itself was the victim; a victim's tokens already
        scheduled this step return to the budget.

        Returns a SchedulerOutput: `scheduled` as (sequence, num_scheduled_tokens), decodes
        first; the block swaps, copy-on-write copies and fresh blocks to zero before the forward
        pass; and the sequences preempted. Invariant (asserted): the sum of
        num_scheduled_tokens <= max_num_batched_tokens. Call `update_from_output` after the step."""
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        self._scheduled: dict[str, int] = {}
        if self.config.enable_chunked_prefill:
            self._schedule_running(out, decodes=True)
            self._schedule_running(out, decodes=False)
            if not out.preempted:
                self._schedule_swapped(out)
            if not out.preempted and not self.swapped:
                self._schedule_waiting(out, chunk=True)
        else:
            if not self.swapped:
                self._schedule_waiting(out, chunk=False)
            if not self._scheduled:  # no prefill this step: a decode step
                self._schedule_running(out, decodes=True)
                if not out.preempted:
                    self._schedule_swapped(out)
        by_id = self._requests
        decodes = [(by_id[r], n) for r, n in self._scheduled.items() if not by_id[r].is_prefill]
        prefills = [(by_id[r], n) for r, n in self._scheduled.items() if by_id[r].is_prefill]
        out.scheduled = decodes + prefills
        out.blocks_to_copy = self.block_manager.pending_copies
        self.block_manager.pending_copies = []
        out.blocks_to_zero = self.block_manager.fresh_blocks
        self.block_manager.fresh_blocks = []
        assert self._budget >= 0 and out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, decodes: bool) -> None:
        for seq in list(self.running):
            if self._budget <= 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in self._scheduled:
                continue
            if seq.is_prefill == decodes:  # decodes pass takes decodes only, and vice versa
                continue
            num_new = min(seq.num_uncomputed_tokens, self._budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._scheduled[seq.request_id] = num_new
                self._budget -= num_new

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.swapped and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, self._budget)
            extra = bm.blocks_needed(seq.num_computed_tokens + num_new) - len(bm.swap_tables[seq.request_id])
            if len(bm.swap_tables[seq.request_id]) + max(extra, 0) > bm.num_free_blocks:
                return
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(seq))
            allocated = bm.allocate_slots(seq, num_new)
            assert allocated, "free blocks were checked above"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._scheduled[seq.request_id] = num_new
            self._budget -= num_new

    def _schedule_waiting(self, out: SchedulerOutput, chunk: bool) -> None:
        bm = self.block_manager
        while self.waiting and self._budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            computed = bm.get_computed_blocks(seq)
            num_new = seq.num_tokens - seq.num_computed_tokens - len(computed) * bm.block_size
            if chunk:
                num_new = min(num_new, self._budget)
            elif num_new > self._budget:
                return
            if not bm.allocate_slots(seq, num_new, computed):
                return
            if not seq.skip_reading_prefix_cache:  # vLLM counts no lookup it skipped
                bm.record_prefix_lookup(seq.num_tokens, len(computed) * bm.block_size)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._scheduled[seq.request_id] = num_new
            self._budget -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._budget += self._scheduled.pop(seq.request_id, 0)
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            out.blocks_to_swap_out.extend(bm.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            mode = "SWAP"
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            mode = "RECOMPUTE"
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        logger.warning(
            "Request %s is preempted by PreemptionMode.%s mode because there is not enough KV "
            "cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size/pipeline_parallel_size to provide "
            "more KV cache memory, or decrease max_num_seqs or max_num_batched_tokens. "
            "total_num_cumulative_preemption=%d",
            seq.request_id, mode, self.num_preemptions,
        )

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, tuple[int, dict[int, float] | None]]
    ) -> list[Sequence]:
        """Commits the step: advances num_computed_tokens, registers full blocks in the
        prefix cache, appends each sampled token (and its logprobs) and finishes requests
        that hit EOS, a stop token, max_tokens or max_model_len. Returns the sequences
        that received a token this step."""
        updated = []
        for seq, num_tokens in out.scheduled:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted during the step
            seq.num_computed_tokens += num_tokens
            self.block_manager.cache_full_blocks(seq)
            result = sampled.get(seq.request_id)
            if result is None or seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            token_id, logprobs = result
            seq.output_token_ids.append(token_id)
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            updated.append(seq)
            status = self._check_stop(seq, token_id)
            if status is not None:
                self._finish(seq, status)
        return updated

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in seq.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish_request(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends a request for a reason found outside the scheduler (a stop string)."""
        if not seq.is_finished:
            self._finish(seq, status)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        seq.status = status
        self.block_manager.release(seq)
        self._requests.pop(seq.request_id, None)
