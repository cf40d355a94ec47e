#include "core/checksum.hpp"

#include <algorithm>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace fw {

uint64_t checksum(const void* data, size_t len) { return XXH3_64bits(data, len); }

uint64_t copy_and_checksum(void* dst, const void* src, size_t len) {
  constexpr size_t kBlock = 128 * 1024;  // fits L2 on every x86/ARM server core
  if (len <= kBlock) {
    std::memcpy(dst, src, len);
    return XXH3_64bits(dst, len);
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  for (size_t off = 0; off < len; off += kBlock) {
    size_t n = std::min(kBlock, len - off);
    std::memcpy(d + off, s + off, n);
    XXH3_64bits_update(&state, d + off, n);
  }
  return XXH3_64bits_digest(&state);
}

}  // namespace fw
