#!/usr/bin/env python3
"""Train sapwood's bundled default models: a small Qwen3.5-style hybrid target and a draft.

Both are HF `Qwen3_5ForCausalLM` checkpoints (config `qwen3_5_text`) sharing one byte-level BPE
tokenizer, trained from scratch on the Python source of the running interpreter's standard
library. torch is a training-only dependency; the exported checkpoints need none of it.

Stages (each reads what the previous ones wrote into --out):

    corpus     list the stdlib .py files, fixed held-out split      -> corpus.json
    tokenizer  byte-level BPE (vocab 4096) on the train split       -> tokenizer.json, tokens_*.npy
    bench      measure training tokens/s of the target (no output)
    target     train the target (AdamW, cosine, fp32)               -> target/ckpt.pt, target/log.txt
    distill    target continuations of corpus prefixes + top-k     -> distill.pt
    draft      train the draft on the target's distributions        -> draft/ckpt.pt, draft/log.txt
    export     bf16 safetensors + configs + tokenizer               -> python/sapwood/data/default
    check      load the export with transformers, generate a sample
    all        every stage above except bench, in order

    nohup nice -n 10 python3 scripts/train_default.py all --out /work/train_default \\
        > /work/train_default/log.txt 2>&1 &

The training forward (`HybridLM`) is plain torch with the parameter names and shapes of
transformers' Qwen3_5ForCausalLM, so its state_dict is an HF checkpoint: a chunked gated delta
rule (WY/UT form, chunk 64, fp32 matmuls), the causal depthwise conv via F.conv1d, attention via
F.scaled_dot_product_attention. scripts/test_train_forward.py checks it against transformers.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
EXPORT_DIR = REPO / "python" / "sapwood" / "data" / "default"
SEED = 20250901
THREADS = 2

EOS, PAD = "<|endoftext|>", "<|pad|>"
VOCAB = 4096
HELDOUT_EVERY = 20          # every 20th file (sorted order, index % 20 == 10) is held out
MAX_FILE_BYTES = 200_000

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_config(hidden, layers, intermediate, heads, kv_heads, hk, hv, head_dim=64, dk=64, dv=64):
    """An HF qwen3_5_text config dict (3:1 GDN:attention)."""
    rot_half = int(head_dim * 0.25) // 2
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "layer_types": [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)],
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        # as real Qwen3.5 configs: an MRoPE section, a no-op for text positions
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True,
                            "mrope_section": [rot_half - 2 * (rot_half // 4), rot_half // 4, rot_half // 4]},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": None,
        "use_cache": True,
    }


TARGET_CONFIG = hybrid_config(hidden=288, layers=8, intermediate=864, heads=4, kv_heads=2, hk=4, hv=8)
DRAFT_CONFIG = hybrid_config(hidden=128, layers=4, intermediate=384, heads=2, kv_heads=1, hk=2, hv=4)

# Training recipe. The learning rate follows warmup-stable-decay (WSD): linear warmup, constant
# peak, then a linear decay to min_lr_frac * peak over `decay_steps`. A run is defined by its step
# counts: with stable_steps / decay_steps set it is step-exact reproducible (fixed seeds, fixed
# batches per step, fixed thread count). Left as None, the decay starts when the time budget
# (max_minutes) has decay_minutes left, and decay_steps is sized from the measured step time; the
# counts the run chose are recorded in RECIPE.json, and `--target-steps S:D` replays them exactly.
# bench (idle machine, 2 threads): target 8x512 eager 4.3 s/step (950 tok/s), torch.compile'd
# 3.3 s/step (~1240 tok/s) after a 5 min compile; draft 32x192 eager 1.1 s/step (5600 tok/s).
# The machine is shared: when another process holds a core, 2 threads stall on the straggler, so
# an eager run may pick its thread count (1 or 2) by measured step time (probe_every > 0).
TARGET_TRAIN = dict(seq_len=512, batch=8, stable_steps=None, decay_steps=None, lr=1.5e-3,
                    min_lr_frac=0.1, warmup=40, weight_decay=0.1, betas=(0.9, 0.95), clip=1.0,
                    log_every=10, eval_every=250, ckpt_every=25, max_minutes=45.0, decay_minutes=8.0,
                    compile=True, probe_every=0)
DISTILL = dict(prefix_len=128, cont_len=64, n_train=4096, n_heldout=256, batch=128, temperature=0.8,
               topk=32, max_minutes=9.0, train_limit=None)
DRAFT_TRAIN = dict(batch=32, stable_steps=None, decay_steps=None, lr=3e-3, min_lr_frac=0.1, warmup=30,
                   weight_decay=0.1, betas=(0.9, 0.95), clip=1.0, log_every=10, eval_every=200,
                   ckpt_every=50, max_minutes=12.0, decay_minutes=3.0, compile=False, probe_every=0)


def log(msg, f=None):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if f is not None:
        with open(f, "a") as fh:
            fh.write(line + "\n")


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ----------------------------------------------------------------------------------------------
# The training model: HF Qwen3_5ForCausalLM parameter names, fast plain-torch forward
# ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w), w initialised to 0."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class GatedRMSNorm(nn.Module):
    """GDN output norm: w * (o * rsqrt(mean(o^2) + eps)) * silu(z), plain w initialised to 1."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o, z):
        return self.weight * (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)) * F.silu(z)


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk=64):
    """Chunked gated delta rule (WY/UT form of flash-linear-attention's naive chunk reference).

    q, k: [B, H, T, dk] (already L2-normalised, q scaled by dk^-0.5); v: [B, H, T, dv];
    g (log decay, <= 0), beta: [B, H, T]; state: [B, H, dk, dv] or None. fp32 throughout.
    Per token: S *= exp(g); S += k (beta (v - S^T k))^T; o = S^T q.
    Returns o [B, H, T, dv] and the final state.
    """
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    gc = g.cumsum(-1)                                                   # within-chunk log decay
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [.., i, j]
    kb = k * beta.unsqueeze(-1)
    # (I + strictly_lower(diag(beta) K K^T * decay)) [u | w] = [beta V | beta K exp(gc)]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * gc.exp().unsqueeze(-1)], -1)
    uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * decay                            # intra-chunk, causal incl. diag
    qd = q * gc.exp().unsqueeze(-1)                                     # reads the chunk-start state
    kd = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)                    # decayed to the chunk end
    last = gc[..., -1].exp()[..., None, None]                           # [B, H, n, 1, 1]
    S = q.new_zeros(B, H, dk, dv) if state is None else state
    outs = []
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ S
        outs.append(qd[:, :, i] @ S + attn[:, :, i] @ vn)
        S = S * last[:, :, i] + kd[:, :, i].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, H, n * chunk, dv)[:, :, :T]
    return o, S


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token-by-token form of the same recurrence (decode steps; test oracle)."""
    B, H, T, dk = k.shape
    S = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        u = (S * k[:, :, t].unsqueeze(-1)).sum(-2)
        d = beta[:, :, t].unsqueeze(-1) * (v[:, :, t] - u)
        S = S + k[:, :, t].unsqueeze(-1) * d.unsqueeze(-2)
        outs.append((S * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, 2), S


class GatedDeltaNet(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.hk, self.hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.K = c["linear_conv_kernel_dim"]
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False,
                                padding=self.K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, c["rms_norm_eps"])
        self.out_proj = nn.Linear(self.hv * self.dv, H, bias=False)

    def forward(self, x, cache=None):
        """x [B, T, H]. cache: None (training) or a dict holding 'conv' [B, C, K-1] (pre-conv
        inputs) and 'state' [B, Hv, dk, dv], updated in place."""
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)                     # [B, C, T]
        if cache is None:
            mixed = F.conv1d(mixed, self.conv1d.weight, padding=self.K - 1, groups=self.conv_dim)[..., :T]
        else:
            prev = cache.get("conv")
            if prev is None:
                prev = mixed.new_zeros(B, self.conv_dim, self.K - 1)
            full = torch.cat([prev, mixed], -1)
            cache["conv"] = full[..., -(self.K - 1):]
            mixed = F.conv1d(full, self.conv1d.weight, groups=self.conv_dim)
        mixed = F.silu(mixed).transpose(1, 2)                           # [B, T, C]
        kd = self.hk * self.dk
        q = mixed[..., :kd].reshape(B, T, self.hk, self.dk)
        k = mixed[..., kd:2 * kd].reshape(B, T, self.hk, self.dk)
        v = mixed[..., 2 * kd:].reshape(B, T, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x))                         # [B, T, Hv]
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        rep = self.hv // self.hk                                        # value head h reads key head h // rep
        q = (l2norm(q) * self.dk ** -0.5).repeat_interleave(rep, 2).transpose(1, 2)
        k = l2norm(k).repeat_interleave(rep, 2).transpose(1, 2)
        v, g, beta = v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
        state = None if cache is None else cache.get("state")
        if cache is not None and T <= 4:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, state)
        if cache is not None:
            cache["state"] = state
        o = o.transpose(1, 2)                                           # [B, T, Hv, dv]
        z = self.in_proj_z(x).reshape(B, T, self.hv, self.dv)
        return self.out_proj(self.norm(o, z).reshape(B, T, -1))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, D = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.D = c["num_attention_heads"], c["num_key_value_heads"], D
        self.q_proj = nn.Linear(H, self.nh * D * 2, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, c["rms_norm_eps"])
        self.k_norm = RMSNorm(D, c["rms_norm_eps"])

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        D, rot = self.D, cos.shape[-1]
        qg = self.q_proj(x).view(B, T, self.nh, 2 * D)                  # per head [q | gate]
        q, gate = qg[..., :D], qg[..., D:].reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)                              # [B, nh, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, D).transpose(1, 2)
        q = torch.cat([q[..., :rot] * cos + rotate_half(q[..., :rot]) * sin, q[..., rot:]], -1)
        k = torch.cat([k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin, k[..., rot:]], -1)
        past = 0
        if cache is not None:
            if "k" in cache:
                past = cache["k"].shape[2]
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        if past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=D ** -0.5)
        else:  # query i sits at position past + i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=D ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.mlp = MLP(c["hidden_size"], c["intermediate_size"])
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin, cache=None):
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            x = x + self.linear_attn(h, cache)
        else:
            x = x + self.self_attn(h, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c, kind) for kind in c["layer_types"])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class HybridLM(nn.Module):
    """Qwen3_5ForCausalLM (tied embeddings): state_dict() has HF names, lm_head.weight omitted."""

    def __init__(self, config: dict):
        super().__init__()
        assert config["tie_word_embeddings"], "the bundled models are tied"
        self.config = config
        self.model = TextModel(config)
        rp = config["rope_parameters"]
        rot = int(config["head_dim"] * rp["partial_rotary_factor"])
        inv = 1.0 / rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """transformers' Qwen3_5PreTrainedModel._init_weights: Linear/Conv1d/Embedding ~ N(0, 0.02),
        zero-centred norms 0, gated norm 1, dt_bias 1, A_log = log(U(0.01, 16))."""
        std = self.config["initializer_range"]
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.zero_()
            elif isinstance(m, GatedRMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)
                m.A_log.copy_(torch.empty(m.hv).uniform_(0.01, 16).log())

    def rope(self, start, T, dtype):
        # angles in float64 (exact for any dtype), then cast: HF does this in float32
        rp = self.config["rope_parameters"]
        rot = 2 * self.inv_freq.shape[0]
        inv = 1.0 / rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        pos = torch.arange(start, start + T, dtype=torch.float64)
        ang = pos[:, None] * inv[None]
        ang = torch.cat([ang, ang], -1)
        dev = self.inv_freq.device
        return ang.cos().to(device=dev, dtype=dtype), ang.sin().to(device=dev, dtype=dtype)

    def hidden(self, ids, cache=None, start=0):
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(start, ids.shape[1], x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if cache is None else cache.setdefault(i, {}))
        return self.model.norm(x)

    def forward(self, ids, cache=None, start=0):
        """Logits [B, T, V]. With a cache dict, continue a sequence whose first `start` tokens
        it already holds."""
        return self.hidden(ids, cache, start) @ self.model.embed_tokens.weight.T

    def hf_state_dict(self):
        return {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head")}


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Stage 1: corpus
# ----------------------------------------------------------------------------------------------

EXCLUDE_DIRS = ("site-packages", "test", "tests", "idlelib")


def stage_corpus(out: Path):
    root = Path(sysconfig.get_paths()["stdlib"])
    files, skipped = [], {"too_large": [], "not_utf8": []}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")[:-1]
        if any(d in EXCLUDE_DIRS for d in parts) or rel.startswith("lib2to3/tests"):
            continue
        data = p.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            skipped["too_large"].append(rel)
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"].append(rel)
            continue
        files.append((rel, data))
    files.sort()
    entries = []
    for i, (rel, data) in enumerate(files):
        split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY // 2 else "train"
        entries.append({"path": rel, "sha256": sha256_bytes(data), "bytes": len(data), "split": split})
    listing = "".join(f"{e['path']}\t{e['sha256']}\t{e['split']}\n" for e in entries)
    corpus = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "rule": f"*.py under stdlib, excluding dirs {EXCLUDE_DIRS} and lib2to3/tests, files > "
                f"{MAX_FILE_BYTES} bytes and non-UTF-8 files; sorted; file i held out iff "
                f"i % {HELDOUT_EVERY} == {HELDOUT_EVERY // 2}",
        "list_sha256": sha256_bytes(listing.encode()),
        "n_train": sum(e["split"] == "train" for e in entries),
        "n_heldout": sum(e["split"] == "heldout" for e in entries),
        "bytes_train": sum(e["bytes"] for e in entries if e["split"] == "train"),
        "bytes_heldout": sum(e["bytes"] for e in entries if e["split"] == "heldout"),
        "skipped": skipped,
        "files": entries,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
    log(f"corpus: {corpus['n_train']} train files ({corpus['bytes_train']} B), {corpus['n_heldout']} "
        f"held out ({corpus['bytes_heldout']} B), skipped {len(skipped['too_large'])} large, "
        f"{len(skipped['not_utf8'])} non-UTF-8; list sha256 {corpus['list_sha256'][:16]}")


def read_corpus(out: Path):
    corpus = json.loads((out / "corpus.json").read_text())
    root = Path(corpus["stdlib"])
    texts = {"train": [], "heldout": []}
    for e in corpus["files"]:
        data = (root / e["path"]).read_bytes()
        if sha256_bytes(data) != e["sha256"]:
            raise RuntimeError(f"{e['path']} changed since corpus.json was written")
        texts[e["split"]].append(data.decode("utf-8"))
    return corpus, texts


# ----------------------------------------------------------------------------------------------
# Stage 2: tokenizer
# ----------------------------------------------------------------------------------------------

def build_tokenizer(train_texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    return tok


def stage_tokenizer(out: Path):
    corpus, texts = read_corpus(out)
    t0 = time.time()
    tok = build_tokenizer(texts["train"])
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1 and tok.get_vocab_size() == VOCAB
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    stats = {}
    for split in ("train", "heldout"):
        ids = []
        for enc in tok.encode_batch(texts[split], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(out / f"tokens_{split}.npy", arr)
        nbytes = corpus[f"bytes_{split}"]
        stats[split] = {"tokens": int(arr.size), "bytes_per_token": round(nbytes / arr.size, 3)}
    # round trip check on a few files
    for s in texts["heldout"][:5]:
        assert tok.decode(tok.encode(s).ids) == s
    h = sha256_bytes((out / "tokenizer.json").read_bytes())
    (out / "tokens.json").write_text(json.dumps({"tokenizer_sha256": h, **stats}, indent=1) + "\n")
    log(f"tokenizer: vocab {tok.get_vocab_size()}, sha256 {h[:16]}, {stats} ({time.time() - t0:.0f}s)")


# ----------------------------------------------------------------------------------------------
# Training helpers
# ----------------------------------------------------------------------------------------------

def lr_at(step, peak, warmup, min_frac, decay_start=None, decay_steps=None):
    """Warmup-stable-decay: linear warmup over `warmup` steps, constant peak, then linear decay to
    min_frac * peak over decay_steps from decay_start (None = not decaying yet)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay_start is None or step < decay_start:
        return peak
    done = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
    return peak * (1 - (1 - min_frac) * done)


