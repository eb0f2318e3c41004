"""The OpenAI-compatible HTTP API over a Scheduler of slots (FastAPI on uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (streaming
with SSE; responses.py translates a Responses request into the chat request it means),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics. A request's choices run as jobs
on slots; their events come back from the slots' worker threads through the event loop. Every
error, the framework's own included (an unknown route, a wrong method), is an OpenAI error
object: clients read `error.message`, and FastAPI's `{"detail": ...}` left them with none.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .access import add_access, check_api_key, check_origins
from . import responses
from .admit import (DEFAULT_MAX_BODY_MB, Admitted, parse_body, prepare, read_body,
                    sampling_params)
from .metrics import CONTENT_TYPE, Metrics
from .protocol import SEED_LIMIT, ApiError
from . import tools as tools_
from .reasoning import PARSERS, Splitter, split, template_thinks
from .slots import ChoiceError, ChoiceResult, Delta, Job, QueueFull, TooManyChoices
from .text import chars_per_token_bound

def choice_seed(seed: int, j: int) -> int:
    """Choice j of a request with seed s samples with seed (s + j) mod 2^64: choice j is the
    single-choice request with that seed."""
    return (int(seed) + j) % SEED_LIMIT


class ServerState:
    """What the endpoints share: the scheduler, one model for tokenizing (slot 0's; its
    tokenizer and template, never its engine), defaults, metrics."""

    def __init__(self, scheduler, cache, model_id: str, token_bytes=None,
                 max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2 ** 20),
                 api_key: str | None = None, cors_origins=(), reasoning_parser: str = "auto",
                 aliases=()):
        self.scheduler, self.cache, self.model_id = scheduler, cache, model_id
        # every name a client may send: the served name first, then its aliases
        self.model_names = tuple(dict.fromkeys([model_id, *aliases]))
        for name in self.model_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"served model name {name!r}: must be a non-empty string")
        # access.py: None serves everyone; origins () turns CORS off
        self.api_key = None if api_key is None else check_api_key(api_key)
        self.cors_origins = check_origins(cors_origins)
        self.model = scheduler.slots[0].model
        self.max_context = self.model.max_context
        self.token_bytes = token_bytes
        self.max_body_bytes = int(max_body_bytes)
        # characters one token covers at most (None: no such bound): admit.check_prompt_chars
        self.chars_per_token = chars_per_token_bound(self.model.tokenizer)
        # admission's parsing, templates and tokenizing, off the event loop (admit.py)
        self.executor = ThreadPoolExecutor(thread_name_prefix="sapwood-admit")
        self.metrics = Metrics(scheduler, cache)
        self.created = int(time.time())
        if reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser={reasoning_parser!r}: must be one of {PARSERS}")
        # reasoning.py: split Qwen3.5's <think> blocks into reasoning_content
        self.reasoning = reasoning_parser == "qwen3" or (
            reasoning_parser == "auto" and template_thinks(self.model.chat_template))
        gen = self.model.generation_config
        # as vLLM: the checkpoint's generation_config gives the defaults of unset fields
        sampled = bool(gen.get("do_sample", False))
        self.defaults = dict(temperature=float(gen.get("temperature", 1.0)) if sampled else 0.0,
                             top_p=float(gen.get("top_p", 1.0)) if sampled else 1.0,
                             top_k=int(gen.get("top_k", 0) or 0) if sampled else 0)

    def close(self) -> None:
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def model_not_found(self, name: str) -> ApiError:
        served = ", ".join(repr(n) for n in self.model_names)
        return ApiError(404, f"model {name!r} is not served here (this server serves "
                             f"{served})", "model", code="model_not_found")

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

    def __init__(self, st: ServerState, chat: bool, adm: Admitted):
        self.st, self.chat, self.req = st, chat, adm.req
        req = adm.req
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        opts = req.sapwood
        seed = req.seed if req.seed is not None else secrets.randbits(64)
        self.prompts = adm.prompts
        self.jobs = []
        for i, (ids, max_tokens) in enumerate(zip(adm.prompts, adm.max_tokens)):
            for j in range(req.n):
                params = sampling_params(st, req, choice_seed(seed, j))
                self.jobs.append(Job(i * req.n + j, list(ids), max_tokens, params, opts.verify,
                                     opts.width, opts.drafter, req.stops(), adm.logprobs,
                                     self._emit, stream=req.stream,
                                     constraint=adm.constraint))
        # reasoning.py: a chat's <think> block goes to reasoning_content, split per choice
        self.split = chat and st.reasoning
        self.thinking = adm.thinking
        self.splitters: dict[int, Splitter] = {}
        self.tools = adm.tools  # tools.py: the output's tool-call blocks become tool_calls
        self.tool_streams: dict[int, tools_.Stream] = {}
        self.results: dict[int, ChoiceResult] = {}
        self.ended: set[int] = set()   # choices that reported (result, error or cancelled)
        self.error: BaseException | None = None

    def _emit(self, kind, payload) -> None:  # on a slot's worker thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.st.scheduler.cancel(self.jobs)

    @property
    def pending(self) -> int:
        """Choices yet to report: every one ends in a result, an error or a cancellation."""
        return len(self.jobs) - len(self.ended)

    def take(self, kind, payload):
        """Book an event; the first error is kept (the request's answer) and the rest of its
        choices are cancelled."""
        if kind == "done":
            self.results[payload.index] = payload
            self.ended.add(payload.index)
        elif kind == "error":
            e: ChoiceError = payload
            self.ended.add(e.index)
            if self.error is None:
                self.error = e.error
                self.cancel()
        elif kind == "cancelled":
            self.ended.add(payload)

    def failure(self) -> ApiError | None:
        """The request's error: a choice's, or choices that ended without a result (cancelled
        before they ran: only a server shutting down does that while the client waits)."""
        if self.error is not None:
            return api_error(self.error)
        missing = sorted(set(range(len(self.jobs))) - set(self.results))
        if missing:
            return ApiError(503, f"choice {missing[0]} was cancelled before it ran (the server "
                                 "is shutting down)", type="server_error", code="cancelled")
        return None

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
                msg = {"role": "assistant", "content": r.text}
                if self.split:
                    msg["reasoning_content"], msg["content"] = split(r.text, self.thinking)
                finish = r.finish_reason
                if self.tools:
                    content, calls = tools_.parse(msg["content"], self.tools)
                    if calls:
                        msg["content"], msg["tool_calls"] = content or None, calls
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": msg, "logprobs": lp,
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": r.text, "logprobs": lp,
                                "finish_reason": r.finish_reason})
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage(), "sapwood": self.extension()}

    def split_delta(self, index: int, text: str | None, end: bool = False) -> tuple:
        """(reasoning, content) of a streamed piece of choice `index` (None: none of it);
        end: the choice is done, flush what a possible tag held back."""
        r, c = None, text
        if self.split:
            sp = self.splitters.setdefault(index, Splitter(self.thinking))
            r, c = sp.finish() if end else sp.push(text or "")
        if self.tools:  # content up to a possible call; the calls come with the end
            ts = self.tool_streams.setdefault(index, tools_.Stream(self.tools))
            c = ts.push(c or "")
            if end:
                rest, calls = ts.finish()
                c += rest
                ts.calls = calls
        return r or None, c or None

    def tool_calls_delta(self, index: int) -> list:
        """A streamed choice's tool-call pieces written since the last call, as delta.tool_calls
        entries (tools.Stream: each call's id and name, then its arguments as they come)."""
        ts = self.tool_streams.get(index)
        return ts.take() if ts is not None else []

    def called(self, index: int) -> bool:
        """Whether a streamed choice that ended made tool calls."""
        ts = self.tool_streams.get(index)
        return bool(ts is not None and ts.calls)

    def chunk(self, index: int, text: str | None, lp, finish: str | None, first: bool,
              reasoning: str | None = None) -> dict:
        if self.chat:
            delta = {}
            if first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [c]}
        c = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [c]}


