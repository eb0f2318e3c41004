"""Pre-quantized checkpoints (python/sapwood/formats.py): FP8 block-quantized files load as the
float checkpoint of their dequantized values, bit for bit, streamed; bad files are named."""
import json
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
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
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
