"""Text for a token stream: incremental decoding, stop strings, per-token bytes.

A served request turns committed token ids into text deltas as they come, in constant work per
token (decoding the whole output at every token is quadratic), holds back what could still turn
out to be part of a stop string, and attributes text to tokens so that logprobs and usage count
exactly the tokens whose text is returned (as `Model.generate` trims them).
"""
from __future__ import annotations

from collections import deque

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Text deltas of a growing id list. Each step decodes a short window (the ids since the
    last complete text, plus the ids before them that give the tokenizer its context), so a
    token costs O(1) whatever the output length. A delta that would end in U+FFFD (an
    incomplete UTF-8 sequence split over tokens) waits for the next token; flush() gives what
    is left at the end."""

    def __init__(self, decode):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: context ids already turned into text
        self._read = 0    # ids up to here have given their text

    def push(self, tok: int) -> str:
        self._ids.append(int(tok))
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read]) if self._read > self._prefix else ""
        now = self._decode(self._ids[self._prefix:])
        if not final and (len(now) <= len(before) or now.endswith(_REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]


class StopMatcher:
    """Finds stop strings in streamed text in linear time (an Aho-Corasick automaton over the
    stop strings, fed one character at a time) and says how much text is safe to show: all of
    it but the longest suffix that is a prefix of some stop string, which is the automaton's
    depth. Where several stops complete within one fed chunk, the earliest start wins, as
    `Model.generate`'s per-token search (`text.find` of each stop) decides."""

    def __init__(self, stops):
        self._goto: list[dict] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._out: list[int] = [0]  # the longest stop ending at this state (0: none)
        for s in stops:
            state = 0
            for ch in s:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[state][ch] = nxt
                    self._goto.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._out.append(0)
                state = nxt
            self._out[state] = max(self._out[state], len(s))
        self._build_failure_links()
        self._state = 0
        self.length = 0  # characters fed so far

    def _build_failure_links(self) -> None:
        queue = deque(self._goto[0].values())
        while queue:
            s = queue.popleft()
            for ch, t in self._goto[s].items():
                f = self._fail[s]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[t] = 0 if s == 0 else self._goto[f].get(ch, 0)
                # a stop that ends at the failure state ends here as well
                self._out[t] = max(self._out[t], self._out[self._fail[t]])
                queue.append(t)

    def feed(self, text: str) -> int | None:
        """Feed a chunk; the offset (in all text fed) where the earliest stop string completed
        in this chunk starts, or None."""
        cut = None
        for ch in text:
            s = self._state
            while s and ch not in self._goto[s]:
                s = self._fail[s]
            s = self._goto[s].get(ch, 0)
            self._state = s
            self.length += 1
            # every stop ending here: the longest is out[s]; shorter ones start later
            n = self._out[s]
            if n:
                start = self.length - n
                cut = start if cut is None else min(cut, start)
        return cut

    def safe(self) -> int:
        """How many characters of the text fed so far can be shown."""
        return self.length - self._depth[self._state]


class TokenText:
    """What a request's output tokens say, as the client may see it: text released so far,
    and for each token the end offset of its text (a token whose text completes only with a
    later token's bytes ends where that text ends). finish() cuts at a stop string."""

    def __init__(self, decode, stops):
        self._dec = IncrementalDecoder(decode)
        self._stops = StopMatcher(stops) if stops else None
        self.text = ""         # all decoded text (up to the cut once stopped)
        self.ends: list[int] = []  # per token whose text is complete: end offset in self.text
        self._open = 0         # tokens pushed whose text is not complete yet
        self.released = 0      # characters the client may see
        self.stopped = False

    def push(self, tok: int) -> bool:
        """Add a token; True when a stop string completed (the output ends before it)."""
        self._open += 1
        return self._add(self._dec.push(tok))

    def flush(self) -> None:
        """The output ended without a stop string: release everything."""
        if not self.stopped:
            self._add(self._dec.flush())
            self.ends.extend([len(self.text)] * self._open)
            self._open = 0
            self.released = len(self.text)

    def _add(self, delta: str) -> bool:
        if not delta:
            return False
        self.text += delta
        self.ends.extend([len(self.text)] * self._open)
        self._open = 0
        if self._stops is None:
            self.released = len(self.text)
            return False
        cut = self._stops.feed(delta)
        if cut is None:
            self.released = max(self.released, self._stops.safe())
            return False
        # cut >= released: a stop's every proper prefix was held back as it came
        self.text = self.text[:cut]
        self.released, self.stopped = cut, True
        return True

    def kept_tokens(self) -> int:
        """Tokens whose whole text lies within the released text."""
        n = 0
        while n < len(self.ends) and self.ends[n] <= self.released:
            n += 1
        return n


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
