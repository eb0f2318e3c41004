"""Write a random-valued Qwen3.5 checkpoint in mlx-lm's affine-quantized layout (what
`mlx_lm.convert -q` writes) at a published size, straight from the shapes, in scratch space:

    python scripts/make_mlx_checkpoint.py 27B /tmp/qwen35-27b-mlx4 [--bits 4] [--group 64]

mlx-lm's converter needs the bf16 checkpoint first (54 GB at 27B, beside its 15 GB output); this
writes the output alone, a tensor at a time. Layout as the converter's (`--compare DIR` checks
it against a converter's output: at the 2B shape, the same names, dtypes and shapes): names under
`language_model.model.*` (and `language_model.lm_head.*` when untied), every Linear and the
embedding as uint32-packed codes (low bits first) with bf16 `scales` and `biases` per group,
RMSNorm weights stored +1 (mlx's convention), conv1d as [C, K, 1], A_log in f32, no vision
tower and no MTP head (mlx-lm drops both). Values: codes uniform, scale ~ 1/sqrt(fan_in)/8,
bias = -2^(bits-1) scale, so each weight is a centred grid value.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from sapwood.checkpoints import (SIZES, _refuse_repo_path, make_config,  # noqa: E402
                                 tensor_shapes, write_tokenizer)

PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
            "k_norm.weight", "model.norm.weight")
ROWS = 2048  # rows generated at a time


def mlx_tensors(size: str, bits: int, group: int) -> tuple[dict, dict]:
    """(config.json, {mlx name: (dtype, shape, kind, fan_in)}) in the converter's order."""
    config = make_config(size, mtp=True)
    config["quantization"] = config["quantization_config"] = {
        "group_size": group, "bits": bits, "mode": "affine"}
    hf = tensor_shapes(make_config(size, mtp=False), vision=False)
    out = {}
    for name, shape in hf.items():
        base = name.replace("model.language_model.", "language_model.model.", 1)
        if name == "lm_head.weight":
            base = "language_model.lm_head.weight"
        if len(shape) == 2 and shape[1] % group == 0:  # Linear and embedding: quantized
            stem = base[:-len(".weight")]
            out[base] = ("U32", [shape[0], shape[1] * bits // 32], "codes", shape[1])
            out[stem + ".scales"] = ("BF16", [shape[0], shape[1] // group], "scales", shape[1])
            out[stem + ".biases"] = ("BF16", [shape[0], shape[1] // group], "biases", shape[1])
        elif name.endswith("conv1d.weight"):  # [C, 1, K] -> [C, K, 1]
            out[base] = ("BF16", [shape[0], shape[2], 1], "normal", shape[2])
        elif name.endswith("A_log"):
            out[base] = ("F32", list(shape), "a_log", 0)
        elif name.endswith(PLUS_ONE):
            out[base] = ("BF16", list(shape), "plus_one", 0)
        else:
            out[base] = ("BF16", list(shape), "norm" if "norm" in name else "bias", 0)
    return config, dict(sorted(out.items()))


def _bf16(x: np.ndarray) -> bytes:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def _values(kind, dtype, shape, fan_in, bits, group, rng):
    """The tensor's bytes, a block of rows at a time."""
    rows, cols = shape[0], int(np.prod(shape[1:]))
    scale = fan_in ** -0.5 / 8 if fan_in else 0.0
    for r0 in range(0, rows, ROWS):
        n = min(ROWS, rows - r0)
        if kind == "codes":
            yield rng.integers(0, 1 << 32, (n, cols), dtype=np.uint32).astype("<u4").tobytes()
        elif kind == "scales":
            yield _bf16(np.full((n, cols), scale, np.float32) * rng.uniform(0.5, 1.5, (n, cols)))
        elif kind == "biases":
            yield _bf16(np.full((n, cols), -(1 << (bits - 1)) * scale, np.float32))
        elif kind == "a_log":
            yield np.log(rng.uniform(1, 16, (n, cols))).astype("<f4").tobytes()
        elif kind == "plus_one":
            yield _bf16(1.0 + rng.normal(0, 0.1, (n, cols)))
        elif kind == "normal":
            yield _bf16(rng.normal(0, fan_in ** -0.5, (n, cols)))
        else:  # dt_bias, the gated norm's weight
            yield _bf16(rng.normal(1.0 if kind == "norm" else 0.0, 0.1, (n, cols)))


def write(size: str, path: Path, bits: int, group: int, shard_gb: float, seed: int) -> int:
    _refuse_repo_path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, tensors = mlx_tensors(size, bits, group)
    nbytes = {n: int(np.prod(s)) * (2 if d == "BF16" else 4) for n, (d, s, _, _) in tensors.items()}
    shards, cur, acc = [], [], 0
    for n in tensors:
        if cur and acc + nbytes[n] > shard_gb * 1e9:
            shards.append(cur)
            cur, acc = [], 0
        cur.append(n)
        acc += nbytes[n]
    shards.append(cur)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    rng = np.random.default_rng(seed)
    weight_map = {}
    for fname, names in zip(files, shards):
        header, off = {"__metadata__": {"format": "mlx"}}, 0
        for n in names:
            header[n] = {"dtype": tensors[n][0], "shape": tensors[n][1],
                         "data_offsets": [off, off + nbytes[n]]}
            off += nbytes[n]
            weight_map[n] = fname
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for n in names:
                d, s, kind, fan_in = tensors[n]
                for chunk in _values(kind, d, s, fan_in, bits, group, rng):
                    f.write(chunk)
        print(f"{fname}: {len(names)} tensors, {off / 1e9:.2f} GB", flush=True)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return sum(nbytes.values())


def compare(size: str, other: Path, bits: int, group: int) -> list[str]:
    """Names, dtypes and shapes this writer gives that differ from a converter's directory."""
    theirs = {}
    for f in sorted(other.glob("*.safetensors")):
        with open(f, "rb") as fh:
            h = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        theirs.update({k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"})
    ours = {k: (d, s) for k, (d, s, _, _) in mlx_tensors(size, bits, group)[1].items()}
    return sorted(f"{k}: ours {ours.get(k)}, theirs {theirs.get(k)}"
                  for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", choices=SIZES)
    ap.add_argument("path", help="output directory (scratch space, not the repository)")
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4, 8])
    ap.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true",
                    help="compare the layout with `path`, a converter's output; write nothing")
    a = ap.parse_args(argv)
    if a.compare:
        diff = compare(a.size, Path(a.path), a.bits, a.group)
        print("\n".join(diff) or "same names, dtypes and shapes")
        return 1 if diff else 0
    total = write(a.size, Path(a.path), a.bits, a.group, a.shard_gb, a.seed)
    print(f"{a.path}: {total / 1e9:.2f} GB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
