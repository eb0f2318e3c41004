"""Int8 KV quantization and the paged store: bitwise against the numpy reference."""
import numpy as np
import pytest

from sapwood import _core
from sapwood.reference import kv as ref


def test_quantize_matches_reference_bitwise(rng):
    x = rng.standard_normal((50, 128)).astype(np.float32) * rng.uniform(0.01, 100, (50, 1)).astype(np.float32)
    x[3, :32] = 0.0                      # all-zero group: scale 0 -> q 0
    x[4, :32] = np.linspace(-127, 127, 32, dtype=np.float32) / 254  # exact .5 ties
    x[5, 5] = 1e30                        # one huge value dominates its group
    q, s = _core.quantize_int8(x)
    qr, sr = ref.quantize_int8(x)
    assert (q == qr).all() and (s == sr).all()
    assert (q[3, :32] == 0).all() and s[3, 0] == 0
    assert np.abs(q).max() <= 127


def test_paged_store_roundtrip_across_pages(rng):
    hkv, d = 2, 64
    pool = _core.KVPagePool(num_pages=8, page_size=32, n_kv_heads=hkv, head_dim=d)
    seq = _core.KVSequence(pool)
    refkv = ref.PagedKV(8, 32, hkv, d)
    for t in [1, 31, 1, 40, 7]:   # lengths that straddle page boundaries
        k = rng.standard_normal((t, hkv, d)).astype(np.float32)
        v = rng.standard_normal((t, hkv, d)).astype(np.float32)
        seq.append(k, v)
        refkv.append(k, v)
    k, v = seq.read()
    kr, vr = refkv.gather()
    assert seq.length == 80 and (k == kr).all() and (v == vr).all()
    assert pool.free_pages == 8 - 3
    seq.truncate(33)
    assert seq.length == 33 and pool.free_pages == 8 - 2
    assert (seq.read()[0] == kr[:33]).all()


def test_pool_exhaustion_is_an_error_and_leaves_sequence_usable(rng):
    pool = _core.KVPagePool(num_pages=2, page_size=32, n_kv_heads=1, head_dim=32)
    seq = _core.KVSequence(pool)
    k = rng.standard_normal((60, 1, 32)).astype(np.float32)
    seq.append(k, k)
    with pytest.raises(MemoryError, match="exhausted"):
        seq.append(k[:5], k[:5])
    assert seq.length == 60 and pool.free_pages == 0
    seq.append(k[:4], k[:4])  # still room in the last page
    assert seq.length == 64


def test_pages_return_to_pool_when_sequence_dies(rng):
    pool = _core.KVPagePool(num_pages=4, page_size=32, n_kv_heads=1, head_dim=32)
    seq = _core.KVSequence(pool)
    seq.append(*(2 * [rng.standard_normal((100, 1, 32)).astype(np.float32)]))
    assert pool.free_pages == 0
    del seq
    assert pool.free_pages == 4


def test_f32_pool_stores_exact_values(rng):
    pool = _core.KVPagePool(4, 32, 2, 64, dtype="f32")
    seq = _core.KVSequence(pool)
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    seq.append(k, -k)
    kk, vv = seq.read()
    assert (kk == k).all() and (vv == -k).all()
