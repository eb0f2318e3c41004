"""POST /v1/responses, the OpenAI Responses API as the openai client's `responses.create` uses
it: text (or message items, function calls and their outputs) in; a message, Qwen3.5's
reasoning and function calls out; streaming as Responses events.

A request is translated into the chat request it means (to_chat) and runs as one: the same
admission checks, template, constraints (text.format, tool_choice) and slots, so its tokens are
a chat's, identical in every verify mode. Finished responses are kept (Store: in memory, the
newest STORED of them, unless the request says store: false) so that previous_response_id can
continue a conversation and GET /v1/responses/{id} can fetch one, as OpenAI's API does.
"""
from __future__ import annotations

import json
import uuid
from collections import OrderedDict

from .protocol import ApiError

# Responses fields -> what the chat request calls them (errors name the Responses field)
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens",
            "response_format": "text.format"}
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
           "parallel_tool_calls", "sapwood", "chat_template_kwargs", "thinking_budget",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "user", "metadata",
           "store", "service_tier", "safety_identifier", "prompt_cache_key")
_IGNORED = ("reasoning", "include", "background", "max_tool_calls", "truncation",
            "stream_options", "prompt_cache_retention")


STORED = 1024  # finished responses kept for previous_response_id (the oldest go first)


class Store:
    """The newest `limit` finished responses: their objects and the conversation each ends
    (its input items, the previous responses' included, then its output items)."""

    def __init__(self, limit: int = STORED):
        self.limit = limit
        self._items: OrderedDict = OrderedDict()  # id -> (response object, conversation items)

    def put(self, obj: dict, body: dict, conversation: list) -> None:
        if body.get("store") is False:
            return
        self._items[obj["id"]] = (obj, conversation + obj["output"])
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str):
        """(response object, its conversation), or None."""
        return self._items.get(rid)


def conversation(body: dict, store: Store) -> list:
    """The input items a request means: the previous response's conversation (without its
    instructions, as OpenAI's API does) followed by this request's input."""
    items = body.get("input")
    items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
    prev = body.get("previous_response_id")
    if prev is None:
        return items
    if not isinstance(prev, str) or store.get(prev) is None:
        raise ApiError(400, f"previous_response_id: previous response with id {prev!r} not found "
                       f"(this server keeps the newest {store.limit} responses, in memory)",
                       "previous_response_id", code="previous_response_not_found")
    return store.get(prev)[1] + (items if isinstance(items, list) else [])


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code="invalid_value")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or a list of input_text parts", where)
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _bad(f"part {i} is {kind!r}: only text parts are supported (this server reads "
                       "and writes text only)", where)
        out.append(part["text"])
    return "".join(out)


def _messages(body: dict, items) -> list:
    msgs = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    if not isinstance(items, list) or not items:
        raise _bad("must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        where = f"input.{i}"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"role {role!r}: must be user, system, developer or assistant", where)
            msgs.append({"role": role, "content": _text(it.get("content"), where + ".content")})
        elif kind == "function_call":
            call = {"id": it.get("call_id"), "type": "function",
                    "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": out if isinstance(out, str) else _text(out, where + ".output")})
        elif kind == "reasoning":
            continue  # a previous turn's thinking: Qwen3.5's template drops it too
        else:
            raise _bad(f"item type {kind!r} is not supported (message, function_call, "
                       "function_call_output)", where)
    return msgs


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise _bad("must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tool {i} is {kind!r}: only function tools run here", "tools")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    return out


def to_chat(body: dict, items: list) -> dict:
    """The chat completions body a Responses body means, its input `items` (conversation());
    ApiError naming Responses fields."""
    known = set(_PASSED) | set(_IGNORED) | {"input", "instructions", "max_output_tokens",
                                            "tools", "tool_choice", "text",
                                            "previous_response_id", "conversation", "prompt"}
    for k in body:
        if k not in known:
            raise ApiError(400, f"unrecognized request argument supplied: {k}", k,
                           code="unknown_field")
    for k in ("conversation", "prompt"):
        if body.get(k) is not None:
            raise _bad("not supported: this server keeps no conversations or prompts (send "
                       "input items, or previous_response_id)", k)
    chat = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["messages"] = _messages(body, items)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise _bad("must be an object {'format': ...}", "text")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None:
        chat["response_format"] = fmt
    return chat


def renamed(e: ApiError) -> ApiError:
    """A chat admission error as the Responses request's: its field names."""
    if e.param:
        head, _, rest = e.param.partition(".")
        if head in _RENAMED:
            new = _RENAMED[head] + ("." + rest if rest else "")
            e.message = e.message.replace(e.param, new, 1)
            e.param = new
    return e


class Ids:
    """The ids of one response and its output items (the same streamed and in the result)."""

    def __init__(self):
        self.response = "resp_" + uuid.uuid4().hex
        self.reasoning = "rs_" + uuid.uuid4().hex
        self.message = "msg_" + uuid.uuid4().hex


