"""`sapwood serve` against the official openai client: a live server on 127.0.0.1 (a free
port, uvicorn in a thread) over tiny checkpoints. Every response is compared with
`Model.generate(..., verify="off")` on a separate engine, tokens and text with ==, logprobs
with == against the log-softmax of the logits plain decoding computes."""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from util import require_packages

require_packages("openai")

import httpx  # noqa: E402
import openai  # noqa: E402

import sapwood  # noqa: E402
from sapwood import server  # noqa: E402
from sapwood.reference.ranking import logsumexp  # noqa: E402
from sapwood.server.text import token_bytes_table  # noqa: E402
from sapwood.testing import make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTEXT = 1024


def _checkpoints(root):
    make_tiny_checkpoint(root / "target", seed=1, layers=4)
    make_tiny_checkpoint(root / "draft", seed=2, layers=2, hidden=32)
    for d in ("target", "draft"):  # random models hit eos at once; no eos, max_tokens ends
        (root / d / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    tc = json.loads((root / "target" / "tokenizer_config.json").read_text())
    (root / "target" / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": CHATML}))


class Live:
    """A server on a free loopback port (server.start: uvicorn in a thread) and its clients."""

    def __init__(self, st):
        self.st = st
        self.running = server.start(st)
        self.url = self.running.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def post(self, path, body, raw=False):
        content = body if raw else json.dumps(body)
        return self.http.post(path, content=content, headers={"content-type": "application/json"})

    def health(self):
        return self.http.get("/health").json()

    def close(self):
        self.http.close()
        self.running.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    _checkpoints(root)
    return root


@pytest.fixture(scope="module")
def live(root):
    # the target drafts for itself: long accepted paths and wide trees, so tokens and logprobs
    # come from deep rows of verified trees, not from root rows alone
    # batch_verify: the slots' verify rounds share forwards; every output must still be its
    # solo run's
    st = server.build(str(root / "target"), drafter=str(root / "target"), parallel=4,
                      max_context=CONTEXT, cache_mb=64, model_id="tiny", batch_verify=True)
    srv = Live(st)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ref(root):
    return sapwood.load(root / "target", max_context=CONTEXT)


def prompt_ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def ext(resp):
    return resp.model_extra["sapwood"]


def solo(ref, prompt, **kw):
    return ref.generate(prompt, verify="off", **kw)


def plain_rows(ref, prompt, tokens):
    """The logits each token was picked from, by plain decoding (prefill, then one verify and
    commit per token): the oracle of the logprobs."""
    eng = ref.engine
    eng.reset()
    rows = [eng.prefill(prompt)]
    for t in tokens[:-1]:
        rows.append(eng.verify([t], [-1])[0])
        eng.commit([0])
    return rows


def test_models_health_and_metrics(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert live.health()["slots"] == 4
    text = live.http.get("/metrics").text
    assert "sapwood_slots 4.0" in text and "sapwood_queue_depth" in text


SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=3),
            dict(temperature=1.1, seed=11, top_k=40, min_p=0.02),
            dict(temperature=0.7, seed=5, presence_penalty=0.5, frequency_penalty=0.3)]


def _body_kw(s):
    """The request's fields: top_k and min_p travel as extra fields of the openai client."""
    kw = {k: v for k, v in s.items() if k not in ("top_k", "min_p")}
    extra = {k: s[k] for k in ("top_k", "min_p") if k in s}
    return kw, extra


@pytest.mark.parametrize("verify", ["chain", "tree", "auto"])
@pytest.mark.parametrize("si", range(len(SAMPLING)))
def test_completion_equals_plain_decoding(live, ref, verify, si):
    s = SAMPLING[si]
    p = prompt_ids(7 + si, seed=si)
    want = solo(ref, p, max_tokens=24, **s)
    kw, extra = _body_kw(s)
    body = {"sapwood": {"verify": verify, "return_token_ids": True, "width": 8}, **extra}
    r = live.client.completions.create(model="tiny", prompt=p, max_tokens=24, extra_body=body, **kw)
    assert ext(r)["choices"][0]["token_ids"] == want.tokens
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(p)
    chunks = list(live.client.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                 stream=True, extra_body=body, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_speculation_went_deep(live, ref):
    # the exactness tests above mean something only if rounds kept several draft tokens
    r = live.client.completions.create(model="tiny", prompt=prompt_ids(9, 1), max_tokens=40,
                                       temperature=0, extra_body={"sapwood": {"verify": "tree",
                                                                              "width": 8}})
    stats = ext(r)["choices"][0]["stats"]
    assert stats["tokens_per_cycle"] > 3 and stats["wide_cycles"] > 0


def _check_logprobs(ref, prompt, tokens, token_lps, tops, k):
    """token_lps (and tops: per token [(id, logprob)], or None) against the oracle's rows."""
    rows = plain_rows(ref, prompt, tokens)
    assert len(token_lps) == len(tokens)
    for i, (row, tok, lp) in enumerate(zip(rows, tokens, token_lps)):
        x = np.asarray(row, np.float64)
        z = logsumexp(x)
        assert lp == float(x[tok] - z)
        if tops is not None:
            best = np.argsort(-x, kind="stable")[:k]
            assert tops[i] == [(int(j), float(x[j] - z)) for j in best]
        # and the definition itself: log-softmax (float64 from float32 logits; 1e-9 allows
        # the summation order of another implementation)
        assert abs(lp - (x[tok] - np.log(np.exp(x - x.max()).sum()) - x.max())) < 1e-9


@pytest.mark.parametrize("verify", ["chain", "tree", "auto"])
def test_logprobs_are_the_targets_log_softmax(live, ref, verify):
    p = prompt_ids(11, seed=4)
    body = {"sapwood": {"verify": verify, "return_token_ids": True}}
    for temperature in (0.0, 0.9):
        r = live.client.completions.create(model="tiny", prompt=p, max_tokens=20, logprobs=3,
                                           temperature=temperature, seed=2, extra_body=body)
        toks = ext(r)["choices"][0]["token_ids"]
        assert toks == solo(ref, p, max_tokens=20, temperature=temperature, seed=2).tokens
        lp = r.choices[0].logprobs
        _check_logprobs(ref, p, toks, lp.token_logprobs, None, 3)
        assert all(s == ref.decode([t]) or ("\ufffd" in ref.decode([t]) and s.startswith("bytes:"))
                   for s, t in zip(lp.tokens, toks))
        # top_logprobs is keyed by token text (ids that decode alike share a key): its values
        # are among the top 3 of the oracle's row
        for row, d in zip(plain_rows(ref, p, toks), lp.top_logprobs):
            x = np.asarray(row, np.float64)
            best = set(float(v) for v in np.sort(x)[::-1][:3] - logsumexp(x))
            assert set(d.values()) <= best and max(d.values()) == max(best)
    # chat: the same numbers in chat form; each top entry's bytes name its id
    msgs = [{"role": "user", "content": "hello there"}]
    r = live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            extra_body=body)
    toks = ext(r)["choices"][0]["token_ids"]
    assert toks == solo(ref, msgs, max_tokens=16).tokens
    content = r.choices[0].logprobs.content
    tb = token_bytes_table(ref.tokenizer)
    by_bytes = {bytes(tb(i)): i for i in range(ref.config.vocab_size)}
    assert [by_bytes[bytes(c.bytes)] for c in content] == toks
    tops = [[(by_bytes[bytes(t.bytes)], t.logprob) for t in c.top_logprobs] for c in content]
    chat_prompt = ref.encode(ref.apply_chat_template(msgs))
    _check_logprobs(ref, chat_prompt, toks, [c.logprob for c in content], tops, 2)


def test_chat_streaming_and_not(live, ref):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    want = solo(ref, msgs, max_tokens=20, temperature=0.8, seed=9)
    r = live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                            temperature=0.8, seed=9)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    chunks = list(live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                                      temperature=0.8, seed=9, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_stream_opens_each_choice_with_its_role_alone(live, ref):
    """OpenAI's chat streams (and vLLM's, llama.cpp's) open each choice with a delta holding
    the role alone; the text follows in later chunks, none of which repeats the role
    (llama.cpp's test_logprobs_stream checks this with the openai client)."""
    msgs = [{"role": "user", "content": "def f(x):"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0.8, "seed": 5,
            "n": 2, "stream": True}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            deltas[c["index"]].append((c["delta"], c["finish_reason"]))
    for j in range(2):
        assert deltas[j][0] == ({"role": "assistant"}, None)
        assert [d for d, _ in deltas[j][1:] if "role" in d] == []
        want = solo(ref, msgs, max_tokens=6, temperature=0.8, seed=5 + j).text
        assert "".join(d.get("content", "") for d, _ in deltas[j]) == want
        assert deltas[j][-1][1] == "length"
    chunks = list(live.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                                      stream=True, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content is None
    assert [c for c in chunks[1:] if c.choices[0].delta.role is not None] == []


def test_n_choices_reproducible_for_a_seed(live, ref):
    p = "def main():"
    kw = dict(model="tiny", prompt=p, max_tokens=16, temperature=1.0, n=2, seed=41)
    a = live.client.completions.create(**kw)
    b = live.client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    # choice j samples with seed + j: it is the single-choice request with that seed
    for j in range(2):
        assert texts[j] == solo(ref, p, max_tokens=16, temperature=1.0, seed=41 + j).text
    assert [c["seed"] for c in ext(a)["choices"]] == [41, 42]


def test_stop_strings(live, ref):
    p = prompt_ids(6, seed=8)
    full = solo(ref, p, max_tokens=30).text
    assert len(full) > 12
    stop = full[8:11]
    want = solo(ref, p, max_tokens=30, stop=[stop, "\x00never"])
    assert want.finish_reason == "stop" and stop not in want.text
    body = {"sapwood": {"return_token_ids": True}}
    r = live.client.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0,
                                       stop=[stop, "\x00never"], extra_body=body)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert ext(r)["choices"][0]["token_ids"] == want.tokens
    assert r.usage.completion_tokens == len(want.tokens)
    chunks = list(live.client.completions.create(model="tiny", prompt=p, max_tokens=30,
                                                 temperature=0, stop=stop, stream=True))
    shown = ""
    for c in chunks:
        shown += c.choices[0].text
        assert stop not in shown and want.text.startswith(shown)
    assert shown == want.text
    # a stop string whose start ends the output: held back while it may complete, then shown
    tail = full[-2:] + "\x01"
    chunks = list(live.client.completions.create(model="tiny", prompt=p, max_tokens=30,
                                                 temperature=0, stop=tail, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full


def test_concurrent_clients_each_get_their_solo_output(live, ref):
    jobs = []
    for i in range(100):
        s = SAMPLING[i % len(SAMPLING)]
        verify = ("chain", "tree", "auto", "off")[i % 4]
        jobs.append((prompt_ids(3 + i % 13, seed=100 + i), 6 + i % 7, s, verify, i % 3 == 0))
    want = [solo(ref, p, max_tokens=n, **s).tokens for p, n, s, _, _ in jobs]

    def one(job):
        p, n, s, verify, stream = job
        kw, extra = _body_kw(s)
        body = {"sapwood": {"verify": verify, "return_token_ids": True}, **extra}
        if stream:
            chunks = list(live.client.completions.create(
                model="tiny", prompt=p, max_tokens=n, stream=True, extra_body=body,
                stream_options={"include_usage": True}, **kw))
            return chunks[-1].model_extra["sapwood"]["choices"][0]["token_ids"]
        r = live.client.completions.create(model="tiny", prompt=p, max_tokens=n, extra_body=body,
                                           **kw)
        return ext(r)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, jobs))
    assert len(got) == 100
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} differs from its solo run"


def _metric(live, name):
    for line in live.http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _wait_idle(live):
    deadline = time.monotonic() + 60  # a liveness bound, not a speed claim
    while live.health()["busy"]:
        assert time.monotonic() < deadline, "a slot never came free"
        time.sleep(0.02)


def test_disconnects_free_the_slot(root, ref):
    long_context = 4096  # room for requests that outlast the client's patience
    st = server.build(str(root / "target"), parallel=1, max_context=long_context, cache_mb=0,
                      max_queue=1, model_id="tiny")
    live = Live(st)
    try:
        long = dict(model="tiny", prompt="abc", max_tokens=long_context - 8, temperature=0,
                    extra_body={"sapwood": {"verify": "off"}})
        stream = live.client.completions.create(stream=True, **long)
        it = iter(stream)
        next(it), next(it)
        assert live.health()["busy"] == 1
        # the slot is taken: one more waits in the queue (it holds 1), the next gets 503
        waiting = live.client.completions.create(stream=True, **long)
        with pytest.raises(openai.APIStatusError) as e:
            live.client.completions.create(**long)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        waiting.close()
        stream.close()
        _wait_idle(live)
        assert _metric(live, "sapwood_choices_cancelled_total") >= 1
        assert _metric(live, "sapwood_generation_tokens_total") < long_context - 8
        # a client that gives up on a non-streamed request
        body = {k: v for k, v in long.items() if k != "extra_body"}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.05)
        _wait_idle(live)
        cancelled = _metric(live, "sapwood_choices_cancelled_total")
        assert _metric(live, "sapwood_generation_tokens_total") < 3 * (long_context - 8)
        r = live.client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
        assert r.choices[0].text == solo(ref, "abc", max_tokens=5).text
        assert cancelled >= 2
    finally:
        live.close()


