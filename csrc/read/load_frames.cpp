// The compressed chunks of a load (issue 38): a framed chunk's frame is read,
// padded to 4 KiB, from the chunk's own offset into a per-file buffer of frames,
// then decoded by a worker into where the plain chunk would have been read
// (the file's buffer, or a placer's bounce slot), and verified there: the
// checksums are over the uncompressed bytes, as in a plain checkpoint.
#include <stdexcept>
#include <string>

#include "core/codec.hpp"
#include "core/error.hpp"
#include "read/load_job.hpp"

namespace fw {

uint64_t LoadJob::raw_len(size_t i) const {
  if (!framed(i)) return requests_[i].want;  // a plain request may be shorter than a chunk (add_requests)
  const uint64_t size = specs_[file_of_request_[i]].size, off = requests_[i].offset;
  return std::min<uint64_t>(opt_.chunk_bytes, size - off);
}

void LoadJob::init_frames() {
  bool any = false;
  for (auto& f : opt_.frames) any |= !f.empty();
  if (!any) return;
  if (opt_.frames.size() != specs_.size()) throw std::invalid_argument("frames: one list per file");
  if (!codec::unavailable().empty())
    throw std::runtime_error("this checkpoint is compressed (zstd): " + codec::unavailable());
  zframe_.assign(requests_.size(), 0);
  zdst_.assign(requests_.size(), nullptr);
  std::vector<uint64_t> packed(specs_.size(), 0);
  for (uint32_t f = 0; f < specs_.size(); ++f) {
    const auto& fr = opt_.frames[f];
    if (fr.empty()) continue;
    const uint64_t chunks = (specs_[f].size + opt_.chunk_bytes - 1) / opt_.chunk_bytes;
    if (fr.size() != chunks)
      throw FormatError("'" + specs_[f].path + "': the manifest lists " + std::to_string(fr.size()) +
                        " compressed chunks, the file has " + std::to_string(chunks));
  }
  // Each frame must fit the span of its chunk (the reader never reads past it).
  for (size_t i = 0; i < requests_.size(); ++i) {
    const uint32_t f = file_of_request_[i];
    if (opt_.frames[f].empty()) continue;
    const uint64_t n = opt_.frames[f][requests_[i].offset / opt_.chunk_bytes];
    if (!n) continue;
    if (n < codec::kHeaderBytes || round_up(n, kAlign) > round_up(raw_len(i), kAlign))
      throw FormatError("'" + specs_[f].path + "': compressed chunk at offset " + std::to_string(requests_[i].offset) +
                        " has a frame of " + std::to_string(n) + " bytes, outside its chunk");
    zframe_[i] = n;
    packed[f] += round_up(n, kAlign);
  }
  for (uint32_t f = 0; f < specs_.size(); ++f)
    zbuf_.push_back(packed[f] ? std::make_unique<AlignedBuffer>(packed[f], /*populate=*/true) : nullptr);
  std::vector<uint64_t> pos(specs_.size(), 0);
  for (size_t i = 0; i < requests_.size(); ++i) {
    if (!zframe_[i]) continue;
    IoRequest& r = requests_[i];
    const uint32_t f = file_of_request_[i];
    zdst_[i] = r.buf;  // the file's buffer there; a placer slot (set at submit) otherwise
    r.buf = zbuf_[f]->data() + pos[f];
    r.want = zframe_[i];
    r.len = round_up(zframe_[i], kAlign);
    pos[f] += r.len;
  }
}

// On a worker: the frame of request i into its destination. A malformed frame
// fails the load with the file and the chunk's offset.
bool LoadJob::decode(size_t i) {
  thread_local codec::Coder coder;
  const uint32_t f = file_of_request_[i];
  try {
    coder.decompress(requests_[i].buf, zframe_[i], zdst_[i], raw_len(i));
    return true;
  } catch (const std::exception& e) {
    fail(std::make_exception_ptr(FormatError("'" + specs_[f].path + "' at offset " +
                                             std::to_string(requests_[i].offset) + ": " + e.what())));
    return false;
  }
}

}  // namespace fw
