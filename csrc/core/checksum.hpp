// Checksums are XXH3-64 (xxHash, used header-only). The manifest records the
// algorithm name so a later format can change it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fw {

constexpr const char* kChecksumAlgorithm = "xxh3-64";

uint64_t checksum(const void* data, size_t len);

// Copies src to dst and returns the checksum of the bytes, hashing each block
// right after it is copied, while it is still in cache.
uint64_t copy_and_checksum(void* dst, const void* src, size_t len);

// Which XXH3 the checksums run: "avx2" where the build has that path and the CPU and
// OS allow it, else "scalar".
const char* checksum_path();

}  // namespace fw
