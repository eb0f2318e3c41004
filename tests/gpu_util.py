"""GPU kernels under the emulator: build emu/*.cpp with g++ into small shared objects (one per
kernel family and backend, cached by a hash of their sources), load them with ctypes, and wrap
each in numpy-level calls shaped like the host backends' (tests/test_gpu_kernels.py).

Backends: "metal-emu" (the unmodified metal/*.metal compiled as C++ under emu/metal_shim.hpp) and
"sycl-emu" (the sycl/*.hpp kernel templates instantiated with the emulated nd_item). Both run
each threadgroup's threads as fibers (emu/fiber.hpp). The cache lives in build/emu/ (or
$SAPWOOD_EMU_CACHE); only g++ is needed, no Python build dependency.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EMU, METAL, SYCL = ROOT / "emu", ROOT / "metal", ROOT / "sycl"
KINDS = ("kv", "attention", "gdn", "q8")
KERNEL_FILE = {
    "metal": {"kv": "kv_quant.metal", "attention": "tree_attention.metal", "gdn": "gdn.metal",
              "q8": "q8_matmul.metal", "selftest": "selftest.metal"},
    "sycl": {"kv": "kv_quant.hpp", "attention": "tree_attention.hpp", "gdn": "gdn.hpp",
             "q8": "q8_matmul.hpp"},
}
# -fsigned-char: MSL char is signed. -ffp-contract=off: no fused a*b+c the source did not write.
# -Wno-attributes: the Metal attributes ([[buffer(0)]], ...) are parsed and ignored.
# $SAPWOOD_EMU_CFLAGS appends (e.g. "-O0 -g", or -DSW_EMU_UCONTEXT for the portable switch).
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fsigned-char", "-ffp-contract=off",
            "-fvisibility=hidden", "-Wall", "-Wno-attributes", "-Wno-unknown-attributes",
            *os.environ.get("SAPWOOD_EMU_CFLAGS", "").split()]
CXX = os.environ.get("CXX", "g++")


class EmuError(RuntimeError):
    """The emulator refused a launch or detected a synchronisation error in a kernel."""


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def _cache_dir() -> Path:
    d = Path(os.environ.get("SAPWOOD_EMU_CACHE", ROOT / "build" / "emu"))
    try:
        d.mkdir(parents=True, exist_ok=True)
        return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="sapwood-emu-"))


def _sources(api: str, kind: str, first: Path | None):
    """Include dirs and every file the build reads (hashed into the cache key)."""
    own = METAL if api == "metal" else SYCL
    dirs = ([first] if first else []) + [own] + ([EMU] if kind == "selftest" else [])
    files = sorted(p for p in EMU.rglob("*") if p.is_file())
    files += sorted(p for p in own.iterdir() if p.suffix in (".h", ".hpp"))
    name = KERNEL_FILE[api][kind]
    files.append(next(d / name for d in dirs if (d / name).exists()))
    return dirs, files


def build(api: str, kind: str, first: Path | None = None) -> Path:
    """Compile launch_<kind>.cpp for `api` ("metal" | "sycl"); `first` is searched for the kernel
    source before metal/ or sycl/ (how the mutation tests swap in an edited kernel)."""
    dirs, files = _sources(api, kind, first)
    define = "-DSW_METAL" if api == "metal" else "-DSW_SYCL_EMU"
    cmd = [CXX, *CXXFLAGS, define, f"-I{EMU}", f"-I{EMU / 'include'}"]
    cmd += [f"-I{d}" for d in dirs]
    h = hashlib.sha256(" ".join([*CXXFLAGS, define]).encode())
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    out = _cache_dir() / f"{api}_{kind}_{h.hexdigest()[:16]}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(cmd + [str(EMU / f"launch_{kind}.cpp"), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode:
            raise EmuError(f"emulator build failed ({api}/{kind}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)
    return out


def build_all(jobs: int = 2) -> None:
    """Build every family for both APIs, `jobs` compilers at a time (first run only)."""
    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(lambda ak: build(*ak), [(a, k) for a in ("metal", "sycl") for k in KINDS]))


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


class _Lib:
    def __init__(self, path: Path):
        self.dll = ctypes.CDLL(str(path))
        self.dll.sw_last_error.restype = ctypes.c_char_p
        self.dll.sw_barrier_waits.restype = ctypes.c_long

    def call(self, name, *args):
        conv = []
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous, name
                conv.append(_ptr(a))
            elif isinstance(a, float):
                conv.append(ctypes.c_float(a))
            elif a is None:
                conv.append(ctypes.c_void_p(0))
            else:
                conv.append(ctypes.c_int(int(a)))
        if getattr(self.dll, name)(*conv) != 0:
            raise EmuError(self.dll.sw_last_error().decode())

    def barrier_waits(self) -> int:
        return self.dll.sw_barrier_waits()


def f32(a):
    return np.ascontiguousarray(a, np.float32)


def i32(a):
    return np.ascontiguousarray(a, np.int32)


def _real_lib(api: str) -> Path | None:
    """A real device's host library (metal/metal_backend.mm, sycl/sycl_backend.cpp): it exports
    the emulator's sw_* API. $SAPWOOD_METAL_LIB / $SAPWOOD_SYCL_LIB, else next to the package."""
    env = os.environ.get(f"SAPWOOD_{api.upper()}_LIB")
    if env:
        return Path(env)
    try:
        import sapwood
    except ImportError:
        return None
    d = Path(sapwood.__file__).parent
    return next((d / n for n in (f"libsapwood_{api}.so", f"libsapwood_{api}.dylib") if (d / n).exists()), None)


