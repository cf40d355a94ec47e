#include "write/stripe_layout.hpp"

#include <algorithm>
#include <charconv>
#include <numeric>
#include <queue>
#include <stdexcept>

namespace fw {

std::vector<LayoutFile> layout_stripes(const std::vector<LayoutTensor>& tensors, const std::vector<std::string>& names,
                                       const std::string& metadata_json) {
  const size_t count = tensors.size();
  const unsigned n = static_cast<unsigned>(names.size());
  if (n == 0) throw std::invalid_argument("layout_stripes: no file names");
  std::vector<LayoutFile> files(n);
  if (n == 1) {
    files[0].members.resize(count);
    std::iota(files[0].members.begin(), files[0].members.end(), 0u);
  } else {
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
  }

  for (unsigned fi = 0; fi < n; ++fi) {
    LayoutFile& f = files[fi];
    auto& idx = f.members;
    std::sort(idx.begin(), idx.end());
    std::stable_sort(idx.begin(), idx.end(),
                     [&](uint32_t a, uint32_t b) { return tensors[a].itemsize > tensors[b].itemsize; });
    // The header is made in place: 8 bytes for its length, the JSON, then spaces.
    std::string& h = f.header;
    size_t guess = 8 + 16 + metadata_json.size() + 2;
    for (uint32_t j : idx) guess += tensors[j].key.size() + tensors[j].shape.size() + 80;
    h.reserve(guess + kHeaderAlign);
    h.assign(8, '\0');
    h += "{\"__metadata__\":";
    h += metadata_json;
    std::vector<uint64_t> rels;
    rels.reserve(idx.size());
    uint64_t rel = 0;
    auto number = [&h](uint64_t v) {
      char num[24];
      h.append(num, std::to_chars(num, num + sizeof num, v).ptr);
    };
    for (uint32_t j : idx) {
      const LayoutTensor& t = tensors[j];
      h += t.quoted ? "," : ",\"";
      h += t.key;
      h += t.quoted ? ":{" : "\":{";
      h += "\"dtype\":\"";
      h += t.code;
      h += "\",\"shape\":[";
      h += t.shape;
      h += "],\"data_offsets\":[";
      number(rel);
      h += ',';
      number(rel + t.nbytes);
      h += "]}";
      rels.push_back(rel);
      rel += t.nbytes;
    }
    h += '}';
    const uint64_t body = h.size() - 8;
    const uint64_t padded = (8 + body + kHeaderAlign - 1) / kHeaderAlign * kHeaderAlign - 8;
    if (padded > kMaxHeaderBytes)
      throw std::invalid_argument(names[fi] + ": safetensors header would be " + std::to_string(padded) +
                                  " bytes (limit " + std::to_string(kMaxHeaderBytes) + "); use more stripes");
    for (int b = 0; b < 8; ++b) h[b] = static_cast<char>((padded >> (8 * b)) & 0xff);
    h.append(padded - body, ' ');
    const uint64_t hb = f.header.size();
    f.offsets.reserve(rels.size());
    for (uint64_t r : rels) f.offsets.push_back(hb + r);
    f.size = hb + rel;
  }
  return files;
}

}  // namespace fw
