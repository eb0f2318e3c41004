"""GPU kernels (metal/*.metal, sycl/*.hpp) against the numpy oracles, kept honest without a GPU.

Each backend runs the same suite: "metal-emu" compiles the unmodified .metal files as C++ under
emu/metal_shim.hpp, "sycl-emu" instantiates the SYCL kernel templates with an emulated nd_item;
both run every threadgroup's threads as fibers, so barriers and simdgroup reductions are real
rendezvous (emu/fiber.hpp). Real devices join when their host library is present
(SAPWOOD_METAL_LIB / SAPWOOD_SYCL_LIB, see tests/gpu_util.py).

Tolerances are the CPU tests' (test_tree_attention.py, test_gdn.py give the reasoning): 1e-4 for
attention (against the int8-query oracle, as the kernels round queries like keys), 2e-4 for GDN, bitwise for int8 quantization and for q8 (integer dots; the two final
float products in the same order as the numpy model). Within a backend the invariances are
bitwise: a node's output is the same in a tree, in its chain, and alone after its ancestors were
committed. The mutation tests (tests/test_gpu_mutants.py) run on the device layer.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import gpu_util as gu
from sapwood.reference import kv as refkv
from sapwood.reference.gdn import GDNReference
from sapwood.reference.tree_attention import int8_queries, tree_attention_naive
from util import TREES, assert_close, path_to, random_tree

pytestmark = pytest.mark.skipif(not gu.compiler_available(), reason=f"no {gu.CXX}: the kernel emulator needs it")

BACKENDS = ["metal-emu", "sycl-emu"] + gu.real_backends()
SMALL, REALISTIC = (4, 2, 64), (24, 4, 256)  # Hq, Hkv, D
HISTORIES = [0, 1, 31, 32, 33, 1000, 4096]
ATTN_TREES = ["single", "chain16", "star16", "random1"]
ATTN_ATOL, GDN_ATOL = 1e-4, 2e-4
PAGE = 64


@pytest.fixture(scope="session")
def built():
    gu.build_all()


@functools.lru_cache(maxsize=None)
def _backend(name):
    return gu.Backend(name)


@pytest.fixture(params=BACKENDS)
def backend(request, built):
    return _backend(request.param)


# ---------------------------------------------------------------- int8 KV

@functools.lru_cache(maxsize=None)
def history(shape, p):
    """A reference PagedKV with p random positions on shuffled pages (exercises the table)."""
    _, hkv, d = shape
    rng = np.random.default_rng(p * 7 + d)
    kv = refkv.PagedKV((p + 64) // PAGE + 2, PAGE, hkv, d)
    kv.free = [int(x) for x in rng.permutation(len(kv.free))]
    k = rng.standard_normal((p, hkv, d)).astype(np.float32)
    v = rng.standard_normal((p, hkv, d)).astype(np.float32)
    if p:
        kv.append(k, v)
    return kv, k, v


def quant_inputs(rng, t, hkv, d):
    x = rng.standard_normal((t, hkv, d)).astype(np.float32) * 3
    x[0, 0, :32] = 0                        # scale 0 -> all zeros
    x[1, 0, :32] = np.float32(0.5) * np.arange(-16, 16)  # ties at .5 steps of the scale
    x[1, 0, 0] = 127 * 0.5                  # amax = 63.5 -> scale exactly 0.5
    x[2, 1, 32:64] *= 1e-30                 # tiny scales
    return x


def test_kv_quantize_direct_bitwise(backend):
    x = quant_inputs(np.random.default_rng(1), 5, 2, 96)
    q, s = backend.kv_quantize_direct(x)
    rq, rs = refkv.quantize_int8(x)
    assert (s == rs).all() and (q == rq).all()


def test_kv_quantize_into_pages_bitwise(backend):
    """Appends in three uneven pieces across page boundaries; the pool arrays, scales and page
    table must equal reference.kv.PagedKV's byte for byte."""
    rng = np.random.default_rng(2)
    x = quant_inputs(rng, 150, 2, 64)
    v = rng.standard_normal((150, 2, 64)).astype(np.float32)
    ref = refkv.PagedKV(5, 64, 2, 64)
    gpu = refkv.PagedKV(5, 64, 2, 64)
    ref.free = [3, 0, 4, 1, 2]
    gpu.free = list(ref.free)
    for a, b in [(0, 40), (40, 129), (129, 150)]:
        ref.append(x[a:b], v[a:b])
        backend.kv_append(gpu, x[a:b], v[a:b])
    assert ref.page_table == gpu.page_table and ref.length == gpu.length
    for name in ("k_q", "k_s", "v_q", "v_s"):
        assert (getattr(ref, name) == getattr(gpu, name)).all(), name


