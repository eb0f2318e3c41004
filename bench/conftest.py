"""Benchmarks (pytest-benchmark): `python -m pytest bench --benchmark-only`.

Each benchmark records its effective bytes/s in extra_info next to the machine's streaming read
bandwidth, measured here in the same process (the memory floor).
"""
import pytest

from sapwood import _core


@pytest.fixture(scope="session")
def read_bw():
    return _core.read_bandwidth(1 << 29, 0, 3)
