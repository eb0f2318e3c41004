"""The huge-page arena (csrc/huge_pages.*): arrays share chunks, a chunk goes back when its
last array does, and freeing or reusing space never touches a live array."""
import gc

import numpy as np

from sapwood import _core


def _matrix(rng, rows, cols=256):  # rows x 256 bytes of q8: 512 rows is 128 KiB, arena-sized
    return _core.WeightMatrix(rng.standard_normal((rows, cols)).astype(np.float32), "q8")


def test_arrays_share_chunks_and_chunks_are_returned():
    gc.collect()
    before = _core.arena_chunks()
    rng = np.random.default_rng(0)
    ms = [_matrix(rng, rows=512) for _ in range(100)]  # 100 x 128 KiB
    held = _core.arena_chunks() - before
    assert held <= 2, held  # shared (a chunk an earlier test left room in may take them all)
    del ms
    gc.collect()
    assert _core.arena_chunks() == before


def test_freed_space_reused_without_touching_live_arrays():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    a = _matrix(rng, rows=512)
    want = a.matmul(x)
    for i in range(20):  # the newest array freed and its space handed out again
        b = _matrix(np.random.default_rng(100 + i), rows=512)
        yb = b.matmul(x)
        del b
        c = _matrix(np.random.default_rng(100 + i), rows=512)
        assert np.array_equal(c.matmul(x), yb)
        del c
    b1, b2 = _matrix(rng, rows=512), _matrix(rng, rows=512)
    y2 = b2.matmul(x)
    del b1  # not the newest: its space stays taken
    c = _matrix(np.random.default_rng(7), rows=1024)  # would overlap b2 were it reused
    assert np.array_equal(b2.matmul(x), y2)
    assert np.array_equal(a.matmul(x), want)


def test_model_storage_goes_with_the_model(tmp_path):
    import sapwood
    from sapwood.testing import make_tiny_checkpoint
    # a 16.8 MB f32 embedding table: over half a chunk, so chunks of its own whatever other
    # tests' models left in the current shared chunk
    make_tiny_checkpoint(tmp_path / "m", seed=0, vocab=65536, tied=True)
    gc.collect()
    before = _core.arena_chunks()
    model = sapwood.load(tmp_path / "m", weights="f32", kv="f32", max_context=40960)
    assert model.engine.memory()["weights_bytes"] > 16 << 20
    assert _core.arena_chunks() > before
    del model
    gc.collect()
    assert _core.arena_chunks() == before
