#include <cstdlib>
#include <cstring>
#include <string>

#include "../common.h"
#include "kernels.h"

#if SAPWOOD_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sapwood {

extern const KernelTable kernels_generic;
#if SAPWOOD_X86
extern const KernelTable kernels_avx2;
extern const KernelTable kernels_avx512;
extern const KernelTable kernels_amx;

// Linux hands out the AMX tile state only to processes that ask for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel 5.16+); without it a tile instruction faults.
static bool amx_usable() {
#if defined(__linux__)
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}
#endif

const KernelTable* kernels_by_name(const char* name) {
  if (!std::strcmp(name, "generic")) return &kernels_generic;
#if SAPWOOD_X86
  __builtin_cpu_init();
  if (!std::strcmp(name, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return &kernels_avx2;
  if (!std::strcmp(name, "avx512") && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return &kernels_avx512;
  if (!std::strcmp(name, "amx") && kernels_by_name("avx512") && amx_usable()) return &kernels_amx;
#endif
  return nullptr;
}

static const KernelTable* pick() {
  if (const char* forced = std::getenv("SAPWOOD_ISA")) {
    const KernelTable* t = kernels_by_name(forced);
    if (!t) throw InputError(cat("SAPWOOD_ISA=", forced, " is not built or not supported here"));
    return t;
  }
  for (const char* name : {"amx", "avx512", "avx2"})
    if (const KernelTable* t = kernels_by_name(name)) return t;
  return &kernels_generic;
}

static const KernelTable* g_table = nullptr;

const KernelTable& kernels() {
  if (!g_table) g_table = pick();
  return *g_table;
}

void set_kernels(const KernelTable* table) { g_table = table; }

}  // namespace sapwood
