"""Pre-quantized checkpoint formats, as readers of the streaming load (loading.CheckpointTensors).

A format turns the stored tensors of a checkpoint (quantized values, their scales) into the
logical float tensors the model reads, one chunk of rows at a time, so a load still holds the
engine plus one chunk. The engine then stores them as asked (f32, bf16, q8, q4).

FP8 block quantization (`quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128]}`, as Qwen's and DeepSeek's FP8 releases and transformers'
finegrained_fp8 write it): `X.weight` holds float8 e4m3 values and `X.weight_scale_inv` one
scale per block of rows x columns; the weight is value * scale (transformers' dequantisation).
Each value widens exactly to float32 and the product is rounded once, to float32: the tensor
the engine gets is within half a float32 ulp of the stored one. Tensors without a scale (the
`modules_to_not_convert`, norms, the GDN parameters) stay as they are stored.

MLX affine quantization (mlx-lm's converter: `quantization: {"group_size", "bits"}` in
config.json, per-module overrides by path): `X.weight` packs `bits`-bit values q low bits first
into uint32, `X.scales` and `X.biases` hold one scale s and bias b per group of inputs, and the
weight is s * q + b. Read here as that float32 expression (s, b widen exactly; s * q is exact;
the sum rounds once), so the engine gets what MLX stores within half a float32 ulp; kernels
that run the groups as stored are the next step. mlx-lm also renames (`language_model.`), moves
the GDN conv1d's axes ([C, K, 1]) and stores the zero-centred RMSNorm weights plus one: undone
here (the reshape moves no byte; the minus one is exact for weights in [0.5, 2]). It drops the
MTP head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .safetensors_io import TensorInfo, TensorReader

SCALE_SUFFIX = "_scale_inv"


def _e4m3_table() -> np.ndarray:
    """float32 value of every e4m3 ("fn": no infinities, S.1111.111 is NaN) bit pattern."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (sign * v).astype(np.float32)


E4M3 = _e4m3_table()


@dataclass(frozen=True)
class BlockFp8:
    """A float tensor stored as e4m3 values (`weight`) and float32/bf16 scales per
    block[0] x block[1] block (`scale`): what CheckpointTensors reads as float32 rows."""
    name: str
    weight: TensorInfo
    scale: TensorInfo
    block: tuple

    dtype = "F32"  # what it reads as

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def row_bytes(self) -> int:
        return self.weight.row_bytes

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) as float32 [(r1 - r0) * cols] (a new array)."""
        cols = self.shape[1]
        w = E4M3[reader.rows(self.weight, r0, r1)].reshape(r1 - r0, cols)  # a copy: the reader's
        b0, b1 = self.block                                                # buffer is reused next
        s0, s1 = r0 // b0, (r1 - 1) // b0 + 1
        s = reader.rows(self.scale, s0, s1)
        s = _bf16_bits(s) if s.dtype == np.uint16 else s.astype(np.float32)
        s = s.reshape(s1 - s0, -1)[np.arange(r0, r1) // b0 - s0]       # the scale row of each row
        return (w * np.repeat(s, b1, axis=1)[:, :cols]).reshape(-1)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def _f32(x: np.ndarray) -> np.ndarray:
    """A float tensor's rows as read (bf16 as its uint16 bits) as a new float32 array."""
    return _bf16_bits(x) if x.dtype == np.uint16 else x.astype(np.float32)


MLX_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight")


