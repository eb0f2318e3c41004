"""The logsumexp kernel (draft ranking) against its float64 oracle, on every ISA."""
import numpy as np
import pytest

from sapwood import _core
from sapwood.reference.ranking import logsumexp
from util import ISAS, isa


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096, 151936])
def test_logsumexp_matches_the_oracle_and_every_isa_bitwise(rng, n, peaked):
    x = rng.standard_normal(n).astype(np.float32)
    if peaked:  # as a confident draft gives: most terms underflow against the peak
        x = x * 30
        x[rng.integers(0, n)] = 120.0
    got = {}
    for name in ISAS:
        with isa(name):
            got[name] = _core.logsumexp(x)
    # each canonical exp is within 2 ulp of float32 exp (2.4e-7 relative) and the float64 sum
    # adds next to nothing, so the log is within ~2.4e-7; 1e-6 leaves room, while one term
    # dropped from a flat row of 151936 (1/151936 = 6.6e-6) would not fit in it
    assert abs(got[ISAS[0]] - logsumexp(x)) <= 1e-6
    assert len(set(got.values())) == 1, got


def test_logsumexp_checks_its_input():
    with pytest.raises(ValueError, match="empty"):
        _core.logsumexp(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        _core.logsumexp(np.array([1.0, np.nan], np.float32))
