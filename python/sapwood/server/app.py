"""The OpenAI-compatible HTTP API over a Scheduler of slots (FastAPI on uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming with SSE),
GET /v1/models, GET /health, GET /metrics. A request's choices run as jobs on slots; their
events come back from the slots' worker threads through the event loop.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..sampling import SamplingParams
from .metrics import CONTENT_TYPE, Metrics
from .protocol import SEED_LIMIT, ApiError, ChatRequest, CompletionRequest, validation_error
from .slots import ChoiceResult, Delta, Job, QueueFull

# Used when a checkpoint has none (the bundled default): ChatML, the format of Qwen's own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def choice_seed(seed: int, j: int) -> int:
    """Choice j of a request with seed s samples with seed (s + j) mod 2^64: choice j is the
    single-choice request with that seed."""
    return (int(seed) + j) % SEED_LIMIT


class ServerState:
    """What the endpoints share: the scheduler, one model for tokenizing (slot 0's; its
    tokenizer and template, never its engine), defaults, metrics."""

    def __init__(self, scheduler, cache, model_id: str, token_bytes=None):
        self.scheduler, self.cache, self.model_id = scheduler, cache, model_id
        self.model = scheduler.slots[0].model
        self.max_context = self.model.max_context
        self.token_bytes = token_bytes
        self.metrics = Metrics(scheduler, cache)
        self.created = int(time.time())
        gen = self.model.generation_config
        # as vLLM: the checkpoint's generation_config gives the defaults of unset fields
        sampled = bool(gen.get("do_sample", False))
        self.defaults = dict(temperature=float(gen.get("temperature", 1.0)) if sampled else 0.0,
                             top_p=float(gen.get("top_p", 1.0)) if sampled else 1.0,
                             top_k=int(gen.get("top_k", 0) or 0) if sampled else 0)

    def token_str(self, tok: int) -> str:
        """A token's text; one that alone is an incomplete UTF-8 sequence as its bytes,
        "bytes:\\xe2\\x80" (the OpenAI API's notation), so that such tokens stay apart."""
        s = self.model.decode([tok])
        if "\ufffd" in s and self.token_bytes is not None:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(tok))
        return s

    def token_b(self, tok: int) -> list:
        if self.token_bytes is not None:
            return self.token_bytes(tok)
        return list(self.model.decode([tok]).encode("utf-8"))


