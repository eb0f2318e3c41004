"""Loading: our safetensors reader, checkpoint validation, `sapwood.load` -> Model.

Validation runs before the engine is built, so it is tested without C++; a fake Engine checks what
`load` hands the engine; tests of the real Engine are marked `needs_engine`."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

import sapwood
from sapwood.loading import check_tensors, engine_dims, read_checkpoint
from sapwood.config import ModelConfig, expected_shapes
from sapwood.safetensors_io import load_checkpoint_weights, read_safetensors
from sapwood.testing import save_bf16, make_tiny_checkpoint, make_tokenizer

needs_engine = pytest.mark.skipif(not hasattr(sapwood._core, "Engine"), reason="engine not built yet")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(d, seed=3)
    return d


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A fresh copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_dir, tmp_path / "ckpt")


def write_raw(path, header, data=b"", header_len=None):
    h = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes((len(h) if header_len is None else header_len).to_bytes(8, "little") + h + data)
    return path


def resave(d, weights):
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_roundtrip_save_file(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a.f32": rng.standard_normal((3, 5)).astype(np.float32), "c.scalar": np.array(2.5, np.float32),
              "b.f16": rng.standard_normal((7,)).astype(np.float16), "d.empty": np.zeros((0, 4), np.float32),
              "e.i64": np.arange(-3, 9, dtype=np.int64).reshape(3, 4), "f.u8": np.arange(10, dtype=np.uint8),
              "g.i8": np.array([-128, 0, 127], np.int8)}
    save_file(arrays, str(tmp_path / "x.safetensors"))
    assert set(got := read_safetensors(tmp_path / "x.safetensors")) == set(arrays)
    for n, x in arrays.items():
        # floats come back as float32, exactly (f16 -> f32 is exact); integers as they are
        assert got[n].dtype == (np.float32 if x.dtype.kind == "f" else x.dtype)
        assert got[n].shape == x.shape and np.array_equal(got[n], x.astype(got[n].dtype)), n
    assert list(read_safetensors(tmp_path / "x.safetensors", names=["b.f16"])) == ["b.f16"]
    with pytest.raises(ValueError, match="nope"):
        read_safetensors(tmp_path / "x.safetensors", names=["nope"])


def test_bf16_exact(tmp_path):
    # values whose low 16 bits are zero are exactly bf16: the round trip must be bit exact
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 6)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    save_bf16({"w": x, "v": x[0]}, tmp_path / "b.safetensors", {"format": "pt"})
    got = read_safetensors(tmp_path / "b.safetensors")
    assert got["w"].dtype == np.float32 and np.array_equal(got["w"].view(np.uint32), x.view(np.uint32))
    assert np.array_equal(got["v"], x[0])


def test_bf16_checkpoint_matches_f32(tmp_path):
    make_tiny_checkpoint(tmp_path / "f32", seed=5)
    make_tiny_checkpoint(tmp_path / "bf16", seed=5, dtype="bfloat16")
    a, b = load_checkpoint_weights(tmp_path / "f32"), load_checkpoint_weights(tmp_path / "bf16")
    assert set(a) == set(b)
    for n in a:  # bf16 keeps 8 bits of mantissa: rounding error <= 2^-9 relative
        assert b[n].dtype == np.float32 and not (b[n].view(np.uint32) & 0xFFFF).any()
        assert np.all(np.abs(b[n] - a[n]) <= np.abs(a[n]) * 2.0 ** -8), n


GOOD = {"__metadata__": {"format": "pt"},
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}


def bad(dtype="F32", shape=(2,), offsets=(8, 16)):
    """GOOD with tensor 'y' replaced (offsets=None: no data_offsets key)."""
    y = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets or ())}
    if offsets is None:
        del y["data_offsets"]
    return {**GOOD, "y": y}


@pytest.mark.parametrize("header, data, header_len, match", [
    (GOOD, bytes(12), None, r"'y'.*truncated"),                                       # cut short
    (GOOD, bytes(16), 10 ** 6, r"header length 1000000 exceeds the file size"),
    (b"{not json", bytes(16), None, r"not valid JSON"),
    (b'{"x": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "x": {}}', bytes(4), None,
     r"duplicate key 'x'"),
    (bad(offsets=(4, 12)), bytes(16), None, r"'y'.*overlap.*'x'"),
    (bad(shape=(1,), offsets=(12, 8)), bytes(16), None, r"'y'.*data_offsets"),      # end < begin
    (bad(dtype="Q4_K"), bytes(16), None, r"'y'.*dtype 'Q4_K'"),
    (bad(dtype="F16"), bytes(16), None, r"'y'.*needs 4 bytes"),
    (bad(shape=(-2,)), bytes(16), None, r"'y'.*bad shape"),
    (bad(offsets=None), bytes(16), None, r"'y'.*data_offsets"),
])
def test_corrupt_files(tmp_path, header, data, header_len, match):
    p = write_raw(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(ValueError, match=match) as e:
        read_safetensors(p)
    assert "bad.safetensors" in str(e.value)  # the message names the file


def test_truncated_checkpoint(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        read_checkpoint(ckpt)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        read_checkpoint(ckpt)


def shard(src, dst):
    """Split src's model.safetensors into two shards + an index in dst (a copy of src)."""
    w = load_checkpoint_weights(src)
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    names = sorted(w)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, ns in parts.items():
        save_file({n: w[n] for n in ns}, str(dst / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return w


def test_sharded_equals_single(tiny_dir, tmp_path):
    w = shard(tiny_dir, tmp_path / "sharded")
    got = load_checkpoint_weights(tmp_path / "sharded")
    assert set(got) == set(w) and all(np.array_equal(got[n], w[n]) for n in w)
    a, b = read_checkpoint(tiny_dir), read_checkpoint(tmp_path / "sharded")
    assert list(a.weights) == list(b.weights)
    assert all(np.array_equal(a.weights[n], b.weights[n]) for n in a.weights)
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard 'model-00002-of-00002.safetensors'.*missing"):
        load_checkpoint_weights(tmp_path / "sharded")


@pytest.mark.parametrize("name, match", [
    ("model.safetensors", r"no model.safetensors or model.safetensors.index.json; found \['other"),
    ("config.json", r"no config.json"),
])
def test_missing_file(ckpt, name, match):
    (ckpt / name).rename(ckpt / "other.safetensors")
    with pytest.raises(ValueError, match=match):
        sapwood.load(ckpt)


K = "model.layers.3.self_attn.k_proj.weight"


@pytest.mark.parametrize("mutate, match", [
    (lambda w: w.pop("model.layers.1.linear_attn.A_log"), r"missing tensor 'model.layers.1.linear_attn.A_log'"),
    (lambda w: w.update({K: w[K][:-1]}), rf"'{K}' has shape \(63, 64\), expected \(64, 64\)"),
    (lambda w: w.update({"model.layers.0.mlp.gate_proj.bias": np.zeros(128, np.float32)}),
     r"unexpected tensors.*model.layers.0.mlp.gate_proj.bias"),
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].astype(np.int32)}),
     r"'model.norm.weight' has dtype int32"),
])
def test_bad_tensors(ckpt, mutate, match):
    w = load_checkpoint_weights(ckpt)
    mutate(w)
    resave(ckpt, w)
    with pytest.raises(ValueError, match=match):  # raised before any engine is built
        sapwood.load(ckpt)