def test_second_turn_resumes_from_the_first(live, ref):
    p1 = prompt_ids(40, seed=21)
    body = {"sapwood": {"verify": "auto", "return_token_ids": True}}
    r1 = live.client.completions.create(model="tiny", prompt=p1, max_tokens=12, temperature=0,
                                        extra_body=body)
    t1 = ext(r1)["choices"][0]["token_ids"]
    p2 = p1 + t1 + prompt_ids(9, seed=22)
    r2 = live.client.completions.create(model="tiny", prompt=p2, max_tokens=12, temperature=0,
                                        extra_body=body)
    c = ext(r2)["choices"][0]
    # the first turn committed its prompt and all its tokens but the last pick
    assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(t1) - 1
    assert c["cached_tokens"] == len(p1) + len(t1) - 1
    assert c["prefilled_tokens"] == len(p2) - c["cached_tokens"]
    assert c["token_ids"] == solo(ref, p2, max_tokens=12).tokens
    fresh = solo(ref, p2, max_tokens=12)
    print(f"second turn: {c['stats']['prefill_s'] * 1e3:.2f} ms to first token resumed "
          f"({c['prefilled_tokens']} tokens prefilled), {fresh.stats.prefill_s * 1e3:.2f} ms "
          f"with a prefill of all {len(p2)} (measured, not asserted)")


