// Page-aligned host memory from mmap: aligned for O_DIRECT, and whole pages so
// it can be page-locked by the CUDA runtime without touching neighbours.
// No transparent huge pages by default: with THP in madvise mode, faults of
// fresh 2 MiB pages paid for compaction and zeroing (perf: clear_page_erms) and
// made a cold 2 GiB load 3x slower than with 4 KiB pages when every load buffer
// had them. huge_pages() is for buffers that O_DIRECT requests reuse many times,
// faulted once: a load's bounce slots and the staging pool (see there).
#pragma once
#include <cstddef>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace fw {

constexpr size_t kAlign = 4096;

inline constexpr uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Fault in the pages of [p, p + len) (MADV_POPULATE_WRITE, or touching them);
// p page-aligned.
void prefault_pages(char* p, size_t len) noexcept;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // populate=true pre-faults the pages so the first use does not pay for them.
  explicit AlignedBuffer(size_t bytes, bool populate = false);
  // bytes of file `fd` from `file_offset` (a multiple of 4096), mapped shared:
  // what is written here is in the file, and outlives the process when the file
  // is on tmpfs. The file must already hold those bytes (fallocate), or a
  // fault past its end raises SIGBUS.
  static AlignedBuffer map_shared(int fd, uint64_t file_offset, size_t bytes);
  // 2 MiB aligned and advised as transparent huge pages (where THP is on in
  // madvise or always mode): an O_DIRECT request into 4 KiB pages is cut into
  // requests of at most max_segments pages (254 on virtio-blk: under 1 MiB),
  // one into 2 MiB pages is not. Cold reads of 8 MiB chunks into them moved
  // 2.8 GB/s on the benchmark VM, against 0.7 GB/s into 4 KiB pages.
  static AlignedBuffer huge_pages(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  // Fault in [offset, offset+len) now (MADV_POPULATE_WRITE, or touching pages).
  void prefault(size_t offset, size_t len) const noexcept;

  // MADV_DONTFORK on the whole mapping: a child made by fork() gets no copy of
  // it (the range is simply absent there). For private memory that the CUDA
  // driver pins: a fork would otherwise copy every pinned page into the child
  // (or leave the parent's next write in a fresh copy-on-write page while DMA
  // lands in the child's), and copies the page tables of tens of GB at every
  // DataLoader start even without CUDA. Not for shared mappings (map_shared).
  // Returns false (errno set) when the kernel refused.
  bool dont_fork() const noexcept;
  // Drops the mapping without unmapping it: for a forked child, in which a
  // dont_fork() range does not exist (another mapping may already use the
  // addresses, so munmap would destroy it).
  void forget() noexcept;

  char* data() const noexcept { return ptr_; }
  size_t size() const noexcept { return size_; }      // usable bytes (as requested)
  size_t capacity() const noexcept { return cap_; }   // mapped bytes (page multiple)

 private:
  void reset() noexcept;
  char* ptr_ = nullptr;
  void* map_ = nullptr;  // what mmap returned (ptr_ may be aligned up inside it)
  size_t size_ = 0, cap_ = 0, map_len_ = 0;
};

// Faults in a huge_pages() buffer while watching what its 2 MiB pages cost.
// Some VMs back a fresh huge page slowly: on the benchmark VM, memory the guest
// freed recently faults in at 0.3 ms per 2 MiB page, but blocks it had reported
// free to its host take 20-35 ms of CPU each (14 s per GiB), against ~0.6 ms
// for 2 MiB of 4 KiB pages. Elsewhere huge pages fault in faster than small
// ones and make every O_DIRECT request cheaper (no cut at the device's segment
// limit, 512x fewer pages to pin). So fault_in() goes in 8 MiB steps, timed
// in thread CPU time (a preempted thread is not a slow page), and the first
// step whose huge pages cost over 3x what 4 KiB pages cost here advises the
// whole buffer MADV_NOHUGEPAGE: the rest is faulted in with 4 KiB pages.
// FLASHWRITE_HUGE_PAGES=on keeps huge pages, off never uses them, auto (the
// default) watches; a bad value is std::invalid_argument.
class HugePageWatch {
 public:
  // Measures 4 KiB pages on the buffer's last 4 MiB (auto mode, 16 MiB and up).
  explicit HugePageWatch(const AlignedBuffer& buf);
  // Thread-safe: the fill threads each fault in their part.
  void fault_in(size_t offset, size_t len);
  bool huge() const { return !small_.load(); }
  std::string why() const;  // "2 MiB pages: ..." or "4 KiB pages: ..."
  static void check_setting();  // throws on a bad FLASHWRITE_HUGE_PAGES

 private:
  const AlignedBuffer& buf_;
  bool watch_ = false;
  double small_ms_ = 0;  // CPU ms per 2 MiB of 4 KiB pages
  std::atomic<bool> small_{false};
  mutable std::mutex mu_;
  std::string why_;
  double worst_ms_ = 0;  // the dearest step's CPU ms per 2 MiB page so far
};

}  // namespace fw
