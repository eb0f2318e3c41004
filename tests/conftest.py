import numpy as np
import pytest

from util import ISAS, isa


@pytest.fixture(params=ISAS)
def each_isa(request):
    """Run the test under every kernel variant built and supported here (generic is the
    oracle-like baseline; SIMD variants must match it bitwise)."""
    with isa(request.param):
        yield request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
