"""`Model`: a loaded checkpoint (engine, tokenizer, config). Build one with `sapwood.load`."""
from __future__ import annotations

from pathlib import Path

from .reference.model import FULL, ModelConfig


class Model:
    """The engine with its weights, plus what the checkpoint directory says about the model.

    engine: sapwood._core.Engine (committed state: prefill / verify / commit, see DESIGN.md)
    tokenizer: tokenizers.Tokenizer, or None when the directory has no tokenizer.json
    config: ModelConfig; generation_config: dict (generation_config.json, {} when absent);
    chat_template: Jinja source from the tokenizer files, or None.
    """

    def __init__(self, engine, tokenizer, config: ModelConfig, generation_config: dict | None = None,
                 chat_template: str | None = None, path=None, *, weights: str = "q8", kv: str = "int8",
                 backend: str = "cpu", max_context: int = 4096):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.generation_config = dict(generation_config or {})
        self.chat_template = chat_template
        self.path = None if path is None else Path(path)
        self.weights, self.kv, self.backend, self.max_context = weights, kv, backend, max_context

    def _tok(self):
        if self.tokenizer is None:
            raise RuntimeError(f"{self.path}: no tokenizer.json was loaded; work with token ids")
        return self.tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. from a chat template) are
        recognised either way; add_special_tokens only adds the tokenizer's post-processor
        tokens, which Qwen tokenizers do not have, so the default keeps the text as written."""
        return self._tok().encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self._tok().decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        c = self.config
        n_attn = sum(t == FULL for t in c.layer_types)
        name = self.path.name if self.path is not None else "?"
        return (f"Model({name!r}, layers={c.num_layers} ({c.num_layers - n_attn} GDN + {n_attn} "
                f"attention), hidden={c.hidden_size}, vocab={c.vocab_size}, weights={self.weights}, "
                f"kv={self.kv}, backend={self.backend}, max_context={self.max_context})")
