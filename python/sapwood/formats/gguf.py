"""GGUF files as llama.cpp's convert_hf_to_gguf.py writes Qwen3.5 (architecture `qwen35`),
read with the `gguf` package's GGUFReader: one file holding the metadata, the tokenizer and
every tensor, quantized or not.

What the converter does to a Qwen3.5 checkpoint, undone here (conversion/qwen.py,
Qwen3NextModel / _LinearAttentionVReorderBase / _QwenMtpMixin):
- names: `model.layers.{i}.linear_attn.in_proj_qkv` -> `blk.{i}.attn_qkv` etc. (GGUF_NAMES);
  the MTP head becomes block `num_hidden_layers` (`blk.{n}.nextn.eh_proj` for `mtp.fc`, ...);
- the zero-centred RMSNorm weights are stored plus one (every `*norm.weight` but the GDN
  gated norm): minus one here, exact for weights of magnitude >= 2^-16 from a bf16 source;
- A_log is stored as -exp(A_log) (`ssm_a`, rounded to float32 by the converter): read back
  as log(-ssm_a) in float64, rounded to float32: within 2^-23 plus an ulp of the source's
  A_log (the stored exp's rounding becomes an absolute error of its relative size);
- the conv1d weight [C, 1, K] is squeezed to [C, K]: the same bytes, read as [C, 1, K];
- with fewer key than value heads the value heads are permuted from HF's grouped order to a
  tiled one (value head h reads key head h % Hk): the engine runs tiled order as it is
  (config.HEAD_ORDER_KEY), so nothing is moved back.

Values: F32, F16 and BF16 tensors widen exactly. Block-quantized ones (Q8_0, Q4_0, Q4_K,
Q5_K, Q6_K, ...) are dequantized once, a chunk of rows at a time, by gguf.quants.dequantize
(llama.cpp's reference dequantization, in numpy) to float32 for an f32 or bf16 load.
Q4_0, Q4_1 and Q4_K (AS_STORED) run as stored in q8 and q4 loads: the engine's affine groups
of 32 (QMatrix q4a, weight = scale * q + bias) hold them without loss. Q4_0: scale d, bias -8d;
Q4_1: d and m; Q4_K: per 32-input sub-block d * sc and -(dmin * m) (an f16 times a 6-bit
integer: exact in float32), its nibbles moved from the block's order (a 64-input chunk's low
nibbles are one sub-block, its high nibbles the next) to the engine's. scale * q + bias then
rounds once where gguf-py's d * q - dm does, to the same float32. The other block types
(Q8_0: a scale per 32 inputs where QMatrix's int8 rows have one per row; Q5_K, Q6_K, ...) are
rounded a second time by a q8 or q4 load, which says so; f32 keeps them.

The tokenizer stored in the file (tokenizer.ggml.model "gpt2": byte-level BPE, its tokens,
merges and token types) is rebuilt as a tokenizers.Tokenizer with the pre-tokenizer
`tokenizer.ggml.pre` names (qwen35, qwen2, gpt-2); another one loads the model without a
tokenizer, with a warning (token ids in, ids out).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..safetensors_io import TensorInfo, TensorReader
from .common import _bf16_bits, pack_q4_affine

MAGIC = b"GGUF"
ARCH = "qwen35"
# HF suffix (after "model.layers.{i}.") -> GGUF suffix (after "blk.{i}."); True: stored plus one
LAYER_NAMES = {
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
GLOBAL_NAMES = {
    "model.embed_tokens.weight": ("token_embd.weight", False),
    "lm_head.weight": ("output.weight", False),
    "model.norm.weight": ("output_norm.weight", True),
}
MTP_NAMES = {  # after "mtp." / "blk.{n}.nextn."
    "fc.weight": ("eh_proj.weight", False),
    "pre_fc_norm_embedding.weight": ("enorm.weight", True),
    "pre_fc_norm_hidden.weight": ("hnorm.weight", True),
    "norm.weight": ("shared_head_norm.weight", True),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
# Pre-tokenizer splits (tokenizer.ggml.pre): Qwen3.5's (checkpoints._PRETOKENIZE_REGEX) and
# Qwen2's (transformers' Qwen2Tokenizer; Qwen3 too).
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


AS_STORED = ("Q4_0", "Q4_1", "Q4_K")  # the block types a quantized load keeps as stored


def is_gguf(path) -> bool:
    """A file that starts with GGUF's magic."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file under its HF name and shape, read as float32 rows."""
    name: str
    gguf_name: str
    qtype: str           # GGMLQuantizationType name: F32, Q8_0, Q4_K, ...
    path: Path
    shape: tuple         # the HF shape
    offset: int          # absolute, in path
    nbytes: int
    minus: float = 0.0   # RMSNorm weights stored plus one
    neg_exp: bool = False  # A_log stored as -exp(A_log)

    dtype = "F32"

    @property
    def q4_group(self) -> int:
        """32 for the block types the engine's affine groups of 32 hold as stored (Q4_0, Q4_1,
        Q4_K: AS_STORED), in a matrix whose rows are whole runs of 64; else 0."""
        plain = not self.minus and not self.neg_exp
        return 32 if self.qtype in AS_STORED and len(self.shape) == 2 and self.shape[1] % 64 == 0 and plain else 0

    def q4_affine_rows(self, reader: TensorReader, r0: int, r1: int):
        """Rows [r0, r1) of a Q4_0 / Q4_1 / Q4_K tensor as the engine's affine groups of 32
        (common.pack_q4_affine): per 32 inputs a scale s and bias b with s * q + b equal to
        gguf-py's dequantization bit for bit (see AS_STORED)."""
        import gguf
        n = r1 - r0
        info = TensorInfo(self.path, "U8", (self.shape[0], self.row_bytes), self.offset, self.nbytes)
        raw = reader.rows(info, r0, r1).reshape(n, self.row_bytes)
        if self.qtype == "Q4_K":
            blocks = raw.reshape(-1, 144)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
            s = d * sc.astype(np.float32)          # [blocks, 8]: exact (11 x 6 bits)
            b = -(dmin * m.astype(np.float32))     # exact
            qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        else:  # Q4_0 [d, qs[16]], Q4_1 [d, m, qs[16]]: byte j holds input j low, j + 16 high
            size = 18 if self.qtype == "Q4_0" else 20
            blocks = raw.reshape(-1, size)
            s = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            b = (-8 * s if self.qtype == "Q4_0"    # exact
                 else blocks[:, 2:4].copy().view(np.float16).astype(np.float32))
            qs = blocks[:, size - 16:].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(n, -1)
        return pack_q4_affine(q, s.reshape(n, -1), b.reshape(n, -1), 32)

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape[0] else 0

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        import gguf
        n = r1 - r0
        info = TensorInfo(self.path, "U8", (self.shape[0], self.row_bytes), self.offset, self.nbytes)
        raw = reader.rows(info, r0, r1)  # the reader's buffer: every branch below copies
        if self.qtype == "F32":
            x = raw.view("<f4").astype(np.float32)
        elif self.qtype == "F16":
            x = raw.view("<f2").astype(np.float32)
        elif self.qtype == "BF16":
            x = _bf16_bits(raw.view("<u2"))
        else:
            qt = gguf.GGMLQuantizationType[self.qtype]
            x = gguf.quants.dequantize(raw.reshape(n, self.row_bytes), qt).astype(np.float32)
        x = x.reshape(-1)
        if self.neg_exp:
            with np.errstate(divide="ignore", invalid="ignore"):  # NaN/inf: the engine names it
                x = np.log(-x.astype(np.float64)).astype(np.float32)
        if self.minus:
            x = x - np.float32(self.minus)
        return x


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _need(reader, key: str, path: Path):
    v = _field(reader, key)
    if v is None:
        raise ValueError(f"{path}: GGUF metadata has no {key!r} (not a file llama.cpp's "
                         "converter wrote for Qwen3.5?)")
    return v


