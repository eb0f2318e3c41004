"""Command line: `sapwood generate PROMPT`, `sapwood serve [MODEL]` (docs/server.md),
`sapwood inspect PATH` and `sapwood bench ...` (see bench/).

Any failure is reported on one line of standard error with exit code 1 (2: the command line
itself is wrong, as argparse reports it); `--debug`, before or after the command, shows the
traceback instead. Every option's help states its default. Ctrl-C ends a command with exit
code 130; `generate` first reports what it generated and its stats.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

# --threads' bound: fixed, so that a command line valid on one machine is valid on every other
# (os.cpu_count() differs between hosts and, in a container, can be far from the cores granted),
# and above any current host's hardware threads (two 192-core sockets with SMT: 768). The
# engine runs one OS thread per count: a typo such as 40000 would start 40000 threads.
MAX_THREADS = 1024


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default: argparse's '(default: X)', 'off' for a flag.
    Help that states its default itself, '(default: ...)', is kept as written (a default of
    None means something the text says better)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.option_strings and action.nargs == 0 and action.default is False:
            return text + " (default: off)"
        return super()._get_help_string(action)


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_THREADS}, "
                                         f"got {text!r}")
    return n


def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    from importlib import metadata

    try:
        return metadata.version("sapwood")
    except metadata.PackageNotFoundError:
        from . import __version__

        return __version__


WEIGHTS = ["auto", "f32", "bf16", "q8", "q4"]
KV = ["int8", "f32"]
DRAFTER_HELP = ("'mtp' (the checkpoint's own MTP head), 'lookup' (prompt lookup), 'default' (the "
                "bundled draft) or a draft checkpoint directory (default: the model's attached "
                "draft, else the MTP head when the checkpoint has one, else lookup)")


def _add_load_args(p: argparse.ArgumentParser, backend: str, threads: str) -> None:
    """How the model is loaded: the options every command that loads one takes."""
    p.add_argument("--revision", default=None, help="hub id: branch, tag or commit (default: main)")
    p.add_argument("--download", action="store_true",
                   help="hub id: download it when it is not in the local cache")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="how the weights are stored: f32, bf16, or int8 / int4 quantised; auto: "
                        "q4 for an MLX 4-bit file (run as stored), else q8")
    p.add_argument("--kv", default="int8", choices=KV, help="how the KV cache is stored")
    p.add_argument("--threads", type=_threads, default=None, metavar="N",
                   help=f"engine worker threads{threads}")
    p.add_argument("--max-context", type=int, default=4096, metavar="N",
                   help="the longest sequence (prompt and output) in tokens")
    p.add_argument("--backend", default=backend,
                   help="auto (Metal on Apple silicon, else cpu), cpu, metal, metal-emulated, "
                        "sycl, sycl-emulated")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="checkpoint directory, a Hugging Face repo id from the local cache "
                        "(e.g. Qwen/Qwen3.5-9B), or 'default' for the bundled pair")
    _add_load_args(p, "auto", f", 1 to {MAX_THREADS} (default: the engine's choice, one per "
                              "hardware thread)")


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text ('-' reads standard input); with --chat, the system "
                        "message (optional)")
    _add_model_args(p)
    p.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    p.add_argument("--verify", default="auto", choices=["off", "chain", "tree", "auto"],
                   help="off: plain decoding; chain: the draft's rows; tree: a tree of --width "
                        "nodes; auto: the speculation policy picks each round (the output is "
                        "the same whichever)")
    p.add_argument("--width", type=int, default=None, metavar="W",
                   help="tree nodes per round: the width (tree) or the largest width (auto) "
                        "(default: 16)")
    p.add_argument("--rows", type=int, default=8, help="draft rows per round (chain, auto: the most)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="the most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K likeliest tokens; 0 is off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the likeliest tokens holding probability P; 1 is off")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the likeliest; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the positive scores (multiply the negative ones) of tokens "
                        "already in the prompt or output by R; 1 is off")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X from the score of each token already in the prompt or "
                        "output; 0 is off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X times its count from the score of each token in the prompt "
                        "or output; 0 is off")
    p.add_argument("--seed", type=int, default=0, help="the sampling noise's seed")
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop before this text (repeatable) (default: none; the model's end "
                        "tokens stop it too)")
    p.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="constrain the output to this JSON schema (a file, or the schema's "
                        "JSON text); identical in every verify mode")
    p.add_argument("--regex", default=None, metavar="RE",
                   help="constrain the output to match this regular expression")
    p.add_argument("--grammar", default=None, metavar="FILE|TEXT",
                   help="constrain the output to this grammar (Lark, or llama.cpp's GBNF)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, finish_reason, stats) instead of "
                        "streaming the text")
    p.add_argument("--chat", action="store_true",
                   help="an interactive chat: each line read is a user message, the reply is "
                        "streamed; the sequence is kept between turns (/reset, /exit)")
    p.add_argument("--no-policy-cache", action="store_true",
                   help="do not load or save the speculation policy's calibration "
                        "(also SAPWOOD_POLICY_CACHE=0)")


def _generate_options(a) -> tuple[dict, dict]:
    """generate()'s sampling and decoding options from the command line."""
    return (dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                 seed=a.seed, repetition_penalty=a.repetition_penalty,
                 presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty),
            dict(max_tokens=a.max_tokens, verify=a.verify, width=a.width, rows=a.rows))


