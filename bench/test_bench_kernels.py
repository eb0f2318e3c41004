"""Kernel microbenchmarks: tree attention over int8 pages, pathwise GDN, realistic shapes.

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-group-by=group

Tree attention reads each KV tile once for all rows and heads of a KV head, so its bytes are
the history's int8 keys and values plus scales; `floor_ms` is those bytes at the measured read
bandwidth and `x_floor` the measured time over it.
"""
import numpy as np
import pytest

from sapwood import _core

HQ, HKV, D = 24, 4, 256
GDN = dict(hk=16, hv=48, dk=128, dv=128, conv_k=4)


def _seq(p):
    rng = np.random.default_rng(0)
    pool = _core.KVPagePool(num_pages=p // 64 + 2, page_size=64, n_kv_heads=HKV, head_dim=D)
    seq = _core.KVSequence(pool)
    for a in range(0, p, 4096):
        t = min(4096, p - a)
        x = rng.standard_normal((t, HKV, D)).astype(np.float32)
        seq.append(x, x)
    return pool, seq


_SEQS = {}


@pytest.mark.parametrize("rows", [1, 4, 8, 16])
@pytest.mark.parametrize("history", [512, 4096, 32768])
def test_tree_attention(benchmark, read_bw, history, rows):
    if history not in _SEQS:
        _SEQS[history] = _seq(history)
    _, seq = _SEQS[history]
    rng = np.random.default_rng(1)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, rows)])
    q = rng.standard_normal((rows, HQ, D)).astype(np.float32)
    k = rng.standard_normal((rows, HKV, D)).astype(np.float32)
    benchmark.group = f"tree_attention history={history}"
    benchmark.pedantic(_core.tree_attention, args=(seq, q, k, k, parents), rounds=7,
                       warmup_rounds=1, iterations=1)
    nbytes = history * HKV * 2 * (D + 4 * D // 32)
    t = benchmark.stats.stats.median
    benchmark.extra_info.update(bytes=nbytes, GBps=nbytes / t / 1e9, read_GBps=read_bw / 1e9,
                                floor_ms=nbytes / read_bw * 1e3, x_floor=t / (nbytes / read_bw))


@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
def test_gdn_tree(benchmark, read_bw, nodes):
    s = GDN
    c = 2 * s["hk"] * s["dk"] + s["hv"] * s["dv"]
    rng = np.random.default_rng(2)
    layer = _core.GDNLayer(s["hk"], s["hv"], s["dk"], s["dv"],
                           (rng.standard_normal((c, 4)) * 0.3).astype(np.float32))
    x = rng.standard_normal((nodes, c)).astype(np.float32)
    g = -rng.uniform(0.01, 1, (nodes, s["hv"])).astype(np.float32)
    b = rng.uniform(0.1, 0.9, (nodes, s["hv"])).astype(np.float32)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, nodes)])
    benchmark.group = "gdn_tree realistic (Hk16 Hv48 dk=dv=128)"
    benchmark.pedantic(layer.verify, args=(x, g, b, parents), rounds=9, warmup_rounds=2,
                       iterations=1)
    nbytes = 4 * s["hv"] * s["dk"] * s["dv"]  # the committed state is read once per layer
    t = benchmark.stats.stats.median
    benchmark.extra_info.update(bytes=nbytes, GBps=nbytes / t / 1e9, read_GBps=read_bw / 1e9)
