"""Numpy reference of the checkpoint's multi-token-prediction head (`mtp.*`), float64.

As vLLM's qwen3_5_mtp defines it: for the target's final hidden state h_i (after model.norm)
and the next token t_{i+1},

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])   # embedding first

then one full-attention decoder layer at position i (the target's attention and MLP math, its
own KV cache), mtp.norm, and the target's LM head (tied or not). The norms are zero-centred
RMSNorms like every other. A deeper draft row feeds the head's own output hidden state (after
mtp.norm, what the LM head read) and its pick back in, one position later.

Tensor names are the checkpoint's: `mtp.fc.weight [H, 2H]`, `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight`, `mtp.layers.0.*` named as a target layer's;
`mtp.*` sits at the top level in both the plain and the multimodal (`model.language_model.*`)
layout. The head has no embedding table of its own: it reads the target's.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..config import FULL, MTP_CONFIG_KEY, ModelConfig, check_mtp_tensors, mtp_tensors
from .model import ReferenceModel, normalize_names, rms_norm

class MtpReference:
    """The head with its own committed KV state. Row j of its state is the target's position
    j: prefill(hidden, tokens) commits rows from the target's final hidden states and the token
    after each; draft() continues the chain from the last committed row and rolls it back."""

    def __init__(self, config: dict | ModelConfig, weights: dict, kv_int8: bool = False):
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
        if cfg.mtp_layers != 1:
            raise ValueError(f"{MTP_CONFIG_KEY}={cfg.mtp_layers}: the reference runs one MTP layer")
        mtp = mtp_tensors(weights)
        check_mtp_tensors(cfg, mtp)
        target = normalize_names(weights)
        embed = target["model.embed_tokens.weight"]
        w = {"model." + n[len("mtp."):]: x for n, x in mtp.items() if n.startswith("mtp.layers.0.")}
        w["model.embed_tokens.weight"] = embed
        w["model.norm.weight"] = mtp["mtp.norm.weight"]
        if not cfg.tie_word_embeddings:
            w["lm_head.weight"] = target["lm_head.weight"]
        self.cfg = cfg
        self.layer = ReferenceModel(replace(cfg, layer_types=(FULL,)), w, kv_int8=kv_int8)
        self.embed = embed
        self.fc = np.asarray(mtp["mtp.fc.weight"], np.float64)
        self.norm_e = mtp["mtp.pre_fc_norm_embedding.weight"]
        self.norm_h = mtp["mtp.pre_fc_norm_hidden.weight"]

    @property
    def length(self) -> int:
        return self.layer.length

    def reset(self) -> None:
        self.layer.reset()

    def _inputs(self, hidden, tokens) -> np.ndarray:
        eps = self.cfg.rms_norm_eps
        e = rms_norm(np.asarray(self.embed[np.asarray(tokens, np.int64)], np.float64), self.norm_e, eps)
        h = rms_norm(np.asarray(hidden, np.float64), self.norm_h, eps)
        return np.concatenate([e, h], -1) @ self.fc.T

    def prefill(self, hidden, tokens) -> tuple[np.ndarray, np.ndarray]:
        """Commit rows at positions length.. (hidden [n, H], tokens [n]): (the head's output
        hidden rows [n, H] after mtp.norm, logits [n, V])."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        h, z = self.layer.forward(tokens, np.arange(tokens.size) - 1, x=self._inputs(hidden, tokens))
        self.layer.commit(list(range(tokens.size)))
        return h, z

    def draft(self, hidden, tokens, rows: int) -> tuple[np.ndarray, list[int]]:
        """Commit the rows (the last one's token: the root), then the greedy chain of `rows`
        rows: (logits [rows, V], picks). The drafted rows are rolled back."""
        h, z = self.prefill(hidden, tokens)
        saved = (self.layer.length, dict(self.layer.kv))
        h, logits, picks = h[-1:], [z[-1]], []
        for r in range(rows):
            picks.append(int(np.argmax(logits[-1])))
            if r + 1 < rows:
                h, z = self.prefill(h, [picks[-1]])
                logits.append(z[0])
        self.layer.length, self.layer.kv = saved
        return np.array(logits), picks
