// AVX2 + FMA build of the same kernel source (vectorised by the compiler across lanes only).
#include "prelude.h"
#pragma GCC target("avx2,fma")
#define SW_ISA_NS isa_avx2
#define SW_ISA_STR "avx2"
#define SW_TABLE_NAME kernels_avx2
#define SW_USE_AVX2 1
#include "body.inc"
