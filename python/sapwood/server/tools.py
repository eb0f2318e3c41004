"""Tool calling in Qwen3.5's format: the request's tools, tool_choice enforced by a grammar, and
the output's tool-call blocks parsed into the API's `tool_calls`.

Qwen3.5's chat template (as Qwen3-Coder's) lists the tools as JSON in the system turn and asks
for calls written as

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

with a string VALUE as its raw text and any other as JSON; several calls follow each other on
new lines. `<tool_call>` and `</tool_call>` are special tokens of its tokenizer. tool_choice
"required" or a named function is a grammar of exactly that shape (grammar.py's masks: the
arguments fit each parameter's schema, identically in every verify mode); "auto" lets the
model choose and the parser finds what it wrote; "none" renders no tools at all.
"""
from __future__ import annotations

import json
import re
import uuid

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _is_string(schema) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema


def _value_rule(name: str, schema) -> tuple[str, list, bool]:
    """(the rule body of one parameter's VALUE, extra rule lines, whether the body takes the
    closing tag too)."""
    if not isinstance(schema, dict) or not schema or _is_string(schema):
        # raw text up to the first closing tag: a lazy lexeme (llguidance's [lazy]) ends at
        # the shortest match, so the text is anything without "\n</parameter>\n"; a
        # maxLength bounds it (in characters)
        n = (schema or {}).get("maxLength") if isinstance(schema, dict) else None
        body = f".{{0,{int(n)}}}" if isinstance(n, int) and n >= 0 else ".*"
        return name, [f"{name}[lazy]: /(?s:{body})\\n<\\/parameter>\\n/"], True
    if schema.get("type") == "string":  # an enum of strings: raw text, one of the values
        return "(" + " | ".join(_lark_str(str(v)) for v in schema["enum"]) + ")", [], False
    return "%json " + json.dumps(schema), [], False


def call_grammar(tools: list, names: list | None, parallel: bool, special: bool = True) -> str:
    """A Lark grammar (llguidance's) of tool-call blocks for `names` (None: any tool), one or,
    with parallel, several. special: <tool_call> and </tool_call> are special tokens of the
    tokenizer (Qwen3.5's are), written as such; else as text."""
    o, c = ("<tool_call>", "</tool_call>") if special else (_lark_str(TOOL_OPEN),
                                                             _lark_str(TOOL_CLOSE))
    rules, alts = [], []
    for t, tool in enumerate(tools):
        fn = tool["function"]
        if names is not None and fn["name"] not in names:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for p, (pname, pschema) in enumerate(props.items()):
            value, extra, lazy = _value_rule(f"v{t}_{p}", pschema)
            rules += extra
            item = (_lark_str(f"<parameter={pname}>\n") + " " + value +
                    ("" if lazy else " " + _lark_str("\n</parameter>\n")))
            parts.append(f"({item})" + ("" if pname in required else "?"))
        body = " ".join(parts) or '""'
        head = _lark_str("\n<function=" + fn["name"] + ">\n")
        rules.append(f'call{t}: {o} {head} {body} {_lark_str("</function>" + chr(10))} {c}')
        alts.append(f"call{t}")
    if not alts:
        raise ValueError(f"tool_choice names a function not in tools: {names}")
    rules.insert(0, "call: " + " | ".join(alts))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start] + rules)


def _value(raw: str, schema):
    """A parameter's value: a string parameter's raw text, else JSON (what the model wrote, as
    text, when it is not JSON: vLLM's qwen3_coder parser does so)."""
    if _is_string(schema) or (schema or {}).get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_FUNC, _PARAM_OPEN, _PARAM_CLOSE, _FUNC_CLOSE = "<function=", "<parameter=", "</parameter>", "</function>"


def _name_at(text: str, i: int):
    """(the name of a `<tag=NAME>` whose NAME starts at i, the index after its `>`); None while
    the text ends first; False when it is no such tag (a newline or nothing before `>`)."""
    j = i
    while j < len(text) and text[j] not in ">\n":
        j += 1
    if j == len(text):
        return None
    if text[j] == "\n" or j == i:
        return False
    return text[i:j], j + 1


def _scan(text: str) -> list:
    """The tool calls in an output (or in what came of it so far), each as [name, [(parameter,
    raw value)...], ended]: a call is `<tool_call>`, `<function=NAME>`, then its complete
    `<parameter=P>\nVALUE\n</parameter>` blocks (a value runs to the first `</parameter>`;
    a parameter named twice keeps its first value) up to `</function>`. Calls come in the
    order written; text around them is not theirs. A prefix of an output scans to a prefix of
    its scan (a call's parameters so far), which lets a stream send each call's name and
    arguments as they complete."""
    calls, p = [], 0
    while True:
        i = text.find(TOOL_OPEN, p)
        if i < 0:
            return calls
        j = i + len(TOOL_OPEN)
        while j < len(text) and text[j].isspace():
            j += 1
        if len(text) - j < len(_FUNC) and _FUNC.startswith(text[j:]):
            return calls  # the header may still come
        if not text.startswith(_FUNC, j):
            p = i + 1
            continue
        got = _name_at(text, j + len(_FUNC))
        if got is None:
            return calls
        if got is False or not got[0].strip():
            p = i + 1
            continue
        name, p = got[0].strip(), got[1]
        call = [name, [], False]
        calls.append(call)
        while True:
            a, b = text.find(_PARAM_OPEN, p), text.find(_FUNC_CLOSE, p)
            if b >= 0 and (a < 0 or b < a):
                call[2], p = True, b + len(_FUNC_CLOSE)
                break
            if a < 0:
                return calls  # cut here: the end of the text may still close it
            got = _name_at(text, a + len(_PARAM_OPEN))
            if got is None:
                return calls
            if got is False:
                p = a + 1
                continue
            pname, k = got
            e = text.find(_PARAM_CLOSE, k)
            if e < 0:
                return calls
            raw = text[k:e]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            if pname not in (q for q, _ in call[1]):
                call[1].append((pname, raw))
            p = e + len(_PARAM_CLOSE)


