"""The one-pass sampling kernel (kernels/cpu/sample.py over csrc/sample.c): argmax of logits / T
plus Gumbel noise from counter-based draws. Checked: the draws follow softmax(logits / T)
(chi-square on a small vocabulary, masked tokens never drawn), a key fixes the token, the
pruning of tokens far below the row's largest logit changes no draw, a row with no finite logit
answers -1, and strided rows read the right logits. The noise itself against a float64 reference
of the same generator (SplitMix64's mix, Cephes-style logs)."""

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
    got = sample.gumbel_sample(LOGITS.repeat(rows, 1), torch.full((rows,), 1 / temperature), _keys(rows))
    counts = torch.bincount(got, minlength=len(LOGITS)).double()
    assert counts[4] == 0  # the -inf token
    want = (LOGITS / temperature).softmax(-1).double() * rows
    kept = want > 5
    # chi-square over the tokens expected at least 5 times (6-7 of them): P(X > 30) < 1e-4
    assert (((counts - want) ** 2 / want)[kept]).sum().item() < 30


def test_a_key_fixes_the_token_and_keys_vary_it():
    logits = torch.zeros(1, 5000)  # uniform: every draw is the noise's argmax alone
    first = [sample.gumbel_sample(logits, torch.ones(1), torch.tensor([k])).item() for k in (1, 2, 3)]
    again = [sample.gumbel_sample(logits, torch.ones(1), torch.tensor([k])).item() for k in (1, 2, 3)]
    assert first == again
    many = sample.gumbel_sample(logits.repeat(200, 1), torch.ones(200), _keys(200))
    assert len(set(many.tolist())) > 150


def test_pruning_far_tokens_changes_no_draw():
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 300, 4099  # not a multiple of the kernel's tile
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, ::3] -= 40.0  # a third of every row far below its top: never drawn, noise skipped
    keys = _keys(rows, 1)
    for t in (0.7, 1.0, 1.5):
        inv_t = torch.full((rows,), 1 / t)
        masked = logits.clone()
        masked[logits * (1 / t) < (logits.amax(-1, keepdim=True) * (1 / t) - 21)] = float("-inf")
        got = sample.gumbel_sample(logits, inv_t, keys)
        assert torch.equal(got, sample.gumbel_sample(masked, inv_t, keys))
        assert (got % 3 != 0).all()


def _reference(logits: np.ndarray, inv_t: float, key: int) -> int:
    """The kernel's draw in float64: SplitMix64's mix of key + (i + 1) * golden, top 24 bits + 0.5."""
    mask = (1 << 64) - 1
    i = np.arange(logits.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    assert int(z.max()) <= mask
    u = ((z >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0
    return int(np.argmax(logits.astype(np.float64) * inv_t - np.log(-np.log(u))))


def test_the_draws_are_the_reference_generators():
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 200, 2000
    logits = torch.randn(rows, vocab, generator=gen) * 2
    keys = _keys(rows, 2)
    got = sample.gumbel_sample(logits, torch.full((rows,), 1 / 0.8), keys)
    want = [_reference(logits[r].numpy(), np.float32(1 / 0.8), int(keys[r]) % (1 << 64)) for r in range(rows)]
    # float32 arithmetic against float64: a near tie may flip, rarely
    assert (got.numpy() == np.array(want)).mean() >= 0.98


def test_rows_without_a_finite_logit_answer_minus_one_and_strided_rows_read_their_own():
    wide = torch.full((3, 64), float("-inf"))
    wide[0, 10] = 1.0
    wide[2, 3] = float("nan")
    wide[2, 40] = 0.0  # NaN is never drawn; the finite logit is
    view = wide[:, :50]  # rows 64 floats apart
    got = sample.gumbel_sample(view, torch.ones(3), _keys(3))
    assert got.tolist() == [10, -1, 40]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="gumbel_sample"):
        sample.gumbel_sample(torch.zeros(2, 5, dtype=torch.float64), torch.ones(2), _keys(2))
    with pytest.raises(ValueError, match="gumbel_sample"):
        sample.gumbel_sample(torch.zeros(2, 5), torch.ones(3), _keys(2))
