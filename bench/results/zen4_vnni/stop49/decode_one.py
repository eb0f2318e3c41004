"""Decode tokens/s of each PATH:WEIGHTS (2 threads, 16-token prompt, 3 x 32 tokens, median), as
JSON: the sapwood on PYTHONPATH is the build under test (the prefetch A/B ran two builds)."""
import sys, json, statistics, os, warnings
warnings.filterwarnings("ignore")
import sapwood
out = {}
for spec in sys.argv[1:]:
    path, w = spec.rsplit(":", 1)
    m = sapwood.load(path, weights=w, threads=2, max_context=256, quiet=True)
    m.generation_config["eos_token_id"] = []
    m.generate(list(range(1000, 1016)), max_tokens=9, verify="off")
    ts = [m.generate(list(range(1000, 1016)), max_tokens=33, verify="off").stats.decode_tokens_per_s for _ in range(3)]
    out[spec] = statistics.median(ts)
    del m
print(json.dumps(out))
