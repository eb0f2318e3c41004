"""q8 decode at the Qwen3.5-2B shape (random weights, real vocabulary), 2 threads: sapwood's q8
of the bf16 checkpoint, sapwood on the converter's Q8_0 GGUF of it (weights="auto"), and
llama.cpp's llama-bench tg32 on that GGUF; blocks alternated, medians and ranges.

    python bench/results/zen4_vnni/stop48/decode_2b_llama.py /tmp/qwen35-2b /tmp/gguf2b/q8_0.gguf \
        LLAMA_BIN_DIR [--blocks 4]
(the GGUF: llama.cpp's convert_hf_to_gguf.py --outtype q8_0 of the same directory)"""
import argparse, json, os, platform, re, statistics, subprocess, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "python"))
import sapwood

ap = argparse.ArgumentParser()
ap.add_argument("hf"); ap.add_argument("gguf"); ap.add_argument("llama_bin")
ap.add_argument("--blocks", type=int, default=4); ap.add_argument("--tokens", type=int, default=32)
a = ap.parse_args()
models = {"sapwood q8 (bf16 file)": sapwood.load(a.hf, weights="q8", threads=2, max_context=256, quiet=True),
          "sapwood auto (Q8_0 GGUF)": sapwood.load(a.gguf, threads=2, max_context=256, quiet=True)}
for m in models.values():
    m.generation_config["eos_token_id"] = []
prompt = list(range(1000, 1016))


def sapwood_tok_s(m):
    r = m.generate(prompt, max_tokens=a.tokens + 1, verify="off")
    return r.stats.decode_tokens_per_s


def llama_tok_s():
    out = subprocess.run([os.path.join(a.llama_bin, "llama-bench"), "-m", a.gguf, "-p", "0",
                          "-n", str(a.tokens), "-t", "2", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=a.llama_bin))
    return float(json.loads(out.stdout)[0]["avg_ts"])


runs = {k: [] for k in list(models) + ["llama.cpp Q8_0 (llama-bench tg)"]}
for k, m in models.items():
    sapwood_tok_s(m)  # warm-up
llama_tok_s()
for b in range(a.blocks):
    names = list(runs) if b % 2 == 0 else list(runs)[::-1]
    for n in names:
        runs[n].append(llama_tok_s() if n.startswith("llama") else sapwood_tok_s(models[n]))
ref = statistics.median(runs["llama.cpp Q8_0 (llama-bench tg)"])
for n, v in runs.items():
    print(f"{n:34s} {statistics.median(v):6.2f} tok/s [{min(v):.2f}-{max(v):.2f}]  x{statistics.median(v) / ref:.3f} llama.cpp")
print(json.dumps({"runs": runs, "cpu": platform.processor(), "load_avg": os.getloadavg(),
                  "weights_bytes": {n: m.engine.memory()["weights_bytes"] for n, m in models.items()}}))
