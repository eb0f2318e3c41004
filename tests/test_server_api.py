"""`sapwood serve` answering what OpenAI clients send (issue 49): OpenAI error objects on every
route (an unknown route, a wrong method, a body that is not JSON) and GET /v1/models/{id}. A
live server on a free loopback port over a tiny checkpoint, talked to with httpx and with the
official openai client."""

import pytest
from util import LiveServer, require_packages, tiny_server_target

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
CONTEXT = 256
TIMEOUT = 30


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
    ("POST", "/v1/responses", {"model": "tiny"}, 404, "unknown_url", "POST /v1/responses"),
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

def test_models_retrieve(live):
    m = live.client.models.retrieve("tiny")
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "sapwood")
    assert m.model_dump() == live.client.models.list().data[0].model_dump()
