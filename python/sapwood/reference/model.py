"""Whole-model numpy reference of HF `Qwen3_5ForCausalLM` (text only), float64.

The executable spec of the model graph. It reuses the GDN recurrence (`gdn.GDNReference`), tree
attention (`tree_attention.tree_attention_naive`) and int8 KV rounding (`kv.roundtrip`), so each
piece of math lives in one place. It speaks the engine contract of DESIGN.md: `verify(tokens,
parents)` scores a tree without changing committed state, `commit(path)` keeps one root-to-leaf
path; `prefill` and `step` are chains built from those two.

Checked against transformers 5.24 `models/qwen3_5/modeling_qwen3_5.py`; where it and DESIGN.md
could be read two ways, transformers wins (notes marked "HF:").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .gdn import GDNReference, silu
from .kv import roundtrip
from .tree import check_parents, check_path, depths
from .tree_attention import int8_queries, tree_attention_naive

LINEAR, FULL = "linear_attention", "full_attention"
SUPPORTED_TYPES = ("qwen3_5_text", "qwen3_5")
UNSUPPORTED_TYPES = {
    "qwen3_next": "Qwen3-Next (fused in_proj_qkvz / in_proj_ba, MoE) is not supported",
    "qwen3_5_moe": "Qwen3.5 MoE is not supported (MoE is out of scope)",
    "qwen3_5_moe_text": "Qwen3.5 MoE is not supported (MoE is out of scope)",
}
# Keys of our own (not HF): how value heads of a GDN layer map to key heads. HF stores "grouped"
# (transformers repeat_interleave's q/k: value head h reads key head h // (Hv/Hk)); some
# converters (GGUF-style) permute the value heads to "tiled" order (h reads key head h % Hk).
HEAD_ORDER_KEY = "sapwood_gdn_head_order"


_MISSING = object()


# Bounds the engine holds too (csrc/engine.cpp's checked()): a config claiming 10^7 layers is
# refused here, before anything is sized from it, not after gigabytes of tables were built.
MAX_DIM = 1 << 24
MAX_LAYERS = 4096


def _int_key(c: dict, key: str, default, lo: int = 1, hi: int = MAX_DIM) -> int:
    """config[key] as an int in [lo, hi]: a JSON integer only (not a bool, a float or a string,
    which int() would have truncated or parsed)."""
    v = c.get(key, _MISSING)
    if v is _MISSING or (v is None and default is not None):
        return default
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"config.json: {key}={v!r}: must be an integer in [{lo}, {hi}]")
    return v


def _float_key(c: dict, key: str, default, lo: float = 0.0, hi: float = math.inf,
               hi_inclusive: bool = False) -> float:
    """config[key] as a finite number in (lo, hi) (hi included where asked)."""
    v = c.get(key, _MISSING)
    if v is _MISSING:
        return default
    ok = type(v) in (int, float) and math.isfinite(v) and v > lo and (v <= hi if hi_inclusive else v < hi)
    if not ok:
        upper = f"<= {hi}" if hi_inclusive else f"< {hi}"
        raise ValueError(f"config.json: {key}={v!r}: must be a finite number > {lo}"
                         + ("" if hi == math.inf else f" and {upper}"))
    return float(v)


def _bool_key(c: dict, key: str, default: bool) -> bool:
    v = c.get(key, default)
    if type(v) is not bool:  # "false" is truthy: reading it as a bool would flip its meaning
        raise ValueError(f"config.json: {key}={v!r}: must be true or false")
    return v


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int          # full attention query heads
    num_kv_heads: int
    head_dim: int
    rotary_dim: int         # int(head_dim * partial_rotary_factor), the rotated leading dims
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    hk: int                 # GDN key heads, key head dim, value heads, value head dim
    dk: int
    hv: int
    dv: int
    conv_kernel: int
    head_order: str = "grouped"
    eos_token_ids: tuple[int, ...] = ()
    mtp_layers: int = 0     # mtp_num_hidden_layers: the checkpoint's MTP head (reference/mtp.py)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @classmethod
    def from_dict(cls, config: dict) -> "ModelConfig":
        """Parse an HF config.json dict (`qwen3_5_text`, or `qwen3_5` with a nested text_config).

        Missing fields take Qwen3_5TextConfig's defaults, as transformers would.
        """
        mt = config.get("model_type")
        if not isinstance(mt, str):
            raise ValueError(f"config.json: model_type={mt!r}: must be a string; supported: "
                             f"{', '.join(SUPPORTED_TYPES)}")
        if mt in UNSUPPORTED_TYPES:
            raise ValueError(f"model_type {mt!r}: {UNSUPPORTED_TYPES[mt]}")
        if mt not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_TYPES)}")
        c = config
        # A multimodal config nests the text model in text_config; some converters write
        # model_type qwen3_5 over a flat text config, which is read as it is, not as defaults.
        if "text_config" in config:
            c = config.get("text_config") or {}
            if not isinstance(c, dict):
                raise ValueError(f"config.json: text_config={c!r}: must be an object")
            c = dict(c)
            if str(c.get("model_type", "qwen3_5_text")) in UNSUPPORTED_TYPES:
                return cls.from_dict(c)
            # the top level holds tie_word_embeddings for the composite model; the text one wins
            c.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        if "num_experts" in c or "moe_intermediate_size" in c:
            raise ValueError("MoE text config (num_experts / moe_intermediate_size) is not supported")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only silu)")
        if _bool_key(c, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported")

        n_layers = _int_key(c, "num_hidden_layers", 32, hi=MAX_LAYERS)
        types = c.get("layer_types")
        if types is None:  # HF: full iff (i+1) % full_attention_interval == 0
            interval = _int_key(c, "full_attention_interval", 4)
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(types, (list, tuple)):
            raise ValueError(f"config.json: layer_types={types!r}: must be a list")
        types = tuple(types)
        if len(types) != n_layers or any(t not in (LINEAR, FULL) for t in types):
            raise ValueError(f"layer_types {types} must be {n_layers} of {LINEAR!r}/{FULL!r}")

        # HF rope priority: rope_parameters (alias rope_scaling) > top-level keys > defaults.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: rope_parameters={rope!r}: must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only default)")
        theta = _float_key(rope, "rope_theta", _float_key(c, "rope_theta", 10000.0))
        prf = _float_key(rope, "partial_rotary_factor",
                         _float_key(c, "partial_rotary_factor", 0.25, hi=1.0, hi_inclusive=True),
                         hi=1.0, hi_inclusive=True)
        head_dim = _int_key(c, "head_dim", 256)  # HF default 256 (also for null), not hidden/heads

        hk, hv = _int_key(c, "linear_num_key_heads", 16), _int_key(c, "linear_num_value_heads", 32)
        if hv % hk:
            raise ValueError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
        nh, nkv = _int_key(c, "num_attention_heads", 16), _int_key(c, "num_key_value_heads", 4)
        if nh % nkv:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
        order = c.get(HEAD_ORDER_KEY, "grouped")
        if order not in ("grouped", "tiled"):
            raise ValueError(f"{HEAD_ORDER_KEY} must be 'grouped' or 'tiled', got {order!r}")
        eos = c.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        if any(type(e) is not int or e < 0 for e in eos):
            raise ValueError(f"config.json: eos_token_id={c.get('eos_token_id')!r}: must be a "
                             "token id or a list of them")
        return cls(
            vocab_size=_int_key(c, "vocab_size", 248320), hidden_size=_int_key(c, "hidden_size", 4096),
            intermediate_size=_int_key(c, "intermediate_size", 12288), layer_types=types,
            num_heads=nh, num_kv_heads=nkv, head_dim=head_dim, rotary_dim=int(head_dim * prf),
            rope_theta=theta, rms_norm_eps=_float_key(c, "rms_norm_eps", 1e-6),
            tie_word_embeddings=_bool_key(c, "tie_word_embeddings", False),
            hk=hk, dk=_int_key(c, "linear_key_head_dim", 128), hv=hv,
            dv=_int_key(c, "linear_value_head_dim", 128),
            conv_kernel=_int_key(c, "linear_conv_kernel_dim", 4),
            head_order=order, eos_token_ids=eos,
            mtp_layers=_int_key(c if "mtp_num_hidden_layers" in c else config, "mtp_num_hidden_layers", 0, lo=0, hi=MAX_LAYERS))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by HF name, with its shape (lm_head absent when tied)."""
    H, D = cfg.hidden_size, cfg.head_dim
    s = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, H)
        s[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, H)
        s[p + "mlp.down_proj.weight"] = (H, cfg.intermediate_size)
        if kind == LINEAR:
            a = p + "linear_attn."
            s[a + "in_proj_qkv.weight"] = (cfg.conv_dim, H)
            s[a + "in_proj_z.weight"] = (cfg.hv * cfg.dv, H)
            s[a + "in_proj_b.weight"] = (cfg.hv, H)
            s[a + "in_proj_a.weight"] = (cfg.hv, H)
            s[a + "conv1d.weight"] = (cfg.conv_dim, 1, cfg.conv_kernel)
            s[a + "dt_bias"] = (cfg.hv,)
            s[a + "A_log"] = (cfg.hv,)
            s[a + "norm.weight"] = (cfg.dv,)  # one gated-norm weight shared by all value heads
            s[a + "out_proj.weight"] = (H, cfg.hv * cfg.dv)
        else:
            a = p + "self_attn."
            s[a + "q_proj.weight"] = (2 * cfg.num_heads * D, H)  # per head [q | gate]
            s[a + "k_proj.weight"] = (cfg.num_kv_heads * D, H)
            s[a + "v_proj.weight"] = (cfg.num_kv_heads * D, H)
            s[a + "o_proj.weight"] = (H, cfg.num_heads * D)
            s[a + "q_norm.weight"] = (D,)
            s[a + "k_norm.weight"] = (D,)
    return s


