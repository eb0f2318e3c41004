"""Pre-quantized checkpoints (python/sapwood/formats.py): FP8 block-quantized files load as the
float checkpoint of their dequantized values, bit for bit, streamed; bad files are named."""
import json
import re
import shutil

import numpy as np
import pytest

import sapwood
from sapwood.formats import E4M3
from sapwood.testing import make_tiny_checkpoint

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

BLOCK = (16, 24)  # does not divide the tiny model's widths: partial blocks at the edges


def quantize_blocks(w: "torch.Tensor", block=BLOCK):
    """(e4m3 values, float32 scales per block, the dequantized float32 weight) as Qwen's FP8
    releases store them: scale = amax / 448 per block, value = w / scale rounded to e4m3."""
    rows, cols = w.shape
    b0, b1 = block
    nb0, nb1 = -(-rows // b0), -(-cols // b1)
    pad = torch.zeros(nb0 * b0, nb1 * b1)
    pad[:rows, :cols] = w
    blocks = pad.reshape(nb0, b0, nb1, b1)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.float(), q.float() * full


def write_fp8(src, dst, deq_dst, *, quant_config=None, skip=("norm", "A_log", "dt_bias", "conv1d")):
    """An FP8 copy of the float checkpoint `src` at dst, and the float32 checkpoint of its
    dequantized values at deq_dst."""
    for d in (dst, deq_dst):
        shutil.copytree(src, d)
    tensors = st.load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and not any(s in name for s in skip):
            q, scale, dq = quantize_blocks(w.float())
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, scale, dq
        else:
            fp8[name] = deq[name] = w
    st.save_file(fp8, str(dst / "model.safetensors"))
    st.save_file(deq, str(deq_dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config or {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    make_tiny_checkpoint(root / "float", seed=4, mtp=True)
    write_fp8(root / "float", root / "fp8", root / "deq")
    return root


def test_e4m3_table_is_torchs():
    bits = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(E4M3, bits)  # NaN where torch has NaN (assert_array_equal)
    assert E4M3[0x7E] == 448.0 and E4M3[0x01] == 2.0 ** -9


@pytest.mark.parametrize("weights", ["f32", "q8"])
def test_fp8_loads_as_its_dequantized_float_checkpoint(fp8_pair, weights):
    a = sapwood.load(fp8_pair / "fp8", weights=weights, quiet=True)
    b = sapwood.load(fp8_pair / "deq", weights=weights, quiet=True)
    assert a.engine.model_id == b.engine.model_id  # the same weights, hashed as the engine stores them
    ids = [5, 17, 99, 3, 250, 42]
    np.testing.assert_array_equal(a.engine.prefill(ids, True), b.engine.prefill(ids, True))
    kw = dict(max_tokens=12, verify="chain", drafter="mtp", temperature=0.8, seed=3)
    assert a.generate(ids, **kw).tokens == b.generate(ids, **kw).tokens  # the MTP head too


def test_fp8_error_against_the_float_source(fp8_pair):
    """What e4m3 costs against the float weights it was made from, as the loader hands them to
    the engine: 3 mantissa bits round each value within 2^-4 of its magnitude, and the
    subnormals (steps of 2^-9) within 2^-10 of the block's scale. The logits' figure is printed."""
    from sapwood.loading import read_checkpoint
    src = st.load_file(str(fp8_pair / "float" / "model.safetensors"))
    ck = read_checkpoint(fp8_pair / "fp8")
    checked = 0
    for name, info in ck.weights.infos.items():
        if not hasattr(info, "block"):
            continue
        w, got = src[name].float().numpy(), ck.weights[name]
        scale = st.load_file(str(fp8_pair / "fp8" / "model.safetensors"))[name + "_scale_inv"].numpy()
        s = np.repeat(np.repeat(scale, BLOCK[0], 0), BLOCK[1], 1)[:w.shape[0], :w.shape[1]]
        assert (np.abs(got - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s).all(), name
        checked += 1
    assert checked >= 20
    a = sapwood.load(fp8_pair / "float", weights="f32", quiet=True)
    b = sapwood.load(fp8_pair / "fp8", weights="f32", quiet=True)
    ids = [5, 17, 99, 3, 250, 42]
    za, zb = a.engine.prefill(ids, True), b.engine.prefill(ids, True)
    print(f"fp8 vs float source: max |logit diff| / max |logit| = "
          f"{np.abs(za - zb).max() / np.abs(za).max():.3g}")


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = st.load_file(str(src / "model.safetensors"))
    edit(tensors)
    st.save_file(tensors, str(dst / "model.safetensors"))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"),
     "'model.layers.0.mlp.up_proj.weight' has no 'model.layers.0.mlp.up_proj.weight_scale_inv'"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 3)}),
     r"expected F32 or BF16 \[8, 3\]"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1)}), "has a scale but holds"),
    (lambda t: t.update({"nothing.weight_scale_inv": torch.ones(1)}), "has no tensor 'nothing.weight'"),
])
def test_bad_fp8_files_are_named(fp8_pair, tmp_path, edit, match):
    _rewrite(fp8_pair / "fp8", tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        sapwood.load(tmp_path / "bad", quiet=True)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method='bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"},
     "checkpoint_format='marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size=None"),
])
def test_unread_quantizations_are_refused(fp8_pair, tmp_path, qc, match):
    d = tmp_path / "q"
    shutil.copytree(fp8_pair / "fp8", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        sapwood.load(d, quiet=True)


def test_fp8_without_its_quantization_config_is_refused(fp8_pair, tmp_path):
    d = tmp_path / "noconfig"
    shutil.copytree(fp8_pair / "fp8", d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="is F8_E4M3 but config.json has no FP8"):
        sapwood.load(d, quiet=True)


# MLX affine checkpoints, written here as mlx-lm's converter writes them (names, packing,
# sanitize); test_mlx_lm_converter_and_forward checks the same against mlx-lm itself.
def mlx_quantize(w: np.ndarray, bits: int, group: int):
    """(packed uint32, scales, biases, dequantized float32) of a float32 weight [out, in], affine
    per group: scale = (max - min) / (2^bits - 1), bias = min, q = round((w - bias) / scale)."""
    out, cols = w.shape
    g = w.reshape(out, cols // group, group)
    lo, hi = g.min(axis=2), g.max(axis=2)
    scale = np.where(hi > lo, (hi - lo) / (2 ** bits - 1), 1.0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 2 ** bits - 1).astype(np.uint32)
    q = q.reshape(out, cols)
    per = 32 // bits
    packed = np.zeros((out, cols // per), np.uint32)
    for j in range(per):
        packed |= q[:, j::per] << np.uint32(j * bits)
    deq = (np.repeat(scale, group, 1) * q.astype(np.float32) + np.repeat(lo, group, 1))
    return packed, scale, lo.astype(np.float32), deq.astype(np.float32)


def write_mlx(src, dst, deq_dst, bits=4, group=32, overrides=None):
    from safetensors.numpy import load_file, save_file
    overrides = overrides or {}
    for d in (dst, deq_dst):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    mlx, deq = {}, {}
    for name, w in tensors.items():
        if name.startswith("mtp."):
            deq[name] = w  # mlx-lm drops the head
            continue
        key = "language_model." + name
        module = key[:-len(".weight")]
        setting = overrides.get(module, {"bits": bits, "group_size": group})
        if w.ndim == 2 and setting is not False and w.shape[1] % setting["group_size"] == 0:
            p, s, b, dq = mlx_quantize(w, setting["bits"], setting["group_size"])
            mlx[key], mlx[module + ".scales"], mlx[module + ".biases"], deq[name] = p, s, b, dq
        elif "conv1d.weight" in name:
            mlx[key], deq[name] = np.ascontiguousarray(np.moveaxis(w, 2, 1)), w
        elif name.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight",
                            "k_norm.weight")):
            mlx[key], deq[name] = w + np.float32(1.0), (w + np.float32(1.0)) - np.float32(1.0)
        else:
            mlx[key], deq[name] = w, w
    save_file(mlx, str(dst / "model.safetensors"))
    save_file(deq, str(deq_dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization"] = {"group_size": group, "bits": bits, "mode": "affine", **overrides}
    cfg["quantization_config"] = dict(cfg["quantization"])
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("bits, group, overrides", [
    (4, 32, {}), (8, 64, {}), (2, 32, {}),
    (4, 64, {"language_model.model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32},
             "language_model.model.layers.1.mlp.up_proj": False})])
def test_mlx_loads_as_its_dequantized_float_checkpoint(tmp_path, bits, group, overrides):
    make_tiny_checkpoint(tmp_path / "float", seed=6, mtp=True)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", bits, group, overrides)
    a = sapwood.load(tmp_path / "mlx", weights="f32", quiet=True)
    b = sapwood.load(tmp_path / "deq", weights="f32", quiet=True)
    assert a.engine.model_id == b.engine.model_id
    ids = [5, 17, 99, 3, 250, 42]
    np.testing.assert_array_equal(a.engine.prefill(ids, True), b.engine.prefill(ids, True))
    assert a.mtp is None  # mlx-lm dropped the head the config still announces
    kw = dict(max_tokens=10, temperature=0.7, seed=2)
    assert (a.generate(ids, verify="tree", width=6, drafter="lookup", **kw).tokens
            == a.generate(ids, verify="off", **kw).tokens)


@pytest.mark.parametrize("quant, match", [
    ({"group_size": 64, "bits": 3}, "expected mlx-lm's"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "mode 'mxfp4'"),
    ({"group_size": 48, "bits": 4}, "expected mlx-lm's"),
])
def test_unread_mlx_settings_are_refused(tmp_path, quant, match):
    make_tiny_checkpoint(tmp_path / "float", seed=6)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq")
    cfg = json.loads((tmp_path / "mlx" / "config.json").read_text())
    cfg["quantization"] = quant
    (tmp_path / "mlx" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        sapwood.load(tmp_path / "mlx", quiet=True)


def test_mlx_lm_converter_and_forward(tmp_path):
    """A checkpoint made by mlx-lm's own converter (4-bit, groups of 64) loads with default
    options, and its float32 logits track mlx-lm's forward of the same file: within 1e-5 of
    the largest logit (float32 rounding of two summation orders)."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import convert, load
    make_tiny_checkpoint(tmp_path / "hf", seed=4, layout="multimodal")
    convert(str(tmp_path / "hf"), mlx_path=str(tmp_path / "mlx"), quantize=True, q_bits=4,
            q_group_size=64)
    ids = [5, 17, 99, 3, 250, 42, 7, 8]
    model, _ = load(str(tmp_path / "mlx"))
    want = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    got = sapwood.load(tmp_path / "mlx", weights="f32", kv="f32", quiet=True).engine.prefill(ids, True)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    default = sapwood.load(tmp_path / "mlx", quiet=True)
    assert (default.engine.prefill(ids, True).argmax(1) == want.argmax(1)).all()


def test_a_requantizing_load_says_so(fp8_pair, tmp_path, capsys):
    make_tiny_checkpoint(tmp_path / "float", seed=6)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 8, 64)
    for d, what in ((tmp_path / "mlx", "MLX affine 8-bit, groups of 64"),
                    (fp8_pair / "fp8", r"FP8 e4m3 in \[16, 24\] blocks")):
        with pytest.warns(UserWarning, match=r"\d+ " + what + r" tensors are rounded again for "
                                             r"weights='q8'"):
            sapwood.load(d, quiet=True, verbose=True)
        # the line saying what loads names the stored format too
        assert re.search(r"\(\d+ MB " + what + r"\) as weights=q8", capsys.readouterr().err)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sapwood.load(tmp_path / "mlx", weights="f32", quiet=True)  # exact: nothing to say
        sapwood.load(tmp_path / "float", quiet=True)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_4bit_runs_as_stored(tmp_path, group):
    """MLX 4-bit groups of 32 or 64 (or 128: two of 64) run as stored in a quantized load: no
    second rounding (no warning), the stored bytes plus a scale and bias per group in memory
    (<= 1.25x the file), every kernel variant the same bits, the same tokens in every
    verify mode, and logits within the int8 activations' error of the exact float32 load:
    relative RMS 0.04-0.15 measured here, where a q8 load of the same values measures
    0.04-0.20 (random nets amplify the activations' rounding); a wrong nibble order, scale or
    bias gives errors of order 1."""
    import warnings

    from util import ISAS, isa
    make_tiny_checkpoint(tmp_path / "float", seed=6, hidden=128, intermediate=256)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 4, group)
    ids = [5, 17, 99, 3, 250, 42, 7]
    exact = sapwood.load(tmp_path / "mlx", weights="f32", quiet=True).engine.prefill(ids, True)
    outs = []
    for name in ISAS:
        with isa(name), warnings.catch_warnings():
            warnings.simplefilter("error")
            m = sapwood.load(tmp_path / "mlx", weights="q4", quiet=True)
            outs.append(m.engine.prefill(ids, True))
    for z in outs[1:]:
        np.testing.assert_array_equal(z, outs[0])
    rel = np.linalg.norm(outs[0] - exact) / np.linalg.norm(exact)
    print(f"MLX 4-bit g{group} as stored vs exact float32: relative RMS {rel:.4f}")
    assert rel <= 0.3
    file_bytes = (tmp_path / "mlx" / "model.safetensors").stat().st_size
    assert m.engine.memory()["weights_bytes"] <= 1.25 * file_bytes
    kw = dict(max_tokens=12, temperature=0.8, seed=1, drafter="lookup")
    plain = m.generate(ids, verify="off", **kw).tokens
    assert all(m.generate(ids, verify=v, width=w, **kw).tokens == plain
               for v, w in (("chain", None), ("tree", 8)))


@pytest.mark.parametrize("backend", ["metal-emulated", "sycl-emulated"])
@pytest.mark.parametrize("group", [32, 64])
def test_mlx_4bit_on_a_gpu_backend_runs_as_stored(tmp_path, group, backend):
    """MLX 4-bit groups of 32 or 64 on a GPU backend run as stored, as on the CPU: weights='auto'
    is q4 with no second rounding (no warning), the prefill logits are the CPU backend's (the
    affine matmuls and embedding rows are its bits, test_gpu_ops.py; the other GPU kernels sum
    in their own orders, measured 1.5e-7 and 2.1e-7 of the logit scale here, bounded as
    test_backends.py bounds q4: 3e-2; a dropped bias measures 10), and the tokens are the CPU's
    in every verify mode."""
    import warnings
    make_tiny_checkpoint(tmp_path / "float", seed=6, hidden=128, intermediate=256)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 4, group)
    ids = [5, 17, 99, 3, 250, 42, 7]
    cpu = sapwood.load(tmp_path / "mlx", backend="cpu", quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = sapwood.load(tmp_path / "mlx", backend=backend, quiet=True)
    assert m.weights == "q4"
    want, got = cpu.engine.prefill(ids, True), m.engine.prefill(ids, True)
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"MLX 4-bit g{group} on {backend} vs cpu: {rel:.2e} of the logit scale")
    assert rel <= 3e-2
    assert (got.argmax(1) == want.argmax(1)).all()
    kw = dict(max_tokens=12, temperature=0.8, seed=1, drafter="lookup")
    plain = cpu.generate(ids, verify="off", **kw).tokens
    assert all(m.generate(ids, verify=v, width=w, **kw).tokens == plain
               for v, w in (("off", None), ("chain", None), ("tree", 8)))


def test_affine_rows_give_the_exact_largest_weight(tmp_path):
    """The LM head's largest |weight| (the logit bound loading checks) comes with the stored
    rows, from each group's smallest and largest q, equal to the dequantized tensor's."""
    from sapwood.loading import read_checkpoint
    make_tiny_checkpoint(tmp_path / "float", seed=6)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 4, 64)
    ck = read_checkpoint(tmp_path / "mlx")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        info = ck.weights.infos[name]
        *_, amax = info.q4_affine_rows(ck.weights._reader, 0, info.shape[0])
        assert amax == np.abs(ck.weights[name]).max()


@pytest.mark.parametrize("weights", ["q4", "q8", "f32"])
def test_the_memory_estimate_counts_stored_groups(tmp_path, weights):
    """sapwood.estimate of an MLX 4-bit checkpoint: its matrices kept as stored in q4/q8
    loads (a scale and a bias per 64 inputs), the engine's own figure, to the byte."""
    make_tiny_checkpoint(tmp_path / "float", seed=6)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 4, 64)
    est = sapwood.estimate(tmp_path / "mlx", weights=weights)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = sapwood.load(tmp_path / "mlx", weights=weights, quiet=True)
    assert est.parts["weights"] == m.engine.memory()["weights_bytes"]


# weights="auto" (the default): the checkpoint decides (formats.auto_weights)
@pytest.mark.parametrize("bits, group, overrides, want", [
    (4, 64, {}, "q4"), (4, 128, {}, "q4"), (4, 32, {}, "q4"), (8, 64, {}, "q8"), (2, 64, {}, "q8"),
    (4, 64, {"language_model.model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64}}, "q8"),
])
def test_auto_keeps_what_runs_as_stored(tmp_path, bits, group, overrides, want):
    """MLX 4-bit groups of 32/64/128 load as q4 (as stored, no warning); anything else in q8, and
    a load that rounds stored values again says so, naming the format and the mode."""
    import warnings
    # widths that groups of 128 divide: every matrix quantized, as the estimate assumes
    make_tiny_checkpoint(tmp_path / "float", seed=6, hidden=128, intermediate=256, dv=32)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", bits, group, overrides)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = sapwood.load(tmp_path / "mlx", quiet=True)
    assert m.weights == want
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    if want == "q4":
        assert not said
    else:
        assert len(said) == 1 and f"MLX affine {bits}-bit, groups of {group}" in said[0]
        assert "weights='q8' (what weights='auto' picks" in said[0]
    est = sapwood.estimate(tmp_path / "mlx")
    assert est.weights == want
    if not overrides:  # the estimate counts the global setting (formats.stored_matrices)
        assert est.parts["weights"] == m.engine.memory()["weights_bytes"]


def test_auto_is_q8_for_float_and_fp8(fp8_pair):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sapwood.load(fp8_pair / "float", quiet=True).weights == "q8"
    with pytest.warns(UserWarning, match=r"FP8 e4m3 in \[16, 24\] blocks tensors are rounded "
                                         r"again for weights='q8' \(what weights='auto'"):
        assert sapwood.load(fp8_pair / "fp8", quiet=True).weights == "q8"


@pytest.mark.parametrize("weights, lossy", [("f32", False), ("q8", True), ("q4", True),
                                            ("bf16", True)])
def test_an_explicit_mode_that_rounds_again_says_so(tmp_path, weights, lossy):
    """An MLX 8-bit file: f32 widens it exactly (silent); q8, q4 and bf16 round it again and
    the warning names the file's format and the mode."""
    import warnings
    make_tiny_checkpoint(tmp_path / "float", seed=6)
    write_mlx(tmp_path / "float", tmp_path / "mlx", tmp_path / "deq", 8, 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = sapwood.load(tmp_path / "mlx", weights=weights, quiet=True)
    assert m.weights == weights
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    if lossy:
        assert len(said) == 1 and re.search(r"\d+ MLX affine 8-bit, groups of 64 tensors are "
                                            f"rounded again for weights='{weights}';", said[0])
    else:
        assert not said
