"""Allowed-token masks in the keyed sampler (a grammar's constraint): the engine's sampler
(csrc/sampler.cpp) against the numpy oracle (reference/sampling.py) with ==. Both compute
the same scaled logits, integer top-p weights and libm exp/log over the masked row, so any
difference is a bug, not rounding: the tolerance is zero."""
import numpy as np
import pytest

from sapwood import _core
from sapwood.reference import sampling as oracle
from sapwood.reference.sampling import apply_penalties
from sapwood.sampling import SamplingParams, sample

from test_sampling import ORACLE_MODES, oracle_rows


def pack(ok: np.ndarray, dtype=np.int32) -> np.ndarray:
    """bool [N, V] -> bitmasks [N, ceil(V/32)] in llguidance's layout (bit i % 32 of word
    i // 32), built independently of reference.allowed."""
    n, v = ok.shape
    words = np.zeros((n, (v + 31) // 32), np.uint64)
    for i in range(v):
        words[:, i // 32] |= ok[:, i].astype(np.uint64) << np.uint64(i % 32)
    return words.astype(np.uint32).view(dtype)


def masks_for(rng, x):
    """Per row a mask of another kind: half the ids, 1%, a single id (not the argmax), all
    but the argmax, everything; every row keeps at least one finite logit."""
    n, v = x.shape
    ok = np.zeros((n, v), bool)
    for r in range(n):
        kind = r % 5
        if kind == 0:
            ok[r] = rng.random(v) < 0.5
        elif kind == 1:
            ok[r] = rng.random(v) < 0.01
        elif kind == 2:
            ok[r, int(np.argsort(-x[r])[7])] = True
        elif kind == 3:
            ok[r] = True
            ok[r, int(x[r].argmax())] = False
        else:
            ok[r] = True
        finite = np.isfinite(x[r])
        if not (ok[r] & finite).any():
            ok[r, int(np.flatnonzero(finite)[0])] = True
    return ok


@pytest.mark.parametrize("name", list(ORACLE_MODES))
def test_masked_engine_sampler_draws_the_oracles_tokens(name):
    mode = ORACLE_MODES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2 ** 32)
    x = oracle_rows(rng, v=3001)  # V not a multiple of 32: the last word is partial
    ok = masks_for(rng, x)
    pos = rng.integers(0, 2 ** 40, size=len(x))
    seed = int(rng.integers(0, 2 ** 63))
    for dtype in (np.int32, np.uint32):
        mask = pack(ok, dtype)
        for rows in (x, x.astype(np.float64)):
            got = sample(rows, pos, seed=seed, mask=mask, **mode)
            want = oracle.sample(rows.astype(np.float64), pos.astype(np.uint64), seed=seed,
                                 mask=mask, **mode)
            np.testing.assert_array_equal(got, want)
            assert ok[np.arange(len(x)), got].all(), "a disallowed id was drawn"
    unmasked = sample(x, pos, seed=seed, **mode)
    assert (got != unmasked).sum() >= 3, "the masks should change some picks"


def test_greedy_takes_the_allowed_argmax():
    x = np.array([[5.0, 1.0, 4.0, 4.0, -np.inf]], np.float32)
    ok = np.array([[False, True, True, True, True]])
    assert sample(x, [3], mask=pack(ok)).tolist() == [2]  # tie 4.0: lower id
    assert sample(x[0], 3, mask=pack(ok)[0]) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_masks_with_penalties_are_the_references(temperature):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(40, 500)) * 2).astype(np.float32)
    ok = masks_for(rng, x)
    history = rng.integers(0, 500, size=200)
    kw = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.3)
    params = SamplingParams(temperature=temperature, seed=2, **kw).validate()
    pos = np.arange(40) + 9
    got = sample(x, pos, temperature=temperature, seed=2, history=history, mask=pack(ok), **kw)
    pen = np.stack([apply_penalties(row, history, params) for row in x])
    want = oracle.sample(pen.astype(np.float64), pos.astype(np.uint64), seed=2,
                         temperature=temperature, mask=pack(ok))
    np.testing.assert_array_equal(got, want)


