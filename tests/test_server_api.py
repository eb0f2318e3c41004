"""`sapwood serve` answering what OpenAI clients send (issue 49): OpenAI error objects on every
route (an unknown route, a wrong method, a body that is not JSON), GET /v1/models/{id}, the
API's fields honoured, ignored or refused as docs/server.md lists them, null as a field's
default, an optional API key and CORS. Live servers on free loopback ports over a tiny
checkpoint, talked to with httpx and with the official openai client."""
import json
import logging
import re
from pathlib import Path

import pytest
from util import LiveServer, require_packages, tiny_server_target

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402
from sapwood.server import protocol  # noqa: E402
from sapwood.server.protocol import ChatRequest, CompletionRequest  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
CONTEXT = 256
TIMEOUT = 30
KEY = "sk-test-0123"
ORIGIN = "http://app.example:3000"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_server_target(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def live(target):
    st = server.build(str(target), parallel=1, max_context=CONTEXT, cache_mb=0, model_id="tiny")
    srv = LiveServer(st, TIMEOUT)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def locked(target):
    """A key, one allowed origin and a served name with a "/" in it, as hub ids have."""
    st = server.build(str(target), parallel=1, max_context=CONTEXT, cache_mb=0,
                      model_id="org/tiny", api_key=KEY, cors_origins=[ORIGIN])
    srv = LiveServer(st, TIMEOUT)
    yield srv
    srv.close()


def openai_error(r, status, code=None):
    """An OpenAI error object, never the framework's {"detail": ...}."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    doc = r.json()
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- 1. OpenAI-shaped errors everywhere --------------------------------------------------------

ROUTE_ERRORS = [  # (method, path, body, status, code, text the message must show)
    ("GET", "/v1/nope", None, 404, "unknown_url", "GET /v1/nope"),
    ("POST", "/v1/embeddings", {"model": "tiny"}, 404, "unknown_url", "POST /v1/embeddings"),
    ("GET", "/", None, 404, "unknown_url", "GET /"),
    ("POST", "/v2/completions", {}, 404, "unknown_url", "/v2/completions"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed", "allows POST"),
    ("GET", "/v1/chat/completions", None, 405, "method_not_allowed", "allows POST"),
    ("POST", "/v1/models", {}, 405, "method_not_allowed", "allows GET"),
    ("DELETE", "/v1/models/tiny", None, 405, "method_not_allowed", "DELETE"),
    ("PUT", "/health", None, 405, "method_not_allowed", "PUT /health"),
    ("GET", "/v1/models/gpt-4", None, 404, "model_not_found", "'gpt-4'"),
]


@pytest.mark.parametrize("case", ROUTE_ERRORS, ids=lambda c: f"{c[0]} {c[1]}")
def test_route_errors_are_openai_errors(live, case):
    method, path, body, status, code, shows = case
    r = live.http.request(method, path, json=body)
    err = openai_error(r, status, code)
    assert shows in err["message"], err
    if status == 405:  # the methods the path allows, as HTTP says
        assert r.headers["allow"] in ("GET", "POST"), r.headers


NOT_JSON = [b"", b"model=tiny&prompt=hi", b"\xff\xfe\x00", b"{'model': 'tiny'}", b"null",
            b'"a string"', b'{"model": "tiny", "prompt": "hi"']


@pytest.mark.parametrize("raw", NOT_JSON)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_a_json_object_is_an_openai_400(live, path, raw):
    ctype = "application/x-www-form-urlencoded" if b"=" in raw else "application/json"
    r = live.http.post(path, content=raw, headers={"content-type": ctype})
    openai_error(r, 400, "invalid_json")


def test_the_openai_client_reads_route_errors(live):
    with pytest.raises(openai.NotFoundError) as e:
        live.client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "'gpt-4'" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        live.client.get("/nope", cast_to=object)
    assert e.value.body["code"] == "unknown_url"


# -- 2. GET /v1/models/{id} ----------------------------------------------------------------------

def test_models_retrieve(live, locked):
    m = live.client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "sapwood")
    assert m.model_dump() == live.client.models.list().data[0].model_dump()
    # a served name with "/" in it (a hub id) is one path parameter
    r = locked.http.get("/v1/models/org/tiny", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["id"] == "org/tiny", r.text
    r = locked.http.get("/v1/models/org", headers={"authorization": f"Bearer {KEY}"})
    openai_error(r, 404, "model_not_found")


# -- 3. fields: honoured, ignored, refused ---------------------------------------------------------

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
        "temperature": 0.8, "seed": 5, "sapwood": {"return_token_ids": True}}
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0.8,
              "seed": 5, "sapwood": {"return_token_ids": True}}

IGNORED_CHAT = {"user": "u-1", "store": True, "metadata": {"team": "a"}, "service_tier": "auto",
                "safety_identifier": "h", "prompt_cache_key": "k",
                "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
                "parallel_tool_calls": False, "reasoning_effort": "low", "verbosity": "low",
                "prediction": {"type": "content", "content": "hello"}}
NEUTRAL_CHAT = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "auto",
                "response_format": {"type": "text"}, "modalities": ["text"], "logit_bias": {},
                "stream_options": {"include_usage": False, "include_obfuscation": True}}
IGNORED_COMPLETION = {"user": "u-1", "store": False, "metadata": {}, "service_tier": "default"}
NEUTRAL_COMPLETION = {"echo": False, "best_of": 1, "suffix": "", "logit_bias": {"7": 0}}


def tokens_of(r):
    assert r.status_code == 200, r.text
    doc = r.json()
    return [c["token_ids"] for c in doc["sapwood"]["choices"]], doc


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_ignored_and_neutral_fields_change_nothing(live, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = CHAT if chat else COMPLETION
    want, _ = tokens_of(live.post(base, path))
    extra = {**IGNORED_CHAT, **NEUTRAL_CHAT} if chat else {**IGNORED_COMPLETION,
                                                            **NEUTRAL_COMPLETION}
    got, _ = tokens_of(live.post({**base, **extra}, path))
    assert got == want
    # every field of the kind, one at a time: no field refused alone either
    for name, v in extra.items():
        assert tokens_of(live.post({**base, name: v}, path))[0] == want, name


def test_the_openai_client_sends_what_sdk_wrappers_send(live):
    """The fields an SDK wrapper adds (a 400 each before): the answer is the plain one."""
    kw = dict(model="tiny", messages=CHAT["messages"], max_tokens=6, temperature=0.8, seed=5)
    want = live.client.chat.completions.create(**kw).choices[0].message.content
    r = live.client.chat.completions.create(
        **kw, user="u-1", store=False, metadata={"run": "1"}, service_tier="auto",
        parallel_tool_calls=True, reasoning_effort="minimal", n=1, logit_bias={},
        stream_options=None, response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].message.content == want
    # an assistant turn sent back as the client parsed it, its null fields included
    turn = r.choices[0].message.model_dump()
    assert "refusal" in turn and "tool_calls" in turn
    r2 = live.client.chat.completions.create(
        model="tiny", max_tokens=3, temperature=0,
        messages=[*CHAT["messages"], turn, {"role": "user", "content": "again"}])
    assert r2.choices[0].finish_reason == "length"


def test_stream_include_usage_is_honoured(live):
    chunks = list(live.client.chat.completions.create(
        model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_null_is_a_fields_default(live, chat):
    """Clients send null for fields they leave unset (the API's types are Optional)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = CHAT if chat else COMPLETION
    want, doc = tokens_of(live.post(base, path))
    nulls = {"n": None, "stop": None, "top_p": None, "top_k": None, "presence_penalty": None,
             "frequency_penalty": None, "stream": None, "stream_options": None, "logprobs": None,
             "logit_bias": None, "user": None}
    nulls.update({"top_logprobs": None, "tools": None, "tool_choice": None,
                  "response_format": None} if chat else {"echo": None, "suffix": None,
                                                         "best_of": None})
    got, doc2 = tokens_of(live.post({**base, **nulls}, path))
    assert got == want and len(doc2["choices"]) == 1
    # an unknown field is refused, null or not
    err = openai_error(live.post({**base, "temprature": None}, path), 400, "unknown_field")
    assert err["param"] == "temprature"


REFUSED = [  # (chat, field, value, param, text the message must show)
    # tools are honoured (tests/test_server_tools.py); malformed ones and the legacy API not
    (True, "tools", [{"type": "function", "function": {"name": "bad name"}}], "tools",
     "name must be"),
    (True, "tool_choice", "required", "tool_choice", "needs tools"),
    (True, "tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice",
     "needs tools"),
    (True, "tool_choice", "sometimes", "tool_choice", "'required'"),
    (True, "functions", [{"name": "f"}], "functions", "legacy functions API"),
    (True, "function_call", {"name": "f"}, "function_call", "legacy functions API"),
    # structured output is honoured (tests/test_server_structured.py); a malformed one is not
    (True, "response_format", {"type": "yaml"}, "response_format", "json_object"),
    (True, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "s": 1}},
     "response_format", "unknown key 's'"),
    (True, "modalities", ["text", "audio"], "modalities", "text only"),
    (True, "audio", {"voice": "alloy", "format": "wav"}, "audio", "text only"),
    (True, "web_search_options", {}, "web_search_options", "web search"),
    (True, "moderation", {"model": "m"}, "moderation", "moderate"),
    (True, "logit_bias", {"5": -100}, "logit_bias", "bias changes the distribution"),
    (True, "messages", [{"role": "function", "content": "42", "name": "f"}],
     "messages.0.role", "legacy functions API"),
    (True, "messages", [{"role": "assistant", "content": "x",
                         "tool_calls": [{"id": "c1", "type": "function"}]}],
     "messages.0.tool_calls", "needs function"),
    (True, "messages", [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "x"}}]}],
     "messages.0.content", "only 'text' parts"),
    (False, "echo", True, "echo", "not returned"),
    (False, "best_of", 2, "best_of", "use n"),
    (False, "suffix", "}", "suffix", "insertion"),
    (False, "logit_bias", {"5": 10}, "logit_bias", "only zero biases"),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c[1]}={c[2]!r}"[:40])
