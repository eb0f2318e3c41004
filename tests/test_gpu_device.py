"""The GPU device layer (csrc/gpu/device.h) through _core.gpu_run: the emulated Metal device's
registry against the sources, its argument binding, its errors, and the four existing kernel
families run through it, bitwise equal to the ctypes launchers of tests/gpu_util.py (the same
kernels with the same arithmetic: any difference is a binding fault).
"""
from __future__ import annotations

import re
import struct
import sys

import numpy as np
import pytest

import gpu_util as gu
from sapwood import _core
from sapwood.reference import kv as refkv
from util import TREES, path_to

DEVICES = gu.devices()
EMU = "metal-emulated"


@pytest.fixture(params=DEVICES)
def dev(request):
    return request.param


@pytest.fixture(scope="module")
def ctypes_metal():
    if not gu.compiler_available():
        pytest.skip(f"no {gu.CXX}: the ctypes launchers need it")
    return gu.Backend("metal-emu")


# ---------------------------------------------------------------- registry

BUILTIN = {"threadgroup_position_in_grid": "g", "thread_index_in_threadgroup": "i",
           "thread_index_in_simdgroup": "l", "simdgroup_index_in_threadgroup": "s",
           "simdgroups_per_threadgroup": "n"}


def source_signatures():
    """{kernel: one letter per parameter} parsed from metal/*.metal, checking on the way that
    buffer(i) and threadgroup(i) count up in parameter order (the binder's assumption)."""
    out = {}
    for p in sorted(gu.METAL.glob("*.metal")):
        text = re.sub(r"//.*", "", p.read_text())
        for m in re.finditer(r"\bkernel\s+void\s+(\w+)\s*\(([^{]*)\)\s*\{", text):
            kinds, nb, nt = "", 0, 0
            for param in m.group(2).split(","):
                b = re.search(r"\[\[\s*buffer\((\d+)\)\s*\]\]", param)
                t = re.search(r"SW_THREADGROUP_ARG\((\d+)\)", param)
                a = re.search(r"\[\[\s*(\w+)\s*\]\]", param)
                if b:
                    assert int(b.group(1)) == nb, f"{m.group(1)}: buffer({b.group(1)}) out of order"
                    kinds, nb = kinds + "b", nb + 1
                elif t:
                    assert int(t.group(1)) == nt, f"{m.group(1)}: threadgroup({t.group(1)}) out of order"
                    kinds, nt = kinds + "t", nt + 1
                else:
                    assert a and a.group(1) in BUILTIN, f"{m.group(1)}: parameter {param.strip()!r}"
                    kinds += BUILTIN[a.group(1)]
            assert m.group(1) not in out, f"kernel {m.group(1)} defined twice"
            out[m.group(1)] = kinds
    return out


def test_registry_is_exactly_the_sources_kernels():
    """Every `kernel void` of metal/*.metal is registered, nothing else, each with the binding
    its source declares."""
    src = source_signatures()
    reg = _core.gpu_emulated_kernels()
    assert set(reg) == set(src), (set(src) - set(reg), set(reg) - set(src))
    for name, kinds in src.items():
        assert reg[name] == kinds, name


def test_devices_and_their_errors():
    assert EMU in DEVICES
    with pytest.raises(ValueError, match="unknown GPU device 'cuda'.*metal-emulated"):
        gu.run("cuda", "rms_norm", [], 1, 32)
    if sys.platform != "darwin":
        with pytest.raises(ValueError, match="macOS"):
            gu.run("metal", "rms_norm", [], 1, 32)
    with pytest.raises(RuntimeError, match="no kernel named 'no_such_kernel'"):
        gu.run(EMU, "no_such_kernel", [], 1, 32)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 4 buffer arguments, got 1"):
        gu.run(EMU, "q8_quantize_rows", [x], 2, 256, [32])
    args = [x, np.zeros((2, 64), np.int8), np.zeros(2, np.float32), gu.pack(2, 64, 64, 0)]
    with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 1 threadgroup memory"):
        gu.run(EMU, "q8_quantize_rows", args, 2, 256)
    with pytest.raises(RuntimeError, match="q8_quantize_rows: threads .* got 48"):
        gu.run(EMU, "q8_quantize_rows", args, 2, 48, [32])
    with pytest.raises(RuntimeError, match=r"q8_quantize_rows: buffer\(3\): a constant block of 12 bytes"):
        gu.run(EMU, "q8_quantize_rows", args[:3] + [gu.pack(2, 64, 64)], 2, 256, [32])
    with pytest.raises(ValueError, match=r"args\[1\] must be a numpy array .* got <class 'list'>"):
        gu.run(EMU, "q8_quantize_rows", [x, [1, 2], args[2], args[3]], 2, 256, [32])
    with pytest.raises(ValueError, match=r"args\[0\] must be C-contiguous"):
        gu.run(EMU, "q8_quantize_rows", [np.zeros((64, 2), np.float32).T] + args[1:], 2, 256, [32])


