"""Request bodies of the OpenAI API as sapwood serves it (pydantic), and its error objects.

Every field is checked here, before a request reaches a slot: a malformed body or field gets a
400 whose error object names the field (`param`) and the value it had. The OpenAI API's fields
fall in three kinds (docs/server.md lists them): honoured; ignored, those that cannot change
the output here (`user`, `store`, `metadata`, ...: SDK wrappers send them, and a 400 broke
them); refused unless neutral, those whose other values would change the output in a way
sapwood does not implement (`tools`, `logit_bias`, `echo`, ...: ignoring them would answer
something else than was asked, silently). A field's null is its default, as the API's types
say (clients send null for what they leave unset). Fields the API does not define are refused,
as the OpenAI API refuses them: a misspelt `temprature` must not pass unnoticed.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, ClassVar, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from pydantic import ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from ..sampling import PENALTY_RANGE, REPETITION_PENALTY_RANGE, SEED_LIMIT, TOP_K_MAX

MAX_N = 16            # choices per request
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16


class ApiError(Exception):
    """An error the client caused (or a full server): an HTTP status and an OpenAI-style error
    object {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers  # of the response: a 405's Allow, a 401's WWW-Authenticate

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|(list|dict|tuple|literal|function-\w+)\[.*\])")


def validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field and its value."""
    err = e.errors(include_url=False)[0]
    raw = err.get("loc", ())
    extra = err.get("type") == "extra_forbidden"
    # union members add their type to a location: ('stop', 'list[str]', 2) is stop; an unknown
    # field's name (the last part) is the client's, kept whatever it reads: a field "str" was
    # taken for a tag and reported as "supplied: None"
    loc = [str(x) for i, x in enumerate(raw) if isinstance(x, int) or not _TYPE_TAG.fullmatch(x)
           or (extra and i == len(raw) - 1)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if extra:
        name = ".".join(loc)
        return ApiError(400, f"unrecognized request argument supplied: {name or repr(name)}",
                        name, code="unknown_field")
    if err.get("type") == "missing":
        return ApiError(400, f"{param} is required", param, code="missing_field")
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}{msg} (got {_short(err.get('input'))})", param,
                    code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """A known field's null means its default: the API's types make most fields Optional and
        clients send null for those they leave unset (`"n": null` was a 400). An unknown field
        stays an error, null or not."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


log = logging.getLogger("sapwood.server")

# Fields of the OpenAI API that cannot change what sapwood outputs: accepted with any value and
# ignored (each logged once per process, so an operator learns what clients send). Storage,
# billing and caching bookkeeping;
# `prediction`, a latency hint whose output is the model's own either way; `reasoning_effort`
# and `verbosity`, hints without a defined effect on an open model (vLLM and llama.cpp
# ignore them too: the chat template decides).
IGNORED = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options")
IGNORED_CHAT = IGNORED + ("prediction", "reasoning_effort", "verbosity")
_logged: set = set()


# the reasons of refusals: each reads after the field's name, "tools: <why> (got ...)"
_TOOLS = "the legacy functions API is not supported: use tools and tool_choice"
_TEXT_ONLY = "this server reads and writes text only"


def _zero_bias(v) -> bool:
    return isinstance(v, dict) and all(type(x) in (int, float) and x == 0 for x in v.values())


# Fields of the OpenAI API accepted only at a neutral value (null always: the default): another
# value would change the output in a way sapwood does not implement, so it is refused naming the
# field and why, never ignored. field: (is the value neutral, why another is refused)
REFUSED = {
    "logit_bias": (_zero_bias, "not supported (a bias changes the distribution that plain "
                               "decoding and every verify mode share; only zero biases pass)"),
}
REFUSED_COMPLETION = {
    **REFUSED,
    "echo": (lambda v: v is False, "not supported (the prompt is not returned)"),
    "best_of": (lambda v: v == 1 and type(v) is int, "not supported (use n)"),
    "suffix": (lambda v: v == "", "not supported (no insertion)"),
}
REFUSED_CHAT = {
    **REFUSED,
    "functions": (lambda v: v == [], _TOOLS),
    "function_call": (lambda v: v in ("none", "auto"), f"only 'none' or 'auto': {_TOOLS}"),
    "modalities": (lambda v: v == ["text"], f"only ['text']: {_TEXT_ONLY}"),
    "audio": (lambda v: False, f"not supported: {_TEXT_ONLY}"),
    "web_search_options": (lambda v: False, "not supported: this server has no web search"),
    "moderation": (lambda v: False, "not supported: this server does not moderate requests"),
}