def test_masked_sampler_at_the_real_vocabulary():
    rng = np.random.default_rng(3)
    v = 248_320
    x = np.stack([rng.normal(size=v), rng.normal(size=v) * 6]).astype(np.float32)
    ok = np.zeros((2, v), bool)
    ok[0, rng.choice(v, 300, replace=False)] = True   # a JSON state: a few hundred ids
    ok[1] = rng.random(v) < 0.9                        # free text inside a string
    pos = np.array([17, 2 ** 33 + 1], dtype=np.uint64)
    for mode in ("greedy", "plain", "all"):
        got = sample(x, pos, seed=11, mask=pack(ok), **ORACLE_MODES[mode])
        want = oracle.sample(x.astype(np.float64), pos, seed=11, mask=pack(ok),
                             **ORACLE_MODES[mode])
        np.testing.assert_array_equal(got, want)


def walk_oracle(logits, tokens, parents, base, ok, **kw):
    """The walk (sampler.h) over the oracle: at each node the masked pick at its position."""
    node, path, picks = 0, [], []
    while True:
        depth = len(path)
        pick = int(oracle.sample(logits[node:node + 1].astype(np.float64),
                                 np.array([base + depth + 1], np.uint64),
                                 mask=pack(ok[node:node + 1]), **kw)[0])
        path.append(node)
        picks.append(pick)
        kids = [j for j in range(node + 1, len(tokens)) if parents[j] == node and tokens[j] == pick]
        if not kids:
            return path, picks
        node = kids[0]


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, top_p=0.9, seed=5)])
def test_walk_draws_each_node_from_its_own_mask(kw):
    """A tree whose nodes' masks differ: the walk's pick at each node is the oracle's under
    that node's mask. Children carry the masked picks, so the walk goes deep."""
    rng = np.random.default_rng(1)
    v, n = 200, 12
    logits = (rng.normal(size=(n, v)) * 3).astype(np.float32)
    ok = rng.random((n, v)) < 0.3
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 7]
    tokens = [int(rng.integers(v)) for _ in range(n)]
    base = 40
    for node in range(n):  # top-down: the first child of each node takes its masked pick
        kids = [j for j in range(1, n) if parents[j] == node]
        if kids:
            depth = 0
            a = node
            while parents[a] >= 0:
                a, depth = parents[a], depth + 1
            tokens[kids[0]] = int(oracle.sample(
                logits[node:node + 1].astype(np.float64), np.array([base + depth + 1], np.uint64),
                mask=pack(ok[node:node + 1]), **kw)[0])
    want = walk_oracle(logits, tokens, parents, base, ok, **kw)
    got = _core.walk(logits, tokens, parents, base, mask=pack(ok), **kw)
    assert tuple(map(list, got)) == tuple(want)
    assert len(want[0]) >= 4
    assert got != _core.walk(logits, tokens, parents, base, **kw)


def test_a_mask_that_allows_nothing_is_refused_naming_the_row():
    x = np.zeros((3, 40), np.float32)
    x[2, :20] = -np.inf
    ok = np.ones((3, 40), bool)
    ok[1] = False
    with pytest.raises(ValueError, match="token mask row 1 allows no token"):
        sample(x, [0, 1, 2], mask=pack(ok), temperature=0.5)
    with pytest.raises(ValueError, match="token mask row 1 allows no token"):
        oracle.sample(x.astype(np.float64), np.arange(3, dtype=np.uint64), mask=pack(ok))
    ok[1] = True
    ok[2, 20:] = False  # only -inf logits left
    with pytest.raises(ValueError, match="row 2 allows only tokens whose logits are -inf"):
        sample(x, [0, 1, 2], mask=pack(ok))
    # bits past V do not count as allowing anything
    ok2 = np.zeros((1, 40), bool)
    m = pack(ok2)
    m[0, 1] |= np.int32(1 << 20)  # id 52 >= V
    with pytest.raises(ValueError, match="allows no token"):
        sample(x[:1], [0], mask=m)
    assert sample(x, [0, 1, 2]).tolist() == [0, 0, 20]  # usable after the errors


@pytest.mark.parametrize("mask, match", [
    (np.zeros((2, 2), np.int32), r"mask has shape \(2, 2\), expected \(2, 1\)"),
    (np.zeros((2, 1), np.float32), "int32 or uint32"),
    (np.zeros((2, 1), np.int64), "int32 or uint32"),
    ([[1], [1]], "int32 or uint32"),  # a list is made an int64 array
])
def test_bad_masks_are_refused(mask, match):
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(ValueError, match=match):
        sample(x, [0, 1], mask=mask)
    with pytest.raises(ValueError, match="numpy array"):  # the engine's own check
        _core.sample(x, np.arange(2, dtype=np.uint64), mask=[[1], [1]])
