"""GPTQ and AWQ int4 checkpoints (python/sapwood/formats/int4.py): written here with the test's
own numpy packers (AutoGPTQ's v1/v2 and AutoAWQ's GEMM layouts), loaded as the float
checkpoint of their dequantized values bit for bit; groups of 64/128 in input order run as
stored (no second rounding); bad files are named."""
import json
import shutil
import warnings

import numpy as np
import pytest

import sapwood
from sapwood.testing import make_tiny_checkpoint

st = pytest.importorskip("safetensors.numpy")

IDS = [5, 17, 99, 3, 250, 42, 7]
QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # what GPTQModel/AutoAWQ quantize
AWQ_PACK = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble k <- output 8c + AWQ_PACK[k]


def rtn(w: np.ndarray, group: int, g_idx: np.ndarray):
    """Round-to-nearest asymmetric int4 of w [out, in] by the groups g_idx assigns: (q [out, in],
    zero [G, out], scale f16 [G, out]) with scale = (max - min) / 15, zero = round(-min / s)."""
    out, cols = w.shape
    ng = cols // group
    scale = np.empty((ng, out), np.float16)
    zero = np.empty((ng, out), np.int64)
    for gi in range(ng):
        cols_g = w[:, g_idx == gi]
        lo, hi = np.minimum(cols_g.min(1), 0), np.maximum(cols_g.max(1), 0)
        s = np.maximum((hi - lo) / 15, 1e-4).astype(np.float16)
        scale[gi], zero[gi] = s, np.clip(np.rint(-lo / s.astype(np.float32)), 0, 15)
    s_full, z_full = scale[g_idx].T.astype(np.float32), zero[g_idx].T
    q = np.clip(np.rint(w / s_full) + z_full, 0, 15).astype(np.int64)
    return q, zero, scale


def dequant(q, zero, scale, g_idx) -> np.ndarray:
    """The test's own: scale * (q - zero) per input's group, in float64 then float32 (exact:
    at most 15 significant bits)."""
    w = (scale[g_idx].T.astype(np.float64) * (q - zero[g_idx].T)).astype(np.float32)
    return np.ascontiguousarray(w)  # safetensors.numpy writes a Fortran-ordered array's buffer


