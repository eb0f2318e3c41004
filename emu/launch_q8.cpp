// Emulated launches of the q8 kernels (metal/q8_matmul.metal or sycl/q8_matmul.hpp).
#include "api.hpp"
#if defined(SW_METAL)
#include "metal_shim.hpp"
#include "q8_matmul.metal"
#else
#include "q8_matmul.hpp"
#endif

using swemu::ThreadCtx;
constexpr int kThreads = 256;  // 8 simdgroups

// x [rows, cols] -> xq [rows, cols_pad] int8 (zero padded), xs [rows].
SW_API int sw_q8_quantize_rows(const float* x, int rows, int cols, int cols_pad, int8_t* xq, float* xs) {
  return swemu::guard([&] {
    swemu::require(rows > 0 && cols > 0 && cols_pad >= cols && cols_pad % 32 == 0, "bad shape");
    const uint32_t grid[3] = {uint32_t(rows), 1, 1};
    const size_t smem = sizeof(float) * (kThreads / 32);
#if defined(SW_METAL)
    SwQ8Params p{rows, cols, cols_pad, 0};
    swemu::runner().launch(grid, kThreads, smem, [&](const ThreadCtx& c) {
      q8_quantize_rows(x, reinterpret_cast<char*>(xq), xs, p, reinterpret_cast<float*>(c.smem),
                       uint3(c.tg[0], c.tg[1], c.tg[2]), c.tid, c.lane, c.sg, c.nsg);
    });
#else
    swsycl::Q8Args a{};
    a.x = x, a.xq = xq, a.xs = xs, a.rows = rows, a.cols = cols, a.cols_pad = cols_pad;
    swemu::runner().launch(grid, kThreads, smem, [&](const ThreadCtx& c) {
      swsycl::q8_quantize_rows(swemu::NdItem{&c}, a, reinterpret_cast<float*>(c.smem));
    });
#endif
  });
}

// y [rows, out] = dequant(w [out, cols_pad]) x dequant(xq [rows, cols_pad]), 1 <= rows <= 16.
SW_API int sw_q8_matmul(const int8_t* w, const float* w_scale, const int8_t* xq, const float* xs, int rows,
                        int cols_pad, int out, float* y) {
  return swemu::guard([&] {
    swemu::require(rows >= 1 && rows <= 16, "1..16 rows");
    swemu::require(cols_pad % 32 == 0 && out > 0, "bad shape");
    const uint32_t grid[3] = {uint32_t((out + kThreads / 32 - 1) / (kThreads / 32)), 1, 1};
#if defined(SW_METAL)
    SwQ8Params p{rows, 0, cols_pad, out};
    swemu::runner().launch(grid, kThreads, 0, [&](const ThreadCtx& c) {
      q8_matmul(reinterpret_cast<const char*>(w), w_scale, reinterpret_cast<const char*>(xq), xs, y, p,
                uint3(c.tg[0], c.tg[1], c.tg[2]), c.lane, c.sg, c.nsg);
    });
#else
    swsycl::Q8Args a{};
    a.w = w, a.w_scale = w_scale, a.xq = const_cast<int8_t*>(xq), a.xs = const_cast<float*>(xs), a.y = y;
    a.rows = rows, a.cols_pad = cols_pad, a.out_features = out;
    swemu::runner().launch(grid, kThreads, 0, [&](const ThreadCtx& c) { swsycl::q8_matmul(swemu::NdItem{&c}, a); });
#endif
  });
}
