#include "write/stripe_layout.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <numeric>
#include <queue>
#include <stdexcept>

namespace fw {
namespace {

// The header's JSON between the parts that vary.
constexpr std::string_view kOpen = "{\"__metadata__\":", kDtype = "\":{\"dtype\":\"", kShape = "\",\"shape\":[",
                           kOffsets = "],\"data_offsets\":[", kClose = "]}";

size_t digits(uint64_t v) {
  size_t d = 1;
  while (v >= 10) v /= 10, ++d;
  return d;
}

// Which tensors go to which file: the largest to the lightest file so far (the
// first of equals); one file takes them all in order.
std::vector<LayoutFile> assign_members(const std::vector<LayoutTensor>& tensors, unsigned n) {
  const size_t count = tensors.size();
  std::vector<LayoutFile> files(n);
  if (n == 1) {
    files[0].members.resize(count);
    std::iota(files[0].members.begin(), files[0].members.end(), 0u);
    return files;
  }
  std::vector<uint32_t> order(count);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return tensors[a].nbytes > tensors[b].nbytes; });
  using Load = std::pair<uint64_t, unsigned>;  // (bytes so far, file): the lightest, then the first
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (unsigned i = 0; i < n; ++i) heap.push({0, i});
  for (uint32_t j : order) {
    auto [load, i] = heap.top();
    heap.pop();
    files[i].members.push_back(j);
    heap.push({load + tensors[j].nbytes, i});
  }
  return files;
}

// The JSON's exact length for these members, and each member's data offset
// (relative to the end of the header) in `rels`; `data` gets the data's bytes.
size_t header_json_bytes(const std::vector<LayoutTensor>& tensors, const std::vector<uint32_t>& idx,
                         const std::string& metadata_json, std::vector<uint64_t>& rels, uint64_t& data) {
  rels.reserve(idx.size());
  uint64_t rel = 0;
  size_t body = kOpen.size() + metadata_json.size() + 1;
  for (uint32_t j : idx) {
    const LayoutTensor& t = tensors[j];
    rels.push_back(rel);
    body += 1 + t.key.size() + (t.quoted ? 0 : 1) + kDtype.size() - (t.quoted ? 1 : 0) + t.code.size() +
            kShape.size() + t.shape.size() + kOffsets.size() + digits(rel) + 1 + digits(rel + t.nbytes) +
            kClose.size();
    rel += t.nbytes;
  }
  data = rel;
  return body;
}

// Writes the JSON at `out` (room for exactly its bytes); returns its end.
char* write_header_json(char* out, const std::vector<LayoutTensor>& tensors, const std::vector<uint32_t>& idx,
                        const std::string& metadata_json, const std::vector<uint64_t>& rels) {
  auto put = [&out](std::string_view sv) {
    std::memcpy(out, sv.data(), sv.size());
    out += sv.size();
  };
  auto number = [&out](uint64_t v) { out = std::to_chars(out, out + 24, v).ptr; };
  put(kOpen);
  put(metadata_json);
  for (size_t m = 0; m < idx.size(); ++m) {
    const LayoutTensor& t = tensors[idx[m]];
    put(t.quoted ? std::string_view(",") : std::string_view(",\""));
    put(t.key);
    put(t.quoted ? kDtype.substr(1) : kDtype);
    put(t.code);
    put(kShape);
    put(t.shape);
    put(kOffsets);
    number(rels[m]);
    *out++ = ',';
    number(rels[m] + t.nbytes);
    put(kClose);
  }
  *out++ = '}';
  return out;
}

// One file: its members ordered (largest elements first, the state's order
// within one element size), then its header made in place, sized exactly first:
// 8 bytes for its length, the JSON, then spaces up to the boundary (one
// allocation, no regrowth).
void lay_out_file(const std::vector<LayoutTensor>& tensors, const std::string& name, const std::string& metadata_json,
                  LayoutFile& f) {
  auto& idx = f.members;
  std::sort(idx.begin(), idx.end());
  std::stable_sort(idx.begin(), idx.end(),
                   [&](uint32_t a, uint32_t b) { return tensors[a].itemsize > tensors[b].itemsize; });
  std::vector<uint64_t> rels;
  uint64_t data = 0;
  const size_t body = header_json_bytes(tensors, idx, metadata_json, rels, data);
  const uint64_t padded = (8 + body + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign - 8;
  if (padded > kMaxHeaderBytes)
    throw std::invalid_argument(name + ": safetensors header would be " + std::to_string(padded) + " bytes (limit " +
                                std::to_string(kMaxHeaderBytes) + "); use more stripes");
  std::string& h = f.header;
  h.assign(8 + padded, ' ');
  char* out = h.data();
  for (int b = 0; b < 8; ++b) *out++ = static_cast<char>((padded >> (8 * b)) & 0xff);
  out = write_header_json(out, tensors, idx, metadata_json, rels);
  if (static_cast<size_t>(out - h.data()) != 8 + body) throw std::logic_error("layout_stripes: header size");
  const uint64_t hb = f.header.size();
  f.offsets.reserve(rels.size());
  for (uint64_t r : rels) f.offsets.push_back(hb + r);
  f.size = hb + data;
}

}  // namespace

std::vector<LayoutFile> layout_stripes(const std::vector<LayoutTensor>& tensors, const std::vector<std::string>& names,
                                       const std::string& metadata_json) {
  const unsigned n = static_cast<unsigned>(names.size());
  if (n == 0) throw std::invalid_argument("layout_stripes: no file names");
  std::vector<LayoutFile> files = assign_members(tensors, n);
  for (unsigned fi = 0; fi < n; ++fi) lay_out_file(tensors, names[fi], metadata_json, files[fi]);
  return files;
}

}  // namespace fw