@dataclass(frozen=True)
class MlxAffine:
    """A float tensor stored as MLX affine groups: `bits`-bit values packed in uint32 (low
    bits first), a scale and a bias per `group` inputs."""
    name: str
    weight: TensorInfo
    scales: TensorInfo
    biases: TensorInfo
    bits: int
    group: int

    dtype = "F32"

    @property
    def shape(self) -> tuple:
        return (self.weight.shape[0], self.weight.shape[1] * 32 // self.bits)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    @property
    def row_bytes(self) -> int:
        return self.weight.row_bytes

    @property
    def q4_affine(self) -> bool:
        return runs_as_stored(self.bits, self.group)

    def _groups(self, reader: TensorReader, r0: int, r1: int):
        """(q [n, cols] uint32, scales [n, cols / group], biases) as new arrays."""
        n, cols = r1 - r0, self.shape[1]
        packed = reader.rows(self.weight, r0, r1).reshape(n, -1, 1)
        shifts = np.arange(0, 32, self.bits, dtype=np.uint32)
        q = ((packed >> shifts) & np.uint32((1 << self.bits) - 1)).reshape(n, cols)  # a copy
        s = _f32(reader.rows(self.scales, r0, r1)).reshape(n, -1)
        b = _f32(reader.rows(self.biases, r0, r1)).reshape(n, -1)
        return q, s, b

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        q, s, b = self._groups(reader, r0, r1)
        s, b = (np.repeat(v, self.group, axis=1) for v in (s, b))
        return (s * q.astype(np.float32) + b).reshape(-1)

    def q4_affine_rows(self, reader: TensorReader, r0: int, r1: int):
        """Rows [r0, r1) as the engine stores affine 4-bit groups of 64: nibbles with input j of
        a group low and input j + 32 high in byte j, scales and biases per 64 inputs (a group
        of 128 is two with its scale and bias); and the largest |weight| among them (a
        group's extremes sit at its smallest and largest q: the weight is linear in q)."""
        q, s, b = self._groups(reader, r0, r1)
        g = q.astype(np.uint8).reshape(r1 - r0, -1, 64)
        nibbles = g[:, :, :32] | (g[:, :, 32:] << 4)
        per = self.group // 64
        s, b = np.repeat(s, per, axis=1), np.repeat(b, per, axis=1)
        ends = [s * g.min(axis=2).astype(np.float32) + b, s * g.max(axis=2).astype(np.float32) + b]
        amax = float(max(np.abs(e).max() for e in ends)) if g.size else 0.0
        return np.ascontiguousarray(nibbles).reshape(-1), s.reshape(-1), b.reshape(-1), amax


@dataclass(frozen=True)
class Relaid:
    """A stored tensor read with another shape (same bytes, e.g. conv1d [C, K, 1] as [C, 1, K]),
    minus `minus` when nonzero (MLX's RMSNorm weights, stored plus one)."""
    name: str
    info: TensorInfo
    shape: tuple
    minus: float = 0.0

    @property
    def dtype(self) -> str:
        return "F32" if self.minus else self.info.dtype

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def row_bytes(self) -> int:
        return self.info.nbytes // self.shape[0] if self.shape[0] else 0

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        if not self.minus:  # rows of the new shape are whole rows of the stored bytes
            return reader.rows(self._flat(), r0, r1)
        return _f32(reader.rows(self._flat(), r0, r1)) - np.float32(self.minus)

    def _flat(self) -> TensorInfo:
        return TensorInfo(self.info.path, self.info.dtype, self.shape, self.info.offset,
                          self.info.nbytes)


def runs_as_stored(bits, group) -> bool:
    """Whether the engine runs MLX groups as stored (QMatrix's affine 4-bit groups of 64)."""
    return bits == 4 and isinstance(group, int) and group % 64 == 0


def mlx_quantization(raw_config: dict) -> dict | None:
    """mlx-lm's `quantization` entry of config.json, checked; None when absent."""
    q = raw_config.get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict) or not _mlx_setting_ok(q):
        raise ValueError(f"quantization={q!r}: expected mlx-lm's {{'group_size', 'bits'}}")
    for path, v in q.items():
        if path not in ("group_size", "bits", "mode") and v is not False and not _mlx_setting_ok(v):
            raise ValueError(f"quantization[{path!r}]={v!r}: expected {{'group_size', 'bits'}} or false")
    if q.get("mode", "affine") != "affine":
        raise ValueError(f"quantization mode {q['mode']!r}: sapwood reads MLX's affine mode")
    return q


def _mlx_setting_ok(v) -> bool:
    return (isinstance(v, dict) and v.get("bits") in (2, 4, 8)
            and type(v.get("group_size")) is int and v["group_size"] in (32, 64, 128))


