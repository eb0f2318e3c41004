"""sapwood against the runtimes users would otherwise pick, on the same checkpoint: plain
decode and prefill tokens/s. Peers: transformers on CPU (torch), llama.cpp through
llama-cpp-python on GGUF conversions of the checkpoint (scripts/convert_gguf.py) at matching
quantization. A peer that cannot be run here is reported as such, never skipped silently.

Protocol: every runtime is loaded once in this process; each block times one sample of every
runtime, in forward order on even blocks and reversed on odd ones (ABBA), so slow drifts of a
shared machine hit all runtimes alike. Ratios against sapwood are taken within a block.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .common import dump_json, file_sha256, geomean, machine, model_identity, source_revision


class _Sapwood:
    def __init__(self, path, weights, prompt_ids, new_tokens):
        import sapwood

        self.m = sapwood.load(path, weights=weights, max_context=len(prompt_ids) + new_tokens + 64)
        self.m.generation_config["eos_token_id"] = []  # time exactly new_tokens decode steps
        self.prompt, self.new = prompt_ids, new_tokens
        self.info = {"weights": weights, "threads": self.m.engine.threads}

    def sample(self):
        r = self.m.generate(self.prompt, max_tokens=self.new, verify="off")
        return len(self.prompt) / r.stats.prefill_s, r.stats.decode_tokens_per_s, list(r.tokens)


class _Transformers:
    def __init__(self, path, prompt_ids, new_tokens):
        import torch
        import transformers

        self.torch = torch
        self.hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.ids, self.new = torch.tensor(prompt_ids)[None], new_tokens
        self.info = {"weights": "f32 (torch)", "threads": torch.get_num_threads(),
                     "version": transformers.__version__}

    def sample(self):
        with self.torch.no_grad():
            t = time.perf_counter()
            out = self.hf(self.ids, use_cache=True)
            t_pre = time.perf_counter() - t
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            toks = [int(tok)]
            t = time.perf_counter()
            for _ in range(self.new - 1):
                out = self.hf(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                toks.append(int(tok))
            t_dec = time.perf_counter() - t
        return self.ids.shape[1] / t_pre, (self.new - 1) / t_dec, toks


class _LlamaCpp:
    def __init__(self, gguf, prompt_ids, new_tokens, threads):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(prompt_ids) + new_tokens + 64,
                                   n_threads=threads, n_threads_batch=threads, n_batch=512,
                                   verbose=False)
        self.prompt, self.new = prompt_ids, new_tokens
        # Llama.scores is not filled without logits_all; read the last row from the context
        v = self.llm.n_vocab()
        self.last = lambda: np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(v,))
        self.info = {"gguf": str(gguf), "gguf_sha256": file_sha256(gguf), "threads": threads,
                     "version": llama_cpp.__version__}

    def sample(self):
        llm = self.llm
        llm.reset()
        t = time.perf_counter()
        llm.eval(self.prompt)
        t_pre = time.perf_counter() - t
        toks = []
        t = time.perf_counter()
        for _ in range(self.new - 1):
            toks.append(int(np.argmax(self.last())))
            llm.eval([toks[-1]])
        t_dec = time.perf_counter() - t
        toks.append(int(np.argmax(self.last())))
        return len(self.prompt) / t_pre, (self.new - 1) / t_dec, toks


def _try(name, make, status):
    """Build a runtime, or record why it cannot run here."""
    try:
        return make()
    except ImportError as e:
        status[name] = f"not run: {e.name or e} is not installed"
    except Exception as e:  # a peer failing to load its model is a finding to report
        status[name] = f"not run: {type(e).__name__}: {e}"
    return None


def main(a) -> int:
    import sapwood

    m = sapwood.load(a.model)
    path = m.path
    prompt_ids = [int(t) for t in m.encode(open(__file__, encoding="utf-8").read())[: a.prompt_tokens]]
    threads = m.engine.threads
    status, runners = {}, {}
    for w in a.weights:
        runners[f"sapwood-{w}"] = _Sapwood(path, w, prompt_ids, a.new_tokens)
    r = _try("transformers", lambda: _Transformers(path, prompt_ids, a.new_tokens), status)
    if r:
        runners["transformers"] = r
    if not a.gguf:
        status["llama.cpp"] = ("not run: no GGUF given (--gguf); build llama-cpp-python from source "
                               "and convert the checkpoint with scripts/convert_gguf.py")
    for g in a.gguf or []:
        name = f"llama.cpp-{Path(g).stem.rsplit('-', 1)[-1]}"
        r = _try(name, lambda g=g: _LlamaCpp(g, prompt_ids, a.new_tokens, threads), status)
        if r:
            runners[name] = r
    names = list(runners)
    for n in names:  # warm-up, not timed
        runners[n].sample()
    blocks = []
    for b in range(a.reps):
        order = names if b % 2 == 0 else names[::-1]
        samples = {n: dict(zip(("prefill_tok_s", "decode_tok_s", "tokens"), runners[n].sample())) for n in order}
        blocks.append({"order": list(order), "samples": samples})
    base = names[0]
    for n in names:  # same checkpoint, so the greedy continuations should agree (up to format)
        t0, t1 = blocks[0]["samples"][base]["tokens"], blocks[0]["samples"][n]["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(t0, t1)) if x != y), min(len(t0), len(t1)))
        runners[n].info[f"greedy_tokens_equal_to_{base}"] = f"first {same} of {len(t0)}"
    peers = {}
    for n in names:
        res = dict(runners[n].info)
        for k in ("prefill_tok_s", "decode_tok_s"):
            xs = [blk["samples"][n][k] for blk in blocks]
            ratio = [blk["samples"][base][k] / blk["samples"][n][k] for blk in blocks]
            res[k] = float(np.median(xs))
            res[k + "_range"] = [float(min(xs)), float(max(xs))]
            res[f"{base}_over_this_{k}"] = {"median": float(np.median(ratio)), "geomean": geomean(ratio),
                                            "range": [float(min(ratio)), float(max(ratio))]}
        peers[n] = res
    out = {"revision": source_revision(), "model": model_identity(m), "machine": machine(),
           "cpu_threads_env": os.environ.get("OMP_NUM_THREADS"), "prompt_tokens": len(prompt_ids),
           "new_tokens": a.new_tokens, "blocks": blocks, "protocol": "one sample per runtime per "
           "block, order reversed every other block (ABBA); ratios paired within blocks",
           "peers": peers, "not_run": status}
    print(f"{a.reps} blocks, prompt {len(prompt_ids)} tokens, {a.new_tokens} new; medians [min, max]; "
          f"ratio = {base} / runtime, paired per block")
    print(f"{'runtime':>18} {'prefill tok/s':>24} {'decode tok/s':>24} {'ratio pre':>10} {'ratio dec':>10}")
    for n, r in peers.items():
        cell = lambda k: f"{r[k]:8.1f} [{r[k + '_range'][0]:.0f}, {r[k + '_range'][1]:.0f}]"
        print(f"{n:>18} {cell('prefill_tok_s'):>24} {cell('decode_tok_s'):>24} "
              f"{r[f'{base}_over_this_prefill_tok_s']['median']:>10.2f} "
              f"{r[f'{base}_over_this_decode_tok_s']['median']:>10.2f}")
    for n, s in status.items():
        print(f"{n:>18}  {s}")
    sha = dump_json(out, a.out)
    print(f"raw JSON {a.out} sha256 {sha}")
    return 0