class ThreadChooser:
    """Pick torch's intra-op thread count (1..THREADS) by measured step time; re-probe the
    other counts now and then, since the machine's other load comes and goes."""

    def __init__(self, probe_every):
        self.options = list(range(THREADS, 0, -1))
        self.time = {n: None for n in self.options}
        self.probe_every = probe_every
        self.current = THREADS
        torch.set_num_threads(self.current)

    def before(self, step):
        probe = self.probe_every and step % self.probe_every == self.probe_every - 1
        if probe:  # try the counts in turn
            n = self.options[(step // self.probe_every) % len(self.options)]
        else:
            known = {n: t for n, t in self.time.items() if t is not None}
            n = min(known, key=known.get) if known else THREADS
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.current = n

    def after(self, dt):
        old = self.time[self.current]
        self.time[self.current] = dt if old is None else 0.7 * old + 0.3 * dt


def make_optimizer(model, lr, wd, betas):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas,
                             fused=False, foreach=True)


def batch_windows(tokens: np.ndarray, step: int, batch: int, seq: int, seed: int):
    """Random windows of seq + 1 tokens; deterministic in (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - seq - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64))


def fixed_windows(tokens: np.ndarray, seq: int, limit=None):
    n = (tokens.size - 1) // seq
    idx = range(n) if limit is None else np.linspace(0, n - 1, min(n, limit)).astype(int)
    return torch.from_numpy(np.stack([tokens[i * seq:i * seq + seq + 1] for i in idx]).astype(np.int64))


@torch.no_grad()
def eval_lm_loss(model, windows, batch=8):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1])
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return tot / n


def save_ckpt(path: Path, model, opt, step, extra):
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "config": model.config,
                **extra}, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Stage: bench
# ----------------------------------------------------------------------------------------------

def stage_bench(out: Path, steps=4, config=None, batch=None, seq=None):
    torch.set_num_threads(THREADS)
    seed_all(SEED)
    cfg = config or TARGET_CONFIG
    tr = TARGET_TRAIN
    batch, seq = batch or tr["batch"], seq or tr["seq_len"]
    model = HybridLM(cfg)
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
    tokens = np.load(out / "tokens_train.npy") if (out / "tokens_train.npy").exists() else \
        np.random.default_rng(0).integers(0, VOCAB, 200_000).astype(np.uint16)
    times = []
    for step in range(steps + 1):
        w = batch_windows(tokens, step, batch, seq, SEED)
        t0 = time.time()
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.time() - t0)
    dt = float(np.median(times[1:]))
    tps = batch * seq / dt
    log(f"bench: {count_params(model) / 1e6:.2f}M params, batch {batch}x{seq}: {dt:.2f}s/step, "
        f"{tps:.0f} tok/s (threads {torch.get_num_threads()})")
    return tps


# ----------------------------------------------------------------------------------------------
# Stage 3: target
# ----------------------------------------------------------------------------------------------

def train_loop(name, model, cfgt, out_dir: Path, get_batch, loss_fn, batch_tokens, evals):
    """Shared AdamW/WSD loop with logging, periodic eval and checkpoints (resumable). Returns the
    summary, which records the stable/decay step counts the run used (see TARGET_TRAIN)."""
    torch.set_num_threads(THREADS)
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = out_dir / "log.txt"
    ckpt = out_dir / "ckpt.pt"
    opt = make_optimizer(model, cfgt["lr"], cfgt["weight_decay"], cfgt["betas"])
    start, wall_before, hist = 0, 0.0, []
    decay_start, decay_steps = cfgt.get("stable_steps"), cfgt.get("decay_steps")
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        if st.get("done"):
            log(f"{name}: already done ({st['step']} steps); delete {ckpt} to retrain", logf)
            return st["summary"]
        opt.load_state_dict(st["opt"])
        start, wall_before, hist = st["step"], st["wall_s"], st["hist"]
        decay_start, decay_steps = st.get("decay_start", decay_start), st.get("decay_steps", decay_steps)
        log(f"{name}: resuming at step {start}", logf)
    budget = cfgt.get("max_minutes")
    if decay_start is None and budget is None:
        raise ValueError(f"{name}: set stable_steps/decay_steps or a time budget")
    log(f"{name}: {count_params(model)} params, {cfgt}", logf)
    chooser = ThreadChooser(cfgt.get("probe_every", 0))
    step_loss = loss_fn
    if cfgt.get("compile"):
        step_loss = torch.compile(loss_fn, dynamic=False)
        log(f"{name}: torch.compile on (the first step includes compilation)", logf)
    t0 = time.time()
    tokens_seen = sum(h[2] for h in hist)
    step = start
    step_times = []
    while decay_start is None or step < decay_start + decay_steps:
        wall = wall_before + time.time() - t0
        if decay_start is None and wall / 60 >= budget - cfgt["decay_minutes"] and len(step_times) >= 5:
            decay_start = step
            decay_steps = max(1, round(cfgt["decay_minutes"] * 60 / float(np.median(step_times[-20:]))))
            log(f"{name}: decay starts at step {decay_start}, {decay_steps} decay steps", logf)
        lr = lr_at(step, cfgt["lr"], cfgt["warmup"], cfgt["min_lr_frac"], decay_start, decay_steps)
        for gp in opt.param_groups:
            gp["lr"] = lr
        batch = get_batch(step)
        chooser.before(step)
        ts = time.time()
        loss, ntok = step_loss(model, batch), batch_tokens(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfgt["clip"]).item()
        opt.step()
        chooser.after(time.time() - ts)
        step_times.append(time.time() - ts)
        step += 1
        tokens_seen += ntok
        hist.append((step, loss.item(), ntok))
        wall = wall_before + time.time() - t0
        if step % cfgt["log_every"] == 0:
            recent = [h[1] for h in hist[-cfgt["log_every"]:]]
            times = {n: round(t, 2) for n, t in chooser.time.items() if t is not None}
            log(f"{name} step {step} loss {np.mean(recent):.4f} lr {lr:.2e} gnorm {gn:.2f} "
                f"tokens {tokens_seen} wall {wall / 60:.1f}m tok/s {tokens_seen / max(wall, 1e-9):.0f} "
                f"s/step by threads {times}", logf)
        if step % cfgt["eval_every"] == 0:
            res = {k: fn(model) for k, fn in evals.items()}
            log(f"{name} eval step {step}: {json.dumps(res)}", logf)
        if step % cfgt["ckpt_every"] == 0:
            save_ckpt(ckpt, model, opt, step, {"wall_s": wall, "hist": hist, "done": False,
                                               "decay_start": decay_start, "decay_steps": decay_steps})
    torch.set_num_threads(THREADS)
    wall = wall_before + time.time() - t0
    res = {k: fn(model) for k, fn in evals.items()}
    last = [h[1] for h in hist[-50:]]
    summary = {"steps": step, "stable_steps": decay_start, "decay_steps": decay_steps,
               "tokens": tokens_seen, "wall_s": round(wall, 1), "tokens_per_s": round(tokens_seen / wall, 1),
               "final_train_loss_last50": round(float(np.mean(last)), 4),
               **{k: round(v, 4) for k, v in res.items()}}
    log(f"{name} done: {json.dumps(summary)}", logf)
    save_ckpt(ckpt, model, opt, step, {"wall_s": wall, "hist": hist, "done": True, "summary": summary})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def stage_target(out: Path):
    tr = TARGET_TRAIN
    seed_all(SEED)
    model = HybridLM(TARGET_CONFIG)
    train_tok = np.load(out / "tokens_train.npy")
    held = fixed_windows(np.load(out / "tokens_heldout.npy"), tr["seq_len"], limit=128)  # 128 of 338
    held_small = held[np.linspace(0, len(held) - 1, min(len(held), 48)).astype(int)]
    train_fixed = fixed_windows(train_tok, tr["seq_len"], limit=96)

    def get_batch(step):
        return batch_windows(train_tok, step, tr["batch"], tr["seq_len"], SEED + 1)

    def loss_fn(m, w):
        logits = m(w[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1))

    evals = {"heldout_loss": lambda m: eval_lm_loss(m, held_small)}
    summary = train_loop("target", model, tr, out / "target", get_batch, loss_fn,
                         lambda w: w[:, 1:].numel(), evals)
    if "heldout_loss_full" not in summary:
        summary["heldout_loss_full"] = round(eval_lm_loss(model, held), 4)
        summary["train_loss_fixed96"] = round(eval_lm_loss(model, train_fixed), 4)
        summary["heldout_windows"] = len(held)
        (out / "target" / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        log(f"target final: held-out loss {summary['heldout_loss_full']} over {len(held)} windows, "
            f"train loss (96 fixed windows) {summary['train_loss_fixed96']}", out / "target" / "log.txt")
    return model, summary


def load_trained(out: Path, name: str, config: dict):
    model = HybridLM(config)
    st = torch.load(out / name / "ckpt.pt", weights_only=False)
    model.load_state_dict(st["model"])
    model.eval()
    return model, st


# ----------------------------------------------------------------------------------------------
# Stage 4: distillation data
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prefix, n_new, temperature, gen, topk=None):
    """Continue prefix [B, P] by n_new tokens (KV cache + recurrent GDN state); greedy if
    temperature == 0. With topk: also the top-k log-probs (values, ids) of the model's
    next-token distribution at every position but the last, [B, P + n_new - 1, k]."""
    cache = {}
    logits = model(prefix, cache, 0)
    tops = [torch.log_softmax(logits, -1).topk(topk, -1)] if topk else []
    logits = logits[:, -1]
    out = [prefix]
    pos = prefix.shape[1]
    for i in range(n_new):
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        out.append(nxt)
        if i + 1 < n_new:
            logits = model(nxt, cache, pos)
            if topk:
                tops.append(torch.log_softmax(logits, -1).topk(topk, -1))
            logits = logits[:, -1]
            pos += 1
    seq = torch.cat(out, 1)
    if not topk:
        return seq
    return seq, torch.cat([t.values for t in tops], 1), torch.cat([t.indices for t in tops], 1)


def stage_distill(out: Path):
    torch.set_num_threads(THREADS)
    d = DISTILL
    target, _ = load_trained(out, "target", TARGET_CONFIG)
    gen = torch.Generator().manual_seed(SEED + 7)
    logf = out / "distill_log.txt"
    chooser = ThreadChooser(0)  # fixed thread count: the continuations must replay exactly
    t0 = time.time()
    result = {}
    for split, n in (("train", d["n_train"]), ("heldout", d["n_heldout"])):
        tokens = np.load(out / f"tokens_{split}.npy")
        rng = np.random.default_rng([SEED, 11 if split == "train" else 12])
        starts = rng.integers(0, tokens.size - d["prefix_len"], size=n)
        seqs, top_v, top_i = [], [], []
        for b in range(0, n, d["batch"]):
            over = d["train_limit"] is not None and b >= d["train_limit"] if split == "train" else False
            if split == "train" and d["train_limit"] is None and b and time.time() - t0 > 60 * d["max_minutes"]:
                over = True
            if over:
                log(f"distill: time budget reached after {b} train sequences", logf)
                break
            chooser.before(b // d["batch"])
            tb = time.time()
            pre = torch.from_numpy(np.stack([tokens[s:s + d["prefix_len"]] for s in starts[b:b + d["batch"]]])
                                   .astype(np.int64))
            half = pre.shape[0] // 2  # first half greedy, second half sampled at T
            parts = [generate(target, pre[:half], d["cont_len"], 0.0, gen, d["topk"]),
                     generate(target, pre[half:], d["cont_len"], d["temperature"], gen, d["topk"])]
            seq, v, i = (torch.cat(x) for x in zip(*parts))             # v, i: predictions of tokens 1..L-1
            chooser.after(time.time() - tb)
            seqs.append(seq.to(torch.int16))
            top_v.append(v.to(torch.float16))
            top_i.append(i.to(torch.int16))
            log(f"distill {split}: {b + seq.shape[0]}/{n} sequences ({time.time() - t0:.0f}s)", logf)
        result[split] = {"seq": torch.cat(seqs), "top_v": torch.cat(top_v), "top_i": torch.cat(top_i),
                         "greedy": torch.tensor([j % d["batch"] < d["batch"] // 2 for j in range(len(starts))])
                         [:sum(x.shape[0] for x in seqs)]}
    result["wall_s"] = time.time() - t0
    torch.save(result, out / "distill.pt")
    mass = result["train"]["top_v"].float().exp().sum(-1).mean().item()
    log(f"distill done: {result['train']['seq'].shape[0]}+{result['heldout']['seq'].shape[0]} sequences, mean top-{d['topk']} mass {mass:.3f}, "
        f"{result['wall_s']:.0f}s", logf)


# ----------------------------------------------------------------------------------------------
# Stage 5: draft
# ----------------------------------------------------------------------------------------------

def distill_loss(model, seq, top_v, top_i):
    """Cross-entropy of the draft against the target's renormalised top-k next-token distribution
    (= KL up to the target's entropy), every position of the sequence."""
    logits = model(seq[:, :-1].long())
    lq = torch.log_softmax(logits, -1)
    p = torch.softmax(top_v.float(), -1)                                # renormalised top-k
    return -(p * lq.gather(-1, top_i.long())).sum(-1).mean()


@torch.no_grad()
def eval_draft(model, data, cont_from):
    """Held-out distillation loss and top-1 agreement with the target on the continuations."""
    model.eval()
    tot, agree, n = 0.0, 0, 0
    for b in range(0, data["seq"].shape[0], 32):
        seq, tv, ti = data["seq"][b:b + 32], data["top_v"][b:b + 32], data["top_i"][b:b + 32]
        tot += distill_loss(model, seq, tv, ti).item() * seq.shape[0]
        logits = model(seq[:, :-1].long())
        a = (logits.argmax(-1) == ti[..., 0].long())[:, cont_from - 1:]
        agree += a.sum().item()
        n += a.numel()
    model.train()
    return tot / data["seq"].shape[0], agree / n


def stage_draft(out: Path):
    tr = DRAFT_TRAIN
    seed_all(SEED + 100)
    model = HybridLM(DRAFT_CONFIG)
    data = torch.load(out / "distill.pt")
    train, held = data["train"], data["heldout"]
    held_lm = fixed_windows(np.load(out / "tokens_heldout.npy"), TARGET_TRAIN["seq_len"])
    held_lm = held_lm[np.linspace(0, len(held_lm) - 1, min(len(held_lm), 48)).astype(int)]
    n = train["seq"].shape[0]

    def get_batch(step):
        rng = np.random.default_rng([SEED + 2, step])
        idx = torch.from_numpy(rng.integers(0, n, size=tr["batch"]))
        return train["seq"][idx], train["top_v"][idx], train["top_i"][idx]

    def loss_fn(m, b):
        return distill_loss(m, *b)

    p = DISTILL["prefix_len"]
    evals = {"heldout_distill_loss": lambda m: eval_draft(m, held, p)[0],
             "heldout_top1_agreement": lambda m: eval_draft(m, held, p)[1],
             "heldout_corpus_lm_loss": lambda m: eval_lm_loss(m, held_lm)}
    summary = train_loop("draft", model, tr, out / "draft", get_batch, loss_fn,
                         lambda b: b[0][:, 1:].numel(), evals)
    summary["train_sequences"] = n
    summary["epochs"] = round(summary["steps"] * tr["batch"] / n, 2)
    (out / "draft" / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return model, summary


# ----------------------------------------------------------------------------------------------
# Stage 6: export + check
# ----------------------------------------------------------------------------------------------

def export_one(model_sd: dict, config: dict, dst: Path, tokenizer_json: Path):
    from safetensors.torch import save_file
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(model_sd.items())
               if not k.startswith("lm_head")}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config)
    cfg["dtype"] = "bfloat16"
    cfg["transformers_version"] = "5.24.0"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dst / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg["eos_token_id"], "pad_token_id": 1, "do_sample": False,
         "transformers_version": "5.24.0"}, indent=2) + "\n")
    (dst / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
         "model_max_length": 4096, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return sum(v.numel() for v in tensors.values())


def stage_export(out: Path, dest: Path = EXPORT_DIR):
    corpus = json.loads((out / "corpus.json").read_text())
    toks = json.loads((out / "tokens.json").read_text())
    recipe = {"description": "sapwood bundled default: Qwen3.5-style hybrid (3:1 GDN:attention) target "
                             "and distilled draft, trained from scratch on the CPython stdlib",
              "script": "scripts/train_default.py all", "seed": SEED, "torch": torch.__version__,
              "threads": THREADS,
              "corpus": {k: corpus[k] for k in ("python", "rule", "list_sha256", "n_train", "n_heldout",
                                                "bytes_train", "bytes_heldout")},
              "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": VOCAB,
                            "special_tokens": [EOS, PAD], **toks}}
    for name, config, train_cfg in (("target", TARGET_CONFIG, TARGET_TRAIN), ("draft", DRAFT_CONFIG, DRAFT_TRAIN)):
        st = torch.load(out / name / "ckpt.pt", weights_only=False)
        n = export_one(st["model"], config, dest / name, out / "tokenizer.json")
        summ = st.get("summary") or {"steps": st["step"], "partial": True, "wall_s": st["wall_s"],
                                     "tokens": sum(h[2] for h in st["hist"])}
        sp = out / name / "summary.json"
        if sp.exists() and st.get("done"):
            summ = json.loads(sp.read_text())
        recipe[name] = {"params": n, "config": {k: config[k] for k in (
            "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim")},
            "train": {k: (list(v) if isinstance(v, tuple) else v) for k, v in train_cfg.items()},
            "result": summ,
            "weights_sha256": sha256_bytes((dest / name / "model.safetensors").read_bytes())}
    recipe["distill"] = dict(DISTILL)
    dist = torch.load(out / "distill.pt") if (out / "distill.pt").exists() else None
    if dist is not None:
        recipe["distill"]["train_sequences"] = int(dist["train"]["seq"].shape[0])
    t, d = recipe["target"]["result"], recipe["draft"]["result"]
    if dist is not None and t.get("stable_steps") is not None and d.get("stable_steps") is not None:
        recipe["reproduce"] = (f"python scripts/train_default.py all --target-steps {t['stable_steps']}:"
                               f"{t['decay_steps']} --distill-train {recipe['distill']['train_sequences']} "
                               f"--draft-steps {d['stable_steps']}:{d['decay_steps']}")
    dp = out / "distill_log.txt"
    if dp.exists():
        recipe["distill"]["log_tail"] = dp.read_text().strip().splitlines()[-1]
    (dest / "RECIPE.json").write_text(json.dumps(recipe, indent=1) + "\n")
    log(f"exported to {dest}: " + ", ".join(f"{p.relative_to(dest)} {p.stat().st_size / 1e6:.1f}MB"
                                             for p in sorted(dest.rglob("*.safetensors"))))


