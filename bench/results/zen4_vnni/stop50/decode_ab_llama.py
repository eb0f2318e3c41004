"""Decode at a Qwen3.5 shape, 2 threads: two sapwood builds (PYTHONPATH dirs, each running
stop49/decode_one.py over the same PATH:WEIGHTS arms in a fresh process) beside llama.cpp's
llama-bench tg32 on a GGUF of the same checkpoint; blocks alternate the order; medians and
ranges; each sapwood arm also as a fraction of its memory floor (the last build's weights
bytes / the read bandwidth measured once a block).

    python bench/results/zen4_vnni/stop50/decode_ab_llama.py LLAMA_BIN GGUF \
        --builds old=/tmp/oldpkg new=python --arms /tmp/qwen35-2b:q4 /tmp/qwen35-2b-mlx4:auto \
        /tmp/gguf2b/q4_k_m.gguf:auto [--blocks 4]
"""
import argparse, json, os, platform, statistics, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("llama_bin"); ap.add_argument("gguf")
ap.add_argument("--builds", nargs="+", required=True, metavar="NAME=PYTHONPATH")
ap.add_argument("--arms", nargs="+", required=True, metavar="PATH:WEIGHTS")
ap.add_argument("--blocks", type=int, default=4)
a = ap.parse_args()
builds = dict(b.split("=", 1) for b in a.builds)
ONE = os.path.join(HERE, "..", "stop49", "decode_one.py")


def build_run(path):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    out = subprocess.run([sys.executable, ONE, *a.arms], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_tok_s():
    out = subprocess.run([os.path.join(a.llama_bin, "llama-bench"), "-m", a.gguf, "-p", "0", "-n", "32",
                          "-t", "2", "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def weights_bytes(path):
    code = ("import json,sys,sapwood; w={}\n"
            "for s in sys.argv[1:]:\n p,x=s.rsplit(':',1); m=sapwood.load(p,weights=x,threads=2,max_context=256,quiet=True)\n"
            " w[s]=m.engine.memory()['weights_bytes']; del m\n"
            "print(json.dumps(w))")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    out = subprocess.run([sys.executable, "-c", code, *a.arms], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bandwidth(path):
    code = "from sapwood import _core; print(_core.read_bandwidth(1 << 29, 2, 3))"
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


LLAMA = f"llama.cpp {os.path.basename(a.gguf)}"
runs = {LLAMA: []}
for n in builds:
    for s in a.arms:
        runs[f"{n} {s}"] = []
bws = []
for b in range(a.blocks):
    order = ["llama", *builds] if b % 2 == 0 else [*builds][::-1] + ["llama"]
    for what in order:
        if what == "llama":
            runs[LLAMA].append(llama_tok_s())
            continue
        for s, v in build_run(builds[what]).items():
            runs[f"{what} {s}"].append(v)
    bws.append(bandwidth(builds[list(builds)[-1]]))
wbytes = weights_bytes(builds[list(builds)[-1]])  # the last build's (the one under test)
ref, bw = statistics.median(runs[LLAMA]), statistics.median(bws)
for n, v in runs.items():
    spec = n.split(" ", 1)[1] if n != LLAMA else None
    floor = f"  {statistics.median(v) * wbytes[spec] / bw:.2f} of the floor" if spec in wbytes else ""
    print(f"{n:52s} {statistics.median(v):6.2f} tok/s [{min(v):.2f}-{max(v):.2f}]  "
          f"x{statistics.median(v) / ref:.3f} llama.cpp{floor}")
print(f"read bandwidth {bw / 1e9:.1f} GB/s [{min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}]")
print(json.dumps({"runs": runs, "read_bandwidth": bws, "weights_bytes": wbytes, "cpu": platform.processor(),
                  "load_avg": os.getloadavg()}))