def normalize_names(weights: dict) -> dict:
    """Map composite-checkpoint names onto ForCausalLM names; drop what the text model ignores.

    HF: Qwen3_5ForConditionalGeneration stores `model.language_model.*`; `mtp.*` (multi-token
    prediction heads) and `model.visual.*` are ignored by Qwen3_5ForCausalLM on load (the MTP
    head's tensors: reference.mtp.mtp_tensors).
    """
    out = {}
    for name, w in weights.items():
        if name.startswith(("mtp.", "model.visual.", "model.mtp.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = w
    return out


def rms_norm(x, w, eps):
    """Zero-centred RMSNorm (HF Qwen3_5RMSNorm): x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def gated_rms_norm(o, z, w, eps):
    """GDN output norm (HF Qwen3_5RMSNormGated): w * (o * rsqrt(mean(o^2) + eps)) * silu(z).

    Plain `w`, not `1 + w`: this weight is initialised to ones in HF, unlike the others.
    """
    return np.asarray(w, np.float64) * (o / np.sqrt((o * o).mean(-1, keepdims=True) + eps)) * silu(z)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rope(x, pos, rotary_dim, theta):
    """Rotate-half RoPE on the first rotary_dim dims of x [N, heads, D] at positions pos [N].

    HF computes MRoPE with 3 position rows (t, h, w) interleaved by mrope_section; for text all
    three rows are the same position, so it is plain RoPE with inv_freq over rotary_dim.
    """
    inv = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None]             # [N, rotary_dim/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]               # [N, 1, rotary_dim]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    r, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rot = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos + rot * sin, rest], -1)


class ReferenceModel:
    """The model with committed state: per full-attention layer the KV history, per GDN layer a
    GDNReference (state S, conv window, pending tape).

    kv_int8: keys and values go through the int8 round trip (float32, groups of 32 dims) when
    they are computed, so every query, tree nodes included, sees the dequantized values, as in
    the runtime's paged int8 KV cache; the queries go through it too, as the runtime's int8
    scores take them (tree_attention.int8_queries).
    """

    def __init__(self, config: dict | ModelConfig, weights: dict, kv_int8: bool = False,
                 head_order: str | None = None):
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
        if head_order is not None:
            cfg = replace(cfg, head_order=head_order)
        self.cfg, self.kv_int8 = cfg, kv_int8
        w = normalize_names(weights)
        shapes = expected_shapes(cfg)
        if cfg.tie_word_embeddings:
            w.pop("lm_head.weight", None)  # HF ties lm_head to embed_tokens regardless of the file
        missing = [n for n in shapes if n not in w]
        if missing:
            hint = " (untied model without lm_head.weight?)" if missing == ["lm_head.weight"] else ""
            raise ValueError(f"missing weights{hint}: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        unexpected = sorted(set(w) - set(shapes))
        if unexpected:  # e.g. biases or MoE experts: silently ignoring them would be wrong
            raise ValueError(f"unexpected weights: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        for n, shape in shapes.items():
            if tuple(w[n].shape) != shape:
                raise ValueError(f"{n}: shape {tuple(w[n].shape)}, expected {shape}")
        # Kept in their stored dtype; every product with a float64 activation is float64.
        self.w = w
        self.lm_head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        self.reset()

    def reset(self) -> None:
        cfg = self.cfg
        self.length = 0  # committed tokens
        self.gdn: dict[int, GDNReference] = {}
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        empty = np.zeros((0, cfg.num_kv_heads, cfg.head_dim))
        for i, kind in enumerate(cfg.layer_types):
            if kind == LINEAR:
                conv = self.w[f"model.layers.{i}.linear_attn.conv1d.weight"][:, 0, :]  # [C, K]
                self.gdn[i] = GDNReference(cfg.hk, cfg.hv, cfg.dk, cfg.dv, conv, cfg.head_order)
            else:
                self.kv[i] = (empty, empty)
        self._tape = None

    def _lin(self, x, name):
        return x @ self.w[name].T

    def _gdn(self, i, x, parents):
        cfg, p = self.cfg, f"model.layers.{i}.linear_attn."
        n = x.shape[0]
        qkv = self._lin(x, p + "in_proj_qkv.weight")                     # [N, C], pre-conv
        z = self._lin(x, p + "in_proj_z.weight").reshape(n, cfg.hv, cfg.dv)
        beta = sigmoid(self._lin(x, p + "in_proj_b.weight"))
        a = self._lin(x, p + "in_proj_a.weight") + self.w[p + "dt_bias"]
        g = -np.exp(np.asarray(self.w[p + "A_log"], np.float64)) * np.logaddexp(0.0, a)  # softplus
        o = self.gdn[i].verify(qkv, g, beta, parents)                    # [N, Hv, dv]
        o = gated_rms_norm(o, z, self.w[p + "norm.weight"], cfg.rms_norm_eps)
        return self._lin(o.reshape(n, -1), p + "out_proj.weight")

    def _attn(self, i, x, parents, pos):
        cfg, p = self.cfg, f"model.layers.{i}.self_attn."
        n, D = x.shape[0], cfg.head_dim
        # HF: q_proj output viewed as [N, Hq, 2*D] then chunked: per head [q | gate], not
        # all q heads then all gates.
        qg = self._lin(x, p + "q_proj.weight").reshape(n, cfg.num_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, -1)
        q = rms_norm(q, self.w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(self._lin(x, p + "k_proj.weight").reshape(n, cfg.num_kv_heads, D),
                     self.w[p + "k_norm.weight"], cfg.rms_norm_eps)
        v = self._lin(x, p + "v_proj.weight").reshape(n, cfg.num_kv_heads, D)
        q, k = rope(q, pos, cfg.rotary_dim, cfg.rope_theta), rope(k, pos, cfg.rotary_dim, cfg.rope_theta)
        if self.kv_int8:  # what the cache stores is what every query sees, this node's own too
            k = roundtrip(k.astype(np.float32)).astype(np.float64)
            v = roundtrip(v.astype(np.float32)).astype(np.float64)
            q = int8_queries(q.astype(np.float32)).astype(np.float64)
        self._tape[i] = (k, v)
        k_hist, v_hist = self.kv[i]
        # GQA (query head h reads KV head h // (Hq/Hkv), as HF repeat_kv) and scale D^-0.5 live
        # in tree_attention_naive.
        o = tree_attention_naive(q, k_hist, v_hist, k, v, parents).reshape(n, -1)
        return self._lin(o * sigmoid(gate), p + "o_proj.weight")

    def verify(self, tokens, parents) -> np.ndarray:
        """Logits [N, V] for a tree of tokens (node i at position length + depth(i)); the
        committed state is unchanged until commit()."""
        return self.forward(tokens, parents)[1]

    def forward(self, tokens, parents, x=None) -> tuple[np.ndarray, np.ndarray]:
        """verify(), returning (final hidden states after model.norm [N, H], logits [N, V]).
        x [N, H]: the rows that enter the first layer instead of the tokens' embeddings (the
        MTP head feeds its fc output in)."""
        cfg = self.cfg
        tokens = np.asarray(tokens, np.int64)
        pos = self.length + depths(parents)
        if tokens.shape != pos.shape or tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"tokens must be {pos.size} ids in [0, {cfg.vocab_size})")
        self._tape = {"parents": check_parents(parents)}
        if x is None:
            x = np.asarray(self.w["model.embed_tokens.weight"][tokens], np.float64)
        elif np.shape(x) != (tokens.size, cfg.hidden_size):
            raise ValueError(f"x has shape {np.shape(x)}, expected {(tokens.size, cfg.hidden_size)}")
        x = np.asarray(x, np.float64)
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (self._gdn(i, h, parents) if kind == LINEAR else self._attn(i, h, parents, pos))
            y = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._lin(silu(self._lin(y, p + "mlp.gate_proj.weight")) *
                              self._lin(y, p + "mlp.up_proj.weight"), p + "mlp.down_proj.weight")
        x = rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)
        return x, x @ self.lm_head.T

    def commit(self, path) -> None:
        """Commit nodes path = [0, ..., leaf] of the last verify()."""
        if self._tape is None:
            raise RuntimeError("commit() without a verify() before it")
        path = check_path(self._tape["parents"], path)
        for i, kind in enumerate(self.cfg.layer_types):
            if kind == LINEAR:
                self.gdn[i].commit(path)
            else:
                k, v = self._tape[i]
                kh, vh = self.kv[i]
                self.kv[i] = (np.concatenate([kh, k[path]]), np.concatenate([vh, v[path]]))
        self.length += len(path)
        self._tape = None

    def prefill(self, tokens, chunk: int = 32) -> np.ndarray:
        """Commit tokens; logits [T, V]. Chains of `chunk` tokens bound the cost of the
        references' per-node path walks (quadratic in chain length)."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        out = []
        for s in range(0, tokens.size, chunk):
            t = tokens[s:s + chunk]
            out.append(self.verify(t, np.arange(t.size) - 1))
            self.commit(list(range(t.size)))
        return np.concatenate(out) if out else np.zeros((0, self.cfg.vocab_size))

    def step(self, token: int) -> np.ndarray:
        """Plain decoding: verify([t], [-1]) then commit([0]); logits [V]."""
        logits = self.verify([int(token)], [-1])[0]
        self.commit([0])
        return logits
