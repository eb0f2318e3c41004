"""Issue 38: no argument, call order or snapshot can crash the engine or silently change it.

Each test here failed before the fix it names (a crash counts as a failure): snapshots carry
state only and a model identity, a failed restore changes nothing, reset() is a fresh engine,
constructor arguments and verify's node count are checked with the value in the message, and
the KV pool takes memory only as positions are used. Logits are compared with `==` (docs/design.md:
the same committed state and path give the same bits).
"""
import numpy as np
import pytest

import sapwood
from sapwood import _core
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two models of the same shape (seeds 3, 4) and one with other GDN dimensions."""
    out = {}
    for name, kw in {"a": dict(seed=3), "b": dict(seed=4), "wide": dict(seed=3, dk=32, dv=32)}.items():
        p = tmp_path_factory.mktemp(name)
        make_tiny_checkpoint(p, **kw)
        out[name] = p
    return out


def engine(path, max_context=512, weights="f32"):
    return sapwood.load(path, weights=weights, kv="int8", max_context=max_context).engine


def toks(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n)


def busy_state(e):
    """Prefill, a committed chain (GDN tokens left pending), a kept draft: every kind of state."""
    e.prefill(toks(20))
    e.verify([5, 6, 7], [-1, 0, 1])
    e.commit([0, 1, 2])
    e.draft_chain(9, 3)
    e.keep_draft([9])


def probe(e):
    """Logits that depend on all of the committed state (KV, GDN state, window, pending)."""
    return e.verify([3, 4, 8, 1], [-1, 0, 1, 0])


def test_snapshot_of_another_model_of_the_same_shape_is_refused(ckpts):
    a, b = engine(ckpts["a"]), engine(ckpts["b"])
    a.prefill(toks(30))
    b.prefill(toks(30, seed=1))
    before = probe(a)
    snap = b.snapshot()
    assert snap.model_id == b.model_id != a.model_id
    with pytest.raises(ValueError, match="another model"):
        a.restore(snap)
    assert a.position == 30 and (probe(a) == before).all()
    a.reset()
    fresh = engine(ckpts["a"])
    assert (a.prefill(toks(10)) == fresh.prefill(toks(10))).all()


def test_snapshot_of_other_gdn_dims_is_refused_without_harm(ckpts):
    a, w = engine(ckpts["a"]), engine(ckpts["wide"])
    a.prefill(toks(30))
    w.prefill(toks(30))
    before = probe(a)
    with pytest.raises(ValueError, match="another model"):
        a.restore(w.snapshot())
    for _ in range(3):  # the old bug: heap corruption a few calls later
        assert (probe(a) == before).all()


def test_same_checkpoint_same_id_and_restore_across_engines(ckpts):
    a1, a2 = engine(ckpts["a"]), engine(ckpts["a"])
    assert a1.model_id == a2.model_id
    assert engine(ckpts["a"], weights="q8").model_id != a1.model_id  # another computation
    busy_state(a1)
    a2.restore(a1.snapshot())
    assert (probe(a1) == probe(a2)).all()


def test_failed_restore_changes_nothing(ckpts):
    big, small = engine(ckpts["a"], max_context=512), engine(ckpts["a"], max_context=64)
    assert big.model_id == small.model_id  # max_context is not part of the model
    big.prefill(toks(100))
    small.prefill(toks(40, seed=2))
    before = probe(small)
    with pytest.raises(ValueError, match="does not fit max_context 64"):
        small.restore(big.snapshot())
    assert small.position == 40 and (probe(small) == before).all()


def test_reset_gives_a_fresh_engine(ckpts):
    """reset() after every kind of state, then the calls that append to the GDN pending tape
    (a draft chain with a prefix, keep_draft, commit) equal a fresh engine's, bitwise."""
    used, fresh = engine(ckpts["a"]), engine(ckpts["a"])
    busy_state(used)
    for e in (used, fresh):
        e.reset()
        assert e.position == 0
    for e in (used, fresh):
        with pytest.raises(ValueError, match="commit without a preceding verify"):
            e.commit([0])
        assert e.keep_draft([1, 2]) == 0  # nothing kept from before the reset
    outs = []
    for e in (used, fresh):
        out = [e.draft_chain(4, 2, prefix=[7, 8])]
        out.append(np.array([e.keep_draft([4, 11])], np.float32))
        out.append(e.verify([1, 2, 3], [-1, 0, 0]))
        e.commit([0, 2])
        out.append(probe(e))
        outs.append(out)
    for x, y in zip(*outs):
        assert x.shape == y.shape and (x == y).all()


