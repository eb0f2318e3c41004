"""Pathwise Gated DeltaNet: numpy oracle, then bitwise invariances of tree/chain/commit.

Oracle tolerance: the kernel runs in float32 (sequential fmaf over the key dim, float32 state),
the reference in float64. q and k are unit vectors, so |o| <= |S| stays O(1)-O(10) with the
decays used here; a few hundred float32 roundings per step over <= 40 steps stay below 1e-5
relative. 2e-4 absolute (on outputs of size ~1) fails on any wrong head map, tap, gate or path.
"""
import numpy as np
import pytest

from sapwood import _core
from sapwood.reference.gdn import GDNReference
from util import ISAS, TREES, assert_close, isa, path_to, random_tree

SMALL = dict(hk=2, hv=4, dk=16, dv=16, conv_k=4)
REALISTIC = dict(hk=16, hv=48, dk=128, dv=128, conv_k=4)
ATOL = 2e-4


def channels(s):
    return 2 * s["hk"] * s["dk"] + s["hv"] * s["dv"]


def inputs(s, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, channels(s))).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (n, s["hv"])).astype(np.float32)   # log decay <= 0
    beta = rng.uniform(0.1, 0.9, (n, s["hv"])).astype(np.float32)
    return x, g, beta


def make(s, order="grouped", max_pending=8, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((channels(s), s["conv_k"])) * 0.5).astype(np.float32)
    layer = _core.GDNLayer(s["hk"], s["hv"], s["dk"], s["dv"], w, head_order=order,
                           max_pending=max_pending)
    ref = GDNReference(s["hk"], s["hv"], s["dk"], s["dv"], w, head_order=order)
    return layer, ref


def advance(layer, ref, s, prompt, pending, seed):
    """Commit a prompt of `prompt` tokens, then a chain of `pending` tokens (left unfolded)."""
    if prompt:
        x, g, b = inputs(s, prompt, seed)
        layer.prefill(x, g, b)
        ref.verify(x, g, b, np.arange(prompt) - 1)
        ref.commit(list(range(prompt)), max_pending=0)
    if pending:
        x, g, b = inputs(s, pending, seed + 1)
        layer.verify(x, g, b, np.arange(pending) - 1)
        layer.commit(list(range(pending)))
        ref.verify(x, g, b, np.arange(pending) - 1)
        ref.commit(list(range(pending)))
    assert layer.n_pending == pending


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("pending", [0, 1, 3, 8])
@pytest.mark.parametrize("tree", list(TREES))
def test_oracle_small(tree, pending, order):
    s = SMALL
    layer, ref = make(s, order)
    advance(layer, ref, s, prompt=5, pending=pending, seed=3)
    parents = TREES[tree]
    x, g, b = inputs(s, len(parents), 7)
    out = layer.verify(x, g, b, parents)
    assert_close(out, ref.verify(x, g, b, parents), ATOL, f"{tree} pending={pending} {order}")
    path = path_to(parents, len(parents) - 1)
    layer.commit(path)
    ref.commit(path)
    assert_close(layer.folded_state(), ref.folded_state(), ATOL, "state after commit")
    assert_close(layer.window, ref.window, 0.0, "conv window")  # copies of inputs: exact


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("tree", ["chain16", "star16", "random1"])
def test_oracle_realistic(tree, order):
    s = REALISTIC
    layer, ref = make(s, order)
    advance(layer, ref, s, prompt=3, pending=2, seed=5)
    parents = TREES[tree]
    x, g, b = inputs(s, len(parents), 8)
    assert_close(layer.verify(x, g, b, parents), ref.verify(x, g, b, parents), ATOL, tree)


def test_pending_all_counts_match_oracle():
    """Pending 0..8 after a committed path, each against the reference."""
    s = SMALL
    for pending in range(9):
        layer, ref = make(s)
        advance(layer, ref, s, prompt=2, pending=pending, seed=pending)
        x, g, b = inputs(s, 4, 50)
        parents = TREES["random3"][:4]
        assert_close(layer.verify(x, g, b, parents), ref.verify(x, g, b, parents), ATOL,
                     f"pending={pending}")