def mlx_view(index: dict, quant: dict) -> dict:
    """The checkpoint's tensors under HF names, every MLX-quantized weight as one MlxAffine,
    the conv1d weights and RMSNorm weights as transformers has them."""
    out = {}
    for name, info in index.items():
        if name.endswith((".scales", ".biases")):
            if name.rsplit(".", 1)[0] + ".weight" not in index:
                raise ValueError(f"{name!r} has no weight beside it")
            continue
        hf = name[len("language_model."):] if name.startswith("language_model.") else name
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in index:
            setting = quant.get(module, quant)
            if setting is False:
                raise ValueError(f"{name!r} has scales but quantization[{module!r}] is false")
            bits, group = setting["bits"], setting["group_size"]
            scales, biases = index[module + ".scales"], index.get(module + ".biases")
            if biases is None:
                raise ValueError(f"MLX tensor {name!r} has scales but no {module + '.biases'!r}")
            if (info.dtype != "U32" or len(info.shape) != 2
                    or tuple(scales.shape) != (info.shape[0], info.shape[1] * 32 // bits // group)
                    or tuple(biases.shape) != tuple(scales.shape)
                    or scales.dtype not in ("F32", "F16", "BF16") or biases.dtype != scales.dtype):
                raise ValueError(f"MLX tensor {name!r}: {info.dtype}{list(info.shape)} with scales "
                                 f"{scales.dtype}{list(scales.shape)} and biases "
                                 f"{biases.dtype}{list(biases.shape)} do not make {bits}-bit "
                                 f"groups of {group}")
            out[hf] = MlxAffine(hf, info, scales, biases, bits, group)
        elif "conv1d.weight" in hf and len(info.shape) == 3 and info.shape[2] == 1:
            out[hf] = Relaid(hf, info, (info.shape[0], 1, info.shape[1]))
        elif hf.endswith(MLX_NORMS) and len(info.shape) == 1:
            out[hf] = Relaid(hf, info, tuple(info.shape), minus=1.0)
        else:
            out[hf] = info
    return out


def fp8_block_size(raw_config: dict) -> tuple | None:
    """(rows, cols) of an FP8 block-quantized checkpoint's scale blocks, None for a checkpoint
    that does not say it is quantized; ValueError for a quantization sapwood does not read."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r}: sapwood reads float "
                         "checkpoints and FP8 block-quantized ones ('fp8'); convert others to "
                         "bf16 first")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r}: FP8 checkpoints are read in e4m3")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(type(v) is int and 1 <= v <= 1 << 16 for v in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [rows, cols] "
                         "of block scales (per-tensor or per-channel FP8 is not read)")
    return tuple(block)


def fp8_view(index: dict, block: tuple) -> dict:
    """The checkpoint's tensors with every e4m3 weight and its scale as one BlockFp8 (by the
    weight's name); ValueError naming a weight without its scale or a scale of the wrong shape."""
    out = {}
    for name, info in index.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in index:
                raise ValueError(f"scale {name!r} has no tensor {name[:-len(SCALE_SUFFIX)]!r}")
            continue
        scale = index.get(name + SCALE_SUFFIX)
        if info.dtype != "F8_E4M3":
            if scale is not None:
                raise ValueError(f"{name!r} has a scale but holds {info.dtype}, not F8_E4M3")
            out[name] = info
            continue
        if scale is None:
            raise ValueError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
        if len(info.shape) != 2:
            raise ValueError(f"FP8 tensor {name!r} has shape {info.shape}: block scales need 2-D")
        want = tuple(math.ceil(n / b) for n, b in zip(info.shape, block))
        if tuple(scale.shape) != want or scale.dtype not in ("F32", "BF16"):
            raise ValueError(f"{name + SCALE_SUFFIX!r} is {scale.dtype}{list(scale.shape)}: "
                             f"expected F32 or BF16 {list(want)} for {list(info.shape)} in "
                             f"{block[0]}x{block[1]} blocks")
        out[name] = BlockFp8(name, info, scale, block)
    return out


def stored_view(index: dict, raw_config: dict) -> dict:
    """The checkpoint's tensors as the model reads them: MLX affine or FP8 block weights with
    their scales as one tensor (MlxAffine, BlockFp8) when config.json says so; ValueError for
    FP8 tensors it does not explain."""
    quant = mlx_quantization(raw_config)
    if quant is not None:
        return mlx_view(index, quant)
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
    return None


def requantized(infos: dict, weights: str) -> int:
    """How many stored quantized tensors a load in `weights` rounds a second time: all of them
    but in f32; in q4/q8 only those no kernel runs as stored (affine 4-bit groups of 64 do)."""
    n = 0
    for info in infos.values():
        if isinstance(info, BlockFp8):
            n += weights != "f32"
        elif isinstance(info, MlxAffine):
            n += weights == "bf16" or (weights in ("q4", "q8") and not info.q4_affine)
    return n


def stored_matrices(raw_config: dict) -> str | None:
    """"q4a" when a quantized load keeps the checkpoint's matrices as stored (MLX 4-bit groups
    of 64 or 128; per-module settings other than those are rounded again: the memory estimate
    counts the global setting), else None."""
    q = raw_config.get("quantization")
    if isinstance(q, dict) and runs_as_stored(q.get("bits"), q.get("group_size")):
        return "q4a"
    return None
