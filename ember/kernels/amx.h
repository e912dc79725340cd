// AMX tiles (Xeons since Sapphire Rapids): what both of their users share, bfloat16 attention
// (attention_tiles.h) and the int8 linear layers (linear_amx.h). Each user loads a configuration
// of its own at the start of its work on a thread and hands the tiles back at its end (release),
// so neither finds the other's shapes, nor oneDNN's.
//
// common.h includes it where the build targets tiles (EMBER_AMX_TILES, EMBER_AMX_INT8).

#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace ember_kernels {
namespace amx {

// The processor has tiles with the products asked for (bfloat16: tdpbf16ps; int8: tdpb*d) and
// Linux grants this process their state (arch_prctl's ARCH_REQ_XCOMP_PERM).
inline bool granted(bool bf16, bool int8) {
  static const struct Units {
    bool bf16, int8;
  } units = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24))) return Units{false, false};
    constexpr long REQUEST_PERMISSION = 0x1023, TILE_DATA = 18;
    if (syscall(SYS_arch_prctl, REQUEST_PERMISSION, TILE_DATA) != 0) return Units{false, false};
    return Units{bool(edx & (1u << 22)), bool(edx & (1u << 25))};
  }();
  return (!bf16 || units.bf16) && (!int8 || units.int8);
}

// A configuration: palette 1, each tile's rows and bytes a row.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

inline void configure(const Config& config) { asm volatile("ldtilecfg %0" ::"m"(config) : "memory"); }
inline void release() { asm volatile("tilerelease" ::: "memory"); }

// The compiler's own tile intrinsics do not tell it that a load reads memory; these do.
template <int T> inline void load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T> inline void store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T> inline void zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
// C += A B: bfloat16 pairs into floats
template <int C, int A, int B> inline void dot_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
// C += A B: signed bytes (A) times unsigned bytes (B), four at a time, into int32 sums
template <int C, int A, int B> inline void dot_s8u8() {
  asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

}  // namespace amx
}  // namespace ember_kernels