def _response_format(v):
    """response_format as OpenAI defines it -> {"type": ...} checked: text, json_object, or
    json_schema with {"name", "schema", "strict", "description"} (schema an object)."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError("must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                         "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    extra = set(v) - {"type", "json_schema"}
    if extra:
        raise ValueError(f"unknown key {sorted(extra)[0]!r}")
    if v["type"] != "json_schema":
        if "json_schema" in v:
            raise ValueError(f"json_schema given with type {v['type']!r}")
        return v
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError("type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}")
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"json_schema: unknown key {sorted(extra)[0]!r}")
    if "name" in js and not (isinstance(js["name"], str)
                             and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", js["name"])):
        raise ValueError("json_schema.name must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(js.get("schema", {}), dict):
        raise ValueError("json_schema.schema must be a JSON object (a JSON Schema)")
    if js.get("strict") not in (None, True, False):
        raise ValueError("json_schema.strict must be a boolean")
    return v


def note_ignored(req, names) -> None:
    """Log, once per process and field, that a request set a field that is ignored. A warning:
    `sapwood serve` configures no handler for this logger, and Python shows only warnings then."""
    for name in names:
        if name in req.model_fields_set and name not in _logged:
            _logged.add(name)
            log.warning("request field %r is accepted and ignored (docs/server.md, 'Fields')", name)


class SapwoodOptions(_Strict):
    """The `sapwood` extension field: how the request is decoded, never what it outputs
    (every verify mode, width and drafter gives the same tokens)."""
    verify: Literal["off", "chain", "tree", "auto"] = "auto"
    width: Optional[StrictInt] = Field(None, ge=1, le=64)
    drafter: Optional[Literal["lookup", "model", "mtp"]] = None
    return_token_ids: StrictBool = False


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    include_obfuscation: Any = None  # ignored: random padding against length side channels


class _Sampling(_Strict):
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=TOP_K_MAX)  # 0 or -1: off (vLLM's)
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)
    seed: Optional[StrictInt] = Field(None, ge=0, lt=SEED_LIMIT)
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    # the ranges SamplingParams checks, for the reasons sampling.py gives: within them a
    # penalised logit cannot overflow (repetition_penalty=1e-300 made every pick raise)
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                    allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                     allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0],
                                      le=REPETITION_PENALTY_RANGE[1], allow_inf_nan=False)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    sapwood: SapwoodOptions = Field(default_factory=SapwoodOptions)
    # vLLM's structured-output extensions (grammar.py compiles them at admission)
    guided_json: Optional[Union[StrictStr, dict]] = None
    guided_regex: Optional[StrictStr] = None
    guided_grammar: Optional[StrictStr] = None
    guided_choice: Optional[List[StrictStr]] = Field(None, min_length=1)
    # ignored (IGNORED) and refused unless neutral (REFUSED): any type here, the validators
    # below decide
    logit_bias: Any = None
    user: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    _refused: ClassVar[dict] = REFUSED  # each request kind's table

    @field_validator("*")
    @classmethod
    def _neutral(cls, v, info: ValidationInfo):
        """A field of the refused kind at any value but its neutral one: a 400 saying why."""
        rule = cls._refused.get(info.field_name)
        if rule is not None and not rule[0](v):
            raise ValueError(rule[1])
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def stops(self) -> list:
        return list(self.stop or [])

    def constraint(self) -> tuple | None:
        """(param, grammar.compile_constraint's keyword arguments) of the structured output
        asked for, or None; ApiError when more than one is set."""
        asked = []
        rf = getattr(self, "response_format", None)
        if rf is not None and rf["type"] != "text":
            if rf["type"] == "json_object":
                asked.append(("response_format", dict(json_object=True)))
            else:
                schema = rf["json_schema"].get("schema")
                asked.append(("response_format.json_schema.schema",
                              dict(json_schema=schema) if schema is not None
                              else dict(json_object=True)))
        if self.guided_json is not None:
            asked.append(("guided_json", dict(json_schema=self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", dict(regex=self.guided_regex)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", dict(grammar=self.guided_grammar)))
        if self.guided_choice is not None:
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.guided_choice)
            asked.append(("guided_choice", dict(grammar=f"start: {alts}")))
        if len(asked) > 1:
            raise ApiError(400, f"{asked[0][0].split('.')[0]} and {asked[1][0].split('.')[0]} "
                                "both constrain the output: give one", asked[1][0].split(".")[0],
                           code="invalid_value")
        return asked[0] if asked else None


def _prompt(v):
    """str, [int], [str] or [[int]] -> a list of prompts, each a str or a list of ids."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return list(v)
    if isinstance(v, list) and v and all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in v):
        return [list(p) for p in v]
    raise ValueError("must be a string, a list of token ids, or a list of either")