def test_refused_fields_say_which_and_why(live, case):
    chat, name, value, param, shows = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    err = openai_error(live.post({**(CHAT if chat else COMPLETION), name: value}, path), 400)
    assert err["param"] == param and shows in err["message"], err


def test_ignored_fields_are_logged_once(live, monkeypatch, caplog):
    monkeypatch.setattr(protocol, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="sapwood.server"):
        for _ in range(2):
            tokens_of(live.post({**CHAT, "store": True, "metadata": {}}, "/v1/chat/completions"))
    said = [r.getMessage() for r in caplog.records if r.name == "sapwood.server"]
    assert sorted(said) == sorted(f"request field {f!r} is accepted and ignored (docs/server.md"
                                  ", 'Fields')" for f in ("store", "metadata")), said


def test_the_docs_list_every_field():
    """docs/server.md's "Fields" section names every field a request may hold, each once as
    honoured, ignored or refused, and the kinds agree with protocol.py's tables."""
    text = DOCS.read_text()
    section = text[text.index("\n## Fields"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| (honoured|ignored|refused unless neutral) \| (.*?) \|", line)
        if m:
            for name in re.findall(r"`([a-z_.]+)`", m.group(2)):
                assert name not in rows, f"{name} listed twice"
                rows[name] = m.group(1)
    fields = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    fields |= {f"messages.{f}" for f in protocol.Message.model_fields}
    fields |= {f"stream_options.{f}" for f in protocol.StreamOptions.model_fields}
    fields -= {"stream_options"}  # its members are listed
    assert fields == set(rows), fields ^ set(rows)
    for name in protocol.IGNORED_CHAT:
        assert rows[name] == "ignored", name
    for name in {**protocol.REFUSED_CHAT, **protocol.REFUSED_COMPLETION}:
        assert rows[name] == "refused unless neutral", name


# -- 4. API key and CORS -------------------------------------------------------------------------

def test_without_the_key_every_route_but_health_is_a_401(locked):
    body = {"model": "org/tiny", "prompt": "hi", "max_tokens": 2}
    assert locked.http.get("/health").status_code == 200
    for method, path, headers in [
            ("POST", "/v1/completions", {}),
            ("GET", "/v1/models", {"authorization": "Bearer wrong"}),
            ("GET", "/metrics", {"authorization": KEY}),                # no scheme
            ("GET", "/v1/nope", {}),                                    # routes stay unmapped
            ("POST", "/v1/chat/completions", {"authorization": f"Basic {KEY}"}),
            ("GET", "/v1/models", {"authorization": f"Bearer {KEY}x"})]:
        r = locked.http.request(method, path, json=body, headers=headers)
        err = openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer" and KEY not in err["message"]
    r = locked.http.post("/v1/completions", json=body, headers={"authorization": f"bearer {KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert locked.http.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code \
        == 200


def test_the_openai_client_with_and_without_the_key(locked):
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model="org/tiny", max_tokens=3, temperature=0,
                                     messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length"
    assert [m.id for m in good.models.list().data] == ["org/tiny"]
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="sk-other", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="org/tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def _preflight(srv, origin, method="POST"):
    return srv.http.options("/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": method,
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})


def test_cors_lets_the_allowed_origin_in(locked):
    # the preflight carries no key (browsers never send one) and is answered before the check
    r = _preflight(locked, ORIGIN)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-stainless-os" in r.headers["access-control-allow-headers"]
    assert "POST" in r.headers["access-control-allow-methods"]
    # the answers a page reads: a 401 too, so that it can tell why
    for key in (KEY, None):
        headers = {"origin": ORIGIN, **({"authorization": f"Bearer {key}"} if key else {})}
        r = locked.http.get("/v1/models", headers=headers)
        assert r.status_code == (200 if key else 401)
        assert r.headers["access-control-allow-origin"] == ORIGIN
    # another origin: no header that lets its page read anything, and an OpenAI error
    r = _preflight(locked, "http://evil.example")
    openai_error(r, 400, "cors_refused")
    assert "access-control-allow-origin" not in r.headers
    r = locked.http.get("/v1/models", headers={"origin": "http://evil.example",
                                               "authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_is_off_by_default(live):
    r = _preflight(live, ORIGIN)
    openai_error(r, 405, "method_not_allowed")
    assert not [h for h in r.headers if h.startswith("access-control-")]
    r = live.http.get("/v1/models", headers={"origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_the_key_from_the_environment(monkeypatch, target):
    monkeypatch.setenv("SAPWOOD_API_KEY", "sk-env")
    st = server.build(str(target), max_context=CONTEXT, cache_mb=0)
    try:
        assert st.api_key == "sk-env"
    finally:
        st.close()
    st = server.build(str(target), max_context=CONTEXT, cache_mb=0, api_key="sk-arg")
    try:
        assert st.api_key == "sk-arg"  # the argument wins
    finally:
        st.close()


@pytest.mark.parametrize("kw, match", [
    (dict(api_key=""), "api_key"), (dict(api_key="two words"), "api_key"),
    (dict(api_key="kéy"), "api_key"), (dict(cors_origins=["http://a.example/"]), "no path"),
    (dict(cors_origins=["a.example"]), "scheme://host"), (dict(cors_origins=[5]), "5")])
def test_bad_keys_and_origins_fail_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        server.build("/nonexistent/checkpoint", **kw)  # loading it would fail otherwise


def test_serve_api_key_and_cors_from_the_command_line(monkeypatch, target, capsys):
    from sapwood.cli import main

    built = []
    monkeypatch.setattr(server, "run", lambda st, **kw: built.append(st))
    monkeypatch.delenv("SAPWOOD_API_KEY", raising=False)
    assert main(["serve", str(target), "--port", "1", "--max-context", str(CONTEXT),
                 "--host", "0.0.0.0", "--api-key", KEY, "--cors-origin", ORIGIN,
                 "--cors-origin", "*"]) == 0
    assert (built[0].api_key, built[0].cors_origins) == (KEY, (ORIGIN, "*"))
    assert "no authentication" not in capsys.readouterr().err
    built[0].close()
    assert main(["serve", str(target), "--port", "1", "--max-context", str(CONTEXT),
                 "--host", "0.0.0.0"]) == 0
    assert built[1].api_key is None and built[1].cors_origins == ()
    assert "no authentication" in capsys.readouterr().err
    built[1].close()
