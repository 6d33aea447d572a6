"""The batched logits adjustments (engine/sample/logits_adjust.py) through the Sampler: penalties equal
vLLM's formula computed row by row, logit bias, bad words and min_tokens, each row's result the
same alone as in a batch beside rows without adjustments, and the count slots growing past
their first size."""

from __future__ import annotations

import torch

from kvpilot.engine.sample.sampler import Sampler
from kvpilot.engine.sampling_params import SamplingParams

VOCAB = 50


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's `apply_penalties` for one row, written plainly: repetition over prompt and output
    tokens (divide positive, multiply negative), then frequency x count and presence."""
    row = logits.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_penalties_match_the_formula_across_steps_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    params = [greedy(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3), greedy(),
              greedy(repetition_penalty=0.8), greedy(frequency_penalty=-0.5)]
    prompts = [[1, 2, 3, 3], [4], [5, 6], [7, 7, 8]]
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler(seed=0)
    ids = [f"r{i}" for i in range(len(params))]
    for rid, p, prompt, out in zip(ids, params, prompts, outputs):
        sampler.add_request(rid, p, out, prompt_token_ids=prompt)
    for _ in range(12):
        logits = torch.randn(len(params), VOCAB, generator=gen) * 3
        expected = [int(reference_penalties(logits[i], prompts[i], outputs[i], params[i]).argmax())
                    for i in range(len(params))]
        got = [token for token, _ in sampler(logits, ids, params)]
        assert got == expected
        for out, token in zip(outputs, got):
            out.append(token)  # what the scheduler does with the live lists
    assert any(len(out) > len(set(out)) for out in outputs)  # repeats happened, so the counts were exercised


def test_logit_bias_bad_words_and_min_tokens():
    sampler = Sampler(seed=0)
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0  # the winner without adjustments
    params = [greedy(logit_bias={3: 100.0, 9: -100.0}), greedy(bad_words_token_ids=[[9], [4, 8]]),
              greedy(min_tokens=2, stop_token_ids=[9])]
    outputs = [[], [4], []]
    for i, (p, out) in enumerate(zip(params, outputs)):
        sampler.add_request(str(i), p, out, eos_token_ids=(0,))
    logits[1, 8] = 4.0  # second best for row 1; banned after token 4
    logits[2, 0] = 4.0  # EOS, second best for row 2; banned below min_tokens
    tokens = [t for t, _ in sampler(logits.clone(), ["0", "1", "2"], params)]
    assert tokens[0] == 3
    assert tokens[1] not in (9, 8)
    assert tokens[2] not in (9, 0)
    outputs[1][:] = [5]  # the two-token word's prefix no longer ends the output: 8 allowed again
    outputs[2][:] = [1, 1]  # min_tokens reached: the stop tokens are allowed again
    tokens = [t for t, _ in sampler(logits.clone(), ["0", "1", "2"], params)]
    assert tokens[1:] == [8, 9]


def test_a_row_is_adjusted_the_same_alone_as_in_a_batch_and_slots_grow():
    gen = torch.Generator().manual_seed(1)
    n = 20  # more than the first 8 slots
    params = [greedy(frequency_penalty=1.5, repetition_penalty=1.2, logit_bias={i % VOCAB: 3.0})
              if i % 2 else greedy() for i in range(n)]
    batched, alone = Sampler(seed=0), Sampler(seed=0)
    outs_b = [[] for _ in range(n)]
    outs_a = [[] for _ in range(n)]
    for i, p in enumerate(params):
        batched.add_request(str(i), p, outs_b[i], prompt_token_ids=[i % VOCAB])
        alone.add_request(str(i), p, outs_a[i], prompt_token_ids=[i % VOCAB])
    for _ in range(6):
        logits = torch.randn(n, VOCAB, generator=gen)
        got = [t for t, _ in batched(logits.clone(), [str(i) for i in range(n)], params)]
        for i in range(n):
            outs_b[i].append(got[i])
            (t, _), = alone(logits[i:i + 1].clone(), [str(i)], [params[i]])
            outs_a[i].append(t)
    assert outs_b == outs_a
    assert any(len(set(o)) > 1 for o in outs_b[1::2])  # the frequency penalty moves penalized rows off a repeat
    for i in range(n):
        batched.forget(str(i))
    assert not batched.adjust.active([str(i) for i in range(n)])


def test_a_ban_that_would_empty_a_row_is_lifted():
    """A grammar that allows only the stop token (a complete choice) beside min_tokens: the stop
    token stays, so the row is never all -inf."""
    sampler = Sampler(seed=0)
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[:, 0] = 1.0  # only EOS is left, as a complete grammar leaves it
    logits[1, 7] = 0.5  # row 1 has another token
    params = [greedy(min_tokens=4), greedy(min_tokens=4)]
    for i, p in enumerate(params):
        sampler.add_request(str(i), p, [], eos_token_ids=(0,))
    assert [t for t, _ in sampler(logits, ["0", "1"], params)] == [0, 7]
