"""The GPU device layer (csrc/gpu/device.h) from the tests: one kernel dispatch through
_core.gpu_run, the parameter blocks of metal/sw_common.h, the source directories."""
from __future__ import annotations

import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMU, METAL, SYCL = ROOT / "emu", ROOT / "metal", ROOT / "sycl"


def pack(*fields) -> bytes:
    """A parameter block of metal/sw_common.h: Python ints as int32, floats as float32, in order
    (every block there is plain 4-byte fields, so there is no padding)."""
    return b"".join(struct.pack("<f" if isinstance(v, float) else "<i", v) for v in fields)


def devices() -> list[str]:
    """The GPU devices this build of _core has ("metal-emulated" everywhere, "metal" on a Mac)."""
    from sapwood import _core
    return _core.gpu_devices()


def run(device, kernel, args, groups, threads, threadgroup_bytes=()):
    """One dispatch and wait: args[i] is [[buffer(i)]] (arrays are written back in place).
    device: a name of _core.gpu_devices(), or a mutant_device.MutantDevice (an edited kernel)."""
    groups = [groups] if isinstance(groups, int) else list(groups)
    if not isinstance(device, str):
        return device.run(kernel, list(args), groups, threads, list(threadgroup_bytes))
    from sapwood import _core
    _core.gpu_run(device, kernel, list(args), groups, threads, list(threadgroup_bytes))