# ---------------------------------------------------------------- tree attention

def tree_inputs(shape, n, seed):
    hq, hkv, d = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, hq, d)).astype(np.float32),
            rng.standard_normal((n, hkv, d)).astype(np.float32),
            rng.standard_normal((n, hkv, d)).astype(np.float32))


def attention_error(b, shape, p, tree, split):
    kv, _, _ = history(shape, p)
    parents = TREES[tree]
    q, k, v = tree_inputs(shape, len(parents), p + len(parents))
    out = b.tree_attention(q, kv, k, v, parents, split=split)
    kh, vh = kv.gather()
    ref = tree_attention_naive(int8_queries(q), kh, vh, refkv.roundtrip(k), refkv.roundtrip(v),
                               parents)
    return float(np.max(np.abs(out - ref)))


@pytest.mark.parametrize("split", [64, 512])
@pytest.mark.parametrize("tree", ATTN_TREES)
@pytest.mark.parametrize("p", HISTORIES)
def test_attention_oracle_small(backend, p, tree, split):
    err = attention_error(backend, SMALL, p, tree, split)
    assert err <= ATTN_ATOL, f"P={p} {tree} split={split}: max abs error {err:.3g}"


@pytest.mark.parametrize("p,tree,split", [(33, "chain16", 512), (33, "star16", 64),
                                          (1000, "random1", 512), (1000, "single", 64)])
def test_attention_oracle_realistic(backend, p, tree, split):
    """Hq 24 / Hkv 4 / D 256: 96 (row, head) pairs per KV head, 24 simdgroups per threadgroup."""
    err = attention_error(backend, REALISTIC, p, tree, split)
    assert err <= ATTN_ATOL, f"P={p} {tree} split={split}: max abs error {err:.3g}"


def test_attention_row_blocks(backend):
    """Hq 40 / Hkv 1 pushes 16 rows past 32 * 4 pairs: rows go in blocks; results unchanged."""
    shape = (40, 1, 32)
    kv, _, _ = history(shape, 70)
    parents = TREES["random2"]
    q, k, v = tree_inputs(shape, len(parents), 3)
    out = backend.tree_attention(q, kv, k, v, parents, split=64)
    kh, vh = kv.gather()
    ref = tree_attention_naive(int8_queries(q), kh, vh, refkv.roundtrip(k), refkv.roundtrip(v),
                               parents)
    assert_close(out, ref, ATTN_ATOL, "row blocks")
    solo = backend.tree_attention(q[:1], kv, k[:1], v[:1], [-1], split=64)
    assert (solo[0] == out[0]).all()


@pytest.mark.parametrize("shape,p", [(SMALL, 29), (SMALL, 509), (REALISTIC, 33)],
                         ids=["small-29", "small-509", "realistic-33"])
