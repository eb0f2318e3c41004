"""Tree attention over int8 KV pages: numpy oracle, then bitwise invariances.

Tolerance for the oracle: over an int8 pool the kernel scores int8 queries against the int8
keys (exact int32 dot per 32-dim group, then a float32 fmaf over the groups), so the oracle is
the float64 softmax over the same operands: int8_queries(q), the dequantized keys and values.
What is left is float32 rounding (8 group terms per score, sequential sums over up to 8208
keys); outputs are convex combinations of values of size ~1-4 whose float32 error is well
under 1e-5 in practice (about sqrt(n) * 6e-8 each); 1e-4 absolute leaves a wide margin yet
fails on any real bug (a wrong mask, key or scale moves outputs by 1e-2 or more).

Against the fp32 queries the error is the query quantization's, bounded in
test_int8_query_error_bound.
"""
import functools

import numpy as np
import pytest

from sapwood import _core
from sapwood.reference import kv as refkv
from sapwood.reference.tree_attention import (int8_queries, tree_attention_naive,
                                               tree_attention_split)
from util import ISAS, TREES, assert_close, isa, path_to, random_tree

SMALL = (4, 2, 64)      # Hq, Hkv, D
REALISTIC = (24, 4, 256)
ODD_DIM = (2, 1, 96)     # D % 64 == 32: a head dim that is not a whole number of 64-dim blocks
HISTORIES = [0, 1, 31, 32, 33, 1000, 4096, 8192]
ATOL = 1e-4


@functools.lru_cache(maxsize=None)
def history(shape, p, page_size=64):
    """A sequence holding p random committed positions (cached: building 8192 is not free)."""
    hq, hkv, d = shape
    rng = np.random.default_rng(p * 7 + d)
    pool = _core.KVPagePool(num_pages=(p + 64) // page_size + 2, page_size=page_size,
                            n_kv_heads=hkv, head_dim=d)
    seq = _core.KVSequence(pool)
    if p:
        seq.append(rng.standard_normal((p, hkv, d)).astype(np.float32),
                   rng.standard_normal((p, hkv, d)).astype(np.float32))
    kh, vh = seq.read()
    return pool, seq, kh, vh


def tree_inputs(shape, n, seed):
    hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    return q, k, v


def check_oracle(shape, p, tree, split):
    _, seq, kh, vh = history(shape, p)
    parents = TREES[tree]
    q, k, v = tree_inputs(shape, len(parents), p + len(parents))
    out = _core.tree_attention(seq, q, k, v, parents, split=split)
    ref = tree_attention_naive(int8_queries(q), kh, vh, refkv.roundtrip(k), refkv.roundtrip(v),
                               parents)
    assert_close(out, ref, ATOL, f"P={p} tree={tree} split={split}")


@pytest.mark.parametrize("split", [64, 512])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("p", HISTORIES)
def test_oracle_small_shape(p, tree, split):
    check_oracle(SMALL, p, tree, split)


@pytest.mark.parametrize("tree", ["single", "chain16", "star16", "random1"])
@pytest.mark.parametrize("p", [0, 33, 1000, 8192])
def test_oracle_realistic_shape(p, tree):
    check_oracle(REALISTIC, p, tree, 512)


@pytest.mark.parametrize("tree", list(TREES))
def test_oracle_realistic_shape_split64(tree):
    check_oracle(REALISTIC, 1000, tree, 64)


@pytest.mark.parametrize("p", [0, 33, 1000])
def test_oracle_head_dim_96(p):
    check_oracle(ODD_DIM, p, "random1", 512)


@pytest.mark.parametrize("q_scale", [1.0, 8.0])  # 8: sharp softmaxes, scores of size ~30
@pytest.mark.parametrize("shape", [SMALL, REALISTIC])
def test_int8_query_error_bound(shape, q_scale):
    """Against the float64 softmax over the fp32 queries. Quantizing a query moves each of its
    scores by delta_j = scale * (q - q8) . k_j, and |delta_j| <= scale * sum over groups of
    (qs_g / 2) * sum |k_j| in the group (half a step per dim). Softmax weights then change by a
    factor in [exp(-2 d), exp(2 d)] for d = max_j |delta_j|, so an output moves by at most
    (exp(2 d) - 1) * max_j |v_j|: asserted per (row, head) with the d of its own visible keys,
    plus ATOL for the float32 rounding. The bound holds for any data; the typical error is far
    below it (random signs: about sqrt(D) times one step, not D)."""
    hq, hkv, d = shape
    _, seq, kh, vh = history(shape, 1000)
    parents = TREES["random1"]
    q, k, v = tree_inputs(shape, len(parents), 21)
    q = q * np.float32(q_scale)
    out = _core.tree_attention(seq, q, k, v, parents)
    kt, vt = refkv.roundtrip(k), refkv.roundtrip(v)
    ref = tree_attention_naive(q, kh, vh, kt, vt, parents)
    dq = (q.astype(np.float64) - int8_queries(q)) / np.sqrt(d)
    for i in range(len(parents)):
        path = path_to(parents, i)
        keys = np.concatenate([kh, kt[path]]).astype(np.float64)    # [P + depth, Hkv, D]
        vals = np.concatenate([vh, vt[path]]).astype(np.float64)
        for h in range(hq):
            kv = h // (hq // hkv)
            delta = np.abs(keys[:, kv] @ dq[i, h]).max()
            bound = np.expm1(2 * delta) * np.abs(vals[:, kv]).max() + ATOL
            err = np.abs(out[i, h] - ref[i, h]).max()
            assert err <= bound, f"row {i} head {h}: {err:.3g} > bound {bound:.3g}"
    assert np.abs(out - ref).max() > ATOL  # the quantization is there to be bounded


