"""Request bodies of the OpenAI API as sapwood serves it (pydantic), and its error objects.

Every field is checked here, before a request reaches a slot: a malformed body or field gets a
400 whose error object names the field (`param`) and the value it had. Fields the OpenAI API
defines but sapwood does not implement are accepted only at their neutral value (e.g. `echo:
false`, empty `logit_bias`); unknown fields are refused, as the OpenAI API refuses them.
"""
from __future__ import annotations

import re
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from pydantic import field_validator
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


class SapwoodOptions(_Strict):
    """The `sapwood` extension field: how the request is decoded, never what it outputs
    (every verify mode, width and drafter gives the same tokens)."""
    verify: Literal["off", "chain", "tree", "auto"] = "auto"
    width: Optional[StrictInt] = Field(None, ge=1, le=64)
    drafter: Optional[Literal["lookup", "model", "mtp"]] = None
    return_token_ids: StrictBool = False


class StreamOptions(_Strict):
    include_usage: StrictBool = False


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
    logit_bias: Optional[dict] = None
    user: Optional[StrictStr] = None
    sapwood: SapwoodOptions = Field(default_factory=SapwoodOptions)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported (it would change the distribution "
                             "the exactness guarantee is about)")
        return v

    def stops(self) -> list:
        return list(self.stop or [])


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
    prompt: Any
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[None] = None

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

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of is not supported (use n)")
        return v


class ContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, List[ContentPart]]
    name: Optional[StrictStr] = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # "developer" is the newer name of "system"; chat templates know the older one
        d = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            d["name"] = self.name
        return d


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(_Sampling):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[Any]] = Field(None, max_length=0)
    tool_choice: Optional[Literal["none"]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    def limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                f"({self.max_completion_tokens}) disagree", "max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