def stage_check(out: Path, dest: Path = EXPORT_DIR):
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM
    torch.set_num_threads(THREADS)
    tok = Tokenizer.from_file(str(dest / "target" / "tokenizer.json"))
    models = {n: Qwen3_5ForCausalLM.from_pretrained(str(dest / n), dtype=torch.float32).eval()
              for n in ("target", "draft")}
    prompt = "def merge(a, b):"
    ids = torch.tensor([tok.encode(prompt).ids])
    samples = {}
    for n, m in models.items():
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=0, pad_token_id=1)
        samples[n] = tok.decode(g[0].tolist())
        print(f"===== {n} (bf16 weights, HF Qwen3_5ForCausalLM, greedy) =====\n{samples[n]}\n", flush=True)
    # held-out loss through transformers with the exported bf16 weights (a few windows)
    held = fixed_windows(np.load(out / "tokens_heldout.npy"), TARGET_TRAIN["seq_len"], limit=8)
    losses = {}
    for n, m in models.items():
        with torch.no_grad():
            lg = m(held[:, :-1], use_cache=False).logits
        losses[n] = round(F.cross_entropy(lg.reshape(-1, VOCAB), held[:, 1:].reshape(-1)).item(), 4)
    # agreement of the exported models on the target's greedy continuation
    with torch.no_grad():
        g = models["target"].generate(held[:4, :128], max_new_tokens=64, do_sample=False,
                                      eos_token_id=None, pad_token_id=1)
        lt = models["target"](g, use_cache=False).logits[:, 127:-1].argmax(-1)
        ld = models["draft"](g, use_cache=False).logits[:, 127:-1].argmax(-1)
    agree = (lt == ld).float().mean().item()
    res = {"hf_bf16_heldout_loss_8windows": losses, "hf_draft_target_top1_agreement": round(agree, 4),
           "sample_prompt": prompt, "samples": samples}
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}), flush=True)
    rp = dest / "RECIPE.json"
    if rp.exists():
        r = json.loads(rp.read_text())
        r["check"] = res
        rp.write_text(json.dumps(r, indent=1) + "\n")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["corpus", "tokenizer", "bench", "target", "distill", "draft",
                                      "export", "check", "all"])
    ap.add_argument("--out", type=Path, default=Path("/work/train_default"))
    ap.add_argument("--dest", type=Path, default=EXPORT_DIR, help="export directory")
    ap.add_argument("--target-steps", metavar="S:D", help="replay: stable and decay steps of the target")
    ap.add_argument("--draft-steps", metavar="S:D", help="replay: stable and decay steps of the draft")
    ap.add_argument("--distill-train", type=int, metavar="N", help="replay: distillation sequences")
    args = ap.parse_args(argv)
    for flag, cfg in ((args.target_steps, TARGET_TRAIN), (args.draft_steps, DRAFT_TRAIN)):
        if flag:
            try:
                cfg["stable_steps"], cfg["decay_steps"] = (int(x) for x in flag.split(":"))
            except ValueError:
                ap.error(f"expected STABLE:DECAY step counts, got {flag!r}")
    if args.distill_train is not None:
        DISTILL["train_limit"] = args.distill_train
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(THREADS)
    t0 = time.time()
    stages = ["corpus", "tokenizer", "target", "distill", "draft", "export", "check"] \
        if args.stage == "all" else [args.stage]
    for s in stages:
        ts = time.time()
        if s == "export":
            stage_export(out, args.dest)
        elif s == "check":
            stage_check(out, args.dest)
        else:
            globals()[f"stage_{s}"](out)
        log(f"stage {s} took {time.time() - ts:.0f}s")
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