def _file_or_text(value: str, what: str) -> str:
    """A file's text when `value` names an existing file, else `value` itself."""
    import os
    if value and not value.lstrip().startswith(("{", "[")) and os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{what} {value!r}: {e}") from None
    return value


def _constraint_options(a) -> dict:
    """generate()'s json_schema= / regex= / grammar= from --json-schema, --regex, --grammar;
    ValueError naming a schema that is neither a file nor JSON."""
    import json
    out = {}
    if getattr(a, "json_schema", None) is not None:
        text = _file_or_text(a.json_schema, "--json-schema")
        try:
            out["json_schema"] = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {a.json_schema[:80]!r}: neither a file nor JSON "
                             f"({e})") from None
    if getattr(a, "regex", None) is not None:
        out["regex"] = a.regex
    if getattr(a, "grammar", None) is not None:
        out["grammar"] = _file_or_text(a.grammar, "--grammar")
    if len(out) > 1:
        raise ValueError(f"give one of --json-schema, --regex, --grammar, got {sorted(out)}")
    return out


def check_generate(a) -> None:
    """The option values' errors, before a hub id is resolved or the model loads (minutes for
    a big one) and before any output; generate() checks the rest (drafter, stop strings)
    before its stream starts."""
    from .generate import DecodeConfig
    from .sampling import SamplingParams

    sampling, decoding = _generate_options(a)
    DecodeConfig(params=SamplingParams(**sampling), **decoding).validate()
    if a.chat and a.json:
        raise ValueError("--chat writes the conversation as text: it takes no --json")
    _constraint_options(a)


def cmd_generate(a) -> int:
    import sapwood

    from .generate import GenerationResult, GenerationStats

    prompt = _read_stdin() if a.prompt == "-" and not a.chat else a.prompt
    sampling, decoding = _generate_options(a)
    out, got, stream, model = sys.stdout, [], None, None
    try:
        model = sapwood.load(a.model, weights=a.weights, kv=a.kv, threads=a.threads,
                             backend=a.backend, max_context=a.max_context,
                             policy_cache=not a.no_policy_cache)
        if a.chat:
            from .chat import chat

            return chat(model, dict(drafter=a.drafter, stop=a.stop, **sampling, **decoding),
                        system=prompt)
        stream = model.generate(prompt, stream=True, drafter=a.drafter, stop=a.stop, **sampling,
                                **decoding, **_constraint_options(a))
        if not a.json:
            out.write(prompt)
            out.flush()
        for chunk in stream:
            got.extend(chunk.tokens)
            if not a.json and chunk.text:
                out.write(chunk.text)
                out.flush()
        r = stream.result
    except KeyboardInterrupt:
        with _sigint_ignored():  # a second Ctrl-C does not cut the report short
            if stream is not None:
                stream.close()  # the decoding loop ends: its stats are final
            stats = stream.stats if stream is not None else GenerationStats()
            stats.tokens = len(got)  # those received (a stop string may hold some back)
            text = model.decode(got) if got and model.tokenizer is not None else ""
            r = GenerationResult(got, text, stats, "interrupted")
            _report(a, r)
        return 130
    _report(a, r)
    return 0


