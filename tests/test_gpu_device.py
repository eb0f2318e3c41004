"""The GPU device layer (csrc/gpu/device.h) through _core.gpu_run: the emulated Metal device's
registry against the sources, its argument binding and its errors. The kernels themselves are
checked against the numpy references in tests/test_gpu_ops.py, tests/test_gpu_state.py and,
bound by the backend, tests/test_backend_ops.py.
"""
from __future__ import annotations

import re
import struct
import sys

import numpy as np
import pytest

import gpu_util as gu
from sapwood import _core

DEVICES = gu.devices()
EMU = "metal-emulated"


# ---------------------------------------------------------------- registry

BUILTIN = {"threadgroup_position_in_grid": "g", "thread_index_in_threadgroup": "i",
           "thread_index_in_simdgroup": "l", "simdgroup_index_in_threadgroup": "s",
           "simdgroups_per_threadgroup": "n"}


def source_signatures():
    """{kernel: one letter per parameter} parsed from metal/*.metal, checking on the way that
    buffer(i) and threadgroup(i) count up in parameter order (the binder's assumption)."""
    out = {}
    for p in sorted(gu.METAL.glob("*.metal")):
        text = re.sub(r"//.*", "", p.read_text())
        for m in re.finditer(r"\bkernel\s+void\s+(\w+)\s*\(([^{]*)\)\s*\{", text):
            kinds, nb, nt = "", 0, 0
            for param in m.group(2).split(","):
                b = re.search(r"\[\[\s*buffer\((\d+)\)\s*\]\]", param)
                t = re.search(r"SW_THREADGROUP_ARG\((\d+)\)", param)
                a = re.search(r"\[\[\s*(\w+)\s*\]\]", param)
                if b:
                    assert int(b.group(1)) == nb, f"{m.group(1)}: buffer({b.group(1)}) out of order"
                    kinds, nb = kinds + "b", nb + 1
                elif t:
                    assert int(t.group(1)) == nt, f"{m.group(1)}: threadgroup({t.group(1)}) out of order"
                    kinds, nt = kinds + "t", nt + 1
                else:
                    assert a and a.group(1) in BUILTIN, f"{m.group(1)}: parameter {param.strip()!r}"
                    kinds += BUILTIN[a.group(1)]
            assert m.group(1) not in out, f"kernel {m.group(1)} defined twice"
            out[m.group(1)] = kinds
    return out


def test_registry_is_exactly_the_sources_kernels():
    """Every `kernel void` of metal/*.metal is registered, nothing else, each with the binding
    its source declares."""
    src = source_signatures()
    reg = _core.gpu_emulated_kernels()
    assert set(reg) == set(src), (set(src) - set(reg), set(reg) - set(src))
    for name, kinds in src.items():
        assert reg[name] == kinds, name


def test_devices_and_their_errors():
    assert EMU in DEVICES
    with pytest.raises(ValueError, match="unknown GPU device 'cuda'.*metal-emulated"):
        gu.run("cuda", "rms_norm", [], 1, 32)
    if sys.platform != "darwin":
        with pytest.raises(ValueError, match="macOS"):
            gu.run("metal", "rms_norm", [], 1, 32)
    with pytest.raises(RuntimeError, match="no kernel named 'no_such_kernel'"):
        gu.run(EMU, "no_such_kernel", [], 1, 32)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 4 buffer arguments, got 1"):
        gu.run(EMU, "q8_quantize_rows", [x], 2, 256, [32])
    args = [x, np.zeros((2, 64), np.int8), np.zeros(2, np.float32), gu.pack(2, 64, 64, 0)]
    with pytest.raises(RuntimeError, match="q8_quantize_rows: takes 1 threadgroup memory"):
        gu.run(EMU, "q8_quantize_rows", args, 2, 256)
    with pytest.raises(RuntimeError, match="q8_quantize_rows: threads .* got 48"):
        gu.run(EMU, "q8_quantize_rows", args, 2, 48, [32])
    with pytest.raises(RuntimeError, match=r"q8_quantize_rows: buffer\(3\): a constant block of 12 bytes"):
        gu.run(EMU, "q8_quantize_rows", args[:3] + [gu.pack(2, 64, 64)], 2, 256, [32])
    with pytest.raises(ValueError, match=r"args\[1\] must be a numpy array .* got <class 'list'>"):
        gu.run(EMU, "q8_quantize_rows", [x, [1, 2], args[2], args[3]], 2, 256, [32])
    with pytest.raises(ValueError, match=r"args\[0\] must be C-contiguous"):
        gu.run(EMU, "q8_quantize_rows", [np.zeros((64, 2), np.float32).T] + args[1:], 2, 256, [32])


def test_outputs_come_back_in_place_and_read_only_inputs_stay():
    x = np.arange(64, dtype=np.float32).reshape(1, 64) - 31.5
    x.flags.writeable = False
    xq, xs = np.zeros((1, 64), np.int8), np.zeros(1, np.float32)
    gu.run(EMU, "q8_quantize_rows", [x, xq, xs, gu.pack(1, 64, 64, 0)], 1, 256, [32])
    assert xs[0] == np.float32(31.5) / np.float32(127) and xq[0, 0] == -127 and xq[0, -1] == 127


def test_pack_matches_the_c_layout():
    assert gu.pack(1, -2, 0.5) == struct.pack("<iif", 1, -2, 0.5)
