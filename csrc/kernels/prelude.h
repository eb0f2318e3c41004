// Everything a kernel body includes, pulled in before the per-ISA target pragma so library
// code (std::vector, ...) is compiled for the baseline and only the kernels get the ISA.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../thread_pool.h"
#include "kernels.h"
