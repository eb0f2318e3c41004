"""Benchmarks (pytest-benchmark): `python -m pytest bench --benchmark-only`.

Each benchmark records its effective bytes/s in extra_info next to the machine's streaming read
bandwidth, measured here in the same process (the memory floor).
"""
import os

import pytest

from sapwood import _core


@pytest.fixture(scope="session")
def read_bw():
    small = os.environ.get("SAPWOOD_BENCH_SMOKE") == "1"  # the smoke run times nothing
    return _core.read_bandwidth(1 << (20 if small else 29), 0, 1 if small else 3)
