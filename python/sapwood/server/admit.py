"""Admission of a request: its body read within the size limit, parsed, every value checked and
its prompts encoded, all before a job is queued, and everything costly off the event loop.

The event loop serves every client, streams in flight included: one request that held it (a
38 MB prompt tokenized there took 53 s, issue 50) stalled them all. So the body is read in
chunks and refused (413) past `max_body_bytes`, from its Content-Length at once or as soon as a
chunked upload passes it; parsing, validation, the chat template and tokenizing run in a worker
thread (`prepare`); and a prompt is refused as too long as early as its length can be known: by
its character count before tokenizing where the tokenizer bounds the characters a token covers
(text.chars_per_token_bound), by its token count otherwise. (json's C parser holds the GIL
while it runs, about 0.3 s for 16 MB of small numbers, so even on a worker thread a body's
parse stalls the loop that long: the body limit is what bounds it.)

Everything a request asks for is checked here, so an error after admission (in a slot) is the
server's own: 500. Here a bad value is a 400 naming it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..generate import DecodeConfig
from ..sampling import SamplingParams
from .protocol import (IGNORED, IGNORED_CHAT, ApiError, ChatRequest, CompletionRequest,
                       note_ignored, validation_error)
from .reasoning import THINK_CLOSE, prompt_opens_thinking

DEFAULT_MAX_BODY_MB = 16.0
# The deepest JSON a valid request has is 5 levels (messages, a message, its content parts, a
# part); past this limit a body is refused before anything else walks it (the json module, the
# validation and error messages recurse: 100,000 levels raised RecursionError, a 500).
MAX_JSON_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server accepts ({limit} bytes; "
                         "`sapwood serve --max-body-mb` sets it)", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to exceed `limit` bytes: from its
    Content-Length before reading any of it, else (a chunked upload) once the chunks read pass
    it. Nothing past the limit is kept. A client gone before its body ended is a 499 (counted;
    nobody hears it), not an unhandled ClientDisconnect logged as the server's error."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise body_too_large(limit)
    except ClientDisconnect:  # gone before its body ended: nobody to answer, no server error
        raise ApiError(499, "the client closed the connection before the body ended",
                       code="client_closed") from None
    return bytes(body)


def _where(path) -> str | None:
    return ".".join(str(p) for p in path) or None


def _check_json(obj) -> None:
    """Refuse a body nested past MAX_JSON_DEPTH and any string with a lone surrogate (JSON's
    "\\ud800" escape decodes to one; it is no Unicode text, and the tokenizer fails on it), naming
    where. Iterative: the walk itself must not recurse."""
    stack = [(obj, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body nests JSON more than {MAX_JSON_DEPTH} levels deep "
                                f"(at {_where(path)})", _where(path), code="invalid_json")
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m:
                raise ApiError(400, f"{_where(path) or 'the body'}: the text has a lone surrogate "
                                    f"(U+{ord(m.group()):04X} at character {m.start()}), which is "
                                    "not valid Unicode", _where(path), code="invalid_value")
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    raise ApiError(400, f"a key of {_where(path) or 'the body'} has a lone "
                                        "surrogate, which is not valid Unicode", _where(path),
                                   code="invalid_value")
                if isinstance(x, (str, dict, list)):
                    stack.append((x, depth + 1, path + (k,)))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, (str, dict, list)):
                    stack.append((x, depth + 1, path + (i,)))


def parse_body(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the body nests JSON too deeply (a request needs at most "
                            f"{MAX_JSON_DEPTH} levels)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}",
                       code="invalid_json")
    _check_json(obj)
    return obj


def sampling_params(st, req, seed: int) -> SamplingParams:
    """The request's sampling, its unset fields from the checkpoint's defaults."""
    d = st.defaults
    return SamplingParams(
        temperature=d["temperature"] if req.temperature is None else req.temperature,
        top_p=d["top_p"] if req.top_p is None else req.top_p,
        top_k=d["top_k"] if req.top_k is None else max(req.top_k, 0),
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)


@dataclass
class Admitted:
    """A request that passed every check: its prompts' ids, max_tokens, logprobs."""
    req: object
    prompts: list
    max_tokens: list      # per prompt
    logprobs: int | None
    constraint: object = None  # grammar.Constraint: structured output, or None
    thinking: bool = False     # the prompt opened a thinking block (reasoning.py)
    tools: list | None = None  # the tools whose calls the output is parsed for (tools.py)