class CompletionRequest(_Sampling):
    _refused: ClassVar[dict] = REFUSED_COMPLETION
    prompt: Any
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        out = _prompt(v)
        if len(out) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts per request")
        for p in out:
            if len(p) == 0:
                raise ValueError("a prompt is empty")
        return out


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # null only in an assistant turn (one that made tool calls: _content_needed)
    content: Optional[Union[StrictStr, List[ContentPart]]] = Field(None, validate_default=True)
    name: Optional[StrictStr] = None
    # an assistant turn as the API returns it, sent back: its refusal text and annotations
    # (web search citations) are ignored, nothing in a chat template renders them; tool calls
    # and audio are refused, as the request's tools and audio are
    refusal: Any = None
    annotations: Any = None
    tool_calls: Any = None
    function_call: Any = None
    audio: Any = None
    tool_call_id: Optional[StrictStr] = None  # a tool result's call (the template may show it)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """An image's or a file's part refused as such, not as "should be a valid string"."""
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"a {kind!r} content part: only 'text' parts are "
                                     f"supported ({_TEXT_ONLY})")
        return v

    @field_validator("content")
    @classmethod
    def _content_given(cls, v, info: ValidationInfo):
        """A missing content is "messages.N.content is required", but for an assistant turn
        (its tool_calls, declared later, are checked in _content_needed)."""
        if v is None and info.data.get("role") != "assistant":
            raise PydanticCustomError("missing", "Field required")
        return v

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v == "function":
            raise ValueError(f"a 'function' message: {_TOOLS} ('tool' messages)")
        return v

    @field_validator("function_call", "audio")
    @classmethod
    def _unsupported(cls, v, info: ValidationInfo):
        raise ValueError(f"not supported: {_TEXT_ONLY}" if info.field_name == "audio" else _TOOLS)

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v):
        """An assistant turn's calls as the API returns them: their arguments (JSON text)
        become the object Qwen3.5's template iterates over."""
        if not isinstance(v, list):
            raise ValueError("must be a list of {'id', 'type': 'function', 'function': "
                             "{'name', 'arguments'}}")
        out = []
        for i, c in enumerate(v):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"call {i} needs function: {{'name', 'arguments'}}")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError as e:
                raise ValueError(f"call {i}: arguments are not JSON ({e})") from None
            if not isinstance(args, dict):
                raise ValueError(f"call {i}: arguments must be a JSON object")
            out.append({"id": c.get("id"), "type": "function",
                        "function": {"name": fn["name"], "arguments": args}})
        return out

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only in an assistant turn with "
                             "tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant turn has tool_calls")
        return self

    def as_template_dict(self) -> dict:
        c = self.content
        text = c if isinstance(c, str) or c is None else "".join(p.text for p in c)
        # "developer" is the newer name of "system"; chat templates know the older one
        d = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def _tools(v):
    """tools: [{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}], names unique."""
    if not isinstance(v, list):
        raise ValueError("must be a list of {'type': 'function', 'function': {...}}")
    seen = set()
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise ValueError(f"tool {i} must be {{'type': 'function', 'function': {{'name', "
                             "'parameters', ...}}}")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra or set(t) - {"type", "function"}:
            raise ValueError(f"tool {i}: unknown key {sorted(extra or set(t) - {'type', 'function'})[0]!r}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tool {i}: name must be 1-64 letters, digits, '_', '.' or '-', "
                             f"got {name!r}")
        if name in seen:
            raise ValueError(f"tool {i}: name {name!r} given twice")
        seen.add(name)
        params = fn.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tool {i} ({name}): parameters must be a JSON Schema of type "
                             "'object'")
        if not isinstance(params.get("properties", {}), dict):
            raise ValueError(f"tool {i} ({name}): parameters.properties must be an object")
    return v


def _tool_choice(v):
    if v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', "
                         "'function': {'name': ...}}")
    return v


class ChatRequest(_Sampling):
    _refused: ClassVar[dict] = REFUSED_CHAT
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    # vLLM's: extra variables for the chat template (Qwen3.5: enable_thinking)
    chat_template_kwargs: Optional[dict] = None
    # the most reasoning tokens (Qwen3.5's thinking); then </think> is the only token allowed
    thinking_budget: Optional[StrictInt] = Field(None, ge=0)

    @field_validator("tools")
    @classmethod
    def _tools_ok(cls, v):
        return _tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _choice_ok(cls, v):
        return _tool_choice(v)

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel_ok(cls, v):
        if not isinstance(v, bool):
            raise ValueError("must be a boolean")
        return v

    def tool_mode(self) -> tuple:
        """(tools the template shows or None, the names a call must use: None any, [] no call
        enforced, parallel). tool_choice none shows no tools; required enforces any tool;
        a named one only it; auto lets the model choose."""
        tools = self.tools or None
        choice = self.tool_choice or ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
        parallel = True if self.parallel_tool_calls is None else self.parallel_tool_calls
        if choice == "none":
            return None, [], parallel
        if choice == "auto":
            return tools, [], parallel
        if choice == "required":
            return tools, None, parallel
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools",
                           "tool_choice")
        return tools, [name], parallel

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        taken = {"messages", "add_generation_prompt", "tools"} & set(v)
        if taken:
            raise ValueError(f"{sorted(taken)[0]!r} is set by the request itself, not here")
        return v

    def limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree", "max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        return _response_format(v)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