class _ToStderr(logging.Handler):
    def emit(self, record):  # sys.stderr looked up now: the current one (pytest swaps it)
        print(f"sapwood: {self.format(record)}", file=sys.stderr, flush=True)


@contextmanager
def _loading_shown():
    """While a command runs, each load's line (loading.describe_load: files, weights mode, the
    memory the engine will take) goes to stderr: minutes of silence before a big model's first
    token look like a hang. The Python API only logs it (sapwood.load(verbose=True) prints)."""
    lg, h = logging.getLogger("sapwood.loading"), _ToStderr()
    level = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        lg.removeHandler(h)
        lg.setLevel(level)


@contextmanager
def _sigint_ignored():
    try:
        old = [signal.signal(signal.SIGINT, signal.SIG_IGN)]
    except ValueError:  # not the main thread, the only one Python runs signal handlers on
        old = []
    try:
        yield
    finally:
        for handler in old:
            if handler is not None:  # None: a handler not set from Python, none to restore
                signal.signal(signal.SIGINT, handler)


def _report(a, r) -> None:
    """The result: one JSON object on stdout (--json), else the stats line on stderr."""
    if a.json:
        print(json.dumps({"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason,
                          "stats": r.stats.as_dict()}))
        return
    s = r.stats
    sys.stdout.flush()
    print(f"\n\n[{r.finish_reason}] {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s "
          f"(decode {s.decode_tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1e3:.0f} ms, "
          f"draft prefill {s.draft_prefill_s * 1e3:.0f} ms), "
          f"{s.tokens_per_cycle:.2f} tokens/cycle, {s.cycles} cycles ({s.wide_cycles} wide)",
          file=sys.stderr)


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
    from .formats import auto_weights, stored_matrices
    from .loading import _read_json, read_config
    from .memory import GB, WEIGHT_MODES, available_bytes, estimate_config

    from .config import ModelConfig
    from .formats.gguf import gguf_file_config, is_gguf

    if is_gguf(os.path.expanduser(a.path)):  # one file: its metadata is the config
        d = os.path.expanduser(a.path)
        raw = gguf_file_config(d)
        cfg = ModelConfig.from_dict(raw)
    else:
        d = resolve_checkpoint(a.path, revision=a.revision, download=a.download)
        cfg = read_config(d)
        raw = _read_json(d / "config.json", "config.json")
    if a.weights == "auto":
        a.weights = auto_weights(raw)
    ests = {m: estimate_config(cfg, weights=m, kv=a.kv, max_context=a.max_context,
                               stored=stored_matrices(raw)) for m in WEIGHT_MODES}
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

    if a.served_model_name and a.model_id and a.model_id != a.served_model_name[0]:
        raise ValueError(f"--model-id {a.model_id!r} and --served-model-name "
                         f"{a.served_model_name[0]!r} disagree: give one")
    a.model_id = a.model_id or (a.served_model_name[0] if a.served_model_name else None)
    if a.parallel is None:
        a.parallel, why = server.machine_parallel(a.model, weights=a.weights, kv=a.kv,
                                                  max_context=a.max_context, threads=a.threads)
        print(f"sapwood serve: {why}", file=sys.stderr, flush=True)
    st = server.build(a.model, drafter=a.drafter, parallel=a.parallel, max_context=a.max_context,
                      cache_mb=a.cache_mb, max_queue=a.queue, weights=a.weights, kv=a.kv,
                      backend=a.backend, threads=a.threads, model_id=a.model_id,
                      batch_verify=a.batch_verify, max_body_mb=a.max_body_mb,
                      api_key=a.api_key, cors_origins=a.cors_origin or (),
                      chat_template=_read_chat_template(a.chat_template),
                      reasoning_parser=a.reasoning_parser, aliases=a.served_model_name[1:])
    if a.host not in ("127.0.0.1", "localhost", "::1") and not st.api_key:
        print(f"sapwood serve: listening on {a.host}, not only this machine: the API has no "
              "authentication (--api-key or SAPWOOD_API_KEY sets a key)", file=sys.stderr)
    server.run(st, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def _read_chat_template(spec):
    """--chat-template: "chatml" or a Jinja file (llama.cpp and vLLM take both forms)."""
    from .chat_template import CHATML

    if spec is None or spec == "chatml":
        return None if spec is None else CHATML
    try:
        return Path(spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {spec!r}: not 'chatml' nor a readable template "
                         f"file ({e.strerror if isinstance(e, OSError) else e})") from None


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="default",
                   help="checkpoint directory, a Hugging Face repo id from the local cache, or "
                        "'default' for the bundled pair")
    _add_load_args(p, "cpu", f" per slot, 1 to {MAX_THREADS} (default: the cores shared out "
                             "between the slots)")
    p.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--parallel", type=int, default=None,
                   help="slots: requests decoded at once (one copy of the weights, a sequence "
                        "state per slot; see docs/server.md) (default: the least of the cores "
                        "// 2 (or --threads), the slots free memory holds, and 4; said at start)")
    p.add_argument("--batch-verify", action="store_true",
                   help="verify the decoding slots' trees in one forward (each weight read once "
                        "for all of them; outputs unchanged; not faster on the CPU hosts measured "
                        "so far, see docs/server.md)")
    p.add_argument("--cache-mb", type=float, default=256,
                   help="byte budget of the turn-end snapshots that let a chat's next turn skip "
                        "its prefill, in MiB (0: off)")
    p.add_argument("--queue", type=int, default=64,
                   help="choices that may wait for a slot; past that requests get 503 (a "
                        "request with more choices than the queue and the slots hold: 400)")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="the largest request body accepted, in MiB; a larger one gets 413")
    p.add_argument("--chat-template", default=None, metavar="FILE|chatml",
                   help="the Jinja template chat messages are written with, instead of the "
                        "checkpoint's (default: the checkpoint's; without one, ChatML)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                   help="split <think>...</think> into reasoning_content: qwen3 always, none "
                        "never, auto when the chat template writes thinking (Qwen3.5's does)")
    p.add_argument("--model-id", default=None,
                   help="the model name clients send (default: 'default' or the directory name)")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the model's names for clients (vLLM's): the first is --model-id, the "
                        "others aliases requests may send too")
    p.add_argument("--api-key", default=None,
                   help="requests must send 'Authorization: Bearer KEY', else 401; /health stays "
                        "open (default: $SAPWOOD_API_KEY, else no key)")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browser pages of ORIGIN (scheme://host[:port], or '*') call the "
                        "API; repeat for more (default: none, CORS off)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level")


