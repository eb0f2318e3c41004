// AVX-512 (+VNNI) build of the same kernel source: the AVX2 code paths, 512-bit tree attention
// (one register holds the 16 lanes of a canonical dot), plus vpdpbusd for the
// int8 matmul. Chosen only where the CPU has AVX-512 F/BW/VL/DQ and VNNI.
#include "prelude.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
#define SW_ISA_NS isa_avx512
#define SW_ISA_STR "avx512"
#define SW_TABLE_NAME kernels_avx512
#define SW_USE_AVX2 1
#define SW_USE_AVX512 1
#define SW_USE_VNNI 1
#include "body.inc"
