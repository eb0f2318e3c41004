"""POST /v1/responses through the openai client's responses.create (issue 49): text in and out
as the chat request it means (same tokens), reasoning items, function calls and their outputs
going back as input items, text.format constraints identical in every verify mode, streaming
events joined to the result, and errors naming the Responses fields."""
import json

import pytest
from test_server_tools import TOOLS, qwen_markup_server, weather_ok
from util import LiveServer, require_packages

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
TIMEOUT = 60
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MODES = [{"verify": "off"}, {"verify": "chain"}, {"verify": "tree", "width": 8},
         {"verify": "auto"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv = qwen_markup_server(tmp_path_factory, "responses", parallel=1)
    yield srv
    srv.close()


def test_text_in_text_out_is_the_chat_answer(live):
    r = live.client.responses.create(model="tiny", input="Hello there", max_output_tokens=16,
                                     temperature=0.8, extra_body={"seed": 3, **NO_THINK})
    c = live.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=16,
        temperature=0.8, seed=3, extra_body=NO_THINK)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == c.choices[0].message.content
    assert r.usage.output_tokens == 16 and r.usage.input_tokens == c.usage.prompt_tokens


def test_instructions_and_items_and_reasoning(live):
    r = live.client.responses.create(
        model="tiny", instructions="Be brief.", max_output_tokens=24, temperature=0.0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
               {"role": "user", "content": "More?"}],
        extra_body={"thinking_budget": 5})
    kinds = [o.type for o in r.output]
    assert kinds[0] == "reasoning" and "message" in kinds
    assert r.output[0].content[0].text  # the reasoning text, capped by the budget


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_text_format_json_schema_in_every_mode(live, temperature):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    outs = []
    for mode in MODES:
        r = live.client.responses.create(
            model="tiny", input="A number as JSON", max_output_tokens=40, temperature=temperature,
            text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                                     "strict": True}},
            extra_body={"sapwood": mode, "seed": 5, **NO_THINK})
        outs.append(r.output_text)
    assert all(o == outs[0] for o in outs)
    assert 0 <= json.loads(outs[0])["n"] <= 99


