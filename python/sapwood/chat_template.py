"""Compiling and rendering a checkpoint's chat template.

The template ships with the checkpoint, i.e. it is code from whoever published the weights. In a
plain jinja2.Environment `{{ cycler.__init__.__globals__.os.popen(...) }}` reaches the shell, so it
runs in Jinja's immutable sandbox (as transformers renders templates): no underscore attributes,
no mutating lists/dicts passed in, plus the helpers HF templates call. Every failure is a
ValueError with the template's or the sandbox's message, so callers (the server: a 400) need
not know jinja2.
"""
from __future__ import annotations

import json
import re
import warnings
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.exceptions
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


# ChatML: what Qwen's own templates write and what every Qwen3.5 tokenizer has special tokens
# for (<|im_start|>, <|im_end|>); the format a template-less checkpoint's messages get.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_warned: set = set()  # the checkpoints already warned about: once each, not once a request


def template_for(template: str | None, where) -> str:
    """The chat template a model's messages are written with: the checkpoint's own, else ChatML
    with a warning (once per checkpoint). The one rule for Model.apply_chat_template and the
    server (docs/server.md, "Chat templates"): sapwood loads Qwen3.5 checkpoints only, whose
    format ChatML is, so a base checkpoint shipped without a template still chats in its own
    format (llama.cpp falls back to ChatML too; vLLM refuses, which guards model families a
    guessed format would be wrong for)."""
    if template:
        return template
    key = str(where)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{key}: the checkpoint has no chat template; chat messages are written "
                      "as ChatML (<|im_start|>role ... <|im_end|>, Qwen's format). Set "
                      "model.chat_template (serve: --chat-template FILE) for another format",
                      stacklevel=3)
    return CHATML


class _TemplateRaised(jinja2.TemplateError):
    """The template's own raise_exception(): kept apart from jinja2's errors so its message
    surfaces bare (it is addressed to the user: "Conversation roles must alternate...")."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, ' become \u003c...) and forces ASCII: tool
    # schemas would reach the model differently from how transformers renders them
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)  # templates stamp "Today Date: ..." with it


def _check_jinja_version():
    # jinja2 before 3.1.6 has published sandbox escapes (str.format, the |attr filter)
    got = tuple(int(p) for p in re.findall(r"\d+", getattr(jinja2, "__version__", "0"))[:3])
    if got < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2>=3.1.6 (its sandbox; {jinja2.__version__} "
                          "has known escapes): pip install -U jinja2")


@lru_cache(maxsize=None)
def _environment() -> ImmutableSandboxedEnvironment:
    _check_jinja_version()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox; ValueError naming a syntax error."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template has a syntax error (line {e.lineno}): "
                         f"{e.message or e}") from e


def render_chat_template(template: jinja2.Template, **variables) -> str:
    """template.render(**variables), its failures as ValueError."""
    try:
        return template.render(**variables)
    except _TemplateRaised as e:
        raise ValueError(str(e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise ValueError(f"the chat template tried an operation the sandbox refuses: {e}") from None
    except jinja2.TemplateError as e:  # undefined values, a syntax error of an include, ...
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
