// Compressed saves (issue 38): a chunk of a file planned with byte planes is
// framed by the codec (core/codec.hpp) on the copy thread that queues its
// write, and the frame, padded to 4 KiB, is written at the chunk's own offset:
// the layout and the checksums (over the staged, uncompressed bytes) stay what
// they are uncompressed, and the rest of the chunk's span is a hole. A chunk
// zstd does not shrink by a page is written as staged. The frame holds the
// chunk's bytes, so the slot goes back (or is kept, hold_slots) once it is made.
//
// Frames come from a small recycled set (zmax_): a thread waits for one when
// every frame is queued behind a slow link, which paces compression to the
// writes without unbounded memory.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "core/codec.hpp"
#include "write/save_job.hpp"

namespace fw {

void SaveJob::init_compress() {
  bool any = false;
  for (const FileSpec& s : specs_) any |= !s.planes.empty();
  if (!any) return;
  if (!codec::unavailable().empty()) throw std::runtime_error("compress=\"zstd\": " + codec::unavailable());
  zwidth_.assign(plan_.chunks.size(), 0);
  zframe_.assign(plan_.chunks.size(), 0);
  zheld_.resize(plan_.chunks.size());
  zslot_.assign(plan_.chunks.size(), nullptr);
  zmax_ = defaults::kCompressFramesInFlight + opt_.copy_threads;
  for (size_t ci = 0; ci < plan_.chunks.size(); ++ci) {
    const Chunk& c = plan_.chunks[ci];
    const FileSpec& s = specs_[c.file];
    if (s.planes.empty()) continue;
    if (!s.link_from.empty()) throw std::invalid_argument("a held file cannot be compressed: " + s.path);
    // Where the writes set the size, the file's last chunk is written whole (plain).
    if (opt_.files->sized_by_writes() && c.file_offset + c.data_len >= s.size) continue;
    // Bytes of each width inside [file_offset, file_offset + data_len).
    uint64_t by_width[9] = {};
    const uint64_t lo = c.file_offset, hi = c.file_offset + c.data_len;
    auto it = std::upper_bound(s.planes.begin(), s.planes.end(), lo,
                               [](uint64_t off, const std::pair<uint64_t, unsigned>& r) { return off < r.first; });
    uint64_t pos = lo;
    unsigned width = it == s.planes.begin() ? 1 : std::prev(it)->second;
    for (; pos < hi; ++it) {
      const uint64_t end = it == s.planes.end() ? hi : std::min(hi, it->first);
      if (width > 8) throw std::invalid_argument("plane width must be 1, 2, 4 or 8");
      by_width[width] += end - pos;
      pos = end;
      if (it == s.planes.end()) break;
      width = it->second;
    }
    unsigned best = 1;
    for (unsigned w : {2u, 4u, 8u})
      if (by_width[w] > by_width[best]) best = w;
    zwidth_[ci] = static_cast<uint8_t>(best);
  }
}

char* SaveJob::slot_of(size_t ci) const { return zslot_.empty() || !zslot_[ci] ? requests_[ci].buf : zslot_[ci]; }

void SaveJob::wake_frames() {
  if (zwidth_.empty()) return;
  { std::lock_guard<std::mutex> lk(zmu_); }
  zcv_.notify_all();
}

// On a copy thread, before chunk ci's write is queued: its frame replaces the
// slot as the request's buffer when it is a page or more smaller.
bool SaveJob::compress_chunk(size_t ci) {
  const Chunk& c = plan_.chunks[ci];
  std::unique_ptr<AlignedBuffer> frame;
  {
    std::unique_lock<std::mutex> lk(zmu_);
    zcv_.wait(lk, [&] { return !zfree_.empty() || zmade_ < zmax_ || ctl_.cancelled() || failed(); });
    if (ctl_.cancelled() || failed()) {
      lk.unlock();
      if (slot_refs_[ci].load()) slot_done(ci);
      else return_slot(requests_[ci].buf, false);
      return false;
    }
    if (!zfree_.empty()) {
      frame = std::move(zfree_.back());
      zfree_.pop_back();
    } else {
      ++zmade_;
    }
  }
  try {
    if (!frame) frame = std::make_unique<AlignedBuffer>(round_up(codec::bound(pool_->slot_bytes()), kAlign));
    thread_local codec::Coder coder;
    const auto t0 = std::chrono::steady_clock::now();
    const size_t n = coder.compress(requests_[ci].buf, c.data_len, zwidth_[ci], opt_.compress_level, frame->data());
    zns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    const uint64_t len = round_up(n, kAlign);
    if (len >= c.write_len) {  // not worth a page: written as staged
      std::lock_guard<std::mutex> lk(zmu_);
      zfree_.push_back(std::move(frame));
      zcv_.notify_one();
      return true;
    }
    std::memset(frame->data() + n, 0, len - n);
    opt_.files->leave_holes(files_[c.file]->fd.load(), c.data_len - len);
    zframe_[ci] = n;
    zslot_[ci] = requests_[ci].buf;
    requests_[ci].buf = frame->data();
    zheld_[ci] = std::move(frame);
  } catch (...) {
    if (frame) {
      std::lock_guard<std::mutex> lk(zmu_);
      zfree_.push_back(std::move(frame));
      zcv_.notify_one();
    }
    if (slot_refs_[ci].load()) slot_done(ci);
    else return_slot(requests_[ci].buf, false);
    throw;
  }
  // The frame holds the chunk now: the write's share of the slot is done.
  if (slot_refs_[ci].load()) slot_done(ci);
  else return_slot(zslot_[ci], true);
  return true;
}

// Chunk ci's frame is written (or its write failed): back to the free frames.
void SaveJob::frame_written(size_t ci) {
  std::lock_guard<std::mutex> lk(zmu_);
  zfree_.push_back(std::move(zheld_[ci]));
  zcv_.notify_one();
}

std::vector<std::vector<uint64_t>> SaveJob::chunk_frames() const {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> by_file(specs_.size());
  for (size_t ci = 0; ci < plan_.chunks.size(); ++ci)
    by_file[plan_.chunks[ci].file].emplace_back(plan_.chunks[ci].file_offset, zframe_.empty() ? 0 : zframe_[ci]);
  std::vector<std::vector<uint64_t>> out(specs_.size());
  for (size_t f = 0; f < specs_.size(); ++f) {
    std::sort(by_file[f].begin(), by_file[f].end());
    for (auto& [off, n] : by_file[f]) out[f].push_back(n);
  }
  return out;
}

}  // namespace fw
