"""The policy cache as input from outside the process (issue 50, cases 5-7): crafted files that
passed the old checks and then broke every generate with that drafter (with an error naming no
file), a file of thousands of entries that slowed generation 100-170x, a FIFO that blocked
forever, a link to /dev/zero read until memory ran out, a full disk that left a temporary file
per request. Now only a regular file under a size cap is read, every field is checked, anything
invalid is ignored with one warning naming the file, and the tokens are those of no cache.
Property tests (hypothesis, derandomized) feed arbitrary JSON and mutated valid states."""
from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import threading
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sapwood
from sapwood import policy_cache
from sapwood.policy import Policy
from sapwood.testing import make_tiny_checkpoint

# a prompt that repeats, so the lookup drafter drafts and the policy plans, prices and learns
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 12, 13, 5, 6, 7, 8]
GEN = dict(max_tokens=16, drafter="lookup", verify="auto")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    make_tiny_checkpoint(d, seed=4)
    m = sapwood.load(d, weights="f32", max_context=256)
    return m, m.generate(PROMPT, max_tokens=16, verify="off").tokens


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(policy_cache, "_warned", set(), raising=False)


def cache_file(m):
    return policy_cache.path_for(policy_cache.key(m.identity(), repr("lookup")))


def valid_file(m):
    """A cache file as generate writes it (what the mutations start from)."""
    m.reset_policies()
    m.generate(PROMPT, **GEN)
    m.generate(PROMPT[:11], **GEN)
    f = cache_file(m)
    assert f.is_file()
    return json.loads(f.read_text())


def generate_with(m, want, content=None):
    """generate() after the cache file is `content` (bytes or JSON data; None: as it is):
    the tokens of no cache, and the warnings it gave."""
    f = cache_file(m)
    if content is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(content if isinstance(content, bytes) else
                      json.dumps(content, allow_nan=True).encode())
    m.reset_policies()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = m.generate(PROMPT, **GEN)
    assert out.tokens == want
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def with_state(data, **changes):
    data = json.loads(json.dumps(data))
    for path, value in changes.items():
        node = data["state"]
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        node[int(last) if isinstance(node, list) else last] = value
    return data


def first_verify_entry(data):
    return next(i for i, e in enumerate(data["state"]["costs"]) if e[1] == "verify")


INF = 1.25e-300  # a sentinel written as 1e999, which JSON parses as infinity


def raw(data) -> bytes:
    return json.dumps(data, allow_nan=True).replace(repr(INF), "1e999").encode()


def test_crafted_states_are_ignored_with_one_warning_naming_the_file(model):
    m, want = model
    data = valid_file(m)
    i = first_verify_entry(data)
    rows_band = next(iter(data["state"]["rows"]))
    crafted = [  # each passed the old checks; the first ones then raised in every generate
        with_state(data, **{f"costs__{i}__2": None}),          # a node count of None
        with_state(data, **{f"costs__{i}__2": "4"}),           # ... or a string
        with_state(data, **{f"costs__{i}__2": True}),          # ... or a bool
        with_state(data, **{f"costs__{i}__2": 10 ** 6}),       # ... or far past any tree
        with_state(data, **{f"costs__{i}__3": [INF]}),         # an infinite timing
        with_state(data, **{f"costs__{i}__3": []}),            # no timings at all
        with_state(data, **{f"rows__{rows_band}__0__1": INF}),
        with_state(data, **{f"rows__{rows_band}__1__1": -5.0}),
        with_state(data, **{"level": {"0": INF}}),
        with_state(data, **{"wide_vs_chain": {"0": [INF, 1.0, 1.0]}}),
        with_state(data, **{"acceptance__-1__0__0__0__0": INF}),
        with_state(data, **{"rows": {"99": [[0.0] * 33, [0.0] * 33]}}),
        with_state(data, **{"acceptance__-1__0__0__0__0": math.nan}),  # NaN: not JSON at all
    ]
    f = cache_file(m)
    for n, bad in enumerate(crafted):
        got = generate_with(m, want, raw(bad))
        assert len(got) == 1 and str(f) in got[0], (n, got)
        assert "ignoring the policy cache" in got[0]
        assert generate_with(m, want, raw(bad)) == []  # once per file and problem per process
    assert generate_with(m, want, data) == []  # a valid file is taken, silently


def test_a_file_of_thousands_of_entries_is_refused(model):
    """Thousands of node counts made every round's Theil-Sen fit quadratic in them."""
    m, want = model
    data = valid_file(m)
    costs = [[0, "verify", n, [1e-4 * n] * 4] for n in range(1, 5000)]
    cache_file(m).write_text(json.dumps(with_state(data, costs=costs)))
    pol = Policy()
    with pytest.warns(RuntimeWarning, match="4999 entries, more than"):
        assert not policy_cache.load(pol, policy_cache.key(m.identity(), repr("lookup")))
    assert not pol.costs.t  # nothing of it taken in
    got = generate_with(m, want)
    assert got == []  # warned once already


