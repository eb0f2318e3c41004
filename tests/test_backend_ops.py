"""Every op of the backend op list (csrc/backend.h) on every backend this build has, against the
numpy references of python/sapwood/reference, with the same cases and the same tolerances
everywhere (after ggml's test-backend-ops).

Backends: the CPU once per kernel variant this CPU runs (generic, avx2, avx512, amx), then each
GPU backend (metal-emulated and sycl-emulated everywhere, metal / sycl where built). The ops run
through _core.BackendOps: the Backend itself, over a small irregular model's weights loaded as
the engine loads them (dk != dv, Hv = 3 Hk, widths that are no multiple of the kernels' blocks),
so a GPU backend's argument binding, layouts and grids are what is tested, not just its kernels.
The drafting ops over logits: top-k and logsumexp are backend ops (a greedy draft row is
ranked where its logits are), checked through BackendOps like the others; argmax and the
selections the sampler uses run on the host's kernels, checked per CPU variant and as the
device kernels a GPU backend has for them.

Tolerances are stated per test; `==` where the op rounds no more than its reference does.
Within a backend, docs/design.md's exactness is asserted with `==`: a row's matmul result does not
depend on the other rows, a tree node's attention and GDN output equal the chain's on its path.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gpu_util as gu
from sapwood import _core
from sapwood.loading import engine_dims, read_checkpoint
from sapwood.reference import kv as refkv
from sapwood.reference import ops, quant
from sapwood.reference.gdn import GDNReference, silu
from sapwood.reference.model import rope, sigmoid
from sapwood.reference.ranking import logsumexp
from sapwood.reference.tree_attention import int8_queries, tree_attention_naive
from sapwood.testing import make_tiny_checkpoint
from util import ISAS, TREES, assert_close, isa, logit_rows, path_to

U = 2.0 ** -24  # float32 unit roundoff
GPU = [b for b in _core.available_backends() if b != "cpu"]
BACKENDS = [f"cpu-{v}" for v in ISAS] + GPU
FORMATS = ["f32", "bf16", "q8", "q4"]
# G A: one GDN and one attention layer, dk=16 != dv=32, Hv = 3 Hk; hidden 96 and intermediate
# 160 are no multiple of q4's 64-wide groups, the vocabulary none of the matmuls' row blocks.
SHAPE = dict(vocab=300, hidden=96, intermediate=160, layers=2, hk=2, hv=6, dk=16, dv=32,
             n_heads=4, n_kv_heads=2, head_dim=64, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ops_model")
    make_tiny_checkpoint(path, seed=3, **SHAPE)
    ck = read_checkpoint(path)
    return engine_dims(ck.config), ck.weights, ck.config


@contextlib.contextmanager
def on(backend):
    """The CPU's kernel variant for `cpu-<isa>`; nothing to select for a GPU backend."""
    if backend.startswith("cpu-"):
        with isa(backend[4:]):
            yield "cpu"
    else:
        yield backend


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def make_ops(checkpoint, backend, fmt="f32"):
    dims, weights, _ = checkpoint
    with on(backend) as name:
        return _core.BackendOps(dims, weights, fmt, name)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def dequantized(w, fmt):
    """The weights as every backend's matmul and embedding must see them."""
    if fmt == "f32":
        return w
    if fmt == "bf16":
        return quant.from_bf16(quant.to_bf16(w))
    if fmt == "q8":
        return quant.q8_dequantize(*quant.q8_weights(w), w.shape[1])
    return quant.q4_dequantize(*quant.q4_weights(w), w.shape[1])


# ---------------------------------------------------------------- stateless ops

@pytest.mark.parametrize("fmt", FORMATS)
def test_embed(checkpoint, backend, fmt):
    """Rows of the table in every format, dequantized exactly as the reference does: `==`."""
    ops_ = make_ops(checkpoint, backend, fmt)
    table = checkpoint[1]["model.embed_tokens.weight"]
    tokens = np.array([3, 0, 299, 3, 17, 150, 64], np.int32)
    with on(backend):
        x = ops_.embed(tokens)
    assert (x == dequantized(table, fmt)[tokens]).all()


