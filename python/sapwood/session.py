"""A sequence of a model and the requests decoded on it, one at a time: the one front door.

`Model.generate` runs each request on a fresh Session, the CLI's chat runs its turns on one (a
turn whose prompt extends what the engine holds prefills only the new tokens), and every
server slot runs its jobs through one. What each of them needs around the decoding loop
(generate.Decoder) lives here once: the prefill (or a continued or restored state), stop
strings, and the text as it grows, released in chunks that are never withdrawn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from .generate import DecodeConfig, Decoder, GenerationResult, GenerationStats
from .textstream import IncrementalText


@dataclass
class Chunk:
    """Text and tokens released together. A token is released once every continuation keeps
    it (a stop string may still begin in the text after it: held back until resolved), and
    its text once it is complete (no half of a UTF-8 character)."""
    text: str                   # the new text ("" without a tokenizer, or while incomplete)
    tokens: list                # the ids released with it
    ends: list                  # per token: where its text ends in the output
    start: int                  # where the first token's text starts in the output
    finish_reason: str | None = None  # the last chunk's: "stop" | "length" | "context"


@dataclass
class Outcome:
    """A finished request: the tokens and text kept (a stop string and what follows it cut),
    why it ended ("stop", "length", "context", or "cancelled" when `cancelled` said so), the
    stats, per token where its text ends, and the committed tokens the engine holds."""
    tokens: list
    text: str
    finish_reason: str
    stats: GenerationStats
    ends: list = field(default_factory=list)
    context: list = field(default_factory=list)

    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.text, self.stats, self.finish_reason)


class Session:
    """One sequence of `model`, entered by one thread. `engine`: what the decoding loop drives
    (the model's engine, or a server slot's recording wrapper of it)."""

    def __init__(self, model, engine=None):
        self.model = model
        self.engine = engine if engine is not None else model.engine
        self.context: list[int] = []  # the committed tokens the engine holds after a request
        self.continued = 0  # the last request's prompt tokens that were held, not prefilled
        self.stats = GenerationStats()
        self.drafter, self._drafter_spec = None, None
        self._held = False  # run(): do the engines hold this session's context?

    def drafter_for(self, spec):
        """The drafter `spec` names (Model.resolve_drafter), kept while requests name the same
        one: a draft model's committed state then follows the session's between requests."""
        if self.drafter is None or spec != self._drafter_spec:
            # a new drafter has seen none of the held sequence (and a draft model loaded once
            # per target may hold another request's state): the next prefill starts afresh
            # and resets it
            self.drafter = self.model.resolve_drafter(spec)
            self._drafter_spec, self.context = spec, []
        return self.drafter

    def prefill(self, ids: list, drafter=None):
        """The prompt's last logits: only the tokens after the held context when `ids` extends
        it (a chat's next turn), else from an empty sequence (the drafter starting afresh)."""
        eng, held = self.engine, self.context
        self.context = []  # until the request ends, the engine's context is the Decoder's
        if (self._held and held and len(ids) > len(held) and ids[:len(held)] == held
                and eng.position == len(held)):
            self.continued = len(held)
            return eng.prefill(ids[len(held):])
        self.continued = 0
        if eng.position:
            eng.reset()
        reset_drafter(drafter)
        return eng.prefill(ids)

    def run(self, ids: list, cfg: DecodeConfig, drafter, *, stops=(), text: bool = True,
            prefill: Callable | None = None, on_round=None,
            cancelled: Callable[[], bool] | None = None) -> Iterator[Chunk]:
        """Decode one request after `ids`: a generator of Chunks as they are released, which
        returns the Outcome (StopIteration's value). Arguments are checked now, before it
        starts. text=False skips the text as it grows (no stop
        strings; chunks carry tokens only, the final text is decoded once). `prefill(ids)`
        replaces Session.prefill (a prompt or snapshot cache); `cancelled()`, asked after every
        token, ends the request at once ("cancelled": no final chunk)."""
        model = self.model
        tok = model.tokenizer
        if stops and tok is None:
            raise ValueError(f"stop={list(stops)!r}: stop strings need the checkpoint's "
                             "tokenizer.json, which this model has none of (stop on token ids "
                             "with generation_config's eos_token_id)")
        dec = Decoder(self.engine, drafter, cfg, policy=model.speculation_policy(drafter),
                      on_round=on_round)
        self.stats = dec.stats  # the running request's, as they stand
        # the engines still hold this session's sequence unless another request ran on them
        # since (a draft model is shared by every request of its target)
        models = [model] + [getattr(drafter, "model", None)] * hasattr(drafter, "sync")
        self._held = all(getattr(m, "_session", None) is self for m in models)
        for m in models:
            m._session = self
        inc = IncrementalText(tok, stops, model.tokenizer_file) if text and tok is not None else None
        return self._steps(dec, inc, ids, prefill or (lambda p: self.prefill(p, drafter)),
                           cancelled)

    def _steps(self, dec, inc, ids, prefill, cancelled) -> Iterator[Chunk]:
        tok = self.model.tokenizer
        tokens: list[int] = []
        chars = sent = 0  # characters and tokens released
        finish = None
        steps = dec.run(ids, prefill)
        try:
            for t in steps:
                tokens.append(t)
                if inc is not None:
                    inc.push(t)
                    if inc.stop_at >= 0:
                        finish = "stop"
                        break
                if cancelled is not None and cancelled():
                    finish = "cancelled"
                    break
                if inc is None:
                    shown, safe = 0, len(tokens)
                else:
                    shown, safe = len(inc.text) - inc.held_chars(), inc.safe_tokens()
                if shown > chars or safe > sent:
                    yield _chunk(inc.text if inc else "", inc.ends if inc else [], tokens,
                                 chars, shown, sent, safe)
                    chars, sent = max(chars, shown), max(sent, safe)
        except GeneratorExit:  # closed early: the engine holds what was committed
            self.context = list(dec.context)
            raise
        except BaseException:  # the engine's state is not known to follow the context
            self.context = []
            raise
        finally:
            steps.close()
        self.context = list(dec.context)
        if finish == "stop":
            body, kept = inc.text[:inc.stop_at], inc.tokens_before(inc.stop_at)
        else:
            # the whole output, a last unfinished character included
            body = self.model.decode(tokens) if tok is not None else ""
            kept = len(tokens)
            finish = finish or dec.finish_reason
        ends = ((inc.ends if inc else []) + [len(body)] * len(tokens))[:kept]
        if finish != "cancelled":
            last = _chunk(body, ends, tokens, chars, len(body), sent, kept)
            last.finish_reason = finish
            yield last
        dec.stats.tokens = kept
        return Outcome(tokens[:kept], body, finish, dec.stats, ends, self.context)


def reset_drafter(drafter) -> None:
    """A drafter starts afresh (one of the caller's own may have no state, hence no reset)."""
    if hasattr(drafter, "reset"):
        drafter.reset()


def _chunk(text, ends, tokens, chars, shown, sent, safe) -> Chunk:
    """The chunk released between (chars, sent) and (shown, safe)."""
    return Chunk(text[chars:max(chars, shown)], tokens[sent:safe], ends[sent:safe],
                 ends[sent - 1] if 0 < sent <= len(ends) else 0)


class Stream:
    """generate(stream=True)'s iterator of Chunks (text pieces with their token ids; the last
    one has finish_reason), then `result` (a GenerationResult, also StopIteration's value).
    The model stays claimed until the stream is exhausted, closed or dropped; a generator
    closed before it started runs no cleanup, hence `release`.

    stats: the request's GenerationStats as they stand, final once the stream has ended,
    closed or been interrupted (a stream cut short by Ctrl-C has no result: `sapwood
    generate` reports these)."""

    def __init__(self, gen, release, stats):
        self._gen, self._release, self.stats = gen, release, stats
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        try:
            return next(self._gen)
        except StopIteration as fin:
            self.result = fin.value
            raise

    def text(self) -> Iterator[str]:
        """Just the text pieces (mlx-lm's stream_generate-style loop)."""
        for c in self:
            if c.text:
                yield c.text

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self._release()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