def test_outputs_come_back_in_place_and_read_only_inputs_stay():
    x = np.arange(64, dtype=np.float32).reshape(1, 64) - 31.5
    x.flags.writeable = False
    xq, xs = np.zeros((1, 64), np.int8), np.zeros(1, np.float32)
    gu.run(EMU, "q8_quantize_rows", [x, xq, xs, gu.pack(1, 64, 64, 0)], 1, 256, [32])
    assert xs[0] == np.float32(31.5) / np.float32(127) and xq[0, 0] == -127 and xq[0, -1] == 127


# ---------------------------------------------------------------- the existing families

def test_kv_quantize_through_device_bitwise(dev, ctypes_metal):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 2, 96)) * 3).astype(np.float32)
    x[0, 0, :32] = 0
    q, s = np.zeros((5, 2, 96), np.int8), np.zeros((5, 2, 3), np.float32)
    gu.run(dev, "kv_quantize", [x, q, s, np.zeros(1, np.int32), gu.pack(5, 2, 96, 0, 0)], (5, 2), 96)
    cq, cs = ctypes_metal.kv_quantize_direct(x)
    assert (q == cq).all() and (s == cs).all()
    rq, rs = refkv.quantize_int8(x)
    assert (q == rq).all() and (s == rs).all()


def attn_plan(parents, hist_len):
    """metal/sw_plan.h for one block of rows: ancestor lists and keys per row."""
    n = len(parents)
    depth = np.zeros(n, np.int32)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    stride = int(depth.max()) + 1
    anc = np.zeros((n, stride), np.int32)
    for i in range(n):
        for d, k in enumerate(path_to(parents, i)):
            anc[i, d] = k
    return anc, (hist_len + depth + 1).astype(np.int32), stride


