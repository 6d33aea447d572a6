"""Statistics of the request arrival process (vLLM get_request): Poisson gaps, gamma
burstiness, normalization and seeding."""

import math

import numpy as np
import pytest

from kvpilot.loadgen.benchmark import arrival_offsets

N = 20000


def gaps(offsets):
    return np.diff(np.concatenate([[0.0], offsets]))


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5


def test_poisson_gaps_have_mean_one_over_rate_and_unit_cv():
    g = gaps(arrival_offsets(N, 10.0, 1.0, seed=3, normalize=False))
    assert g.mean() == pytest.approx(0.1, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)
    # exponential: P(gap > mean) = 1/e
    assert (g > 0.1).mean() == pytest.approx(math.exp(-1), abs=0.015)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv_and_keeps_the_rate(burstiness):
    g = gaps(arrival_offsets(N, 5.0, burstiness, seed=1, normalize=False))
    assert g.mean() == pytest.approx(0.2, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_infinite_burstiness_is_periodic():
    assert gaps(arrival_offsets(4, 2.0, math.inf)) == pytest.approx([0.5] * 4)


def test_normalized_schedule_ends_at_n_over_rate():
    offsets = arrival_offsets(100, 4.0, 0.5, seed=7)
    assert offsets[-1] == pytest.approx(25.0)
    assert np.all(np.diff(offsets) >= 0) and offsets[0] > 0


def test_same_seed_same_schedule_other_seed_differs():
    a = arrival_offsets(50, 3.0, 1.0, seed=11)
    assert np.array_equal(a, arrival_offsets(50, 3.0, 1.0, seed=11))
    assert not np.allclose(a, arrival_offsets(50, 3.0, 1.0, seed=12))


def test_schedule_matches_vllm_global_numpy_stream():
    # vLLM seeds the global numpy RNG with --seed and draws np.random.gamma per request.
    np.random.seed(5)
    expected = np.cumsum([np.random.gamma(shape=2.0, scale=1.0 / (8.0 * 2.0)) for _ in range(30)])
    assert arrival_offsets(30, 8.0, 2.0, seed=5, normalize=False) == pytest.approx(expected)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_non_positive_rate_or_burstiness_is_rejected(rate, burstiness):
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_offsets(3, rate, burstiness)
