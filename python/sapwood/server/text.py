"""Per-token bytes for logprobs: a token alone may be an incomplete UTF-8 sequence, which only
its bytes show. (The text of a token stream, stop strings included, is textstream's.)"""
from __future__ import annotations


def token_bytes_table(tokenizer):
    """id -> the token's raw bytes for byte-level BPE vocabularies (GPT-2's reversible byte to
    character map, as Qwen's tokenizers use), else None: a token alone may be an incomplete
    UTF-8 sequence, which only its bytes show."""
    if tokenizer is None:
        return None
    dec = getattr(tokenizer, "decoder", None)
    if dec is None or "ByteLevel" not in type(dec).__name__ + repr(dec):
        return None
    from ..testing import _bytes_to_unicode

    inv = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    def token_bytes(i: int) -> list[int]:
        s = tokenizer.id_to_token(int(i))
        if s is None:
            return []
        if s in special or any(c not in inv for c in s):
            return list(s.encode("utf-8"))
        return [inv[c] for c in s]

    return token_bytes
