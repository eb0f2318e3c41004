"""`sapwood generate --chat`: an interactive multi-turn chat on one Session.

Each turn renders the whole conversation with the checkpoint's chat template (ChatML, with a
warning, for a checkpoint without one: chat_template.template_for); the session
keeps the sequence between turns, so a turn whose rendering extends the tokens the engine holds
prefills only the new ones (the template may render an earlier reply differently, e.g. without
its thinking: then the turn prefills the conversation again). Commands: /reset forgets the
conversation, /exit (or end of input) ends it. Ctrl-C stops the reply being written and keeps
what was written; at the prompt it ends the chat.
"""
from __future__ import annotations

import sys


def chat(model, options: dict, system: str | None = None, inp=None, out=None, err=None) -> int:
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    start = [{"role": "system", "content": system}] if system else []
    messages, session = list(start), model.session()
    prompt = "> " if inp.isatty() else ""
    while True:
        err.write(prompt)
        err.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            return 130
        if not line:  # end of input
            return 0
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        stream = model.generate(messages, stream=True, session=session, **options)
        reply, finish = [], "interrupted"
        try:
            for chunk in stream:
                reply.append(chunk.text)
                out.write(chunk.text)
                out.flush()
            finish = stream.result.finish_reason
        except KeyboardInterrupt:
            stream.close()
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        s = stream.stats
        err.write(f"[{finish}] {s.tokens} tokens, {s.decode_tokens_per_s:.1f} tok/s; prompt "
                  f"{s.prompt_tokens} tokens, {s.prompt_tokens - session.continued} prefilled "
                  f"in {s.prefill_s * 1e3:.0f} ms\n")