def test_split_reference_matches_naive():
    """The split-K reference (partials merged by log-sum-exp) is the naive softmax in float64."""
    _, _, kh, vh = history(SMALL, 1000)
    parents = TREES["random1"]
    q, k, v = tree_inputs(SMALL, len(parents), 5)
    a = tree_attention_naive(q, kh, vh, k, v, parents)
    b = tree_attention_split(q, kh, vh, k, v, parents, split=96)
    assert_close(b, a, 1e-12, "split vs naive (float64 rounding only)")


@pytest.mark.parametrize("shape", [SMALL, REALISTIC])
@pytest.mark.parametrize("p", [29, 500, 1000])
def test_tree_chain_single_node_bitwise(shape, p):
    """Node i's output depends only on history + its path: the tree row, the last row of the
    path verified as a chain, and the node alone after committing its ancestors to pages agree
    bit for bit (p=29 puts the tree across a 32-key tile, p=500 across a 512 split)."""
    pool, seq, kh, vh = history(shape, p)
    parents = random_tree(16, p)
    q, k, v = tree_inputs(shape, 16, 99)
    out_tree = _core.tree_attention(seq, q, k, v, parents)
    for i in [3, 9, 15]:
        path = path_to(parents, i)
        chain = np.arange(len(path)) - 1
        out_chain = _core.tree_attention(seq, q[path], k[path], v[path], chain)
        assert (out_chain[-1] == out_tree[i]).all(), f"chain differs at node {i}"
        # The same keys committed to pages, the node verified alone.
        pool2 = _core.KVPagePool(pool.num_pages + 2, pool.page_size, shape[1], shape[2])
        seq2 = _core.KVSequence(pool2)
        if p:
            seq2.append(kh, vh)  # already-dequantized values quantize back to themselves
        assert (seq2.read()[0] == kh).all()
        seq2.append_nodes(k, v, parents, path[:-1]) if len(path) > 1 else None
        out_single = _core.tree_attention(seq2, q[i:i + 1], k[i:i + 1], v[i:i + 1], [-1])
        assert (out_single[0] == out_tree[i]).all(), f"single-node form differs at node {i}"


def test_other_nodes_do_not_matter_bitwise():
    _, seq, _, _ = history(SMALL, 300)
    parents = TREES["random2"]
    q, k, v = tree_inputs(SMALL, 16, 3)
    base = _core.tree_attention(seq, q, k, v, parents)
    i = 15
    on_path = set(path_to(parents, i))
    off = [j for j in range(16) if j not in on_path]
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[off] += 1.0
    k2[off] *= -2.0
    v2[off] += 3.0
    out = _core.tree_attention(seq, q2, k2, v2, parents)
    assert (out[i] == base[i]).all()
    assert not (out[off[0]] == base[off[0]]).all()  # the perturbation did reach other rows


@pytest.mark.parametrize("p", [0, 700, 4096])
def test_thread_count_bitwise(p):
    _, seq, _, _ = history(REALISTIC, p)
    parents = TREES["random3"]
    q, k, v = tree_inputs(REALISTIC, len(parents), 11)
    a = _core.tree_attention(seq, q, k, v, parents, threads=1)
    b = _core.tree_attention(seq, q, k, v, parents, threads=2)
    assert (a == b).all()


@pytest.mark.skipif(len(ISAS) < 2, reason="only one kernel variant on this CPU")
@pytest.mark.parametrize("tree", ["random4", "single"])  # single: the one-row (fused) path
@pytest.mark.parametrize("shape", [SMALL, ODD_DIM, (8, 2, 256)])
@pytest.mark.parametrize("q_scale", [1.0, 40.0])  # 40: most scores fall below exp's -87.3 cut
def test_kernel_variants_bitwise(q_scale, shape, tree):
    """Every SIMD build gives the generic build's bits."""
    _, seq, _, _ = history(shape, 300)
    parents = TREES[tree]
    q, k, v = tree_inputs(shape, len(parents), 12)
    q = q * np.float32(q_scale)
    outs = []
    for name in ISAS:
        with isa(name):
            outs.append(_core.tree_attention(seq, q, k, v, parents))
    for o in outs[1:]:
        assert (o == outs[0]).all()


def test_f32_pool_matches_oracle_on_raw_values():
    hq, hkv, d = SMALL
    rng = np.random.default_rng(4)
    pool = _core.KVPagePool(8, 32, hkv, d, dtype="f32")
    seq = _core.KVSequence(pool)
    kh = rng.standard_normal((70, hkv, d)).astype(np.float32)
    vh = rng.standard_normal((70, hkv, d)).astype(np.float32)
    seq.append(kh, vh)
    parents = TREES["random1"]
    q, k, v = tree_inputs(SMALL, 16, 6)
    out = _core.tree_attention(seq, q, k, v, parents)
    assert_close(out, tree_attention_naive(q, kh, vh, k, v, parents), ATOL, "f32 KV")