def test_a_fifo_at_the_path_does_not_block(model):
    m, want = model
    f = cache_file(m)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.unlink(missing_ok=True)
    os.mkfifo(f)
    result = []
    t = threading.Thread(target=lambda: result.append(generate_with(m, want)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader the old code left waiting for a writer
        os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO at the cache's path blocked")
    assert len(result[0]) == 1 and "not a regular file" in result[0][0]


def test_links_and_oversized_files_are_not_read(model, tmp_path):
    m, want = model
    f = cache_file(m)
    f.parent.mkdir(parents=True, exist_ok=True)
    real = tmp_path / "real.json"
    real.write_text(json.dumps(valid_file(m)))
    f.unlink()
    f.symlink_to(real)
    got = generate_with(m, want)
    assert len(got) == 1 and "symbolic link" in got[0]
    f.unlink()
    with open(f, "wb") as out:  # sparse: no disk used, but past the cap
        out.truncate(policy_cache.MAX_BYTES + 1)
    got = generate_with(m, want)
    assert len(got) == 1 and "bytes, more than" in got[0]


def test_a_link_to_dev_zero_is_not_read(tmp_path):
    """In a child limited to 2 GiB of address space: the old code read /dev/zero until that
    ran out."""
    code = f"""
import resource, warnings
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from sapwood import policy_cache
from sapwood.policy import Policy
k = policy_cache.key({{"path": "t"}}, "lookup")
p = policy_cache.path_for(k)
p.parent.mkdir(parents=True, exist_ok=True)
p.symlink_to("/dev/zero")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    print(policy_cache.load(Policy(), k), [str(w.message) for w in seen])
"""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("False") and "symbolic link" in r.stdout


def test_a_failed_write_leaves_no_temporary_file(model, monkeypatch):
    m, want = model
    f = cache_file(m)
    f.parent.mkdir(parents=True, exist_ok=True)

    class Full:  # the disk is full: every write fails
        def __init__(self, fd):
            self.fd = fd

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            os.close(self.fd)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    m.reset_policies()
    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as seen:
        patch.setattr(policy_cache.os, "fdopen", lambda fd, mode: Full(fd))
        warnings.simplefilter("always")
        for _ in range(5):
            assert m.generate(PROMPT, **GEN).tokens == want
    msgs = [str(w.message) for w in seen]
    assert len(msgs) == 1 and "No space left" in msgs[0] and str(f) in msgs[0]
    assert [p.name for p in f.parent.iterdir() if p.name.endswith(".tmp")] == []
    # a directory in the way of the rename: the same
    policy_cache._warned = set()
    f.unlink(missing_ok=True)
    f.mkdir()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert m.generate(PROMPT, **GEN).tokens == want
    assert len([w for w in seen if "could not write" in str(w.message)]) == 1
    assert [p.name for p in f.parent.iterdir() if p.name.endswith(".tmp")] == []
    f.rmdir()


# ---- properties ----------------------------------------------------------------------------

PROPS = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["verify", "draft", "rest", "chain", "plain", "tree", "-1", "0", "8"]),
    lambda kids: (st.lists(kids, max_size=5)
                  | st.dictionaries(st.text(max_size=4), kids, max_size=4)),
    max_leaves=12)


@st.composite
def mutated(draw, base):
    """`base` with a few of its values, anywhere in it, replaced by arbitrary JSON."""
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        node, key = data, "state"
        for _ in range(draw(st.integers(0, 6))):
            child = node[key]
            if isinstance(child, dict) and child:
                node, key = child, draw(st.sampled_from(sorted(child)))
            elif isinstance(child, list) and child:
                node, key = child, draw(st.integers(0, len(child) - 1))
            else:
                break
        node[key] = draw(json_values)
    return data


def check_property(m, want, content):
    got = generate_with(m, want, content)
    assert len(got) <= 1 and all(str(cache_file(m)) in w for w in got), got


def test_property_mutated_valid_states(model):
    m, want = model
    base = valid_file(m)

    @PROPS
    @given(data=mutated(base))
    def prop(data):
        check_property(m, want, data)

    prop()


def test_property_arbitrary_json(model):
    m, want = model
    key = json.loads(json.dumps(policy_cache.key(m.identity(), repr("lookup"))))

    @PROPS
    @given(state=json_values, whole=st.booleans(), junk=st.binary(max_size=40))
    def prop(state, whole, junk):
        content = ({"version": policy_cache.VERSION, "key": key, "state": state} if whole
                   else junk if isinstance(state, str) else state)
        check_property(m, want, content)

    prop()