def test_tied_drops_lm_head_and_untied_needs_it(ckpt):
    cfg = ModelConfig.from_dict({**json.loads((ckpt / "config.json").read_text()), "tie_word_embeddings": True})
    w = load_checkpoint_weights(ckpt)
    out = check_tensors(cfg, w)  # HF ignores a stored lm_head of a tied model
    assert list(out) == list(expected_shapes(cfg)) and "lm_head.weight" not in out
    del w["lm_head.weight"]
    resave(ckpt, w)
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head.weight'.*tie_word_embeddings"):
        read_checkpoint(ckpt)


def test_composite_names(ckpt):
    # Qwen3_5ForConditionalGeneration layout: model.language_model.*, plus mtp.* and visual heads
    w = load_checkpoint_weights(ckpt)
    resave(ckpt, {**{n.replace("model.", "model.language_model.", 1): x for n, x in w.items()},
                  "mtp.fc.weight": np.zeros((2, 2), np.float32), "model.visual.patch.weight": np.zeros(3, np.float32)})
    assert set(read_checkpoint(ckpt).weights) == set(w)


@pytest.mark.parametrize("model_type, match", [
    ("llama", r"unsupported model_type 'llama'; supported: qwen3_5_text"),
    ("qwen3_next", r"Qwen3-Next.*not supported"),
])
def test_unsupported_model_type(ckpt, model_type, match):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    with pytest.raises(ValueError, match=match):
        sapwood.load(ckpt)