def test_attention_tree_chain_single_bitwise(backend, shape, p):
    """The tree row, the last row of its path verified as a chain, and the node alone after its
    ancestors were committed to pages (through the quantize kernel) agree bit for bit. p=29 puts
    the tree across a 32-key tile, p=509 across a 512 split and a 64-position page."""
    kv, kh, vh = history(shape, p)
    n = 16 if shape == SMALL else 6
    parents = random_tree(n, p)
    q, k, v = tree_inputs(shape, n, 99)
    out_tree = backend.tree_attention(q, kv, k, v, parents, split=512)
    for i in sorted({3 % n, n // 2, n - 1}):
        path = path_to(parents, i)
        out_chain = backend.tree_attention(q[path], kv, k[path], v[path], np.arange(len(path)) - 1)
        assert (out_chain[-1] == out_tree[i]).all(), f"chain differs at node {i}"
        kv2 = refkv.PagedKV(kv.k_q.shape[0] + 1, PAGE, shape[1], shape[2])
        if p:
            backend.kv_append(kv2, kh, vh)
        if len(path) > 1:
            backend.kv_append(kv2, k[path[:-1]], v[path[:-1]])
        out_single = backend.tree_attention(q[i:i + 1], kv2, k[i:i + 1], v[i:i + 1], [-1])
        assert (out_single[0] == out_tree[i]).all(), f"single-node form differs at node {i}"


def test_attention_other_nodes_do_not_matter_bitwise(backend):
    kv, _, _ = history(SMALL, 300)
    parents = TREES["random2"]
    q, k, v = tree_inputs(SMALL, 16, 3)
    base = backend.tree_attention(q, kv, k, v, parents, split=64)
    i = 15
    off = [j for j in range(16) if j not in set(path_to(parents, i))]
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[off] += 1.0
    k2[off] *= -2.0
    v2[off] += 3.0
    out = backend.tree_attention(q2, kv, k2, v2, parents, split=64)
    assert (out[i] == base[i]).all()
    assert not (out[off[0]] == base[off[0]]).all()  # the perturbation did reach other rows


# ---------------------------------------------------------------- pathwise GDN

GDN_SMALL = dict(hk=2, hv=4, dk=16, dv=16, conv_k=4)
GDN_REALISTIC = dict(hk=16, hv=48, dk=128, dv=128, conv_k=4)


def channels(s):
    return 2 * s["hk"] * s["dk"] + s["hv"] * s["dv"]


def gdn_inputs(s, n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, channels(s))).astype(np.float32),
            -rng.uniform(0.01, 1.0, (n, s["hv"])).astype(np.float32),
            rng.uniform(0.1, 0.9, (n, s["hv"])).astype(np.float32))


def gdn_make(b, s, order="grouped", max_pending=8, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((channels(s), s["conv_k"])) * 0.5).astype(np.float32)
    dims = (s["hk"], s["hv"], s["dk"], s["dv"])
    return gu.GDN(b, *dims, w, head_order=order, max_pending=max_pending), GDNReference(*dims, w, head_order=order)


def gdn_advance(layer, ref, s, prompt, pending, seed):
    """Commit a prompt (folded) then a chain of `pending` tokens left on the tape."""
    for n, fold, sd in ((prompt, True, seed), (pending, False, seed + 1)):
        if not n:
            continue
        x, g, b = gdn_inputs(s, n, sd)
        chain = np.arange(n) - 1
        layer.verify(x, g, b, chain)
        layer.commit(list(range(n)), max_pending=0 if fold else 8)
        ref.verify(x, g, b, chain)
        ref.commit(list(range(n)), max_pending=0 if fold else 8)
    assert layer.n_pending == pending


def gdn_error(b, s, tree, pending, order, select=False):
    """Max error of verify vs the oracle, then of the folded state after committing a path."""
    layer, ref = gdn_make(b, s, order)
    gdn_advance(layer, ref, s, prompt=5, pending=pending, seed=3)
    parents = TREES[tree]
    x, g, beta = gdn_inputs(s, len(parents), 7)
    err = float(np.max(np.abs(layer.verify(x, g, beta, parents) - ref.verify(x, g, beta, parents))))
    path = path_to(parents, len(parents) - 1)
    layer.commit(path, select=select)
    ref.commit(path)
    assert (layer.window == ref.window).all(), "conv window (copies of inputs: exact)"
    return max(err, float(np.max(np.abs(layer.folded_state() - ref.folded_state()))))