def _fragments(params: list, schema: dict) -> list:
    """A call's arguments JSON in pieces, one a parameter: '{"a": 1', ', "b": "x"'; joined with
    the closing "}" they are json.dumps of the arguments object."""
    props = (schema or {}).get("properties") or {}
    return [("{" if n == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
            + json.dumps(_value(raw, props.get(name)), ensure_ascii=False)
            for n, (name, raw) in enumerate(params)]


def _schemas(tools: list) -> dict:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse(text: str, tools: list | None) -> tuple[str, list]:
    """(content before the first call, tool_calls as the API returns them) of an output. A
    call the end of the output cut (max_tokens) keeps the parameters it completed."""
    if not tools or TOOL_OPEN not in text:
        return text, []
    schemas = _schemas(tools)
    calls = [{"id": _call_id(), "type": "function", "function": {
        "name": name, "arguments": "".join(_fragments(params, schemas.get(name, {})) or ["{"]) + "}"}}
        for name, params, _ in _scan(text)]
    if not calls:
        return text, []
    return text[:text.index(TOOL_OPEN)].rstrip(), calls


class Stream:
    """Streamed content with tools: text is released until a `<tool_call>` may begin (white
    space at its end waits for what follows: before a call it is not content); from there it
    is held. Each call goes out as it is written, as OpenAI streams them: its id and
    name once `<function=NAME>` is complete (arguments ""), then its arguments JSON a
    parameter at a time, "}" when `</function>` closes it (take()). Joined, a call's pieces
    are parse()'s call of the whole output."""

    def __init__(self, tools):
        self.tools, self.held, self.buf, self.text = tools, False, "", ""
        self.released = 0  # characters of text given out as content
        self.schemas = _schemas(tools)
        self.sent: list = []  # per call: [id, the arguments sent so far]
        self.pending: list = []  # delta.tool_calls entries not yet taken
        self.calls: list = []  # finish(): the calls as parse() gives them

    def push(self, text: str) -> str:
        self.text += text
        if self.held:
            self._progress(final=False)
            return ""
        self.buf += text
        i = self.buf.find(TOOL_OPEN)
        if i >= 0:
            self.held = True
            out = self.buf[:i].rstrip()  # the content ends before the call's white space
            self.buf = ""
            self._progress(final=False)
        else:  # hold a possible `<tool_call>`'s start, and white space a call may follow
            keep = next((k for k in range(min(len(TOOL_OPEN) - 1, len(self.buf)), 0, -1)
                         if TOOL_OPEN.startswith(self.buf[-k:])), 0)
            out = self.buf[:len(self.buf) - keep].rstrip()
            self.buf = self.buf[len(out):]
        self.released += len(out)
        return out

    def _progress(self, final: bool) -> None:
        """Queue what the calls written so far add to what was sent."""
        for k, (name, params, ended) in enumerate(_scan(self.text)):
            frags = _fragments(params, self.schemas.get(name, {}))
            args = "".join(frags) + ("" if not (ended or final) else "}" if frags else "{}")
            if k == len(self.sent):
                self.sent.append([_call_id(), ""])
                self.pending.append({"index": k, "id": self.sent[k][0], "type": "function",
                                     "function": {"name": name, "arguments": ""}})
            done = self.sent[k][1]
            if len(args) > len(done):  # args extends what was sent: _scan is prefix-stable
                self.pending.append({"index": k, "function": {"arguments": args[len(done):]}})
                self.sent[k][1] = args

    def take(self) -> list:
        """The delta.tool_calls entries queued since the last take."""
        out, by_index = [], {}
        for e in self.pending:  # one entry a call: its header and arguments pieces joined
            k = e["index"]
            if k in by_index:
                by_index[k]["function"]["arguments"] += e["function"]["arguments"]
            else:
                by_index[k] = {**e, "function": dict(e["function"])}
                out.append(by_index[k])
        self.pending = []
        return out

    def finish(self) -> tuple[str, list]:
        """(the content still held, the calls): as parse() splits the whole text; the calls'
        last pieces are queued for take()."""
        content, calls = parse(self.text, self.tools)
        if not calls:
            return self.text[self.released:], []
        self._progress(final=True)
        for c, (cid, _) in zip(calls, self.sent):
            c["id"] = cid
        self.calls = calls
        return content[self.released:], calls
