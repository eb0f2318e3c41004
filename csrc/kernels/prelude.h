// Everything a kernel body includes, pulled in before the per-ISA target pragma so library
// code (std::vector, ...) is compiled for the baseline and only the kernels get the ISA.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "../common.h"
#include "../thread_pool.h"
#include "kernels.h"