@pytest.mark.parametrize("order", ["grouped", "tiled"])
@pytest.mark.parametrize("pending", [0, 1, 3, 8])
@pytest.mark.parametrize("tree", list(TREES))
def test_gdn_oracle_small(backend, tree, pending, order):
    err = gdn_error(backend, GDN_SMALL, tree, pending, order, select=pending == 3)
    assert err <= GDN_ATOL, f"{tree} pending={pending} {order}: max abs error {err:.3g}"


def test_gdn_pending_all_counts(backend):
    for pending in range(9):
        layer, ref = gdn_make(backend, GDN_SMALL)
        gdn_advance(layer, ref, GDN_SMALL, prompt=2, pending=pending, seed=pending)
        x, g, b = gdn_inputs(GDN_SMALL, 4, 50)
        parents = TREES["random3"][:4]
        assert_close(layer.verify(x, g, b, parents), ref.verify(x, g, b, parents), GDN_ATOL, f"pending={pending}")


@pytest.mark.parametrize("order", ["grouped", "tiled"])
def test_gdn_oracle_realistic(backend, order):
    """hk 16 / hv 48 / dk = dv = 128: 128 state columns per threadgroup, a 5-node tree."""
    s = GDN_REALISTIC
    layer, ref = gdn_make(backend, s, order)
    gdn_advance(layer, ref, s, prompt=2, pending=2, seed=5)
    parents = np.array([-1, 0, 0, 1, 3])
    x, g, b = gdn_inputs(s, 5, 8)
    assert_close(layer.verify(x, g, b, parents), ref.verify(x, g, b, parents), GDN_ATOL, order)


def test_gdn_tree_chain_single_bitwise(backend):
    """Tree row == last row of its chain == plain decoding (verify one node, commit it), with
    both commit modes; select and replay leave bitwise equal folded states."""
    s = GDN_SMALL
    x0, g0, b0 = gdn_inputs(s, 6, 1)
    layer, _ = gdn_make(backend, s)
    layer.verify(x0, g0, b0, np.arange(6) - 1)
    layer.commit(list(range(6)))
    parents = random_tree(16, 21)
    x, g, b = gdn_inputs(s, 16, 2)
    out_tree = layer.verify(x, g, b, parents)
    for i, select in [(4, False), (11, True), (15, False)]:
        path = path_to(parents, i)
        out_chain = layer.verify(x[path], g[path], b[path], np.arange(len(path)) - 1)
        assert (out_chain[-1] == out_tree[i]).all(), f"chain differs at node {i}"
        single, _ = gdn_make(backend, s, max_pending=3)
        single.verify(x0, g0, b0, np.arange(6) - 1)
        single.commit(list(range(6)))
        for j in path:
            o = single.verify(x[j:j + 1], g[j:j + 1], b[j:j + 1], [-1])
            single.commit([0], select=select)
        assert (o[0] == out_tree[i]).all(), f"plain decoding differs at node {i}"
    a, _ = gdn_make(backend, s)
    c, _ = gdn_make(backend, s)
    for layer_, sel in ((a, True), (c, False)):
        layer_.verify(x, g, b, parents)
        layer_.commit(path_to(parents, 15), select=sel)
    assert (a.folded_state() == c.folded_state()).all() and (a.window == c.window).all()


# ---------------------------------------------------------------- q8 matmul

