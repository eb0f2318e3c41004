"""Tiny random HF-format checkpoints for tests (numpy + safetensors + tokenizers; no torch).

`make_tiny_checkpoint` writes config.json (`qwen3_5_text`, loadable by transformers'
Qwen3_5ForCausalLM), model.safetensors and a byte-level BPE tokenizer.json. Weights are random
with non-identity norms, dt_bias and A_log, so a wrong norm convention or gate shows up in logits.
Everything is a function of the arguments and the seed: no downloads, no global RNG.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import HEAD_ORDER_KEY, ModelConfig, expected_shapes

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# Bytes that never occur in UTF-8 text (C0, C1, F5..FF): a byte-level tokenizer of Python str
# never needs them, so 243 byte tokens + the specials fit in a 256-token vocabulary.
_NON_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens and the "
    "target model verifies a whole tree of them in one step, then keeps the longest path it "
    "agrees with. The state of a linear attention layer is a small matrix per head; the state "
    "of a full attention layer is the cache of keys and values of every token before it. "
    "def main():\n    print('hello, world')\n    return 0\n"
    "In the beginning there was the token, and the token was with the model. 0123456789 "
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, as the ByteLevel pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _train_merges(n_merges: int) -> list[tuple[str, str]]:
    """Deterministic tiny BPE training on _CORPUS: most frequent pair, ties by string order."""
    from tokenizers.pre_tokenizers import ByteLevel

    words = [list(w) for w, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS)]
    merges = []
    while len(merges) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        merges.append(best)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [w[i] + w[i + 1]]
                i += 1
    return merges


# Qwen3.5's markup tokens, for checkpoints that test thinking and tool calls (special_tokens=)
QWEN_MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def make_tokenizer(vocab: int, special_tokens=()):
    """Byte-level BPE with ids < vocab: byte tokens, then the special tokens (EOS, im_start,
    im_end, then `special_tokens`), then merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    table = [b2u[b] for b in range(256) if b not in _NON_UTF8]
    specials = SPECIAL_TOKENS + tuple(special_tokens)
    n_base = len(table) + len(specials)
    if vocab < n_base:
        raise ValueError(f"vocab={vocab} is too small for the tokenizer (needs >= {n_base})")
    ids = {tok: i for i, tok in enumerate(table + list(specials))}
    merges = _train_merges(vocab - n_base)
    for i, (a, b) in enumerate(merges):
        ids[a + b] = n_base + i
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # the specials are in the model vocab (ids 243..245), so marking them special keeps their ids
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert tok.token_to_id(specials[-1]) == n_base - 1 and tok.get_vocab_size() <= vocab
    return tok