def test_chat_second_turn_resumes_from_the_longest_snapshot(live, ref):
    body = {"sapwood": {"return_token_ids": True}}
    m1 = [{"role": "user", "content": "write a loop"}]
    r1 = live.client.chat.completions.create(model="tiny", messages=m1, max_tokens=10,
                                             temperature=0, extra_body=body)
    t1 = ext(r1)["choices"][0]["token_ids"]
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "and another"}]
    r2 = live.client.chat.completions.create(model="tiny", messages=m2, max_tokens=10,
                                             temperature=0, extra_body=body)
    assert ext(r2)["choices"][0]["token_ids"] == solo(ref, m2, max_tokens=10).tokens
    p1 = ref.encode(ref.apply_chat_template(m1))
    p2 = ref.encode(ref.apply_chat_template(m2))
    assert p2[:len(p1)] == p1  # this conversation's first prompt begins the second
    # the snapshots the first turn left: its prompt's end and its turn's end; the reply's text
    # may tokenize otherwise in the second prompt, then only the prompt's end matches
    ends = [n for n, toks in ((len(p1), p1), (len(p1) + len(t1) - 1, p1 + t1[:-1]))
            if p2[:n] == toks]
    assert r2.usage.prompt_tokens_details.cached_tokens == max(ends)


LONG = list(range(3, 250)) * 5  # 1235 tokens: past the context of 1024