def test_verify_node_cap(ckpts):
    e = engine(ckpts["a"])
    cap = _core.Engine.max_verify_nodes
    n = cap + 1
    with pytest.raises(ValueError, match=f"a tree of {n} nodes; at most {cap}"):
        e.verify(np.zeros(n, np.int64), np.arange(-1, n - 1))
    e.prefill(toks(4))
    assert e.verify(np.zeros(cap, np.int64), np.arange(-1, cap - 1)).shape == (cap, 256)


def _dims_and_weights(path):
    ck = read_checkpoint(path)
    return engine_dims(ck.config), ck.weights


@pytest.mark.parametrize("change, match", [
    (dict(num_kv_heads=0), r"num_kv_heads must be in \[1, .*got 0"),   # was SIGFPE
    (dict(num_heads=0), r"num_heads must be in \[1, .*got 0"),
    (dict(num_heads=3), r"num_heads=3 is not a multiple of num_kv_heads=2"),
    (dict(head_dim=48), "head_dim must be a multiple of 32 up to 1024, got 48"),
    (dict(rotary_dim=3), "rotary_dim must be even.*got 3"),
    (dict(rope_theta=float("inf")), "rope_theta must be finite and > 0, got inf"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be finite and > 0, got nan"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be finite and > 0, got -1"),
    (dict(vocab_size=-5), r"vocab_size must be in \[1, .*got -5"),
    (dict(hk=0), r"hk must be in \[1, .*got 0"),
    (dict(hv=3), "hv=3 is not a multiple of hk=2"),
    (dict(conv_kernel=0), r"conv_kernel must be in \[1, 64\], got 0"),
    (dict(layer_is_attention=[]), "must list 1 to 4096 layers, got 0"),
])
def test_engine_dims_checked_with_the_value(ckpts, change, match):
    dims, w = _dims_and_weights(ckpts["a"])
    dims.update(change)
    with pytest.raises(ValueError, match=match):
        _core.Engine(dims, w, "f32", "int8", 64, 1)


@pytest.mark.parametrize("kw, match", [
    (dict(max_context=2**31 - 1), r"max_context must be in \[1, 16777216\], got 2147483647"),
    (dict(max_context=0), r"max_context must be in \[1, 16777216\], got 0"),
    (dict(threads=-1), r"threads must be in \[0, 1024\] .*got -1"),
    (dict(weights_format="q3"), "q3"),
    (dict(kv="fp8"), "fp8"),
])
def test_engine_arguments_checked_with_the_value(ckpts, kw, match):
    dims, w = _dims_and_weights(ckpts["a"])
    args = dict(weights_format="f32", kv="int8", max_context=64, threads=1) | kw
    with pytest.raises(ValueError, match=match):
        _core.Engine(dims, w, **args)


def test_non_finite_weight_named_by_the_engine(ckpts):
    dims, w = _dims_and_weights(ckpts["a"])
    w = dict(w)
    w["model.layers.0.linear_attn.dt_bias"] = w["model.layers.0.linear_attn.dt_bias"].copy()
    w["model.layers.0.linear_attn.dt_bias"][1] = np.inf
    with pytest.raises(ValueError, match=r"model.layers.0.linear_attn.dt_bias has a non-finite "
                                         r"value inf at flat index 1"):
        _core.Engine(dims, w, "f32", "int8", 64, 1)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_pool_takes_memory_as_it_is_used(ckpts):
    """A pool for 2^22 positions (~600 MB of pages on this tiny model) must not be resident
    at load: only the pages written are. Before, the whole pool was zeroed at load."""
    dims, w = _dims_and_weights(ckpts["a"])
    before = _rss_bytes()
    e = _core.Engine(dims, w, "f32", "int8", 1 << 22, 1)
    pool = e.memory()["kv_pool_bytes"]
    assert pool > 256 << 20
    grown = _rss_bytes() - before
    assert grown < pool // 8, (grown, pool)
    e.prefill(toks(300))  # and it works: pages appear as written
    assert e.memory()["kv_used_bytes"] > 0 and e.position == 300
