"""Qwen3.5's thinking as the OpenAI API's `reasoning_content` (vLLM's `qwen3` reasoning parser).

Qwen3.5's chat template ends the generation prompt with `<think>\\n` (thinking on) or with an
empty `<think>\\n\\n</think>\\n\\n` (enable_thinking false). So the output starts inside the
thinking when the prompt left a `<think>` open, and the text before `</think>` is reasoning,
the text after it (less the newlines the template puts there) the answer. An output that never
closes its thinking (max_tokens ran out) is all reasoning, as vLLM reports it. A model may also
open `<think>` itself at the start of its output.

Splitter works on text as it streams: a tag split across two deltas is held back until it is
known not to be one, so a streamed answer's pieces join to the non-streamed one.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "none")


def template_thinks(template: str | None) -> bool:
    """Does a chat template write thinking blocks (Qwen3 / Qwen3.5 style)?"""
    return bool(template) and THINK_CLOSE in template


def prompt_opens_thinking(prompt: str) -> bool:
    """Does the rendered prompt end inside a `<think>` block (its last one not closed)?"""
    i = prompt.rfind(THINK_OPEN)
    return i >= 0 and prompt.find(THINK_CLOSE, i) < 0 and prompt[i + len(THINK_OPEN):].strip() == ""


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could start `tag` (kept back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class Splitter:
    """Text in (push), (reasoning, content) pieces out; finish() flushes what was held."""

    def __init__(self, thinking: bool):
        self.state = "think" if thinking else "start"  # start: may still open <think>
        self.buf = ""
        self.reasoning, self.content = "", ""  # everything released so far
        self.thought = thinking  # was there a thinking block (reasoning_content is not null)?

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        r, c = "", ""
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buf, self.state = stripped[len(THINK_OPEN):], "think"
                    self.thought = True
                    continue
                if THINK_OPEN.startswith(stripped) and stripped:
                    break  # could still be <think>: wait
                if not stripped and self.buf:
                    break  # only whitespace so far
                self.state = "content"
                continue
            if self.state == "think":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    r += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "after"
                    continue
                keep = _held(self.buf, THINK_CLOSE)
                r += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.state == "after":  # the template's newlines after </think> are no answer
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.state = "content"
                continue
            c += self.buf
            self.buf = ""
            break
        return self._out(r, c)

    def finish(self) -> tuple[str, str]:
        r, c = "", ""
        if self.state == "think":
            r = self.buf
        elif self.state in ("start", "content"):
            c = self.buf
        self.buf = ""
        return self._out(r, c)

    def _out(self, r: str, c: str) -> tuple[str, str]:
        self.reasoning += r
        self.content += c
        return r, c


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output: the streamed pieces joined."""
    s = Splitter(thinking)
    s.push(text)
    s.finish()
    return (s.reasoning if s.thought else None), s.content