def output_items(call, ids: Ids, r) -> tuple[list, str]:
    """(output items, status) of a finished choice."""
    from . import tools as tools_
    from .reasoning import split
    reasoning, content = split(r.text, call.thinking) if call.split else (None, r.text)
    calls = []
    if call.tools:
        content, calls = tools_.parse(content, call.tools)
        streamed = call.tool_streams.get(r.index)
        if streamed is not None and streamed.calls:  # the ids its stream gave out
            calls = streamed.calls
    out = []
    if reasoning is not None:
        out.append({"type": "reasoning", "id": ids.reasoning, "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": reasoning}]})
    if content or not calls:
        out.append(message_item(ids, content, "completed"))
    for c in calls:
        out.append({"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                    "status": "completed"})
    return out, ("incomplete" if r.finish_reason in ("length", "context") else "completed")


def message_item(ids: Ids, text: str, status: str) -> dict:
    return {"type": "message", "id": ids.message, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def response_object(call, ids: Ids, body: dict, created: float, output=None,
                    status="in_progress") -> dict:
    usage = None
    if call.results:
        u = call.usage()
        usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                 "total_tokens": u["total_tokens"],
                 "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": ids.response, "object": "response", "created_at": int(created), "status": status,
        "model": call.st.model_id, "output": output or [], "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
        "usage": usage, "store": body.get("store") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "sapwood": call.extension() if call.results else None}


def sse(event: dict, seq: list) -> str:
    event["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def stream(call, ids: Ids, body: dict, created: float, api_error, store: Store,
                 items: list):
    """The Responses events of a streamed request: created, the reasoning and message items'
    deltas as they come, each function call as it is written (added with arguments "" once its
    name is out, then its arguments a parameter at a time: tools.Stream), completed (or
    failed)."""
    seq = [0]
    yield sse({"type": "response.created",
               "response": response_object(call, ids, body, created)}, seq)
    open_items: list = []  # "reasoning", "message" in the order they began
    texts = {"reasoning": "", "message": ""}

    def begin(kind):
        index = len(open_items)
        open_items.append(kind)
        item = ({"type": "reasoning", "id": ids.reasoning, "summary": [], "content": [],
                 "status": "in_progress"} if kind == "reasoning"
                else message_item(ids, "", "in_progress") | {"content": []})
        evs = [{"type": "response.output_item.added", "output_index": index, "item": item}]
        part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        evs.append({"type": "response.content_part.added", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "part": part})
        return evs

    def delta(kind, text):
        evs = [] if kind in open_items else begin(kind)
        texts[kind] += text
        item_id = ids.reasoning if kind == "reasoning" else ids.message
        evs.append({"type": "response.reasoning_text.delta" if kind == "reasoning"
                    else "response.output_text.delta", "item_id": item_id,
                    "output_index": open_items.index(kind), "content_index": 0, "delta": text,
                    **({} if kind == "reasoning" else {"logprobs": []})})
        return evs

    calls: dict = {}  # call k -> (its output index, its item id), as it began

    def function_calls():
        evs = []
        for e in call.tool_calls_delta(0):
            k, piece = e["index"], e["function"]["arguments"]
            if k not in calls:
                calls[k] = (len(open_items), "fc_" + e["id"][5:])
                open_items.append(("call", k))
                evs.append({"type": "response.output_item.added", "output_index": calls[k][0],
                            "item": {"type": "function_call", "id": calls[k][1],
                                     "call_id": e["id"], "name": e["function"]["name"],
                                     "arguments": "", "status": "in_progress"}})
            if piece:
                evs.append({"type": "response.function_call_arguments.delta",
                            "item_id": calls[k][1], "output_index": calls[k][0], "delta": piece})
        return evs

    try:
        while call.pending:
            kind, payload = await call.events.get()
            call.take(kind, payload)
            if kind == "error":
                err = api_error(payload.error)
                yield sse({"type": "response.failed", "response": response_object(
                    call, ids, body, created, status="failed") | {"error": {
                        "code": err.code or "server_error", "message": err.message}}}, seq)
                return
            if kind == "delta":
                r, c = call.split_delta(payload.index, payload.text)
            elif kind == "done":
                r, c = call.split_delta(payload.index, None, end=True)
            else:
                continue
            for k, t in (("reasoning", r), ("message", c)):
                if t:
                    for ev in delta(k, t):
                        yield sse(ev, seq)
            if call.tools:
                for ev in function_calls():
                    yield sse(ev, seq)
        result = call.results.get(0)
        if result is None:
            return
        output, status = output_items(call, ids, result)
        for index, item in enumerate(output):
            t = item["type"]
            if t == "function_call":  # added and its arguments streamed as it was written
                yield sse({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "arguments": item["arguments"],
                           "name": item["name"]}, seq)
            elif t in open_items:  # its text was streamed: close it
                yield sse({"type": "response.reasoning_text.done" if t == "reasoning"
                           else "response.output_text.done", "item_id": item["id"],
                           "output_index": index, "content_index": 0,
                           "text": item["content"][0]["text"]}, seq)
            else:  # nothing was streamed of it (an empty message)
                yield sse({"type": "response.output_item.added", "output_index": index,
                           "item": item | {"status": "in_progress"}}, seq)
            yield sse({"type": "response.output_item.done", "output_index": index,
                       "item": item}, seq)
        done = response_object(call, ids, body, created, output, status)
        store.put(done, body, items)
        yield sse({"type": "response.completed" if status == "completed"
                   else "response.incomplete", "response": done}, seq)
    finally:
        call.cancel()

