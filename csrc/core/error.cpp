#include "core/error.hpp"

#include <cstring>

namespace fw {

static std::string describe(int err, const std::string& op, const std::string& path, int64_t offset,
                            int64_t length) {
  std::string s = std::strerror(err);
  s += " (" + op;
  if (offset >= 0) s += " at offset " + std::to_string(offset);
  if (length >= 0) s += ", " + std::to_string(length) + " bytes";
  s += ")";
  if (!path.empty()) s += ": '" + path + "'";
  return s;
}

IoError::IoError(int err, std::string op, std::string path, int64_t offset, int64_t length)
    : std::runtime_error(describe(err, op, path, offset, length)),
      err_(err),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset),
      length_(length) {}

std::string IoError::detail() const {
  std::string s = std::strerror(err_);
  s += " (" + op_;
  if (offset_ >= 0) s += " at offset " + std::to_string(offset_);
  if (length_ >= 0) s += ", " + std::to_string(length_) + " bytes";
  return s + ")";
}

void throw_errno(int err, const std::string& op, const std::string& path, int64_t offset, int64_t length) {
  throw IoError(err, op, path, offset, length);
}

}  // namespace fw
