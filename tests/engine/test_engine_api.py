"""The offline API on the real model: sampling parameters, stop conditions, logprobs,
bad input, and that one bad request never disturbs the others."""

from __future__ import annotations

import math

import pytest

from kvpilot.engine import EngineArgs, SamplingParams
from kvpilot.engine.core.sequence import SequenceStatus

PROMPT = "The three primary colors are"


def run(llm, prompt=PROMPT, **params):
    return llm.generate(prompt, SamplingParams(**params))[0].outputs[0]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(small_llm):
    a = run(small_llm, temperature=1.0, seed=7, max_tokens=12)
    b = run(small_llm, temperature=1.0, seed=7, max_tokens=12)
    c = run(small_llm, temperature=1.0, seed=8, max_tokens=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = run(small_llm, temperature=0, max_tokens=12)
    assert run(small_llm, temperature=1.5, top_k=1, seed=3, max_tokens=12).token_ids == greedy.token_ids


def test_seeded_request_is_independent_of_its_batch(small_llm):
    alone = run(small_llm, temperature=0.8, top_p=0.9, seed=11, max_tokens=10).token_ids
    batch = small_llm.generate(
        [PROMPT, "Once upon a time", "def fib(n):"],
        [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10),
         SamplingParams(temperature=1.0, max_tokens=10), SamplingParams(temperature=0, max_tokens=10)],
    )
    assert batch[0].outputs[0].token_ids == alone


def test_stop_string_truncates_text_and_reports_it(small_llm):
    free = run(small_llm, temperature=0, max_tokens=24)
    words = free.text.split()
    assert len(words) >= 4
    stop = words[3]
    out = run(small_llm, temperature=0, max_tokens=24, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)


def test_stop_token_ids_max_tokens_and_ignore_eos(small_llm):
    free = run(small_llm, temperature=0, max_tokens=10)
    stop_id = free.token_ids[4]
    out = run(small_llm, temperature=0, max_tokens=10, stop_token_ids=[stop_id])
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert run(small_llm, temperature=0, max_tokens=3).finish_reason == "length"
    # a chat reply ends with EOS well before 200 tokens; ignore_eos runs to max_tokens
    chat = small_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200))
    assert chat[0].outputs[0].finish_reason == "stop"
    assert len(chat[0].outputs[0].token_ids) < 200
    forced = small_llm.chat([{"role": "user", "content": "Say hi."}],
                            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(forced[0].outputs[0].token_ids) == 40


def test_logprobs_of_chosen_and_top_tokens(small_llm):
    out = run(small_llm, temperature=0, max_tokens=5, logprobs=3)
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: chosen token is the top one
        assert entry[token] == max(entry.values()) and entry[token] <= 0
        assert all(math.isfinite(v) for v in entry.values())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-1), r"temperature must be in \[0, 2\]"),
        (dict(temperature=2.5), r"temperature must be in \[0, 2\]"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a finite number greater than zero"),
        (dict(bad_words=["x", ""]), "bad_words cannot contain an empty string"),
        (dict(top_p=0), "top_p must be in"),
        (dict(top_k=-5), "top_k must be"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(logprobs=-2), "logprobs must be non-negative or -1"),
        (dict(stop=[""]), "stop strings must not be empty"),
    ],
)
def test_bad_sampling_params_raise(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(max_num_batched_tokens=8, max_num_seqs=16), "must be >= max_num_seqs"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
         "smaller than max_model_len"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(block_size=24), "block_size must be a power of two"),
        (dict(preemption_mode="drop"), "preemption_mode must be"),
        (dict(tensor_parallel_size=2), "must divide the model's 9 attention heads"),
        (dict(max_model_len=100000), "exceeds the model's context length"),
        (dict(dtype="int8"), "dtype 'int8' is not supported"),
        (dict(model="no-such-model"), "not a builtin alias"),
        (dict(model="builtin://gpt-7"), "unknown builtin model"),
        (dict(max_model_len=1024, num_gpu_blocks_override=10), "To serve one request of max_model_len"),
    ],
)
def test_invalid_engine_args_say_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        config = EngineArgs(**args).create_engine_config()
        from kvpilot.engine.engine.llm_engine import LLMEngine

        LLMEngine(config)


def test_bad_requests_raise_and_the_engine_keeps_serving(small_llm):
    engine = small_llm.engine
    good = engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("no-ids", [], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt is 1024 tokens but max_model_len is 1024"):
        engine.add_request("long", [42] * 1024, SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        engine.add_request("bad-id", [1, 49152], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", PROMPT, SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()
    assert good.status is SequenceStatus.FINISHED_LENGTH and good.num_output_tokens == 8
    assert small_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids \
        == good.output_token_ids
    # a batch with one bad prompt is refused whole, and nothing stays queued
    with pytest.raises(ValueError):
        small_llm.generate([PROMPT, ""], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks_at_once(small_llm):
    engine = small_llm.engine
    engine.add_request("to-abort", PROMPT * 20, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort_request("to-abort")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.abort_request("to-abort")


def test_live_scheduler_config_change_takes_effect_next_step(small_llm):
    engine = small_llm.engine
    before = engine.scheduler.config
    try:
        engine.update_scheduler_config(max_num_seqs=2, max_num_batched_tokens=64)
        for i in range(4):
            engine.add_request(f"live-{i}", PROMPT, SamplingParams(max_tokens=3))
        engine.step()
        assert len(engine.scheduler.running) == 2
        with pytest.raises(ValueError, match="must be >= max_num_seqs"):
            engine.update_scheduler_config(max_num_batched_tokens=1)
        with pytest.raises(ValueError, match="cannot change"):
            engine.update_scheduler_config(block_size=32)
        assert engine.scheduler.config.max_num_batched_tokens == 64  # unchanged by the refusals
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.update_scheduler_config(max_num_seqs=before.max_num_seqs,
                                       max_num_batched_tokens=before.max_num_batched_tokens)


def test_chat_applies_the_template(small_llm):
    ids = small_llm.apply_chat_template([{"role": "user", "content": "hi"}])
    text = small_llm.get_tokenizer().decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_uninitialised_pool_memory_never_reaches_outputs(model_path):
    """Fresh pool memory may hold NaN bit patterns; blocks are zeroed at first use, so a
    NaN-filled pool (block 0, the padding target, zeroed at allocation) changes nothing."""
    from kvpilot.engine import LLM

    prompts = ["Hello there, how are you", "What is 2+2? Answer briefly.", "List three fruits:"] * 3
    params = SamplingParams(temperature=0, max_tokens=24)
    args = dict(dtype="float32", max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=40, swap_space=0.05)
    clean = [o.outputs[0].token_ids for o in LLM(str(model_path), **args).generate(prompts, params)]
    llm = LLM(str(model_path), **args)
    for k, v in llm.engine.runner.kv_caches:
        k[1:].fill_(float("nan"))
        v[1:].fill_(float("nan"))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == clean
