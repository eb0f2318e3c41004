"""A checkpoint's chat template is its publisher's code: Model.apply_chat_template runs it in
Jinja's immutable sandbox (chat_template.py). Hostile templates fail with ValueError before
their side effect; the helpers HF templates call (raise_exception, tojson, strftime_now,
loop controls) work as in transformers; ordinary templates render as they did."""
import importlib.util
import json
from datetime import datetime

import jinja2
import jinja2.ext
import pytest

from sapwood.model import Model

# Qwen3's template, cut down: system/tools header, namespace, reversed scan, <think> handling,
# enable_thinking from the caller's kwargs
QWEN = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, multi_step=true) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step and message.role == "user" %}
        {%- set ns.multi_step = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"},
        {"role": "user", "content": "bye"}]


def model(template):
    # apply_chat_template needs only the template: no engine, tokenizer or config
    return Model(None, None, None, chat_template=template)


@pytest.mark.parametrize("expr", [
    "cycler.__init__.__globals__.os.popen('touch {f}').read()",
    "''.__class__.__mro__[1].__subclasses__()",
    "joiner.__init__.__globals__['__builtins__']['open']('{f}', 'w').write('x')",
    "messages.append({{'role': 'user', 'content': '{f}'}})",
])
def test_hostile_template_is_refused_before_its_side_effect(tmp_path, expr):
    marker = tmp_path / "pwned"
    msgs = [{"role": "user", "content": "hi"}]
    m = model("{{ " + expr.format(f=marker) + " }}")
    with pytest.raises(ValueError, match="sandbox refuses: access to attribute"):
        m.apply_chat_template(msgs)
    assert not marker.exists()
    assert msgs == [{"role": "user", "content": "hi"}]  # the caller's list is untouched


def test_syntax_error_is_a_value_error():
    with pytest.raises(ValueError, match=r"syntax error \(line 1\).*endfor"):
        model("{% for m in messages %}{{ m }}").apply_chat_template([{"role": "user"}])


def test_raise_exception_message_surfaces():
    with pytest.raises(ValueError, match="^Unexpected message role: tool$"):
        model(QWEN).apply_chat_template([{"role": "tool", "content": "x"}])


def test_tojson_and_strftime_now():
    tools = [{"name": "f", "description": "é <b> & 'q'", "args": {"z": 1, "a": 2}}]
    m = model("{{ tools[0] | tojson }}|{{ tools[0].args | tojson(indent=1, sort_keys=true) }}|"
              "{{ tools[0].args | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.now().strftime("%Y-%m-%d")
    out = m.apply_chat_template([], tools=tools).split("|")
    # as transformers: keys in order, no ASCII/HTML escaping (Jinja's own tojson does both)
    assert out[0] == json.dumps(tools[0], ensure_ascii=False)
    assert out[1] == '{\n "a": 2,\n "z": 1\n}'
    assert out[2] == '{"z":1,"a":2}'
    assert out[3] in (before, datetime.now().strftime("%Y-%m-%d"))  # midnight between


def test_qwen_template_renders_as_before_with_kwargs():
    m = model(QWEN)
    got = m.apply_chat_template(MSGS, enable_thinking=False)
    assert got == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the same as the unsandboxed Environment it used to run in
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                               extensions=[jinja2.ext.loopcontrols])
    for kw in ({}, {"enable_thinking": False}, {"add_generation_prompt": False}):
        args = {"add_generation_prompt": True, **kw}
        assert m.apply_chat_template(MSGS, **kw) == plain.from_string(QWEN).render(
            messages=MSGS, **args)
    assert m.apply_chat_template(MSGS, add_generation_prompt=False).endswith("bye<|im_end|>\n")


def test_matches_transformers_rendering_with_tools():
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    compile_ = getattr(cu, "_compile_jinja_template", None)
    if compile_ is None:
        pytest.skip("transformers no longer has _compile_jinja_template")
    tools = [{"type": "function", "function": {"name": "get", "description": "météo <now>",
                                               "parameters": {"type": "object"}}}]
    want = compile_(QWEN).render(messages=MSGS, tools=tools, add_generation_prompt=True)
    assert model(QWEN).apply_chat_template(MSGS, tools=tools) == want
    assert "météo <now>" in want


def test_loop_controls():
    m = model("{% for x in messages %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}")
    assert m.apply_chat_template([1, 2, 3]) == "1"


def test_compiled_once_per_template(monkeypatch):
    calls = []
    orig = jinja2.Environment.from_string  # the sandbox inherits it

    def counting(self, *a, **kw):
        calls.append(1)
        return orig(self, *a, **kw)

    monkeypatch.setattr(jinja2.Environment, "from_string", counting)
    m = model("{{ messages | length }}")
    assert [m.apply_chat_template([1] * n) for n in range(3)] == ["0", "1", "2"]
    assert len(calls) == 1
    m.chat_template = "x{{ messages | length }}"  # replaced (the server's fallback): recompiled
    assert m.apply_chat_template([1]) == "x1" and len(calls) == 2


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in ("fastapi", "httpx")),
                    reason="the server extra is not installed")
def test_server_answers_400_with_the_message(tmp_path):
    from fastapi.testclient import TestClient

    from sapwood import server
    from sapwood.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "c", seed=1, layers=2)
    st = server.build(str(tmp_path / "c"), parallel=1, max_context=256, cache_mb=0,
                      model_id="tiny")
    client = TestClient(server.create_app(st))  # no lifespan: the 400 comes before scheduling
    marker = tmp_path / "pwned"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for tpl, msg in [(f"{{{{ cycler.__init__.__globals__.os.popen('touch {marker}') }}}}",
                      "sandbox refuses"),
                     ("{{ raise_exception('no tools here') }}", "no tools here")]:
        st.model.chat_template = tpl
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert msg in r.json()["error"]["message"]
    assert not marker.exists()
