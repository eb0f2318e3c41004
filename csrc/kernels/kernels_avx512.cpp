// AVX-512 build of the same kernel source. Not exercised on AVX2-only machines.
#include "prelude.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define SW_ISA_NS isa_avx512
#define SW_ISA_STR "avx512"
#define SW_TABLE_NAME kernels_avx512
#define SW_USE_AVX2 1
#include "body.inc"
