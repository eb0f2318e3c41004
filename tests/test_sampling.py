"""Keyed sampling (docs/design.md "Sampling keyed by (seed, position, id)"): the hash against an
independent Python-int implementation, determinism, exact distributions (chi-square, with a control
that must fail), batching, bad input and penalties."""
import re

import numpy as np
import pytest

from sapwood.reference.sampling import apply_penalties, keyed_uniform, mix64
from sapwood.sampling import SamplingParams, filtered_probs, sample

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


# The engine's sampler (csrc/sampler.cpp) against the oracle (reference/sampling.py), token for
# token with ==: same scaled logits, same integer top-p weights, same libm exp/log, so any
# difference is a bug, not rounding. Rows span flat (every id needs its noise), peaked (most
# ids ruled out by the noise bound), tied (the order's tie rule) and -inf-masked logits.
ORACLE_MODES = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.8),
    "cold": dict(temperature=1e-3),
    "hot": dict(temperature=50.0),
    "top_k_1": dict(temperature=1.0, top_k=1),
    "top_k_40": dict(temperature=0.7, top_k=40),
    "top_k_all_but_one": dict(temperature=0.7, top_k=2999),
    "top_p_95": dict(temperature=0.8, top_p=0.95),
    "top_p_half": dict(temperature=1.0, top_p=0.5),
    "top_p_tiny": dict(temperature=1.0, top_p=1e-9),
    "top_p_almost_1": dict(temperature=1.0, top_p=1 - 1e-12),
    "min_p": dict(temperature=0.9, min_p=0.05),
    "min_p_1": dict(temperature=0.9, min_p=1.0),
    "all": dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02),
}


def oracle_rows(rng, v=3000):
    flat = rng.normal(size=(4, v)) * 0.05
    normal = rng.normal(size=(4, v))
    peaked = rng.normal(size=(4, v)) * 8
    tied = np.round(rng.normal(size=(4, v)) * 2)        # many exact ties, at every cut
    masked = rng.normal(size=(4, v)) * 3
    masked[rng.random(masked.shape) < 0.5] = -np.inf
    return np.concatenate([flat, normal, peaked, tied, masked]).astype(np.float32)


@pytest.mark.parametrize("name", list(ORACLE_MODES))
def test_engine_sampler_draws_the_oracles_tokens(name):
    from sapwood.reference import sampling as oracle
    mode = ORACLE_MODES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2 ** 32)
    x = oracle_rows(rng)
    pos = rng.integers(0, 2 ** 40, size=len(x))
    seed = int(rng.integers(0, 2 ** 63))
    for rows in (x, x.astype(np.float64)):
        got = sample(rows, pos, seed=seed, **mode)
        want = oracle.sample(rows.astype(np.float64), pos.astype(np.uint64), seed=seed, **mode)
        np.testing.assert_array_equal(got, want)
    if name not in ("greedy", "cold", "top_k_1", "top_p_tiny", "min_p_1"):  # not argmax alone
        assert (got != x.argmax(axis=1)).sum() >= 3, "the rows should not all draw the argmax"


@pytest.mark.parametrize("name", ["plain", "top_p_95", "all"])
def test_engine_sampler_at_the_real_vocabulary(name):
    """Qwen3.5's vocabulary (248,320): a random checkpoint's logits (std ~1: top-p 0.95 keeps
    most of the vocabulary) and a peaked row."""
    from sapwood.reference import sampling as oracle
    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(size=248_320), rng.normal(size=248_320) * 6]).astype(np.float32)
    pos = np.array([17, 2 ** 33 + 1], dtype=np.uint64)
    got = sample(x, pos, seed=11, **ORACLE_MODES[name])
    want = oracle.sample(x.astype(np.float64), pos, seed=11, **ORACLE_MODES[name])
    np.testing.assert_array_equal(got, want)


def test_top_p_kept_set_follows_the_ids_under_a_permutation():
    """Top-p's cut depends on the ranks before it, not on where ids sit in the row: a row and
    its permutation keep the same ids (permuted). (Exact sums at the cut:
    test_top_p_cut_where_the_sum_reaches_p_exactly.)"""
    rng = np.random.default_rng(5)
    x = rng.normal(size=4000)
    perm = rng.permutation(4000)
    p = filtered_probs(x, 1.0, top_p=0.9)
    q = filtered_probs(x[perm], 1.0, top_p=0.9)
    np.testing.assert_array_equal(p[perm] > 0, q > 0)
    assert 0 < (p > 0).sum() < 4000


@pytest.mark.parametrize("top_p,kept", [(0.5, {0, 1}), (0.5 + 2 ** -32, {0, 1, 2}), (0.25, {0}),
                                        (0.75, {0, 1, 2}), (1.0, {0, 1, 3})])
def test_top_p_cut_where_the_sum_reaches_p_exactly(top_p, kept):
    """Equal logits have weight 2^40 each (e^0 is exact): the sum before rank r reaches p at an
    exact integer, where a '<' written as '<=' would keep one id more. -inf at id 2 when p = 1."""
    x = np.zeros((300, 4), dtype=np.float32)
    if top_p == 1.0:
        x[:, 2] = -np.inf
    toks = sample(x, np.arange(300), seed=4, temperature=1.0, top_p=top_p)
    assert set(toks.tolist()) == kept
    np.testing.assert_array_equal(filtered_probs(x[0], 1.0, top_p=top_p) > 0,
                                  [i in kept for i in range(4)])


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.3),
                                       dict(presence_penalty=0.7, frequency_penalty=-0.4),
                                       dict(repetition_penalty=0.8, presence_penalty=-2.0,
                                            frequency_penalty=2.0)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_penalties_are_the_references(penalties, temperature):
    """sample(..., history=, penalties) against the oracle: apply_penalties, then the
    reference sampler, token for token; rows built so that the penalties change the pick."""
    from sapwood.reference import sampling as oracle
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(64, 500)) * 2).astype(np.float32)
    top = np.argsort(-x, axis=1)[:, :3].reshape(-1)    # each row's best three, seen 3 times
    history = np.concatenate([rng.integers(0, 500, size=300), top, top, top])
    pos = np.arange(64) + 77
    params = SamplingParams(temperature=temperature, seed=9, **penalties).validate()
    got = sample(x, pos, temperature=temperature, seed=9, history=history, **penalties)
    pen = np.stack([apply_penalties(row, history, params) for row in x])
    want = oracle.sample(pen.astype(np.float64), pos.astype(np.uint64), seed=9,
                         temperature=temperature)
    np.testing.assert_array_equal(got, want)
    plain = sample(x, pos, temperature=temperature, seed=9)
    assert (got != plain).any(), "the penalties should change some picks"
    with pytest.raises(ValueError, match="500"):
        sample(x, pos, temperature=temperature, history=[500], **penalties)
