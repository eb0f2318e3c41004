// Baseline build of the kernels (any CPU); also the oracle the SIMD builds must match bitwise.
#include "prelude.h"
#define SW_ISA_NS isa_generic
#define SW_ISA_STR "generic"
#define SW_TABLE_NAME kernels_generic
#define SW_USE_AVX2 0
#include "body.inc"
