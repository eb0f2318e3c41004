"""Pre-quantized checkpoint formats, as readers of the streaming load (loading.CheckpointTensors).

A format turns the stored tensors of a checkpoint (quantized values, their scales) into the
logical float tensors the model reads, one chunk of rows at a time, so a load still holds the
engine plus one chunk. The engine then stores them as asked (f32, bf16, q8, q4), except
matrices it runs as stored: affine 4-bit groups of 32 or 64 (`q4_group`, QMatrix's q4a), which
a q8 or q4 load keeps byte for byte (common.pack_q4_affine lays them out). Every format reads exactly: an f32 load holds the values
the file means (the submodules say to what precision each is "exact").

- fp8.py: FP8 block quantization (Qwen's and DeepSeek's FP8 releases).
- mlx.py: MLX affine 2/4/8-bit (mlx-lm's converter), mlx-lm's renames undone.
- int4.py: GPTQ (AutoGPTQ / GPTQModel, desc_act too) and AWQ (GEMM) int4 safetensors.
- gguf.py: llama.cpp's GGUF files of Qwen3.5 (any tensor type), with their tokenizer.

weights="auto" (auto_weights) picks the mode a checkpoint loads in; requantized() counts the
tensors a mode rounds a second time, for the warning loading prints.
"""
from __future__ import annotations

from .common import Relaid, _bf16_bits, _f32  # noqa: F401
from .fp8 import E4M3, SCALE_SUFFIX, BlockFp8, fp8_block_size, fp8_view  # noqa: F401
from .int4 import Int4Linear, int4_config, int4_view  # noqa: F401
from .mlx import MLX_NORMS, MlxAffine, mlx_quantization, mlx_view, runs_as_stored  # noqa: F401


def stored_view(index: dict, raw_config: dict) -> dict:
    """The checkpoint's tensors as the model reads them: MLX affine or FP8 block weights with
    their scales as one tensor (MlxAffine, BlockFp8) when config.json says so; ValueError for
    FP8 tensors it does not explain."""
    quant = mlx_quantization(raw_config)
    if quant is not None:
        return mlx_view(index, quant)
    int4 = int4_config(raw_config)
    if int4 is not None:
        return int4_view(index, int4)
    block = fp8_block_size(raw_config)
    if block is not None:
        return fp8_view(index, block)
    for name, info in index.items():
        if info.dtype.startswith("F8"):
            raise ValueError(f"tensor {name!r} is {info.dtype} but config.json has no FP8 "
                             "quantization_config (quant_method 'fp8', weight_block_size) to "
                             "scale it by")
    return index


def describe(raw_config: dict) -> str | None:
    """The stored format in a few words, for the note a requantizing load prints; None for a
    float checkpoint."""
    q = raw_config.get("quantization")
    if isinstance(q, dict):
        return f"MLX affine {q.get('bits')}-bit, groups of {q.get('group_size')}"
    q = raw_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        return f"FP8 e4m3 in {q.get('weight_block_size')} blocks"
    if isinstance(q, dict) and q.get("quant_method") in ("gptq", "awq"):
        g = q.get("group_size")
        return (f"{q['quant_method'].upper()} int{q.get('bits')}, "
                + ("one group a row" if g == -1 else f"groups of {g}")
                + (" (desc_act)" if q.get("desc_act") else ""))
    return None


def requantized(infos: dict, weights: str) -> int:
    """How many stored quantized tensors a load in `weights` rounds a second time: none in f32
    (every format widens exactly to float32); in q4/q8 those no kernel runs as stored (affine
    4-bit groups do, on every backend: `q4_group`); in bf16 all of them."""
    n = 0
    for info in infos.values():
        if getattr(info, "quantized", False):
            n += weights == "bf16" or (weights in ("q4", "q8") and not info.q4_group > 0)
    return n


def stored_matrices(raw_config: dict) -> str | None:
    """"q4a" ("q4a32") when a quantized load keeps the checkpoint's matrices as stored (MLX
    4-bit groups of 64 or 128 (of 32); per-module settings other than those are rounded again:
    the memory estimate counts the global setting), else None. GPTQ/AWQ files give None although their int4
    groups of 64/128 run as stored too: they keep the embeddings, the head and the GDN
    projections in float, so counting every matrix as the mode asked over-counts (a safe
    figure for the memory check) where counting them all as q4a would under-count."""
    q = raw_config.get("quantization")
    if isinstance(q, dict) and runs_as_stored(q.get("bits"), q.get("group_size")):
        return "q4a32" if q["group_size"] == 32 else "q4a"
    return None


def auto_weights(raw_config: dict) -> str:
    """The engine mode `weights="auto"` loads a checkpoint in.

    "q4" for an MLX checkpoint whose every quantized module is 4-bit in groups of 32, 64 or 128
    (all of its matrices run as stored, q4a; the q4 and q8 modes would hold the same bytes, and
    "q4" names what runs). "q8" for everything else: a float checkpoint (int8 per output row,
    the engine's finest quantized mode); FP8 and 8-bit files (their nearest mode); and any
    file whose groups no kernel runs as stored (MLX 2-bit, mixed settings): their
    values are dequantized exactly and rounded once more, and int8 per row rounds them within
    1/254 of the row's largest |weight| where q4 would round 4-bit-grid values to another
    4-bit grid (errors of the order of the first rounding).
    """
    q = raw_config.get("quantization")
    if not isinstance(q, dict):
        return "q8"
    settings = [q] + [v for k, v in q.items() if k not in ("group_size", "bits", "mode")]
    # a module left in float (False) would be quantized to q4 by a "q4" load: q8 then
    ok = all(v is not False and runs_as_stored(v.get("bits"), v.get("group_size"))
             for v in settings)
    return "q4" if ok else "q8"
