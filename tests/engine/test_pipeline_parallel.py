"""Pipeline parallelism on CPU (gloo): stages with their own layers and KV cache, alone and
with tensor parallelism inside each stage, give the same greedy tokens as one process; a
rank killed mid-step ends the engine with an error naming it within seconds."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpilot.engine import SamplingParams
from kvpilot.engine.distributed import parallel_state

from tiny_llama import generate_and_close, save_tiny_llama, smollm2_llm, tiny_llm, tiny_prompts

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama5(tmp_path_factory):
    """5 layers, so two stages split unevenly (3 + 2, vLLM's get_pp_indices)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-pp"), num_layers=5)


def test_tiny_llama_tp2_x_pp2_gives_the_same_greedy_tokens_as_one_process(tiny_llama5, monkeypatch):
    prompts = tiny_prompts()
    expected = generate_and_close(tiny_llm(tiny_llama5), prompts, GREEDY)
    monkeypatch.setenv("KVPILOT_PP_MIN_MICRO_BATCH_TOKENS", "1")  # cut even these small steps in 2
    llm = tiny_llm(tiny_llama5, tp=2, pp=2)
    # the driver holds stage 0's 3 layers, with half of the 2 KV heads
    assert len(llm.engine.runner.kv_caches) == 3 and llm.engine.runner.kv_caches[0][0].shape[2] == 1
    assert generate_and_close(llm, prompts, GREEDY) == expected
    assert (parallel_state.get_tp_size(), parallel_state.get_pp_size()) == (1, 1)  # close() reset it


def test_smollm2_pp2_gives_the_same_greedy_tokens_as_one_process(model_path, chat_prompts, monkeypatch):
    prompts = chat_prompts[:3]  # 63 + 47 + 92 prompt tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the prefill step is cut into 2 micro-batches that overlap; the 3-token decodes are not
    monkeypatch.setenv("KVPILOT_PP_MIN_MICRO_BATCH_TOKENS", "64")

    def run(pp: int) -> list[list[int]]:
        return generate_and_close(smollm2_llm(model_path, pp=pp), prompts, params)

    assert run(2) == run(1)


def test_more_stages_than_layers_is_refused_at_startup(tiny_llama5):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 6 exceeds the model's 5 layers"):
        tiny_llm(tiny_llama5, pp=6)


def test_a_middle_stage_killed_during_a_step_is_named_within_seconds(tiny_llama5, monkeypatch):
    """Three stages; rank 1 (the middle) dies while the driver is in the step. The last
    stage's receive fails and it stops too, but the error names the rank that was killed."""
    llm = tiny_llm(tiny_llama5, pp=3)
    executor = llm.engine.runner
    original = executor.runner.execute
    middle = executor.workers[0]

    def execute_after_kill(out, sample=True):
        os.kill(middle.pid, signal.SIGKILL)  # every rank has the step's inputs by now
        time.sleep(0.2)
        return original(out, sample)

    try:
        assert len(llm.generate(tiny_prompts()[:1], GREEDY)[0].outputs[0].token_ids) == 12
        monkeypatch.setattr(executor.runner, "execute", execute_after_kill)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 0, pipeline stage 1, pid \d+\) died"):
            llm.generate(tiny_prompts()[:1], GREEDY)
        assert time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="rank 1"):  # stays failed, no hang
            llm.engine.step()
    finally:
        llm.engine.close()
    assert not any(p.is_alive() for p in executor.workers)
