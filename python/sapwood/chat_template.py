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
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.exceptions
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
