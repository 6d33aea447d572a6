"""One request never takes the engine down (issue 30): an error in what runs for one request
(its setup, its logits processors, detokenizing it) ends that request alone with
finish_reason "error" and its KV blocks freed, while the batch it shared a step with
completes; an error in what the batch shares propagates out of `step()`. On the tiny
random Llama (fast) and on the real SmolLM2 tokenizer path for the seed regression."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import save_tiny_llama, tiny_llm, tiny_prompts

from kvpilot.engine import SamplingParams
from kvpilot.engine.outputs import RequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = tiny_llm(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-isolation"), num_layers=2))
    yield engine
    engine.engine.close()


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Adds every request, steps until none is left; the final output of each, by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_raising_logits_processor_ends_its_request_alone_and_frees_its_blocks(llm):
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    calls = []

    def bad(output_token_ids, logits):
        calls.append(len(output_token_ids))
        if len(output_token_ids) == 2:
            raise RuntimeError("processor bug")
        return logits

    prompts = tiny_prompts()
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    finals = run(engine, {"a": (prompts[0], good), "bad": (prompts[1], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[bad])), "c": (prompts[2], good)})
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "RuntimeError: processor bug" in finals["bad"].error
    assert calls == [0, 1, 2]  # it ran on each of its steps until it raised, then never again
    for request_id in ("a", "c"):
        assert finals[request_id].outputs[0].finish_reason == "length" and finals[request_id].error is None
        assert len(finals[request_id].outputs[0].token_ids) == 6
    assert engine.block_manager.num_free_blocks == free_before
    # the others' tokens are what they would have been without the failing neighbour
    alone = run(engine, {"a2": (prompts[0], good)})
    assert alone["a2"].outputs[0].token_ids == finals["a"].outputs[0].token_ids


def test_a_logits_processor_that_changes_the_row_steers_sampling(llm):
    def only_token_7(_, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[7] = 0.0
        return forced

    finals = run(llm.engine, {"x": (tiny_prompts()[0], SamplingParams(
        temperature=0.8, max_tokens=4, ignore_eos=True, logits_processors=[only_token_7]))})
    assert finals["x"].outputs[0].token_ids == [7, 7, 7, 7]


def test_a_failing_detokenizer_ends_its_request_alone(llm, monkeypatch):
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("text", tiny_prompts()[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                                  stop=["never-seen"]))
    engine.add_request("ids", tiny_prompts()[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))

    def broken(*_, **__):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    monkeypatch.setattr(engine._detok["text"], "add", broken)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["text"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in finals["text"].error
    assert finals["ids"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == free_before


def test_a_request_whose_setup_fails_is_refused_and_leaves_nothing_behind(llm, monkeypatch):
    engine = llm.engine
    waiting = len(engine.scheduler.waiting)

    def broken(*_, **__):
        raise OverflowError("Overflow when unpacking long long")

    monkeypatch.setattr(engine.runner.sampler, "add_request", broken)
    with pytest.raises(RequestError, match="could not be set up: OverflowError"):
        engine.add_request("r", tiny_prompts()[0], SamplingParams(seed=5))
    assert len(engine.scheduler.waiting) == waiting and "r" not in engine._prompts


def test_seeds_past_int64_are_refused_before_the_engine():
    with pytest.raises(ValueError, match="seed must be within int64"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_the_int64_seed_limits_draw_reproducibly(llm):
    prompt = tiny_prompts()[0]
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in (2**63 - 1, -(2**63))]
    first = run(llm.engine, {"hi": (prompt, params[0]), "lo": (prompt, params[1])})
    again = run(llm.engine, {"hi2": (prompt, params[0])})
    assert first["hi"].outputs[0].token_ids == again["hi2"].outputs[0].token_ids
    assert first["lo"].outputs[0].finish_reason == "length"


def test_an_error_in_the_shared_step_propagates(llm, monkeypatch):
    """The model step is shared by the batch: its failure is not one request's, and the
    caller (the server's engine loop) must learn of it."""
    engine = llm.engine

    def broken(*_, **__):
        raise RuntimeError("kernel fault")

    engine.add_request("z", tiny_prompts()[0], SamplingParams(max_tokens=2))
    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="kernel fault"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("z")


def test_the_server_loop_fails_one_stream_alone_and_dies_on_a_shared_error(llm, monkeypatch):
    """The server's engine loop (AsyncLLMEngine): a request's own error reaches only its
    stream (RequestError) and counts as vllm:request_success{finished_reason="error"}; an
    error in the shared step fails every stream with EngineDeadError and calls on_dead."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from kvpilot.engine.engine.async_engine import AsyncLLMEngine, EngineDeadError
    from kvpilot.engine.metrics.engine_metrics import EngineMetrics

    engine = llm.engine
    registry = CollectorRegistry()
    bm = engine.block_manager
    free_before = bm.num_free_blocks

    def bad(*_):
        raise ValueError("processor bug")

    async def collect(loop_engine, request_id, prompt, params):
        try:
            return [o async for o in loop_engine.generate(request_id, prompt, params)][-1]
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            return exc

    async def scenario():
        loop_engine = AsyncLLMEngine(engine, EngineMetrics(engine.config, bm.num_blocks, bm.num_swap_blocks,
                                                           registry=registry), log_stats=False)
        died = asyncio.get_running_loop().create_future()
        loop_engine.on_dead = died.set_result
        loop_engine.start(asyncio.get_running_loop())
        prompts, good = tiny_prompts(), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outcomes = await asyncio.gather(
            collect(loop_engine, "a", prompts[0], good),
            collect(loop_engine, "bad", prompts[1], SamplingParams(max_tokens=5, logits_processors=[bad])),
            collect(loop_engine, "c", prompts[2], good))
        await asyncio.sleep(0.2)  # one idle turn publishes the state
        free_after = loop_engine.state.num_free_blocks
        monkeypatch.setattr(engine.runner, "execute", lambda *_: 1 / 0)
        dead = await collect(loop_engine, "d", prompts[0], good)
        cause = await asyncio.wait_for(died, 10)
        monkeypatch.undo()
        engine.abort_request("d")
        return outcomes, free_after, dead, cause, loop_engine.is_running

    outcomes, free_after, dead, cause, running = asyncio.run(scenario())
    assert outcomes[0].outputs[0].finish_reason == "length" and outcomes[2].outputs[0].finish_reason == "length"
    assert isinstance(outcomes[1], RequestError) and "ValueError: processor bug" in str(outcomes[1])
    assert free_after == free_before
    errors = registry.get_sample_value("vllm:request_success_total",
                                       {"model_name": engine.config.served_model_name, "engine": "0",
                                        "finished_reason": "error"})
    assert errors == 1
    assert isinstance(dead, EngineDeadError) and "ZeroDivisionError" in str(dead)
    assert isinstance(cause, ZeroDivisionError) and not running
