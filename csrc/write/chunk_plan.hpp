// Chunk arithmetic for a save: each stripe file is cut into chunk_bytes-sized,
// 4 KiB-aligned pieces of its final image; every chunk gathers the parts of the
// segments (header bytes, tensor bytes) that fall inside it.
//
// A segment's bytes are checksummed per "piece" = segment ∩ chunk, so checksum
// boundaries sit at file offsets that are multiples of chunk_bytes and a reader
// can verify any chunk on its own and name the exact tensor that is damaged.
#pragma once
#include <cstdint>
#include <vector>

namespace fw {

struct Segment {
  const char* src;     // source bytes (contiguous); must outlive staging
  uint64_t nbytes;
  uint32_t file;       // stripe index
  uint64_t offset;     // absolute offset in the stripe file
  int32_t device = -1; // CUDA device index of `src`, or -1 for host memory
};

struct Piece {
  uint32_t segment;
  uint64_t src_offset;    // offset inside the segment
  uint64_t chunk_offset;  // offset inside the chunk
  uint64_t len;
  uint64_t hash_index;    // where its checksum goes in the flat checksum array
};

struct Chunk {
  uint32_t file;
  uint64_t file_offset;   // multiple of chunk_bytes
  uint64_t data_len;      // bytes of file image in this chunk (tail chunk may be short)
  uint64_t write_len;     // data_len rounded up to 4 KiB (O_DIRECT); the file is truncated after
  uint32_t first_piece, piece_count;
  bool has_gaps;          // some bytes are not covered by any segment: zero them
};

struct ChunkPlan {
  std::vector<Chunk> chunks;             // ordered round-robin across files
  std::vector<Piece> pieces;
  std::vector<uint64_t> segment_hash_start;  // size = segments + 1
};

// Throws std::invalid_argument when segments overlap, leave their file, or
// sizes are inconsistent.
ChunkPlan plan_chunks(const std::vector<uint64_t>& file_sizes, const std::vector<Segment>& segments,
                      uint64_t chunk_bytes);

}  // namespace fw