def pack_along(x: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """int [a, 8b] -> int32 [a, b]: nibble k of int c holds x[:, 8c + order[k]]."""
    a, n = x.shape
    out = np.zeros((a, n // 8), np.uint32)
    for k in range(8):
        out |= (x[:, order[k]::8].astype(np.uint32) & 15) << np.uint32(4 * k)
    return out.view(np.int32)


def gptq_tensors(q, zero, scale, g_idx, v1=True):
    """AutoGPTQ's layout: qweight [in / 8, out] packed along the inputs; qzeros [G, out / 8]
    packed along the outputs, v1 storing zero - 1 (4-bit wrap: AutoGPTQ reads (z + 1) & 15)."""
    return {"qweight": np.ascontiguousarray(pack_along(q).T),
            "qzeros": pack_along((zero - 1) & 15 if v1 else zero),
            "scales": scale, "g_idx": g_idx.astype(np.int32)}


def awq_tensors(q, zero, scale):
    """AutoAWQ's GEMM layout: qweight [in, out / 8] and qzeros [G, out / 8], packed along the
    outputs in AWQ's order."""
    return {"qweight": pack_along(np.ascontiguousarray(q.T), AWQ_PACK),
            "qzeros": pack_along(zero, AWQ_PACK), "scales": scale}


def write_int4(src, dst, deq_dst, method, group, *, desc_act=False, v1=True, seed=0):
    """A GPTQ/AWQ copy of the float checkpoint src (the QUANTIZED modules of every layer, the
    rest as stored), and the float32 checkpoint of its dequantized values. Returns
    {weight name: (source float32, dequantized)}."""
    for d in (dst, deq_dst):
        shutil.copytree(src, d)
    rng = np.random.default_rng(seed)
    tensors = st.load_file(str(src / "model.safetensors"))
    out, deq, pairs = {}, {}, {}
    for name, w in tensors.items():
        module = name[:-len(".weight")]
        if not (name.endswith(QUANTIZED_W) and name.startswith("model.layers.")):
            out[name] = deq[name] = w
            continue
        cols = w.shape[1]
        g = cols if group == -1 else group
        g_idx = np.arange(cols) // g
        if desc_act:  # act-order: the groups follow a permutation of the inputs
            g_idx = g_idx[rng.permutation(cols)]
        q, zero, scale = rtn(w.astype(np.float32), g, g_idx)
        parts = gptq_tensors(q, zero, scale, g_idx, v1) if method == "gptq" else \
            awq_tensors(q, zero, scale)
        out.update({f"{module}.{k}": v for k, v in parts.items()})
        deq[name] = dequant(q, zero, scale, g_idx)
        pairs[name] = (w.astype(np.float32), deq[name])
    st.save_file(out, str(dst / "model.safetensors"))
    st.save_file(deq, str(deq_dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"desc_act": desc_act, "sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
              if method == "gptq" else {"zero_point": True, "version": "gemm"})
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return pairs


QUANTIZED_W = tuple(m + ".weight" for m in QUANTIZED)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4src")
    # widths groups of 128 divide (q/k/v/o, MLP), an MTP head kept in float
    make_tiny_checkpoint(root / "float", seed=8, hidden=128, intermediate=256, dv=32, mtp=True)
    return root / "float"


CASES = [("gptq", 128, False, True), ("gptq", 64, False, False), ("gptq", 32, False, True),
         ("gptq", 64, True, True), ("gptq", -1, False, True), ("awq", 128, False, False),
         ("awq", 32, False, False)]


@pytest.mark.parametrize("method, group, desc_act, v1", CASES)
def test_int4_reads_as_its_dequantized_values(src, tmp_path, method, group, desc_act, v1):
    """Every quantized Linear reads back as the test's own dequantization, ==; the float
    tensors as stored; f32 loads of the two checkpoints are the same engine (model_id, logits,
    MTP drafts)."""
    from sapwood.loading import read_checkpoint
    pairs = write_int4(src, tmp_path / "q", tmp_path / "deq", method, group, desc_act=desc_act,
                       v1=v1)
    ck = read_checkpoint(tmp_path / "q")
    for name, (_, want) in pairs.items():
        got = ck.weights[name]
        assert got.dtype == np.float32 and np.array_equal(got, want), name
        for r0, r1 in ((0, 3), (5, 21), (want.shape[0] - 9, want.shape[0])):  # unaligned chunks
            chunk = ck.weights.infos[name].rows(ck.weights._reader, r0, r1)
            assert np.array_equal(chunk.reshape(r1 - r0, -1), want[r0:r1]), (name, r0, r1)
    assert len(pairs) == 3 * 4 + 4  # the MLPs of 4 layers, the attention layer's q, k, v, o
    a = sapwood.load(tmp_path / "q", weights="f32", quiet=True)
    b = sapwood.load(tmp_path / "deq", weights="f32", quiet=True)
    assert a.engine.model_id == b.engine.model_id
    np.testing.assert_array_equal(a.engine.prefill(IDS, True), b.engine.prefill(IDS, True))
    kw = dict(max_tokens=10, temperature=0.8, seed=3)
    assert a.generate(IDS, drafter="mtp", **kw).tokens == b.generate(IDS, drafter="mtp", **kw).tokens


@pytest.mark.parametrize("method, group, desc_act, v1", CASES)
def test_int4_auto_and_what_it_says(src, tmp_path, method, group, desc_act, v1):
    """weights='auto' loads GPTQ/AWQ in q8: groups of 32/64/128 in input order run as stored
    (silent); other groupings round again in q8 and a warning names the format and the mode;
    q4 keeps the stored groups too, f32 is exact (silent). Tokens are the same in every verify
    mode."""
    write_int4(src, tmp_path / "q", tmp_path / "deq", method, group, desc_act=desc_act, v1=v1)
    stored = group in (32, 64, 128, -1) and not desc_act  # -1: one group a row (128 or 256 wide)
    for weights in ("auto", "q4", "f32"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            m = sapwood.load(tmp_path / "q", weights=weights, quiet=True)
        said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
        assert m.weights == ("q8" if weights == "auto" else weights)
        if stored or weights == "f32":
            assert not said, said
        else:
            assert len(said) == 1 and f"16 {method.upper()} int4, " in said[0], said
            assert f"rounded again for weights='{m.weights}'" in said[0]
    kw = dict(max_tokens=12, temperature=0.8, seed=1, drafter="lookup")
    plain = m.generate(IDS, verify="off", **kw).tokens
    assert all(m.generate(IDS, verify=v, width=w, **kw).tokens == plain
               for v, w in (("chain", None), ("tree", 8)))


@pytest.mark.parametrize("method, group", [("gptq", 128), ("awq", 128), ("gptq", 32)])
def test_int4_as_stored_holds_the_stored_groups(src, tmp_path, method, group):
    """A q8 (auto) or q4 load keeps the stored nibbles (affine groups of 64, or of 32, bias =
    -(scale * zero)): the same bits on every kernel variant, fewer bytes than the q8 load of the
    dequantized float file, logits within the int8 activations' error of the exact float32
    load: relative RMS 0.05 measured here in q8, as the q8 load of the dequantized file (0.05);
    <= 0.3 asserted, as for MLX's as-stored groups (random nets amplify the activations'
    rounding; a wrong nibble order or zero gives errors of order 1). In q4 the tensors the
    file keeps in float (embeddings, head, GDN projections) are rounded to symmetric 4-bit
    groups too: 0.52 here (0.57 for the q4 load of the dequantized file), printed only."""
    from util import ISAS, isa
    write_int4(src, tmp_path / "q", tmp_path / "deq", method, group)
    exact = sapwood.load(tmp_path / "q", weights="f32", quiet=True).engine.prefill(IDS, True)
    for weights in ("q8", "q4"):
        outs = []
        for name in ISAS:
            with isa(name):
                m = sapwood.load(tmp_path / "q", weights=weights, quiet=True)
                outs.append(m.engine.prefill(IDS, True))
        for z in outs[1:]:
            np.testing.assert_array_equal(z, outs[0])
        rel = np.linalg.norm(outs[0] - exact) / np.linalg.norm(exact)
        print(f"{method} int4 g{group} as stored, weights={weights} vs exact float32: relative RMS "
              f"{rel:.4f}")
        if weights == "q8":
            assert rel <= 0.3
            deq = sapwood.load(tmp_path / "deq", weights="q8", quiet=True)
            assert m.engine.memory()["weights_bytes"] < deq.engine.memory()["weights_bytes"]
    # the engine's own dequantization of an as-stored row is the file's value, bit for bit
    from sapwood.loading import read_checkpoint
    ck = read_checkpoint(tmp_path / "q")
    name = "model.layers.0.mlp.down_proj.weight"
    info = ck.weights.infos[name]
    nib, s, b, amax = info.q4_affine_rows(ck.weights._reader, 0, info.shape[0])
    lo, hi = (nib & 15).astype(np.float32), (nib >> 4).astype(np.float32)
    n, cols = info.shape
    h = 16 if group == 32 else 32  # the engine group's high-nibble offset (csrc/weights.h)
    q = np.concatenate([lo.reshape(n, -1, h), hi.reshape(n, -1, h)], axis=2).reshape(n, cols)
    w = q * np.repeat(s.reshape(n, -1), 2 * h, 1) + np.repeat(b.reshape(n, -1), 2 * h, 1)
    assert np.array_equal(w, ck.weights[name]) and amax == np.abs(w).max()


def test_int4_error_against_the_float_source(src, tmp_path):
    """What round-to-nearest int4 costs against the float weights it was made from: each value
    within one step of its group (scale = (max - min) / 15 in f16: half a step for the
    rounding, up to another half where the zero point's rounding moves the grid's end inside
    the range and q clips); the largest error and the logits' figure are printed."""
    pairs = write_int4(src, tmp_path / "q", tmp_path / "deq", "gptq", 128)
    worst = 0.0
    for name, (w, d) in pairs.items():
        g = np.arange(w.shape[1]) // 128
        lo = np.minimum(w.reshape(w.shape[0], -1, 128).min(2), 0)
        hi = np.maximum(w.reshape(w.shape[0], -1, 128).max(2), 0)
        step = ((hi - lo) / 15)[:, g]
        err = np.abs(w - d)
        assert (err <= step * (1 + 2 ** -9)).all(), name
        worst = max(worst, float((err / step).max()))
    print(f"gptq int4 g128 vs float source: largest |error| {worst:.3f} steps")
    za = sapwood.load(src, weights="f32", quiet=True).engine.prefill(IDS, True)
    zb = sapwood.load(tmp_path / "q", weights="f32", quiet=True).engine.prefill(IDS, True)
    print(f"gptq int4 g128 vs float source: max |logit diff| / max |logit| = "
          f"{np.abs(za - zb).max() / np.abs(za).max():.3g}")


def _edit(src, tmp_path, edit, method="gptq"):
    write_int4(src, tmp_path / "q", tmp_path / "deq", method, 64)
    t = st.load_file(str(tmp_path / "q" / "model.safetensors"))
    edit(t)
    st.save_file(t, str(tmp_path / "q" / "model.safetensors"))
    return tmp_path / "q"


P = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop(P + ".qzeros"), f"'{P}.qweight' has no '{P}.qzeros'"),
    (lambda t: t.pop(P + ".qweight"), f"'{P}.(qzeros|g_idx)' has no qweight"),
    (lambda t: t.update({P + ".scales": np.ones((3, 3), np.float16)}),
     rf"'{P}.scales' is F16\[3, 3\]: expected F16 or BF16 or F32\[2, 256\]"),
    (lambda t: t.update({P + ".g_idx": np.full(128, 9, np.int32)}), "outside 0..1"),
    (lambda t: t.update({P + ".qweight": t[P + ".qweight"].view(np.float32)}),
     "expected a 2-D I32 tensor"),
    (lambda t: t.update({P + ".bias": np.ones(256, np.float16)}), "a nonzero bias"),
    (lambda t: t.update({P + ".weight": np.ones((256, 128), np.float32)}), "stored beside"),
])
def test_bad_int4_files_are_named(src, tmp_path, edit, match):
    d = _edit(src, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        sapwood.load(d, quiet=True)


def test_a_zero_bias_is_dropped(src, tmp_path):
    d = _edit(src, tmp_path, lambda t: t.update({P + ".bias": np.zeros(256, np.float16)}))
    sapwood.load(d, weights="f32", quiet=True)


def test_a_dropped_mtp_head_is_not_required(src, tmp_path):
    """A quantizer that drops the MTP head keeps the config's announcement (as mlx-lm does):
    the model loads without the head; other drafters draft."""
    write_int4(src, tmp_path / "q", tmp_path / "deq", "gptq", 64)
    t = st.load_file(str(tmp_path / "q" / "model.safetensors"))
    st.save_file({k: v for k, v in t.items() if not k.startswith("mtp.")},
                 str(tmp_path / "q" / "model.safetensors"))
    m = sapwood.load(tmp_path / "q", quiet=True)
    assert m.mtp is None
    assert len(m.generate(IDS, max_tokens=4, drafter="lookup").tokens) == 4