@pytest.mark.parametrize("kw, match", [
    (dict(weights="q5"), r"weights='q5'.*f32, bf16, q8, q4"),
    (dict(kv="fp8"), r"kv='fp8'.*int8, f32"),
    *[(dict(backend=b), rf"'{b}' is not built in this install") for b in ("cuda", "metal", "sycl")],
    (dict(backend="tpu"), r"unknown backend"),
    *[(dict(max_context=c), r"max_context") for c in (0, -5, True, 1.5)],
    (dict(threads=-1), r"threads"), (dict(threads=2.0), r"threads"),
])
def test_bad_args(ckpt, kw, match):
    with pytest.raises(ValueError, match=match):
        sapwood.load(ckpt, **kw)


class FakeEngine:  # records what load passes: (dims, weights, weights_format, kv, max_context, threads)
    def __init__(self, *args):
        self.args, self.position = args, 0


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(sapwood._core, "Engine", FakeEngine, raising=False)


def test_engine_dims():
    d = engine_dims(ModelConfig.from_dict({"model_type": "qwen3_5_text", "num_hidden_layers": 8, "head_dim": 64}))
    assert set(d) == set("vocab_size hidden_size intermediate_size layer_is_attention num_heads num_kv_heads "
                         "head_dim rotary_dim rope_theta rms_norm_eps tie_word_embeddings hk dk hv dv "
                         "conv_kernel head_order".split())
    assert d["layer_is_attention"] == [False, False, False, True] * 2
    assert d["rotary_dim"] == 16 and d["head_order"] == "grouped"
    assert isinstance(d["rope_theta"], float) and isinstance(d["rms_norm_eps"], float)


def test_load_hands_engine_contract(ckpt, fake_engine):
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 20}))
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": "{{ messages }}"}))
    m = sapwood.load(ckpt, weights="q4", kv="f32", max_context=128)
    dims, weights, *rest = m.engine.args
    assert dims == engine_dims(m.config) and rest == ["q4", "f32", 128, 0, "cpu"]  # threads None -> 0; auto -> cpu here
    assert list(weights) == list(expected_shapes(m.config))
    for n, x in weights.items():
        assert x.dtype == np.float32 and x.flags.c_contiguous, n
    assert m.generation_config == {"temperature": 0.7, "top_k": 20}
    assert m.chat_template == "{{ messages }}" and "hidden=64, vocab=256, weights=q4" in repr(m)
    assert m.decode(m.encode(text := "<|im_start|>user\nhello, world<|im_end|>")) == text
    (ckpt / "chat_template.jinja").write_text("jinja wins")
    m = sapwood.load(ckpt, threads=3)
    assert m.chat_template == "jinja wins" and m.engine.args[5] == 3
    for f in ("tokenizer.json", "generation_config.json"):  # both optional
        (ckpt / f).unlink()
    m = sapwood.load(ckpt)
    assert m.tokenizer is None and m.generation_config == {}
    with pytest.raises(RuntimeError, match="no tokenizer"):
        m.encode("hi")


def test_tokenizer_larger_than_vocab(ckpt):
    tok = make_tokenizer(320)
    assert tok.get_vocab_size(with_added_tokens=True) > 256
    tok.save(str(ckpt / "tokenizer.json"))
    with pytest.raises(ValueError, match="vocab_size=256"):
        read_checkpoint(ckpt)


@needs_engine
@pytest.mark.parametrize("variant", ["f32", "bf16", "tied", "sharded"])
def test_load_tiny(tmp_path, variant):
    d = tmp_path / "m"
    src = tmp_path / ("single" if variant == "sharded" else "m")
    make_tiny_checkpoint(src, seed=2, tied=variant == "tied", dtype="bfloat16" if variant == "bf16" else "float32")
    if variant == "sharded":
        shard(src, d)
    m = sapwood.load(d, threads=1, max_context=256)
    assert isinstance(m, sapwood.Model) and m.engine.position == 0
    assert m.config.vocab_size == 256 and m.config.tie_word_embeddings == (variant == "tied")
    ids = m.encode(text := "The quick brown fox <|im_end|> 0123")
    assert all(0 <= i < 256 for i in ids) and m.decode(ids) == text
    assert "layers=4 (3 GDN + 1 attention)" in repr(m)


@needs_engine
@pytest.mark.parametrize("weights", ["f32", "bf16", "q8", "q4"])
@pytest.mark.parametrize("kv", ["int8", "f32"])
def test_load_formats(tiny_dir, weights, kv):
    m = sapwood.load(tiny_dir, weights=weights, kv=kv, max_context=64)
    assert m.engine.position == 0 and (m.weights, m.kv) == (weights, kv)
