"""Shared test helpers: one assert_close, tree shapes, kernel-variant selection."""
from __future__ import annotations

import contextlib

import numpy as np

from sapwood import _core


def assert_close(actual, expected, atol, what=""):
    """Max-abs comparison against a float64 oracle; the caller states why `atol` is right."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"
    return err


def chain(n):
    return np.arange(n) - 1


def star(n):
    p = np.zeros(n, np.int64)
    p[0] = -1
    return p


def random_tree(n, seed):
    rng = np.random.default_rng(seed)
    p = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    return p


TREES = {
    "single": np.array([-1]),
    "chain16": chain(16),
    "star16": star(16),
    **{f"random{s}": random_tree(n, s) for s, n in [(1, 16), (2, 16), (3, 9), (4, 13)]},
}


def path_to(parents, i):
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


def logit_rows(rng, cols):
    """Rows of logits for the drafting selections: ties, NaNs, -inf, signed zeros."""
    x = rng.integers(-4, 5, (8, cols)).astype(np.float32)  # few values: many ties
    x[1, rng.integers(0, cols, max(1, cols // 5))] = np.nan
    x[2] = np.nan
    x[3] = -np.inf
    x[3, cols // 2:] = np.nan
    x[4, 0], x[4, -1] = np.nan, -np.inf
    x[4, 1:-1] = np.nan
    x[5, :] = 0.0
    x[5, 0] = -0.0
    x[6, -1] = 9.0  # the best at the last column
    return x


@contextlib.contextmanager
def isa(name):
    old = _core.isa()
    _core.set_isa(name)
    try:
        yield
    finally:
        _core.set_isa(old)


ISAS = _core.available_isas()


def require_packages(*extra: str) -> None:
    """Skip the calling module when the server extra (or `extra`) is missing here; under CI,
    which installs them, fail instead: there the tests must run."""
    import importlib.util
    import os

    import pytest

    names = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx", *extra)
    missing = [m for m in names if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI"):
        raise ImportError(f"CI without the packages {missing}")
    if missing:
        pytest.skip(f"missing here: {', '.join(missing)}: pip install \"sapwood[server,test]\"",
                    allow_module_level=True)


def tiny_server_target(root, **kw):
    """A tiny checkpoint for server tests at root/target: two layers, no eos (random models hit
    eos at once; without it max_tokens ends a choice)."""
    import json

    from sapwood.testing import make_tiny_checkpoint

    make_tiny_checkpoint(root / "target", seed=1, layers=2, **kw)
    (root / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return root / "target"


class LiveServer:
    """A built server (sapwood.server.build) running on a free loopback port, with an httpx
    client whose every request is bounded by `timeout`: a hang fails instead of hanging."""

    def __init__(self, st, timeout):
        import httpx

        from sapwood import server

        self.st = st
        self.running = server.start(st)
        self.url, self.port = self.running.url, self.running.port
        self.http = httpx.Client(base_url=self.url, timeout=timeout)

    def post(self, body, path="/v1/completions", raw=False):
        """body: JSON-able, or the raw bytes to send (raw=True)."""
        import json

        content = body if raw else json.dumps(body)
        return self.http.post(path, content=content, headers={"content-type": "application/json"})

    def close(self):
        self.http.close()
        self.running.close()


def concurrent_equals_solo(call, reqs, timeout, reps=3) -> list:
    """call(req) for each request alone, then each `reps` times at once from threads (a load
    across the server's slots): every concurrent answer equals the request's solo answer.
    Returns the solo answers."""
    import threading

    solo = [call(r) for r in reqs]
    got, errors = {}, []

    def one(i, rep):
        try:
            got[(i, rep)] = call(reqs[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i, rep)) for rep in range(reps)
               for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors and len(got) == reps * len(reqs), errors
    for (i, _), out in got.items():
        assert out == solo[i], i
    return solo
