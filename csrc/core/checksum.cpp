#include "core/checksum.hpp"

#include <stddef.h>
#include <stdint.h>

#include "core/checksum_impl.inc"

namespace fw {

#if defined(FLASHWRITE_HAVE_AVX2_XXH3)
namespace avx2 {
uint64_t checksum(const void* data, size_t len);
uint64_t copy_and_checksum(void* dst, const void* src, size_t len);
}  // namespace avx2

static const bool kAvx2 = __builtin_cpu_supports("avx2");

uint64_t checksum(const void* data, size_t len) {
  return kAvx2 ? avx2::checksum(data, len) : ::checksum_impl(data, len);
}
uint64_t copy_and_checksum(void* dst, const void* src, size_t len) {
  return kAvx2 ? avx2::copy_and_checksum(dst, src, len) : ::copy_and_checksum_impl(dst, src, len);
}
#else
uint64_t checksum(const void* data, size_t len) { return ::checksum_impl(data, len); }
uint64_t copy_and_checksum(void* dst, const void* src, size_t len) {
  return ::copy_and_checksum_impl(dst, src, len);
}
#endif

}  // namespace fw
