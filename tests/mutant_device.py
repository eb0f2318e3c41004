"""An emulated device built around an edited kernel source (tests/test_gpu_mutants.py).

_core's emulated devices are compiled once from metal/ and sycl/, so a kernel with a barrier
deleted needs a second build: emu/mutant_device.cpp with emu/metal_device.cpp (or, for "sycl",
emu/sycl_device.cpp), the edited source's directory searched first, compiled by g++ with the
flags CMakeLists.txt gives the emulator, loaded with ctypes. It dispatches as _core.gpu_run
does, so gpu_util.run takes a MutantDevice wherever it takes a device name. Builds are cached
in build/emu/ (or $SAPWOOD_EMU_CACHE) by a hash of every source read;
$SAPWOOD_EMU_CFLAGS appends flags (e.g. "-O0 -g" to debug a kernel under gdb).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from gpu_util import EMU, METAL, ROOT, SYCL

CXX = os.environ.get("CXX", "g++")
# CMakeLists.txt's emulator flags. -fsigned-char: MSL char is signed. -ffp-contract=off: no fused
# a*b+c the source did not write. -Wno-attributes: the Metal attributes are parsed and ignored.
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fsigned-char", "-ffp-contract=off",
            "-fvisibility=hidden", "-Wall", "-Wno-attributes", "-Wno-unknown-attributes",
            *os.environ.get("SAPWOOD_EMU_CFLAGS", "").split()]
# The files a build reads, by suffix, hashed into its cache key ("": emu/include/metal_stdlib).
SOURCES = {".cpp", ".hpp", ".h", ".metal", ""}


class EmuError(RuntimeError):
    """The mutant refused a launch, or the emulator found a synchronisation error in a kernel."""


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def _cache_dir() -> Path:
    d = Path(os.environ.get("SAPWOOD_EMU_CACHE", ROOT / "build" / "emu"))
    try:
        d.mkdir(parents=True, exist_ok=True)
        return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="sapwood-emu-"))


def build(api: str, override: Path | None) -> Path:
    """The mutant's shared object: `api` "metal" or "sycl", `override` a directory whose kernel
    sources are found before metal/ or sycl/'s."""
    dirs = ([override] if override else []) + ([METAL] if api == "metal" else [SYCL, METAL])
    dirs += [EMU, EMU / "include", ROOT / "csrc"]
    flags = [*CXXFLAGS, *(["-DSW_SYCL_EMU"] if api == "sycl" else [])]
    h = hashlib.sha256(" ".join(flags).encode())
    for i, d in enumerate(dirs[:-1]):  # (the override's place, not its temporary path)
        for f in sorted(p for p in d.iterdir() if p.is_file() and p.suffix in SOURCES):
            h.update(f"{i}/{f.name}".encode() + f.read_bytes())
    h.update((ROOT / "csrc" / "gpu" / "device.h").read_bytes())
    out = _cache_dir() / f"mutant_{api}_{h.hexdigest()[:16]}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [CXX, *flags, *(f"-I{d}" for d in dirs), str(EMU / "mutant_device.cpp"), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise EmuError(f"mutant build failed ({api}, {override}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)
    return out


class MutantDevice:
    """The emulated `api` device over the kernel sources of `override` (None: the unedited ones)."""

    def __init__(self, api: str = "metal", override: Path | None = None):
        self.dll = ctypes.CDLL(str(build(api, override)))
        self.dll.sw_last_error.restype = ctypes.c_char_p
        self.name = f"mutant({api}, {override.name if override else 'unedited'})"

    def __repr__(self):
        return self.name

    def run(self, kernel, args, groups, threads, threadgroup_bytes):
        n = len(args)
        keep = [a if isinstance(a, np.ndarray) else ctypes.create_string_buffer(a, len(a)) for a in args]
        for a in keep:
            assert not isinstance(a, np.ndarray) or a.flags.c_contiguous, kernel
        ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data if isinstance(a, np.ndarray) else ctypes.cast(a, ctypes.c_void_p)
                                       for a in keep])
        sizes = (ctypes.c_size_t * n)(*[a.nbytes if isinstance(a, np.ndarray) else len(a) for a in args])
        blocks = (ctypes.c_int * n)(*[0 if isinstance(a, np.ndarray) else 1 for a in args])
        g = (ctypes.c_uint32 * 3)(*(list(groups) + [1, 1])[:3])
        tg = (ctypes.c_size_t * max(1, len(threadgroup_bytes)))(*threadgroup_bytes)
        fn = self.dll.sw_device_run
        fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        if fn(kernel.encode(), n, ptrs, sizes, blocks, g, threads, len(threadgroup_bytes), tg) != 0:
            raise EmuError(self.dll.sw_last_error().decode())
