"""`sapwood serve` against hostile clients (issue 50, cases 2, 3 and 9): every choice ends in a
result or an error and a failed request answers once; numbers are held to ranges that cannot
overflow; bodies are size-limited, parsed and tokenized off the event loop and refused as too
long before tokenizing; deep JSON, lone surrogates and requests that can never fit the queue get
a 400 saying why. A live server on a free loopback port over a tiny checkpoint, as in
tests/test_server.py; raw sockets where a client must misbehave below HTTP."""
import asyncio
import json
import socket
import threading
import time
import unicodedata

import numpy as np
import pytest
from util import LiveServer, require_packages, tiny_server_target

require_packages()

import sapwood  # noqa: E402
from sapwood import server  # noqa: E402
from sapwood.sampling import SamplingParams  # noqa: E402
from sapwood.server.slots import Job, Scheduler, SnapshotCache, TooManyChoices  # noqa: E402
from sapwood.server.text import _NORMALIZER_SHRINK, chars_per_token_bound  # noqa: E402
from sapwood.testing import make_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
CONTEXT = 256
MAX_BODY = 64 * 1024
TIMEOUT = 30  # a liveness bound: a request that hangs fails here instead of hanging the suite


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_server_target(tmp_path_factory.mktemp("harden"))


@pytest.fixture(scope="module")
def live(target):
    # one slot and a queue of one: capacity 2 choices; a 64 KiB body limit
    st = server.build(str(target), parallel=1, max_context=CONTEXT, cache_mb=0, max_queue=1,
                      model_id="tiny", max_body_mb=MAX_BODY / 2 ** 20)
    srv = LiveServer(st, TIMEOUT)
    yield srv
    srv.close()


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _ok(live, **kw):
    r = live.post({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# -- case 2: every choice reports; a failed request answers once; ranges that cannot overflow --

@pytest.mark.parametrize("kw", [dict(repetition_penalty=1e-300), dict(repetition_penalty=1e-3),
                                dict(repetition_penalty=1e3), dict(presence_penalty=1e300),
                                dict(frequency_penalty=-1e300), dict(presence_penalty=2.5),
                                dict(top_k=2 ** 40)])
def test_python_api_refuses_values_that_could_overflow(target, kw):
    m = sapwood.load(target, max_context=CONTEXT)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        m.generate("hello", max_tokens=4, temperature=0.8, seed=1, **kw)
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw).validate()


def test_python_api_range_ends_give_finite_picks(target):
    m = sapwood.load(target, max_context=CONTEXT)
    for kw in (dict(repetition_penalty=0.01), dict(repetition_penalty=100.0),
               dict(presence_penalty=-2.0, frequency_penalty=2.0),
               dict(presence_penalty=2.0, frequency_penalty=-2.0), dict(top_k=2 ** 31 - 1)):
        for t in (0.0, 0.8):
            r = m.generate("hello hello", max_tokens=6, temperature=t, seed=3, verify="off", **kw)
            assert len(r.tokens) == 6


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-300),
                                         ("repetition_penalty", 101),
                                         ("presence_penalty", 1e300), ("top_k", 2 ** 40)])
def test_server_refuses_values_that_could_overflow(live, field, value):
    # n=2: before, repetition_penalty=1e-300 passed, every choice raised on +inf logits and
    # the request never got an answer
    err = _error(live.post({"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2,
                            "temperature": 0.8, field: value}), 400)
    assert err["param"] == field and err["code"] == "invalid_value"
    _ok(live)


class FakePanic(BaseException):
    """What pyo3's PanicException is: no Exception."""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raised", [RuntimeError, FakePanic])
