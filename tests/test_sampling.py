"""Keyed sampling (DESIGN.md "Sampling keyed by (seed, position, id)"): the hash against an
independent Python-int implementation, determinism, exact distributions (chi-square, with a control
that must fail), batching, bad input and penalties."""
import re

import numpy as np
import pytest

from sapwood.sampling import (SamplingParams, apply_penalties, filtered_probs, keyed_uniform,
                              mix64, sample)

MASK = 2 ** 64 - 1


def py_mix(z):
    """The spec's mix, written with Python ints (independent of the module's numpy code)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_uniform(seed, position, id_):
    h = py_mix(py_mix(py_mix(seed) ^ position) ^ id_)
    return ((h >> 11) + 0.5) * 2.0 ** -53


# Ids deliberately not in value order; two 0.7s tie at the top-k=5 boundary (ranks 5 and 6).
VALUES = [2.0, 1.5, 1.0, 0.7, 0.7, 0.3, 0.0, -0.2, -0.5, -1.0, -1.5, -2.0]
PERM = [7, 3, 11, 0, 9, 4, 1, 10, 5, 2, 8, 6]
LOGITS = np.array(VALUES)[np.argsort(PERM)]   # LOGITS[PERM[i]] = VALUES[i]
SETTINGS = {
    "plain": dict(temperature=0.8),
    "top_k": dict(temperature=0.8, top_k=5),
    "top_p": dict(temperature=0.8, top_p=0.7),
    "min_p": dict(temperature=0.8, min_p=0.1),
    "all": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05),
}


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_mix64_known_splitmix_output():
    # First output of the reference SplitMix64 generator from state 0.
    assert int(mix64(np.uint64(0))) == 0xE220A8397B1DCDAF
    z = np.array([0, 1, 2 ** 63 + 5, MASK], dtype=np.uint64)
    assert [int(v) for v in mix64(z)] == [py_mix(int(v)) for v in z]


@pytest.mark.parametrize("seed,position,id_", [
    (0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (42, 17, 1234),
    (2 ** 63 + 5, 4095, 151935), (MASK, 2 ** 40 + 3, 151935), (123456789, 0, 151935)])
def test_keyed_uniform_matches_python_ints(seed, position, id_):
    got = keyed_uniform(seed, position, np.array([id_]))
    assert got[0] == py_uniform(seed, position, id_)     # exact: same bits, same rounding
    assert 0.0 < got[0] < 1.0


def test_keyed_uniform_broadcast_and_range():
    pos = np.arange(5)[:, None]
    ids = np.array([0, 7, 151935])[None, :]
    u = keyed_uniform(2 ** 63 + 5, pos, ids)
    assert u.shape == (5, 3) and u.dtype == np.float64
    ref = [[py_uniform(2 ** 63 + 5, p, i) for i in (0, 7, 151935)] for p in range(5)]
    np.testing.assert_array_equal(u, ref)
    big = keyed_uniform(9, 3, np.arange(200_000))
    assert big.min() > 0.0 and big.max() < 1.0
    assert abs(big.mean() - 0.5) < 0.005


def test_greedy_is_argmax_ties_lower_id():
    x = np.array([0.1, 3.0, -1.0, 3.0, 2.9])
    assert sample(x, 0) == 1
    assert sample(x, 5, seed=99, top_k=1) == 1
    rows = np.stack([x, x[::-1], np.zeros(5)])
    np.testing.assert_array_equal(sample(rows, np.array([0, 1, 2])), [1, 1, 0])
    np.testing.assert_array_equal(filtered_probs(x), [0, 1, 0, 0, 0])


def test_same_key_same_token_different_positions_differ():
    x = np.zeros(64)                                   # uniform: every draw is pure noise
    n = 400
    same = sample(np.tile(x, (n, 1)), np.full(n, 11), seed=5, temperature=1.0)
    assert (same == same[0]).all()
    assert sample(x, 11, seed=5, temperature=1.0) == same[0]
    by_pos = sample(np.tile(x, (n, 1)), np.arange(n), seed=5, temperature=1.0)
    assert len(set(by_pos.tolist())) > 50              # ~64 expected; 1 if position were ignored
    by_seed = [sample(x, 11, seed=s, temperature=1.0) for s in range(n)]
    assert len(set(by_seed)) > 50


def test_kept_sets_by_hand():
    # Top-k tie at the boundary keeps the lower id.
    x = np.array([1.0, 0.5, 0.5, 2.0])
    np.testing.assert_array_equal(filtered_probs(x, 1.0, top_k=3) > 0, [1, 1, 0, 1])
    # Top-p: probs 0.5, 0.25, 0.125, 0.125 (T = 1): p = 0.75 reaches at 2 ids, 0.76 needs 3.
    y = np.log([0.125, 0.5, 0.125, 0.25])
    np.testing.assert_array_equal(filtered_probs(y, 1.0, top_p=0.75) > 0, [0, 1, 0, 1])
    np.testing.assert_array_equal(filtered_probs(y, 1.0, top_p=0.76) > 0, [1, 1, 0, 1])
    # Top-p renormalises over the top-k set: top_k=2 -> {0.5, 0.25} -> 2/3, 1/3.
    np.testing.assert_array_equal(filtered_probs(y, 1.0, top_k=2, top_p=0.6) > 0, [0, 1, 0, 0])
    np.testing.assert_allclose(filtered_probs(y, 1.0, top_k=2), [0, 2 / 3, 0, 1 / 3])
    # Min-p relative to the largest probability: 0.25 / 0.5 = 0.5 kept, 0.125 / 0.5 dropped.
    np.testing.assert_array_equal(filtered_probs(y, 1.0, min_p=0.5) > 0, [0, 1, 0, 1])
    np.testing.assert_array_equal(filtered_probs(y, 1.0, min_p=0.51) > 0, [0, 1, 0, 0])
    # -inf logits are never sampled, even when top-k would admit them.
    z = np.array([-np.inf, 0.0, -np.inf])
    assert all(sample(z, p, temperature=5.0, top_k=3) == 1 for p in range(50))


def draws(setting, n_seeds=200, per_seed=100):
    """20000 samples: 200 seeds, each one batched call over 100 positions."""
    rows = np.tile(LOGITS, (per_seed, 1))
    out = [sample(rows, np.arange(per_seed) + 1000, seed=s, **setting) for s in range(n_seeds)]
    return np.concatenate(out)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_chi_square_matches_filtered_probs(name):
    stats = pytest.importorskip("scipy.stats")
    setting = SETTINGS[name]
    toks = draws(setting)
    counts = np.bincount(toks, minlength=len(LOGITS))
    p = filtered_probs(LOGITS, **setting)
    kept = p > 0
    assert counts[~kept].sum() == 0, "sampled an id outside the kept set"
    res = stats.chisquare(counts[kept], p[kept] * len(toks))
    print(f"{name}: kept {int(kept.sum())}/{len(LOGITS)} ids, chi-square p = {res.pvalue:.4g}")
    assert res.pvalue > 1e-3


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "all"])
def test_chi_square_control_detects_wrong_distribution(name):
    """The same samples against the unfiltered softmax must be rejected: proves the test above
    can see a filter that is missing or wrong."""
    stats = pytest.importorskip("scipy.stats")
    setting = SETTINGS[name]
    assert (filtered_probs(LOGITS, **setting) == 0).any()   # the filter removes mass
    toks = draws(setting)
    counts = np.bincount(toks, minlength=len(LOGITS))
    wrong = softmax(LOGITS / setting["temperature"])
    res = stats.chisquare(counts, wrong * len(toks))
    print(f"control {name}: chi-square p vs unfiltered softmax = {res.pvalue:.3g}")
    assert res.pvalue < 1e-6


def test_batch_equals_rows():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 50)) * 2
    x[3] = x[5]                                        # identical rows, different positions
    pos = rng.integers(0, 10_000, size=16)
    for setting in SETTINGS.values():
        got = sample(x, pos, seed=2 ** 63 + 5, **setting)
        assert got.dtype == np.int64 and got.shape == (16,)
        want = [sample(x[i], int(pos[i]), seed=2 ** 63 + 5, **setting) for i in range(16)]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs,value", [
    (dict(temperature=-1.0), "-1.0"), (dict(temperature=1.0, top_p=0.0), "0.0"),
    (dict(temperature=1.0, top_p=1.5), "1.5"), (dict(temperature=1.0, top_k=-3), "-3"),
    (dict(temperature=1.0, min_p=2.0), "2.0"), (dict(temperature=float("nan")), "nan"),
    (dict(seed=1.5), "1.5")])
def test_bad_params(kwargs, value):
    with pytest.raises(ValueError, match=re.escape(value)):
        sample(np.zeros(4), 0, **kwargs)


def test_bad_logits_and_positions():
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, np.nan, 1.0]), 0, temperature=1.0)
    with pytest.raises(ValueError, match="NaN"):
        filtered_probs(np.array([0.0, np.nan]), 1.0)
    with pytest.raises(ValueError, match=re.escape("(3,)")):
        sample(np.zeros((2, 4)), np.arange(3))
    with pytest.raises(ValueError, match=re.escape("(2, 1)")):
        sample(np.zeros((2, 4)), np.zeros((2, 1), dtype=int))
    with pytest.raises(ValueError, match=re.escape("(2,)")):
        sample(np.zeros(4), np.arange(2))
    with pytest.raises(ValueError, match="-1"):
        sample(np.zeros(4), -1, temperature=1.0)


def test_params_validate_and_tree_eligible():
    assert SamplingParams().validate().tree_eligible
    assert SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3).tree_eligible
    for kw in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
               dict(frequency_penalty=-0.2)):
        assert not SamplingParams(**kw).tree_eligible
    for kw, value in ((dict(repetition_penalty=0.0), "0.0"), (dict(presence_penalty=np.nan), "nan"),
                      (dict(top_k=2.5), "2.5"), (dict(seed=-1), "-1"), (dict(seed="1"), "'1'")):
        with pytest.raises(ValueError, match=re.escape(value)):
            SamplingParams(**kw).validate()


def test_penalties_by_hand():
    x = np.array([2.0, -1.0, 0.5, 0.0, 3.0])
    hist = [0, 1, 1, 3]                                # counts [1, 2, 0, 1, 0]
    before = x.copy()
    np.testing.assert_allclose(apply_penalties(x, hist, SamplingParams(repetition_penalty=2.0)),
                               [1.0, -2.0, 0.5, 0.0, 3.0])
    np.testing.assert_allclose(
        apply_penalties(x, hist, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)),
        [1.25, -2.0, 0.5, -0.75, 3.0])
    np.testing.assert_allclose(
        apply_penalties(x, hist, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                                frequency_penalty=0.25)),
        [0.25, -3.0, 0.5, -0.75, 3.0])
    np.testing.assert_array_equal(apply_penalties(x, [], SamplingParams(presence_penalty=1.0)), x)
    np.testing.assert_array_equal(x, before)           # input untouched
    with pytest.raises(ValueError, match="5"):
        apply_penalties(x, [5], SamplingParams(presence_penalty=1.0))
