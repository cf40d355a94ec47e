// Errors that cross into Python. An OS failure keeps errno, the path and the
// file offset so the binding can raise the matching OSError subclass
// (FileNotFoundError, PermissionError, ENOSPC...) with full context.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fw {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string op, std::string path, int64_t offset = -1, int64_t length = -1);
  int err() const noexcept { return err_; }
  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  int64_t offset() const noexcept { return offset_; }
  int64_t length() const noexcept { return length_; }
  // strerror plus what was being done, without the path (Python adds it as filename).
  std::string detail() const;

 private:
  int err_;
  std::string op_, path_;
  int64_t offset_, length_;
};

// Malformed or inconsistent checkpoint data detected by native code.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_errno(int err, const std::string& op, const std::string& path,
                              int64_t offset = -1, int64_t length = -1);

}  // namespace fw
