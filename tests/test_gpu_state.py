"""A sequence's state kernels (int8 KV, tree attention, pathwise GDN) bound by hand through
_core.gpu_run on every device, against the numpy references: what tests/test_backend_ops.py
cannot reach through its one small model. KV bytes are compared directly (quantization ties and
tiny scales; pages appended in uneven pieces through a shuffled table), attention runs over
histories at the 32-key tile and the 512-key split with the largest head size, and GDN over
both head orders and the largest state, through the pending tape and a replayed commit. The
cases also serve tests/test_gpu_mutants.py and tests/test_gpu_sycl.py.

Tolerances are the CPU tests' (test_tree_attention.py, test_gdn.py give the reasoning): 1e-4
for attention (against the int8-query oracle, as the kernels round queries like keys), 2e-4
for GDN; `==` for int8 quantization and for copies (the conv window, the pending tape).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

import gpu_util as gu
from sapwood.reference import kv as refkv
from sapwood.reference.gdn import GDNReference
from sapwood.reference.tree_attention import int8_queries, tree_attention_naive
from util import TREES, assert_close, path_to, random_tree

ATTN_TOL, GDN_TOL = 1e-4, 2e-4
PAGE, SPLIT = 64, 512  # SPLIT: the engine's kAttnSplit (csrc/kernels/kernels.h)
SMALL, LARGEST = (4, 2, 64), (24, 4, 256)  # Hq, Hkv, D (256: SW_MAX_HEAD_DIM)
GDN_SMALL, GDN_LARGEST = (2, 4, 16, 32), (16, 48, 128, 128)  # hk, hv, dk, dv (128: SW_GDN_MAX_DK)


@pytest.fixture(params=gu.devices())
def dev(request):
    return request.param


# ---------------------------------------------------------------- int8 KV

def quant_inputs(rng, t, hkv, d):
    x = rng.standard_normal((t, hkv, d)).astype(np.float32) * 3
    x[0, 0, :32] = 0  # scale 0 -> all zeros
    x[1, 0, :32] = np.float32(0.25) * np.arange(-31, 33, 2)  # x / scale at every half step ...
    x[1, 0, 0] = 127 * 0.5  # ... of a scale of exactly 0.5: ties, to even
    x[2, 1, 32:64] *= 1e-30  # tiny scales
    return x


def kv_quantize_case(dev, rng):
    """Direct rows [T, Hkv, D] (a tree's own keys): reference.kv's bytes."""
    x = quant_inputs(rng, 5, 2, 96)
    q, s = np.zeros((5, 2, 96), np.int8), np.zeros((5, 2, 3), np.float32)
    gu.run(dev, "kv_quantize", [x, q, s, np.zeros(1, np.int32), gu.pack(5, 2, 96, 0, 0)], (5, 2), 96)
    rq, rs = refkv.quantize_int8(x)
    assert (q == rq).all() and (s == rs).all()


def test_kv_quantize_direct_bitwise(dev, rng):
    kv_quantize_case(dev, rng)


def test_kv_quantize_into_pages_bitwise(dev, rng):
    """Appends in three uneven pieces across page boundaries, through a shuffled page table: the
    pool's int8 values and scales are reference.kv.PagedKV's, byte for byte."""
    x = quant_inputs(rng, 150, 2, 64)
    ref = refkv.PagedKV(5, PAGE, 2, 64)
    ref.free = [3, 0, 4, 1, 2]
    ref.append(x, x)
    table = np.array(ref.page_table, np.int32)
    q, s = np.zeros_like(ref.k_q), np.zeros_like(ref.k_s)
    for a, b in [(0, 40), (40, 129), (129, 150)]:
        gu.run(dev, "kv_quantize", [x[a:b].copy(), q, s, table, gu.pack(b - a, 2, 64, PAGE, a)], (b - a, 2), 64)
    assert (q == ref.k_q).all() and (s == ref.k_s).all()


# ---------------------------------------------------------------- tree attention

def paged_history(shape, p, seed):
    """A reference.kv.PagedKV of p random positions on shuffled pages (the kernel's own bytes, as
    the test above shows)."""
    _, hkv, d = shape
    rng = np.random.default_rng(seed)
    kv = refkv.PagedKV(p // PAGE + 2, PAGE, hkv, d)
    kv.free = [int(i) for i in rng.permutation(len(kv.free))]
    if p:
        kv.append(*(rng.standard_normal((p, hkv, d)).astype(np.float32) for _ in range(2)))
    return kv


def tree_inputs(shape, n, seed):
    hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, hq, d)).astype(np.float32),
            rng.standard_normal((n, hkv, d)).astype(np.float32),
            rng.standard_normal((n, hkv, d)).astype(np.float32))


def attn_plan(parents, hist_len):
    """metal/sw_plan.h for one block of rows: ancestor lists and keys per row."""
    n = len(parents)
    depth = np.zeros(n, np.int32)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    stride = int(depth.max()) + 1
    anc = np.zeros((n, stride), np.int32)
    for i in range(n):
        anc[i, :depth[i] + 1] = path_to(parents, i)
    return anc, (hist_len + depth + 1).astype(np.int32), stride


def tree_attention(dev, q, kv, k, v, parents):
    """kv_quantize of the tree's own keys and values, tree_attn_partial over the history's pages
    and the tree, tree_attn_merge: [N, Hq, D] (one block of rows, as sw_plan.h makes it)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    assert n * (hq // hkv) <= 32 * 4, "more than one block of rows"
    own = []
    for x in (k, v):
        own += [np.zeros((n, hkv, d), np.int8), np.zeros((n, hkv, d // 32), np.float32)]
        gu.run(dev, "kv_quantize", [x, *own[-2:], np.zeros(1, np.int32), gu.pack(n, hkv, d, 0, 0)], (n, hkv), d)
    anc, row_len, stride = attn_plan(parents, kv.length)
    n_chunks = -(-int(row_len.max()) // SPLIT)
    scale = float(np.float32(1) / np.sqrt(np.float32(d)))
    prm = gu.pack(n, hq, hkv, d, kv.length, PAGE, SPLIT, n_chunks, stride, scale)
    part = np.zeros((n_chunks, n, hq, d + 2), np.float32)
    table = np.array(kv.page_table or [0], np.int32)
    gu.run(dev, "tree_attn_partial", [q, kv.k_q, kv.k_s, kv.v_q, kv.v_s, table, *own, anc, row_len, part, prm],
           (n_chunks, hkv), 32 * -(-n * (hq // hkv) // 4), [72 * d])
    out = np.zeros((n, hq, d), np.float32)
    gu.run(dev, "tree_attn_merge", [part, row_len, out, prm], (n, hq), 32)
    return out


def attention_case(dev, shape, p, parents, seed=0):
    kv = paged_history(shape, p, seed)
    q, k, v = tree_inputs(shape, len(parents), seed + 1)
    kh, vh = kv.gather()
    want = tree_attention_naive(int8_queries(q), kh, vh, refkv.roundtrip(k), refkv.roundtrip(v), parents)
    assert_close(tree_attention(dev, q, kv, k, v, parents), want, ATTN_TOL, f"P={p}")


@pytest.mark.parametrize("tree", ["single", "chain16", "star16", "random1"])
@pytest.mark.parametrize("p", [0, 1, 31, 32, 33, 1000, 4096])
def test_tree_attention(dev, p, tree):
    """Histories ending before, at and after a 32-key tile, and past the 512-key split (two
    chunks merged, and nine)."""
    attention_case(dev, SMALL, p, TREES[tree], seed=p)


def test_tree_attention_largest_head(dev):
    """Hq 24 / Hkv 4 / D 256: 96 (row, head) pairs, 24 simdgroups a threadgroup, two chunks."""
    attention_case(dev, LARGEST, 600, TREES["random1"])


def test_tree_row_is_its_chain_and_the_node_alone_bitwise(dev):
    """P = 509: the tree's keys straddle a page and the 512-key split. Row i of the tree, the
    last row of its path verified as a chain, and node i verified alone once its ancestors are
    in the pages give the same bits (test_backends.py checks this through whole models at
    histories below one split)."""
    kv = paged_history(SMALL, 509, 9)
    parents = random_tree(16, 509)
    q, k, v = tree_inputs(SMALL, 16, 99)
    tree = tree_attention(dev, q, kv, k, v, parents)
    for i in (3, 8, 15):
        path = path_to(parents, i)
        chain = tree_attention(dev, q[path], kv, k[path], v[path], np.arange(len(path)) - 1)
        assert (chain[-1] == tree[i]).all(), f"chain differs at node {i}"
        longer = copy.deepcopy(kv)
        if len(path) > 1:
            longer.append(k[path[:-1]], v[path[:-1]])
        alone = tree_attention(dev, q[i:i + 1], longer, k[i:i + 1], v[i:i + 1], [-1])
        assert (alone[0] == tree[i]).all(), f"the node alone differs at node {i}"


# ---------------------------------------------------------------- pathwise GDN

def gdn_case(dev, dims=GDN_SMALL, order="grouped", seed=5):
    """Two rounds of gdn_conv, gdn_recur, gdn_commit and gdn_window bound by hand from a random
    committed state and window, against GDNReference: a 9-node tree, its deepest path committed
    by replay with 2 tokens left on the pending tape; then a 13-node tree verified over that
    tape, its deepest path committed by selecting the leaf's state. Returns every output."""
    hk, hv, dk, dv = dims
    kk, c = 4, 2 * hk * dk + hv * dv
    rng = np.random.default_rng(seed)
    conv_w = (rng.standard_normal((c, kk)) * 0.5).astype(np.float32)
    state = (rng.standard_normal((hv, dk, dv)) * 0.1).astype(np.float32)
    window = rng.standard_normal((kk - 1, c)).astype(np.float32)
    ref = GDNReference(hk, hv, dk, dv, conv_w, head_order=order)
    ref.S, ref.window = state.astype(np.float64), window.astype(np.float64)
    tape = [np.zeros((1, hk, dk), np.float32), np.zeros((1, hv, dv), np.float32),
            np.zeros((1, hv), np.float32), np.zeros((1, hv), np.float32)]  # none pending yet
    grouped, pending, outputs = int(order == "grouped"), 0, []
    q_scale = float(np.float32(1) / np.sqrt(np.float32(dk)))
    threads = 32 * -(-max(dk, dv) // 32)
    for parents, keep in ((TREES["random3"], 2), (TREES["random4"], 0)):
        n = len(parents)
        x = rng.standard_normal((n, c)).astype(np.float32)
        g = -rng.uniform(0.01, 1.0, (n, hv)).astype(np.float32)
        beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
        par = np.asarray(parents, np.int32)
        prm = gu.pack(n, hk, hv, dk, dv, kk, grouped, pending, 0, 0, 0, q_scale, 0)
        q, k = np.zeros((n, hk, dk), np.float32), np.zeros((n, hk, dk), np.float32)
        v, out = np.zeros((n, hv, dv), np.float32), np.zeros((n, hv, dv), np.float32)
        node_state = np.zeros((n, hv, dk, dv), np.float32)
        gu.run(dev, "gdn_conv", [x, par, window, np.ascontiguousarray(conv_w.T), q, k, v, prm], (n, 2 * hk + hv), 32)
        gu.run(dev, "gdn_recur", [state, *tape, q, k, v, g, beta, par, out, node_state, prm], hv, threads,
               [4 * 2 * dk])
        assert_close(out, ref.verify(x, g, beta, parents), GDN_TOL, f"verify over {pending} pending")
        path = np.asarray(max((path_to(parents, i) for i in range(n)), key=len), np.int32)  # the deepest
        assert len(path) > keep
        ref.commit(path.tolist(), max_pending=keep)
        n_fold = 0 if keep == 0 else pending + len(path) - keep
        new_tape = [np.zeros((max(keep, 1),) + t.shape[1:], np.float32) for t in tape]
        cprm = gu.pack(0, hk, hv, dk, dv, kk, grouped, pending, len(path), n_fold, int(keep == 0), 0.0, 0)
        gu.run(dev, "gdn_commit", [state, *tape, k, v, g, beta, path, node_state, *new_tape, cprm], hv, threads,
               [4 * dk])
        new_window = np.zeros_like(window)
        gu.run(dev, "gdn_window", [window, x, path, new_window, cprm], -(-c // 256), 256)
        assert (new_window == ref.window).all(), "the conv window holds copies of inputs"
        last = path[len(path) - keep:]
        assert all((t[:keep] == a[last]).all() for t, a in zip(new_tape, (k, v, g, beta))), "tape: copies"
        tape, pending, window = new_tape, keep, new_window
        outputs += [out, node_state, state.copy(), window, *tape]
    assert_close(state, ref.S, GDN_TOL, "the committed state")
    return outputs


@pytest.mark.parametrize("order", ["grouped", "tiled"])
def test_gdn(dev, order):
    gdn_case(dev, GDN_SMALL, order)


def test_gdn_largest_state(dev):
    """hk 16 / hv 48 / dk = dv = 128: a thread holds a whole state column."""
    gdn_case(dev, GDN_LARGEST, "tiled")


def test_gdn_recur_of_a_prefill_chunk_keeps_only_its_last_state(dev):
    """last_state_only (a prefill chunk, committed as it goes): the same outputs bitwise, the
    chain's last state in slot 0 equal to the per-node run's last one, no other slot written,
    so the backend sizes that buffer for one state instead of rows x Hv x dk x dv floats."""
    hk, hv, dk, dv, kk, n = 2, 6, 16, 32, 4, 11
    c = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(8)
    conv_w = (rng.standard_normal((c, kk)) * 0.5).astype(np.float32)
    state0 = (rng.standard_normal((hv, dk, dv)) * 0.1).astype(np.float32)
    window0 = rng.standard_normal((kk - 1, c)).astype(np.float32)
    x = rng.standard_normal((n, c)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (n, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
    par = (np.arange(n) - 1).astype(np.int32)
    q_scale = float(np.float32(1) / np.sqrt(np.float32(dk)))
    tape = [np.zeros((1, hk, dk), np.float32), np.zeros((1, hv, dv), np.float32),
            np.zeros((1, hv), np.float32), np.zeros((1, hv), np.float32)]
    threads = 32 * -(-max(dk, dv) // 32)
    runs = []
    for last_only in (0, 1):
        prm = gu.pack(n, hk, hv, dk, dv, kk, 1, 0, 0, 0, 0, q_scale, last_only)
        q, k = np.zeros((n, hk, dk), np.float32), np.zeros((n, hk, dk), np.float32)
        vv, out = np.zeros((n, hv, dv), np.float32), np.zeros((n, hv, dv), np.float32)
        node_state = np.full((n, hv, dk, dv), np.nan, np.float32)
        gu.run(dev, "gdn_conv", [x, par, window0, np.ascontiguousarray(conv_w.T), q, k, vv, prm],
               (n, 2 * hk + hv), 32)
        gu.run(dev, "gdn_recur", [state0, *tape, q, k, vv, g, beta, par, out, node_state, prm], hv, threads,
               [4 * 2 * dk])
        runs.append((out, node_state))
    (out_all, states), (out_last, kept) = runs
    assert (out_last == out_all).all()
    assert (kept[0] == states[n - 1]).all()
    assert np.isnan(kept[1:]).all(), "a slot past the first was written"

