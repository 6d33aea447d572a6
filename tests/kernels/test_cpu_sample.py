"""The CPU sampling kernel (kernels/cpu/sample.py over csrc/sample.c): inverse transform sampling
over exp((logits - max) / T) with one uniform per row from its key. Checked: the draws follow
softmax(logits / T) (chi-square on a small vocabulary, masked tokens never drawn), a key fixes the
token, tokens without mass in float32 change no draw, a row with no finite logit answers -1,
strided rows read their own logits, and the draws against a float64 reference of the same
uniform (SplitMix64's output) over a vocabulary of several of the kernel's tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.kernels.cpu import sample

pytestmark = pytest.mark.skipif(not sample.available(), reason="the install built no CPU sampling kernel")

LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5, 3.0, -2.0])


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**63 - 1, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax_of_the_scaled_logits(temperature):
    rows = 20000
    got = sample.sample_from_logits(LOGITS.repeat(rows, 1), torch.full((rows,), 1 / temperature), _keys(rows))
    counts = torch.bincount(got, minlength=len(LOGITS)).double()
    assert counts[4] == 0  # the -inf token
    want = (LOGITS / temperature).softmax(-1).double() * rows
    kept = want > 5
    # chi-square over the tokens expected at least 5 times (6-7 of them): P(X > 30) < 1e-4
    assert (((counts - want) ** 2 / want)[kept]).sum().item() < 30


def test_a_key_fixes_the_token_and_keys_vary_it():
    logits = torch.zeros(1, 5000)  # uniform: every draw is the noise's argmax alone
    first = [sample.sample_from_logits(logits, torch.ones(1), torch.tensor([k])).item() for k in (1, 2, 3)]
    again = [sample.sample_from_logits(logits, torch.ones(1), torch.tensor([k])).item() for k in (1, 2, 3)]
    assert first == again
    many = sample.sample_from_logits(logits.repeat(200, 1), torch.ones(200), _keys(200))
    assert len(set(many.tolist())) > 150


def test_tokens_without_mass_change_no_draw():
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 300, 4099  # not a multiple of the kernel's tile
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, ::3] -= 200.0  # a third of every row: e^((l - max) / T) below e^-87, no mass in float32
    keys = _keys(rows, 1)
    for t in (0.7, 1.0, 1.5):
        inv_t = torch.full((rows,), 1 / t)
        masked = logits.clone()
        masked[:, ::3] = float("-inf")
        got = sample.sample_from_logits(logits, inv_t, keys)
        assert torch.equal(got, sample.sample_from_logits(masked, inv_t, keys))
        assert (got % 3 != 0).all()


def _reference(logits: np.ndarray, inv_t: float, key: int) -> int:
    """The kernel's draw in float64: u = SplitMix64's output for key, top 53 bits; the first token whose
    running sum of exp((l - max) * inv_t) passes u times the total."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = float(z >> np.uint64(11)) / 2.0**53
    p = np.exp((logits.astype(np.float64) - logits.max()) * inv_t)
    return int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))


def test_the_draws_are_the_reference_inversions():
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 300, 5000  # 5 tiles of 1024 and a partial one
    logits = torch.randn(rows, vocab, generator=gen) * 2
    keys = _keys(rows, 2)
    got = sample.sample_from_logits(logits, torch.full((rows,), 1 / 0.8), keys)
    want = [_reference(logits[r].numpy(), 1 / 0.8, int(keys[r])) for r in range(rows)]
    # float32 terms and sums against float64: a target right at a token's edge may move by one, rarely
    assert (got.numpy() == np.array(want)).mean() >= 0.99


def test_rows_without_a_finite_logit_answer_minus_one_and_strided_rows_read_their_own():
    wide = torch.full((3, 64), float("-inf"))
    wide[0, 10] = 1.0
    wide[2, 3] = float("nan")
    wide[2, 40] = 0.0  # NaN is never drawn; the finite logit is
    view = wide[:, :50]  # rows 64 floats apart
    got = sample.sample_from_logits(view, torch.ones(3), _keys(3))
    assert got.tolist() == [10, -1, 40]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="sample_from_logits"):
        sample.sample_from_logits(torch.zeros(2, 5, dtype=torch.float64), torch.ones(2), _keys(2))
    with pytest.raises(ValueError, match="sample_from_logits"):
        sample.sample_from_logits(torch.zeros(2, 5), torch.ones(3), _keys(2))


def test_the_portable_build_draws_as_the_vectorized_one():
    from kvpilot.kernels.cpu.loader import variants_runnable

    gen = torch.Generator().manual_seed(9)
    rows, vocab = 200, 3000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, 5::7] = float("-inf")
    keys, inv_t = _keys(rows, 4), torch.full((rows,), 1 / 1.3)
    builds = variants_runnable()
    best = sample.sample_from_logits(logits, inv_t, keys, variant=builds[-1])
    plain = sample.sample_from_logits(logits, inv_t, keys, variant=builds[0])
    # the same terms to the last bits or two: a target right at a token's edge may move by one, rarely
    assert (best == plain).double().mean().item() >= 0.99
    assert (plain % 7 != 5).all() and (best % 7 != 5).all()
