"""The sampler's exponential race (engine/sample/sampler.py): argmax(p / q), q ~ Exp(1), draws token i
with probability p_i (vLLM's v1 sampler; the race is the Gumbel-max trick in another form).
Checked here on a small vocabulary with many rows at once, against the softmax of the
temperature-scaled logits, for unseeded rows (one shared draw) and seeded ones (a draw each), on
both paths: the torch ops and the one-pass C kernel (kernels/cpu/sample.py) the CPU kernel path
takes for rows with a temperature only."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.sample.sampler import Sampler
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.kernels.cpu import sample as cpu_sample

PATHS = [pytest.param(False, id="torch"),
         pytest.param(True, id="c-kernel", marks=pytest.mark.skipif(not cpu_sample.available(),
                                                                    reason="no CPU sampling kernel built"))]


def _sampler(seed: int, fused: bool) -> Sampler:
    sampler = Sampler(seed=seed)
    sampler.fused_sampling = fused
    return sampler

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("seeded", [False, True], ids=["shared-generator", "per-request-seed"])
def test_exponential_race_draws_tokens_with_the_softmax_probabilities(seeded, fused):
    rows, temperature = 4000, 0.7
    sampler = _sampler(1, fused)
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(rows)]
    out = sampler(LOGITS.repeat(rows, 1), [str(i) for i in range(rows)], params)
    counts = torch.bincount(torch.tensor([t for t, _ in out]), minlength=len(LOGITS)).double()
    want = (LOGITS / temperature).softmax(-1).double() * rows
    # chi-square with 4 degrees of freedom: P(X > 25) < 1e-4
    assert ((counts - want) ** 2 / want).sum().item() < 25


@pytest.mark.parametrize("fused", PATHS)
def test_seeded_rows_repeat_and_unseeded_rows_vary(fused):
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0)]
    logits = torch.zeros(2, 1000)  # uniform: every draw is the noise's argmax alone
    a, b = _sampler(0, fused), _sampler(1, fused)
    first = [a(logits, ["r", "s"], params)[0][0] for _ in range(3)]
    again = [b(logits, ["r", "s"], params)[0][0] for _ in range(3)]
    assert first == again  # the seeded request's own generator, whatever the sampler's seed
    shared = [a(logits, ["r", "s"], params)[1][0] for _ in range(20)]
    assert len(set(shared)) > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_argmax_with_ties_and_nan(dtype):
    from kvpilot.engine.sample.sampler import argmax_rows

    x = torch.randn(6, 300).to(dtype)
    x[1, [7, 200]] = 50.0  # a tie: the first index wins
    x[2, 100], x[2, 250] = float("nan"), 99.0  # NaN counts as the maximum
    x[3] = 0.0  # all equal
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert got[1].item() == 7 and got[2].item() == 100 and got[3].item() == 0


def test_the_c_kernel_takes_temperature_only_rows_and_leaves_top_k_top_p_min_p_to_torch(monkeypatch):
    if not cpu_sample.available():
        pytest.skip("no CPU sampling kernel built")
    sampler = _sampler(0, True)
    calls = []
    real = cpu_sample.sample_from_logits
    monkeypatch.setattr(cpu_sample, "sample_from_logits", lambda x, t, k: calls.append(x.shape[0]) or real(x, t, k))
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.1, min_p=0.1)]
    out = sampler(logits, [str(i) for i in range(5)], params)
    assert calls == [1]  # row 0 only; row 2 is greedy
    assert out[2][0] == logits[2].argmax().item()
    top5 = set(logits[1].topk(5).indices.tolist())
    assert out[1][0] in top5


@pytest.mark.parametrize("fused", PATHS)
def test_greedy_rows_and_random_rows_without_mass_in_one_batch(fused):
    logits = torch.full((4, 50), float("-inf"))
    logits[0, 3], logits[0, 9] = 5.0, 1.0  # greedy: its argmax
    logits[2, 7] = 0.0  # random with one finite logit: that token, always
    logits[3] = torch.arange(50.0)  # greedy again, after the random rows
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)]
    sampler = _sampler(3, fused)
    for _ in range(5):
        tokens = [t for t, _ in sampler(logits.clone(), ["a", "b", "c", "d"], params)]
        # row 1 has no finite logit: its greedy token (argmax of all -inf: index 0), as torch.argmax
        assert tokens == [3, 0, 7, 49]