def test_function_calls_and_their_outputs(live):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = live.client.responses.create(model="tiny", input="Weather?", tools=tools,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=120, temperature=0.5,
                                     parallel_tool_calls=False, extra_body={"seed": 1, **NO_THINK})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert weather_ok(json.loads(calls[0].arguments))
    follow = live.client.responses.create(
        model="tiny", tools=tools, max_output_tokens=8, extra_body=NO_THINK,
        input=[{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")


def test_streaming_events_join_to_the_result(live):
    kw = dict(model="tiny", input="Tell me", max_output_tokens=30, temperature=0.9,
              extra_body={"thinking_budget": 6, "seed": 4})
    whole = live.client.responses.create(**kw)
    deltas, reasoning, types, final = [], [], [], None
    for ev in live.client.responses.create(stream=True, **kw):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type == "response.reasoning_text.delta":
            reasoning.append(ev.delta)
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert types[0] == "response.created" and final is not None
    assert "".join(deltas) == whole.output_text == final.output_text
    assert "".join(reasoning) == whole.output[0].content[0].text


def test_streamed_function_call_events_are_openais(live):
    """A streamed function call is OpenAI's event sequence: the item added with arguments ""
    as soon as its name is written, its arguments as response.function_call_arguments.delta
    events a parameter at a time, .done with them whole, the item done under the id it was
    added with; the SDK's stream helper joins them to the response's call."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model="tiny", input="Weather?", tools=tools, max_output_tokens=120,
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0.5,
              parallel_tool_calls=False, extra_body={"seed": 1, **NO_THINK})
    whole = live.client.responses.create(**kw)
    want = [o for o in whole.output if o.type == "function_call"][0]
    seen, deltas, item_ids = [], [], set()
    for ev in live.client.responses.create(stream=True, **kw):
        if ev.type == "response.output_item.added" and ev.item.type == "function_call":
            seen.append(("added", ev.item.name, ev.item.arguments))
            item_ids.add(ev.item.id)
        elif ev.type == "response.function_call_arguments.delta":
            deltas.append(ev.delta)
            item_ids.add(ev.item_id)
        elif ev.type == "response.function_call_arguments.done":
            seen.append(("done", ev.name, ev.arguments))
        elif ev.type == "response.output_item.done" and ev.item.type == "function_call":
            seen.append(("item", ev.item.name, ev.item.arguments))
            item_ids.add(ev.item.id)
    assert seen == [("added", "get_weather", ""), ("done", "get_weather", want.arguments),
                    ("item", "get_weather", want.arguments)]
    assert "".join(deltas) == want.arguments and len(item_ids) == 1
    assert len(deltas) == len(json.loads(want.arguments)) + 1  # a parameter a piece, then "}"
    with live.client.responses.stream(**kw) as st:
        for _ in st:
            pass
        final = st.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        ("get_weather", want.arguments)]


@pytest.mark.parametrize("kw, param, text", [
    (dict(input="x", previous_response_id="resp_1"), "previous_response_id", "not found"),
    (dict(input="x", conversation="conv_1"), "conversation", "keeps no"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens", ""),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input.0.content", "input_image"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools", "web_search"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "s",
                                      "schema": {"type": "frob"}}}),
     "text.format.json_schema.schema", "frob"),
    (dict(input=[]), "input", "non-empty"),
])
def test_bad_requests_name_the_responses_field(live, kw, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.responses.create(model="tiny", **kw)
    assert e.value.body["param"] == param and text in e.value.body["message"], e.value.body


def test_previous_response_id_continues_the_conversation(live):
    """A follow-up by previous_response_id is the request that sends the whole conversation as
    input items (the same greedy answer); GET /v1/responses/{id} returns the stored response;
    store=False keeps nothing."""
    kw = dict(model="tiny", max_output_tokens=12, temperature=0.0, extra_body=NO_THINK)
    first = live.client.responses.create(input="Hello there", **kw)
    follow = live.client.responses.create(input="And then?", previous_response_id=first.id, **kw)
    full = live.client.responses.create(input=[
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And then?"}], **kw)
    assert follow.output_text == full.output_text and follow.previous_response_id == first.id
    assert follow.usage.input_tokens == full.usage.input_tokens > first.usage.input_tokens
    got = live.client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.store
    # streamed responses are stored too
    ends = [ev.response for ev in live.client.responses.create(input="Hello there", stream=True, **kw)
            if ev.type in ("response.completed", "response.incomplete")]
    again = live.client.responses.create(input="And then?", previous_response_id=ends[0].id, **kw)
    assert again.output_text == follow.output_text
    kept_not = live.client.responses.create(input="Hello there", store=False, **kw)
    assert not kept_not.store
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(kept_not.id)
    with pytest.raises(openai.BadRequestError):
        live.client.responses.create(input="x", previous_response_id=kept_not.id, **kw)


def test_unknown_fields_are_refused(live):
    r = live.post({"model": "tiny", "input": "x", "temprature": 1}, path="/v1/responses")
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field"


def test_served_model_name_aliases(tmp_path):
    from util import tiny_server_target
    target = tiny_server_target(tmp_path)
    st = server.build(str(target), parallel=1, max_context=128, cache_mb=0, model_id="main",
                      aliases=["alias-1", "org/alias-2"])
    srv = LiveServer(st, TIMEOUT)
    try:
        ids = [m["id"] for m in srv.http.get("/v1/models").json()["data"]]
        assert ids == ["main", "alias-1", "org/alias-2"]
        assert srv.http.get("/v1/models/org/alias-2").json()["id"] == "org/alias-2"
        for name in ids:
            r = srv.post({"model": name, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "main"
        r = srv.post({"model": "other", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404 and "'alias-1'" in r.json()["error"]["message"]
    finally:
        srv.close()
