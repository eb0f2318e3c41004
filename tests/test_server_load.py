"""A bounded loopback load test of `sapwood serve` (issue 50, "beyond the cases"): valid and
hostile clients at once against a real server process.

`python -m sapwood serve --parallel 2 --port 0` over a tiny checkpoint, on 127.0.0.1. First each
valid request is made alone (its answer and its time); then for DURATION seconds valid clients
(streamed and not, greedy and seeded sampled, n=2, logprobs, chat and completions) repeat theirs
while hostile clients run beside them: bodies past --max-body-mb (declared, uploaded, chunked:
413), JSON nested 50,000 deep and a lone surrogate (400), more choices than the queue and the
slots hold (400), floods of invalid requests (each its 4xx), clients that go away mid-stream
or mid-request, and slowloris clients that trickle a request's head and body over seconds (and
some that never finish one). Asserted:

- every valid answer is the one its request got alone: token ids, text, finish reasons and
  logprobs (the slowloris requests' too, once they complete);
- every valid request finishes within LATENCY_FACTOR times its solo time plus LATENCY_SLACK: a
  bound against stalls (one client freezing the others, as a 38 MB body did for 53 s), not a
  benchmark;
- every hostile request gets its status and error code;
- afterwards the server is healthy: /health answers with no slot busy and nothing queued (the
  abandoned streams were cancelled), no 5xx was counted, nothing was logged as an error, and a
  valid request still gets its solo answer.

Slow tier (`-m slow`): about 30 s (25 s of load).
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from util import require_packages

require_packages()

import httpx  # noqa: E402

import sapwood  # noqa: E402
from sapwood.testing import make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

DURATION = 25.0          # seconds of mixed load
PARALLEL, QUEUE = 2, 32  # capacity 34 choices: the valid clients never see a full queue
CONTEXT = 512
MAX_BODY = 256 * 1024    # --max-body-mb 0.25
LATENCY_FACTOR, LATENCY_SLACK = 20.0, 3.0
TIMEOUT = 60             # any one request or socket read: a hang fails instead of hanging


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server process; its URL, port and log."""
    root = tmp_path_factory.mktemp("load")
    make_tiny_checkpoint(root / "target", seed=3, layers=4)
    # random models hit eos at once; no eos, max_tokens ends
    (root / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(sapwood.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["XDG_CACHE_HOME"] = str(root / "cache")  # the policy cache: never the user's
    env.pop("SAPWOOD_POLICY_CACHE", None)
    out, err = root / "stdout", root / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sapwood", "serve", str(root / "target"), "--port", "0",
             "--parallel", str(PARALLEL), "--queue", str(QUEUE), "--max-context", str(CONTEXT),
             "--max-body-mb", str(MAX_BODY / 2 ** 20), "--cache-mb", "32", "--model-id", "tiny"],
            stdout=fo, stderr=fe, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", out.read_text())
            if m:
                break
            assert proc.poll() is None, f"the server exited: {err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the server did not start within 120 s"
            time.sleep(0.05)
        port = int(m.group(1))
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "stderr": err}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


# -- valid requests ------------------------------------------------------------------------

def _ids(body):
    return {**body, "model": "tiny", "sapwood": {"return_token_ids": True}}