def _context_error(st, what: str, param: str) -> ApiError:
    return ApiError(400, f"{what}; this model's context holds {st.max_context} (at most "
                         f"{st.max_context - 1} prompt tokens, leaving room for one generated)",
                    param, code="context_length_exceeded")


def check_prompt_chars(st, text: str, param: str) -> None:
    """Refuse a text that cannot fit the context before tokenizing it: past
    (max_context - 1) * bound characters it has more tokens than that."""
    k = st.chars_per_token
    if k is not None and len(text) > (st.max_context - 1) * k:
        raise _context_error(st, f"the prompt has {len(text)} characters, so more tokens than fit "
                                 f"(a token of this tokenizer covers at most {k} characters)",
                             param)


def encode(st, text: str) -> list:
    """Token ids of `text` as Model.encode gives them, by encode_batch: it releases the GIL
    while it runs, encode does not (measured: encoding 3 MB held it 2.3 s, stalling the event
    loop from a worker thread too)."""
    try:
        return st.model.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a tokenizer panic is no Exception (pyo3)
        raise ApiError(500, f"the tokenizer failed on this prompt: {type(e).__name__}: {e}",
                       type="server_error") from None


def _check_drafter(st, req) -> None:
    slot = st.scheduler.slots[0]
    if req.sapwood.drafter == "model" and slot.draft_model is None:
        raise ApiError(400, "sapwood.drafter='model': this server has no draft model (start it "
                            "with --drafter)", "sapwood.drafter")
    if req.sapwood.drafter == "mtp" and slot.model.mtp is None:
        why = slot.model.mtp_unsupported or "this server's model has no MTP head"
        raise ApiError(400, f"sapwood.drafter='mtp': {why}", "sapwood.drafter")


def _check_values(st, req, limit) -> None:
    """The decode configuration a choice will run with, checked now (the protocol's ranges
    are SamplingParams' too; this keeps a value that slipped past them from failing in a slot)."""
    try:
        DecodeConfig(max_tokens=limit or 1, params=sampling_params(st, req, 0),
                     verify=req.sapwood.verify, width=req.sapwood.width).validate()
    except ValueError as e:
        msg = str(e)
        name = msg.split("=", 1)[0] if "=" in msg.split(" ", 1)[0] else None
        raise ApiError(400, msg, name, code="invalid_value") from None


def compile_constraint(st, req):
    """The request's structured output (response_format, guided_*) compiled for the served
    model's tokenizer, or None; a schema, regex or grammar llguidance cannot use is a 400
    naming the field and the problem."""
    asked = req.constraint()
    if asked is None:
        return None
    param, kw = asked
    from ..grammar import compile_constraint as compile_
    try:
        return compile_(st.model, **kw)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param, code="invalid_value") from None
    except RuntimeError as e:  # llguidance missing: the server's, not the client's
        raise ApiError(500, f"{param}: {e}", param, type="server_error") from None


def tool_constraint(st, tools, names, parallel):
    """tool_choice required (names None) or named: the grammar of Qwen3.5's tool-call blocks
    (tools.call_grammar), compiled for the served model."""
    from ..grammar import compile_constraint as compile_
    from .tools import TOOL_OPEN, call_grammar
    special = st.model.tokenizer.token_to_id(TOOL_OPEN) is not None
    try:
        return compile_(st.model, grammar=call_grammar(tools, names, parallel, special))
    except ValueError as e:  # a parameter schema llguidance cannot use
        raise ApiError(400, f"tools: {e}", "tools", code="invalid_value") from None


