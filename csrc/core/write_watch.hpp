// Which memory no write has reached since it was last looked at: the kernel's
// write watch (userfaultfd write-protection in async mode, and the PAGEMAP_SCAN
// ioctl of /proc/self/pagemap that reads and re-arms it in one step; Linux 6.7).
// Incremental saves use it to skip hashing tensors that nothing wrote since the
// save that last hashed them (python/flashwrite/write_watch.py).
//
// A page counts as unchanged only while its write-protect bit, set by a scan of
// this watch, is still there. Any write through this process's page tables
// clears it (the CPU's, and the kernel's on the process's behalf: read(), an
// O_DIRECT or io_uring read into the memory, process_vm_writev), and so does any
// unmap or remap. Conservatively, a page that is not present (never touched,
// swapped out, dropped by MADV_DONTNEED) or not anonymous (shared memory, a file
// mapping, which other processes can write through their own page tables) always
// counts as changed. What the kernel cannot see: a device writing by DMA into
// memory pinned before it was protected; the Python side leaves pinned tensors out.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace fw {

class WriteWatch {
 public:
  using Range = std::pair<uintptr_t, uint64_t>;  // (address, bytes)

  // Throws IoError with the errno where the kernel cannot: userfaultfd missing or
  // forbidden (seccomp, vm.unprivileged_userfaultfd), asynchronous write-protection
  // unknown (before Linux 6.7), no PAGEMAP_SCAN.
  WriteWatch();
  ~WriteWatch();
  WriteWatch(const WriteWatch&) = delete;
  WriteWatch& operator=(const WriteWatch&) = delete;

  // Registers the pages under each range (whole pages around it) for write-protection;
  // false where the kernel refuses (memory that is not anonymous or shmem, a range
  // another userfaultfd watches, too many mappings). Registering again is harmless.
  // Registration alone protects nothing: the next scan does.
  std::vector<bool> arm(const std::vector<Range>& ranges);

  // For each range, which of its pages may have changed since the last scan that covered
  // them (written, not present, not anonymous, not registered, or unmapped): kInside for
  // a page wholly its own (or the range could not be scanned), kHead / kTail for a first
  // / last page it shares with the memory before / after it; 0 for none. Every page of
  // every range is write-protected again, so the next scan reports writes from now on.
  // Ranges that share a page are scanned together, so one's write is seen by both.
  static constexpr uint8_t kInside = 1, kHead = 2, kTail = 4;
  std::vector<uint8_t> scan(const std::vector<Range>& ranges);

  pid_t pid() const { return pid_; }  // the process it was made in (a fork's child must make its own)

 private:
  int uffd_ = -1;
  int pagemap_ = -1;
  pid_t pid_;
  std::mutex mu_;
};

}  // namespace fw