def test_choices_that_all_fail_answer_once_with_the_error(live, monkeypatch, stream, raised):
    """n=2 on one slot: choice 0 runs and fails, choice 1 waits in the queue and is cancelled.
    Before, the second error was never counted (and a cancelled queued choice never reported),
    so the request waited forever; a panic ended the slot's thread."""
    slot = live.st.scheduler.slots[0]

    def fail(job):
        raise raised(f"boom in choice {job.index}")

    monkeypatch.setattr(slot, "run", fail)
    r = live.post({"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2, "stream": stream})
    if stream:
        assert r.status_code == 200
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in e]
        assert len(errors) == 1 and events[-1] == "[DONE]", events
        err = errors[0]
    else:
        err = _error(r, 500)
    assert err["type"] == "server_error" and "boom in choice 0" in err["message"], err
    monkeypatch.undo()
    # choice 1 may have reached the slot before the failure cancelled it: it stops at its next
    # round, so the slot is idle again shortly (a request sent meanwhile gets 503, try again)
    deadline = time.monotonic() + TIMEOUT
    while live.http.get("/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.01)
    _ok(live, n=2)  # the slot survived, and so did its thread
    assert live.http.get("/health").json()["busy"] == 0


def test_failures_after_admission_are_500_and_the_server_serves_on(live, monkeypatch):
    slot = live.st.scheduler.slots[0]

    def fail(job):
        raise ValueError("logits contain +inf")  # the engine's, not the client's fault

    monkeypatch.setattr(slot, "run", fail)
    err = _error(live.post({"model": "tiny", "prompt": "hi", "max_tokens": 4}), 500)
    assert err["type"] == "server_error" and "+inf" in err["message"]
    monkeypatch.undo()
    _ok(live)


class _FakeSlot:
    """A slot that only records what it was given (the scheduler's bookkeeping alone)."""

    def __init__(self, index):
        self.index, self.started, self.job = index, [], None

    def start(self, job):
        self.started.append(job)

    def stop(self):
        pass


def _fake_scheduler(max_queue=4):
    return Scheduler(lambda i, done: _FakeSlot(i), 1, SnapshotCache(0), max_queue)


def _jobs(n, events):
    return [Job(i, [1, 2], 4, SamplingParams(), "off", None, None, [], None,
                lambda kind, payload: events.append((kind, payload))) for i in range(n)]


def test_a_cancelled_queued_choice_reports_once():
    events = []
    s = _fake_scheduler()
    slot = s.slots[0]
    jobs = _jobs(4, events)
    s.submit(jobs)
    assert slot.started == [jobs[0]]
    jobs[1].cancelled.set()  # cancelled by its flag alone (as a client going away did before)
    s.cancel([jobs[2]])      # and by the scheduler: it leaves the queue and reports at once
    assert events == [("cancelled", 2)]
    s._done(slot, None)      # the slot frees: job 1 is dropped (and reports), job 3 starts
    assert events == [("cancelled", 2), ("cancelled", 1)] and slot.started[-1] is jobs[3]
    s.cancel(jobs)           # running or reported already: nothing more to report
    assert len(events) == 2


def test_close_reports_the_queued_choices():
    events = []
    s = _fake_scheduler()
    jobs = _jobs(3, events)
    s.submit(jobs)
    s.close()
    assert sorted(events) == [("cancelled", 1), ("cancelled", 2)]


def test_a_listener_that_raises_does_not_stop_the_scheduler():
    def emit(kind, payload):
        raise RuntimeError("the event loop is closed")

    s = _fake_scheduler()
    jobs = [Job(i, [1], 4, SamplingParams(), "off", None, None, [], None, emit) for i in range(3)]
    s.submit(jobs)
    s.cancel(jobs[1:])       # reports, which raise: swallowed
    assert s.queue_depth == 0


# -- case 3: body size, tokenizing off the event loop, length checked as early as known -----

def _raw(live, head: bytes, chunks=(), timeout=TIMEOUT):
    """Send a request's head and body chunks over a raw socket; (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=timeout) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            assert got, data
            data += got
        head_part, rest = data.split(b"\r\n\r\n", 1)
        lines = head_part.decode().split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, v in (ln.split(":", 1) for ln in lines[1:])
                      if k.strip().lower() == "content-length")
        while len(rest) < length:
            got = s.recv(65536)
            assert got
            rest += got
    return status, json.loads(rest[:length])


def _head(extra: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"{extra}\r\n").encode()


def test_a_body_past_the_limit_gets_413_from_its_content_length(live):
    # nothing of the body is sent: before, the server waited to read all 10^9 bytes of it
    status, body = _raw(live, _head("content-length: 1000000000\r\n"))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(MAX_BODY) in body["error"]["message"]


def test_a_chunked_body_past_the_limit_gets_413_while_it_is_read(live):
    doc = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}).encode()
    chunks = [doc[i:i + 8192] for i in range(0, MAX_BODY + 1, 8192)]  # just past the limit
    status, body = _raw(live, _head("transfer-encoding: chunked\r\n"),
                        [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks])
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # a body just within the limit is read and served
    pad = MAX_BODY - len(json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2})) - 1
    r = live.post(json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}) + " " * pad,
                  raw=True)
    assert r.status_code == 200, r.text


class _SpyTokenizer:
    """The tokenizer, recording for each encode whether it ran on a thread with a running event
    loop, optionally slowed down."""

    def __init__(self, tok, delay=0.0):
        self._tok, self.delay, self.calls = tok, delay, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _record(self):
        try:
            asyncio.get_running_loop()
            self.calls.append("event loop")
        except RuntimeError:
            self.calls.append("worker")
        time.sleep(self.delay)

    def encode(self, *a, **kw):
        self._record()
        return self._tok.encode(*a, **kw)

    def encode_batch(self, *a, **kw):
        self._record()
        return self._tok.encode_batch(*a, **kw)


def test_prompts_are_tokenized_off_the_event_loop(live, monkeypatch):
    """A slow tokenization (2 s here; 53 s for 38 MB before) must not stall other clients."""
    spy = _SpyTokenizer(live.st.model.tokenizer, delay=2.0)
    monkeypatch.setattr(live.st.model, "tokenizer", spy)
    slow = threading.Thread(target=live.post, args=({"model": "tiny", "prompt": "slow",
                                                     "max_tokens": 2},))
    slow.start()
    deadline = time.monotonic() + 5
    while not spy.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.perf_counter()
    assert live.http.get("/health").status_code == 200
    waited = time.perf_counter() - t0
    slow.join()
    assert spy.calls and "event loop" not in spy.calls, spy.calls
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenization"


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(live, monkeypatch):
    k = live.st.chars_per_token
    assert k == chars_per_token_bound(make_tokenizer(256)) and k > 0
    spy = _SpyTokenizer(live.st.model.tokenizer)
    monkeypatch.setattr(live.st.model, "tokenizer", spy)
    n = (CONTEXT - 1) * k + 1
    for path, body, param in (
            ("/v1/completions", {"prompt": "x" * n}, "prompt"),
            ("/v1/completions", {"prompt": ["short", "y" * n]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * n}]},
             "messages")):
        err = _error(live.post({"model": "tiny", "max_tokens": 1, **body}, path=path), 400)
        assert err["param"] == param and err["code"] == "context_length_exceeded"
        assert "characters" in err["message"] and str(CONTEXT) in err["message"], err
    # max_tokens that no prompt leaves room for: refused before anything is tokenized too
    err = _error(live.post({"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT}), 400)
    assert err["param"] == "max_tokens"
    assert spy.calls == []
    _ok(live)  # a prompt that fits is tokenized as before
    assert spy.calls == ["worker"]


def test_chars_per_token_bound_holds(target):
    """A text of L characters encodes to at least L / bound tokens (random texts from the
    characters byte-level BPE merges most, and from across Unicode)."""
    tok = make_tokenizer(256)
    k = chars_per_token_bound(tok)
    rng = np.random.default_rng(5)
    alphabet = list("the quick brown fox  \n\t0123456789") + ["é", "字", "😀", "\u0301"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet, int(rng.integers(1, 400))))
        assert len(tok.encode(text, add_special_tokens=False).ids) * k >= len(text)
    text = "<|im_start|>" * 50  # special tokens cover their whole content
    assert len(tok.encode(text, add_special_tokens=False).ids) * k >= len(text)


def test_chars_per_token_bound_is_none_where_text_can_vanish():
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    def wordpiece():
        t = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return t

    assert chars_per_token_bound(wordpiece()) is None
    t = make_tokenizer(256)
    t.normalizer = normalizers.StripAccents()
    assert chars_per_token_bound(t) is None
    t = make_tokenizer(256)
    t.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert chars_per_token_bound(t) is None
    t = make_tokenizer(256)
    t.normalizer = normalizers.NFC()
    assert chars_per_token_bound(t) == 4 * chars_per_token_bound(make_tokenizer(256))
    # NFC composes a character from its canonical decomposition: at most 4 characters
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)
                  if not 0xD800 <= c < 0xE000)
    assert longest <= _NORMALIZER_SHRINK["NFC"]


# -- case 9: deep JSON, lone surrogates, requests that can never fit: 400 saying why -------

@pytest.mark.parametrize("depth", [40, 30_000])  # 30,000: past the json module's recursion
def test_deeply_nested_json_is_a_400(live, depth):
    body = '{"model": "tiny", "prompt": ' + "[" * depth + "]" * depth + "}"
    err = _error(live.post(body, raw=True), 400)
    assert err["code"] == "invalid_json" and "deep" in err["message"], err
    _ok(live)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "ab\\ud800c"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ok", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udc00"}]}',
     "messages.0.content"),
])
def test_a_lone_surrogate_is_a_400(live, path, body, param):
    err = _error(live.post(body, path=path, raw=True), 400)
    assert err["param"] == param and "surrogate" in err["message"], err
    # a surrogate pair is one valid character
    r = live.post('{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}', raw=True)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [{"prompt": "hi", "n": 3}, {"prompt": ["a", "b"], "n": 2}])
def test_a_request_that_can_never_fit_the_queue_is_a_400(live, body):
    # one slot and a queue of one: 3 choices can never be held at once; before, 503 "try again"
    err = _error(live.post({"model": "tiny", "max_tokens": 2, **body}), 400)
    assert err["code"] == "too_many_choices" and err["param"] == "n"
    assert "--queue" in err["message"] and "2" in err["message"], err
    with pytest.raises(TooManyChoices):
        live.st.scheduler.submit(_jobs(3, []))


def test_serve_max_body_mb_from_the_command_line(monkeypatch, target):
    from sapwood.cli import main

    built = []
    monkeypatch.setattr(server, "run", lambda st, **kw: built.append(st))
    assert main(["serve", str(target), "--max-body-mb", "0.5", "--port", "1",
                 "--max-context", str(CONTEXT)]) == 0
    assert built[0].max_body_bytes == 2 ** 19
    built[0].close()
    with pytest.raises(ValueError, match="max_body_mb"):
        server.build(str(target), max_body_mb=0)
