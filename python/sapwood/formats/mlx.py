"""MLX affine quantization (mlx-lm's converter: `quantization: {"group_size", "bits"}` in
config.json, per-module overrides by path): `X.weight` packs `bits`-bit values q low bits first
into uint32, `X.scales` and `X.biases` hold one scale s and bias b per group of inputs, and the
weight is s * q + b. Read here as that float32 expression (s, b widen exactly; s * q is exact;
the sum rounds once), so the engine gets what MLX stores within half a float32 ulp; 4-bit
groups of 32, 64 or 128 run as stored in q4/q8 loads (q4_affine_rows). mlx-lm also renames
(`language_model.`), moves the GDN conv1d's axes ([C, K, 1]) and stores the zero-centred RMSNorm weights plus one: undone
here (the reshape moves no byte; the minus one is exact for weights in [0.5, 2]). It drops the
MTP head.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..safetensors_io import TensorInfo, TensorReader
from .common import Relaid, _f32, engine_q4_group, pack_q4_affine


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
    quantized = True

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
    def q4_group(self) -> int:
        """The engine's affine group that runs it as stored (formats.common); 0: none."""
        return engine_q4_group(self.group) if self.bits == 4 else 0

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
        """Rows [r0, r1) as the engine stores affine 4-bit groups (common.pack_q4_affine): a
        group of 128 is two of 64 with its scale and bias."""
        return pack_q4_affine(*self._groups(reader, r0, r1), self.group)


def runs_as_stored(bits, group) -> bool:
    """Whether the engine runs MLX groups as stored (QMatrix's affine 4-bit groups)."""
    return bits == 4 and isinstance(group, int) and engine_q4_group(group) > 0


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


