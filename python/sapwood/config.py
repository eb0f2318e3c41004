"""The model's configuration as the runtime reads it: Qwen3.5's config.json (the text model's
keys, with the bounds the engine holds), the tensors a checkpoint must hold, by HF name and shape,
and the MTP head's. The numpy references (reference/) and the loader both read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

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
    head's tensors: mtp_tensors below).
    """
    out = {}
    for name, w in weights.items():
        if name.startswith(("mtp.", "model.visual.", "model.mtp.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = w
    return out


MTP_CONFIG_KEY = "mtp_num_hidden_layers"


def expected_mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head of cfg.mtp_layers layers, by checkpoint name, with its shape."""
    H = cfg.hidden_size
    s = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
         "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    layer = expected_shapes(replace(cfg, layer_types=(FULL,)))  # one full-attention layer
    for j in range(cfg.mtp_layers):
        for name, shape in layer.items():
            if name.startswith("model.layers.0."):
                s[f"mtp.layers.{j}." + name[len("model.layers.0."):]] = shape
    return s


def mtp_tensors(weights: dict) -> dict:
    """The head's tensors of a checkpoint's {name: array} (`mtp.*`; `model.mtp.*` as `mtp.*`)."""
    out = {}
    for name, w in weights.items():
        if name.startswith("model.mtp."):
            name = name[len("model."):]
        if name.startswith("mtp."):
            out[name] = w
    return out


def check_mtp_tensors(cfg: ModelConfig, tensors: dict) -> None:
    """ValueError naming the first missing, unexpected or misshapen tensor of the head."""
    shapes = expected_mtp_shapes(cfg)
    said = f"(config says {MTP_CONFIG_KEY}={cfg.mtp_layers})"
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise ValueError(f"missing MTP tensor {missing[0]!r} {said}"
                         + (f"; {len(missing)} missing in all" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ValueError(f"unexpected MTP tensor {extra[0]!r} {said}"
                         + (f"; {len(extra)} in all" if len(extra) > 1 else ""))
    for name, shape in shapes.items():
        got = tuple(getattr(tensors[name], "shape", np.shape(tensors[name])))  # arrays or TensorInfo
        if got != shape:
            raise ValueError(f"MTP tensor {name!r} has shape {got}, "
                             f"expected {shape}")