def _first_keys(pairs) -> dict:
    out: dict = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Call:
    """One API request in flight: its jobs, their events, the response pieces."""

    def __init__(self, st: ServerState, chat: bool, req, prompts: list, limit: int | None,
                 logprobs: int | None):
        self.st, self.chat, self.req = st, chat, req
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        opts = req.sapwood
        seed = req.seed if req.seed is not None else secrets.randbits(64)
        d = st.defaults
        self.prompts = prompts
        self.jobs = []
        for i, ids in enumerate(prompts):
            room = st.max_context - len(ids)
            max_tokens = limit if limit is not None else (16 if not chat else room)
            if max_tokens > room:
                raise ApiError(400, f"this model's context holds {st.max_context} tokens; the "
                                    f"prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                                    f"more (at most {room})", "max_tokens",
                               code="context_length_exceeded")
            for j in range(req.n):
                params = SamplingParams(
                    temperature=d["temperature"] if req.temperature is None else req.temperature,
                    top_p=d["top_p"] if req.top_p is None else req.top_p,
                    top_k=d["top_k"] if req.top_k is None else max(req.top_k, 0),
                    min_p=0.0 if req.min_p is None else req.min_p,
                    seed=choice_seed(seed, j), repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty)
                self.jobs.append(Job(i * req.n + j, list(ids), max_tokens, params, opts.verify,
                                     opts.width, opts.drafter, req.stops(), logprobs, self._emit,
                                     stream=req.stream))
        self.results: dict[int, ChoiceResult] = {}
        self.error: Exception | None = None

    def _emit(self, kind, payload) -> None:  # on a slot's worker thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        for j in self.jobs:
            j.cancelled.set()

    @property
    def pending(self) -> int:
        return len(self.jobs) - len(self.results) - (self.error is not None)

    def take(self, kind, payload):
        """Book an event; the error an 'error' event carries is kept and the rest cancelled."""
        if kind == "done":
            self.results[payload.index] = payload
        elif kind == "error":
            self.error = payload
            self.cancel()

    # -- response pieces -------------------------------------------------------------------
    def logprobs_obj(self, tokens, logprobs, ends, start: int = 0):
        st = self.st
        if self.chat:
            content = []
            for tok, (lp, top) in zip(tokens, logprobs):
                content.append({"token": st.token_str(tok), "logprob": lp, "bytes": st.token_b(tok),
                                "top_logprobs": [{"token": st.token_str(t), "logprob": v,
                                                  "bytes": st.token_b(t)} for t, v in top]})
            return {"content": content, "refusal": None}
        offsets = [start] + list(ends[:-1]) if ends else []
        return {"tokens": [st.token_str(t) for t in tokens],
                "token_logprobs": [lp for lp, _ in logprobs],
                # keyed by text: where two ids share one, the likelier keeps it
                "top_logprobs": [_first_keys((st.token_str(t), v) for t, v in top)
                                 for _, top in logprobs],
                "text_offset": offsets[:len(tokens)]}

    def want_logprobs(self) -> bool:
        return self.jobs[0].logprobs is not None

    def usage(self) -> dict:
        n = self.req.n
        prompt = sum(len(p) for p in self.prompts)
        done = list(self.results.values())
        cached = sum(r.cached_tokens for r in done if r.index % n == 0)
        completion = sum(len(r.tokens) for r in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def extension(self) -> dict:
        """The `sapwood` field of a response: per choice its seed, slot, what it prefilled and
        restored, and its decoding statistics."""
        out = []
        for i in sorted(self.results):
            r = self.results[i]
            c = {"index": i, "seed": r.seed, "slot": r.slot, "cached_tokens": r.cached_tokens,
                 "prefilled_tokens": r.prefilled_tokens,
                 "stats": {k: v for k, v in r.stats.as_dict().items()}}
            if self.req.sapwood.return_token_ids:
                c["token_ids"] = list(r.tokens)
            out.append(c)
        return {"choices": out}

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.st.model_id}

    def response(self) -> dict:
        choices = []
        for i in sorted(self.results):
            r = self.results[i]
            lp = self.logprobs_obj(r.tokens, r.logprobs, r.ends) if self.want_logprobs() else None
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": r.text},
                                "logprobs": lp, "finish_reason": r.finish_reason})
            else:
                choices.append({"index": i, "text": r.text, "logprobs": lp,
                                "finish_reason": r.finish_reason})
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage(), "sapwood": self.extension()}

    def chunk(self, index: int, text: str | None, lp, finish: str | None, first: bool) -> dict:
        if self.chat:
            delta = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [c]}
        c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [c]}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(st: ServerState) -> FastAPI:
    app = FastAPI(title="sapwood", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sapwood = st
    m = st.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: say so, keep serving
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                        type="server_error"))

    @app.get("/health")
    async def health():
        s = st.scheduler
        return {"status": "ok", "model": st.model_id, "slots": len(s.slots), "busy": s.busy,
                "queue": s.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model_id, "object": "model",
                                            "created": st.created, "owned_by": "sapwood",
                                            "max_model_len": st.max_context}]}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        try:
            call = _admit(st, await request.body(), chat)
        except ApiError as e:
            m.requests.labels(endpoint, str(e.status)).inc()
            return _error_response(e)
        if call.req.stream:
            return StreamingResponse(_stream(call, endpoint, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            checked = time.monotonic()
            while call.pending:
                try:
                    kind, payload = await asyncio.wait_for(call.events.get(), timeout=0.1)
                    call.take(kind, payload)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - checked >= 0.1:
                    checked = time.monotonic()
                    if await request.is_disconnected():  # nobody to answer: free the slots
                        call.cancel()
                        m.requests.labels(endpoint, "499").inc()
                        return Response(status_code=499)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if call.error is not None:
            return _failed(call, endpoint)
        m.requests.labels(endpoint, "200").inc()
        m.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return JSONResponse(call.response())

    def _failed(call, endpoint):
        e = call.error
        err = e if isinstance(e, ApiError) else ApiError(
            400 if isinstance(e, ValueError) else 500, f"{type(e).__name__}: {e}",
            type="invalid_request_error" if isinstance(e, ValueError) else "server_error")
        m.requests.labels(endpoint, str(err.status)).inc()
        return _error_response(err)

    async def _stream(call: _Call, endpoint: str, t0: float):
        started = set()
        try:
            while call.pending:
                kind, payload = await call.events.get()
                call.take(kind, payload)
                if kind == "error":
                    err = payload if isinstance(payload, ApiError) else ApiError(
                        500, f"{type(payload).__name__}: {payload}", type="server_error")
                    yield _sse(err.body())
                    break
                if kind == "delta":
                    d: Delta = payload
                    lp = (call.logprobs_obj(d.tokens, d.logprobs, d.ends, d.start)
                          if call.want_logprobs() and d.tokens else None)
                    yield _sse(call.chunk(d.index, d.text, lp, None, d.index not in started))
                    started.add(d.index)
                elif kind == "done":
                    r: ChoiceResult = payload
                    yield _sse(call.chunk(r.index, None if call.chat else "", None,
                                          r.finish_reason, r.index not in started))
                    started.add(r.index)
            else:
                opts = call.req.stream_options
                if opts is not None and opts.include_usage:
                    yield _sse({**call.head("chat.completion.chunk" if call.chat
                                            else "text_completion"),
                                "choices": [], "usage": call.usage(), "sapwood": call.extension()})
            yield "data: [DONE]\n\n"
            m.requests.labels(endpoint, "200").inc()
            m.latency.labels(endpoint).observe(time.perf_counter() - t0)
        finally:  # the client went away (or the stream ended): stop what still runs
            call.cancel()

    return app


def _admit(st: ServerState, raw: bytes, chat: bool) -> _Call:
    """Parse and check a request body, encode its prompts and queue its jobs."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}",
                       code="invalid_json")
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model != st.model_id:
        raise ApiError(404, f"model {req.model!r} is not served here (this server serves "
                            f"{st.model_id!r})", "model", code="model_not_found")
    model, vocab = st.model, st.model.config.vocab_size
    if chat:
        try:
            text = model.apply_chat_template([msg.as_template_dict() for msg in req.messages])
        except Exception as e:  # jinja2 errors of the template (e.g. its raise_exception)
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           "messages") from None
        prompts = [model.encode(text)]
        limit, logprobs = req.limit(), req.logprob_count()
    else:
        prompts = []
        for i, p in enumerate(req.prompt):
            ids = model.encode(p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                    f"[0, {vocab})", "prompt")
            prompts.append(ids)
        limit, logprobs = req.max_tokens, req.logprobs
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "messages" if chat else "prompt")
        if len(ids) >= st.max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context holds "
                                f"{st.max_context} (at most {st.max_context - 1} prompt tokens, "
                                "leaving room for one generated)", "messages" if chat else "prompt",
                           code="context_length_exceeded")
    if req.sapwood.drafter == "model" and st.scheduler.slots[0].draft_model is None:
        raise ApiError(400, "sapwood.drafter='model': this server has no draft model (start it "
                            "with --drafter)", "sapwood.drafter")
    if req.sapwood.drafter == "mtp" and st.scheduler.slots[0].model.mtp is None:
        why = st.scheduler.slots[0].model.mtp_unsupported or "this server's model has no MTP head"
        raise ApiError(400, f"sapwood.drafter='mtp': {why}", "sapwood.drafter")
    call = _Call(st, chat, req, prompts, limit, logprobs)
    try:
        st.scheduler.submit(call.jobs)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e}", type="server_error",
                       code="queue_full") from None
    return call
