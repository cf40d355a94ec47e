// The chunk codec of compressed checkpoints: a chunk's bytes split into byte
// planes (byte k of every element of `width` bytes together: the exponent
// bytes of bf16/fp16/fp32 then sit side by side and compress), each plane
// compressed with zstd, or stored as it is where zstd does not make it
// smaller. Checksums stay over the uncompressed bytes (the caller's business).
//
// libzstd is loaded at run time (dlopen of libzstd.so.1, which every Linux
// distribution installs), so the build needs neither its headers nor its
// library, and a host without it still saves and loads uncompressed.
//
// A frame, little-endian: "FWZ1", width (1|2|4|8), bitmask of the planes that
// are zstd (the others are stored), 2 reserved bytes (0), the raw length
// (u64), then one u64 per plane (its stored length), then the planes, then the
// raw_len % width tail bytes as they are.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace fw::codec {

constexpr uint32_t kMagic = 0x315a5746;  // "FWZ1"
constexpr size_t kMaxWidth = 8;
constexpr size_t kHeaderBytes = 16 + 8 * kMaxWidth;

// "" when libzstd could be loaded, else why not (names FLASHWRITE_LIBZSTD).
const std::string& unavailable();
std::string zstd_version();  // "1.5.4", or "" when unavailable

// Bytes a frame of raw_len bytes can take at most (compress's `out` capacity).
size_t bound(size_t raw_len);

// Per thread: zstd contexts and the plane scratch, reused across calls.
class Coder {
 public:
  Coder();
  ~Coder();
  Coder(const Coder&) = delete;
  Coder& operator=(const Coder&) = delete;
  // Frames `len` bytes of `src` into `out` (capacity >= bound(len)); returns the
  // frame's length. Throws std::runtime_error when zstd is unavailable or fails.
  size_t compress(const char* src, size_t len, unsigned width, int level, char* out);
  // Decodes the frame in src[0, avail) into dst, which must receive exactly
  // raw_len bytes. Throws FormatError (what is wrong, no location: the caller
  // names the file and offset) on any malformed, short or inconsistent frame.
  void decompress(const char* src, size_t avail, char* dst, size_t raw_len);

 private:
  void* cctx_ = nullptr;
  int level_ = 0;
  void* dctx_ = nullptr;
  char* scratch_ = nullptr;
  size_t scratch_cap_ = 0;
  char* scratch(size_t n);
};

}  // namespace fw::codec
