"""Decode at a Qwen3.5 shape (random weights, real vocabulary), 2 threads: sapwood runs
(checkpoint:weights) beside llama.cpp's llama-bench tg on a GGUF of the same checkpoint;
blocks alternated, medians and ranges; each sapwood arm also as a fraction of its memory
floor (weights bytes / the read bandwidth measured once a block, _core.read_bandwidth).
stop48/decode_2b_llama.py with the floor column.

    python bench/results/zen4_vnni/stop49/decode_llama.py LLAMA_BIN_DIR GGUF \
        --sapwood /tmp/qwen35-2b:q8 /tmp/gguf2b/q8_0.gguf:auto [--blocks 4]
    python bench/results/zen4_vnni/stop49/decode_llama.py LLAMA_BIN_DIR /tmp/gguf2b/q4_k_m.gguf \
        --sapwood /tmp/qwen35-2b:q4 /tmp/qwen35-2b-mlx4:auto /tmp/gguf2b/q4_k_m.gguf:auto

The GGUFs: llama.cpp's convert_hf_to_gguf.py (--outtype q8_0, or bf16 then llama-quantize
Q4_K_M) of the same directory; the MLX one: mlx_lm.convert -q of it."""
import argparse, json, os, platform, statistics, subprocess, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "python"))
import sapwood
from sapwood import _core

ap = argparse.ArgumentParser()
ap.add_argument("llama_bin"); ap.add_argument("gguf")
ap.add_argument("--sapwood", nargs="+", required=True, metavar="PATH:WEIGHTS")
ap.add_argument("--blocks", type=int, default=4); ap.add_argument("--tokens", type=int, default=32)
a = ap.parse_args()
models = {}
for spec in a.sapwood:
    path, weights = spec.rsplit(":", 1)
    models[f"sapwood {os.path.basename(path)} {weights}"] = sapwood.load(
        path, weights=weights, threads=2, max_context=256, quiet=True)
for m in models.values():
    m.generation_config["eos_token_id"] = []
prompt = list(range(1000, 1016))
LLAMA = f"llama.cpp {os.path.basename(a.gguf)} (llama-bench tg{a.tokens})"


def sapwood_tok_s(m):
    return m.generate(prompt, max_tokens=a.tokens + 1, verify="off").stats.decode_tokens_per_s


def llama_tok_s():
    out = subprocess.run([os.path.join(a.llama_bin, "llama-bench"), "-m", a.gguf, "-p", "0",
                          "-n", str(a.tokens), "-t", "2", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=a.llama_bin))
    return float(json.loads(out.stdout)[0]["avg_ts"])


runs = {k: [] for k in list(models) + [LLAMA]}
for m in models.values():
    sapwood_tok_s(m)  # warm-up
llama_tok_s()
bws = []
for b in range(a.blocks):
    bws.append(_core.read_bandwidth(1 << 29, 2, 3))
    for n in (list(runs) if b % 2 == 0 else list(runs)[::-1]):
        runs[n].append(llama_tok_s() if n == LLAMA else sapwood_tok_s(models[n]))
ref = statistics.median(runs[LLAMA])
bw = statistics.median(bws)
for n, v in runs.items():
    floor = (f"  {statistics.median(v) * models[n].engine.memory()['weights_bytes'] / bw:.2f} of "
             f"the floor" if n in models else "")
    print(f"{n:44s} {statistics.median(v):6.2f} tok/s [{min(v):.2f}-{max(v):.2f}]  "
          f"x{statistics.median(v) / ref:.3f} llama.cpp{floor}")
print(f"read bandwidth {bw / 1e9:.1f} GB/s [{min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}]")
print(json.dumps({"runs": runs, "read_bandwidth": bws, "cpu": platform.processor(),
                  "load_avg": os.getloadavg(),
                  "weights_bytes": {n: m.engine.memory()["weights_bytes"] for n, m in models.items()}}))
