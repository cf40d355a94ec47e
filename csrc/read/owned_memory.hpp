// Memory a loaded CPU tensor owns and the load reads into with O_DIRECT, no
// bounce slot and no copy (read/placements.hpp, kDirect): the tensor's bytes
// sit at the same offset within their page as in the file, and the mapping
// holds the file's pages that the tensor touches, nothing more, so its edge
// pages (a neighbour's bytes read again) are the only slack.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fw {

struct OwnedExtent {
  char* data = nullptr;  // where file byte `file_offset` goes
  void* map = nullptr;   // the mapping to release (release_extent)
  size_t map_len = 0;
};

// Extents of 2 MiB and more are placed so that memory and file agree modulo
// 2 MiB and advised as transparent huge pages (unless FLASHWRITE_HUGE_PAGES=off):
// a direct read into 4 KiB pages is cut at the device's segment limit. Throws
// std::system_error (mmap's errno) when memory runs out.
OwnedExtent map_extent(uint64_t file_offset, uint64_t nbytes);
void release_extent(const OwnedExtent& e) noexcept;

}  // namespace fw
