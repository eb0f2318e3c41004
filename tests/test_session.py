"""The one front door: a Session runs generate's requests, a chat's turns and a server slot's
jobs. Text streams in pieces that add up to the result; a session that keeps its sequence
between requests prefills only what a new prompt adds, with the very tokens a fresh request
gets (==), and never continues a sequence another request has overwritten."""
import io
import re

import pytest

import sapwood
from sapwood.chat import chat
from sapwood.testing import make_tiny_checkpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    make_tiny_checkpoint(root / "target", seed=11, layers=4)
    make_tiny_checkpoint(root / "draft", seed=12, layers=2, hidden=32)
    return root


@pytest.fixture(scope="module")
def model(root):
    m = sapwood.load(root / "target", max_context=512)
    m.generation_config["eos_token_id"] = []  # random models hit eos early
    return m


PROMPT = "Once upon a time, "


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_stream_pieces_add_up_to_the_result(model, temperature):
    want = model.generate(PROMPT, max_tokens=40, temperature=temperature, seed=3)
    s = model.generate(PROMPT, max_tokens=40, temperature=temperature, seed=3, stream=True)
    chunks = list(s)
    assert s.result.tokens == want.tokens and s.result.text == want.text
    assert [t for c in chunks for t in c.tokens] == want.tokens
    assert "".join(c.text for c in chunks) == want.text
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    # the text up to each chunk is the decode of its tokens: no piece ends inside a character
    # that a later token completes (tests/test_hardening_model.py: IncrementalText itself)
    n = 0
    for c in chunks[:-1]:
        n += len(c.tokens)
        assert want.text.startswith(model.decode(want.tokens[:n]))
    for c in chunks:  # each token's text ends where its chunk's text says
        assert len(c.ends) == len(c.tokens)
    assert chunks[-1].ends[-1] == len(want.text) if chunks[-1].tokens else True


def test_stream_text_helper_and_stats(model):
    s = model.generate(PROMPT, max_tokens=12, stream=True)
    text = "".join(s.text())
    assert text == s.result.text and s.stats.tokens == 12 == len(s.result.tokens)


DRAFTERS = [("off", None, None), ("chain", None, "lookup"), ("tree", 6, "lookup"),
            ("chain", None, "draft"), ("tree", 8, "draft"), ("auto", None, "draft")]


@pytest.mark.parametrize("verify,width,drafter", DRAFTERS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_session_continues_with_the_tokens_of_a_fresh_request(root, model, verify, width,
                                                                  drafter, temperature):
    d = str(root / "draft") if drafter == "draft" else drafter
    opts = dict(max_tokens=24, verify=verify, width=width, drafter=d, temperature=temperature,
                seed=5)
    first = model.encode(PROMPT)
    s = model.session()
    r1 = model.generate(first, session=s, **opts)
    assert s.continued == 0
    second = first + r1.tokens + model.encode(" and then")
    r2 = model.generate(second, session=s, **opts)
    # the engine held the prompt and every reply token but the last pick
    assert s.continued == len(first) + len(r1.tokens) - 1
    assert r2.tokens == model.generate(second, **opts).tokens
    third = second + r2.tokens[:3]  # a prompt that does not extend the held sequence
    r3 = model.generate(third, session=s, **opts)
    assert s.continued == 0 and r3.tokens == model.generate(third, **opts).tokens


def test_a_session_never_continues_over_another_request(root, model):
    opts = dict(max_tokens=16, verify="chain", drafter=str(root / "draft"))
    first = model.encode(PROMPT)
    s = model.session()
    r1 = model.generate(first, session=s, **opts)
    # another request on the same engines (and the same cached draft model) in between
    model.generate(first[:4] + [7] * (len(first) + len(r1.tokens) - 5), **opts)
    second = first + r1.tokens + [9, 10]
    r2 = model.generate(second, session=s, **opts)
    assert s.continued == 0
    assert r2.tokens == model.generate(second, **opts).tokens


def test_session_arguments(root, model):
    other = sapwood.load(root / "draft", max_context=64)
    with pytest.raises(ValueError, match="Session of this model"):
        model.generate([1, 2], session=other.session())
    with pytest.raises(ValueError, match="without cache_prompt"):
        model.generate([1, 2], session=model.session(), cache_prompt=True)


def test_chat_keeps_the_sequence_between_turns(model):
    model.chat_template = CHATML
    try:
        inp = io.StringIO("Hello there\n\n/reset\nHello there\nAnd again?\n/exit\nignored\n")
        out, err = io.StringIO(), io.StringIO()
        opts = dict(max_tokens=10, verify="chain", drafter="lookup")
        assert chat(model, opts, system="Be brief.", inp=inp, out=out, err=err) == 0
        turns = [line for line in err.getvalue().splitlines() if line.startswith("[")]
        assert len(turns) == 3, err.getvalue()
        # each reply is what a fresh request on the rendered conversation writes
        sys_msg = {"role": "system", "content": "Be brief."}
        msgs = [sys_msg, {"role": "user", "content": "Hello there"}]
        r1 = model.generate(msgs, **opts)
        msgs2 = msgs + [{"role": "assistant", "content": r1.text},
                        {"role": "user", "content": "And again?"}]
        r2 = model.generate(msgs2, **opts)
        assert out.getvalue() == f"{r1.text}\n{r1.text}\n{r2.text}\n"
        # a turn prefills what the held sequence (the last prompt, the reply but its last
        # pick) does not already start
        prefilled = [int(re.search(r"(\d+) prefilled", t).group(1)) for t in turns]
        ids1 = model.encode(model.apply_chat_template(msgs))
        ids2 = model.encode(model.apply_chat_template(msgs2))
        held = ids1 + r1.tokens[:-1]
        assert prefilled[:2] == [len(ids1)] * 2, prefilled
        assert prefilled[2] == (len(ids2) - len(held) if ids2[:len(held)] == held else len(ids2))
    finally:
        model.chat_template = None


def test_chat_without_a_template_writes_chatml(model):
    """The one chat-template rule (chat_template.template_for): ChatML, with a warning."""
    out = io.StringIO()
    opts = dict(max_tokens=6, verify="off")
    with pytest.warns(UserWarning, match="no chat template"):
        chat(model, opts, inp=io.StringIO("hi\n"), out=out, err=io.StringIO())
    want = model.generate([{"role": "user", "content": "hi"}], **opts).text
    assert out.getvalue() == want + "\n"
