// The staging half of a save (save_job.cpp has the life cycle and the writes):
// copy threads copy host chunks into pool slots and checksum them, a D2H thread
// issues the GPU chunks' copies, and every chunk's write is queued once its
// bytes are in its slot.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/checksum.hpp"
#include "core/stream_copy.hpp"
#include "write/save_job.hpp"

namespace fw {

// Zeroes the bytes of a slot that no piece fills: the aligned tail, or all of it
// when the chunk has gaps.
static void zero_unfilled(const Chunk& c, char* slot) {
  if (c.has_gaps)
    std::memset(slot, 0, c.write_len);
  else if (c.write_len > c.data_len)
    std::memset(slot + c.data_len, 0, c.write_len - c.data_len);
}

void SaveJob::copy_host_chunk(size_t ci, char* slot, bool hash) {
  const Chunk& c = plan_.chunks[ci];
  zero_unfilled(c, slot);
  for (uint32_t i = 0; i < c.piece_count; ++i) {
    const Piece& p = plan_.pieces[c.first_piece + i];
    const char* src = segments_[p.segment].src + p.src_offset;
    if (hash)
      hashes_[p.hash_index] = copy_and_checksum(slot + p.chunk_offset, src, p.len);
    else
      stream_copy(slot + p.chunk_offset, src, p.len);
  }
  requests_[ci].buf = slot;
}

// A deferred chunk, from its slot (its write may be in flight: both only read).
void SaveJob::hash_host_chunk(size_t ci) {
  const Chunk& c = plan_.chunks[ci];
  const char* slot = slot_of(ci);
  for (uint32_t i = 0; i < c.piece_count; ++i) {
    const Piece& p = plan_.pieces[c.first_piece + i];
    hashes_[p.hash_index] = checksum(slot + p.chunk_offset, p.len);
  }
}

// A compressed save's deferred chunks, once staging is over: checksummed, then
// compressed and queued (compressing while staging would lengthen the stall).
// Whatever ends the thread first, the slots not handed to write_chunk go back.
void SaveJob::write_staged(std::vector<size_t>& unwritten) {
  while (!unwritten.empty()) {
    if (ctl_.cancelled() || failed()) return;
    const size_t ci = unwritten.back();
    hash_host_chunk(ci);
    unwritten.pop_back();
    write_chunk(ci);
  }
}

// Copy threads stage the chunks that live in host memory and checksum the
// device chunks once their bytes have landed, then queue each chunk's write
// (the backend never blocks a submit, so the disk never holds up staging).
//
// A copy thread waiting for a free slot stops waiting when a device chunk
// lands: landed chunks are written only by copy threads, and their slots may be
// the very ones it waits for (with a bounded pool and a state mixing GPU and
// CPU tensors, every slot can hold such a chunk).
void SaveJob::copy_worker() {
  const bool gpu = !device_chunks_.empty();
  std::function<bool()> interrupt;
  if (gpu) interrupt = [this] { return has_landed(); };
  size_t claimed = SIZE_MAX;  // a host chunk this thread owns but has no slot for yet
  // Chunks this thread copied and has yet to checksum (defer_hash_). Whatever
  // ends the thread, each gives up its share of the slot.
  std::vector<size_t> unhashed;
  struct Unhashed {
    SaveJob* job;
    std::vector<size_t>& list;
    ~Unhashed() {
      for (size_t ci : list) job->slot_done(ci);
    }
  } unhashed_guard{this, unhashed};
  std::vector<size_t> unwritten;  // deferred chunks of a compressed file (write_staged)
  struct Unwritten {
    SaveJob* job;
    std::vector<size_t>& list;
    ~Unwritten() {
      for (size_t ci : list) job->return_slot(job->requests_[ci].buf, false);
    }
  } unwritten_guard{this, unwritten};
  try {
    for (;;) {
      if (ctl_.cancelled()) return;
      if (gpu && write_landed_chunk()) continue;
      if (claimed != SIZE_MAX || next_chunk_.load() < host_chunks_.size()) {
        stage_host_chunk(claimed, interrupt, unhashed, unwritten);
        continue;
      }
      // Every host chunk is staged: checksum this thread's own, from the slots.
      if (!hash_own_chunks(unhashed)) return;
      write_staged(unwritten);
      if (!unwritten.empty()) return;
      if (!gpu) return;
      // Only device chunks are left: wait for the next one to land.
      std::unique_lock<std::mutex> lk(ctl_.mutex());
      work_cv_.wait(lk, [&] { return !landed_.empty() || d2h_done_ || ctl_.cancelled(); });
      if (landed_.empty()) return;
    }
  } catch (...) {
    fail(std::current_exception());
  }
}

// The oldest landed device chunk, if any: its GPU pieces checksummed from the
// slot, then its write queued. False when none has landed.
bool SaveJob::write_landed_chunk() {
  size_t ci;
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    if (landed_.empty()) return false;
    ci = landed_.front();
    landed_.pop_front();
    --landed_count_;
  }
  const Chunk& c = plan_.chunks[ci];
  const char* slot = requests_[ci].buf;
  for (uint32_t i = 0; i < c.piece_count; ++i) {
    const Piece& p = plan_.pieces[c.first_piece + i];
    if (segments_[p.segment].device >= 0) hashes_[p.hash_index] = checksum(slot + p.chunk_offset, p.len);
  }
  chunk_ready(ci);
  return true;
}

