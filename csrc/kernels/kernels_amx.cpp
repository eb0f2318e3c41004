// AMX build of the same kernel source: the AVX-512 VNNI paths, with the int8 matmul on AMX
// tiles (tdpbssd). Chosen only where the CPU has AMX-TILE/INT8 and the kernel grants this
// process the tile state (dispatch.cpp).
#include "prelude.h"
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
#define SW_ISA_NS isa_amx
#define SW_ISA_STR "amx"
#define SW_TABLE_NAME kernels_amx
#define SW_USE_AVX2 1
#define SW_USE_AVX512 1
#define SW_USE_VNNI 1
#define SW_USE_AMX 1
#include "body.inc"
