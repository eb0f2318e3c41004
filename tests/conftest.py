import numpy as np
import pytest

from sapwood import _core
from util import ISAS, isa


# The engine's own threshold, read at import before the session fixture below lifts it.
DEFAULT_MIN_PARALLEL_WORK = _core.min_parallel_work()


@pytest.fixture(scope="module")
def engine_default_parallel_work():
    """The engine's own threshold back for a module (the server tests): they run ten engines'
    pools on a shared machine, where a parallel region around every test-sized op cost more
    than the op (a 24-token request took seconds instead of milliseconds); results never
    depend on it."""
    old = _core.min_parallel_work()
    _core.set_min_parallel_work(DEFAULT_MIN_PARALLEL_WORK)
    yield
    _core.set_min_parallel_work(old)


@pytest.fixture(autouse=True, scope="session")
def parallel_regions_everywhere():
    """Test-sized problems fall below the engine's minimum work for a parallel region; lift it
    so thread-count tests run the multi-threaded paths (results never depend on it)."""
    old = _core.min_parallel_work()
    _core.set_min_parallel_work(0)
    yield
    _core.set_min_parallel_work(old)


@pytest.fixture(autouse=True)
def policy_cache_in_a_temporary_directory(tmp_path_factory, monkeypatch):
    """The speculation policy's cache (policy_cache.py) lives in a fresh directory per test:
    never the user's, and no test starts from another's calibration."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("SAPWOOD_POLICY_CACHE", raising=False)


@pytest.fixture(params=ISAS)
def each_isa(request):
    """Run the test under every kernel variant built and supported here (generic is the
    oracle-like baseline; SIMD variants must match it bitwise)."""
    with isa(request.param):
        yield request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