// The chunk first, then a slot: a thread that waited for a slot before it knew
// a chunk was left could wait for good when the save holds its slots
// (hold_slots: none comes back) and another thread took the last chunk. A slot
// wait that ends without one (cancelled, or a landed chunk to write first)
// keeps the claim in `claimed`.
void SaveJob::stage_host_chunk(size_t& claimed, const std::function<bool()>& interrupt,
                               std::vector<size_t>& unhashed, std::vector<size_t>& unwritten) {
  if (claimed == SIZE_MAX) {
    claimed = next_chunk_.fetch_add(1);
    if (claimed >= host_chunks_.size()) {
      claimed = SIZE_MAX;
      return;
    }
  }
  char* slot = pool_->acquire(&ctl_.cancel_flag(), interrupt, &staging_wait_);
  if (!slot) return;
  const size_t ci = host_chunks_[claimed];
  claimed = SIZE_MAX;
  // A held chunk is checksummed as it is copied: its file is decided by them.
  const bool defer = defer_hash_ && !is_held(ci);
  copy_host_chunk(ci, slot, !defer);
  if (defer && !zwidth_.empty() && zwidth_[ci]) {
    unwritten.push_back(ci);
    chunk_staged();
    return;
  }
  if (defer) {
    slot_refs_[ci].store(2);
    unhashed.push_back(ci);
  }
  chunk_staged();
  chunk_ready(ci);
}

// This thread's deferred checksums, newest first; false when cancelled meanwhile.
bool SaveJob::hash_own_chunks(std::vector<size_t>& unhashed) {
  if (test_hash_delay_ms_ > 0 && !unhashed.empty())
    std::this_thread::sleep_for(std::chrono::milliseconds(test_hash_delay_ms_));
  while (!unhashed.empty()) {
    if (ctl_.cancelled()) return false;
    const size_t ci = unhashed.back();
    hash_host_chunk(ci);
    unhashed.pop_back();
    slot_done(ci);
  }
  return true;
}

void SaveJob::stage_device_chunks() {
  std::unique_ptr<CopyPipeline> pipe;
  try {
    // Enough batches in flight to keep the copy engine busy while the oldest
    // chunks are checksummed and written.
    pipe = std::make_unique<CopyPipeline>(opt_.copy_streams, CopyDirection::DeviceToHost, defaults::kD2hBatchesInFlight);
    pipe->order_after(opt_.wait_streams);
  } catch (...) {
    fail(std::current_exception());
  }
  // start() returns once fenced_: every copy is enqueued and the callers'
  // streams wait for them, so what the caller queues next cannot tear the
  // snapshot (with a pool smaller than the save, that is once the last chunk
  // got a slot: the caller's thread waits for the writes that free them).
  auto fence = [this] {
    {
      std::lock_guard<std::mutex> lk(ctl_.mutex());
      if (fenced_) return;
      fenced_ = true;
    }
    ctl_.notify();
  };
  if (!pipe) fence();
  if (pipe) {
    try {
      std::vector<DeviceCopy> copies;
      for (size_t ci : device_chunks_) {
        if (ctl_.cancelled() || pipe->failed()) break;
        char* slot = pool_->acquire(&ctl_.cancel_flag(), {}, &staging_wait_);
        if (!slot) break;
        const Chunk& c = plan_.chunks[ci];
        zero_unfilled(c, slot);
        copies.clear();
        for (uint32_t i = 0; i < c.piece_count; ++i) {
          const Piece& p = plan_.pieces[c.first_piece + i];
          const Segment& sg = segments_[p.segment];
          if (sg.device < 0)  // a header or a CPU tensor sharing the chunk
            hashes_[p.hash_index] = copy_and_checksum(slot + p.chunk_offset, sg.src + p.src_offset, p.len);
          else
            copies.push_back(DeviceCopy{sg.device, slot + p.chunk_offset, sg.src + p.src_offset, p.len});
        }
        requests_[ci].buf = slot;
        pipe->issue(copies, [this, ci](bool ok) { landed(ci, ok); });
      }
      // A failed save needs no order (and its first error is the copy's).
      if (!pipe->failed() && !ctl_.cancelled()) pipe->order_before(opt_.wait_streams);
    } catch (...) {
      fail(std::current_exception());
    }
    fence();
    try {
      pipe->finish();  // every issued copy has landed (or failed) after this
    } catch (...) {
      fail(std::current_exception());
    }
  }
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    d2h_done_ = true;
  }
  work_cv_.notify_all();
}

// On the copy pipeline's thread: the chunk's GPU bytes are in its slot.
void SaveJob::landed(size_t ci, bool ok) {
  if (!ok || ctl_.cancelled()) {
    pool_->release(requests_[ci].buf);
    return;
  }
  chunk_staged();
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    landed_.push_back(ci);
    ++landed_count_;
  }
  work_cv_.notify_one();
  pool_->wake();  // a copy thread waiting for a slot writes this chunk first
}

void SaveJob::chunk_staged() {
  // The last chunk's bytes are in the pool: nothing reads the sources any more
  // (checksums of deferred chunks read the slots).
  if (unstaged_.fetch_sub(1) == 1) mark_staged();
}

void SaveJob::mark_staged() {
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    if (staged_) return;
    staged_s_ = since_start();
    staged_ = true;
  }
  ctl_.notify();
}

}  // namespace fw