def _bench(name, a) -> int:
    import importlib

    if name == "peers" and a.weights in ("auto", "q8"):
        a.weights = ["q8", "f32"]
    elif name == "peers":
        a.weights = [a.weights]
    return importlib.import_module(f"sapwood.benchmarks.{name}").main(a)


def _add_bench_parsers(add) -> None:
    ab = add("ab", "two arms side by side (ABBA/BAAB) on the frozen cohort")
    _add_model_args(ab)
    ab.add_argument("--a", default="verify=chain",
                    help="arm A: generate() options as key=value,... (e.g. "
                         "verify=tree,width=8,repetition_penalty=1.1)")
    ab.add_argument("--b", default="verify=auto", help="arm B, as --a")
    ab.add_argument("--cohort", default=None,
                    help="prompt cohort JSON (default: the frozen one, "
                         "sapwood/benchmarks/cohort.json)")
    ab.add_argument("--prompts", type=int, default=0, metavar="N",
                    help="use only the first N prompts; 0: all")
    ab.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens per prompt")
    ab.add_argument("--blocks", type=int, default=2, help="ABBA/BAAB blocks over the cohort")
    ab.add_argument("--warmup", type=int, default=1,
                    help="untimed passes per prompt before its blocks")
    ab.add_argument("--out", default="ab.json", help="raw JSON results")
    ab.add_argument("--processes", type=int, default=1, metavar="N",
                    help="run the A/B in this many fresh processes and report their spread")
    ab.set_defaults(fn=lambda a: _bench("ab", a))
    wd = add("width", "tokens/s per tree width per context depth, and the width rule")
    _add_model_args(wd)
    wd.add_argument("--depths", nargs="+", type=int, default=[0, 2048, 8192, 32768],
                    metavar="TOKENS", help="context depths to measure at")
    wd.add_argument("--max-width", type=int, default=16, metavar="W",
                    help="the widest tree measured")
    wd.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens per run")
    wd.add_argument("--reps", type=int, default=3, help="passes over all widths (ABBA order)")
    wd.add_argument("--drafter", default=None, help=DRAFTER_HELP)
    wd.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="sampling temperature; 0 is greedy (penalties are not offered: they "
                         "make every round a chain, leaving no width to measure)")
    wd.add_argument("--out", default="width.json", help="raw JSON results (and a .png plot)")
    wd.set_defaults(fn=lambda a: _bench("width", a))
    pe = add("peers", "plain decode and prefill against transformers and llama.cpp",
             " (--weights q8, the default, runs sapwood's q8 and f32)")
    _add_model_args(pe)
    pe.add_argument("--gguf", nargs="+", default=None, metavar="FILE",
                    help="GGUF conversions of the same checkpoint (scripts/convert_gguf.py) "
                         "(default: none, llama.cpp not run)")
    pe.add_argument("--prompt-tokens", type=int, default=256, metavar="N", help="prompt length")
    pe.add_argument("--new-tokens", type=int, default=64, metavar="N", help="tokens decoded")
    pe.add_argument("--reps", type=int, default=3,
                    help="blocks: a timed sample of each runtime, order alternated")
    pe.add_argument("--out", default="peers.json", help="raw JSON results")
    pe.set_defaults(fn=lambda a: _bench("peers", a))


