// Where each tensor goes: stripe files, each a valid safetensors file (plan.py's layout).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fw {

// Views into strings the caller keeps alive for the call.
struct LayoutTensor {
  std::string_view key;  // as JSON string content (escaped where needed)
  bool quoted = false;   // key is a whole JSON string already, quotes included
  std::string_view code;   // safetensors dtype code
  std::string_view shape;  // the stored shape as JSON list items, e.g. "4096,1024"
  uint64_t nbytes;
  unsigned itemsize;     // element size: larger first keeps every tensor aligned
};

struct LayoutFile {
  std::string header;             // 8-byte length, JSON, spaces up to a 4 KiB boundary
  uint64_t size = 0;              // header and data
  std::vector<uint32_t> members;  // indices into the tensors, in file order
  std::vector<uint64_t> offsets;  // absolute offset of each member in the file
};

constexpr uint64_t kHeaderAlign = 4096;
constexpr uint64_t kMaxHeaderBytes = 100ull * 1024 * 1024;  // safetensors' own limit

// Balances bytes over `names.size()` files (largest tensor to the lightest file;
// equal sizes keep the state's order), then lays each file out: largest elements
// first, the state's order within one element size, no holes. metadata_json is the
// "__metadata__" object. Throws std::invalid_argument (naming the file) when a
// header grows past kMaxHeaderBytes.
std::vector<LayoutFile> layout_stripes(const std::vector<LayoutTensor>& tensors, const std::vector<std::string>& names,
                                       const std::string& metadata_json);

}  // namespace fw