VALID = {
    "greedy": ("/v1/completions", _ids({"prompt": "the quick brown fox", "max_tokens": 64,
                                        "temperature": 0})),
    "sampled n=2": ("/v1/completions", _ids({"prompt": [7, 19, 33, 101, 5], "max_tokens": 48,
                                             "n": 2, "temperature": 0.9, "top_p": 0.95,
                                             "seed": 1234})),
    "stream logprobs": ("/v1/completions", _ids({
        "prompt": "streams and logprobs", "max_tokens": 48, "stream": True, "logprobs": 3,
        "stream_options": {"include_usage": True}, "temperature": 1.1, "seed": 77,
        "top_k": 50})),
    "chat stream": ("/v1/chat/completions", _ids({
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "tell me about trees"}],
        "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0})),
    "chat sampled": ("/v1/chat/completions", _ids({
        "messages": [{"role": "user", "content": "sapwood?"}], "max_tokens": 40,
        "temperature": 0.7, "seed": 9, "logprobs": True, "top_logprobs": 2,
        "stop": ["zz"]})),
}
# what a slowloris client trickles in (valid: its answer is compared as the others')
SLOW = ("/v1/completions", _ids({"prompt": "slow", "max_tokens": 4, "temperature": 0}))


def _merge_lp(chunks, chat):
    if not chunks:
        return None
    if chat:
        return {"content": [c for p in chunks for c in p["content"]], "refusal": None}
    return {f: [x for p in chunks for x in p[f]]
            for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def answer_of(path, body, status, raw: bytes):
    """A 200's content as comparable data: per choice (text, finish, token ids, logprobs)."""
    assert status == 200, raw[:500]
    chat = path.endswith("chat/completions")
    text = raw.decode("utf-8")
    if body.get("stream"):
        events = [e[len("data: "):] for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]", events[-3:]
        choices, ids = {}, {}
        for e in events[:-1]:
            doc = json.loads(e)
            assert "error" not in doc, doc
            if not doc["choices"]:
                ids = {c["index"]: c["token_ids"] for c in doc["sapwood"]["choices"]}
                continue
            [c] = doc["choices"]
            s = choices.setdefault(c["index"], ["", None, []])
            s[0] += (c["delta"].get("content") if chat else c["text"]) or ""
            s[1] = c["finish_reason"]
            if c["logprobs"] is not None:
                s[2].append(c["logprobs"])
        return [(s[0], s[1], ids[i], _merge_lp(s[2], chat)) for i, s in sorted(choices.items())]
    doc = json.loads(text)
    ids = {c["index"]: c["token_ids"] for c in doc["sapwood"]["choices"]}
    return [(c["message"]["content"] if chat else c["text"], c["finish_reason"], ids[c["index"]],
             c["logprobs"]) for c in doc["choices"]]


def request(http, path, body):
    """(answer, seconds) of a valid request."""
    t0 = time.perf_counter()
    if body.get("stream"):
        with http.stream("POST", path, json=body) as r:
            raw = r.read()
    else:
        r = http.post(path, json=body)
        raw = r.content
    return answer_of(path, body, r.status_code, raw), time.perf_counter() - t0


# -- raw sockets -----------------------------------------------------------------------------

def read_response(s) -> tuple:
    """(status, body) of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        if not got:
            raise ConnectionError(f"closed before a response: {data[:200]!r}")
        data += got
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(v) for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)
                  if k.strip().lower() == "content-length")
    while len(rest) < length:
        got = s.recv(65536)
        if not got:
            raise ConnectionError("closed inside a response")
        rest += got
    return status, rest[:length]


def head(path, extra=""):
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{extra}\r\n").encode()


def raw_exchange(port, data: bytes, chunks=()):
    """Send `data` then `chunks` (stopping quietly if the server answers and closes first);
    (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        try:
            s.sendall(data)
            for c in chunks:
                s.sendall(c)
        except OSError:
            pass
        return read_response(s)


# -- the clients -----------------------------------------------------------------------------

class Run:
    """What the clients share: the deadline, their problems, counts and latencies."""

    def __init__(self, served, solo):
        self.served, self.solo = served, solo
        self.port = served["port"]
        self.deadline = time.monotonic() + DURATION
        self.lock = threading.Lock()
        self.problems: list = []
        self.counts = Counter()
        self.latency: dict = {name: [] for name in VALID}

    def live(self) -> bool:
        return time.monotonic() < self.deadline

    def problem(self, what):
        with self.lock:
            self.problems.append(what)

    def count(self, what):
        with self.lock:
            self.counts[what] += 1

    def guarded(self, name, fn):
        """fn() in a loop until the deadline; any exception is a problem of client `name`."""
        def loop():
            try:
                while self.live():
                    fn()
            except Exception as e:  # noqa: BLE001 - reported with the client's name
                self.problem(f"{name}: {type(e).__name__}: {e}")
        return threading.Thread(target=loop, name=name, daemon=True)


def valid_client(run, name):
    path, body = VALID[name]
    want = run.solo[name][0]
    http = httpx.Client(base_url=run.served["url"], timeout=TIMEOUT)

    def once():
        got, seconds = request(http, path, body)
        with run.lock:
            run.latency[name].append(seconds)
        if got != want:
            run.problem(f"{name}: the answer under load differs from the one alone")
        run.count(name)
    return run.guarded(name, once)


def expect(run, what, status, body, want_status, want_code=None, contains=None):
    if status != want_status:
        run.problem(f"{what}: status {status}, want {want_status}: {body[:300]!r}")
        return
    err = json.loads(body)["error"]
    if set(err) != {"message", "type", "param", "code"} or \
            (want_code is not None and err["code"] != want_code) or \
            (contains is not None and contains not in err["message"]):
        run.problem(f"{what}: {err}")
    run.count(what)


def oversized_client(run):
    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY + 100)}).encode()
    path = "/v1/completions"
    kinds = ["declared", "uploaded", "chunked"]
    i = [0]

    def once():
        kind = kinds[i[0] % 3]
        i[0] += 1
        if kind == "declared":  # a Content-Length past the limit, nothing sent
            status, body = raw_exchange(run.port, head(path, "content-length: 1000000000\r\n"))
        elif kind == "uploaded":  # the whole body sent: refused before it is read
            status, body = raw_exchange(run.port, head(path, f"content-length: {len(big)}\r\n"),
                                        [big])
        else:  # chunked: refused once the chunks pass the limit
            chunks = [big[j:j + 16384] for j in range(0, len(big), 16384)]
            status, body = raw_exchange(run.port, head(path, "transfer-encoding: chunked\r\n"),
                                        [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
                                        + [b"0\r\n\r\n"])
        expect(run, f"413 {kind}", status, body, 413, "request_too_large")
    return run.guarded("oversized", once)


def malformed_client(run):
    """Deep JSON, lone surrogates, a prompt of 256 KB, more choices than the server holds:
    400 saying why."""
    deep = ('{"model": "tiny", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}").encode()
    cases = [
        ("deep json", "/v1/completions", deep, "invalid_json", "deep"),
        ("deep json 40", "/v1/chat/completions",
         ('{"model": "tiny", "messages": ' + "[" * 40 + "]" * 40 + "}").encode(),
         "invalid_json", "deep"),
        ("surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "ab\\ud800c"}',
         "invalid_value", "surrogate"),
        ("surrogate chat", "/v1/chat/completions",
         b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
         "invalid_value", "surrogate"),
        ("near the limit", "/v1/completions",  # parsed, refused by its length untokenized
         json.dumps({"model": "tiny", "prompt": "y" * (MAX_BODY - 100)}).encode(),
         "context_length_exceeded", "characters"),
        ("too many choices", "/v1/completions",
         json.dumps({"model": "tiny", "prompt": ["p"] * 16, "n": 16}).encode(),
         "too_many_choices", "--queue"),
    ]
    http = httpx.Client(base_url=run.served["url"], timeout=TIMEOUT)
    i = [0]

    def once():
        what, path, raw, code, contains = cases[i[0] % len(cases)]
        i[0] += 1
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        expect(run, what, r.status_code, r.content, 400, code, contains)
    return run.guarded("malformed", once)


FLOOD = [
    (b"{not json", 400, "invalid_json"),
    (b"[]", 400, "invalid_json"),
    (b'{"model": "other", "prompt": "x"}', 404, "model_not_found"),
    (b'{"model": "tiny", "prompt": "x", "frobnicate": 1}', 400, "unknown_field"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "invalid_value"),
    (b'{"model": "tiny", "prompt": [99999]}', 400, None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400, "context_length_exceeded"),
]


def flood_client(run, k):
    """Invalid requests back to back on a kept-alive connection, as fast as they are answered."""
    http = httpx.Client(base_url=run.served["url"], timeout=TIMEOUT)
    i = [k]

    def once():
        raw, status, code = FLOOD[i[0] % len(FLOOD)]
        i[0] += 1
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        expect(run, "flood", r.status_code, r.content, status, code)
    return run.guarded(f"flood {k}", once)


def quitter_client(run):
    """Clients that go away: a stream after two events, a non-streamed request after 0.2 s, a
    request whose body stops halfway. Their choices must be cancelled and their slots freed."""
    http = httpx.Client(base_url=run.served["url"], timeout=TIMEOUT)
    long = {"model": "tiny", "prompt": "a long answer", "max_tokens": 400, "temperature": 0.8,
            "seed": 5}
    i = [0]

    def once():
        kind = i[0] % 3
        i[0] += 1
        if kind == 0:
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                if r.status_code != 200:
                    run.problem(f"quitter stream: status {r.status_code}")
                    return
                lines = r.iter_lines()
                for _ in range(2):
                    next(lines)
            run.count("left mid-stream")  # leaving the block closed the connection
        elif kind == 1:
            raw = json.dumps(long).encode()
            with socket.create_connection(("127.0.0.1", run.port), timeout=TIMEOUT) as s:
                s.sendall(head("/v1/completions", f"content-length: {len(raw)}\r\n") + raw)
                time.sleep(0.2)
            run.count("left a request")
        else:
            with socket.create_connection(("127.0.0.1", run.port), timeout=TIMEOUT) as s:
                s.sendall(head("/v1/completions", "content-length: 500\r\n") + b'{"model": ')
                time.sleep(0.1)
            run.count("left mid-body")
    return run.guarded("quitter", once)


def slowloris_client(run, n=6, idle=3, step=3, tick=0.2):
    """n connections that trickle a valid request, `step` bytes per `tick` each (the head and
    the body: about 15 s a request), answered as it is answered alone; and `idle` connections
    that send half a head and then nothing, held to the end."""
    path, body = SLOW
    raw_body = json.dumps(body).encode()
    data = head(path, f"content-length: {len(raw_body)}\r\n") + raw_body
    want = run.solo["slowloris"][0]

    def loop():
        socks = []
        try:
            for _ in range(idle):
                s = socket.create_connection(("127.0.0.1", run.port), timeout=TIMEOUT)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 12")
                socks.append(s)
            slow = [socket.create_connection(("127.0.0.1", run.port), timeout=TIMEOUT)
                    for _ in range(n)]
            socks += slow
            sent = [0] * n
            while min(sent) < len(data):
                for j, s in enumerate(slow):
                    if sent[j] < len(data):
                        s.sendall(data[sent[j]:sent[j] + step])
                        sent[j] += step
                time.sleep(tick)
            for s in slow:
                status, got = read_response(s)
                if answer_of(path, body, status, got) != want:
                    run.problem("slowloris: the answer differs from the one alone")
                run.count("slowloris served")
            while run.live():  # the idle ones stay open to the end
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001
            run.problem(f"slowloris: {type(e).__name__}: {e}")
        finally:
            for s in socks:
                s.close()
    return threading.Thread(target=loop, name="slowloris", daemon=True)


# -- the test --------------------------------------------------------------------------------

def metrics(http) -> dict:
    out = {}
    for ln in http.get("/metrics").text.splitlines():
        if ln and not ln.startswith("#"):
            k, v = ln.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_mixed_valid_and_hostile_clients(served):
    t_start = time.perf_counter()
    http = httpx.Client(base_url=served["url"], timeout=TIMEOUT)
    # alone first: each valid request's answer (the same every time) and its slowest time
    solo = {}
    for name, (path, body) in [*VALID.items(), ("slowloris", SLOW)]:
        runs = [request(http, path, body) for _ in range(3)]
        assert all(a == runs[0][0] for a, _ in runs), f"{name}: alone, answers differ"
        solo[name] = (runs[0][0], max(s for _, s in runs))
    assert all(len(a) == (2 if name == "sampled n=2" else 1) for name, (a, _) in solo.items())

    run = Run(served, solo)
    threads = [valid_client(run, name) for name in VALID]
    threads += [oversized_client(run), malformed_client(run), quitter_client(run),
                flood_client(run, 0), flood_client(run, 4), slowloris_client(run)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION + 2 * TIMEOUT)
        assert not t.is_alive(), f"client {t.name} did not finish"
    load_s = time.perf_counter() - t_start

    report = {name: (f"solo {solo[name][1] * 1000:.0f} ms", f"n {len(ls)}",
                     f"max {max(ls, default=0) * 1000:.0f} ms")
              for name, ls in run.latency.items()}
    print(f"\nload: {dict(run.counts)}\nlatency: {report}")
    assert run.problems == [], run.problems[:20]
    for name in VALID:  # every valid client was served, within its bound
        assert run.counts[name] >= 3, (name, run.counts)
        bound = LATENCY_FACTOR * solo[name][1] + LATENCY_SLACK
        slowest = max(run.latency[name])
        assert slowest <= bound, f"{name}: {slowest:.2f} s under load, bound {bound:.2f} s"
    for what in ("413 declared", "413 uploaded", "413 chunked", "deep json", "surrogate",
                 "near the limit", "too many choices", "flood", "left mid-stream", "left a request",
                 "left mid-body"):
        assert run.counts[what] >= 1, (what, run.counts)
    assert run.counts["slowloris served"] == 6, run.counts

    # healthy afterwards: the abandoned requests were cancelled, their slots freed
    deadline = time.monotonic() + 30
    while True:
        h = http.get("/health").json()
        if h["busy"] == 0 and h["queue"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert h["status"] == "ok" and h["busy"] == 0 and h["queue"] == 0, h
    for name, (path, body) in VALID.items():
        assert request(http, path, body)[0] == solo[name][0], name
    m = metrics(http)
    assert m.get("sapwood_choices_cancelled_total", 0) >= 1, m
    fives = {k: v for k, v in m.items() if k.startswith("sapwood_requests_total") and
             'status="5' in k}
    assert not fives, fives
    assert served["proc"].poll() is None
    log = served["stderr"].read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
    print(f"run time (solo, load, checks): {time.perf_counter() - t_start:.1f} s "
          f"(load phase ended at {load_s:.1f} s)")
