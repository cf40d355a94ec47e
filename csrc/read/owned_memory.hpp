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

// 4 KiB pages, as every load buffer has (core/aligned_buffer.hpp): a cold 1 GiB
// load into fresh 2 MiB pages took 4.2 s here, 2.5 kernel CPU-s/GiB faulting
// them in, against 0.73 s and 0.33 into 4 KiB pages, and the tensors outlive
// the load, so no watch can reuse pages found cheap. FLASHWRITE_HUGE_PAGES=on
// places extents of 2 MiB and more so that memory and file agree modulo 2 MiB
// (every chunk read starts on a huge page) and advises them as huge pages.
// Throws std::system_error (mmap's errno) when memory runs out.
OwnedExtent map_extent(uint64_t file_offset, uint64_t nbytes);
void release_extent(const OwnedExtent& e) noexcept;

}  // namespace fw
