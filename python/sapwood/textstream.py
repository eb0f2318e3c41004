"""Text of a token stream as it grows, and stop strings found in it, in linear time.

`IncrementalText` decodes each new token through a short window of the tokens before it
(the ones since the last complete character) instead of the whole output again: a token that
ends inside a UTF-8 character adds nothing until the token completing it arrives, and a
decoder that drops a leading space of its input (SentencePiece's Metaspace) drops it from the
window's prefix too, so the text grown piece by piece is the text of decoding every token at
once.

With stop strings it says how many leading tokens are safe to stream: those whose text lies
before the longest suffix of the text that is the beginning of some stop string. Those tokens
are in the result whatever comes next (a stop string found later starts inside that suffix),
so a stream never yields a token that the result then withdraws.
"""
from __future__ import annotations

from .tokenizing import guarded


class IncrementalText:
    def __init__(self, tokenizer, stops=(), path="tokenizer.json"):
        self.tokenizer = tokenizer
        self.path = path  # the tokenizer's file, named by an error (tokenizing.guarded)
        self.stops = [s for s in stops]
        self.ids: list[int] = []
        self.text = ""
        self.ends: list[int] = []  # per complete token: len(text) once it is in
        self._prefix = 0           # window start: the tokens ids[_prefix:len(ends)] are in text
        self.stop_at = -1          # where the first stop string starts in text (-1: none yet)

    def _decode(self, ids) -> str:
        return guarded(self.path, "decoding token ids", self.tokenizer.decode, ids,
                       skip_special_tokens=False)

    def push(self, tok: int) -> str:
        """Add a token; returns the text it completed ("" while a character is unfinished)."""
        self.ids.append(int(tok))
        read = len(self.ends)
        before = self._decode(self.ids[self._prefix:read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing yet, or an unfinished UTF-8 sequence: wait for the next token
        delta = now[len(before):]
        old = len(self.text)
        self.text += delta
        self.ends.extend([len(self.text)] * (len(self.ids) - read))
        self._prefix = read
        if self.stop_at < 0 and self.stops and delta:
            hits = []
            for s in self.stops:  # a new match ends inside delta
                i = self.text.find(s, max(0, old - len(s) + 1))
                if i >= 0:
                    hits.append(i)
            if hits:
                self.stop_at = min(hits)
        return delta

    def held_chars(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def tokens_before(self, end: int) -> int:
        """How many leading tokens are complete and lie within text[:end]."""
        lo, hi = 0, len(self.ends)
        while lo < hi:  # ends is non-decreasing
            mid = (lo + hi) // 2
            if self.ends[mid] <= end:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def safe_tokens(self) -> int:
        """Leading tokens that every continuation keeps (see the module docstring)."""
        if self.stop_at >= 0:
            return self.tokens_before(self.stop_at)
        return self.tokens_before(len(self.text) - self.held_chars())
