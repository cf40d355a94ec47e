// Byte planes + zstd per chunk (see codec.hpp).
#include "core/codec.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <utility>
#include <stdexcept>
#include <vector>

#include "core/error.hpp"

namespace fw::codec {

namespace {

// The part of zstd's stable API the codec uses (zstd.h, "stable API" section:
// these signatures have not changed since 1.0).
struct Zstd {
  void* handle = nullptr;
  std::string error, version;
  size_t (*compressBound)(size_t);
  unsigned (*isError)(size_t);
  const char* (*getErrorName)(size_t);
  void* (*createCCtx)();
  size_t (*freeCCtx)(void*);
  void* (*createDCtx)();
  size_t (*freeDCtx)(void*);
  size_t (*compressCCtx)(void*, void*, size_t, const void*, size_t, int);
  size_t (*compress2)(void*, void*, size_t, const void*, size_t);
  size_t (*setParameter)(void*, int, int);
  size_t (*decompressDCtx)(void*, void*, size_t, const void*, size_t);
  const char* (*versionString)();
};

const Zstd& zstd() {
  static const Zstd z = [] {
    Zstd out;
    std::vector<std::string> names;
    const char* env = std::getenv("FLASHWRITE_LIBZSTD");
    if (env && *env) names.emplace_back(env);
    else names = {"libzstd.so.1", "libzstd.so"};
    std::string first;
    for (const auto& n : names) {
      out.handle = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (out.handle) break;
      if (first.empty()) {
        const char* e = dlerror();
        first = e ? e : n + ": not found";
      }
    }
    if (!out.handle) {
      out.error = "libzstd could not be loaded (" + first + "): install it (apt-get install libzstd1; dnf install "
                  "libzstd), or name it with FLASHWRITE_LIBZSTD";
      return out;
    }
#define SYM(field, name)                                                           \
  *reinterpret_cast<void**>(&out.field) = dlsym(out.handle, name);                 \
  if (!out.field && out.error.empty()) out.error = std::string("libzstd lacks ") + name;
    SYM(compressBound, "ZSTD_compressBound")
    SYM(isError, "ZSTD_isError")
    SYM(getErrorName, "ZSTD_getErrorName")
    SYM(createCCtx, "ZSTD_createCCtx")
    SYM(freeCCtx, "ZSTD_freeCCtx")
    SYM(createDCtx, "ZSTD_createDCtx")
    SYM(freeDCtx, "ZSTD_freeDCtx")
    SYM(compressCCtx, "ZSTD_compressCCtx")
    SYM(decompressDCtx, "ZSTD_decompressDCtx")
    SYM(compress2, "ZSTD_compress2")
    SYM(setParameter, "ZSTD_CCtx_setParameter")
    SYM(versionString, "ZSTD_versionString")
#undef SYM
    if (out.error.empty()) out.version = out.versionString();
    return out;
  }();
  return z;
}

const Zstd& Z() {
  const Zstd& z = zstd();
  if (!z.error.empty()) throw std::runtime_error("compress=\"zstd\": " + z.error);
  return z;
}

void put64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint64_t get64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

template <unsigned W>
void split_w(const unsigned char* src, size_t n, unsigned char* dst) {
  for (size_t i = 0; i < n; ++i)
    for (unsigned k = 0; k < W; ++k) dst[k * n + i] = src[i * W + k];
}

void split(const char* src, size_t n, unsigned width, char* dst) {
  auto s = reinterpret_cast<const unsigned char*>(src);
  auto d = reinterpret_cast<unsigned char*>(dst);
  switch (width) {
    case 2: split_w<2>(s, n, d); break;
    case 4: split_w<4>(s, n, d); break;
    case 8: split_w<8>(s, n, d); break;
    default: std::memcpy(dst, src, n); break;
  }
}

template <unsigned W>
void join_w(const unsigned char* const* planes, size_t n, unsigned char* dst) {
  for (size_t i = 0; i < n; ++i)
    for (unsigned k = 0; k < W; ++k) dst[i * W + k] = planes[k][i];
}

void join(const char* const* planes, size_t n, unsigned width, char* dst) {
  auto p = reinterpret_cast<const unsigned char* const*>(planes);
  auto d = reinterpret_cast<unsigned char*>(dst);
  switch (width) {
    case 2: join_w<2>(p, n, d); break;
    case 4: join_w<4>(p, n, d); break;
    case 8: join_w<8>(p, n, d); break;
    default: std::memcpy(dst, planes[0], n); break;
  }
}

// ZSTD_cParameter values (zstd.h, stable since 1.4.0).
constexpr int kLevel = 100, kHashLog = 102, kMinMatch = 105;
// A plane whose first kProbeBytes zstd cannot shrink below kProbeKeep of them is
// stored without trying the rest (mantissa planes: as good as random).
constexpr size_t kProbeBytes = 64 << 10;
constexpr double kProbeKeep = 0.97;

[[noreturn]] void bad(const std::string& what) { throw FormatError("compressed chunk: " + what); }

}  // namespace

const std::string& unavailable() { return zstd().error; }

std::string zstd_version() { return zstd().error.empty() ? zstd().version : std::string(); }

size_t bound(size_t raw_len) {
  // Planes are compressed one after another into the frame and a plane zstd
  // does not shrink is stored over its attempt: at most every byte, plus the
  // slack of one zstd attempt (zstd's ZSTD_COMPRESSBOUND, rounded up).
  return kHeaderBytes + raw_len + (raw_len >> 8) + (128u << 10);
}

Coder::Coder() = default;

Coder::~Coder() {
  const Zstd& z = zstd();
  if (cctx_) z.freeCCtx(cctx_);
  if (dctx_) z.freeDCtx(dctx_);
  std::free(scratch_);
}

char* Coder::scratch(size_t n) {
  if (n > scratch_cap_) {
    std::free(scratch_);
    scratch_ = static_cast<char*>(std::malloc(n));
    if (!scratch_) {
      scratch_cap_ = 0;
      throw std::bad_alloc();
    }
    scratch_cap_ = n;
  }
  return scratch_;
}

size_t Coder::compress(const char* src, size_t len, unsigned width, int level, char* out) {
  const Zstd& z = Z();
  if (width != 1 && width != 2 && width != 4 && width != 8) throw std::invalid_argument("codec: width must be 1, 2, 4 or 8");
  if (!cctx_ || level != level_) {
    if (!cctx_ && !(cctx_ = z.createCCtx())) throw std::bad_alloc();
    // Byte planes hold few distinct values: short matches are everywhere and
    // worth little; minMatch 7 with a small hash table leaves zstd's entropy
    // coder to do the work, at twice level 1's speed and a better ratio.
    for (auto [param, value] : {std::pair<int, int>{kLevel, level}, {kMinMatch, 7}, {kHashLog, 8}}) {
      const size_t r = z.setParameter(cctx_, param, value);
      if (z.isError(r)) throw std::runtime_error(std::string("zstd parameter: ") + z.getErrorName(r));
    }
    level_ = level;
  }
  const size_t n = len / width, tail = len - n * width;
  char* planes = scratch(len ? len : 1);
  split(src, n, width, planes);
  char* p = out + kHeaderBytes;
  uint8_t zmask = 0;
  std::memset(out, 0, kHeaderBytes);
  for (unsigned k = 0; k < width; ++k) {
    const char* plane = planes + k * n;
    size_t stored = n;
    size_t r = n;
    if (n > 2 * kProbeBytes) {
      r = z.compress2(cctx_, p, z.compressBound(kProbeBytes), plane, kProbeBytes);
      if (z.isError(r)) throw std::runtime_error(std::string("zstd compress: ") + z.getErrorName(r));
      r = r < kProbeKeep * kProbeBytes ? 0 : n;  // 0: worth the whole plane
    } else {
      r = 0;
    }
    if (n && r == 0) r = z.compress2(cctx_, p, z.compressBound(n), plane, n);
    if (n && z.isError(r)) throw std::runtime_error(std::string("zstd compress: ") + z.getErrorName(r));
    if (n && r < n) {
      stored = r;
      zmask |= uint8_t(1u << k);
    } else {
      std::memcpy(p, plane, n);
    }
    put64(out + 16 + 8 * k, stored);
    p += stored;
  }
  std::memcpy(p, src + n * width, tail);
  p += tail;
  const uint32_t magic = kMagic;
  std::memcpy(out, &magic, 4);
  out[4] = static_cast<char>(width);
  out[5] = static_cast<char>(zmask);
  put64(out + 8, len);
  return static_cast<size_t>(p - out);
}

void Coder::decompress(const char* src, size_t avail, char* dst, size_t raw_len) {
  if (avail < kHeaderBytes) bad("shorter than its header (" + std::to_string(avail) + " bytes)");
  uint32_t magic;
  std::memcpy(&magic, src, 4);
  if (magic != kMagic) bad("no frame magic (not written by this codec, or overwritten)");
  const unsigned width = static_cast<unsigned char>(src[4]);
  const unsigned zmask = static_cast<unsigned char>(src[5]);
  if (width != 1 && width != 2 && width != 4 && width != 8) bad("plane width " + std::to_string(width) + " is invalid");
  if (zmask >> width || src[6] || src[7]) bad("reserved header bits are set");
  if (get64(src + 8) != raw_len)
    bad("holds " + std::to_string(get64(src + 8)) + " bytes, the manifest says " + std::to_string(raw_len));
  const size_t n = raw_len / width, tail = raw_len - n * width;
  const char* planes[kMaxWidth];
  size_t pos = kHeaderBytes;
  bool any_z = false;
  for (unsigned k = 0; k < width; ++k) {
    const uint64_t stored = get64(src + 16 + 8 * k);
    if (stored > avail - pos) bad("plane " + std::to_string(k) + " runs past the stored bytes (short read?)");
    if (!(zmask >> k & 1) && stored != n) bad("stored plane " + std::to_string(k) + " has the wrong length");
    any_z |= (zmask >> k & 1) != 0;
    planes[k] = src + pos;
    pos += stored;
  }
  if (tail > avail - pos) bad("tail runs past the stored bytes (short read?)");
  const char* tail_src = src + pos;
  if (width == 1 && !any_z) {
    std::memcpy(dst, planes[0], n);
  } else {
    char* buf = nullptr;
    if (any_z) {
      const Zstd& z = Z();
      if (!dctx_ && !(dctx_ = z.createDCtx())) throw std::bad_alloc();
      buf = scratch(raw_len ? raw_len : 1);
      size_t pos2 = kHeaderBytes;
      for (unsigned k = 0; k < width; ++k) {
        const uint64_t stored = get64(src + 16 + 8 * k);
        if (zmask >> k & 1) {
          const size_t r = z.decompressDCtx(dctx_, buf + k * n, n, src + pos2, stored);
          if (z.isError(r)) bad(std::string("plane ") + std::to_string(k) + ": zstd: " + z.getErrorName(r));
          if (r != n) bad("plane " + std::to_string(k) + " decompressed to " + std::to_string(r) + " bytes, not " +
                          std::to_string(n));
          planes[k] = buf + k * n;
        }
        pos2 += stored;
      }
    }
    join(planes, n, width, dst);
  }
  std::memcpy(dst + n * width, tail_src, tail);
}

}  // namespace fw::codec
