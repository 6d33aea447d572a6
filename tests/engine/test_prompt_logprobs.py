"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): at every prompt position after
the first, the prompt token's logprob and rank and the top N, equal to the model's full
forward in Hugging Face transformers (float32) under chunked prefill, batched beside requests
that do not ask, with the prefix cache on (a request that asks never reads it), for -1 (the
whole vocabulary), and across tensor x pipeline parallel ranks."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sample.prompt_logprobs import gather_logprobs

from tiny_llama import VOCAB, save_tiny_llama, tiny_llm, tiny_prompts

TOP = 4


@pytest.fixture(scope="module")
def hf_logprobs(model_path, chat_prompts):
    """Per prompt of chat_prompts[:3]: log_softmax of HF's logits at every position [P, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in chat_prompts[:3]]
    del model
    gc.collect()
    return out


@pytest.fixture(scope="module")
def chunked_llm(model_path):
    """SmolLM2 in float32, a 16-token budget (every prompt is chunked), prefix caching on."""
    llm = LLM(str(model_path), dtype="float32", max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=128,
              max_num_batched_tokens=16, enable_prefix_caching=True, swap_space=0)
    yield llm
    llm.engine.close()


def assert_matches(prompt: list[int], prompt_logprobs, reference: torch.Tensor, top: int) -> None:
    """prompt_logprobs (RequestOutput's) against reference [P, vocab] log_softmax: the prompt
    token first with its rank, then the top `top` tokens with ranks 1..top, within 1e-3."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, ref = prompt_logprobs[pos], reference[pos - 1]
        token = prompt[pos]
        assert next(iter(entry)) == token, f"position {pos}: the prompt token comes first"
        assert abs(entry[token].logprob - ref[token].item()) < 1e-3
        ref_rank = int((ref >= ref[token]).sum())
        assert abs(entry[token].rank - ref_rank) <= 1 or ref_rank <= top, f"position {pos}: rank"
        assert len(entry) in (top, top + 1)  # top: the prompt token is among the top N
        ref_top = ref.topk(top)
        for t, v in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
            if t in entry:
                assert abs(entry[t].logprob - v) < 1e-3
        # a near-tie at the N-th place may swap the last token in the top N
        assert sum(t in entry for t in ref_top.indices.tolist()) >= top - 1, f"position {pos}: {list(entry)}"


def test_prompt_logprobs_equal_hf_under_chunked_prefill_beside_requests_without(chunked_llm, chat_prompts,
                                                                                 hf_logprobs):
    prompts = chat_prompts[:3]
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=2),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP, logprobs=2)]
    outs = chunked_llm.generate(prompts, params)
    assert outs[1].prompt_logprobs is None
    for i in (0, 2):
        assert_matches(prompts[i], outs[i].prompt_logprobs, hf_logprobs[i], TOP)
    # the sampled token's logprob comes from the last prompt position, which prompt logprobs leave out
    first = outs[2].outputs[0].token_ids[0]
    assert abs(outs[2].outputs[0].logprobs[0][first] - hf_logprobs[2][-1, first].item()) < 1e-3


def test_a_request_with_prompt_logprobs_computes_every_position_with_the_prefix_cached(chunked_llm, chat_prompts,
                                                                                        hf_logprobs):
    bm = chunked_llm.engine.block_manager
    prompt = chat_prompts[0]
    chunked_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # caches its blocks
    queries, hits = bm.prefix_queries, bm.prefix_hits
    out = chunked_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits), "no lookup, as vLLM (none counted)"
    assert out.metrics.num_cached_tokens == 0
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:]), "N = 0: the prompt token only"
    assert_matches(prompt, out.prompt_logprobs, hf_logprobs[0], 0)
    again = chunked_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.metrics.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_minus_one_returns_the_whole_vocabulary(chunked_llm, chat_prompts, hf_logprobs):
    prompt = chat_prompts[1][:20]
    out = chunked_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1))[0]
    vocab = chunked_llm.engine.config.model.vocab_size
    for pos in (1, 10, 19):
        entry = out.prompt_logprobs[pos]
        assert len(entry) == vocab
        assert math.isclose(sum(math.exp(lp.logprob) for lp in entry.values()), 1.0, rel_tol=1e-3)
        assert sorted(lp.rank for t, lp in entry.items() if t != prompt[pos])[:3] == [1, 2, 3]
        assert abs(entry[prompt[pos]].logprob - hf_logprobs[1][pos - 1, prompt[pos]].item()) < 1e-3


def test_a_one_token_prompt_has_no_prompt_logprobs_but_the_first_none(chunked_llm):
    out = chunked_llm.generate([[1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_below_minus_one_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative or -1"):
        SamplingParams(prompt_logprobs=-2)


def test_gather_logprobs_ranks_count_the_tokens_at_least_as_likely_as_vllm():
    logprobs = torch.tensor([[-1.0, -0.5, -2.0, -0.5]]).log_softmax(-1)
    ids, values, ranks = gather_logprobs(logprobs, 2, torch.tensor([[2]]))
    assert ids.tolist() == [[2, 1, 3]] and ranks.tolist() == [4]
    ids, _, ranks = gather_logprobs(logprobs, -1, torch.tensor([[3]]))
    assert len(ids[0]) == 5 and ranks.tolist() == [2]  # a tie counts both (vLLM's x >= value)


@pytest.fixture(scope="module")
def tiny_llama5(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-plp"), num_layers=5)


def _tiny_prompt_logprobs(llm: LLM, prompts):
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=5 if i != 1 else None)
              for i in range(len(prompts))]
    try:
        return [o.prompt_logprobs for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()


def test_tp2_x_pp2_micro_batched_gives_the_prompt_logprobs_of_one_process(tiny_llama5, monkeypatch):
    prompts = tiny_prompts()  # 5, 22 and 40 tokens; a 24-token budget chunks the last
    expected = _tiny_prompt_logprobs(tiny_llm(tiny_llama5), prompts)
    monkeypatch.setenv("KVPILOT_PP_MIN_MICRO_BATCH_TOKENS", "1")  # cut the steps in 2 micro-batches
    actual = _tiny_prompt_logprobs(tiny_llm(tiny_llama5, tp=2, pp=2), prompts)
    assert actual[1] is None and len(actual[2]) == 40 and len(actual[2][39]) in (6, 5)
    for ours, ref in zip(actual, expected):
        if ref is None:
            continue
        assert [list(e) if e else e for e in ours] == [list(e) if e else e for e in ref]
        for a, b in zip(ours[1:], ref[1:]):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in b)
    assert max(max(e) for e in actual[0][1:]) < VOCAB
