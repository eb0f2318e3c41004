"""Whole-model numpy reference of HF `Qwen3_5ForCausalLM` (text only), float64.

The executable spec of the model graph. It reuses the GDN recurrence (`gdn.GDNReference`), tree
attention (`tree_attention.tree_attention_naive`) and int8 KV rounding (`kv.roundtrip`), so each
piece of math lives in one place. It speaks the engine contract of docs/design.md: `verify(tokens,
parents)` scores a tree without changing committed state, `commit(path)` keeps one root-to-leaf
path; `prefill` and `step` are chains built from those two.

Checked against transformers 5.24 `models/qwen3_5/modeling_qwen3_5.py`; where it and docs/design.md
could be read two ways, transformers wins (notes marked "HF:").
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..config import LINEAR, ModelConfig, expected_shapes, normalize_names
from .gdn import GDNReference, silu
from .kv import roundtrip
from .tree import check_parents, check_path, depths
from .tree_attention import int8_queries, tree_attention_naive

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
