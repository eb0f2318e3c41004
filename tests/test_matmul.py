"""Matmul kernels for every weight format: exact against a numpy model of the same arithmetic,
and batch invariant bit for bit (a row's result never depends on the other rows)."""
import numpy as np
import pytest

from sapwood import _core
from util import ISAS, isa

FORMATS = ["f32", "bf16", "q8", "q4"]


def quantize_rows(x):
    """The activation quantization Q8/Q4 use: per row, scale = amax/127, rint, clamp."""
    s = (np.abs(x).max(1) / np.float32(127)).astype(np.float32)
    safe = np.where(s == 0, 1, s)[:, None]
    q = np.clip(np.rint(x / safe), -127, 127)
    return q * s[:, None]


@pytest.mark.parametrize("shape", [(70, 100), (256, 64), (33, 300)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_dequantized_oracle(fmt, shape):
    """Tolerance: float32 accumulation over <= 300 products of O(1) terms vs float64: 1e-4
    relative to the output scale; the quantized formats see the same quantized activations."""
    rng = np.random.default_rng(shape[0])
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((9, shape[1])).astype(np.float32)
    m = _core.WeightMatrix(w, fmt)
    xe = quantize_rows(x) if fmt in ("q8", "q4") else x
    want = xe.astype(np.float64) @ m.dequantized().astype(np.float64).T
    got = m.matmul(x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_weights_are_close(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    d = _core.WeightMatrix(w, fmt).dequantized()
    # half a quantization step: f32 exact, bf16 2^-9 relative, q8 amax/254, q4 amax/14 per group
    bound = {"f32": 0.0, "bf16": np.abs(w).max() * 2.0 ** -8, "q8": np.abs(w).max() / 254 * 1.001,
             "q4": np.abs(w).max() / 14 * 1.001}[fmt]
    assert np.abs(d - w).max() <= bound


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("outputs", [600, 1100])
def test_batch_invariant_bitwise(fmt, outputs):
    rng = np.random.default_rng(2)
    # several jobs of one-row matmuls (256 outputs, the last threads x 256 cut in 64s: 600
    # has one long job, partial, 1100 three, the last partial) and of batches (64), partial
    # last ones, a partial Q8 group
    w = rng.standard_normal((outputs, 200)).astype(np.float32)
    x = rng.standard_normal((16, 200)).astype(np.float32)
    m = _core.WeightMatrix(w, fmt)
    full = m.matmul(x)
    for n in [1, 3, 5, 16]:
        for start in range(0, 16, n):
            for threads in (0, 1, 2):  # 0: the default count
                part = m.matmul(x[start:start + n], threads=threads)
                assert (part == full[start:start + n]).all()


def matmul_on_every_isa(m, x):
    """m.matmul(x) under each kernel variant; asserts they agree bitwise, returns the result."""
    outs = []
    for name in ISAS:
        with isa(name):
            outs.append(m.matmul(x))
    for o in outs[1:]:
        assert (o == outs[0]).all()
    return outs[0]


# shapes reach every register tile and tail: outputs not a multiple of 16 (Q8 groups) or of
# 64 (a job: odd group counts for AMX's and VNNI's pairs), rows 1..16 (AVX2: 16x3 tiles,
# one-row below; VNNI: balanced tiles of up to 12 rows x 32 outputs, 9-12 rows as one tile, 13
# as 7 + 6, 24 as 12 + 12, 25 as 9 + 8 + 8) and past 16 with a partial last tile (AMX: 16 rows
# per tile), padded widths with (160, 288) and without
# (256) a 32-input tail block
@pytest.mark.skipif(len(ISAS) < 2, reason="only one kernel variant on this CPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out,cols,rows", [(50, 160, 7), (64, 256, 16), (37, 288, 1), (9, 32, 5),
                                           (6, 64, 2), (11, 96, 3), (150, 96, 1), (200, 64, 3),
                                           (70, 160, 37), (130, 288, 17), (16, 96, 33),
                                           (600, 96, 1), (130, 288, 9), (48, 160, 8),
                                           (50, 160, 10), (37, 288, 11), (130, 96, 12),
                                           (70, 64, 13), (48, 96, 24), (50, 160, 25)])
def test_kernel_variants_bitwise(fmt, out, cols, rows):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((out, cols)).astype(np.float32)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    matmul_on_every_isa(_core.WeightMatrix(w, fmt), x)


@pytest.mark.skipif(len(ISAS) < 2, reason="only one kernel variant on this CPU")
def test_q8_extreme_dots_same_on_every_variant():
    """Saturated int8 operands of one sign, the largest int32 dots the format makes: the
    unsigned-offset VNNI path must not overflow or saturate where the signed paths do not."""
    w = np.ones((8, 4096), np.float32)
    w[1::2] *= -1
    y = matmul_on_every_isa(_core.WeightMatrix(w, "q8"), np.ones((5, 4096), np.float32))
    assert (y[:, 0::2] == 4096).all() and (y[:, 1::2] == -4096).all()


def test_bad_input():
    with pytest.raises(ValueError, match="weights format"):
        _core.WeightMatrix(np.ones((2, 2), np.float32), "q3")
    m = _core.WeightMatrix(np.ones((4, 8), np.float32), "q8")
    with pytest.raises(ValueError, match="x has shape"):
        m.matmul(np.ones((2, 9), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        m.matmul(np.full((1, 8), np.nan, np.float32))


def affine_matrix(out, cols, seed=4, group=64):
    """Affine 4-bit groups of `group` inputs (a pre-quantized checkpoint's, run as stored):
    values 0..15, a scale and a bias per group, as MLX's quantizer makes them (bias = the
    group's min)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(out, cols)).astype(np.uint8)
    s = (rng.random((out, cols // group)) * 0.2 + 0.01).astype(np.float32)
    b = (rng.standard_normal((out, cols // group)) * 0.5).astype(np.float32)
    return q, s, b


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("shape", [(70, 128), (256, 64), (33, 320)])
def test_affine_q4_matches_dequantized_oracle(shape, group):
    """The same oracle and tolerance as the other formats: the quantized activations times the
    stored weights, scale * q + bias, in float64."""
    q, s, b = affine_matrix(*shape, group=group)
    m = _core.WeightMatrix.affine(q, s, b)
    w = np.repeat(s, group, 1) * q.astype(np.float32) + np.repeat(b, group, 1)
    np.testing.assert_array_equal(m.dequantized(), w)  # stored, not rounded again
    x = np.random.default_rng(5).standard_normal((9, shape[1])).astype(np.float32)
    want = quantize_rows(x).astype(np.float64) @ w.astype(np.float64).T
    got = m.matmul(x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    rows16 = -(-shape[0] // 16) * 16  # stored in groups of 16 outputs (csrc/weights.h)
    assert m.nbytes == rows16 * shape[1] // 2 + 2 * 4 * rows16 * s.shape[1]


@pytest.mark.skipif(len(ISAS) < 2, reason="only one kernel variant on this CPU")
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("out,cols,rows", [(50, 192, 7), (64, 256, 16), (37, 64, 1), (6, 64, 2),
                                           (11, 128, 3), (150, 128, 1), (70, 192, 37),
                                           (130, 320, 17), (16, 128, 33), (48, 192, 8),
                                           (37, 320, 11), (130, 128, 12), (70, 64, 13)])
def test_affine_q4_kernel_variants_bitwise(out, cols, rows, group):
    q, s, b = affine_matrix(out, cols, group=group)
    x = np.random.default_rng(6).standard_normal((rows, cols)).astype(np.float32)
    m = _core.WeightMatrix.affine(q, s, b)
    matmul_on_every_isa(m, x)
    for n in (1, 3):  # batch invariant
        assert (m.matmul(x[:n]) == m.matmul(x)[:n]).all()


def test_affine_q4_groups_of_32_are_their_own():
    """Groups of 32 are not groups of 64 in disguise: a scale or bias changed in one group of
    32 changes exactly the outputs of its row, on every kernel variant."""
    q, s, b = affine_matrix(20, 128, group=32)
    x = np.random.default_rng(7).standard_normal((3, 128)).astype(np.float32)
    y0 = matmul_on_every_isa(_core.WeightMatrix.affine(q, s, b), x)
    for g in range(4):
        s2 = s.copy()
        s2[5, g] *= 2
        y = matmul_on_every_isa(_core.WeightMatrix.affine(q, s2, b), x)
        assert (y[:, 5] != y0[:, 5]).all() and (np.delete(y, 5, 1) == np.delete(y0, 5, 1)).all()


def test_affine_q4_bad_input():
    q, s, b = affine_matrix(4, 64)
    with pytest.raises(ValueError, match="64 | in"):
        _core.WeightMatrix.affine(q[:, :32].copy(), s, b)
    with pytest.raises(ValueError, match="0..15"):
        _core.WeightMatrix.affine(q + 16, s, b)
    with pytest.raises(ValueError, match="scales"):
        _core.WeightMatrix.affine(q, s[:2], b)
    with pytest.raises(ValueError, match=r"scales must be \[4, 1\] or \[4, 2\]"):
        _core.WeightMatrix.affine(q, np.ones((4, 4), np.float32), b)
    with pytest.raises(ValueError, match="biases"):
        _core.WeightMatrix.affine(q, np.ones((4, 2), np.float32), b)