def thinking_constraint(st, req, thinking: bool, constraint):
    """A chat whose prompt opened Qwen3.5's <think>: the response's constraint applies after
    </think> only, and thinking_budget caps the reasoning tokens (grammar.ThinkingConstraint).
    Unchanged otherwise; thinking_budget without a thinking block is a 400."""
    if not thinking:
        if req.thinking_budget is not None:
            raise ApiError(400, "thinking_budget: the prompt opens no thinking block (thinking "
                                "is off: chat_template_kwargs.enable_thinking, or the template "
                                "has none)", "thinking_budget")
        return constraint
    end = st.model.tokenizer.token_to_id(THINK_CLOSE)
    if end is None:  # a template with <think> over a tokenizer without the token
        if req.thinking_budget is not None:
            raise ApiError(400, f"thinking_budget: the tokenizer has no {THINK_CLOSE} token",
                           "thinking_budget")
        return constraint
    if constraint is None and req.thinking_budget is None:
        return None
    from ..grammar import ThinkingConstraint, stop_ids_of
    return ThinkingConstraint(int(end), req.thinking_budget, constraint,
                              int(st.model.config.vocab_size), stop_ids_of(st.model))


def prepare(st, raw: bytes, chat: bool) -> Admitted:
    """Parse and check a request body and encode its prompts (on a worker thread). Cheap checks
    first: nothing is rendered or tokenized for a request refused anyway."""
    obj = parse_body(raw)
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    note_ignored(req, IGNORED_CHAT if chat else IGNORED)
    if req.model not in st.model_names:
        raise st.model_not_found(req.model)
    _check_drafter(st, req)
    choices = req.n * (1 if chat else len(req.prompt))
    cap = st.scheduler.capacity
    if choices > cap:  # it would never fit the queue: saying "busy, try again" would be a lie
        raise ApiError(400, f"the request has {choices} choices (n={req.n} for each of "
                            f"{1 if chat else len(req.prompt)} prompt(s)); this server holds at "
                            f"most {cap} at once ({st.scheduler.max_queue} waiting, --queue, and "
                            f"{len(st.scheduler.slots)} running, --parallel)", "n",
                       code="too_many_choices")
    limit, logprobs = (req.limit(), req.logprob_count()) if chat else (req.max_tokens, req.logprobs)
    _check_values(st, req, limit)
    constraint = compile_constraint(st, req)
    if limit is not None and limit >= st.max_context:  # no prompt leaves that much room
        raise ApiError(400, f"max_tokens is {limit}; this model's context holds "
                            f"{st.max_context} tokens, the prompt's included (at most "
                            f"{st.max_context - 1})", "max_tokens", code="context_length_exceeded")
    param = "messages" if chat else "prompt"
    vocab = st.model.config.vocab_size
    thinking, tools = False, None
    if chat:
        tools, names, parallel = req.tool_mode()
        if names != []:  # required or named: a grammar of tool-call blocks
            if constraint is not None:
                raise ApiError(400, "tool_choice and a structured output both constrain the "
                                    "output: give one", "tool_choice")
            constraint = tool_constraint(st, tools, names, parallel)
        kw = dict(req.chat_template_kwargs or {})
        if tools:
            kw["tools"] = tools
        try:
            text = st.model.apply_chat_template([m.as_template_dict() for m in req.messages],
                                                **kw)
        except Exception as e:  # noqa: BLE001 - the template's errors (raise_exception...)
            raise ApiError(400, f"the chat template refused these messages: {e}",
                           "messages") from None
        check_prompt_chars(st, text, param)
        prompts = [encode(st, text)]
        thinking = st.reasoning and prompt_opens_thinking(text)
        constraint = thinking_constraint(st, req, thinking, constraint)
    else:
        for p in req.prompt:  # every prompt's length before any is tokenized or scanned
            if isinstance(p, str):
                check_prompt_chars(st, p, param)
            elif len(p) >= st.max_context:
                raise _context_error(st, f"the prompt has {len(p)} tokens", param)
        prompts = []
        for p in req.prompt:
            ids = encode(st, p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                    f"[0, {vocab})", "prompt")
            prompts.append(ids)
    budgets = []
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param)
        if len(ids) >= st.max_context:
            raise _context_error(st, f"the prompt has {len(ids)} tokens", param)
        room = st.max_context - len(ids)
        max_tokens = limit if limit is not None else (16 if not chat else room)
        if max_tokens > room:
            raise ApiError(400, f"this model's context holds {st.max_context} tokens; the "
                                f"prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                                f"more (at most {room})", "max_tokens",
                           code="context_length_exceeded")
        budgets.append(max_tokens)
    return Admitted(req, prompts, budgets, logprobs, constraint, thinking, tools)
