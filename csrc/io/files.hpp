// File-level system calls with errno-carrying errors. O_DIRECT is tried first;
// where the file system refuses it (EINVAL) the file is opened buffered and the
// caller is told, so it can fsync and report it.
#pragma once
#include <cstdint>
#include <string>

namespace fw {

struct OpenedFile {
  int fd = -1;
  bool direct = false;
};

// Creates a new file (fails if it exists). direct=true tries O_DIRECT first.
OpenedFile open_for_write(const std::string& path, bool direct);
// Reopens an existing file for writing without O_DIRECT (EINVAL fallback on write).
int reopen_buffered_for_write(const std::string& path);
OpenedFile open_for_read(const std::string& path, bool direct);

// Reserve space up front: ENOSPC shows up before any data moves, and extents
// are allocated contiguously. Silently skipped where unsupported (network file systems, some FUSE).
void preallocate(int fd, uint64_t bytes, const std::string& path);
void truncate_to(int fd, uint64_t bytes, const std::string& path);
void fsync_fd(int fd, const std::string& path);
void fsync_dir(const std::string& path);
void close_fd(int fd);
uint64_t file_size(int fd, const std::string& path);

// Atomically swaps two paths (renameat2 RENAME_EXCHANGE). Returns false where the
// file system does not support it; throws on other errors.
bool rename_exchange(const std::string& a, const std::string& b);

// Whether a file in `dir` can be opened and written with O_DIRECT.
bool probe_direct(const std::string& dir);

}  // namespace fw
