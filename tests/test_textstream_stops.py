"""What `sapwood serve` streams around stop strings (textstream.IncrementalText, fed piece by
piece): against the naive per-token search, the text shown is always all of it but the
longest suffix that is a proper prefix of some stop string, and the end result is the
naive search's."""
import numpy as np

from sapwood.textstream import IncrementalText


class _Pieces:
    """A tokenizer whose token i decodes to pieces[i]."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)


def _naive_stop(chunks, stops):
    """Model.generate's rule before textstream: after each token, cut at the earliest first
    occurrence of any stop string."""
    text = ""
    for c in chunks:
        text += c
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return text, False


def _held(text, stops):
    """The longest suffix of text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_stream_holds_back_exactly_the_possible_start_of_a_stop_string():
    rng = np.random.default_rng(0)
    for trial in range(400):
        alphabet = list("ab" if trial % 2 else "abc\u00e9")
        stops = ["".join(rng.choice(alphabet, int(rng.integers(1, 5))))
                 for _ in range(int(rng.integers(1, 4)))]
        chunks = ["".join(rng.choice(alphabet, int(rng.integers(1, 4))))
                  for _ in range(int(rng.integers(1, 12)))]
        want, stopped = _naive_stop(chunks, stops)
        inc = IncrementalText(_Pieces(chunks), stops)
        seen = ""
        for i in range(len(chunks)):
            inc.push(i)
            if inc.stop_at >= 0:
                break
            shown = inc.text[:len(inc.text) - inc.held_chars()]
            assert len(shown) == len(inc.text) - _held(inc.text, stops), (stops, chunks)
            assert shown.startswith(seen) and want.startswith(shown), (stops, chunks)
            seen = shown
        got = inc.text[:inc.stop_at] if inc.stop_at >= 0 else inc.text
        assert (got, inc.stop_at >= 0) == (want, stopped), (stops, chunks)
        # the tokens kept are those whose text lies within the result
        ends = np.cumsum([len(c) for c in chunks[:len(inc.ends)]])
        assert inc.tokens_before(len(got)) == int(np.sum(ends <= len(got)))