def test_tree_attention_through_device_bitwise(dev, ctypes_metal):
    """kv_quantize -> tree_attn_partial -> tree_attn_merge bound by hand, against the ctypes
    launcher (which plans the same launches): P = 100 history keys on shuffled pages."""
    hq, hkv, d, page, split, p = 4, 2, 64, 64, 64, 100
    rng = np.random.default_rng(3)
    kv = refkv.PagedKV(4, page, hkv, d)
    kv.free = [2, 0, 3, 1]
    kv.append(rng.standard_normal((p, hkv, d)).astype(np.float32),
              rng.standard_normal((p, hkv, d)).astype(np.float32))
    parents = TREES["random3"]
    n = len(parents)
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((n, hkv, d)).astype(np.float32) for _ in range(2))
    want = ctypes_metal.tree_attention(q, kv, k, v, parents, split=split)

    tq = {}
    for name, x in (("k", k), ("v", v)):
        tq[name] = (np.zeros((n, hkv, d), np.int8), np.zeros((n, hkv, d // 32), np.float32))
        gu.run(dev, "kv_quantize", [x, *tq[name], np.zeros(1, np.int32), gu.pack(n, hkv, d, 0, 0)], (n, hkv), d)
    anc, row_len, stride = attn_plan(parents, kv.length)
    n_chunks = -(-int(row_len.max()) // split)
    grp = hq // hkv
    scale = float(np.float32(1) / np.sqrt(np.float32(d)))
    prm = gu.pack(n, hq, hkv, d, kv.length, page, split, n_chunks, stride, scale)
    part = np.zeros((n_chunks, n, hq, d + 2), np.float32)
    gu.run(dev, "tree_attn_partial",
           [q, kv.k_q, kv.k_s, kv.v_q, kv.v_s, np.array(kv.page_table, np.int32), *tq["k"], *tq["v"],
            anc, row_len, part, prm], (n_chunks, hkv), 32 * -(-n * grp // 4), [72 * d])
    out = np.zeros((n, hq, d), np.float32)
    gu.run(dev, "tree_attn_merge", [part, row_len, out, prm], (n, hq), 32)
    assert (out == want).all()


def test_gdn_through_device_bitwise(dev, ctypes_metal):
    """gdn_conv -> gdn_recur, then gdn_commit (replay with folding) -> gdn_window, against
    gu.GDN's verify and commit on a 9-node tree (hk 2, hv 4, dk 16, dv 32)."""
    hk, hv, dk, dv, kk = 2, 4, 16, 32, 4
    c = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(5)
    conv_w = (rng.standard_normal((c, kk)) * 0.5).astype(np.float32)
    layer = gu.GDN(ctypes_metal, hk, hv, dk, dv, conv_w, max_pending=2)
    layer.state = rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.1
    layer.window = rng.standard_normal((kk - 1, c)).astype(np.float32)
    state0, window0 = layer.state.copy(), layer.window.copy()
    parents = TREES["random3"]
    n = len(parents)
    x = rng.standard_normal((n, c)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (n, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
    want = layer.verify(x, g, beta, parents)
    path = path_to(parents, n - 1)
    layer.commit(path)

    q_scale = float(np.float32(1) / np.sqrt(np.float32(dk)))
    prm = gu.pack(n, hk, hv, dk, dv, kk, 1, 0, 0, 0, 0, q_scale, 0)
    q, k = np.zeros((n, hk, dk), np.float32), np.zeros((n, hk, dk), np.float32)
    vv, out = np.zeros((n, hv, dv), np.float32), np.zeros((n, hv, dv), np.float32)
    node_state = np.zeros((n, hv, dk, dv), np.float32)
    par = np.asarray(parents, np.int32)
    gu.run(dev, "gdn_conv", [x, par, window0, np.ascontiguousarray(conv_w.T), q, k, vv, prm], (n, 2 * hk + hv), 32)
    tape = [np.zeros((1, hk, dk), np.float32), np.zeros((1, hv, dv), np.float32),
            np.zeros((1, hv), np.float32), np.zeros((1, hv), np.float32)]
    threads = 32 * -(-max(dk, dv) // 32)
    gu.run(dev, "gdn_recur", [state0, *tape, q, k, vv, g, beta, par, out, node_state, prm], hv, threads,
           [4 * 2 * dk])
    assert (out == want).all()

    n_fold = len(path) - 2  # two tokens stay pending (max_pending=2)
    cprm = gu.pack(0, hk, hv, dk, dv, kk, 1, 0, len(path), n_fold, 0, 0.0, 0)
    new_tape = [np.zeros((2,) + t.shape[1:], np.float32) for t in tape]
    state = state0.copy()
    gu.run(dev, "gdn_commit", [state, *tape, k, vv, g, beta, np.asarray(path, np.int32), node_state, *new_tape, cprm],
           hv, threads, [4 * dk])
    new_window = np.zeros_like(window0)
    gu.run(dev, "gdn_window", [window0, x, np.asarray(path, np.int32), new_window, cprm], -(-c // 256), 256)
    assert (state == layer.state).all() and (new_window == layer.window).all()
    for mine, theirs in zip(new_tape, layer.tape):
        assert (mine == theirs).all()


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


@pytest.mark.parametrize("rows", [1, 16])
def test_q8_through_device_bitwise(dev, ctypes_metal, rows):
    rng = np.random.default_rng(rows)
    out, cols, cols_pad = 43, 300, 320
    w = rng.integers(-127, 128, (out, cols_pad)).astype(np.int8)
    w[:, cols:] = 0
    ws = rng.uniform(1e-3, 1e-2, out).astype(np.float32)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    xq, xs = np.zeros((rows, cols_pad), np.int8), np.zeros(rows, np.float32)
    gu.run(dev, "q8_quantize_rows", [x, xq, xs, gu.pack(rows, cols, cols_pad, 0)], rows, 256, [32])
    cq, cs = ctypes_metal.q8_quantize_rows(x, cols_pad)
    assert (xq == cq).all() and (xs == cs).all()
    y = np.zeros((rows, out), np.float32)
    gu.run(dev, "q8_matmul", [w, ws, xq, xs, y, gu.pack(rows, 0, cols_pad, out)], -(-out // 8), 256)
    assert (y == ctypes_metal.q8_matmul(w, ws, cq, cs)).all()


def test_pack_matches_the_c_layout():
    assert gu.pack(1, -2, 0.5) == struct.pack("<iif", 1, -2, 0.5)