NORMS = {  # name, (1 + w) or plain w, rows per token
    "model.norm.weight": (True, 1),
    "model.layers.1.self_attn.q_norm.weight": (True, 4),
    "model.layers.1.self_attn.k_norm.weight": (True, 2),
    "model.layers.0.linear_attn.norm.weight": (False, 6),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_rms_norm(checkpoint, backend, rng, name):
    """Against float64. Tolerance: a float32 sum of <= 96 squares (relative error <= 96 u), an
    rsqrt of a few ulp and two products: < 1e-5 relative on outputs of size <= ~15, so 1e-4
    absolute holds with room while a wrong eps, mean or weight moves them by 1e-2 or more."""
    ops_ = make_ops(checkpoint, backend)
    w = checkpoint[1][name].astype(np.float64)
    plus_one, per_token = NORMS[name]
    x = f32(rng, 16 * per_token, len(w), scale=3)
    with on(backend):
        got = ops_.rms_norm(x, name)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + checkpoint[2].rms_norm_eps)
    want *= (1 + w) if plus_one else w
    assert_close(got, want, 1e-4, name)


@pytest.mark.parametrize("n", [1, 31, 1000])
def test_elementwise(checkpoint, backend, rng, n):
    """add is one IEEE addition: `==` numpy's float32 sum; copy (a forest's K/V rows into each
    sequence's own) is `==` its input. silu(x)*u and sigmoid(x)*u against
    float64: an exp within 4 ulp (MSL's bound; the CPU's canonical exp is closer), a division
    and two products, relative to outputs of size <= ~20: 2e-5 absolute, while a wrong
    activation (sigmoid for silu, a missing u) is off by 1e-1 or more."""
    ops_ = make_ops(checkpoint, backend)
    x, u = f32(rng, n, scale=3), f32(rng, n, scale=2)
    with on(backend):
        s = ops_.add(x, u)
        c = ops_.copy(x)
        a = ops_.silu_mul(x, u)
        b = ops_.sigmoid_mul(x, u)
    assert (s == x + u).all() and (c == x).all()
    x64, u64 = x.astype(np.float64), u.astype(np.float64)
    assert_close(a, silu(x64) * u64, 2e-5, "silu_mul")
    assert_close(b, sigmoid(x64) * u64, 2e-5, "sigmoid_mul")


def test_split_q_gate(checkpoint, backend, rng):
    """A copy: `==`."""
    ops_ = make_ops(checkpoint, backend)
    qg = f32(rng, 5, 4 * 2 * 64)
    with on(backend):
        q, gate = ops_.split_q_gate(qg, 4, 64)
    wq, wg = ops.split_q_gate(qg, 64)
    assert (q == wq.reshape(5, -1)).all() and (gate == wg.reshape(5, -1)).all()


@pytest.mark.parametrize("rot", [16, 64])
def test_rope(checkpoint, backend, rng, rot):
    """With the host's (cos, sin) table (float64 angles rounded once) against float64 RoPE:
    the table's rounding (u relative) and two products and a sum per value of size <= ~4:
    1e-5 absolute; a wrong pairing or sign moves values by O(1)."""
    ops_ = make_ops(checkpoint, backend)
    pos = np.array([0, 1, 7, 63, 64, 1000, 4095, 33], np.int64)
    x = f32(rng, len(pos), 4, 64)
    with on(backend):
        got = ops_.rope(x, rot, ops.rope_table(pos, rot, 10000.0))
    assert_close(got, rope(x.astype(np.float64), pos, rot, 10000.0), 1e-5, f"rot={rot}")


def test_gdn_gates(checkpoint, backend, rng):
    """beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) against float64: an exp and a
    log1p of a few ulp each and two products: 1e-5 relative to |g| <= ~40; a missing dt_bias
    or a wrong head's A_log is off by far more."""
    ops_ = make_ops(checkpoint, backend)
    p = "model.layers.0.linear_attn."
    ba = f32(rng, 9, 12, scale=4)
    with on(backend):
        beta, g = ops_.gdn_gates(ba, 0)
    wb, wg = ops.gdn_gates(ba, checkpoint[1][p + "dt_bias"], checkpoint[1][p + "A_log"])
    assert_close(beta, wb, 1e-6, "beta")
    assert_close(g, wg, 1e-5 * np.abs(wg).max(), "g")


