"""Tool calling over the OpenAI API in Qwen3.5's format (issue 49): tools rendered by the chat
template, tool_choice required / named enforced by a grammar (arguments fit each parameter's
schema; identical in every verify mode, greedy and sampled), calls parsed into
message.tool_calls and streamed delta.tool_calls, assistant tool_calls and `tool` results
going back through the template. A tiny checkpoint whose tokenizer has Qwen3.5's markup
tokens, with a template of Qwen3.5's shape (written for this test)."""
import json

import pytest
from util import LiveServer, concurrent_equals_solo, require_packages

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402
from sapwood.server.protocol import Message  # noqa: E402
from sapwood.server.tools import Stream, call_grammar, parse  # noqa: E402
from sapwood.testing import QWEN_MARKUP, make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
TIMEOUT = 60
TEMPLATE = r"""{%- if tools %}<|im_start|>system
# Tools

<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments | items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},  # random models write on and on
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
MODES = [{"verify": "off"}, {"verify": "chain"}, {"verify": "tree", "width": 8},
         {"verify": "auto"}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def qwen_markup_server(tmp_path_factory, name: str, parallel: int) -> LiveServer:
    """A live server of a tiny checkpoint with Qwen3.5's markup tokens and TEMPLATE, and an
    openai client on it (srv.client); the caller closes it."""
    root = tmp_path_factory.mktemp(name) / "target"
    make_tiny_checkpoint(root, seed=6, layers=2, special_tokens=QWEN_MARKUP)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    st = server.build(str(root), parallel=parallel, max_context=2048, cache_mb=0,
                      model_id="tiny", drafter="lookup")
    srv = LiveServer(st, TIMEOUT)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=TIMEOUT)
    return srv


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv = qwen_markup_server(tmp_path_factory, "tools", parallel=2)
    yield srv
    srv.close()


def chat(live, mode, messages=MSGS, extra=None, **kw):
    r = live.client.chat.completions.create(
        model="tiny", messages=messages, **{"max_tokens": 120, **kw},
        extra_body={"sapwood": {**mode, "return_token_ids": True}, **NO_THINK, **(extra or {})})
    c = r.choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
    return calls, c.message.content, c.finish_reason, r.sapwood["choices"][0]["token_ids"]


def weather_ok(args) -> bool:
    return (set(args) <= {"city", "days", "unit"} and isinstance(args["city"], str)
            and len(args["city"]) <= 8
            and isinstance(args["days"], int) and 1 <= args["days"] <= 7
            and args.get("unit", "c") in ("c", "f"))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=3)])
def test_required_tool_calls_fit_and_are_identical_in_every_mode(live, sampling):
    outs = [chat(live, m, tools=TOOLS, tool_choice="required", **sampling) for m in MODES]
    assert all(o == outs[0] for o in outs), outs
    calls, content, finish, _ = outs[0]
    assert finish == "tool_calls" and calls and content is None
    for name, args in calls:
        assert (name == "get_weather" and weather_ok(args)) or (
            name == "clock" and args["zone"] in ("UTC", "CET"))


def test_named_tool_and_no_parallel_calls(live):
    for seed in range(3):
        calls, _, finish, _ = chat(live, MODES[2], tools=TOOLS, temperature=1.0, seed=seed,
                                   tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}},
                                   parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0][0] == "get_weather" and weather_ok(calls[0][1])


def test_auto_and_none(live):
    calls, content, finish, ids = chat(live, MODES[0], tools=TOOLS, max_tokens=20)
    assert finish in ("length", "stop", "tool_calls")  # the random model chooses
    none = chat(live, MODES[0], tools=TOOLS, tool_choice="none", max_tokens=20)
    assert none[0] == [] and none[2] != "tool_calls"


def test_required_with_thinking_calls_after_the_budget(live):
    r = live.client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=160,
        temperature=0.7, seed=2, extra_body={"thinking_budget": 5})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls
    assert m.reasoning_content is not None


def test_streamed_tool_calls_are_the_messages(live):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0.8, seed=7)
    calls, _, _, _ = chat(live, MODES[2], **kw)
    got, finish = {}, None
    for ch in live.client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=120, stream=True, **kw,
            extra_body={"sapwood": MODES[3], **NO_THINK}):
        for c in ch.choices:
            for t in c.delta.tool_calls or []:  # as OpenAI's: id and name first, then pieces
                if t.index not in got:
                    assert t.id.startswith("call_") and t.type == "function", t
                    got[t.index] = [t.function.name, ""]
                else:
                    assert (t.id, t.type, t.function.name) == (None, None, None), t
                got[t.index][1] += t.function.arguments
            finish = c.finish_reason or finish
    assert [(n, json.loads(a)) for n, a in (got[i] for i in sorted(got))] == calls
    assert finish == "tool_calls"


def _pieces(text, step):
    """What a Stream sends of text pushed `step` characters at a time: (the content, the
    delta.tool_calls entries in order, the calls finish() gives)."""
    s, out, entries = Stream(TOOLS), "", []
    for i in range(0, len(text), step):
        out += s.push(text[i:i + step])
        entries += s.take()
    rest, calls = s.finish()
    return out + rest, entries + s.take(), calls


def test_streamed_tool_call_arguments_come_a_parameter_at_a_time():
    """Each call streams as OpenAI's (and vLLM's) do: its id and name (arguments "") once
    `<function=NAME>` is written, then its arguments JSON a parameter at a time as each
    `</parameter>` completes one, "}" at `</function>`; joined, the pieces are parse()'s."""
    text = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York"
            "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=clock>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
            "</tool_call>")
    content, entries, calls = _pieces(text, 1)
    a, b = calls[0]["id"], calls[1]["id"]
    assert content == parse(text, TOOLS)[0] == "Let me check."  # white space before a call: not content
    assert entries == [
        {"index": 0, "id": a, "type": "function", "function": {"name": "get_weather",
                                                               "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "New York"'}},
        {"index": 0, "function": {"arguments": ', "days": 3'}},
        {"index": 0, "function": {"arguments": "}"}},
        {"index": 1, "id": b, "type": "function", "function": {"name": "clock",
                                                               "arguments": ""}},
        {"index": 1, "function": {"arguments": '{"zone": "UTC"'}},
        {"index": 1, "function": {"arguments": "}"}}]
    assert [c["function"] for c in calls] == [c["function"] for c in parse(text, TOOLS)[1]]
    for step in (3, 7, 40, len(text)):  # bigger deltas: the same calls, fewer pieces
        content, entries, calls = _pieces(text, step)
        assert content == "Let me check."
        joined = {}
        for e in entries:
            joined[e["index"]] = joined.get(e["index"], "") + e["function"]["arguments"]
        assert [joined[0], joined[1]] == [c["function"]["arguments"] for c in calls]
        assert [json.loads(x) for x in (joined[0], joined[1])] == [
            {"city": "New York", "days": 3}, {"zone": "UTC"}]
    # max_tokens cut the call: it keeps the parameters it completed, streamed or not
    cut = text[:text.index("<parameter=days>") + 20]
    content, entries, calls = _pieces(cut, 1)
    assert [e["function"]["arguments"] for e in entries] == ["", '{"city": "New York"', "}"]
    assert [c["function"] for c in calls] == [c["function"] for c in parse(cut, TOOLS)[1]] == [
        {"name": "get_weather", "arguments": '{"city": "New York"}'}]
    # no call: white space held for a call that may follow comes out at the end, all of it
    for plain in ("a b \n\n", "x <tool_ca", "<tool_call>\nno function\n"):
        for step in (1, 2, 5):
            assert _pieces(plain, step)[::2] == (plain, [])


def test_tool_results_go_back_through_the_template(live):
    turn = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    prompt = live.st.model.apply_chat_template(
        [Message.model_validate(m).as_template_dict() for m in turn], tools=TOOLS)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<parameter=days>\n2\n</parameter>" in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    out = chat(live, MODES[2], messages=turn, tools=TOOLS, max_tokens=8)
    assert out[2] in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("kw, param, text", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "not in tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice", "give one"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "given twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "frob"}}}}}], tool_choice="required"),
     "tools", "frob"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages.0.tool_calls", "not JSON"),
])
def test_bad_tool_requests_are_openai_400s(live, kw, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="tiny", **{"messages": MSGS, "max_tokens": 4,
                                                             **kw})
    assert e.value.body["param"] == param and text in e.value.body["message"], e.value.body


def test_parser_reads_qwen35_blocks():
    text = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York"
            "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=clock>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
            "</tool_call>")
    content, calls = parse(text, TOOLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3}), ("clock", {"zone": "UTC"})]
    assert parse("no calls here", TOOLS) == ("no calls here", [])
    for step in (1, 4, 9):
        s, out = Stream(TOOLS), ""
        for i in range(0, len(text), step):
            out += s.push(text[i:i + step])
        rest, streamed = s.finish()
        assert out + rest == "Let me check.\n\n" or (out + rest).rstrip() == content
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_call_grammar_shape():
    g = call_grammar(TOOLS, ["clock"], parallel=False)
    assert g.startswith("start: call\n") and "get_weather" not in g
    assert '("UTC" | "CET")' in g
    with pytest.raises(ValueError, match="not in tools"):
        call_grammar(TOOLS, ["nope"], parallel=True)


def test_mixed_load_of_tool_constrained_and_plain_requests(live):
    """Tool calls, a JSON schema, a thinking budget and plain sampling at once on two slots,
    three rounds each (bounded: 15 requests, a 60 s timeout each): every answer is the one the
    same request got alone."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reqs = [dict(tools=TOOLS, tool_choice="required", temperature=0.9, seed=11),
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}},
                 temperature=0.6, seed=12),
            dict(response_format={"type": "json_schema",
                                  "json_schema": {"name": "s", "schema": schema}}, seed=13,
                 temperature=1.0),
            dict(temperature=0.9, seed=14, max_tokens=30),
            dict(temperature=0.8, seed=15, max_tokens=30, extra={"thinking_budget": 4,
                                                                 "chat_template_kwargs": {}})]
    mode = {"verify": "tree", "width": 6}
    solo = concurrent_equals_solo(lambda r: chat(live, mode, **dict(r)), reqs, TIMEOUT)
    assert solo[0][2] == solo[1][2] == "tool_calls"
