import sys, time, json, numpy as np, warnings
warnings.simplefilter("ignore")
import sapwood
arms = [("/tmp/qwen35-2b-mlx4", "q4", "mlx4 as stored"), ("/tmp/qwen35-2b", "q4", "bf16 -> q4"), ("/tmp/qwen35-2b", "q8", "bf16 -> q8")]
models = {lab: sapwood.load(p, weights=w, threads=2, max_context=512, quiet=True) for p, w, lab in arms}
res = {lab: [] for _, _, lab in arms}
prompt = list(range(1000, 1032))
for rep in range(3):
    for _, _, lab in arms:
        e = models[lab].engine
        e.reset(); e.prefill(prompt)
        tok = 5; t = time.perf_counter(); n = 16
        for i in range(n):
            path, picks = e.verify_walk([tok], [-1])
            tok = picks[-1]
        res[lab].append((time.perf_counter() - t) / n * 1e3)
for lab, v in res.items():
    wb = models[lab].engine.memory()["weights_bytes"]
    print(f"{lab:16s} {np.median(v):7.1f} ms/token [{min(v):.1f}-{max(v):.1f}]  weights {wb/1e9:.2f} GB  -> {wb/1e9/(np.median(v)/1e3):.1f} GB/s")
json.dump(res, open("/tmp/rc/dec2b.json", "w"))
