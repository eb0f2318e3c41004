"""llama.cpp on bench/realistic.py's random 0.65B shape, for bench/engine_table.py's side-by-side
columns: the same random weights written as a Qwen3.5 checkpoint, converted with the llama.cpp
tree's own converter (scripts/convert_gguf.py) to BF16 GGUF, quantized by its llama-quantize to
Q8_0 and Q4_0, and timed with its llama-bench.

LLAMA_BUILD (default /work/llama.cpp-build) is a CMake build of llama.cpp with READY in it once
built; its source tree is READY's `source=` line, else the build folder itself (a source tree built
in place), else vendor/llama.cpp of a llama-cpp-python sdist unpacked beside it. Without a build every llama.cpp figure reads
"not run" and says why.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_BUILD = Path(os.environ.get("LLAMA_BUILD", "/work/llama.cpp-build"))


def find_build(build: Path = DEFAULT_BUILD) -> tuple[dict | None, str]:
    """({'bench', 'quantize', 'source'} paths, '') or (None, why not)."""
    if not (build / "READY").is_file():
        return None, f"not run: {build}/READY does not exist (llama.cpp not built)"
    tools = {}
    for name in ("llama-bench", "llama-quantize"):
        hits = [p for p in (build / "bin" / name, build / name) if p.is_file()]
        hits += sorted(build.rglob(name)) if not hits else []
        if not hits:
            return None, f"not run: no {name} under {build}"
        tools[name] = hits[0]
    source = None
    for line in (build / "READY").read_text().splitlines():
        if line.startswith("source="):
            source = Path(line.split("=", 1)[1].strip())
    if source is None:  # an sdist unpacked beside the build, or the build's own CMake cache
        cands = [build] + sorted(build.parent.glob("llama_cpp_python-*/vendor/llama.cpp"))
        cache = build / "CMakeCache.txt"
        if cache.is_file():
            for line in cache.read_text(errors="replace").splitlines():
                if line.startswith("CMAKE_HOME_DIRECTORY") or line.startswith("llama.cpp_SOURCE_DIR"):
                    cands.insert(0, Path(line.split("=", 1)[1].strip()))
        source = next((c for c in cands if (c / "convert_hf_to_gguf.py").is_file()), None)
    if source is None or not (source / "convert_hf_to_gguf.py").is_file():
        return None, f"not run: no llama.cpp source tree (convert_hf_to_gguf.py) found for {build}"
    return {"bench": tools["llama-bench"], "quantize": tools["llama-quantize"], "source": source}, ""


def hf_config(shape: dict) -> dict:
    """The bundled target's config.json with realistic.py's shape."""
    from sapwood.loading import default_target_path
    cfg = json.loads((Path(default_target_path()) / "config.json").read_text())
    n = len(shape["layer_is_attention"])
    cfg.update(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
               intermediate_size=shape["intermediate_size"], num_hidden_layers=n,
               layer_types=["full_attention" if a else "linear_attention"
                            for a in shape["layer_is_attention"]],
               num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
               head_dim=shape["head_dim"], linear_key_head_dim=shape["dk"],
               linear_value_head_dim=shape["dv"], linear_num_key_heads=shape["hk"],
               linear_num_value_heads=shape["hv"], max_position_embeddings=65536,
               rms_norm_eps=shape["rms_norm_eps"], mtp_num_hidden_layers=0)
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=shape["rope_theta"],
                                  partial_rotary_factor=shape["rotary_dim"] / shape["head_dim"])
    return cfg


def make_ggufs(tools: dict, shape: dict, weights: dict, out_dir: Path) -> dict:
    """{'q8': path, 'q4': path} of Q8_0 / Q4_0 GGUFs of these weights (kept in out_dir and
    reused when already there: the weights are a fixed seed's)."""
    from sapwood.loading import default_target_path
    from sapwood.testing import save_bf16
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"q8": out_dir / "realistic-q8_0.gguf", "q4": out_dir / "realistic-q4_0.gguf"}
    if all(p.is_file() for p in paths.values()):
        return paths
    ckpt = out_dir / "hf"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(default_target_path()) / f, ckpt / f)
    save_bf16(weights, ckpt / "model.safetensors", {"format": "pt"})
    bf16 = out_dir / "realistic-bf16.gguf"
    subprocess.run([sys.executable, str(HERE.parent / "scripts" / "convert_gguf.py"), str(ckpt),
                    str(tools["source"]), "--outtype", "bf16", "--outfile", str(bf16)],
                   check=True, capture_output=True)
    for fmt, qtype in (("q8", "Q8_0"), ("q4", "Q4_0")):
        subprocess.run([str(tools["quantize"]), str(bf16), str(paths[fmt]), qtype], check=True,
                       capture_output=True)
    bf16.unlink()
    shutil.rmtree(ckpt)
    return paths


def llama_bench(tools: dict, gguf: Path, threads: int, *, prompt: int = 0, gen: int = 0,
                depth: int = 0, reps: int = 1, timeout: float = 900) -> dict:
    """llama-bench's samples (tokens/s) of one test: pp`prompt` or tg`gen` at `depth`."""
    # --repack 0: on an AMX host ggml's repacked AMX q8_0 kernel died with SIGILL at its first
    # tile instruction (no tile permission asked of the kernel); plain CPU buffers instead
    cmd = [str(tools["bench"]), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
           "-n", str(gen), "-r", str(reps), "-o", "json", "--repack", "0"]
    if depth:
        cmd += ["-d", str(depth)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    rows = [r for r in json.loads(out.stdout) if r.get("n_prompt", 0) == prompt and r.get("n_gen", 0) == gen]
    if not rows:
        raise RuntimeError(f"{' '.join(cmd)}: no result row in\n{out.stdout[-2000:]}")
    return {"samples_tok_s": rows[0].get("samples_ts") or [rows[0]["avg_ts"]],
            "build": rows[0].get("build_commit"), "cpu": rows[0].get("cpu_info")}


def tok_s_summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples)}


if __name__ == "__main__":  # where the build and source were found, or why not
    print(find_build())
