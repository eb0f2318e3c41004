"""Qwen3.5's thinking over the OpenAI API (issue 49): <think>...</think> split into
`reasoning_content` (message and streaming deltas), chat_template_kwargs reaching the template
(enable_thinking), thinking_budget forcing </think> exactly (a mask: identical in every verify
mode), and a response_format that applies to the answer after the thinking. A tiny checkpoint
whose tokenizer has Qwen3.5's markup tokens and a template of Qwen3.5's shape."""
import json

import pytest
from util import LiveServer, require_packages

require_packages("openai")

import openai  # noqa: E402

from sapwood import server  # noqa: E402
from sapwood.server.reasoning import Splitter, prompt_opens_thinking, split  # noqa: E402
from sapwood.testing import QWEN_MARKUP, make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_default_parallel_work")  # conftest.py: why
TIMEOUT = 60
# Qwen3.5's generation prompt: thinking opened, or an empty block when enable_thinking is false
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
MODES = [{"verify": "off"}, {"verify": "chain"}, {"verify": "tree", "width": 8},
         {"verify": "auto"}]
MSGS = [{"role": "user", "content": "Think, then answer"}]


def thinking_checkpoint(root):
    make_tiny_checkpoint(root, seed=5, layers=2, special_tokens=QWEN_MARKUP)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = thinking_checkpoint(tmp_path_factory.mktemp("think") / "target")
    st = server.build(str(root), parallel=1, max_context=384, cache_mb=0, model_id="tiny",
                      drafter="lookup")
    srv = LiveServer(st, TIMEOUT)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=TIMEOUT)
    srv.end_id = st.model.tokenizer.token_to_id("</think>")
    yield srv
    srv.close()


def chat(live, mode, **kw):
    extra = {"sapwood": {**mode, "return_token_ids": True}, **kw.pop("extra", {})}
    r = live.client.chat.completions.create(model="tiny", messages=MSGS, extra_body=extra,
                                            **{"max_tokens": 40, **kw})
    m = r.choices[0].message
    return (getattr(m, "reasoning_content", None), m.content,
            r.sapwood["choices"][0]["token_ids"], r.choices[0].finish_reason)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=4)])
def test_thinking_budget_forces_the_end_of_thinking_in_every_mode(live, sampling):
    outs = [chat(live, m, extra={"thinking_budget": 6}, **sampling) for m in MODES]
    assert all(o == outs[0] for o in outs), outs
    reasoning, content, ids, _ = outs[0]
    assert ids.index(live.end_id) <= 6  # at most 6 reasoning tokens, then </think>
    assert live.end_id in ids and reasoning is not None and content
    want_r, want_c = split(live.st.model.decode(ids), True)
    assert (reasoning, content) == (want_r, want_c)


def test_without_a_budget_a_random_model_thinks_to_the_end(live):
    reasoning, content, ids, finish = chat(live, MODES[2], max_tokens=12)
    if live.end_id not in ids:  # all reasoning, as vLLM reports an unclosed block
        assert finish == "length" and reasoning == live.st.model.decode(ids) and content == ""


def test_enable_thinking_false_reaches_the_template(live):
    reasoning, content, ids, _ = chat(
        live, MODES[0], extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning is None and content == live.st.model.decode(ids)
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, MODES[0], extra={"chat_template_kwargs": {"enable_thinking": False},
                                    "thinking_budget": 3})
    assert e.value.body["param"] == "thinking_budget"
    with pytest.raises(openai.BadRequestError) as e:
        chat(live, MODES[0], extra={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_a_schema_applies_to_the_answer_after_the_thinking(live):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    outs = [chat(live, m, response_format=fmt, temperature=0.8, seed=1, max_tokens=60,
                 extra={"thinking_budget": 4}) for m in MODES[:3]]
    assert all(o == outs[0] for o in outs)
    reasoning, content, ids, finish = outs[0]
    assert finish == "stop" and json.loads(content) in ({"ok": True}, {"ok": False})
    assert ids.index(live.end_id) <= 4


def test_streamed_deltas_join_to_the_message(live):
    kw = dict(temperature=0.9, seed=2, max_tokens=30)
    reasoning, content, _, _ = chat(live, MODES[2], extra={"thinking_budget": 10}, **kw)
    rs, cs = [], []
    for ch in live.client.chat.completions.create(
            model="tiny", messages=MSGS, stream=True, **kw,
            extra_body={"thinking_budget": 10, "sapwood": MODES[3]}):
        if ch.choices:
            d = ch.choices[0].delta
            rs.append(getattr(d, "reasoning_content", None) or "")
            cs.append(d.content or "")
    assert "".join(rs) == reasoning and "".join(cs) == content


@pytest.mark.parametrize("text, thinking, want", [
    ("plan</think>\n\nanswer", True, ("plan", "answer")),
    ("still thinking", True, ("still thinking", "")),
    ("<think>a</think>b", False, ("a", "b")),
    ("no tags", False, (None, "no tags")),
    ("x </thin", True, ("x </thin", "")),
])
def test_splitter_streams_as_it_splits(text, thinking, want):
    assert split(text, thinking) == want
    for step in (1, 2, 3):  # any cut of the stream joins to the same halves
        s, r, c = Splitter(thinking), "", ""
        for i in range(0, len(text), step):
            a, b = s.push(text[i:i + step])
            r, c = r + a, c + b
        a, b = s.finish()
        assert (r + a, c + b) == (want[0] or "", want[1])


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
