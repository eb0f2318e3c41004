"""Bad input at the kernel boundary: a clear Python exception, no crash, objects still usable."""
import numpy as np
import pytest

from sapwood import _core

HKV, D = 2, 64


@pytest.fixture
def seq():
    pool = _core.KVPagePool(num_pages=2, page_size=32, n_kv_heads=HKV, head_dim=D)
    s = _core.KVSequence(pool)
    s.append(np.ones((10, HKV, D), np.float32), np.ones((10, HKV, D), np.float32))
    return s


def qkv(n, hq=4):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, hq, D)).astype(np.float32),
            rng.standard_normal((n, HKV, D)).astype(np.float32),
            rng.standard_normal((n, HKV, D)).astype(np.float32))


def still_works(seq):
    q, k, v = qkv(2)
    out = _core.tree_attention(seq, q, k, v, [-1, 0])
    assert out.shape == (2, 4, D) and np.isfinite(out).all()


@pytest.mark.parametrize("parents, match", [
    ([-1, 1], r"parents\[1\] = 1"),            # parent not before child
    ([-1, 0, 5], r"parents\[2\] = 5"),
    ([-1, -2], r"parents\[1\] = -2"),
    ([-1, -1], r"parents\[1\] = -1"),          # a second root
    ([0, -1], r"parents\[0\] must be -1"),
])
def test_bad_parents(seq, parents, match):
    q, k, v = qkv(len(parents))
    with pytest.raises(ValueError, match=match):
        _core.tree_attention(seq, q, k, v, parents)
    still_works(seq)


def test_bad_shapes_and_dtypes(seq):
    q, k, v = qkv(2)
    with pytest.raises(ValueError, match="q has shape"):
        _core.tree_attention(seq, q[:1], k, v, [-1, 0])
    with pytest.raises(ValueError, match="k_tree has shape"):
        _core.tree_attention(seq, q, k[:, :1], v, [-1, 0])
    with pytest.raises(ValueError, match="dtype float32"):
        _core.tree_attention(seq, q.astype(np.float64), k, v, [-1, 0])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        _core.tree_attention(seq, q[:, :3], k, v, [-1, 0])
    with pytest.raises(ValueError, match="integers"):
        _core.tree_attention(seq, q, k, v, [-1.0, 0.0])
    with pytest.raises(ValueError, match="split"):
        _core.tree_attention(seq, q, k, v, [-1, 0], split=33)
    with pytest.raises(ValueError, match="numpy float32 array"):
        _core.tree_attention(seq, "q", k, v, [-1, 0])
    still_works(seq)


def test_nan_rejected(seq):
    q, k, v = qkv(2)
    q[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        _core.tree_attention(seq, q, k, v, [-1, 0])
    k2 = np.full((1, HKV, D), np.inf, np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        seq.append(k2, k2)
    assert seq.length == 10
    still_works(seq)


def test_positions_past_pool(seq):
    big = np.ones((60, HKV, D), np.float32)
    with pytest.raises(MemoryError, match="exhausted"):
        seq.append(big, big)
    assert seq.length == 10
    still_works(seq)


def test_bad_commit_paths(seq):
    _, k, v = qkv(3)
    parents = [-1, 0, 0]
    for path, match in [([1], "start at the root"), ([0, 2, 1], "not a child"),
                        ([0, 7], "not in the tree"), ([], "start at the root")]:
        with pytest.raises(ValueError, match=match):
            seq.append_nodes(k, v, parents, path)
    assert seq.length == 10
    seq.append_nodes(k, v, parents, [0, 2])
    assert seq.length == 12


def test_bad_pool_and_layer_arguments():
    with pytest.raises(ValueError, match="head_dim"):
        _core.KVPagePool(4, 32, 2, 48)
    with pytest.raises(ValueError, match="page_size"):
        _core.KVPagePool(4, 30, 2, 64)
    with pytest.raises(ValueError, match="dtype"):
        _core.KVPagePool(4, 32, 2, 64, dtype="fp8")
    with pytest.raises(ValueError, match="quantize|multiple of 32"):
        _core.quantize_int8(np.ones((2, 40), np.float32))


def test_gdn_bad_input_then_usable():
    hk, hv, dk, dv, k = 1, 2, 8, 8, 4
    c = 2 * hk * dk + hv * dv
    w = np.ones((c, k), np.float32) * 0.1
    with pytest.raises(ValueError, match="channels"):
        _core.GDNLayer(hk, hv, dk, dv, w[:-1])
    with pytest.raises(ValueError, match="head_order"):
        _core.GDNLayer(hk, hv, dk, dv, w, head_order="zigzag")
    with pytest.raises(ValueError, match="multiple of Hk"):
        _core.GDNLayer(2, 3, dk, dv, np.ones((2 * 2 * dk + 3 * dv, k), np.float32))
    layer = _core.GDNLayer(hk, hv, dk, dv, w)
    x = np.ones((2, c), np.float32)
    g = -np.ones((2, hv), np.float32)
    b = np.full((2, hv), 0.5, np.float32)
    with pytest.raises(ValueError, match="x has shape"):
        layer.verify(x[:, :-1], g, b, [-1, 0])
    with pytest.raises(ValueError, match=r"parents\[1\]"):
        layer.verify(x, g, b, [-1, 1])
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        layer.verify(bad, g, b, [-1, 0])
    with pytest.raises(ValueError, match="without a preceding verify"):
        layer.commit([0])
    out = layer.verify(x, g, b, [-1, 0])
    with pytest.raises(ValueError, match="not a child"):
        layer.commit([0, 0])
    layer.commit([0, 1])
    assert layer.n_pending == 2 and np.isfinite(out).all()
