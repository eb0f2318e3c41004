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


# Normalizers that never shrink text by more than a known factor: decomposition, lower-casing
# and prepending only keep or add characters; NFC/NFKC compose at most 4 characters into one (a
# composed character absorbs exactly its canonical decomposition, at most 4 long in Unicode:
# tests check it against unicodedata).
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}
# UTF-8 never uses C0, C1 or F5..FF, the bytes a byte-level vocabulary may leave out
_UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


def _parts(d, key):
    """A tokenizer.json component and, for a Sequence, its members."""
    if not d:
        return []
    if d.get("type") == "Sequence":
        return [p for x in d.get(key) or [] for p in _parts(x, key)]
    return [d]


def chars_per_token_bound(tokenizer) -> int | None:
    """At most how many characters of a text one token covers, when the tokenizer guarantees
    one, else None: a text of L characters then encodes to at least L / bound tokens, so a
    prompt too long for the context is refused before it is tokenized (which takes seconds for
    megabytes, issue 50).

    The guarantee holds for byte-level BPE (GPT-2's and Qwen's) whose vocabulary has every byte
    UTF-8 uses: every byte of the (normalized) text ends in some token, and a token covers at
    most as many characters as its vocabulary string has (one per byte; an added token its
    content), times what the normalizer may compose into one character. Other tokenizers can
    drop text (a WordPiece word past its length limit is one [UNK]; whitespace pre-tokenizers,
    BERT's control-character cleaning and Replace delete characters; an added token with
    lstrip/rstrip takes any run of whitespace), so they get None."""
    import json

    if tokenizer is None:
        return None
    try:
        spec = json.loads(tokenizer.to_str())
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - no bound is always safe
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if not any(p.get("type") == "ByteLevel" for p in pre) or any(
            p.get("type") not in ("ByteLevel", "Split")
            or (p.get("type") == "Split" and p.get("behavior") == "Removed") for p in pre):
        return None
    from ..testing import _bytes_to_unicode

    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # such a token takes the whitespace around it, any amount of it
    b2u = _bytes_to_unicode()
    if any(b2u[b] not in vocab for b in _UTF8_BYTES):
        return None
    shrink = 1
    for n in _parts(spec.get("normalizer"), "normalizers"):
        if n.get("type") not in _NORMALIZER_SHRINK:
            return None
        shrink *= _NORMALIZER_SHRINK[n["type"]]
    return shrink * max(1, max(len(s) for s in vocab))
