"""Scheduler behaviour without a model: a fake step samples token 1 for every sequence
whose scheduled tokens reach its end."""

from __future__ import annotations

import logging

import pytest

from kvpilot.engine.core.block_manager import BlockManager
from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.core.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, swap_blocks=0, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 64)
    bm = BlockManager(num_blocks, block_size, swap_blocks)
    return Scheduler(SchedulerConfig(**cfg), bm)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    seq = Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add_request(seq)
    return seq


def step(s: Scheduler):
    out = s.schedule()
    sampled = {
        seq.request_id: (7, None)
        for seq, n in out.scheduled
        if seq.num_computed_tokens + n == seq.num_tokens
    }
    s.update_from_output(out, sampled)
    return out


def run_to_completion(s: Scheduler, max_steps=500):
    outs = []
    while s.has_unfinished_requests():
        outs.append(step(s))
        s.block_manager.check_invariants(s.running)
        assert len(outs) < max_steps
    return outs


def test_budget_invariant_holds_every_step():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    for i in range(10):
        add(s, f"r{i}", 5 + 3 * i)
    for out in run_to_completion(s):
        assert out.total_num_scheduled_tokens <= 16
        assert len(out.scheduled) <= 4


def test_chunked_prefill_schedules_decodes_first_then_chunks_the_last_prefill():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    a = add(s, "a", 6)
    step(s)  # a prefilled, now decoding
    b = add(s, "b", 20)
    out = step(s)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0  # a chunk samples nothing
    out = step(s)
    assert [(q.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = step(s)
    assert dict((q.request_id, n) for q, n in out.scheduled)["b"] == 2
    assert b.num_output_tokens == 1 and a.num_output_tokens == 4


def test_chunked_prefill_off_runs_whole_prompts_in_prefill_only_steps():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)
    a = add(s, "a", 6)
    step(s)
    add(s, "b", 30)
    out = step(s)  # prefills first: b's whole prompt, no decode for a
    assert [(q.request_id, n) for q, n in out.scheduled] == [("b", 30)]
    out = step(s)
    assert sorted(q.request_id for q, _ in out.scheduled) == ["a", "b"]
    assert a.num_output_tokens == 2


def test_chunked_prefill_off_refuses_budget_below_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* smaller than max_model_len"):
        SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, max_num_seqs=64)


def test_max_num_seqs_limits_running_requests():
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(5):
        add(s, f"r{i}", 3)
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempts_newest_when_blocks_run_out_and_every_request_finishes(mode, caplog):
    # 6 blocks of 4 tokens; three prompts of 7 tokens need 2 blocks each, then grow
    s = make_scheduler(num_blocks=6, block_size=4, swap_blocks=16, max_num_batched_tokens=32,
                       max_num_seqs=4, preemption_mode=mode)
    seqs = [add(s, f"r{i}", 7, max_tokens=6) for i in range(3)]
    caplog.set_level(logging.WARNING, "kvpilot.engine.core.scheduler")
    first_victim = None
    while s.has_unfinished_requests():
        out = step(s)
        if out.preempted and first_victim is None:
            first_victim = out.preempted[0]
        s.block_manager.check_invariants(s.running)
    assert first_victim is seqs[2], "the newest running request is preempted first"
    assert s.num_preemptions >= 1
    assert all(q.num_output_tokens == 6 for q in seqs)
    assert s.block_manager.num_free_blocks == 6
    expected = "SWAP" if mode == "swap" else "RECOMPUTE"
    msg = next(r.getMessage() for r in caplog.records if "preempted" in r.getMessage())
    assert f"PreemptionMode.{expected}" in msg and "total_num_cumulative_preemption=1" in msg
    assert "gpu_memory_utilization" in msg and "max_num_seqs" in msg


def test_recompute_preemption_resets_progress_and_requeues_at_head():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    a = add(s, "a", 7, max_tokens=10)
    b = add(s, "b", 7, max_tokens=10)
    c = add(s, "c", 3)
    step(s)  # a and b take all 4 blocks; c waits
    assert c.status is SequenceStatus.WAITING
    step(s)  # position 7 still fits in their second blocks
    assert b.status is SequenceStatus.RUNNING
    step(s)  # both need a third block: b (newest) is preempted
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert list(s.waiting)[0] is b, "a preempted request goes back to the head of the queue"
    assert b.num_output_tokens == 2  # its output so far is kept and recomputed


def test_abort_frees_blocks_immediately():
    s = make_scheduler()
    a = add(s, "a", 10)
    step(s)
    assert s.block_manager.num_free_blocks < 64
    s.abort_request("a")
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished_requests()


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    add(s, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "a", 3)
