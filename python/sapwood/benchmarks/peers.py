"""sapwood against the runtimes users would otherwise pick, on the same checkpoint: plain
decode and prefill tokens/s. Peers: transformers on CPU (torch), llama.cpp through
llama-cpp-python on a GGUF conversion of the checkpoint at matching quantization. A peer that
cannot be run here is reported as such, never skipped silently.
"""
from __future__ import annotations

import time

import numpy as np

from .common import dump_json, machine, model_identity, source_revision


def _sapwood(path, weights, prompt_ids, new_tokens, reps):
    import sapwood

    m = sapwood.load(path, weights=weights, max_context=len(prompt_ids) + new_tokens + 64)
    m.generation_config["eos_token_id"] = []  # time exactly new_tokens decode steps
    m.generate(prompt_ids, max_tokens=4, verify="off")  # warm-up
    pre, dec = [], []
    for _ in range(reps):
        r = m.generate(prompt_ids, max_tokens=new_tokens, verify="off")
        pre.append(len(prompt_ids) / r.stats.prefill_s)
        dec.append(r.stats.decode_tokens_per_s)
    return {"prefill_tok_s": float(np.median(pre)), "decode_tok_s": float(np.median(dec)),
            "weights": weights}


def _transformers(path, prompt_ids, new_tokens, reps):
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"status": f"not run: {e.name} is not installed"}
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompt_ids)[None]
    pre, dec = [], []
    with torch.no_grad():
        hf(ids)
        for _ in range(reps):
            t = time.perf_counter()
            out = hf(ids, use_cache=True)
            t_pre = time.perf_counter() - t
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = hf(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t_dec = time.perf_counter() - t
            pre.append(len(prompt_ids) / t_pre)
            dec.append((new_tokens - 1) / t_dec)
    return {"prefill_tok_s": float(np.median(pre)), "decode_tok_s": float(np.median(dec)),
            "weights": "f32 (torch)", "threads": torch.get_num_threads(),
            "version": transformers.__version__}


def _llama_cpp(gguf, prompt_ids, new_tokens, reps):
    if not gguf:
        return {"status": "not run: no GGUF given (--gguf); llama-cpp-python must be built from "
                          "source here and the checkpoint converted with llama.cpp's converter"}
    try:
        import llama_cpp
    except ImportError:
        return {"status": "not run: llama-cpp-python is not installed"}
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt_ids) + new_tokens + 64, verbose=False)
    pre, dec = [], []
    for _ in range(reps):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt_ids)
        pre.append(len(prompt_ids) / (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        dec.append((new_tokens - 1) / (time.perf_counter() - t))
    return {"prefill_tok_s": float(np.median(pre)), "decode_tok_s": float(np.median(dec)),
            "gguf": gguf, "version": llama_cpp.__version__}


def main(a) -> int:
    import sapwood

    m = sapwood.load(a.model)
    path = m.path
    prompt_ids = m.encode(open(__file__, encoding="utf-8").read())[: a.prompt_tokens]
    out = {"revision": source_revision(), "model": model_identity(m), "machine": machine(),
           "prompt_tokens": len(prompt_ids), "new_tokens": a.new_tokens, "peers": {}}
    for w in a.weights:
        out["peers"][f"sapwood-{w}"] = _sapwood(path, w, prompt_ids, a.new_tokens, a.reps)
    out["peers"]["transformers"] = _transformers(path, prompt_ids, a.new_tokens, a.reps)
    out["peers"]["llama.cpp"] = _llama_cpp(a.gguf, prompt_ids, a.new_tokens, a.reps)
    print(f"{'runtime':>16} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in out["peers"].items():
        if "status" in r:
            print(f"{name:>16}  {r['status']}")
        else:
            print(f"{name:>16} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    sha = dump_json(out, a.out)
    print(f"raw JSON {a.out} sha256 {sha}")
    return 0