@pytest.mark.parametrize("s", [SMALL, REALISTIC], ids=["small", "realistic"])
def test_tree_chain_single_bitwise(s):
    layer, _ = make(s)
    x0, g0, b0 = inputs(s, 6, 1)
    layer.prefill(x0, g0, b0)
    parents = random_tree(16, 21)
    x, g, b = inputs(s, 16, 2)
    out_tree = layer.verify(x, g, b, parents)
    for i in [4, 11, 15]:
        path = path_to(parents, i)
        out_chain = layer.verify(x[path], g[path], b[path], np.arange(len(path)) - 1)
        assert (out_chain[-1] == out_tree[i]).all(), f"chain differs at node {i}"
        # Plain decoding: one node at a time, committing each.
        single, _ = make(s)
        single.prefill(x0, g0, b0)
        for j in path:
            o = single.verify(x[j:j + 1], g[j:j + 1], b[j:j + 1], [-1])
            single.commit([0])
        assert (o[0] == out_tree[i]).all(), f"plain decoding differs at node {i}"


@pytest.mark.parametrize("max_pending", [0, 3, 8])
def test_commit_path_equals_token_by_token(max_pending):
    """Committing a path at once leaves the same state, window and next outputs as
    committing its tokens one at a time, whatever the pending limit."""
    s = SMALL
    a, _ = make(s, max_pending=max_pending)
    b_, _ = make(s, max_pending=8)
    x, g, b = inputs(s, 12, 4)
    parents = random_tree(12, 8)
    path = path_to(parents, 11)
    a.verify(x, g, b, parents)
    a.commit(path)
    for j in path:
        b_.verify(x[j:j + 1], g[j:j + 1], b[j:j + 1], [-1])
        b_.commit([0])
    assert (a.folded_state() == b_.folded_state()).all()
    assert (a.window == b_.window).all()
    xn, gn, bn = inputs(s, 5, 9)
    pn = random_tree(5, 3)
    assert (a.verify(xn, gn, bn, pn) == b_.verify(xn, gn, bn, pn)).all()


def test_prefill_equals_chain_commit_bitwise():
    s = SMALL
    a, _ = make(s)
    b_, _ = make(s)
    x, g, b = inputs(s, 20, 6)
    out_a = a.prefill(x, g, b)
    out_b = b_.verify(x, g, b, np.arange(20) - 1)
    b_.commit(list(range(20)))
    assert (out_a == out_b).all()
    assert (a.folded_state() == b_.folded_state()).all()


def test_verify_does_not_change_committed_state():
    s = SMALL
    layer, _ = make(s)
    x, g, b = inputs(s, 8, 1)
    layer.verify(x, g, b, np.arange(8) - 1)
    layer.commit([0, 1, 2])
    st, win = layer.folded_state(), layer.window
    first = layer.verify(x, g, b, TREES["random3"][:8])
    layer.verify(x * 2, g, b, TREES["star16"][:8])
    assert (layer.folded_state() == st).all() and (layer.window == win).all()
    assert (layer.verify(x, g, b, TREES["random3"][:8]) == first).all()


def test_thread_count_bitwise():
    s = REALISTIC
    outs = []
    for threads in [1, 2]:
        layer, _ = make(s)
        x, g, b = inputs(s, 16, 3)
        outs.append(layer.verify(x, g, b, TREES["random1"], threads=threads))
    assert (outs[0] == outs[1]).all()


@pytest.mark.skipif(len(ISAS) < 2, reason="only one kernel variant on this CPU")
@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: conv outputs reach exp's clamps in silu
def test_kernel_variants_bitwise(scale):
    s = SMALL
    outs = []
    for name in ISAS:
        with isa(name):
            layer, _ = make(s)
            x, g, b = inputs(s, 16, 3)
            x = x * np.float32(scale)
            layer.prefill(x[:5], g[:5], b[:5])
            outs.append(layer.verify(x, g, b, TREES["random2"]))
    for o in outs[1:]:
        assert (o == outs[0]).all()
