"""The SYCL device layer (emu/sycl_device.cpp over sycl/sycl_ops.hpp): the sycl/*.hpp kernels
behind the Metal kernel names, argument order and launch shape. What is SYCL-specific is here;
the op oracles (tests/test_gpu_ops.py, tests/test_gpu_state.py, tests/test_backend_ops.py)
already run on "sycl-emulated" through _core.gpu_devices() and _core.available_backends().

- the registry is the Metal kernels', with their buffer and threadgroup-memory counts;
- every kernel gives the same bits on both emulated devices (the ports keep Metal's
  arithmetic and reduction trees; any difference is a drifted port);
- the canonical sub-group sum is the documented xor butterfly (sycl/README.md), bit for bit;
- whole models through GpuBackend give metal-emulated's logits bitwise;
- a Metal launch the SYCL twin cannot translate is refused with the grid it needed.
Mutants of the SYCL sources are in tests/test_gpu_mutants.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import gpu_util as gu
import sapwood
from sapwood import _core
from sapwood.reference import quant
from test_gpu_device import source_signatures
from test_gpu_state import SMALL, gdn_case, paged_history, tree_attention, tree_inputs
from util import TREES

SYCL, METAL = "sycl-emulated", "metal-emulated"


def test_registry_is_the_metal_kernels():
    src = source_signatures()
    reg = _core.gpu_emulated_kernels(SYCL)
    assert set(reg) == set(src), (set(src) - set(reg), set(reg) - set(src))
    for name, kinds in src.items():
        assert reg[name] == "b" * kinds.count("b") + "t" * kinds.count("t"), name
    with pytest.raises(ValueError, match="device must be 'metal-emulated' or 'sycl-emulated', got 'sycl'"):
        _core.gpu_emulated_kernels("sycl")


# ---------------------------------------------------------------- the same bits as Metal's

def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def cases(rng):
    """{kernel: (args, groups, threads, threadgroup_bytes)} for every kernel but the sequence
    state's (compared below) and those whose bits are the reference's on every device."""
    vocab, hidden, n = 40, 200, 5
    tokens = np.array([3, 0, 39, 3, 40], np.int32)  # the last is outside the table
    w = f32(rng, vocab, hidden)
    q8, s8 = quant.q8_weights(w)
    q4, s4 = quant.q4_weights(w)
    emb = lambda *tab, pad, group=0: ([tokens, *tab, np.zeros((n, hidden), np.float32),
                                       gu.pack(n, hidden, pad, vocab, group, 0)], n, 64, [])
    c = {
        "embed_rows_f32": emb(w, pad=hidden),
        "embed_rows_bf16": emb(quant.to_bf16(w), pad=hidden),
        "embed_rows_q8": emb(q8, s8, pad=q8.shape[1]),
        "embed_rows_q4": emb(q4, s4, s4, pad=2 * q4.shape[1], group=64),  # symmetric: bias unread
    }
    m = 700
    x, u = f32(rng, m, scale=4), f32(rng, m)
    flat = lambda args, count, threads=128: (args, -(-count // threads), threads, [])
    c["add_inplace"] = flat([x.copy(), u, gu.pack(m, 0, 0, 0)], m)
    c["silu_mul"] = flat([x, u, np.zeros(m, np.float32), gu.pack(m, 0, 0, 0)], m)
    c["sigmoid_mul"] = flat([x, u, np.zeros(m, np.float32), gu.pack(m, 0, 0, 0)], m)
    hq, d = 3, 64
    c["split_q_gate"] = flat([f32(rng, n, hq * 2 * d), np.zeros((n, hq, d), np.float32),
                              np.zeros((n, hq, d), np.float32), gu.pack(n, hq, d, 0)], n * hq * d)
    cs = np.stack([np.cos(f32(rng, n, 8)), np.sin(f32(rng, n, 8))], -1).astype(np.float32)
    c["rope"] = flat([f32(rng, n, hq, d, scale=3), cs, gu.pack(n, hq, d, 16)], n * hq * 8)
    hv = 12
    c["gdn_gates"] = flat([f32(rng, n, 2 * hv, scale=8), f32(rng, hv), -np.abs(f32(rng, hv)),
                           np.zeros((n, hv), np.float32), np.zeros((n, hv), np.float32), gu.pack(n, hv, 0, 0)], n * hv)
    c["gather_rows"] = flat([f32(rng, 9, 96), np.array([0, 4, 5, 8, 4], np.int32), np.zeros((5, 96), np.float32),
                             gu.pack(5, 0, 96, 0)], 5 * 96)
    rows, out, cols = 5, 43, 300
    xr = f32(rng, rows, cols)
    wm = f32(rng, out, cols)
    c["matmul_f32"] = ([wm, xr, np.zeros((rows, out), np.float32), gu.pack(rows, cols, cols, out)], 6, 256, [])
    c["matmul_bf16"] = ([quant.to_bf16(wm), xr, np.zeros((rows, out), np.float32), gu.pack(rows, cols, cols, out)],
                        6, 256, [])
    wq, ws = quant.q4_weights(wm)
    xq, xs = quant.quantize_acts(xr, 2 * wq.shape[1])
    c["q4_matmul"] = ([wq, ws, ws, xq, xs, np.zeros((rows, out), np.float32),
                       gu.pack(rows, 2 * wq.shape[1], out, 64, 0)], 2, 256, [])  # 4 outputs a simdgroup
    c["rms_norm"] = ([f32(rng, rows, cols, scale=3), f32(rng, cols), np.zeros((rows, cols), np.float32),
                      gu.pack(rows, cols, 0, 1e-6)], rows, 96, [])
    logits = rng.integers(-4, 5, (rows, 1000)).astype(np.float32)  # ties
    logits[1, ::7] = np.nan
    c["argmax_rows"] = ([logits, np.zeros(rows, np.int32), gu.pack(rows, 1000, 0, 0.0)], rows, 256, [32, 32])
    c["logsumexp_rows"] = ([f32(rng, rows, 1000, scale=3), np.zeros(rows, np.float32), gu.pack(rows, 1000, 0, 0.0)],
                           rows, 256, [4 * 256])
    c["top_k_rows"] = ([logits, np.array([-1, 0, 5, -1, 999], np.int32), np.zeros((rows, 5), np.int32),
                        np.zeros((rows, 5), np.float32), gu.pack(rows, 1000, 5, 0.0)], rows, 256, [32, 32])
    return c


# bitwise the numpy reference's on every device (test_gpu_state.py, test_gpu_ops.py), so each other's
REFERENCE_BITS = {"kv_quantize", "q8_quantize_rows", "q8_matmul"}
# compared by test_sequence_state_same_bits_as_metal
SEQUENCE_STATE = {"tree_attn_partial", "tree_attn_merge", "gdn_conv", "gdn_recur", "gdn_commit", "gdn_window"}


def test_the_cases_cover_every_kernel():
    covered = set(cases(np.random.default_rng(0))) | REFERENCE_BITS | SEQUENCE_STATE
    assert covered == set(_core.gpu_emulated_kernels(SYCL))


@pytest.mark.parametrize("kernel", sorted(cases(np.random.default_rng(0))))
def test_same_bits_as_the_metal_kernel(kernel):
    """Both emulated devices, one launch, every buffer afterwards byte-identical (`==` on bytes,
    NaN payloads included): the port computes what the Metal kernel computes."""
    args, groups, threads, tg = cases(np.random.default_rng(7))[kernel]
    outs = {}
    for dev in (METAL, SYCL):
        mine = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        gu.run(dev, kernel, mine, groups, threads, tg)
        outs[dev] = [a.tobytes() for a in mine if isinstance(a, np.ndarray)]
    assert outs[METAL] == outs[SYCL]
    before = [a.tobytes() for a in args if isinstance(a, np.ndarray)]
    assert outs[SYCL] != before, f"{kernel}: the case writes nothing, so it compares nothing"


def test_sequence_state_same_bits_as_metal():
    """Tree attention over pages and the tree, and two rounds of GDN (a replayed commit, a
    selected one) bound as test_gpu_state.py binds them: every output byte-identical."""
    kv = paged_history(SMALL, 100, 5)
    q, k, v = tree_inputs(SMALL, 9, 5)
    metal, sycl = (tree_attention(dev, q, kv, k, v, TREES["random3"]) for dev in (METAL, SYCL))
    assert metal.tobytes() == sycl.tobytes()
    metal, sycl = (gdn_case(dev) for dev in (METAL, SYCL))
    assert [a.tobytes() for a in metal] == [a.tobytes() for a in sycl]


def butterfly(v):
    """sycl/sw_sycl_common.hpp sg_sum in numpy: lane l adds lane l ^ m, m = 16, 8, 4, 2, 1."""
    v = np.asarray(v, np.float32).copy()
    lanes = np.arange(32)
    for m in (16, 8, 4, 2, 1):
        v = (v + v[lanes ^ m]).astype(np.float32)
    assert (v == v[0]).all()  # every lane holds the same bits
    return v[0]


@pytest.mark.parametrize("dev", [SYCL, METAL])
def test_sub_group_sum_is_the_documented_butterfly(dev):
    """matmul_f32 over 32 columns: lane l's sum is the single product x[l] * w[l] (rounded once),
    so each output is exactly sg_sum of the 32 products. Magnitudes spread over 8 decades make
    the association visible: a sequential sum differs from the butterfly for most outputs."""
    rng = np.random.default_rng(11)
    out = 64
    x = (rng.standard_normal((1, 32)) * 10.0 ** rng.uniform(-4, 4, 32)).astype(np.float32)
    w = (rng.standard_normal((out, 32)) * 10.0 ** rng.uniform(-4, 4, (out, 32))).astype(np.float32)
    y = np.zeros((1, out), np.float32)
    gu.run(dev, "matmul_f32", [w, x, y, gu.pack(1, 32, 32, out)], out // 8, 256)
    products = (x * w).astype(np.float32)  # [out, 32]
    want = np.array([butterfly(p) for p in products], np.float32)
    assert (y[0] == want).all()
    sequential = np.array([np.cumsum(p, dtype=np.float32)[-1] for p in products], np.float32)
    assert (sequential != want).sum() > out // 4, "the case does not tell orders apart"


@pytest.mark.parametrize("weights", ["f32", "q4"])
def test_whole_model_logits_equal_metal_emulated_bitwise(tmp_path, weights):
    """GpuBackend over either emulated device: the same kernels' arithmetic, so prefill and
    16-node tree logits of an irregular tiny model (dk != dv, Hv = 3 Hk) are equal to the bit."""
    from sapwood.testing import make_tiny_checkpoint
    from util import random_tree
    layers = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    make_tiny_checkpoint(tmp_path, seed=3, layers=len(layers), layer_types=layers, hk=2, hv=6, dk=16, dv=32)
    prompt = np.random.default_rng(0).integers(0, 256, 40).tolist()
    parents, toks = random_tree(16, 7).tolist(), np.random.default_rng(1).integers(0, 256, 16).tolist()
    out = {}
    for dev in (METAL, SYCL):
        e = sapwood.load(tmp_path, weights=weights, backend=dev).engine
        out[dev] = (e.prefill(prompt, all_logits=True), e.verify(toks, parents))
    assert (out[METAL][0] == out[SYCL][0]).all() and (out[METAL][1] == out[SYCL][1]).all()
    assert np.isfinite(out[SYCL][1]).all() and np.abs(out[SYCL][1]).max() > 0


# ---------------------------------------------------------------- launches and errors

def test_grids_the_sycl_twins_cannot_decode_are_refused():
    x = np.zeros((5, 2, 32), np.float32)
    kv = [x, np.zeros((5, 2, 32), np.int8), np.zeros((5, 2, 1), np.float32), np.zeros(1, np.int32),
          gu.pack(5, 2, 32, 0, 0)]
    with pytest.raises(RuntimeError, match=r"kv_quantize: the SYCL twin decodes the flattened grid with "
                                           r"n_kv_heads = 2, so the grid must be \(x, 2, 1\), got \(5, 3, 1\)"):
        gu.run(SYCL, "kv_quantize", kv, (5, 3), 32)
    gu.run(METAL, "kv_quantize", kv, (5, 3), 32)  # (Metal itself would run it: its y only picks a head)
    rows = [np.ones((2, 64), np.float32), np.ones(64, np.float32), np.zeros((2, 64), np.float32),
            gu.pack(2, 64, 0, 1e-6)]
    with pytest.raises(RuntimeError, match=r"rms_norm: the SYCL twin takes a 1-D grid \(x, 1, 1\), got \(2, 2, 1\)"):
        gu.run(SYCL, "rms_norm", rows, (2, 2), 32)
    gu.run(SYCL, "rms_norm", rows, (2, 1, 1), 32)
    assert np.abs(rows[2] - 1).max() < 1e-6  # ones normalised (eps 1e-6): it ran


def test_binding_errors_are_the_metal_devices():
    """The backend sees one contract: the same checks and messages as metal-emulated."""
    with pytest.raises(RuntimeError, match="sycl-emulated: no kernel named 'no_such_kernel'"):
        gu.run(SYCL, "no_such_kernel", [], 1, 32)
    x = np.zeros((2, 64), np.float32)
    args = [x, np.zeros((2, 64), np.int8), np.zeros(2, np.float32), gu.pack(2, 64, 64, 0)]
    for dev in (METAL, SYCL):
        with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 4 buffer arguments, got 1"):
            gu.run(dev, "q8_quantize_rows", [x], 2, 256, [32])
        with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 1 threadgroup memory"):
            gu.run(dev, "q8_quantize_rows", args, 2, 256)
        with pytest.raises(RuntimeError, match="q8_quantize_rows: threads .* got 48"):
            gu.run(dev, "q8_quantize_rows", args, 2, 48, [32])
        with pytest.raises(RuntimeError, match=r"q8_quantize_rows: buffer\(3\): a constant block of 12 bytes"):
            gu.run(dev, "q8_quantize_rows", args[:3] + [gu.pack(2, 64, 64)], 2, 256, [32])