def api_error(e: BaseException) -> ApiError:
    """A choice's error as the client sees it. Every value was checked at admission, so what
    fails in a slot is the server's own failure: 500 (an ApiError keeps its status)."""
    if isinstance(e, ApiError):
        return e
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def http_error(request: Request, e: HTTPException) -> ApiError:
    """The framework's own errors as OpenAI's: its router raises 404 for an unknown path and 405
    (with an Allow header) for a known path's wrong method."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        return ApiError(404, f"no such route: {where} (the API is under /v1: completions, "
                             "chat/completions, responses, models)", code="unknown_url", headers=e.headers)
    if e.status_code == 405:
        allow = (e.headers or {}).get("Allow", "")
        return ApiError(405, f"method not allowed: {where} (this path allows {allow})",
                        code="method_not_allowed", headers=e.headers)
    return ApiError(e.status_code, f"{where}: {e.detail}", headers=e.headers,
                    type="server_error" if e.status_code >= 500 else "invalid_request_error")


def create_app(st: ServerState) -> FastAPI:
    app = FastAPI(title="sapwood", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sapwood = st
    m = st.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: say so, keep serving
        return ApiError(500, f"internal error: {type(e).__name__}: {e}",
                        type="server_error").response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # the router's 404 and 405
        return http_error(request, e).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):  # a route's typed params
        err = e.errors()[0]  # loc: ("path" or "query", name, ...)
        param = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return ApiError(400, f"{param}: {err.get('msg', 'invalid value')}", param,
                        code="invalid_value").response()

    @app.get("/health")
    async def health():
        s = st.scheduler
        return {"status": "ok", "model": st.model_id, "slots": len(s.slots), "busy": s.busy,
                "queue": s.queue_depth}

    def model_object(name: str) -> dict:
        return {"id": name, "object": "model", "created": st.created,
                "owned_by": "sapwood", "max_model_len": st.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object(n) for n in st.model_names]}

    @app.get("/v1/models/{model:path}")  # path: a served name may hold "/" (Qwen/Qwen3.5-9B)
    async def model(model: str):
        if model not in st.model_names:
            raise st.model_not_found(model)
        return model_object(model)

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    stored = responses.Store()

    @app.post("/v1/responses")
    async def responses_(request: Request):
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            body = parse_body(await read_body(request, st.max_body_bytes))
            items = responses.conversation(body, stored)
            chat = json.dumps(responses.to_chat(body, items)).encode()
            try:
                adm = await loop.run_in_executor(st.executor, prepare, st, chat, True)
            except ApiError as e:
                raise responses.renamed(e) from None
            call = _submit(_Call(st, True, adm))
        except ApiError as e:
            m.requests.labels("responses", str(e.status)).inc()
            return e.response()
        ids, created = responses.Ids(), time.time()
        if call.req.stream:
            return StreamingResponse(responses.stream(call, ids, body, created, api_error,
                                                      stored, items),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        err = await _wait(call, request, "responses")
        if err is not None:
            return err
        m.requests.labels("responses", "200").inc()
        m.latency.labels("responses").observe(time.perf_counter() - t0)
        output, status = responses.output_items(call, ids, call.results[0])
        obj = responses.response_object(call, ids, body, created, output, status)
        stored.put(obj, body, items)
        return JSONResponse(obj)

    @app.get("/v1/responses/{rid}")
    async def response_by_id(rid: str):
        got = stored.get(rid)
        if got is None:
            return ApiError(404, f"response {rid!r} not found (this server keeps the newest "
                            f"{stored.limit} responses, in memory)", "response_id",
                            code="not_found").response()
        return JSONResponse(got[0])

    def _submit(call: _Call) -> _Call:
        try:
            st.scheduler.submit(call.jobs)
        except TooManyChoices as e:  # prepare checked it; the scheduler has the last word
            raise ApiError(400, str(e), "n", code="too_many_choices") from None
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}", type="server_error",
                           code="queue_full") from None
        return call

    async def _wait(call: _Call, request: Request, endpoint: str):
        """Wait for a request's choices; a Response when it failed or the client left."""
        try:
            checked = time.monotonic()
            while call.pending and call.error is None:  # the first error is the answer
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
        err = call.failure()
        if err is not None:
            m.requests.labels(endpoint, str(err.status)).inc()
            return err.response()
        return None

    async def _serve(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, st.max_body_bytes)
            adm = await asyncio.get_running_loop().run_in_executor(st.executor, prepare, st, raw,
                                                                   chat)
            call = _submit(_Call(st, chat, adm))
        except ApiError as e:
            m.requests.labels(endpoint, str(e.status)).inc()
            return e.response()
        if call.req.stream:
            return StreamingResponse(_stream(call, endpoint, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        err = await _wait(call, request, endpoint)
        if err is not None:
            return err
        m.requests.labels(endpoint, "200").inc()
        m.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return JSONResponse(call.response())

    async def _stream(call: _Call, endpoint: str, t0: float):
        started = set()
        try:
            if call.chat:  # each choice opens with its role alone, as OpenAI's streams do
                for index in range(len(call.jobs)):
                    yield _sse(call.chunk(index, None, None, None, True))
                    started.add(index)
            while call.pending:
                kind, payload = await call.events.get()
                call.take(kind, payload)
                if kind == "error":  # the first error ends the stream, once
                    yield _sse(api_error(payload.error).body())
                    break
                if kind == "delta":
                    d: Delta = payload
                    lp = (call.logprobs_obj(d.tokens, d.logprobs, d.ends, d.start)
                          if call.want_logprobs() and d.tokens else None)
                    reasoning, text = call.split_delta(d.index, d.text)
                    if reasoning or text is not None or lp is not None:
                        yield _sse(call.chunk(d.index, text, lp, None, d.index not in started,
                                              reasoning))
                        started.add(d.index)
                    calls = call.tool_calls_delta(d.index) if call.chat else []
                    if calls:
                        c = call.chunk(d.index, None, None, None, d.index not in started)
                        c["choices"][0]["delta"]["tool_calls"] = calls
                        yield _sse(c)
                        started.add(d.index)
                elif kind == "done":
                    r: ChoiceResult = payload
                    reasoning, text = call.split_delta(r.index, None, end=True)
                    if reasoning or text:
                        yield _sse(call.chunk(r.index, text, None, None, r.index not in started,
                                              reasoning))
                        started.add(r.index)
                    finish = r.finish_reason
                    calls = call.tool_calls_delta(r.index) if call.chat else []
                    if calls:
                        c = call.chunk(r.index, None, None, None, r.index not in started)
                        c["choices"][0]["delta"]["tool_calls"] = calls
                        yield _sse(c)
                        started.add(r.index)
                    if call.chat and call.called(r.index):
                        finish = "tool_calls" if finish == "stop" else finish
                    yield _sse(call.chunk(r.index, None if call.chat else "", None,
                                          finish, r.index not in started))
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

    add_access(app, st.api_key, st.cors_origins)
    return app