def q8_model(w, ws, x, cols_pad):
    """numpy model of the integer arithmetic: per-row activation quantization (CPU QActs rule),
    exact integer dots, then float32(dot) * w_scale * x_scale in that order."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=1)
    xs = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(xs == 0, np.float32(1), xs)[:, None]
    xq = np.where(xs[:, None] == 0, 0, np.clip(np.rint(x / safe), -127, 127)).astype(np.int8)
    xq = np.pad(xq, ((0, 0), (0, cols_pad - x.shape[1])))
    dot = xq.astype(np.int64) @ w.astype(np.int64).T
    return xq, xs, (dot.astype(np.float32) * ws[None, :]) * xs[:, None]


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_q8_matmul_bitwise(backend, rows):
    rng = np.random.default_rng(rows)
    out, cols, cols_pad = 43, 300, 320
    w = rng.integers(-127, 128, (out, cols_pad)).astype(np.int8)
    w[:, cols:] = 0
    ws = rng.uniform(1e-3, 1e-2, out).astype(np.float32)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :] *= 50
    if rows > 1:
        x[1] = 0  # scale 0
    xq_ref, xs_ref, y_ref = q8_model(w, ws, x, cols_pad)
    xq, xs = backend.q8_quantize_rows(x, cols_pad)
    assert (xs == xs_ref).all() and (xq == xq_ref).all()
    y = backend.q8_matmul(w, ws, xq, xs)
    assert (y == y_ref).all()
    assert (backend.q8_matmul(w, ws, xq[-1:], xs[-1:])[0] == y[-1]).all()  # batch-invariant


# ---------------------------------------------------------------- cross-backend and emulator checks

def test_emulated_backends_agree_bitwise(built):
    """The SYCL kernels are ports of the Metal ones with the same reductions: under the same
    emulator they must agree to the bit (catches a port that drifted)."""
    m, s = _backend("metal-emu"), _backend("sycl-emu")
    kv, _, _ = history(SMALL, 100)
    q, k, v = tree_inputs(SMALL, 9, 5)
    par = TREES["random3"]
    assert (m.tree_attention(q, kv, k, v, par, 64) == s.tree_attention(q, kv, k, v, par, 64)).all()
    outs = []
    for b in (m, s):
        layer, _ = gdn_make(b, GDN_SMALL)
        x, g, beta = gdn_inputs(GDN_SMALL, 9, 4)
        outs.append(layer.verify(x, g, beta, par))
    assert (outs[0] == outs[1]).all()


def test_kernels_really_synchronise(built):
    lib = _backend("metal-emu").lib("attention")
    before = lib.barrier_waits()
    attention_error(_backend("metal-emu"), SMALL, 100, "random1", 64)
    assert lib.barrier_waits() > before


def test_emulator_selftest(built):
    """emu/selftest.metal: the shim pieces no production kernel uses yet (shuffles, broadcast,
    simd_min, an int reduction, select, vector arithmetic) against hand-computed values."""
    x = (np.arange(64, dtype=np.float32) * 1.5 - 20).astype(np.float32)
    out = np.zeros(64 * 8, np.float32)
    _backend("metal-emu").lib("selftest").call("sw_emu_selftest", x, out)
    o = out.reshape(64, 8)
    lane, base = np.arange(64) % 32, np.arange(64) // 32 * 32
    assert (o[:, 0] == x[base + (lane + 1) % 32]).all()
    assert (o[:, 1] == x[base + (lane ^ 5)]).all()
    assert (o[:, 2] == x[base + 3]).all()
    assert (o[:, 3] == x[base]).all()                      # x increases with the lane
    assert (o[:, 4] == 496).all()                          # sum of lanes 0..31
    assert (o[:, 5] == np.where(lane % 2 == 1, -x, x)).all()
    assert (o[:, 6] == 4 * x + 5).all()                    # (a*b + a - b) summed over components
    assert (o[:, 7] == 13).all()


def _readme_lists(path):
    """{key: names} from README lines '- **Key**: `name`, `name(n)`, ...' (continuation lines too)."""
    out, key = {}, None
    for line in path.read_text().splitlines():
        m = re.match(r"- \*\*(\w+)\*\*:(.*)", line)
        if m:
            key, line = m.group(1), m.group(2)
        elif not line.startswith("  "):
            key = None
        if key:
            out.setdefault(key, set()).update(re.findall(r"`([\w:]+)", line))
    return out


def _code(text):
    return re.sub(r"//.*", "", text)


def test_metal_sources_stay_in_documented_subset():
    """Every attribute and library call in the shaders is in metal/README.md's subset, and every
    listed function and type exists in the shim (so the shim covers exactly the documented set)."""
    lists = _readme_lists(gu.METAL / "README.md")
    shim = (gu.EMU / "metal_shim.hpp").read_text()
    sources = [_code(p.read_text()) for p in sorted(gu.METAL.glob("*.metal"))]
    sources.append(_code((gu.EMU / "selftest.metal").read_text()))
    for text in sources:
        attrs = set(re.findall(r"\[\[\s*(\w+)", text)) | ({"threadgroup"} if "SW_THREADGROUP_ARG" in text else set())
        assert attrs <= lists["Attributes"], attrs - lists["Attributes"]
        own = set(re.findall(r"\b(?:inline|kernel)\s+[\w:<>]+\s+(\w+)\s*\(", text))
        calls = set(re.findall(r"(?<![.\w])([A-Za-z_]\w*)\s*\(", re.sub(r"\[\[.*?\]\]", "", text)))
        calls -= own | lists["Types"] | {"if", "for", "while", "return", "sizeof", "int", "float", "bool",
                                         "size_t", "SW_THREADGROUP_ARG"}
        assert calls <= lists["Functions"], calls - lists["Functions"]
        assert set(re.findall(r"(\w+)::", text)) <= {"mem_flags"}, "namespace-qualified MSL (fast::, precise::)"
    for name in lists["Functions"] | lists["Types"] - {"char"}:
        assert re.search(rf"\b{name}\b", shim), f"{name} is documented but not in the shim"


def test_sycl_sources_stay_in_documented_subset():
    lists = _readme_lists(gu.SYCL / "README.md")
    emu = (gu.EMU / "sycl_emu.hpp").read_text()
    for p in sorted(gu.SYCL.glob("*.hpp")):
        text = _code(p.read_text())
        assert set(re.findall(r"\bit\.(\w+)", text.split("#else")[0] if "SW_SYCL_EMU" in text else text)) <= lists["Item"]
        if p.name != "sw_sycl_common.hpp":
            assert "sycl::" not in text, f"{p.name}: kernels reach SYCL through swsycl:: only"
    for name in lists["Item"] | {n for n in lists["Traits"] if not n.startswith("sycl")}:
        assert re.search(rf"\b{name}\b", emu), f"{name} is documented but not emulated"


# ---------------------------------------------------------------- SYCL syntax gate

def _sycl_include():
    for cand in (os.environ.get("SAPWOOD_SYCL_INCLUDE"), Path(sysconfig.get_paths()["data"]) / "include"):
        if cand and (Path(cand) / "sycl" / "sycl.hpp").exists():
            return Path(cand)
    return None


@pytest.mark.skipif(_sycl_include() is None,
                    reason="SYCL headers not found: pip install --no-deps intel-sycl-rt==2026.2.0 (or set SAPWOOD_SYCL_INCLUDE)")
@pytest.mark.parametrize("source", ["sycl_backend.cpp", "sycl_device.cpp"])
def test_sycl_sources_type_check_against_real_headers(source):
    """g++ -fsyntax-only of the SYCL hosts: sycl_device.cpp (the device layer's op table) and
    sycl_backend.cpp instantiate every kernel template with the real sycl::nd_item<1> inside
    parallel_for, so the kernels and the queue code are valid SYCL 2020 as written."""
    cmd = [gu.CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-Wno-attributes",
           "-Wno-deprecated-declarations", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING",
           f"-isystem{_sycl_include()}", f"-I{gu.SYCL}", f"-I{gu.METAL}", f"-I{gu.ROOT / 'csrc'}",
           str(gu.SYCL / source)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
