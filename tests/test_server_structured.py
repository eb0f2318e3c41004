"""Structured output over the OpenAI API (issue 49): response_format json_object / json_schema
(strict) and vLLM's guided_json / guided_regex / guided_grammar / guided_choice, through the
official openai client against a live loopback server. Output parses and fits, greedy and
seeded sampled, identical in every verify mode; bad schemas get OpenAI 400s naming the field;
a bounded mixed load across slots gives each request its solo answer."""
import json
import re

import pytest
from util import LiveServer, concurrent_equals_solo, require_packages, tiny_server_target

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
CONTEXT = 384
TIMEOUT = 60
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "rain": {"type": "boolean"},
                   "temp": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "rain", "temp"],
    "additionalProperties": False,
}
MODES = [{"verify": "off"}, {"verify": "chain"}, {"verify": "tree", "width": 8},
         {"verify": "auto"}]
MSGS = [{"role": "user", "content": "Weather in Paris as JSON"}]


def fits(doc) -> bool:
    return (set(doc) == {"city", "rain", "temp"} and isinstance(doc["city"], str)
            and len(doc["city"]) <= 6 and isinstance(doc["rain"], bool)
            and isinstance(doc["temp"], int) and -40 <= doc["temp"] <= 50)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    target = tiny_server_target(tmp_path_factory.mktemp("structured"))
    # batch_verify: the slots' trees verified in one forward, each walked under its own masks
    st = server.build(str(target), parallel=2, max_context=CONTEXT, cache_mb=0, model_id="tiny",
                      drafter="lookup", batch_verify=True)
    srv = LiveServer(st, TIMEOUT)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=TIMEOUT)
    yield srv
    srv.close()


def chat(live, mode, **kw):
    kw.setdefault("max_tokens", 80)
    r = live.client.chat.completions.create(
        model="tiny", messages=MSGS,
        extra_body={"sapwood": {**mode, "return_token_ids": True}, **kw.pop("extra", {})}, **kw)
    c = r.choices[0]
    return c.message.content, r.sapwood["choices"][0]["token_ids"], c.finish_reason


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=5)])
def test_json_schema_output_fits_and_is_identical_in_every_mode(live, sampling):
    fmt = {"type": "json_schema",
           "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    outs = [chat(live, m, response_format=fmt, **sampling) for m in MODES]
    assert all(o == outs[0] for o in outs), outs
    text, _, finish = outs[0]
    assert finish == "stop" and fits(json.loads(text)), text
    plain = chat(live, MODES[0], **sampling)
    assert plain[1] != outs[0][1]


def test_json_object(live):
    outs = [chat(live, m, response_format={"type": "json_object"}, temperature=0.7, seed=3,
                 max_tokens=120) for m in MODES[:3]]
    assert all(o == outs[0] for o in outs)
    if outs[0][2] == "stop":
        assert isinstance(json.loads(outs[0][0]), dict)
    else:  # the budget ran out inside the object: still its beginning
        assert outs[0][0].startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": SCHEMA}, lambda t: fits(json.loads(t))),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: fits(json.loads(t))),
    ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
    ({"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'}, lambda t: re.fullmatch(r"x\d\d", t)),
    ({"guided_grammar": 'root ::= ("ab" | "cd")+ "."'}, lambda t: re.fullmatch(r"(ab|cd)+\.", t)),
    ({"guided_choice": ["sunny", "rainy", "snow é"]}, lambda t: t in ("sunny", "rainy", "snow é")),
])
def test_vllm_guided_fields_on_completions(live, extra, check):
    texts = set()
    for mode in MODES[:3]:
        r = live.client.completions.create(model="tiny", prompt="Answer:", max_tokens=60,
                                           temperature=0.8, seed=2,
                                           extra_body={"sapwood": mode, **extra})
        assert r.choices[0].finish_reason == "stop"
        texts.add(r.choices[0].text)
    assert len(texts) == 1 and check(texts.pop())


@pytest.mark.parametrize("kw, param, text", [
    (dict(response_format={"type": "json_schema",
                           "json_schema": {"name": "w", "schema": {"type": "frob"}}}),
     "response_format.json_schema.schema", "frob"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": 3}}),
     "response_format", "schema must be a JSON object"),
    (dict(response_format={"type": "yaml"}), "response_format", "json_object"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
     "guided_regex", "give one"),
    (dict(extra_body={"guided_regex": "a(b"}), "guided_regex", "regex"),
    (dict(extra_body={"guided_grammar": "start: nope"}), "guided_grammar", "grammar"),
    (dict(extra_body={"guided_json": "{bad"}), "guided_json", "not valid JSON"),
])
def test_bad_constraints_are_openai_400s_naming_the_field(live, kw, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)
    err = e.value.body
    assert err["param"] == param and text in err["message"], err
    assert chat(live, MODES[0], max_tokens=3)[2] == "length"  # still serving


def test_streamed_constrained_chat_is_the_whole_answer(live):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    whole = chat(live, MODES[2], response_format=fmt, temperature=0.9, seed=8)[0]
    parts = []
    for ch in live.client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=80, response_format=fmt, temperature=0.9,
            seed=8, stream=True, extra_body={"sapwood": MODES[3]}):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
    assert "".join(parts) == whole and fits(json.loads(whole))


def test_mixed_load_across_slots_gives_each_request_its_solo_answer(live):
    """Constrained and plain requests at once on two slots, three rounds each: every answer
    is the one the same request got alone (bounded: 12 requests, a 60 s timeout each)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    reqs = [dict(response_format=fmt, temperature=0.9, seed=s) for s in (1, 2)]
    reqs += [dict(temperature=0.9, seed=3), dict(extra={"guided_regex": "[a-f]{5}"}, seed=4,
                                                 temperature=1.0)]
    mode = {"verify": "tree", "width": 6}
    concurrent_equals_solo(lambda r: chat(live, mode, **dict(r)), reqs, TIMEOUT)
