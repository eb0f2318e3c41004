"""The server's text handling: stop strings against the naive per-token search, incremental
decoding against decoding the whole."""
import importlib.util
import os

import numpy as np
import pytest

_MISSING = [m for m in ("fastapi", "uvicorn", "pydantic", "prometheus_client")
            if importlib.util.find_spec(m) is None]
if _MISSING and os.environ.get("CI"):  # CI installs the extra: there the tests must run
    raise ImportError(f"CI without the server extra's packages {_MISSING}")
if _MISSING:
    pytest.skip(f"the server extra is not installed here (missing {', '.join(_MISSING)}): "
                'pip install "sapwood[server]"', allow_module_level=True)

import sapwood  # noqa: E402
from sapwood.server.text import IncrementalDecoder, TokenText  # noqa: E402
from sapwood.testing import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    make_tiny_checkpoint(root / "m", seed=1)
    return sapwood.load(root / "m")


def _naive_stop(chunks, stops):
    """Model.generate's rule: after each chunk, cut at the earliest first occurrence."""
    text = ""
    for c in chunks:
        text += c
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return text, False


def _held(text, stops):
    """The longest suffix of text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stop_matcher_against_the_naive_search():
    rng = np.random.default_rng(0)
    for trial in range(400):
        alphabet = "ab" if trial % 2 else "abc\u00e9"
        stops = ["".join(rng.choice(list(alphabet), int(rng.integers(1, 5))))
                 for _ in range(int(rng.integers(1, 4)))]
        # (a token whose text is empty waits, like one inside a UTF-8 character, for the
        # text that follows it: tokens here have text)
        chunks = ["".join(rng.choice(list(alphabet), int(rng.integers(1, 4))))
                  for _ in range(int(rng.integers(1, 12)))]
        want, stopped = _naive_stop(chunks, stops)
        # chunks are tokens that decode to themselves (ids index the chunk list)
        tt = TokenText(lambda ids: "".join(chunks[i] for i in ids), stops)
        seen = ""
        hit = False
        for i in range(len(chunks)):
            hit = tt.push(i)
            shown = tt.text[:tt.released]
            assert shown.startswith(seen) and want.startswith(shown), (stops, chunks)
            if not hit:  # everything but what may still become a stop string is shown
                assert len(shown) == len(tt.text) - _held(tt.text, stops), (stops, chunks)
            seen = shown
            if hit:
                break
        if not hit:
            tt.flush()
        assert (tt.text[:tt.released], hit) == (want, stopped), (stops, chunks)
        # a token is kept when its text lies within what was returned
        ends = np.cumsum([len(c) for c in chunks[:len(tt.ends)]])
        assert tt.kept_tokens() == int(np.sum(ends <= len(want)))


def test_incremental_decoding_equals_decoding_the_whole(ref):
    rng = np.random.default_rng(1)
    for trial in range(20):
        ids = [int(t) for t in rng.integers(0, ref.config.vocab_size, 60)]
        d = IncrementalDecoder(ref.decode)
        text = "".join(d.push(t) for t in ids) + d.flush()
        assert text == ref.decode(ids)
