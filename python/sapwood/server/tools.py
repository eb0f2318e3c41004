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
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*(?:</tool_call>|$)",
                   re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
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


def _arguments(body: str, schema: dict) -> dict:
    props = (schema or {}).get("properties") or {}
    args = {}
    for name, raw in _PARAM.findall(body):
        if _is_string(props.get(name)) or (props.get(name) or {}).get("type") == "string":
            args[name] = raw
            continue
        try:
            args[name] = json.loads(raw)
        except ValueError:  # what the model wrote, as text (vLLM's qwen3_coder parser does so)
            args[name] = raw
    return args


def parse(text: str, tools: list | None) -> tuple[str, list]:
    """(content before the first call, tool_calls as the API returns them) of an output."""
    if not tools or TOOL_OPEN not in text:
        return text, []
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    calls = []
    for name, body in _CALL.findall(text):
        name = name.strip()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": json.dumps(
                          _arguments(body, schemas.get(name, {})), ensure_ascii=False)}})
    if not calls:
        return text, []
    return text[:text.index(TOOL_OPEN)].rstrip(), calls


class Stream:
    """Streamed content with tools: text is released until a `<tool_call>` may begin; from
    there it is held, and the calls come out at the end (finish)."""

    def __init__(self, tools):
        self.tools, self.held, self.buf, self.text = tools, False, "", ""

    def push(self, text: str) -> str:
        self.text += text
        if self.held:
            return ""
        self.buf += text
        i = self.buf.find(TOOL_OPEN)
        if i >= 0:
            out, self.buf, self.held = self.buf[:i], "", True
            return out
        keep = next((k for k in range(min(len(TOOL_OPEN) - 1, len(self.buf)), 0, -1)
                     if TOOL_OPEN.startswith(self.buf[-k:])), 0)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> tuple[str, list]:
        """(the content still held, the calls): as parse() splits the whole text."""
        content, calls = parse(self.text, self.tools)
        if not calls:
            return self.buf if not self.held else self.text[len(self._released()):], []
        released = self._released()
        return content[len(released):], calls

    def _released(self) -> str:
        i = self.text.find(TOOL_OPEN)
        if i < 0:
            return self.text[:len(self.text) - len(self.buf)]
        return self.text[:i]
