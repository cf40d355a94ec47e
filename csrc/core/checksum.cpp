#include "core/checksum.hpp"

#include <stddef.h>
#include <stdint.h>

#include "core/checksum_impl.inc"

#if defined(FLASHWRITE_HAVE_AVX2_XXH3)
#include <cpuid.h>
#endif

namespace fw {

#if defined(FLASHWRITE_HAVE_AVX2_XXH3)
namespace avx2 {
uint64_t checksum(const void* data, size_t len);
uint64_t copy_and_checksum(void* dst, const void* src, size_t len);
}  // namespace avx2

// AVX2 usable: the CPU has it (CPUID leaf 7, EBX) and the OS saves the YMM registers
// (OSXSAVE and XCR0's SSE and AVX bits). Asked through cpuid itself, not
// __builtin_cpu_supports: zig's compiler-rt, the release wheel's, answers that with 0 on
// every CPU, and the wheel hashed with the scalar XXH3.
static bool avx2_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE) || !(c & bit_AVX)) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 6u) != 6u) return false;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_AVX2);
}

static const bool kAvx2 = avx2_usable();

uint64_t checksum(const void* data, size_t len) {
  return kAvx2 ? avx2::checksum(data, len) : ::checksum_impl(data, len);
}
uint64_t copy_and_checksum(void* dst, const void* src, size_t len) {
  return kAvx2 ? avx2::copy_and_checksum(dst, src, len) : ::copy_and_checksum_impl(dst, src, len);
}
const char* checksum_path() { return kAvx2 ? "avx2" : "scalar"; }
#else
const char* checksum_path() { return "scalar"; }
uint64_t checksum(const void* data, size_t len) { return ::checksum_impl(data, len); }
uint64_t copy_and_checksum(void* dst, const void* src, size_t len) {
  return ::copy_and_checksum_impl(dst, src, len);
}
#endif

}  // namespace fw
