// Emulator self-test: exercises the shim pieces the production kernels do not use yet
// (shuffles, broadcast, simd_min, int reductions, select, vector arithmetic), so they are
// checked before a kernel starts relying on them. Not part of the Metal library.
#include <metal_stdlib>
#include "sw_common.h"
using namespace metal;

kernel void emu_selftest(device const float* x   [[buffer(0)]],  // [64]
                         device float* out       [[buffer(1)]],  // [64 * 8]
                         uint tid                [[thread_index_in_threadgroup]],
                         uint lane               [[thread_index_in_simdgroup]])
{
  const float v = x[tid];
  device float* o = out + tid * 8;
  o[0] = simd_shuffle(v, ushort((lane + 1) % 32));
  o[1] = simd_shuffle_xor(v, ushort(5));
  o[2] = simd_broadcast(v, ushort(3));
  o[3] = simd_min(v);
  o[4] = float(simd_sum(int(lane)));
  o[5] = select(v, -v, lane % 2 == 1);
  const float4 a = float4(v, 1.0f, 2.0f, 3.0f), b = float4(2.0f, v, v, 0.5f);
  const float4 c = a * b + a - b;
  o[6] = c.x + c.y + c.z + c.w;
  const int4 d = int4(char4(-1, 2, -3, 4)) * int4(2, 2, 2, 2);
  o[7] = float(d.x + d.y + d.z + d.w + int(uint2(7u, 9u).y));
}
