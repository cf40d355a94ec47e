#include "core/stream_copy.hpp"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2: every x86-64 CPU has it, and the copy is bound by memory, not by vector width
#define FW_STREAM_COPY_SSE2 1
#endif

namespace fw {

void stream_copy(void* dst, const void* src, size_t len) noexcept {
#ifdef FW_STREAM_COPY_SSE2
  if (len >= kStreamCopyMinBytes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    // Non-temporal stores need a 16-byte aligned destination: the head goes by memcpy.
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= len; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();  // the stores are visible before anything that follows (the write's submit)
    std::memcpy(d + i, s + i, len - i);
    return;
  }
#endif
  std::memcpy(dst, src, len);
}

}  // namespace fw