BAD = [  # (endpoint, body or raw text, status, param, text the message must show)
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", "[1, 2]", 400, None, "JSON object"),
    ("completions", {"prompt": "x"}, 400, "model", "model is required"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "'gpt-4'"),
    ("completions", {"model": "tiny"}, 400, "prompt", "prompt is required"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"model": "tiny", "prompt": []}, 400, "prompt", "[]"),
    ("completions", {"model": "tiny", "prompt": {"a": 1}}, 400, "prompt", "{'a': 1}"),
    ("completions", {"model": "tiny", "prompt": [1, -4]}, 400, "prompt", "-4"),
    ("completions", {"model": "tiny", "prompt": [1, 999999]}, 400, "prompt", "999999"),
    ("completions", {"model": "tiny", "prompt": LONG}, 400, "prompt", "1235"),
    ("completions", {"model": "tiny", "prompt": [5] * 1000, "max_tokens": 100}, 400,
     "max_tokens", "1024"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature", "-1"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature",
     "'hot'"),
    ("completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature",
     "nan"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "0"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p", "1.5"),
    ("completions", {"model": "tiny", "prompt": "x", "top_k": -2}, 400, "top_k", "-2"),
    ("completions", {"model": "tiny", "prompt": "x", "top_k": 2.5}, 400, "top_k", "2.5"),
    ("completions", {"model": "tiny", "prompt": "x", "min_p": 2}, 400, "min_p", "2"),
    ("completions", {"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed", "-1"),
    ("completions", {"model": "tiny", "prompt": "x", "seed": 2 ** 64}, 400, "seed",
     str(2 ** 64)),
    ("completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n", "0"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 17}, 400, "n", "17"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "'5'"),
    ("completions", {"model": "tiny", "prompt": "x", "stop": [""]}, 400, "stop", "['']"),
    ("completions", {"model": "tiny", "prompt": "x", "stop": 5}, 400, "stop", "5"),
    ("completions", {"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400, "stop", "'a'"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs", "21"),
    ("completions", {"model": "tiny", "prompt": "x", "presence_penalty": 3}, 400,
     "presence_penalty", "3"),
    ("completions", {"model": "tiny", "prompt": "x", "frequency_penalty": -2.5}, 400,
     "frequency_penalty", "-2.5"),
    ("completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream", "'yes'"),
    ("completions", {"model": "tiny", "prompt": "x", "colour": "red"}, 400, "colour", "colour"),
    ("completions", {"model": "tiny", "prompt": "x", "echo": True}, 400, "echo", "True"),
    ("completions", {"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of", "3"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, 400,
     "logit_bias", "'5'"),
    ("completions", {"model": "tiny", "prompt": "x", "sapwood": {"verify": "fast"}}, 400,
     "sapwood.verify", "'fast'"),
    ("completions", {"model": "tiny", "prompt": "x", "sapwood": {"width": 0}}, 400,
     "sapwood.width", "0"),
    ("completions", {"model": "tiny", "prompt": "x", "sapwood": {"drafter": "/etc"}}, 400,
     "sapwood.drafter", "'/etc'"),
    ("completions", {"model": "tiny", "prompt": "x", "sapwood": {"drafter": "mtp"}}, 400,
     "sapwood.drafter", "no MTP head"),
    ("completions", {"model": "tiny", "prompt": "x", "sapwood": {"rows": 3}}, 400,
     "sapwood.rows", "rows"),
    ("completions", {"model": "tiny", "prompt": "x", "stream_options": {"usage": 1}}, 400,
     "stream_options.usage", "usage"),
    ("chat", {"model": "tiny"}, 400, "messages", "messages is required"),
    ("chat", {"model": "tiny", "messages": []}, 400, "messages", "[]"),
    ("chat", {"model": "tiny", "messages": "hi"}, 400, "messages", "'hi'"),
    ("chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role", "'robot'"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", "5"),
    ("chat", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages.0.content",
     "required"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 1100}]}, 400,
     "messages", "1024"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs", "logprobs"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
              "max_completion_tokens": 4}, 400, "max_completion_tokens", "4"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "function"}]}, 400, "tools", "function"),
    ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "json_object", "json_schema": {}}}, 400,
     "response_format", "'json_object'"),  # honoured; malformed, refused
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_requests_get_an_openai_error(live, case):
    endpoint, body, status, param, shows = BAD[case]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = live.post(path, body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and shows in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_server_survives_bad_requests_and_a_bad_stream(live, ref):
    for case in BAD:
        endpoint, body, *_ = case
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        live.post(path, body, raw=isinstance(body, str))
    # an error is an error in a stream too: the status comes before any event
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "x", "stream": True, "n": 0})
    assert r.status_code == 400
    assert live.health()["status"] == "ok"
    r = live.client.completions.create(model="tiny", prompt="ok", max_tokens=4, temperature=0)
    assert r.choices[0].text == solo(ref, "ok", max_tokens=4).text