def build_parser() -> argparse.ArgumentParser:
    """The `sapwood` command line: every (sub)command's parser formats its help with _Help and
    takes --debug."""
    debug = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's parser sets `debug` only when given there, so that it does not
    # overwrite `sapwood --debug CMD`'s True with its own default
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of a failure (default: off)")

    def adder(sub):
        def add(name, text, more=""):
            return sub.add_parser(name, help=text, description=text + more,
                                  formatter_class=_Help, parents=[debug])
        return add

    ap = argparse.ArgumentParser(prog="sapwood", formatter_class=_Help,
                                 description="speculative decoding for hybrid LLMs")
    ap.add_argument("--version", action="version", version=f"sapwood {version()}")
    ap.add_argument("--debug", action="store_true",
                    help="show the traceback of a failure (also after the command)")
    add = adder(ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND"))
    g = add("generate", "generate a continuation of a prompt")
    _add_generate_args(g)
    g.set_defaults(fn=cmd_generate, check=check_generate)
    ins = add("inspect", "a checkpoint's shape and the memory loading it takes (per part, "
                         "every weights mode), without loading it")
    ins.add_argument("path", help="checkpoint directory or Hugging Face repo id")
    ins.add_argument("--weights", default="auto", choices=WEIGHTS,
                     help="the weights mode whose parts are listed (all modes' totals follow)")
    ins.add_argument("--kv", default="int8", choices=KV, help="how the KV cache would be stored")
    ins.add_argument("--max-context", type=int, default=4096, metavar="N",
                     help="the context the KV cache would hold, in tokens")
    ins.add_argument("--revision", default=None,
                     help="hub id: branch, tag or commit (default: main)")
    ins.add_argument("--download", action="store_true",
                     help="hub id: download it when it is not in the local cache")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.set_defaults(fn=cmd_inspect)
    sv = add("serve", "an OpenAI-compatible HTTP server (needs sapwood[server])")
    _add_serve_args(sv)
    sv.set_defaults(fn=cmd_serve)
    bench = add("bench", "benchmarks: ab, width, peers")
    _add_bench_parsers(adder(bench.add_subparsers(dest="bench", required=True, metavar="BENCH")))
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)  # a usage error exits here with code 2
    if a.cmd == "generate" and a.prompt is None and not a.chat:
        ap.error("generate: a prompt is needed (text, or '-' to read standard input), or --chat")
    a.argv = [x for x in argv if x != "--debug"]  # bench ab --processes reruns its command line
    try:
        if hasattr(a, "check"):
            a.check(a)
        if getattr(a, "model", "default") != "default":  # a hub id becomes its cached directory
            from .hub import resolve_checkpoint
            a.model = str(resolve_checkpoint(a.model, revision=getattr(a, "revision", None),
                                             download=getattr(a, "download", False)))
        with _loading_shown():
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
