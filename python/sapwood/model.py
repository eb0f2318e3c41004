"""`Model`: a loaded checkpoint (engine, tokenizer, config). Build one with `sapwood.load`."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .config import FULL, ModelConfig

_NO_DEFAULT = object()


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
        self.special_tokens = {}  # bos_token, eos_token, ...: chat template variables
        self.draft = None        # an attached draft Model (the bundled default has one)
        self._mtp = None         # the checkpoint's MTP head (the `mtp` property)
        self.mtp_loader = None   # (engine, threads) -> _core.MtpHead: builds it on first use
        self.mtp_unsupported = None  # why a head the checkpoint has is not run
        # per drafter (speculation_policy()): costs and acceptance calibration across requests
        self._policies: dict = {}
        self.policy_cache = True  # policy_cache.py: keep the calibration across processes
        # One request at a time: generate() resets the engine, so a second request (another
        # thread, a stream left open, a call from on_round) would corrupt the first one's state.
        self._busy = threading.Lock()
        self._busy_thread = None

    def new_sequence(self, *, threads=None) -> "Model":
        """Another Model of these weights with its own sequence state: its engine shares this
        one's weights (one copy, on a GPU backend the same device buffers; `engine.memory()`
        counts them for each), its attached draft model is the draft's own new_sequence(), and
        an MTP head gets a head of its own. Outputs are the bits a separately loaded Model
        gives. The two run requests side by side (one each at a time), and their verify rounds
        can share one forward (`sapwood._core.verify_many`). threads: the engine's worker
        threads (None: this engine's)."""
        eng = self.engine.new_sequence(threads=0 if threads is None else int(threads))
        m = Model(eng, self.tokenizer, self.config, self.generation_config, self.chat_template,
                  self.path, weights=self.weights, kv=self.kv, backend=self.backend,
                  max_context=self.max_context)
        m.policy_cache = self.policy_cache
        m.mtp_unsupported = self.mtp_unsupported
        if self.draft is not None:
            m.draft = self.draft.new_sequence(threads=threads)
        m.mtp_loader = self.mtp_loader  # a head of its own, built on first use
        return m

    @property
    def mtp(self):
        """The checkpoint's MTP head (_core.MtpHead) or None: built from the checkpoint's files
        the first time it is asked for, so a load reads and stores only what is used."""
        if self._mtp is None and self.mtp_loader is not None:
            self._mtp = self.mtp_loader(self.engine, self.engine.threads)
        return self._mtp

    @mtp.setter
    def mtp(self, head) -> None:
        self._mtp = head

    def _claim(self) -> None:
        """Take this model for one request, or raise if a request is running on it."""
        if self._busy.acquire(blocking=False):
            self._busy_thread = threading.get_ident()
            return
        where = ("on this thread (a stream not yet finished or closed, or a call from on_round)"
                 if self._busy_thread == threading.get_ident() else "on another thread")
        raise RuntimeError(f"{self!r} is in use by another request {where}: a Model runs one "
                           "request at a time (finish or close the stream first, give each "
                           "thread its own Model, or serialise the calls)")

    def _release(self) -> None:
        self._busy_thread = None
        self._busy.release()

    def _tok(self):
        if self.tokenizer is None:
            raise RuntimeError(f"{self.path}: no tokenizer.json was loaded; work with token ids")
        return self.tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. from a chat template) are
        recognised either way; add_special_tokens only adds the tokenizer's post-processor
        tokens, which Qwen tokenizers do not have, so the default keeps the text as written."""
        from .tokenizing import guarded

        # a crafted tokenizer.json can make tokenizers panic on some text (tokenizing.py):
        # a ValueError naming the file, not a BaseException past every `except Exception`
        return guarded(self.tokenizer_file, "encoding a text", self._tok().encode, text,
                       add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        from .tokenizing import guarded

        return guarded(self.tokenizer_file, "decoding token ids", self._tok().decode,
                       [int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def tokenizer_file(self):
        """The tokenizer's file, as errors name it."""
        return "tokenizer.json" if self.path is None else self.path / "tokenizer.json"

    def eos_ids(self) -> tuple:
        eos = self.generation_config.get("eos_token_id", self.config.eos_token_ids)
        eos = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        return tuple(int(e) for e in eos)

    def resolve_drafter(self, drafter):
        """None -> an attached draft model (model.draft: the user's, or load("default")'s),
        else the checkpoint's MTP head, else prompt lookup; "mtp"; "lookup"; "default" (the
        bundled draft); a checkpoint path; a loaded Model; or any object with draft/advance."""
        from .drafters import resolve_drafter
        return resolve_drafter(self, drafter)

    def speculation_policy(self, drafter):
        """The speculation policy's state (policy.Policy) for requests drafted by `drafter` (a
        resolved drafter; None for plain decoding), kept across requests and, unless turned off
        (policy_cache.py), across processes. Not shared between drafters: the acceptance
        calibration maps a drafter's own confidences, and drafting costs are part of a round's."""
        from . import policy_cache
        from .policy import Policy

        key = getattr(drafter, "policy_key", None) or (type(drafter).__module__,
                                                        type(drafter).__qualname__)
        if key not in self._policies:
            pol = self._policies[key] = Policy()
            if drafter is not None and self.policy_cache and policy_cache.enabled():
                d = getattr(drafter, "model", None)
                policy_cache.attach(pol, policy_cache.key(
                    self.identity(), d.identity() if isinstance(d, Model) else repr(key)))
        return self._policies[key]

    def identity(self) -> dict:
        """What makes this model's costs and acceptance its own (the policy cache's key)."""
        import hashlib
        import json

        cfg = json.dumps(getattr(self.config, "__dict__", str(self.config)), sort_keys=True,
                         default=str)
        return {"path": str(self.path), "config": hashlib.sha256(cfg.encode()).hexdigest()[:16],
                "weights": self.weights, "kv": self.kv, "backend": self.backend,
                "threads": self.engine.threads if hasattr(self.engine, "threads") else None}

    @contextmanager
    def policy_state(self, state: dict):
        """Requests in this block learn and use the speculation policy kept in `state` (a dict
        the model fills with its width rules) instead of the model's own: `sapwood bench ab`
        gives each arm its own, as two servers of the two configurations would have."""
        saved, self._policies = self._policies, state
        cache, self.policy_cache = self.policy_cache, False  # an arm learns from its own rounds only
        try:
            yield
        finally:
            self._policies, self.policy_cache = saved, cache

    def reset_policies(self) -> None:
        """Forget what the speculation policy measured (a fresh process's first request, the
        policy cache aside)."""
        self._policies.clear()

    def generate(self, prompt, *, max_tokens=256, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                 seed=0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 drafter=None, verify="auto", width=None, rows=8, adapt_rows=True, stop=None,
                 stream=False, cache_prompt=False, on_round=None, session=None,
                 json_schema=None, regex=None, grammar=None):
        """Generate from `prompt` (text, token ids, or chat messages when the checkpoint has a
        chat template). Output is identical for every verify mode, width and drafter.
        rows: draft rows per round; with adapt_rows (chain and auto) the most, fewer while the
        draft keeps few of them.

        Returns a GenerationResult (tokens, text, stats, finish_reason). With stream=True, a
        Stream of Chunks: text pieces as they become final (never half a character, stop
        strings held back until resolved) with their token ids, the last one with its
        finish_reason; then `stream.result` holds the GenerationResult (and `stream.stats` the
        request's stats so far, for a stream that is closed or interrupted).
        cache_prompt=True restores the committed state of an identical previous prompt
        instead of prefilling it again, the target's and a draft model's (benchmarks of long
        contexts use it). session: a Session of this model (Model.session()) to run on, which
        keeps the sequence between requests: a prompt that extends the tokens it holds (a
        chat's next turn) prefills only the new ones.
        json_schema (a dict or its JSON text) / regex / grammar (Lark, or GBNF): every token is
        drawn among those the constraint allows (grammar.py), identically in every mode; the
        request ends when the constraint is complete (its eos).
        """
        from .generate import DecodeConfig
        from .sampling import SamplingParams
        from .session import Session, Stream, reset_drafter

        ids = self._prompt_ids(prompt)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                seed=seed, repetition_penalty=repetition_penalty,
                                presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        constraint = None
        if json_schema is not None or regex is not None or grammar is not None:
            from .grammar import compile_constraint
            constraint = compile_constraint(self, json_schema=json_schema, regex=regex,
                                            grammar=grammar)
        cfg = DecodeConfig(max_tokens=max_tokens, params=params, verify=verify, width=width,
                           rows=rows, adapt_rows=adapt_rows, stop_ids=self.eos_ids(),
                           constraint=constraint).validate()
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        claimed = []

        def release():  # idempotent: the stream's close and the generator's cleanup both call it
            while claimed:
                claimed.pop()._release()

        if session is not None and (session.model is not self or cache_prompt):
            raise ValueError("session= takes a Session of this model (Model.session()), "
                             "without cache_prompt (the session holds the sequence itself)")
        try:
            self._claim()
            claimed.append(self)
            fresh = session is None
            if fresh:
                session = Session(self)
            d = None if verify == "off" else session.drafter_for(drafter)
            draft_model = getattr(d, "model", None)
            if isinstance(draft_model, Model):  # its engine is this request's too
                draft_model._claim()
                claimed.append(draft_model)
            if hasattr(d, "prompt_cache_len"):  # a draft model caches its prompt state alike
                d.prompt_cache_len = len(ids) if cache_prompt else 0
            if fresh and cache_prompt:  # its prefill restores or appends: from empty
                self.engine.reset()
                reset_drafter(d)
            steps = session.run(ids, cfg, d, stops=stops, text=bool(stream or stops),
                                prefill=self._cached_prefill if cache_prompt else None,
                                on_round=on_round)
        except BaseException:
            release()
            raise

        def run():
            try:
                return (yield from steps).result()
            finally:
                release()

        if stream:
            return Stream(run(), release, session.stats)
        gen = run()
        try:
            while True:
                next(gen)
        except StopIteration as fin:
            return fin.value

    def session(self):
        """A Session of this model: generate(..., session=) keeps the sequence between requests
        (sapwood generate --chat's turns)."""
        from .session import Session

        return Session(self)

    def prompt_cached(self, ids) -> bool:
        """Would _cached_prefill(ids) restore a snapshot instead of prefilling?"""
        cache = getattr(self, "_prompt_cache", None)
        return cache is not None and cache[0] == list(ids)

    def _cached_prefill(self, ids):
        return self._restore_or_prefill(ids)[0]

    def _restore_or_prefill(self, ids):
        """(the prompt's last logits, whether they came from the prompt cache): restores the
        snapshot of an identical previous prompt, else prefills and keeps a snapshot."""
        if self.prompt_cached(ids):
            cache = self._prompt_cache
            self.engine.restore(cache[1])
            return cache[2], True
        logits = self.engine.prefill(ids)
        self._prompt_cache = (list(ids), self.engine.snapshot(), logits)
        return logits, False

    def _prompt_ids(self, prompt) -> list:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            return self.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise ValueError(f"prompt is {type(prompt).__name__}: pass text as str (decode it "
                             "first) or token ids as a list of ints")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self.encode(self.apply_chat_template(prompt))
        if isinstance(prompt, np.ndarray) and (prompt.ndim != 1 or prompt.dtype.kind not in "iu"):
            raise ValueError(f"prompt array of dtype {prompt.dtype} and shape {prompt.shape}: "
                             "token ids must be a 1-D integer array")
        try:
            ids = list(prompt)
        except TypeError:
            raise ValueError(f"prompt must be text, token ids or chat messages, got "
                             f"{type(prompt).__name__}") from None
        if not ids:
            raise ValueError("empty prompt")
        for i, t in enumerate(ids):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"prompt token id {t!r} at index {i} is not an integer")
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_kwargs) -> str:
        """The messages as the checkpoint's chat template writes them. The template is the
        checkpoint's code, so it runs sandboxed (chat_template.py); template_kwargs reach it too
        (tools, enable_thinking, ...), as do the tokenizer's special tokens (bos_token,
        eos_token, ...: special_tokens), as transformers passes them. A checkpoint without a template gets ChatML, with a
        warning (chat_template.template_for). ValueError when it fails, refuses the messages
        (raise_exception) or tries what the sandbox forbids."""
        from .chat_template import compile_chat_template, render_chat_template, template_for

        want = template_for(self.chat_template, self.path or "this model")  # none: ChatML
        # compiled once, not per request; keyed by the source since callers may replace
        # chat_template
        src, compiled = getattr(self, "_compiled_chat_template", None) or (None, None)
        if src != want:
            src = want
            compiled = compile_chat_template(src)
            self._compiled_chat_template = (src, compiled)
        return render_chat_template(compiled, **{**self.special_tokens, **template_kwargs},
                                    messages=messages, add_generation_prompt=add_generation_prompt)

    def __repr__(self) -> str:
        c = self.config
        n_attn = sum(t == FULL for t in c.layer_types)
        name = self.path.name if self.path is not None else "?"
        return (f"Model({name!r}, layers={c.num_layers} ({c.num_layers - n_attn} GDN + {n_attn} "
                f"attention), hidden={c.hidden_size}, vocab={c.vocab_size}, weights={self.weights}, "
                f"kv={self.kv}, backend={self.backend}, max_context={self.max_context})")
