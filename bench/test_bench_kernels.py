"""Kernel microbenchmarks at realistic shapes, and verify(N) against verify(1).

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-group-by=group

Every kernel of the CPU table has one: matmul in each weight format (with the activation
quantization it includes), tree attention over int8 pages, pathwise GDN (conv and tree), RMSNorm,
the SiLU gate and the draft's log-sum-exp; then the engine's verify of 1, 9 (a chain) and 16 (a
tree) nodes on the bundled target. extra_info holds bytes/s or multiply-adds/s next to the
machine's streaming read bandwidth (the memory floor): `x_floor` is the time over the time the
bytes take at that bandwidth. Each benchmark also checks what it computed, so the normal test
suite runs this file once at small sizes (SAPWOOD_BENCH_SMOKE=1, --benchmark-disable) as a
correctness smoke run; timings there mean nothing.
"""
import os

import numpy as np
import pytest

import sapwood
from sapwood import _core

SMOKE = os.environ.get("SAPWOOD_BENCH_SMOKE") == "1"
HQ, HKV, D = (4, 2, 64) if SMOKE else (24, 4, 256)
GDN = dict(hk=2, hv=4, dk=32, dv=32, conv_k=4) if SMOKE else dict(hk=16, hv=48, dk=128, dv=128, conv_k=4)
HIDDEN, INTER, VOCAB = (64, 96, 500) if SMOKE else (1024, 3584, 151936)


def run(benchmark, fn, *args, rounds=7):
    """Times fn(*args) (one call per round) and returns one result to check."""
    return benchmark.pedantic(fn, args=args, rounds=rounds, warmup_rounds=1, iterations=1)


def record(benchmark, read_bw, nbytes=None, macs=None, **extra):
    if benchmark.disabled:  # the smoke run: nothing was timed
        return
    t = benchmark.stats.stats.median
    info = dict(read_GBps=read_bw / 1e9, **extra)
    if nbytes is not None:
        info.update(bytes=nbytes, GBps=nbytes / t / 1e9, floor_ms=nbytes / read_bw * 1e3,
                    x_floor=t / (nbytes / read_bw))
    if macs is not None:
        info.update(GMACps=macs / t / 1e9)
    benchmark.extra_info.update(info)


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


@pytest.mark.parametrize("rows", [1, 4] if SMOKE else [1, 4, 8, 16])
@pytest.mark.parametrize("history", [100] if SMOKE else [512, 4096, 32768])
def test_tree_attention(benchmark, read_bw, history, rows):
    if history not in _SEQS:
        _SEQS[history] = _seq(history)
    _, seq = _SEQS[history]
    rng = np.random.default_rng(1)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, rows)])
    q = rng.standard_normal((rows, HQ, D)).astype(np.float32)
    k = rng.standard_normal((rows, HKV, D)).astype(np.float32)
    benchmark.group = f"tree_attention history={history}"
    out = run(benchmark, _core.tree_attention, seq, q, k, k, parents)
    # outputs are convex combinations of values (|v| of a few units): finite and bounded
    assert out.shape == (rows, HQ, D) and np.isfinite(out).all() and np.abs(out).max() < 10
    record(benchmark, read_bw, nbytes=history * HKV * 2 * (D + 4 * D // 32))


@pytest.mark.parametrize("nodes", [1, 4] if SMOKE else [1, 2, 4, 8, 16])
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
    benchmark.group = f"gdn conv+tree (Hk{s['hk']} Hv{s['hv']} dk=dv={s['dk']})"
    out = run(benchmark, layer.verify, x, g, b, parents, rounds=9)
    # verify leaves the committed state alone: the same call gives the same bits
    assert out.shape[0] == nodes and np.isfinite(out).all()
    assert (layer.verify(x, g, b, parents) == out).all()
    record(benchmark, read_bw, nbytes=4 * s["hv"] * s["dk"] * s["dv"])  # S is read once


@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("fmt", ["q8", "q4", "bf16", "f32"])
def test_matmul(benchmark, read_bw, fmt, rows):
    """The MLP's up projection (INTER x HIDDEN): decode rows stream the weights, verify and
    prefill rows reuse them."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((INTER, HIDDEN)).astype(np.float32)
    m = _core.WeightMatrix(w, fmt)
    x = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    benchmark.group = f"matmul {INTER}x{HIDDEN} rows={rows}"
    y = run(benchmark, m.matmul, x)
    # against the matrix as the kernel sees it; quantized formats also quantize x per row
    # (int8, relative error <= 1/254 per entry, so 2% of the output scale is loose but catches
    # a wrong row, block or scale)
    want = x.astype(np.float64) @ m.dequantized().astype(np.float64).T
    assert np.abs(y - want).max() <= 0.02 * np.abs(want).max()
    nbytes = {"q8": 1.0, "q4": 0.5 + 4 / 64, "bf16": 2.0, "f32": 4.0}[fmt] * INTER * HIDDEN
    record(benchmark, read_bw, nbytes=nbytes, macs=rows * INTER * HIDDEN)


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_mul", "logsumexp"])
def test_small_kernel(benchmark, read_bw, kernel):
    """Per verify(9) of the realistic shape: a hidden-state norm, the MLP gate, a logits row."""
    rng = np.random.default_rng(4)
    benchmark.group = "small kernels"
    if kernel == "rms_norm":
        x = rng.standard_normal((9, HIDDEN)).astype(np.float32)
        out = run(benchmark, _core.rms_norm, x, np.ones(HIDDEN, np.float32), 1e-6, rounds=50)
        assert np.allclose((out.astype(np.float64) ** 2).mean(1), 1.0, atol=1e-4)
    elif kernel == "silu_mul":
        x = rng.standard_normal(9 * INTER).astype(np.float32)
        out = run(benchmark, _core.silu_mul, x, x, rounds=50)
        assert np.allclose(out, x * x / (1 + np.exp(-x.astype(np.float64))), atol=1e-5)
    else:
        x = rng.standard_normal(VOCAB).astype(np.float32)
        out = run(benchmark, _core.logsumexp, x, rounds=50)
        assert abs(out - np.log(np.exp(x.astype(np.float64)).sum())) < 1e-6
    record(benchmark, read_bw, nbytes=4 * x.size)


_VERIFY1 = {}


@pytest.mark.parametrize("nodes", [1, 9, 16])
def test_verify_n_vs_verify_1(benchmark, read_bw, nodes):
    """The bundled target at context 256: one token, a 9-node chain, a 16-node tree.
    extra_info `over_verify1`: this verify's time over verify(1) measured just before."""
    eng = sapwood.load("default").engine
    rng = np.random.default_rng(5)
    eng.prefill(rng.integers(0, 4096, 256))
    parents = (np.arange(nodes) - 1 if nodes <= 9 else
               np.array([-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, nodes)]))
    tokens = rng.integers(0, 4096, nodes)
    benchmark.group = "verify(N) vs verify(1), bundled target, context 256"
    logits = run(benchmark, eng.verify, tokens, parents, rounds=30)
    # node 0 is the root: its row is the one-token verify's, bit for bit
    assert logits.shape == (nodes, 4096) and (logits[0] == eng.verify(tokens[:1], [-1])[0]).all()
    if not benchmark.disabled:
        t = benchmark.stats.stats.median
        if nodes == 1:
            _VERIFY1["t"] = t
        record(benchmark, read_bw, **({"over_verify1": t / _VERIFY1["t"]} if _VERIFY1 else {}))