def _f32_decimal(x) -> float:
    """A float32 of the metadata as the shortest decimal that reads back as it (1e-06, as
    config.json wrote it, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def gguf_config(reader, path: Path, names: set) -> dict:
    """The file's qwen35.* metadata as the HF config.json (qwen3_5_text) it came from."""
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        hint = {"qwen35moe": ": Qwen3.5 MoE is not supported",
                "qwen3next": ": Qwen3-Next is not supported"}.get(arch, "")
        raise ValueError(f"{path}: general.architecture={arch!r}: sapwood reads Qwen3.5 "
                         f"({ARCH!r}) GGUF files{hint}")
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{path}: one of {_field(reader, 'split.count')} split GGUF files: "
                         "merge them first (llama-gguf-split --merge)")
    k = lambda key: _need(reader, f"{ARCH}.{key}", path)  # noqa: E731
    blocks, mtp = int(k("block_count")), int(_field(reader, f"{ARCH}.nextn_predict_layers") or 0)
    n = blocks - mtp
    if n <= 0:
        raise ValueError(f"{path}: block_count={blocks} with nextn_predict_layers={mtp}")
    rec = _field(reader, f"{ARCH}.attention.recurrent_layers")
    if rec is not None:
        types = ["linear_attention" if r else "full_attention" for r in list(rec)[:n]]
    else:
        interval = int(_field(reader, f"{ARCH}.full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n)]
    head_dim = int(k("attention.key_length"))
    if int(_field(reader, f"{ARCH}.attention.value_length") or head_dim) != head_dim:
        raise ValueError(f"{path}: attention key_length {head_dim} != value_length "
                         f"{_field(reader, f'{ARCH}.attention.value_length')}")
    hv, inner = int(k("ssm.time_step_rank")), int(k("ssm.inner_size"))
    if hv <= 0 or inner % hv:
        raise ValueError(f"{path}: ssm.inner_size={inner} is not a multiple of "
                         f"ssm.time_step_rank={hv} (value heads)")
    rope_dim = int(_field(reader, f"{ARCH}.rope.dimension_count") or head_dim // 4)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise ValueError(f"{path}: no 2-D 'token_embd.weight' tensor")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": int(embd.shape[1]),  # GGUF lists ne0 (the hidden size) first
        "hidden_size": int(k("embedding_length")), "intermediate_size": int(k("feed_forward_length")),
        "num_hidden_layers": n, "layer_types": types,
        "num_attention_heads": int(k("attention.head_count")),
        "num_key_value_heads": int(k("attention.head_count_kv")), "head_dim": head_dim,
        "rms_norm_eps": _f32_decimal(k("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32_decimal(k("rope.freq_base")),
                            "partial_rotary_factor": rope_dim / head_dim},
        "linear_conv_kernel_dim": int(k("ssm.conv_kernel")),
        "linear_key_head_dim": int(k("ssm.state_size")),
        "linear_num_key_heads": int(k("ssm.group_count")),
        "linear_num_value_heads": hv, "linear_value_head_dim": inner // hv,
        "tie_word_embeddings": "output.weight" not in names,
        "mtp_num_hidden_layers": mtp,
        # the converter stores the value heads tiled when there are fewer key heads
        "sapwood_gdn_head_order": "tiled",
    }
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    return cfg


def _hf_names(cfg: dict) -> dict:
    """GGUF name -> (HF name, stored plus one) for every tensor this config reads."""
    out = {}
    for g, (gg, plus) in GLOBAL_NAMES.items():
        out[gg] = (g, plus)
    n = cfg["num_hidden_layers"]
    for i in range(n + cfg["mtp_num_hidden_layers"]):
        hf = f"model.layers.{i}." if i < n else f"mtp.layers.{i - n}."
        for h, (gg, plus) in LAYER_NAMES.items():
            out[f"blk.{i}.{gg}"] = (hf + h, plus)
        if i == n:  # the head's own tensors, once (the converter puts them in its first block)
            for h, (gg, plus) in MTP_NAMES.items():
                out[f"blk.{i}.nextn.{gg}"] = ("mtp." + h, plus)
    return out


def gguf_view(reader, path: Path, cfg: dict) -> dict:
    """{HF name: GgufTensor} of every tensor in the file (ValueError for one sapwood does not
    know, named; for a shape that is not the one its HF tensor has, check_tensors names it)."""
    names = _hf_names(cfg)
    out = {}
    for t in reader.tensors:
        if t.name not in names:
            raise ValueError(f"{path}: GGUF tensor {t.name!r} is not one sapwood reads "
                             f"({ARCH}: names of llama.cpp's converter)")
        hf, plus = names[t.name]
        shape = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF lists ne0 (columns) first
        qtype = t.tensor_type.name
        if hf.endswith("conv1d.weight"):
            if len(shape) != 2:
                raise ValueError(f"{path}: {t.name!r} has shape {list(shape)}: expected [C, K]")
            shape = (shape[0], 1, shape[1])
        if len(shape) > 1 and shape[0] and int(t.n_bytes) % shape[0]:
            raise ValueError(f"{path}: {t.name!r}: {int(t.n_bytes)} bytes for {shape[0]} rows")
        if not shape or (len(shape) == 1 and qtype not in FLOAT_TYPES):
            raise ValueError(f"{path}: {t.name!r} is {qtype}{list(shape)}: vectors are read "
                             "in F32, F16 or BF16")
        out[hf] = GgufTensor(hf, t.name, qtype, path, shape, int(t.data_offset), int(t.n_bytes),
                             1.0 if plus else 0.0, hf.endswith("A_log"))
    return out


def gguf_tokenizer(reader, path: Path):
    """A tokenizers.Tokenizer from the file's gpt2-style BPE vocabulary, or None (with a
    warning) for a tokenizer model or pre-tokenizer it does not rebuild."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    model, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre")
    if model is None:
        return None
    if model != "gpt2" or pre not in ("qwen35", "qwen2", "gpt-2", "default"):
        warnings.warn(f"{path}: tokenizer model {model!r} with pre-tokenizer {pre!r} is not "
                      "rebuilt (sapwood rebuilds gpt2-style BPE with the qwen35, qwen2 or gpt-2 "
                      "split): the model loads without a tokenizer, token ids in and out",
                      stacklevel=3)
        return None
    tokens = [str(t) for t in _need(reader, "tokenizer.ggml.tokens", path)]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [str(m) for m in (_field(reader, "tokenizer.ggml.merges") or [])]
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    # 5: unused (llama.cpp's padding to the embedding's rows) -- left out of the vocabulary
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if int(ty) != 5}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: BPE merge {m!r} is not two tokens")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in ("qwen35", "qwen2"):
        from ..checkpoints import _PRETOKENIZE_REGEX
        regex = _PRETOKENIZE_REGEX if pre == "qwen35" else QWEN2_REGEX
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens match whole before the BPE; already in the
    # vocabulary, so they keep their ids
    added = [AddedToken(t, special=int(ty) == 3, normalized=False)
             for t, ty in zip(tokens, types) if int(ty) in (3, 4)]
    tok.add_tokens(added)
    return tok


@dataclass
class GgufFile:
    config: dict                # as config.json
    tensors: dict               # {HF name: GgufTensor}
    tokenizer: object
    chat_template: str | None
    eos: int | None

    @property
    def stored_format(self) -> str | None:
        """The quantized types it holds, most tensors first ("GGUF Q4_K/Q6_K"); None when
        every tensor is F32, F16 or BF16."""
        count = {}
        for t in self.tensors.values():
            if t.quantized:
                count[t.qtype] = count.get(t.qtype, 0) + 1
        if not count:
            return None
        return "GGUF " + "/".join(q for q, _ in sorted(count.items(), key=lambda kv: -kv[1]))


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise ValueError(f"{path}: reading GGUF files needs the `gguf` package "
                         "(pip install gguf)") from None
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # numpy, struct or memmap errors of a corrupt or truncated file
        raise ValueError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None


def gguf_file_config(path) -> dict:
    """The HF config.json of a GGUF file, from its metadata alone (memory.estimate)."""
    path = Path(path)
    reader = _reader(path)
    try:
        return gguf_config(reader, path, {t.name for t in reader.tensors})
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise ValueError(f"{path}: malformed GGUF metadata: {type(e).__name__}: {e}") from None


def read_gguf(path) -> GgufFile:
    """Parse a GGUF file's metadata, tensor table and tokenizer (no tensor data is read)."""
    path = Path(path)
    reader = _reader(path)
    try:
        names = {t.name for t in reader.tensors}
        cfg = gguf_config(reader, path, names)
        tensors = gguf_view(reader, path, cfg)
        tok = gguf_tokenizer(reader, path)
        tmpl = _field(reader, "tokenizer.chat_template")
    except ValueError as e:
        if str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: malformed GGUF metadata: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # a value of the wrong type (a string where a count belongs, ...)
        raise ValueError(f"{path}: malformed GGUF metadata: {type(e).__name__}: {e}") from None
    eos = cfg.get("eos_token_id")
    del reader  # its memory map of the file goes with it
    return GgufFile(cfg, tensors, tok, tmpl if isinstance(tmpl, str) else None, eos)
