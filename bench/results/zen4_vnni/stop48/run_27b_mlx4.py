"""27B-shape MLX 4-bit (scripts/make_mlx_checkpoint.py 27B /tmp/qwen35-27b-mlx4): load with
defaults (weights="auto"), generate, peak memory. python bench/results/zen4_vnni/stop48/run_27b_mlx4.py"""
import json, os, resource, sys, time
sys.path.insert(0, "/work/main/python")
import sapwood
t = time.perf_counter()
m = sapwood.load("/tmp/qwen35-27b-mlx4", max_context=512, quiet=True)
load_s = time.perf_counter() - t
mem = m.engine.memory()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(m, flush=True)
prompt = m.encode("def merge(a, b):")
times = []
for verify in ("off", "chain"):
    r = m.generate(prompt, max_tokens=6, verify=verify, drafter="lookup")
    times.append((verify, r.tokens, round(1e3 / r.stats.decode_tokens_per_s)))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
files = sum(os.path.getsize(os.path.join("/tmp/qwen35-27b-mlx4", f)) for f in os.listdir("/tmp/qwen35-27b-mlx4") if f.endswith(".safetensors"))
out = {"weights": m.weights, "load_s": round(load_s, 1), "engine_weights_bytes": mem["weights_bytes"],
       "file_bytes": files, "peak_rss_after_load": rss, "peak_rss": peak,
       "runs": times, "mem_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
       "load_avg": os.getloadavg()}
print(json.dumps(out))
assert times[0][1] == times[1][1]
