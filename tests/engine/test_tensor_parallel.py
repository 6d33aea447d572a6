"""Tensor parallelism on CPU (gloo): the sharded engine gives the same greedy tokens as
one process, a size that does not divide the heads is refused at startup, and a dead rank
ends the engine with an error naming it within seconds."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.distributed import parallel_state

from tiny_llama import generate_and_close, save_tiny_llama, smollm2_llm, tiny_llm, tiny_prompts

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer GQA Llama (4 heads over 2 KV heads, head_dim 32) with random weights."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"), num_layers=2)


def test_tiny_llama_tp2_gives_the_same_greedy_tokens_as_one_process(tiny_llama):
    prompts = tiny_prompts()
    expected = generate_and_close(tiny_llm(tiny_llama, 1), prompts, GREEDY)
    actual = generate_and_close(tiny_llm(tiny_llama, 2), prompts, GREEDY)
    assert actual == expected
    assert parallel_state.get_tp_size() == 1  # close() restored the single-rank state


def test_smollm2_tp3_gives_the_same_greedy_tokens_as_one_process(model_path, chat_prompts):
    prompts = chat_prompts[:3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(tp: int) -> list[list[int]]:
        return generate_and_close(smollm2_llm(model_path, tp=tp), prompts, params)

    assert run(3) == run(1)


def test_tp2_on_smollm2_is_refused_at_startup_with_the_reason(model_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's 9 attention heads"):
        LLM(str(model_path), dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64)


def test_a_killed_worker_rank_ends_the_engine_with_an_error_naming_it(tiny_llama):
    llm = tiny_llm(tiny_llama, 2)
    try:
        assert len(llm.generate(tiny_prompts()[:1], GREEDY)[0].outputs[0].token_ids) == 16
        worker = llm.engine.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 1, pipeline stage 0, pid \d+\) died"):
            llm.generate(tiny_prompts()[:1], GREEDY)
        assert time.monotonic() - t0 < 5
        with pytest.raises(RuntimeError, match="rank 1"):  # stays failed, no hang
            llm.engine.step()
    finally:
        llm.engine.close()
    assert parallel_state.get_tp_size() == 1


def test_a_worker_killed_during_a_step_is_reported_within_seconds(tiny_llama, monkeypatch):
    """The kill lands while the driver waits in a collective: gloo sees the connection
    drop and the driver maps the failure to the dead rank instead of hanging."""
    llm = tiny_llm(tiny_llama, 2)
    runner = llm.engine.runner
    original = runner.runner.execute
    worker = runner.workers[0]

    def execute_after_kill(out, sample=True):
        os.kill(worker.pid, signal.SIGKILL)  # the worker has the step's inputs by now
        time.sleep(0.2)
        return original(out, sample)

    try:
        monkeypatch.setattr(runner.runner, "execute", execute_after_kill)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 1"):
            llm.generate(tiny_prompts()[:1], GREEDY)
        assert time.monotonic() - t0 < 10
    finally:
        llm.engine.close()
