"""One chat-template rule for the Python API and the server (chat_template.template_for): the
checkpoint's template, else ChatML with one warning. Before, the API refused chat messages for a
checkpoint without a template while the server silently wrote them as ChatML."""
import warnings

import pytest
from util import LiveServer, require_packages, tiny_server_target

import sapwood
from sapwood.chat_template import CHATML, template_for

MSGS = [{"role": "user", "content": "hi"}]
CHATML_TEXT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def caught(fn):
    """fn()'s result and the UserWarnings it raised, every one counted (no dedup by location)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in got if issubclass(w.category, UserWarning)]


def test_the_rule_prefers_the_checkpoint_and_warns_once_per_checkpoint(tmp_path):
    assert caught(lambda: template_for("{{ x }}", tmp_path / "a")) == ("{{ x }}", [])
    src, said = caught(lambda: template_for(None, tmp_path / "b"))
    assert src == CHATML and len(said) == 1
    assert str(tmp_path / "b") in said[0] and "no chat template" in said[0] and "ChatML" in said[0]
    assert caught(lambda: template_for("", tmp_path / "b")) == (CHATML, [])  # once, not again
    assert len(caught(lambda: template_for(None, tmp_path / "c"))[1]) == 1  # another checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_server_target(tmp_path_factory.mktemp("rule"))  # no chat template


def test_python_api_writes_chatml_for_a_checkpoint_without_a_template(target):
    m = sapwood.load(target, max_context=256)
    assert m.chat_template is None
    text, said = caught(lambda: m.apply_chat_template(MSGS))
    assert text == CHATML_TEXT and len(said) == 1 and str(target) in said[0]
    a = m.generate(MSGS, max_tokens=4, verify="off")
    assert a.tokens == m.generate(m.encode(CHATML_TEXT), max_tokens=4, verify="off").tokens


def test_server_follows_the_same_rule_and_says_so_at_start(tmp_path):
    require_packages()
    from sapwood import server

    target = tiny_server_target(tmp_path)  # one not warned about yet in this process
    st, said = caught(lambda: server.build(str(target), parallel=2, max_context=256, cache_mb=0,
                                           model_id="tiny"))
    srv = LiveServer(st, 30)
    try:
        assert [s.model.chat_template for s in st.scheduler.slots] == [CHATML, CHATML]
        assert len(said) == 1 and "no chat template" in said[0] and str(target) in said[0]
        r = srv.post({"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0},
                     path="/v1/chat/completions")
        assert r.status_code == 200, r.text
        api = sapwood.load(target, max_context=256)
        want = api.generate(MSGS, max_tokens=4, verify="off")
        assert r.json()["usage"]["prompt_tokens"] == len(api.encode(CHATML_TEXT))
        assert r.json()["choices"][0]["message"]["content"] == want.text
    finally:
        srv.close()


def test_server_chat_template_option_replaces_the_checkpoints(target, tmp_path, monkeypatch):
    require_packages()
    from sapwood import server
    from sapwood.cli import main

    built = []
    monkeypatch.setattr(server, "run", lambda st, **kw: built.append(st))
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert main(["serve", str(target), "--port", "1", "--max-context", "256",
                 "--chat-template", str(tpl)]) == 0
    assert built[0].model.apply_chat_template(MSGS) == "[hi]"
    built[0].close()


@pytest.mark.parametrize("spec, shows", [("missing.jinja", "'missing.jinja'"),
                                         ("bad", "syntax error")])
def test_server_chat_template_option_errors_name_the_value(target, tmp_path, capsys, spec,
                                                           shows, monkeypatch):
    require_packages()
    from sapwood.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad").write_text("{% for m in messages %}")
    assert main(["serve", str(target), "--port", "1", "--chat-template", spec]) == 1
    assert shows in capsys.readouterr().err


def test_templates_see_the_tokenizers_special_tokens(tmp_path):
    """As transformers does, a template gets tokenizer_config.json's bos_token / eos_token
    (a string or an {"content": ...} entry) as variables; a template keyword overrides them."""
    import json

    from sapwood.testing import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path / "m", seed=3)
    tc = tmp_path / "m" / "tokenizer_config.json"
    cfg = json.loads(tc.read_text()) if tc.is_file() else {}
    cfg.update(bos_token="<|endoftext|>", eos_token={"content": "<|im_end|>", "lstrip": False},
               chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}"
                             "{% endfor %}")
    tc.write_text(json.dumps(cfg))
    m = sapwood.load(tmp_path / "m", quiet=True)
    assert m.special_tokens["bos_token"] == "<|endoftext|>" and m.special_tokens["eos_token"] == "<|im_end|>"
    assert m.apply_chat_template(MSGS) == "<|endoftext|>hi<|im_end|>"
    assert m.apply_chat_template(MSGS, bos_token="") == "hi<|im_end|>"
