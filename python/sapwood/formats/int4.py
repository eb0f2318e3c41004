"""GPTQ and AWQ int4 checkpoints (safetensors), as AutoGPTQ / GPTQModel and AutoAWQ write them.

config.json's `quantization_config` says which: `{"quant_method": "gptq", "bits": 4,
"group_size": 128, "desc_act": ..., "sym": ..., "checkpoint_format": "gptq"}` or
`{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}`.
A quantized Linear `X` stores, for in inputs, out outputs and G = in / group groups:

GPTQ: `X.qweight` int32 [in / 8, out]: packed along the inputs, input 8i + j in bits 4j..4j+3
  of row i (low bits first); `X.qzeros` int32 [G, out / 8] packed along the outputs the same
  way; `X.scales` f16 [G, out]; `X.g_idx` int32 [in], the group of each input (i // group
  unless desc_act reordered the quantization: then any permutation of groups). The weight is
  scales[g, o] * (q - zero). checkpoint_format "gptq" (AutoGPTQ's v1, what the hub holds)
  stores zero - 1: AutoGPTQ reads ((stored + 1) & 15), as done here; "gptq_v2" stores zero.
AWQ (GEMM layout): `X.qweight` int32 [in, out / 8] packed along the outputs in the order
  [0, 2, 4, 6, 1, 3, 5, 7] (nibble k holds output 8c + ORDER[k]); `X.qzeros` int32
  [G, out / 8] packed the same way; `X.scales` f16 [G, out]; group of input i is i // group.
  The weight is scales * (q - zero).

Read exactly: s (f16/bf16) widens exactly, q - zero is an integer in [-15, 15], so their
float32 product has at most 15 significant bits and is exact; the engine gets the values the
file means, bit for bit. The tensors the quantizer left in float (embeddings, LM head, the GDN
layers' projections, the MTP head: Qwen3.5 GPTQ/AWQ releases keep them bf16) are read as stored.

As stored: groups of 32, 64 or 128 in input order (no desc_act permutation) are the engine's
affine 4-bit groups (QMatrix q4a: scale * q + bias per 32 or 64 inputs) with bias = -(s *
zero), exact in float32 for the same reason, and s * q + bias == s * (q - zero) exactly (the
sum is representable). A q4 or q8 load then keeps the stored nibbles; desc_act files are
dequantized and rounded once more by the mode asked (a warning says so).

The packed tensors are stored [in, out]-like (transposed against the engine's rows): a chunk of
output rows is a column slice of every packed row (_cols).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..safetensors_io import _DTYPES, TensorInfo, TensorReader
from .common import _f32, engine_q4_group, pack_q4_affine

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # nibble k of a packed AWQ int holds output ORDER[k]
AWQ_UNDO = tuple(int(i) for i in np.argsort(AWQ_ORDER))  # output j sits in nibble UNDO[j]
SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)
PARTS = ("qweight", "qzeros", "scales", "g_idx", "bias")


def _cols(reader: TensorReader, info: TensorInfo, c0: int, c1: int) -> np.ndarray:
    """Columns [c0, c1) of a 2-D stored tensor, every row, as a new [rows, c1 - c0] array in
    the file's dtype (BF16 as uint16 bits). Whole rows are read, 16 MB at a time, and the
    slice kept: a read per row (the strided slice alone) would cost a system call per input
    row of every chunk, where the packed tensors are a few tens of MB read from the page
    cache once per chunk."""
    rows, cols = info.shape
    out = np.empty((rows, c1 - c0), np.dtype(_DTYPES[info.dtype]))
    step = max(1, (16 << 20) // max(1, info.row_bytes))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = reader.rows(info, r0, r1).reshape(r1 - r0, cols)[:, c0:c1]
    return out


def _nibbles(x: np.ndarray) -> np.ndarray:
    """int32 [a, b] -> its 4-bit values [a, b, 8], nibble k = bits 4k..4k+3."""
    return (x.view(np.uint32)[..., None] >> SHIFTS) & np.uint32(15)


@dataclass(frozen=True)
class Int4Linear:
    """One GPTQ or AWQ quantized Linear, read as its float32 [out, in] weight."""
    name: str
    method: str          # "gptq" or "awq"
    qweight: TensorInfo
    qzeros: TensorInfo
    scales: TensorInfo
    group: int           # inputs a group (group_size -1: all of them)
    g_idx: tuple | None  # GPTQ with a permuted g_idx (desc_act); None: input i in group i // group
    zero_plus_one: bool  # GPTQ v1: the stored zero is zero - 1

    dtype = "F32"
    quantized = True

    @property
    def shape(self) -> tuple:
        if self.method == "gptq":
            return (self.qweight.shape[1], self.qweight.shape[0] * 8)
        return (self.qweight.shape[1] * 8, self.qweight.shape[0])

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.qzeros.nbytes + self.scales.nbytes

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0]

    @property
    def q4_group(self) -> int:
        """The engine's affine group that runs it as stored (formats.common); 0: none (a
        desc_act permutation, a float32 scale, a width that is not a multiple of 64)."""
        if self.g_idx is not None or self.shape[1] % 64 or self.scales.dtype not in ("F16", "BF16"):
            return 0
        return engine_q4_group(min(self.group, self.shape[1]))

    def _parts(self, reader: TensorReader, r0: int, r1: int):
        """(q [n, in] uint32, zero [n, G] int32, s [n, G] float32) of output rows [r0, r1)."""
        p0, p1 = r0 // 8, -(-r1 // 8)  # the packed columns holding those outputs
        z = _nibbles(_cols(reader, self.qzeros, p0, p1))
        if self.method == "awq":
            z = z[:, :, AWQ_UNDO]
        z = z.reshape(z.shape[0], -1)[:, r0 - 8 * p0:r1 - 8 * p0].astype(np.int32)
        if self.zero_plus_one:
            z = (z + 1) & 15
        s = _f32(_cols(reader, self.scales, r0, r1))
        if self.method == "gptq":
            q = _nibbles(_cols(reader, self.qweight, r0, r1))       # [in / 8, n, 8]
            q = q.transpose(1, 0, 2).reshape(r1 - r0, -1)           # [n, in]
        else:
            q = _nibbles(_cols(reader, self.qweight, p0, p1))[:, :, AWQ_UNDO]
            q = q.reshape(q.shape[0], -1)[:, r0 - 8 * p0:r1 - 8 * p0].T  # [n, in]
        return np.ascontiguousarray(q), np.ascontiguousarray(z.T), np.ascontiguousarray(s.T)

    def _group_of(self) -> np.ndarray:
        cols = self.shape[1]
        return (np.asarray(self.g_idx, np.int64) if self.g_idx is not None
                else np.arange(cols) // min(self.group, cols))

    def rows(self, reader: TensorReader, r0: int, r1: int) -> np.ndarray:
        q, z, s = self._parts(reader, r0, r1)
        g = self._group_of()
        # (q - zero) is an integer in [-15, 15]: its product with a 16-bit float is exact
        return (s[:, g] * (q.astype(np.int32) - z[:, g]).astype(np.float32)).reshape(-1)

    def q4_affine_rows(self, reader: TensorReader, r0: int, r1: int):
        """As formats.MlxAffine.q4_affine_rows, with bias -(s * zero) per group: exact, as zero
        < 16 and s has at most 11 significant bits."""
        q, z, s = self._parts(reader, r0, r1)
        return pack_q4_affine(q, s, -(s * z.astype(np.float32)), min(self.group, q.shape[1]))


def int4_config(raw_config: dict) -> dict | None:
    """`quantization_config` of a GPTQ or AWQ int4 checkpoint, checked; None for another one.
    ValueError naming the setting sapwood does not read."""
    q = raw_config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") not in ("gptq", "awq"):
        return None
    method = q["quant_method"]
    if q.get("bits") != 4:
        raise ValueError(f"quantization_config.bits={q.get('bits')!r}: sapwood reads {method} "
                         "checkpoints of 4 bits")
    group = q.get("group_size")
    if type(group) is not int or not (group == -1 or group >= 8 and group % 8 == 0):
        raise ValueError(f"quantization_config.group_size={group!r}: expected -1 or a multiple "
                         "of 8")
    if method == "gptq":
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r}: sapwood reads "
                             "GPTQ's 'gptq' (v1) and 'gptq_v2' layouts, not kernel-specific ones")
        return {"method": method, "group": group, "v1": fmt == "gptq"}
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version={q.get('version')!r}: sapwood reads "
                         "AWQ's GEMM layout")
    if q.get("zero_point", True) is not True:
        raise ValueError(f"quantization_config.zero_point={q.get('zero_point')!r}: sapwood "
                         "reads AWQ with zero points")
    return {"method": method, "group": group, "v1": False}


def _check(name: str, info: TensorInfo, dtypes: tuple, shape: tuple, what: str) -> None:
    if info.dtype not in dtypes or tuple(info.shape) != shape:
        raise ValueError(f"{what} tensor {name!r} is {info.dtype}{list(info.shape)}: expected "
                         f"{' or '.join(dtypes)}{list(shape)}")


def int4_view(index: dict, setting: dict) -> dict:
    """The checkpoint's tensors with each quantized Linear's parts as one Int4Linear (by the
    weight's name, `X.weight`); ValueError naming a part that is missing or of the wrong
    shape. Reads the small g_idx tensors (a permuted one cannot run as stored)."""
    method, group, v1 = setting["method"], setting["group"], setting["v1"]
    what = method.upper()
    modules = sorted({n.rsplit(".", 1)[0] for n in index if n.endswith(".qweight")})
    taken = set()
    out = {}
    reader = TensorReader(0)
    try:
        for m in modules:
            parts = {p: index.get(f"{m}.{p}") for p in PARTS}
            for p in ("qzeros", "scales"):
                if parts[p] is None:
                    raise ValueError(f"{what} tensor {m + '.qweight'!r} has no {m + '.' + p!r}")
            qw = parts["qweight"]
            if qw.dtype != "I32" or len(qw.shape) != 2:
                raise ValueError(f"{what} tensor {m + '.qweight'!r} is {qw.dtype}"
                                 f"{list(qw.shape)}: expected a 2-D I32 tensor")
            rows, cols = (qw.shape[1], qw.shape[0] * 8) if method == "gptq" else \
                (qw.shape[1] * 8, qw.shape[0])
            if rows % 8:
                raise ValueError(f"{what} tensor {m + '.qweight'!r}: {rows} outputs, not a "
                                 "multiple of 8 (zeros pack 8 outputs an int)")
            g = cols if group == -1 else group
            if cols % g:
                raise ValueError(f"{what} tensor {m + '.qweight'!r}: {cols} inputs in groups of "
                                 f"{g} do not divide")
            ng = cols // g
            _check(m + ".qzeros", parts["qzeros"], ("I32",), (ng, rows // 8), what)
            _check(m + ".scales", parts["scales"], ("F16", "BF16", "F32"), (ng, rows), what)
            g_idx = None
            if parts["g_idx"] is not None:
                _check(m + ".g_idx", parts["g_idx"], ("I32",), (cols,), what)
                gi = reader.read(parts["g_idx"]).astype(np.int64)
                if gi.size and (gi.min() < 0 or gi.max() >= ng):
                    raise ValueError(f"{what} tensor {m + '.g_idx'!r} holds groups "
                                     f"{int(gi.min())}..{int(gi.max())}, outside 0..{ng - 1}")
                if not np.array_equal(gi, np.arange(cols) // g):
                    g_idx = tuple(gi.tolist())  # desc_act: groups in activation order
            if parts["bias"] is not None:  # Qwen's Linears have none; a file may store zeros
                b = reader.read(parts["bias"])
                if b.shape != (rows,) or np.any(b != 0):
                    raise ValueError(f"{what} tensor {m + '.bias'!r}: a nonzero bias, which "
                                     "this model's Linear layers do not have")
            if m + ".weight" in index:
                raise ValueError(f"{m + '.weight'!r} is stored beside {m + '.qweight'!r}")
            out[m + ".weight"] = Int4Linear(m + ".weight", method, qw, parts["qzeros"],
                                            parts["scales"], g, g_idx, v1)
            taken.update(f"{m}.{p}" for p, i in parts.items() if i is not None)
    finally:
        reader.close()
    for name, info in index.items():
        if name in taken:
            continue
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            raise ValueError(f"{what} tensor {name!r} has no qweight beside it")
        out[name] = info
    return out