MATMULS = {  # matrices sharing x in one call
    "gate|up": ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"],
    "q|k|v": [f"model.layers.1.self_attn.{m}_proj.weight" for m in "qkv"],
    "down": ["model.layers.1.mlp.down_proj.weight"],  # 160 inputs: a partial q4 group
    "lm_head": ["lm_head.weight"],
}


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("group", list(MATMULS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul(checkpoint, backend, rng, fmt, group, rows):
    """y = x W^T. f32/bf16 against float64 over the dequantized weights: float32 sums of <= 160
    products, 1e-5 of the output scale. q8/q4 against quant.py's exact integer dots on the
    same int8 activations (quantize_acts) times the scales: q8 rounds once or twice, q4 once
    per 64-wide group and per group sum, so 1e-6 of the output scale; a wrong scale or a lost
    group is off by 1e-2. Rows are independent: each row alone gives the batch's bits (`==`)."""
    ops_ = make_ops(checkpoint, backend, fmt)
    names = MATMULS[group]
    ws = [checkpoint[1][n] for n in names]
    x = f32(rng, rows, ws[0].shape[1])
    with on(backend):
        ys = ops_.matmul(x, names)
        alone = [ops_.matmul(x[r:r + 1].copy(), names) for r in range(rows)]
    for w, y, k in zip(ws, ys, range(len(ws))):
        if fmt in ("f32", "bf16"):
            want = x.astype(np.float64) @ dequantized(w, fmt).astype(np.float64).T
            bound = 1e-5
        else:
            wq, wsc = (quant.q8_weights if fmt == "q8" else quant.q4_weights)(w)
            cols_pad = wq.shape[1] * (1 if fmt == "q8" else 2)
            xq, xs = quant.quantize_acts(x, cols_pad)
            want = (quant.q8_matmul if fmt == "q8" else quant.q4_matmul)(wq, wsc, xq, xs)
            bound = 1e-6
        assert_close(y, want, bound * np.abs(want).max(), f"{names[k]}")
        assert (np.concatenate([a[k] for a in alone]) == y).all(), "a row depends on the others"


# ---------------------------------------------------------------- affine q4 groups, as stored

# the model of SHAPE with widths MLX quantizes (multiples of 64): 128 inputs (two runs of 64),
# 192 (three) for down_proj; every matrix, the embedding and the LM head as stored
AFFINE_SHAPE = dict(SHAPE, hidden=128, intermediate=192)


@pytest.fixture(scope="module", params=[32, 64], ids=["g32", "g64"])
def mlx_checkpoint(request, tmp_path_factory):
    """An MLX 4-bit checkpoint (affine groups of 32 or 64) and its dequantized twin's tensors."""
    from test_formats import write_mlx  # (skips without torch, as test_formats does)
    group, root = request.param, tmp_path_factory.mktemp(f"mlx{request.param}")
    make_tiny_checkpoint(root / "float", seed=5, **AFFINE_SHAPE)
    write_mlx(root / "float", root / "mlx", root / "deq", 4, group)
    ck, deq = read_checkpoint(root / "mlx"), read_checkpoint(root / "deq")
    assert set(ck.weights.q4_affine_names.values()) == {group}
    assert "lm_head.weight" in ck.weights.q4_affine_names
    return engine_dims(ck.config), ck.weights, deq.weights


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
def test_affine_q4_matmul_and_embed_are_the_cpus(mlx_checkpoint, backend, rng, rows):
    """A q4 load of an MLX 4-bit checkpoint keeps its affine groups (of 32 or 64) as stored on
    every backend: the embedding rows are the file's values (`==` the dequantized twin), and
    every matmul gives the bits of the CPU's portable kernel (mm_q4_job's order) for 1..16 rows,
    a row alone the same as in the batch; within 1e-6 of the output scale of the float64 product
    of the same int8 activations and dequantized weights (a lost bias is off by far more)."""
    dims, weights, deq = mlx_checkpoint
    ops_ = make_ops((dims, weights, None), backend, "q4")
    ref = make_ops((dims, weights, None), BACKENDS[0], "q4")
    tokens = np.array([3, 0, 299, 3, 17, 150, 64], np.int32)
    with on(backend):
        x = ops_.embed(tokens)
    assert (x == deq["model.embed_tokens.weight"][tokens]).all()
    for names in MATMULS.values():
        cols = deq[names[0]].shape[1]
        xin = f32(rng, rows, cols, scale=2)
        if rows > 1:
            xin[1] = 0
        with on(BACKENDS[0]):
            want = ref.matmul(xin, names)
        with on(backend):
            ys = ops_.matmul(xin, names)
            alone = [ops_.matmul(xin[r:r + 1].copy(), names) for r in range(rows)]
        xq, xs = quant.quantize_acts(xin, cols)
        for k, name in enumerate(names):
            assert (ys[k] == want[k]).all(), f"{name}: not the CPU's bits"
            exact = (xq.astype(np.float64) * xs[:, None]) @ deq[name].astype(np.float64).T
            assert_close(ys[k], exact, 1e-6 * np.abs(exact).max(), name)
            assert (np.concatenate([a[k] for a in alone]) == ys[k]).all(), "a row depends on the others"


# ---------------------------------------------------------------- the sequence's state

def tree_inputs(rng, cfg, n):
    att = (f32(rng, n, cfg.num_heads, cfg.head_dim), f32(rng, n, cfg.num_kv_heads, cfg.head_dim),
           f32(rng, n, cfg.num_kv_heads, cfg.head_dim))
    C = 2 * cfg.hk * cfg.dk + cfg.hv * cfg.dv
    gdn = (f32(rng, n, C), -rng.uniform(0.01, 1.0, (n, cfg.hv)).astype(np.float32),
           rng.uniform(0.1, 0.9, (n, cfg.hv)).astype(np.float32))
    return att, gdn


class Oracle:
    """The committed state in float64: the int8-roundtripped history of the attention layer
    and reference/gdn.py's pathwise GDN."""

    def __init__(self, cfg, weights):
        self.cfg = cfg
        self.k = np.zeros((0, cfg.num_kv_heads, cfg.head_dim), np.float32)
        self.v = self.k.copy()
        conv = weights["model.layers.0.linear_attn.conv1d.weight"]
        self.gdn = GDNReference(cfg.hk, cfg.hv, cfg.dk, cfg.dv, conv.reshape(conv.shape[0], -1),
                                head_order=cfg.head_order)

    def forward(self, att, gdn, parents):
        q, k, v = att
        a = tree_attention_naive(int8_queries(q), refkv.roundtrip(self.k),
                                 refkv.roundtrip(self.v), refkv.roundtrip(k), refkv.roundtrip(v),
                                 parents)
        g = self.gdn.verify(*gdn, parents)
        self.tape = (k, v)
        return a, g.reshape(len(parents), -1)

    def commit(self, path, max_pending=8):
        k, v = self.tape
        self.k = np.concatenate([self.k, k[path]])
        self.v = np.concatenate([self.v, v[path]])
        self.gdn.commit(list(path), max_pending=max_pending)


# Tolerances as tests/test_tree_attention.py and test_gdn.py state them: float32 softmax sums
# over <= ~100 keys against float64 (1e-4 on convex combinations of values of size ~1-4), and
# float32 GDN recurrences over <= ~50 steps of unit q, k (2e-4 on outputs of size ~1).
ATT_TOL, GDN_TOL = 1e-4, 2e-4


def prefill(ops_, ref, rng, chunks):
    """Prefill chunks of these lengths, each committed as it goes, against the oracle."""
    for n in chunks:
        att, gdn = tree_inputs(rng, ref.cfg, n)
        a, g = ops_.forward(n, {0: att}, {0: gdn})
        wa, wg = ref.forward(att, gdn, np.arange(n) - 1)
        ref.commit(list(range(n)), max_pending=0)
        assert_close(a[0], wa, ATT_TOL, f"prefill attention, {n} rows to {ops_.length} keys")
        assert_close(g[0], wg, GDN_TOL, f"prefill GDN, {n} rows")


@pytest.mark.parametrize("tree", ["chain16", "star16", "random1", "random4"])
def test_forward_state(checkpoint, backend, rng, tree):
    """Int8 KV quantize-and-store, tree attention over pages + the tree, GDN conv and
    recurrence along paths, commit of a path (KV rows, the leaf's state, the conv window),
    against the float64 oracle over three rounds after a two-chunk prefill; within the backend
    a node's outputs equal the chain's on its path bitwise. Queries are int8-roundtripped like
    keys on every backend (reference/tree_attention.py's int8_queries)."""
    dims, weights, cfg = checkpoint
    ops_ = make_ops(checkpoint, backend)
    ref = Oracle(cfg, weights)
    with on(backend):
        prefill(ops_, ref, rng, (40, 9))  # in two chunks: the second one sees the first in pages
        assert ops_.length == 49
        parents = TREES[tree]
        for rnd in range(3):
            att, gdn = tree_inputs(rng, cfg, len(parents))
            a, g = ops_.forward(len(parents), {0: att}, {0: gdn}, parents)
            wa, wg = ref.forward(att, gdn, parents)
            assert_close(a[0], wa, ATT_TOL, f"round {rnd} attention")
            assert_close(g[0], wg, GDN_TOL, f"round {rnd} GDN")
            path = path_to(parents, len(parents) - 1)
            chain = [tuple(x[path] for x in att), tuple(x[path] for x in gdn)]
            ca, cg = ops_.forward(len(path), {0: chain[0]}, {0: chain[1]}, np.arange(len(path)) - 1)
            assert (ca[0] == a[0][path]).all() and (cg[0] == g[0][path]).all(), "tree != chain"
            ops_.commit(list(range(len(path))))  # the chain's forward is the last: commit it
            ref.forward(*chain, np.arange(len(path)) - 1)
            ref.commit(list(range(len(path))))
            assert ops_.length == 49 + sum(len(path_to(parents, len(parents) - 1)) for _ in range(rnd + 1))


def test_long_forwards(checkpoint, backend, rng):
    """Longer forwards than above: prefill chunks of 200 rows, which a GPU backend attends in
    blocks of 64 (metal/sw_plan.h: 128 (row, query head) pairs a threadgroup, 2 query heads a
    KV head), up to 520 keys, past the 512-key split; then a 16-node tree over them, whose
    deepest node equals its chain's last row (`==`). Against the oracle with the tolerances
    above: attention outputs stay convex combinations however many keys are summed (float32
    sums of 520 terms err by < 520 u relative), and the GDN gates forget, so its error does not
    grow with the prefill's length."""
    dims, weights, cfg = checkpoint
    ref = Oracle(cfg, weights)
    with on(backend) as name:
        ops_ = _core.BackendOps(dims, weights, "f32", name, max_context=1024)
        prefill(ops_, ref, rng, (200, 200, 120))
        parents = TREES["random1"]
        att, gdn = tree_inputs(rng, cfg, len(parents))
        a, g = ops_.forward(len(parents), {0: att}, {0: gdn}, parents)
        wa, wg = ref.forward(att, gdn, parents)
        assert_close(a[0], wa, ATT_TOL, "tree attention")
        assert_close(g[0], wg, GDN_TOL, "tree GDN")
        path = path_to(parents, len(parents) - 1)
        ca, cg = ops_.forward(len(path), {0: tuple(x[path] for x in att)}, {0: tuple(x[path] for x in gdn)},
                              np.arange(len(path)) - 1)
        assert (ca[0] == a[0][path]).all() and (cg[0] == g[0][path]).all(), "tree != chain"


def test_forward_refuses_bad_input(checkpoint, backend):
    ops_ = make_ops(checkpoint, backend)
    cfg = checkpoint[2]
    att, gdn = tree_inputs(np.random.default_rng(0), cfg, 3)
    with on(backend):
        with pytest.raises(ValueError, match="commit without"):
            ops_.commit([0])
        with pytest.raises(ValueError, match="parents"):
            ops_.forward(3, {0: att}, {0: gdn}, [-1, 0, 5])
        with pytest.raises(ValueError, match="every layer"):
            ops_.forward(3, {0: att}, {}, [-1, 0, 1])
        ops_.forward(3, {0: att}, {0: gdn}, [-1, 0, 0])
        with pytest.raises(ValueError, match="path"):
            ops_.commit([0, 2, 1])
        assert ops_.length == 0
        with pytest.raises(ValueError, match="no matrix"):
            ops_.matmul(np.zeros((1, 96), np.float32), ["model.layers.0.self_attn.q_proj.weight"])


# ---------------------------------------------------------------- drafting over logits

@pytest.mark.parametrize("cols", [7, 300, 4096])
def test_top_k_rows_op(checkpoint, backend, rng, cols):
    """Backend::top_k_rows: ids `==` the reference (an equal value's lower id first, NaN never,
    -1 where fewer qualify) and values `==` the row's at them (0 where -1)."""
    ops_ = make_ops(checkpoint, backend)
    x = logit_rows(rng, cols)
    for k in sorted({1, 3, min(16, cols)}):
        with on(backend):
            ids, vals = ops_.top_k_rows(x, k)
        want = ops.top_k_rows(x, k)
        assert ids.tolist() == want.tolist(), k
        at = np.where(want >= 0, x[np.arange(len(x))[:, None], np.maximum(want, 0)], 0)
        assert vals.tolist() == at.tolist()
    with pytest.raises(ValueError, match="top_k_rows: k=17"):
        ops_.top_k_rows(x, 17)


@pytest.mark.parametrize("cols", [1, 300, 151936])
def test_logsumexp_rows_op(checkpoint, backend, rng, cols):
    """Backend::logsumexp_rows against float64, the bound of test_logsumexp (the CPU's double
    result rounded to float adds half an ulp of the result)."""
    ops_ = make_ops(checkpoint, backend)
    x = f32(rng, 16 if cols < 10000 else 2, cols, scale=3)
    x[0] *= 10
    with on(backend):
        got = ops_.logsumexp_rows(x)
    want = np.array([logsumexp(r) for r in x])
    bound = (cols / 256 + 24) * U + 11 * U * np.abs(want)
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want)


class Drafting:
    """argmax / top-k / logsumexp per row: the CPU variant's kernels, or a GPU device's."""

    def __init__(self, backend):
        self.backend = backend

    def argmax(self, x):
        if self.backend.startswith("cpu-"):
            with on(self.backend):
                return np.array([_core.argmax(r) for r in x])
        out = np.full(len(x), -7, np.int32)
        gu.run(self.backend, "argmax_rows", [x, out, gu.pack(len(x), x.shape[1], 0, 0.0)], len(x), 256,
               [32, 32])
        return out

    def top_k(self, x, k, skip):
        if self.backend.startswith("cpu-"):
            with on(self.backend):
                out = []
                for r, s in zip(x, skip):
                    q = np.count_nonzero(~np.isnan(r)) - (0 <= s < len(r) and not np.isnan(r[s]))
                    ids = _core.top_ids(r, min(k, int(q)), int(s)) if q > 0 else []
                    out.append(list(ids) + [-1] * (k - len(ids)))
                return np.array(out)
        ids = np.full((len(x), k), -7, np.int32)
        vals = np.full((len(x), k), np.nan, np.float32)
        gu.run(self.backend, "top_k_rows", [x, skip, ids, vals, gu.pack(len(x), x.shape[1], k, 0.0)],
               len(x), 256, [32, 32])
        return ids

    def logsumexp(self, x):
        if self.backend.startswith("cpu-"):
            with on(self.backend):
                return np.array([_core.logsumexp(r) for r in x])
        out = np.zeros(len(x), np.float32)
        gu.run(self.backend, "logsumexp_rows", [x, out, gu.pack(len(x), x.shape[1], 0, 0.0)], len(x), 256,
               [4 * 256])
        return out


DRAFT_BACKENDS = [f"cpu-{v}" for v in ISAS] + gu.devices()


@pytest.mark.parametrize("draft_backend", DRAFT_BACKENDS)
@pytest.mark.parametrize("cols", [7, 300, 4096])
def test_argmax_and_top_k(draft_backend, rng, cols):
    """Selections: `==` the reference (the first of equal values, NaNs never picked)."""
    d = Drafting(draft_backend)
    x = logit_rows(rng, cols)
    assert d.argmax(x).tolist() == ops.argmax_rows(x).tolist()
    skip = np.array([-1, 0, -1, 3, -1, 1, cols - 1, 2], np.int32)
    for k in (1, 3, 16):
        assert d.top_k(x, min(k, cols - 1), skip).tolist() == ops.top_k_rows(x, min(k, cols - 1), skip).tolist()


@pytest.mark.parametrize("draft_backend", DRAFT_BACKENDS)
@pytest.mark.parametrize("cols", [1, 300, 151936])
def test_logsumexp(draft_backend, rng, cols):
    """Against float64, relative to the sum s >= 1: partial sums of cols/256 terms and a fold
    (one rounding each), each exp within 4 ulp (MSL's bound), then a log and the final add
    relative to the result. One term dropped from a flat row of 300 (1/300) is far outside."""
    rows = 16 if cols < 10000 else 2
    x = f32(rng, rows, cols, scale=3)
    x[0] *= 10  # peaked: most terms underflow against the max
    got = Drafting(draft_backend).logsumexp(x)
    want = np.array([logsumexp(r) for r in x])
    bound = (cols / 256 + 24) * U + 10 * U * np.abs(want)
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want)
