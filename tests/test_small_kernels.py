"""The small kernels (RMSNorm, SiLU-gate, log-sum-exp) against their float64 oracles, on every
ISA, and bitwise equal across ISAs."""
import numpy as np
import pytest

from sapwood import _core
from sapwood.reference.gdn import silu
from sapwood.reference.model import rms_norm, sigmoid
from sapwood.reference.ranking import logsumexp
from util import ISAS, assert_close, isa


def on_every_isa(fn):
    """fn() under each ISA; asserts the results are bitwise equal and returns the first."""
    outs = []
    for name in ISAS:
        with isa(name):
            outs.append(np.asarray(fn()))
    for o in outs[1:]:
        assert (o == outs[0]).all()
    return outs[0]


@pytest.mark.parametrize("n,d", [(1, 64), (9, 288), (3, 100)])
def test_rms_norm(rng, n, d):
    x = (rng.standard_normal((n, d)) * 3).astype(np.float32)
    w1 = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # the scale as applied
    got = on_every_isa(lambda: _core.rms_norm(x, w1, 1e-6))
    # float32: a sequential sum of d <= 288 squares (relative error ~ d * 6e-8 <= 2e-5) and
    # three roundings per output; outputs are O(3), so 2e-4 holds with room, a wrong eps, mean
    # or scale moves them by 1e-2 or more. The oracle takes HF's weight, w1 - 1 (exact).
    assert_close(got, rms_norm(x.astype(np.float64), w1.astype(np.float64) - 1, 1e-6), 2e-4, "rms_norm")
    # in place (the engine normalises key heads over themselves): the same bits in x's buffer
    y = x.copy()
    assert _core.rms_norm(y, w1, 1e-6, inplace=True) is y and (y == got).all()
    with pytest.raises(ValueError, match="inplace"):  # a strided view has no buffer to write
        _core.rms_norm(np.repeat(x, 2, axis=1)[:, ::2], w1, 1e-6, inplace=True)


ACTS = {"silu_mul": silu, "sigmoid_mul": sigmoid}


@pytest.mark.parametrize("kernel", sorted(ACTS))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n", [1, 8, 13, 29, 864])  # 29: 16 lanes, then 8, then scalar
def test_act_mul(rng, n, gated, kernel):
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32) if gated else None
    got = on_every_isa(lambda: getattr(_core, kernel)(x, u))
    want = ACTS[kernel](x.astype(np.float64)) * (u.astype(np.float64) if gated else 1.0)
    # the canonical exp is within 2 ulp of exp, then a division and a product: a few float32
    # ulps of outputs of size <= 16, so 1e-5 absolute
    assert_close(got, want, 1e-5, kernel)


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096, 151936])
def test_logsumexp(rng, n, peaked):
    x = rng.standard_normal(n).astype(np.float32)
    if peaked:  # as a confident draft gives: most terms underflow against the peak
        x = x * 30
        x[rng.integers(0, n)] = 120.0
    got = float(on_every_isa(lambda: _core.logsumexp(x)))
    # each canonical exp is within 2 ulp of float32 exp (2.4e-7 relative) and the float64 sum
    # adds next to nothing, so the log is within ~2.4e-7; 1e-6 leaves room, while one term
    # dropped from a flat row of 151936 (1/151936 = 6.6e-6) would not fit in it
    assert abs(got - logsumexp(x)) <= 1e-6


@pytest.mark.parametrize("n", [1, 7, 8, 13, 16, 17, 4096])
def test_argmax_first_largest_skipping_nan(rng, n):
    """The first index of the largest value, NaNs skipped, on every ISA; ties and special
    values placed where each lane width (16, 8, scalar tail) sees them."""
    x = rng.standard_normal(n).astype(np.float32)
    assert on_every_isa(lambda: _core.argmax(x)) == int(np.argmax(x))
    for where in sorted({0, n // 2, n - 1}):
        t = x.copy()
        t[where:] = np.where(np.arange(n - where) % 3 == 0, 5.0, t[where:])  # ties: the first wins
        assert on_every_isa(lambda: _core.argmax(t)) == where
        t[where] = np.nan  # skipped, wherever it is (np.argmax would return it)
        nan_free = np.where(np.isnan(t), -np.inf, t)
        assert on_every_isa(lambda: _core.argmax(t)) == int(np.argmax(nan_free))
    assert on_every_isa(lambda: _core.argmax(np.full(n, np.nan, np.float32))) == 0
    assert on_every_isa(lambda: _core.argmax(np.full(n, -np.inf, np.float32))) == 0
    signed = np.zeros(n, np.float32)
    signed[0] = -0.0
    assert on_every_isa(lambda: _core.argmax(signed)) == 0  # -0 == +0: the first


@pytest.mark.parametrize("n", [2, 9, 16, 17, 40, 4096])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_ids_best_first_lower_id_on_ties(rng, n, k):
    """The k best ids other than skip, best first, ties by lower id, NaN never: the draft's
    candidates; the same on every ISA, against a stable sort."""
    k = min(k, n - 1)
    x = rng.integers(-4, 5, n).astype(np.float32)  # few values: many ties
    x[rng.integers(0, n, max(1, n // 7))] = np.nan
    for skip in (-1, int(np.nanargmax(x)), n - 1):
        keys = np.where(np.isnan(x), np.inf, -x)
        order = [int(i) for i in np.argsort(keys, kind="stable") if i != skip and not np.isnan(x[i])]
        want = (order + [-1] * k)[:k]
        assert on_every_isa(lambda: _core.top_ids(x, k, skip)).tolist() == want


def test_small_kernels_check_their_input():
    with pytest.raises(ValueError, match="empty"):
        _core.logsumexp(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        _core.logsumexp(np.array([1.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="w"):
        _core.rms_norm(np.ones((2, 4), np.float32), np.ones(3, np.float32), 1e-6)
    for kernel in ACTS:
        with pytest.raises(ValueError, match="u"):
            getattr(_core, kernel)(np.ones(4, np.float32), np.ones(5, np.float32))


def test_silu_mul_clamps_agree_on_every_isa():
    """exp's clamps (0 below -87.3, clamped above 88.3), huge values and signed zeros, in
    positions that every lane width (16, 8, scalar) sees (non-finite inputs are refused)."""
    v = np.array([-1e4, -88.0, -87.3, -87.29, 0.0, -0.0, 87.0, 88.3, 88.4, 1e4, 3e38, -3e38,
                  1e-30, -1e-30, 3.5, -3.5], np.float32)
    x = np.concatenate([v, v[::-1], v[:5]])
    # compared as bits (signed zeros included)
    got = on_every_isa(lambda: _core.silu_mul(x, None).view(np.uint32)).view(np.float32)
    assert (got[x > 20] == x[x > 20]).all()  # 1 + exp(-x) rounds to 1
    sig = on_every_isa(lambda: _core.sigmoid_mul(x, None).view(np.uint32)).view(np.float32)
    # exp(-x) is clamped at exp(88.3): far below zero the sigmoid is ~4.5e-39, not 0
    assert (sig[x > 20] == 1.0).all() and (sig[x < -88] < 1e-38).all()