def to_tiled_order(weights: dict, config: dict) -> dict:
    """Permute the GDN value heads of grouped-order weights into tiled order.

    Grouped head h = kh * r + m (r = Hv/Hk) reads key head kh; it moves to tiled slot
    j = m * Hk + kh, which reads key head j % Hk = kh. Value-head-indexed tensors move with it:
    the v rows of in_proj_qkv and conv1d, in_proj_z rows, in_proj_b/a rows, dt_bias, A_log and
    the out_proj columns. The model computes the same function in either order.
    """
    cfg = ModelConfig.from_dict(config)
    hk, hv, dk, dv = cfg.hk, cfg.hv, cfg.dk, cfg.dv
    r = hv // hk
    src = np.array([(j % hk) * r + j // hk for j in range(hv)])      # tiled slot j <- grouped head
    rows = (src[:, None] * dv + np.arange(dv)).reshape(-1)             # per-channel, for [Hv*dv]
    vrows = np.concatenate([np.arange(2 * hk * dk), 2 * hk * dk + rows])
    out = dict(weights)
    for i, kind in enumerate(cfg.layer_types):
        if kind != "linear_attention":
            continue
        p = f"model.layers.{i}.linear_attn."
        for n in ("in_proj_qkv.weight", "conv1d.weight"):
            out[p + n] = weights[p + n][vrows]
        out[p + "in_proj_z.weight"] = weights[p + "in_proj_z.weight"][rows]
        for n in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
            out[p + n] = weights[p + n][src]
        out[p + "out_proj.weight"] = np.ascontiguousarray(weights[p + "out_proj.weight"][:, rows])
    return out


def init_rule(name: str, shape, embed_std: float = 1.0) -> tuple[str, float, float]:
    """How a text-model (or MTP head) tensor of this name is drawn: ("normal", offset, std), the
    value offset + N(0, std), or ("log_uniform", lo, hi), the value log(U(lo, hi)).

    Norm weights are not identity and dt_bias/A_log not HF's init, so a wrong norm convention or
    gate shows up in logits. Shared by `_random_weights` and `sapwood.checkpoints`.
    """
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if leaf == "embed_tokens":
        return "normal", 0.0, embed_std
    if name.endswith("linear_attn.norm.weight"):  # gated norm: plain w, so around 1
        return "normal", 1.0, 0.2
    if leaf.endswith("norm") or leaf.endswith("layernorm"):  # zero-centred: (1 + w)
        return "normal", 0.0, 0.2
    if leaf == "dt_bias":
        return "normal", 0.0, 0.5
    if leaf == "A_log":  # decay rate exp(A_log) in [0.2, 2]
        return "log_uniform", 0.2, 2.0
    # conv1d [C, 1, K] and Linear [out, in]: 1 / sqrt(fan_in) along the last axis
    return "normal", 0.0, shape[-1] ** -0.5


def _random_weights(config: dict, seed: int, shapes: dict | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {}
    shapes = expected_shapes(ModelConfig.from_dict(config)) if shapes is None else shapes
    for name, shape in shapes.items():
        kind, a, b = init_rule(name, shape)
        if kind == "log_uniform":
            x = np.log(rng.uniform(a, b, shape))
        else:
            x = rng.normal(0.0, b, shape)
            if a:
                x = a + x
        w[name] = x.astype(np.float32)
    return w


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16, little-endian), rounding to nearest even (no
    NaNs expected: random weights have none). uint32 arithmetic: the sum wraps exactly where a
    wider sum's top 16 bits would be cut by the uint16 cast, so nothing is lost."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = (u >> 16) & 1
    r += u
    r += 0x7FFF
    r >>= 16
    return r.astype("<u2")


def save_bf16(weights: dict, filename, metadata: dict) -> None:
    """Write a bfloat16 safetensors file by hand (numpy has no bfloat16): an 8-byte little-endian
    header length, a JSON header of dtype/shape/byte offsets, then the data. float32 -> bf16
    rounds to nearest even (no NaNs in random weights)."""
    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name in sorted(weights):
        x = np.ascontiguousarray(weights[name], np.float32)
        blob = f32_to_bf16_bits(x).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    with open(filename, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def random_lattice(rows: int, k: int, seed: int, vocab: int):
    """A drafter's lattice of `rows` rows, each k distinct candidates below `vocab` with
    descending probabilities (a Dirichlet draw): what trees and the policy are tested on."""
    from .drafters import Lattice

    rng = np.random.default_rng(seed)
    lat = Lattice()
    for _ in range(rows):
        p = np.sort(rng.dirichlet(np.ones(k)))[::-1]
        lat.tokens.append(rng.choice(vocab, k, replace=False))
        lat.logprobs.append(np.log(p))
    return lat


def make_tiny_checkpoint(path, *, seed=0, vocab=256, hidden=64, layers=4, tied=False, hk=2, hv=4,
                         dk=16, dv=16, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=128,
                         conv_kernel=4, head_order="grouped", dtype="float32", layer_types=None,
                         mtp=False, layout="plain", special_tokens=()) -> dict:
    """Write an HF-format Qwen3_5ForCausalLM directory at `path`; return its config dict.

    mtp=True adds a multi-token-prediction head (`mtp.*`, random, one layer; config
    mtp_num_hidden_layers=1) without changing the target's weights. layout="multimodal" writes
    the Qwen3_5ForConditionalGeneration layout: config `qwen3_5` with the text config nested,
    the target's tensors under `model.language_model.*`, `mtp.*` at the top level (the
    returned dict is the text config either way).

    head_order "tiled" writes the same model (same seed -> same function) with the GDN value
    heads permuted (see to_tiled_order) and `sapwood_gdn_head_order: "tiled"` in config.json;
    transformers knows only grouped order, so only the sapwood references can run it.
    dtype: "float32", "float16" or "bfloat16" (written by hand: numpy has no bfloat16).
    layer_types: per layer "linear_attention" or "full_attention" (default: every 4th full).
    special_tokens: more special tokens after EOS, im_start, im_end (e.g. QWEN_MARKUP).
    """
    from safetensors.numpy import save_file

    if head_order not in ("grouped", "tiled"):
        raise ValueError(f"head_order must be 'grouped' or 'tiled', got {head_order!r}")
    if layout not in ("plain", "multimodal"):
        raise ValueError(f"layout must be 'plain' or 'multimodal', got {layout!r}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab, special_tokens)
    rot_half = int(head_dim * 0.25) // 2
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "layer_types": list(layer_types) if layer_types is not None else
                       ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # as real Qwen3.5 configs: nested rope parameters with an MRoPE section (a no-op for text)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True,
                            "mrope_section": [rot_half - 2 * (rot_half // 4), rot_half // 4, rot_half // 4]},
        "linear_conv_kernel_dim": conv_kernel,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "tie_word_embeddings": tied,
        "bos_token_id": None,
        "eos_token_id": tok.token_to_id(EOS_TOKEN),
        "pad_token_id": None,
        "dtype": dtype,
        "use_cache": True,
    }
    weights = _random_weights(config, seed)
    if head_order == "tiled":
        config[HEAD_ORDER_KEY] = "tiled"
        weights = to_tiled_order(weights, config)
    if mtp:
        from .config import MTP_CONFIG_KEY, expected_mtp_shapes
        config[MTP_CONFIG_KEY] = 1
        # its own stream: the target's weights stay those of the same seed without a head
        weights.update(_random_weights(config, seed + 7919, expected_mtp_shapes(ModelConfig.from_dict(config))))
    on_disk = config
    if layout == "multimodal":
        weights = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: x
                   for n, x in weights.items()}
        on_disk = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "text_config": config, "tie_word_embeddings": tied}
    (path / "config.json").write_text(json.dumps(on_disk, indent=2) + "\n")
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if dtype == "bfloat16":
        save_bf16(weights, path / "model.safetensors", meta)
    else:  # save_file writes raw memory: arrays must be C-contiguous
        save_file({n: np.ascontiguousarray(x, dtype) for n, x in weights.items()},
                  str(path / "model.safetensors"), metadata=meta)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "model_max_length": 4096}, indent=2) + "\n")
    return config