def real_backends() -> list[str]:
    return [api for api in ("metal", "sycl") if _real_lib(api)]


class Backend:
    """One GPU API: "metal-emu" / "sycl-emu" under emulation, "metal" / "sycl" on a real device.
    `overrides` maps a kernel family to a directory holding an edited copy of its source."""

    def __init__(self, name: str, overrides: dict | None = None):
        self.name, self.api = name, name.split("-")[0]
        self.emulated = name.endswith("-emu")
        self.overrides = overrides or {}
        self._libs: dict[str, _Lib] = {}

    def lib(self, kind) -> _Lib:
        if kind not in self._libs:
            path = build(self.api, kind, self.overrides.get(kind)) if self.emulated else _real_lib(self.api)
            self._libs[kind] = _Lib(path)
        return self._libs[kind]

    # ---- int8 KV ----
    def kv_quantize_direct(self, x):
        """x [T, Hkv, D] -> (q int8 [T, Hkv, D], scale [T, Hkv, D/32])."""
        x = f32(x)
        t, hkv, d = x.shape
        q = np.zeros((t, hkv, d), np.int8)
        s = np.zeros((t, hkv, d // 32), np.float32)
        self.lib("kv").call("sw_kv_quantize", x, q, s, None, t, hkv, d, 0, 0)
        return q, s

    def kv_append(self, kv, k, v):
        """Append k, v [T, Hkv, D] to a reference.kv.PagedKV through the GPU kernel."""
        k, v = f32(k), f32(v)
        t, hkv, d = k.shape
        pos0 = kv.length
        while len(kv.page_table) * kv.page_size < pos0 + t:
            kv.page_table.append(kv.free.pop())
        pt = i32(kv.page_table)
        for x, q, s in ((k, kv.k_q, kv.k_s), (v, kv.v_q, kv.v_s)):
            self.lib("kv").call("sw_kv_quantize", x, q, s, pt, t, hkv, d, kv.page_size, pos0)
        kv.length += t

    # ---- tree attention ----
    def tree_attention(self, q, kv, k_tree, v_tree, parents, split=512):
        """q [N, Hq, D]; kv: reference.kv.PagedKV history; k_tree, v_tree [N, Hkv, D] float (the
        kernel quantizes them first, as the engine does); parents [N] -> [N, Hq, D]."""
        q = f32(q)
        n, hq, d = q.shape
        hkv = k_tree.shape[1]
        kt, kts = self.kv_quantize_direct(k_tree)
        vt, vts = self.kv_quantize_direct(v_tree)
        out = np.zeros((n, hq, d), np.float32)
        pt = i32(kv.page_table if kv.page_table else [0])
        self.lib("attention").call(
            "sw_tree_attention", q, kv.k_q, kv.k_s, kv.v_q, kv.v_s, pt, kt, kts, vt, vts,
            i32(parents), n, hq, hkv, d, kv.length, kv.page_size, split, out)
        return out

    # ---- q8 ----
    def q8_quantize_rows(self, x, cols_pad):
        x = f32(x)
        rows, cols = x.shape
        xq = np.zeros((rows, cols_pad), np.int8)
        xs = np.zeros(rows, np.float32)
        self.lib("q8").call("sw_q8_quantize_rows", x, rows, cols, cols_pad, xq, xs)
        return xq, xs

    def q8_matmul(self, wq, ws, xq, xs):
        out, cols_pad = wq.shape
        rows = xq.shape[0]
        y = np.zeros((rows, out), np.float32)
        self.lib("q8").call("sw_q8_matmul", np.ascontiguousarray(wq), f32(ws),
                            np.ascontiguousarray(xq), f32(xs), rows, cols_pad, out, y)
        return y


class GDN:
    """Committed GDN state on an emulated backend, with GDNReference's verify/commit API.
    commit(path) replays (folds the oldest of pending ++ path beyond max_pending) unless
    select=True, which copies the leaf's state and leaves nothing pending."""

    def __init__(self, backend: Backend, hk, hv, dk, dv, conv_w, head_order="grouped",
                 max_pending=8):
        self.b, self.max_pending = backend, max_pending
        w = f32(conv_w)  # [C, K] like the reference; kernels take [K, C]
        self.c, self.kk = w.shape
        self.conv_w = f32(w.T)
        self.dims = i32([hk, hv, dk, dv, self.kk, 1 if head_order == "grouped" else 0])
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.state = np.zeros((hv, dk, dv), np.float32)
        self.window = np.zeros((self.kk - 1, self.c), np.float32)
        self._empty_tape()
        self._tree = None

    @property
    def n_pending(self):
        return self.tape[0].shape[0]

    def _empty_tape(self, n=0):
        self.tape = (np.zeros((n, self.hk, self.dk), np.float32), np.zeros((n, self.hv, self.dv), np.float32),
                     np.zeros((n, self.hv), np.float32), np.zeros((n, self.hv), np.float32))

    def verify(self, x, g, beta, parents):
        x, g, beta, parents = f32(x), f32(g), f32(beta), i32(parents)
        n = len(parents)
        q = np.zeros((n, self.hk, self.dk), np.float32)
        k = np.zeros_like(q)
        v = np.zeros((n, self.hv, self.dv), np.float32)
        out = np.zeros_like(v)
        node_state = np.zeros((n, self.hv, self.dk, self.dv), np.float32)
        tk, tv, tg, tb = self.tape
        self.b.lib("gdn").call("sw_gdn_verify", self.dims, x, g, beta, parents, n, self.window,
                               self.conv_w, self.state, tk, tv, tg, tb, self.n_pending,
                               q, k, v, out, node_state)
        self._tree = (x, g, beta, k, v, node_state)
        return out

    def commit(self, path, select=False, max_pending=None):
        x, g, beta, k, v, node_state = self._tree
        self._commit(i32(path), x, g, beta, k, v, node_state, select,
                     self.max_pending if max_pending is None else max_pending)
        self._tree = None

    def _commit(self, path, x, g, beta, k, v, node_state, select, max_pending):
        pl = len(path)
        total = self.n_pending + pl
        n_fold = 0 if select else max(0, total - max_pending)
        new = 0 if select else total - n_fold
        nk, nv, ng, nb = (np.zeros((max(new, 1),) + a.shape[1:], np.float32) for a in self.tape)
        new_window = self.window.copy()
        tk, tv, tg, tb = (a if a.shape[0] else np.zeros((1,) + a.shape[1:], np.float32) for a in self.tape)
        self.b.lib("gdn").call("sw_gdn_commit", self.dims, self.state, tk, tv, tg, tb, self.n_pending,
                               k, v, g, beta, path if pl else i32([0]), pl, node_state, n_fold,
                               int(select), nk, nv, ng, nb, self.window, x, new_window)
        self.tape = (nk[:new], nv[:new], ng[:new], nb[:new])
        self.window = new_window

    def folded_state(self):
        """The committed state with every pending token folded in (by the commit kernel)."""
        saved = (self.state.copy(), self.tape, self.window)
        z = np.zeros((1, 1), np.float32)
        self._commit(i32([]), z, z, z, z, z, z, False, 0)
        s = self.state
        self.state, self.tape, self.window = saved
        return s


# ---- the device layer (csrc/gpu/device.h) through _core.gpu_run ----

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
