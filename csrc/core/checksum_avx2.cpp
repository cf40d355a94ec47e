// XXH3 with AVX2 (this file alone is compiled with -mavx2; checksum.cpp calls
// it only where the CPU has AVX2). 2-3x the SSE2 hash: a save hashes every
// byte it stages, and a load every byte it verifies.
#include <stddef.h>
#include <stdint.h>

#include "core/checksum_impl.inc"

namespace fw::avx2 {
uint64_t checksum(const void* data, size_t len) { return checksum_impl(data, len); }
uint64_t copy_and_checksum(void* dst, const void* src, size_t len) { return copy_and_checksum_impl(dst, src, len); }
}  // namespace fw::avx2
