"""Int8 KV quantization and a paged KV store (numpy reference).

Per token and KV head, each group of 32 consecutive dims shares one fp32 scale:
    scale = amax / 127;  q = clamp(rint(x / scale), -127, 127);  scale 0 -> q = 0.
All arithmetic is float32, so the C++ kernels must reproduce this bit for bit.
"""
from __future__ import annotations

import numpy as np

GROUP = 32


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] float32, D % 32 == 0 -> (q int8 [..., D], scale float32 [..., D // 32])."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {GROUP}")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    scale = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = np.clip(np.rint(g / safe), -127, 127)
    q = np.where(scale[..., None] == 0, 0, q).astype(np.int8)
    return q.reshape(x.shape), scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of quantize_int8: q * scale in float32."""
    g = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP, GROUP).astype(np.float32)
    return (g * scale[..., None].astype(np.float32)).reshape(q.shape)


def roundtrip(x: np.ndarray) -> np.ndarray:
    """What a query sees of a key or value: its int8-dequantized value."""
    return dequantize_int8(*quantize_int8(x))


class PagedKV:
    """A pool of fixed-size pages and one sequence's page table.

    Page layout [Hkv, page_size, D] per page for k and v; page_table[j] holds positions
    [j * page_size, (j + 1) * page_size).
    """

    def __init__(self, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int):
        self.page_size, self.n_kv_heads, self.head_dim = page_size, n_kv_heads, head_dim
        shape = (num_pages, n_kv_heads, page_size, head_dim)
        self.k_q = np.zeros(shape, np.int8)
        self.v_q = np.zeros(shape, np.int8)
        sshape = (num_pages, n_kv_heads, page_size, head_dim // GROUP)
        self.k_s = np.zeros(sshape, np.float32)
        self.v_s = np.zeros(sshape, np.float32)
        self.free = list(range(num_pages))[::-1]
        self.page_table: list[int] = []
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [T, Hkv, D] float32: quantize and store at positions length .. length+T-1."""
        kq, ks = quantize_int8(k)
        vq, vs = quantize_int8(v)
        for t in range(k.shape[0]):
            page, slot = divmod(self.length, self.page_size)
            if page == len(self.page_table):
                if not self.free:
                    raise MemoryError("KV page pool exhausted")
                self.page_table.append(self.free.pop())
            pid = self.page_table[page]
            self.k_q[pid, :, slot], self.k_s[pid, :, slot] = kq[t], ks[t]
            self.v_q[pid, :, slot], self.v_s[pid, :, slot] = vq[t], vs[t]
            self.length += 1

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized history k, v [P, Hkv, D] in position order."""
        pos = np.arange(self.length)
        pid = np.asarray(self.page_table, dtype=np.int64)[pos // self.page_size] if self.length else pos
        slot = pos % self.page_size
        k = dequantize_int8(self.k_q[pid, :, slot], self.k_s[pid, :, slot])
        v = dequantize_int8(self.v_q[pid, :, slot], self.v_s[pid, :, slot])
        return k.reshape(self.length, self.n_kv_heads, self.head_dim), v.reshape(
            self.length, self.n_kv_heads, self.head_dim)
