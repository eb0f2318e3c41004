"""The GPU op list's new kernels (metal/elementwise.metal, rows.metal, matmul.metal, q4_matmul)
on every device this build has (_core.gpu_devices(): the emulated Metal device everywhere, the
real one on a Mac), through _core.gpu_run, against the numpy oracles of python/sapwood/reference.

Tolerances are stated per test: `==` where the op has no rounding beyond what the oracle does
(copies, gathers, dequantization, selections, q8 / q4 with the CPU's order), an a-priori float32
error bound where it sums. Row-count independence is asserted with `==`: a row run in a launch of
16 rows and alone gives the same bits (docs/design.md "Exactness").
"""
from __future__ import annotations

import numpy as np
import pytest

import gpu_util as gu
from sapwood import _core
from sapwood.reference import ops, quant
from sapwood.reference.gdn import silu
from sapwood.reference.model import rms_norm, rope, sigmoid
from sapwood.reference.ranking import logsumexp
from util import logit_rows

U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(params=gu.devices())
def dev(request):
    return request.param


def flat(dev, kernel, args, n, threads=256):
    gu.run(dev, kernel, args, max(1, -(-n // threads)), threads)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- embedding rows

@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
def test_embed_rows_dequantize_as_the_cpu(dev, rng, fmt):
    """Rows of every table format, dequantized: the bits of the CPU's QMatrix.dequantized()
    (the same float(q) * scale), and zeros for a token outside the table."""
    vocab, hidden = 50, 200
    w = f32(rng, vocab, hidden)
    tokens = np.array([3, 0, 49, 3, 17, 50], np.int32)
    n = len(tokens)
    x = np.full((n, hidden), np.nan, np.float32)
    cpu = _core.WeightMatrix(w, fmt).dequantized()
    if fmt == "f32":
        args, pad, want = [w], hidden, w
    elif fmt == "bf16":
        b = quant.to_bf16(w)
        args, pad, want = [b], hidden, quant.from_bf16(b)
    elif fmt == "q8":
        q, s = quant.q8_weights(w)
        args, pad, want = [q, s], q.shape[1], quant.q8_dequantize(q, s, hidden)
    else:
        q, s = quant.q4_weights(w)
        args, pad, want = [q, s, s], 2 * q.shape[1], quant.q4_dequantize(q, s, hidden)  # symmetric: bias unread
    assert (want == cpu).all(), "the numpy packing is the CPU's"
    group = 64 if fmt == "q4" else 0
    gu.run(dev, f"embed_rows_{fmt}", [tokens, *args, x, gu.pack(n, hidden, pad, vocab, group, 0)], n, 64)
    assert (x[:-1] == cpu[tokens[:-1]]).all()
    assert (x[-1] == 0).all()


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dim", [64, 300])
def test_rms_norm(dev, rng, dim):
    n, eps = 16, 1e-6
    x = f32(rng, n, dim, scale=3)
    w1 = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    out = np.zeros_like(x)
    gu.run(dev, "rms_norm", [x, w1, out, gu.pack(n, dim, 0, eps)], n, 32)
    # lane chains of <= 10 squares and a 32-way fold: relative error of ss <= (dim/32 + 5) u;
    # inv adds ~3 u, each output 2 more: < 2e-6 relative on outputs of size <= 15, so 1e-4 holds
    # with room while a wrong eps, mean or scale moves them by 1e-2 or more
    want = rms_norm(x.astype(np.float64), w1.astype(np.float64) - 1, eps)
    gu_close(out, want, 1e-4, "rms_norm")
    # out aliasing x (one buffer bound twice), 8 simdgroups, a launch of one row: the same bits
    y = x.copy()
    gu.run(dev, "rms_norm", [y, w1, y, gu.pack(n, dim, 0, eps)], n, 256)
    assert (y == out).all()
    one = np.zeros((1, dim), np.float32)
    gu.run(dev, "rms_norm", [x[5:6].copy(), w1, one, gu.pack(1, dim, 0, eps)], 1, 32)
    assert (one[0] == out[5]).all()


def gu_close(actual, expected, atol, what):
    err = float(np.max(np.abs(np.asarray(actual, np.float64) - expected)))
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol:.3g}"


# ---------------------------------------------------------------- elementwise

@pytest.mark.parametrize("n", [1, 300, 1000])
def test_add_silu_sigmoid(dev, rng, n):
    x, u, y = f32(rng, n, scale=4), f32(rng, n), f32(rng, n)
    s = x.copy()
    flat(dev, "add_inplace", [s, y, gu.pack(n, 0, 0, 0)], n)
    assert (s == x + y).all()  # one float32 addition, as numpy's
    for kernel, act in (("silu_mul", silu), ("sigmoid_mul", sigmoid)):
        out = np.zeros(n, np.float32)
        flat(dev, kernel, [x, u, out, gu.pack(n, 0, 0, 0)], n)
        # exp within a few ulp, then a division and a product: a few float32 ulps of outputs of
        # size <= 16 (the CPU test's bound)
        gu_close(out, act(x.astype(np.float64)) * u, 1e-5, kernel)
        inplace = x.copy()
        flat(dev, kernel, [inplace, u, inplace, gu.pack(n, 0, 0, 0)], n)
        assert (inplace == out).all()


def test_split_q_gate_and_gather_rows(dev, rng):
    n, hq, d = 5, 3, 64
    qg = f32(rng, n, hq * 2 * d)
    q, gate = np.zeros((n, hq, d), np.float32), np.zeros((n, hq, d), np.float32)
    flat(dev, "split_q_gate", [qg, q, gate, gu.pack(n, hq, d, 0)], n * hq * d)
    wq, wg = ops.split_q_gate(qg, d)
    assert (q == wq).all() and (gate == wg).all()
    src = f32(rng, 9, 96)
    idx = np.array([0, 4, 5, 8, 4], np.int32)
    dst = np.zeros((5, 96), np.float32)
    flat(dev, "gather_rows", [src, idx, dst, gu.pack(5, 0, 96, 0)], 5 * 96)
    assert (dst == ops.gather_rows(src, idx)).all()


@pytest.mark.parametrize("rot", [64, 16])
def test_rope(dev, rng, rot):
    n, heads, d, theta = 6, 3, 64, 1e6
    pos = np.array([0, 1, 7, 100, 4095, 70000])
    x = f32(rng, n, heads, d, scale=3)
    cs = ops.rope_table(pos, rot, theta)
    y = x.copy()
    flat(dev, "rope", [y, cs, gu.pack(n, heads, d, rot)], n * heads * rot // 2)
    # cos and sin rounded to float32 (u relative), two products and a sum of values <= 15:
    # ~4e-6 worst; 1e-5 holds while a swapped sign or half moves outputs by O(1)
    gu_close(y, rope(x.astype(np.float64), pos, rot, theta), 1e-5, "rope")
    assert (y[..., rot:] == x[..., rot:]).all()


def test_gdn_gates(dev, rng):
    n, hv = 7, 12
    ba = f32(rng, n, 2 * hv, scale=3)
    dt_bias = f32(rng, hv, scale=0.5)
    probes = np.array([-80, -40, -30, -17, -1e-3, 0, 1e-3, 19.9, 20.0, 20.1, 35, 60], np.float32)
    ba[0, hv:] = probes - dt_bias  # row 0's arguments near softplus's ranges
    a_log = f32(rng, hv, scale=0.5)
    neg_exp_a = (-np.exp(a_log.astype(np.float64))).astype(np.float32)
    beta, g = np.zeros((n, hv), np.float32), np.zeros((n, hv), np.float32)
    flat(dev, "gdn_gates", [ba, dt_bias, neg_exp_a, beta, g, gu.pack(n, hv, 0, 0)], n * hv)
    # the oracle at the kernel's float32 argument a + dt_bias (rounding that sum is the model's
    # arithmetic, as the CPU's; its effect far below zero is |a| u relative, not the kernel's)
    arg = ba.copy()
    arg[:, hv:] = ba[:, hv:] + dt_bias
    wb, wg = ops.gdn_gates(arg, np.zeros(hv), a_log)
    # relative: exp and log within 4 ulp each (MSL's precise bounds; libm's are 1), then an add,
    # a division, the Goldberg correction and two products rounding once each. Far below zero
    # softplus(a) ~ exp(a): log(1 + exp(a)) without the correction gives 0 there, 100% off.
    assert np.all(np.abs(beta - wb) <= 16 * U * np.abs(wb) + 1e-38)
    assert np.all(np.abs(g - wg) <= 32 * U * np.abs(wg) + 1e-38), np.max(np.abs(g - wg) / np.abs(wg))


# ---------------------------------------------------------------- matmuls

def row_independent(dev, kernel, row_args, y16, groups):
    """Row r of a 16-row launch == the same row launched alone: row_args(r, y) gives the
    one-row launch's arguments writing into y [1, out]."""
    for r in (0, 7, 15):
        y = np.zeros((1, y16.shape[1]), np.float32)
        gu.run(dev, kernel, row_args(r, y), groups, 256)
        assert (y[0] == y16[r]).all(), f"{kernel}: row {r} differs alone"


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_float_matmul(dev, rng, fmt, rows):
    out, cols = 43, 300
    w, x = f32(rng, out, cols), f32(rng, rows, cols)
    wd = w if fmt == "f32" else quant.from_bf16(quant.to_bf16(w))
    wa = w if fmt == "f32" else quant.to_bf16(w)
    y = np.zeros((rows, out), np.float32)
    groups = -(-out // 8)
    gu.run(dev, f"matmul_{fmt}", [wa, x, y, gu.pack(rows, cols, cols, out)], groups, 256)
    # lane chains of cols/32 fmas and a 5-step fold: |error| <= (cols/32 + 6) u sum_k |x w|
    bound = (cols / 32 + 6) * U * (np.abs(x.astype(np.float64)) @ np.abs(wd.astype(np.float64)).T)
    assert np.all(np.abs(y - x.astype(np.float64) @ wd.astype(np.float64).T) <= bound)
    if rows == 16:
        row_independent(dev, f"matmul_{fmt}",
                        lambda r, yr: [wa, x[r:r + 1].copy(), yr, gu.pack(1, cols, cols, out)], y, groups)


def quantized_case(rng, rows, fmt):
    out, cols = 43, 300
    w = f32(rng, out, cols)
    x = f32(rng, rows, cols, scale=2)
    if rows > 1:
        x[1] = 0  # activation scale 0
    wq, ws = quant.q8_weights(w) if fmt == "q8" else quant.q4_weights(w)
    pad = wq.shape[1] if fmt == "q8" else 2 * wq.shape[1]
    return w, x, wq, ws, pad


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_int8_matmul_is_the_cpus(dev, rng, fmt, rows):
    """q8_quantize_rows then q8_matmul / q4_matmul: bitwise the CPU's WeightMatrix(format)
    (same activation quantization, exact int dots, the CPU's float order), and within float32
    rounding of the float64 oracle."""
    w, x, wq, ws, pad = quantized_case(rng, rows, fmt)
    out = w.shape[0]
    xq, xs = np.zeros((rows, pad), np.int8), np.zeros(rows, np.float32)
    gu.run(dev, "q8_quantize_rows", [x, xq, xs, gu.pack(rows, x.shape[1], pad, 0)], rows, 256, [32])
    rq, rs = quant.quantize_acts(x, pad)
    assert (xq == rq).all() and (xs == rs).all()
    y = np.zeros((rows, out), np.float32)
    kernel = f"{fmt}_matmul"
    groups = -(-out // (8 if fmt == "q8" else 32))  # q4: four outputs a simdgroup
    wargs = [wq, ws] if fmt == "q8" else [wq, ws, ws]  # q4 symmetric: the bias is unread
    params = (lambda n: gu.pack(n, 0, pad, out)) if fmt == "q8" else (lambda n: gu.pack(n, pad, out, 64, 0))
    gu.run(dev, kernel, [*wargs, xq, xs, y, params(rows)], groups, 256)
    assert (y == _core.WeightMatrix(w, fmt).matmul(x, threads=1)).all()
    if fmt == "q8":
        want, ops_count = quant.q8_matmul(wq, ws, xq, xs), 2
    else:
        want, ops_count = quant.q4_matmul(wq, ws, xq, xs), pad // 64 + 4
    # the integer dots are exact; each float step rounds once (q8: two products; q4: a fma per
    # group, the 3-step fold, the last product), on partial sums bounded by the absolute terms
    absw = np.abs(quant.q8_dequantize(wq, ws, w.shape[1]) if fmt == "q8" else quant.q4_dequantize(wq, ws, w.shape[1]))
    mag = (np.abs(xq[:, :x.shape[1]]).astype(np.float64) * xs[:, None]) @ absw.T.astype(np.float64)
    assert np.all(np.abs(y - want) <= ops_count * U * mag * 1.0001 + 1e-30)
    if rows == 16:
        row_independent(dev, kernel, lambda r, yr: [*wargs, xq[r:r + 1].copy(), xs[r:r + 1].copy(), yr,
                                                     params(1)], y, groups)


# ---------------------------------------------------------------- affine q4 groups (as stored)

def affine_case(rng, out, cols, group):
    """An affine Q4 matrix as a pre-quantized checkpoint stores it (QMatrix with a bias, groups
    of `group`): the CPU's WeightMatrix.affine and the kernels' buffers (nibbles in the CPU's
    byte order, scales, biases [out, cols / group]). Scales and biases of both signs and
    magnitudes spread over decades, so a wrong group, nibble, fma order or a dropped bias shows."""
    from sapwood.formats.common import pack_q4_affine
    q = rng.integers(0, 16, (out, cols)).astype(np.uint8)
    ng = cols // group
    s = (rng.standard_normal((out, ng)) * 10.0 ** rng.uniform(-3, 0, (out, ng))).astype(np.float32)
    b = (rng.standard_normal((out, ng)) * 10.0 ** rng.uniform(-2, 1, (out, ng))).astype(np.float32)
    s[0, 0], b[1, -1] = 0, 0
    nib, *_ = pack_q4_affine(q, s, b, group)
    cpu = _core.WeightMatrix.affine(q, s, b)
    assert (cpu.dequantized() == (s.repeat(group, 1) * q.astype(np.float32) + b.repeat(group, 1))).all()
    return cpu, nib.reshape(out, cols // 2), s, b


@pytest.mark.parametrize("group", [64, 32])
@pytest.mark.parametrize("cols", [64, 320])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_affine_q4_matmul_is_the_cpus(dev, rng, group, cols, rows):
    """q4_matmul over affine groups of 64 and of 32 (one run of 64 inputs, and five): the CPU's
    bits (mm_q4_job's order: fma of the scale then of the bias per lane and run), for 1..16 rows
    with an all-zero row, and a row's bits the same alone as in a launch of 16."""
    out = 45  # not a multiple of the 4 outputs a simdgroup
    cpu, nib, s, b = affine_case(rng, out, cols, group)
    x = f32(rng, rows, cols, scale=2)
    if rows > 1:
        x[1] = 0  # activation scale 0
    xq, xs = np.zeros((rows, cols), np.int8), np.zeros(rows, np.float32)
    gu.run(dev, "q8_quantize_rows", [x, xq, xs, gu.pack(rows, cols, cols, 0)], rows, 256, [32])
    y = np.full((rows, out), np.nan, np.float32)
    groups = -(-out // 32)
    params = lambda n: gu.pack(n, cols, out, group, 1)
    gu.run(dev, "q4_matmul", [nib, s, b, xq, xs, y, params(rows)], groups, 256)
    want = cpu.matmul(x, threads=1)
    assert (y == want).all(), np.abs(y - want).max()
    # and near the float64 product of the same int8 activations and weights: the case is not
    # degenerate (a dropped bias term moves it by far more than the rounding)
    exact = (xq.astype(np.float64) * xs[:, None].astype(np.float64)) @ cpu.dequantized().T.astype(np.float64)
    mag = (np.abs(xq).astype(np.float64) * xs[:, None]) @ np.abs(cpu.dequantized()).T.astype(np.float64)
    assert np.all(np.abs(y - exact) <= (2 * cols // group + 4) * U * mag * 1.0001 + 1e-30)
    if rows == 16:
        row_independent(dev, "q4_matmul", lambda r, yr: [nib, s, b, xq[r:r + 1].copy(), xs[r:r + 1].copy(),
                                                         yr, params(1)], y, groups)


@pytest.mark.parametrize("group", [64, 32])
def test_affine_embed_rows_are_the_cpus(dev, rng, group):
    """embed_rows_q4 over affine groups: QMatrix::dequant_row's bits (float(q) * scale, rounded,
    plus bias: no fma), zeros for a token outside the table."""
    vocab, hidden = 50, 192
    cpu, nib, s, b = affine_case(rng, vocab, hidden, group)
    tokens = np.array([3, 0, 49, 3, 17, 1, 50], np.int32)
    n = len(tokens)
    x = np.full((n, hidden), np.nan, np.float32)
    gu.run(dev, "embed_rows_q4", [tokens, nib, s, b, x, gu.pack(n, hidden, hidden, vocab, group, 1)], n, 64)
    want = cpu.dequantized()
    assert (x[:-1] == want[tokens[:-1]]).all()
    assert (x[-1] == 0).all()


# ---------------------------------------------------------------- drafting over logits

@pytest.mark.parametrize("cols", [7, 300, 4096])
def test_argmax_rows(dev, rng, cols):
    x = logit_rows(rng, cols)
    out = np.full(len(x), -7, np.int32)
    gu.run(dev, "argmax_rows", [x, out, gu.pack(len(x), cols, 0, 0.0)], len(x), 256, [32, 32])
    want = ops.argmax_rows(x)
    assert out.tolist() == want.tolist()
    assert out.tolist() == [_core.argmax(row) for row in x]  # the CPU's pick


@pytest.mark.parametrize("k", [1, 3, 16])
@pytest.mark.parametrize("cols", [17, 300, 4096])
def test_top_k_rows(dev, rng, cols, k):
    x = logit_rows(rng, cols)
    skip = np.array([-1, 0, -1, 3, -1, 1, cols - 1, 2], np.int32)
    ids = np.full((len(x), k), -7, np.int32)
    vals = np.full((len(x), k), np.nan, np.float32)
    gu.run(dev, "top_k_rows", [x, skip, ids, vals, gu.pack(len(x), cols, k, 0.0)], len(x), 256, [32, 32])
    want = ops.top_k_rows(x, k, skip)
    assert ids.tolist() == want.tolist()
    got_vals = np.where(want >= 0, x[np.arange(len(x))[:, None], np.maximum(want, 0)], 0)
    assert (vals == got_vals).all()
    for r in range(len(x)):  # the CPU's candidates wherever k of them qualify
        if (want[r] >= 0).all():
            assert ids[r].tolist() == list(_core.top_ids(x[r], k, int(skip[r])))


@pytest.mark.parametrize("cols", [1, 300, 151936])
def test_logsumexp_rows(dev, rng, cols):
    rows = 16 if cols < 10000 else 2
    x = f32(rng, rows, cols, scale=3)
    x[0] *= 10  # peaked: most terms underflow against the max
    out = np.zeros(rows, np.float32)
    gu.run(dev, "logsumexp_rows", [x, out, gu.pack(rows, cols, 0, 0.0)], rows, 256, [4 * 256])
    want = np.array([logsumexp(r) for r in x])
    # relative to the sum s >= 1: partial sums of cols/256 terms, an 8-add and a 5-step fold
    # (one rounding each), each exp within 4 ulp (8 u: MSL's precise bound, libm's is 1 ulp);
    # then log (4 ulp) and the final add, relative to the result. One term dropped from a flat
    # row of 300 (1/300) is far outside.
    bound = (cols / 256 + 24) * U + 10 * U * np.abs(want)
    assert np.all(np.abs(out - want) <= bound), np.abs(out - want)
    for threads in (32, 96):  # the partials' order is fixed by cols, not by the thread count
        again = np.zeros(rows, np.float32)
        gu.run(dev, "logsumexp_rows", [x, again, gu.pack(rows, cols, 0, 0.0)], rows, threads, [4 * 256])
        assert (again == out).all()
    one = np.zeros(1, np.float32)
    gu.run(dev, "logsumexp_rows", [x[-1:].copy(), one, gu.pack(1, cols, 0, 0.0)], 1, 256, [4 * 256])
    assert one[0] == out[-1]
