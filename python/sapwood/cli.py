"""Command line: `sapwood generate PROMPT`, `sapwood serve [MODEL]` (docs/server.md) and
`sapwood bench ...` (see bench/).

Any failure is reported on one line of standard error with exit code 1 (2: the command line
itself is wrong, as argparse reports it); `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="checkpoint directory, a Hugging Face repo id from the local cache "
                        "(e.g. Qwen/Qwen3.5-9B), or 'default' for the bundled pair (default)")
    p.add_argument("--revision", default=None, help="hub id: branch, tag or commit (default: main)")
    p.add_argument("--download", action="store_true",
                   help="hub id: download it when it is not in the local cache")
    p.add_argument("--weights", default="q8", choices=["f32", "bf16", "q8", "q4"])
    p.add_argument("--kv", default="int8", choices=["int8", "f32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--backend", default="auto",
                   help="auto (Metal on Apple silicon, else cpu), cpu, metal, metal-emulated, sycl, sycl-emulated")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text ('-' reads standard input)")
    _add_model_args(p)
    p.add_argument("--drafter", default=None,
                   help="'mtp' (the checkpoint's own MTP head), 'lookup', 'default', a draft "
                        "checkpoint directory; default: the model's attached draft, else the "
                        "MTP head when the checkpoint has one, else lookup")
    p.add_argument("--verify", default="auto", choices=["off", "chain", "tree", "auto"])
    p.add_argument("--width", type=int, default=None, help="tree width (tree) or largest width (auto)")
    p.add_argument("--rows", type=int, default=8, help="draft rows per cycle")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-policy-cache", action="store_true",
                   help="do not load or save the speculation policy's calibration "
                        "(also SAPWOOD_POLICY_CACHE=0)")


def cmd_generate(a) -> int:
    import sapwood

    prompt = _read_stdin() if a.prompt == "-" else a.prompt
    model = sapwood.load(a.model, weights=a.weights, kv=a.kv, threads=a.threads, backend=a.backend,
                         max_context=a.max_context, policy_cache=not a.no_policy_cache)
    kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
              min_p=a.min_p, seed=a.seed, drafter=a.drafter, verify=a.verify, width=a.width,
              rows=a.rows, stop=a.stop)
    if a.json:
        r = model.generate(prompt, **kw)
        print(json.dumps({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                          "stats": r.stats.as_dict()}))
        return 0
    out = sys.stdout
    out.write(prompt)
    out.flush()
    from .textstream import IncrementalText

    # holds back a partial UTF-8 sequence
    shown = IncrementalText(model.tokenizer, path=model.tokenizer_file)
    gen = model.generate(prompt, stream=True, **kw)
    try:
        while True:
            tok = next(gen)
            if model.tokenizer is not None:
                out.write(shown.push(tok))
                out.flush()
    except StopIteration as fin:
        r = fin.value
    out.write(r.text[len(shown.text):] if r.text.startswith(shown.text) else "")
    s = r.stats
    print(f"\n\n[{r.finish_reason}] {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s "
          f"(decode {s.decode_tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1e3:.0f} ms, "
          f"draft prefill {s.draft_prefill_s * 1e3:.0f} ms), "
          f"{s.tokens_per_cycle:.2f} tokens/cycle, {s.cycles} cycles ({s.wide_cycles} wide)",
          file=sys.stderr)
    return 0


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input is not UTF-8 text (byte {e.start}: "
                         f"{data[e.start:e.start + 1]!r})") from None


def _error_line(e: BaseException) -> str:
    if isinstance(e, BrokenPipeError):
        return "standard output was closed before the output was written (broken pipe)"
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (ValueError, MemoryError)):
        return text
    return f"{type(e).__name__}: {text}"


def cmd_inspect(a) -> int:
    """What a checkpoint is and what loading it will take, from config.json alone."""
    from .hub import resolve_checkpoint
    from .loading import read_config
    from .memory import GB, WEIGHT_MODES, available_bytes, estimate_config

    d = resolve_checkpoint(a.path, revision=a.revision, download=a.download)
    cfg = read_config(d)
    ests = {m: estimate_config(cfg, weights=m, kv=a.kv, max_context=a.max_context) for m in WEIGHT_MODES}
    free = available_bytes()
    if a.json:
        print(json.dumps({"path": str(d), "config": vars(cfg),
                          "available_bytes": free,
                          "estimates": {m: {**e.parts, "total": e.total} for m, e in ests.items()}},
                         default=list))
        return 0
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    print(f"{d}\n  {cfg.num_layers} layers ({cfg.num_layers - n_attn} GDN + {n_attn} attention), "
          f"hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
          f"{'tied' if cfg.tie_word_embeddings else 'untied'} head, MTP layers {cfg.mtp_layers}")
    print(ests[a.weights].describe())
    print("all modes: " + ", ".join(f"{m} {e.total / GB:.1f} GB" for m, e in ests.items())
          + f"; available: {free / GB:.1f} GB")
    return 0


def cmd_serve(a) -> int:
    from . import server  # without the server extra: an ImportError saying how to install it

    st = server.build(a.model, drafter=a.drafter, parallel=a.parallel, max_context=a.max_context,
                      cache_mb=a.cache_mb, max_queue=a.queue, weights=a.weights, kv=a.kv,
                      backend=a.backend, threads=a.threads, model_id=a.model_id,
                      batch_verify=a.batch_verify, max_body_mb=a.max_body_mb,
                      api_key=a.api_key, cors_origins=a.cors_origin or ())
    if a.host not in ("127.0.0.1", "localhost", "::1") and not st.api_key:
        print(f"sapwood serve: listening on {a.host}, not only this machine: the API has no "
              "authentication (--api-key or SAPWOOD_API_KEY sets a key)", file=sys.stderr)
    server.run(st, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="default",
                   help="checkpoint directory, a Hugging Face repo id from the local cache, or "
                        "'default' for the bundled pair (default)")
    p.add_argument("--revision", default=None, help="hub id: branch, tag or commit (default: main)")
    p.add_argument("--download", action="store_true",
                   help="hub id: download it when it is not in the local cache")
    p.add_argument("--drafter", default=None,
                   help="'mtp' (the checkpoint's own MTP head), 'lookup', 'default', a draft "
                        "checkpoint directory; default: the model's attached draft, else the "
                        "MTP head when the checkpoint has one, else lookup")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", type=int, default=1,
                   help="slots: requests decoded at once (one copy of the weights, a sequence "
                        "state per slot; see docs/server.md)")
    p.add_argument("--batch-verify", action="store_true",
                   help="verify the decoding slots' trees in one forward (each weight read once "
                        "for all of them; outputs unchanged; not faster on the CPU hosts measured "
                        "so far, see docs/server.md)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--cache-mb", type=float, default=256,
                   help="byte budget of the turn-end snapshots that let a chat's next turn skip "
                        "its prefill (0: off)")
    p.add_argument("--queue", type=int, default=64,
                   help="choices that may wait for a slot; past that requests get 503 (a "
                        "request with more choices than the queue and the slots hold: 400)")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="the largest request body accepted, in MiB; a larger one gets 413 "
                        "(default: 16)")
    p.add_argument("--backend", default="cpu", help="engine backend (passed to sapwood.load)")
    p.add_argument("--weights", default="q8", choices=["f32", "bf16", "q8", "q4"])
    p.add_argument("--kv", default="int8", choices=["int8", "f32"])
    p.add_argument("--threads", type=int, default=None,
                   help="engine threads per slot (default: the cores shared out between slots)")
    p.add_argument("--model-id", default=None,
                   help="the model name clients send (default: 'default' or the directory name)")
    p.add_argument("--api-key", default=None,
                   help="requests must send 'Authorization: Bearer KEY', else 401; /health stays "
                        "open (default: $SAPWOOD_API_KEY, else no key)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browser pages of ORIGIN (scheme://host[:port], or '*') call the "
                        "API; repeat for more (default: none, CORS off)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])


def _bench(name, a) -> int:
    import importlib

    if name == "peers" and a.weights == "q8":
        a.weights = ["q8", "f32"]
    elif name == "peers":
        a.weights = [a.weights]
    return importlib.import_module(f"sapwood.benchmarks.{name}").main(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sapwood", description="speculative decoding for hybrid LLMs")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    _add_generate_args(g)
    g.set_defaults(fn=cmd_generate)
    ins = sub.add_parser("inspect", help="a checkpoint's shape and the memory loading it takes "
                                         "(per part, every weights mode), without loading it")
    ins.add_argument("path", help="checkpoint directory or Hugging Face repo id")
    ins.add_argument("--weights", default="q8", choices=["f32", "bf16", "q8", "q4"])
    ins.add_argument("--kv", default="int8", choices=["int8", "f32"])
    ins.add_argument("--max-context", type=int, default=4096)
    ins.add_argument("--revision", default=None)
    ins.add_argument("--download", action="store_true")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=cmd_inspect)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs sapwood[server])")
    _add_serve_args(sv)
    sv.set_defaults(fn=cmd_serve)
    b = sub.add_parser("bench", help="benchmarks: ab, width, peers").add_subparsers(dest="bench", required=True)
    ab = b.add_parser("ab", help="two arms side by side (ABBA/BAAB) on the frozen cohort")
    _add_model_args(ab)
    ab.add_argument("--a", default="verify=chain", help="arm A: key=value,... generate() options")
    ab.add_argument("--b", default="verify=auto", help="arm B")
    ab.add_argument("--cohort", default=None, help="prompt cohort JSON (default: the frozen one)")
    ab.add_argument("--prompts", type=int, default=0, help="use only the first N prompts")
    ab.add_argument("--max-tokens", type=int, default=64)
    ab.add_argument("--blocks", type=int, default=2)
    ab.add_argument("--warmup", type=int, default=1)
    ab.add_argument("--out", default="ab.json")
    ab.add_argument("--processes", type=int, default=1,
                    help="run the A/B in this many fresh processes and report their spread")
    ab.set_defaults(fn=lambda a: _bench("ab", a))
    wd = b.add_parser("width", help="tokens/s per tree width per context depth, and the width rule")
    _add_model_args(wd)
    wd.add_argument("--depths", nargs="+", type=int, default=[0, 2048, 8192, 32768])
    wd.add_argument("--max-width", type=int, default=16)
    wd.add_argument("--max-tokens", type=int, default=128)
    wd.add_argument("--reps", type=int, default=3, help="passes over all widths (ABBA order)")
    wd.add_argument("--drafter", default=None)
    wd.add_argument("--temperature", type=float, default=0.0)
    wd.add_argument("--out", default="width.json")
    wd.set_defaults(fn=lambda a: _bench("width", a))
    pe = b.add_parser("peers", help="plain decode and prefill against transformers and llama.cpp")
    _add_model_args(pe)
    pe.add_argument("--gguf", nargs="+", default=None,
                    help="GGUF conversions of the same checkpoint (scripts/convert_gguf.py)")
    pe.add_argument("--prompt-tokens", type=int, default=256)
    pe.add_argument("--new-tokens", type=int, default=64)
    pe.add_argument("--reps", type=int, default=3)
    pe.add_argument("--out", default="peers.json")
    pe.set_defaults(fn=lambda a: _bench("peers", a))
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)  # a usage error exits here with code 2
    a.argv = [x for x in argv if x != "--debug"]  # bench ab --processes reruns its command line
    try:
        if getattr(a, "model", "default") != "default":  # a hub id becomes its cached directory
            from .hub import resolve_checkpoint
            a.model = str(resolve_checkpoint(a.model, revision=getattr(a, "revision", None),
                                             download=getattr(a, "download", False)))
        return a.fn(a)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if a.debug:
            raise
        if isinstance(e, BrokenPipeError):
            # nothing more may reach the closed pipe, not even Python's flush at exit
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        try:
            print(f"sapwood: error: {_error_line(e)}", file=sys.stderr)
        except (OSError, ValueError):  # stderr closed too
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