@pytest.fixture(scope="module")
def mtp_live():
    """The bundled target, whose trained MTP head keeps some of its drafts, served as
    `sapwood serve TARGET --drafter mtp` builds it."""
    from sapwood.loading import default_target_path

    st = server.build(str(default_target_path()), drafter="mtp", parallel=2,
                      max_context=CONTEXT, cache_mb=64, model_id="bundled")
    assert [s.default_drafter for s in st.scheduler.slots] == ["mtp", "mtp"]
    srv = Live(st)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def mtp_ref():
    from sapwood.loading import default_target_path

    return sapwood.load(default_target_path(), max_context=CONTEXT)


@pytest.mark.parametrize("verify", ["chain", "tree", "auto"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mtp_drafter_equals_plain_decoding(mtp_live, mtp_ref, verify, temperature):
    """drafter "mtp", by the request's extension field and by the server's default: tokens,
    text and logprobs of plain decoding, and (chain, tree) some of the head's drafts kept."""
    p = "def merge(a, b):\n    result = []\n"
    ids = mtp_ref.encode(p)
    want = solo(mtp_ref, p, max_tokens=32, temperature=temperature, seed=7)
    accepted = 0
    for ext_field in ({"drafter": "mtp"}, {}):
        body = {"sapwood": {"verify": verify, "return_token_ids": True, **ext_field}}
        r = mtp_live.client.completions.create(model="bundled", prompt=p, max_tokens=32, logprobs=2,
                                               temperature=temperature, seed=7, extra_body=body)
        choice = ext(r)["choices"][0]
        assert choice["token_ids"] == want.tokens and r.choices[0].text == want.text
        _check_logprobs(mtp_ref, ids, want.tokens, r.choices[0].logprobs.token_logprobs, None, 2)
        accepted += choice["stats"]["draft_rows_accepted"]
    if verify != "auto":  # auto may judge every round better plain
        assert accepted > 0
    # the head drafted (its speculation policy state exists), not another drafter
    assert any(("mtp", id(s.model)) in s.model._policies for s in mtp_live.st.scheduler.slots)


def test_serve_drafter_mtp_from_the_command_line(monkeypatch, root):
    """`sapwood serve DIR --drafter mtp` builds slots that draft with the head; a checkpoint
    without one fails at start with the reason, not at the first request."""
    from sapwood.cli import main
    from sapwood.loading import default_target_path

    built = []
    monkeypatch.setattr(server, "run", lambda st, **kw: built.append(st))
    assert main(["serve", str(default_target_path()), "--drafter", "mtp", "--port", "1"]) == 0
    assert built and built[0].scheduler.slots[0].default_drafter == "mtp"
    built[0].scheduler.close()
    with pytest.raises(ValueError, match="drafter='mtp': this checkpoint has no MTP head"):
        server.build(str(root / "target"), drafter="mtp")


def test_cli_serve_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    import sys

    from sapwood.cli import main

    for name in [m for m in sys.modules if m == "sapwood.server" or m.startswith("sapwood.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(sapwood, "server")  # else `from . import server` finds the attribute
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert 'pip install "sapwood[server]"' in err and "fastapi" in err
