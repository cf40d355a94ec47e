#include "write/chunk_plan.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/aligned_buffer.hpp"

namespace fw {
namespace {

// Segment indices sorted by (file, offset), so each chunk's pieces are found by
// a sweep. Throws for a segment outside its file, or two that overlap.
std::vector<uint32_t> sorted_segments(const std::vector<uint64_t>& file_sizes, const std::vector<Segment>& segments) {
  const size_t nfiles = file_sizes.size();
  std::vector<uint32_t> order(segments.size());
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const auto &x = segments[a], &y = segments[b];
    return x.file != y.file ? x.file < y.file : x.offset < y.offset;
  });
  for (size_t i = 0; i < order.size(); ++i) {
    const Segment& s = segments[order[i]];
    if (s.file >= nfiles) throw std::invalid_argument("segment refers to file " + std::to_string(s.file) + " of " + std::to_string(nfiles));
    if (s.offset > file_sizes[s.file] || s.nbytes > file_sizes[s.file] - s.offset)
      throw std::invalid_argument("segment " + std::to_string(order[i]) + " ends past its file");
    if (i && s.nbytes) {
      // Compare against the previous non-empty segment of the same file.
      for (size_t j = i; j-- > 0;) {
        const Segment& p = segments[order[j]];
        if (p.file != s.file) break;
        if (!p.nbytes) continue;
        if (p.offset + p.nbytes > s.offset) throw std::invalid_argument("segments " + std::to_string(order[j]) + " and " + std::to_string(order[i]) + " overlap");
        break;
      }
    }
  }
  return order;
}

// Checksum slots: one per (segment, chunk it touches); segment i's start at [i].
std::vector<uint64_t> hash_starts(const std::vector<Segment>& segments, uint64_t chunk_bytes) {
  std::vector<uint64_t> start(segments.size() + 1, 0);
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    uint64_t n = s.nbytes ? (s.offset + s.nbytes - 1) / chunk_bytes - s.offset / chunk_bytes + 1 : 0;
    start[i + 1] = start[i] + n;
  }
  return start;
}

// File f's chunks, in order, each with its pieces (appended to plan.pieces).
// `seg_i` starts at f's first segment in `order`.
std::vector<Chunk> plan_file(uint32_t f, uint64_t size, const std::vector<Segment>& segments,
                             const std::vector<uint32_t>& order, size_t seg_i, uint64_t chunk_bytes, ChunkPlan& plan) {
  std::vector<Chunk> chunks;
  const uint64_t nchunks = (size + chunk_bytes - 1) / chunk_bytes;
  for (uint64_t k = 0; k < nchunks; ++k) {
    Chunk c{};
    c.file = f;
    c.file_offset = k * chunk_bytes;
    c.data_len = std::min<uint64_t>(chunk_bytes, size - c.file_offset);
    c.write_len = round_up(c.data_len, kAlign);
    c.first_piece = static_cast<uint32_t>(plan.pieces.size());
    uint64_t lo = c.file_offset, hi = c.file_offset + c.data_len, covered = 0;
    // Skip segments that end before this chunk.
    while (seg_i < order.size() && segments[order[seg_i]].file == f &&
           segments[order[seg_i]].offset + segments[order[seg_i]].nbytes <= lo)
      ++seg_i;
    for (size_t j = seg_i; j < order.size(); ++j) {
      const Segment& s = segments[order[j]];
      if (s.file != f || s.offset >= hi) break;
      if (!s.nbytes) continue;
      uint64_t a = std::max(lo, s.offset), b = std::min(hi, s.offset + s.nbytes);
      if (a >= b) continue;
      Piece p{};
      p.segment = order[j];
      p.src_offset = a - s.offset;
      p.chunk_offset = a - lo;
      p.len = b - a;
      p.hash_index = plan.segment_hash_start[order[j]] + (a / chunk_bytes - s.offset / chunk_bytes);
      covered += p.len;
      plan.pieces.push_back(p);
    }
    c.piece_count = static_cast<uint32_t>(plan.pieces.size() - c.first_piece);
    c.has_gaps = covered != c.data_len;
    chunks.push_back(c);
  }
  return chunks;
}

}  // namespace

ChunkPlan plan_chunks(const std::vector<uint64_t>& file_sizes, const std::vector<Segment>& segments,
                      uint64_t chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % kAlign) throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  const size_t nfiles = file_sizes.size();
  ChunkPlan plan;
  const std::vector<uint32_t> order = sorted_segments(file_sizes, segments);
  plan.segment_hash_start = hash_starts(segments, chunk_bytes);

  std::vector<std::vector<Chunk>> per_file(nfiles);
  size_t cursor = 0;
  for (uint32_t f = 0; f < nfiles; ++f) {
    while (cursor < order.size() && segments[order[cursor]].file < f) ++cursor;
    per_file[f] = plan_file(f, file_sizes[f], segments, order, cursor, chunk_bytes, plan);
  }

  // Round-robin across files so every stripe has requests in flight from the start.
  size_t maxn = 0;
  for (auto& v : per_file) maxn = std::max(maxn, v.size());
  for (size_t k = 0; k < maxn; ++k)
    for (auto& v : per_file)
      if (k < v.size()) plan.chunks.push_back(v[k]);
  return plan;
}

}  // namespace fw
