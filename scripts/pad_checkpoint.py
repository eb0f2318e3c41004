"""Inflate a checkpoint's cost without changing its function, to measure speculation at a
realistic model's cost with a trained pair's real acceptance.

    python scripts/pad_checkpoint.py SRC DST [--intermediate 8192] [--layers 32]

SRC: a Qwen3.5 checkpoint directory ("default": the bundled target). DST gets:
- a wider MLP: gate and up rows past the original intermediate size are zero (silu(0) * 0 = 0),
  down's columns past it zero;
- extra layers appended, layer j a copy of layer j % n (the pattern of layer types goes on, and
  they compute on real values: the attention layers fill their KV cache, the GDN layers evolve
  their state)
  with its mixer's output projection and its MLP's down projection zero: they add exactly 0.0
  to the residual stream.
The hidden size stays (RMSNorm's mean would change with it), so the padded model's logits are
the original's bit for bit in every weight format sapwood loads: a zero weight row quantizes to
a zero scale, zero activations add nothing to an exact int32 (or in-order float) dot, and an
activation row's scale is its max, which zeros do not move (tests/test_pad_checkpoint.py).

The bundled 11M target is compute-bound even verifying one token on a CPU, which is why a
9-node verify costs ~5 one-token verifies there; padded to a few hundred MB of q8 weights a
step streams its weights from memory, as a real model's does.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from sapwood.loading import default_target_path
from sapwood.config import ModelConfig
from sapwood.safetensors_io import load_checkpoint_weights
from sapwood.testing import save_bf16

# the projection whose output a layer adds to the residual stream, per layer type
_OUTPUT_PROJ = {"linear_attention": "linear_attn.out_proj.weight",
                "full_attention": "self_attn.o_proj.weight"}


def pad_weights(weights: dict, config: dict, intermediate: int, layers: int) -> tuple[dict, dict]:
    """(padded weights, padded config)."""
    types = list(ModelConfig.from_dict(config).layer_types)
    n, inter = len(types), config["intermediate_size"]
    if intermediate < inter:
        raise ValueError(f"--intermediate {intermediate} is below the checkpoint's {inter}")
    if layers < n:
        raise ValueError(f"--layers {layers} is below the checkpoint's {n}")
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    extra = intermediate - inter

    def mlp(w: dict, p: str) -> None:
        w[p + "mlp.gate_proj.weight"] = np.pad(w[p + "mlp.gate_proj.weight"], ((0, extra), (0, 0)))
        w[p + "mlp.up_proj.weight"] = np.pad(w[p + "mlp.up_proj.weight"], ((0, extra), (0, 0)))
        w[p + "mlp.down_proj.weight"] = np.pad(w[p + "mlp.down_proj.weight"], ((0, 0), (0, extra)))

    # layer j is layer j % n (the pattern of layer types goes on); past n its output is zero
    types = [types[j % n] for j in range(layers)]
    for j in range(layers):
        sp, dp = f"model.layers.{j % n}.", f"model.layers.{j}."
        layer = {dp + k[len(sp):]: v for k, v in weights.items() if k.startswith(sp)}
        mlp(layer, dp)
        if j >= n:
            for name in (_OUTPUT_PROJ[types[j]], "mlp.down_proj.weight"):
                layer[dp + name] = np.zeros_like(layer[dp + name])
        out.update(layer)
    # an MTP head's layers have the target's MLP shape (intermediate_size): widened the same way
    for p in sorted({k[:-len("mlp.gate_proj.weight")] for k in out
                     if k.startswith("mtp.layers.") and k.endswith("mlp.gate_proj.weight")}):
        mlp(out, p)
    cfg = dict(config, intermediate_size=intermediate, num_hidden_layers=layers, layer_types=types)
    return out, cfg


def pad_checkpoint(src, dst, *, intermediate: int, layers: int) -> dict:
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    weights = load_checkpoint_weights(src)
    padded, cfg = pad_weights(weights, config, intermediate, layers)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # bf16 checkpoints stay bf16 (their values widened exactly to float32, so narrowing them
    # back is exact); anything else is written as float32
    if cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16":
        save_bf16(padded, dst / "model.safetensors", {"format": "pt"})
    else:
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in padded.items()},
                  str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="checkpoint directory, or 'default' for the bundled target")
    ap.add_argument("dst")
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args(argv)
    src = default_target_path() if a.src == "default" else a.src
    cfg = pad_checkpoint(src, a.dst, intermediate=a.intermediate, layers=a.layers)
    print(f"{a.dst}: {cfg['num_hidden_layers']} layers, intermediate {cfg['intermediate_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
