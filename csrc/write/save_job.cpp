#include "write/save_job.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "core/error.hpp"
#include "io/files.hpp"

namespace fw {

SaveJob::SaveJob(std::shared_ptr<StagingPool> pool, std::vector<FileSpec> files, std::vector<Segment> segments,
                 SaveOptions opt)
    : pool_(std::move(pool)), specs_(std::move(files)), segments_(std::move(segments)), opt_(opt) {
  if (!opt_.files) throw std::invalid_argument("a save job needs the files of its target");
  user_segments_ = segments_.size();
  if (const char* d = std::getenv("FLASHWRITE_TEST_DEFER_HASH_DELAY_MS")) test_hash_delay_ms_ = std::atoi(d);
  std::vector<uint64_t> sizes;
  for (uint32_t f = 0; f < specs_.size(); ++f) {
    const FileSpec& s = specs_[f];
    if (s.header.size() > s.size) throw std::invalid_argument("header of '" + s.path + "' is larger than the file");
    if (!s.header.empty()) segments_.push_back(Segment{s.header.data(), s.header.size(), f, 0});
    sizes.push_back(s.size);
    bytes_total_ += s.size;
  }
  plan_ = plan_chunks(sizes, segments_, pool_->slot_bytes());
  hashes_.assign(plan_.segment_hash_start.back(), 0);
  requests_.resize(plan_.chunks.size());
  if (opt_.copy_threads == 0) opt_.copy_threads = 1;
  for (size_t ci = 0; ci < plan_.chunks.size(); ++ci) {
    const Chunk& c = plan_.chunks[ci];
    bool on_device = false;
    for (uint32_t i = 0; i < c.piece_count; ++i) {
      const Piece& p = plan_.pieces[c.first_piece + i];
      if (segments_[p.segment].device >= 0) {
        on_device = true;
        device_bytes_ += p.len;
      }
    }
    (on_device ? device_chunks_ : host_chunks_).push_back(ci);
  }
  unstaged_ = plan_.chunks.size();
  // A bounded pool smaller than the save reuses slots within it: no whole image.
  hold_ = opt_.hold_slots && (pool_->max_slots() == 0 || plan_.chunks.size() <= pool_->max_slots());
  if (!device_chunks_.empty() && !opt_.copy_streams)
    throw std::invalid_argument("segments on a GPU need the engine's CUDA copy streams");
  init_held();
  init_compress();
}

SaveJob::~SaveJob() {
  // Here, not in ctl_'s destructor: the control thread uses members declared after ctl_.
  if (ctl_.started()) {
    cancel();
    ctl_.wait(-1);
  }
  release_slots();
}

void SaveJob::release_slots() {
  std::vector<char*> held;
  {
    std::lock_guard<std::mutex> lk(held_mu_);
    held.swap(held_);
  }
  for (char* p : held) pool_->release(p);
}

bool SaveJob::wait_checksummed(double timeout_s) {
  if (!ctl_.wait_until(checksummed_, timeout_s)) return false;
  return true;
}

std::vector<ChunkSlot> SaveJob::chunk_slots() const {
  std::vector<ChunkSlot> out;
  out.reserve(plan_.chunks.size());
  for (size_t ci = 0; ci < plan_.chunks.size(); ++ci) {
    const Chunk& c = plan_.chunks[ci];
    out.push_back(ChunkSlot{c.file, c.file_offset, c.data_len, pool_->slot_file_offset(slot_of(ci))});
  }
  return out;
}

void SaveJob::start() {
  t0_ = std::chrono::steady_clock::now();
  // Open, preallocate and create the backend here, on the caller's thread, so
  // a missing directory, a permission problem or a full disk is raised by
  // save_async itself instead of surfacing later.
  try {
    for (size_t i = 0; i < specs_.size(); ++i) {
      auto f = std::make_unique<File>();
      f->path = specs_[i].path;
      f->size = specs_[i].size;
      files_.push_back(std::move(f));
      if (!held_files_[i]) open_file(i);  // a held file is created only if it is written
    }
    IoCallback cb = [this](IoRequest* r, int64_t res) { on_io(r, res); };
    backend_ = opt_.files->backend(opt_.queue_depth, cb);
    backend_name_ = backend_->name();
    // A slot for every chunk, on top of what other saves staging now on this
    // pool reserved: then no copy waits for another chunk's checksum, and the
    // checksums can wait until staging is over (each chunk keeps its slot until
    // then). Else each chunk is checksummed as it is copied, and slots recycle.
    // A GPU save leaves the growth (faulting in, pinning) to a thread of its
    // own (run()): its caller does neither, and the D2H copies start into the
    // first slab while the next ones are still being pinned.
    const auto wait0 = std::chrono::steady_clock::now();
    const double pin0 = pool_->pin_seconds();
    const uint64_t cap0 = pool_->capacity_bytes();
    grow_later_ = !device_chunks_.empty();
    const bool all = pool_->reserve(plan_.chunks.size(), /*hold=*/true, opt_.abort.get(), grow_later_ ? &grow_slots_ : nullptr);
    defer_hash_ = all && !opt_.hash_while_copying;
    reserved_ = true;
    // Slabs still to be pinned (made by CPU saves) are kept from the copies
    // until the grower has pinned them.
    if (grow_later_) pool_->claim_unpinned();
    pool_wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait0).count();
    const double pinned_s = std::min(pool_wait_s_, pool_->pin_seconds() - pin0);
    staging_wait_.add("pin", pinned_s);
    staging_wait_.add(pool_->capacity_bytes() > cap0 ? "fault-in" : "pool busy", pool_wait_s_ - pinned_s);
    // A held file keeps its slots until all of its chunks are staged: only safe
    // when the pool has a slot for every chunk of the save.
    holding_ = all;
    if (!holding_) stop_holding();
    slot_refs_.reset(new std::atomic<uint8_t>[plan_.chunks.size()]());
    ctl_.start([this] { run(); });
  } catch (...) {
    if (reserved_ && grow_later_) {
      // The growth and the pinning left to run() are given up.
      std::atomic<bool> stop{true};
      pool_->pin_existing(&stop);
      try {
        pool_->grow(grow_slots_, &stop);
      } catch (...) {
      }
    }
    if (reserved_) pool_->unreserve(plan_.chunks.size());
    reserved_ = false;
    backend_.reset();
    for (auto& f : files_) opt_.files->close(f->fd.load());
    files_.clear();
    throw;
  }
  if (!device_chunks_.empty()) {
    // Return only once the copies are ordered both ways: after the work queued
    // so far on the callers' streams, and before what they queue next (the
    // next optimizer step waits on the GPU for the snapshot's copies).
    std::unique_lock<std::mutex> lk(ctl_.mutex());
    ctl_.cv().wait(lk, [&] { return fenced_ || ctl_.done(); });
  }
}

void SaveJob::open_file(size_t i) {
  File& f = *files_[i];
  OpenedFile of = opt_.files->create(f.path, f.size);
  f.fd = of.fd;
  f.direct = of.direct;
  try {
    // A compressed stripe is not reserved: its frames are written at their chunks' offsets,
    // and the gaps after them, preallocated, took as much disk space as a plain save (issue
    // 45 item 4); left as holes, the space compression saves is really saved.
    if (specs_[i].planes.empty()) opt_.files->reserve(of.fd, f.path, f.size);
  } catch (const IoError& e) {
    // Out of space is the save's failure (reported by its future, like a
    // write that hits ENOSPC), not a bad argument: record it and let the
    // job finish at once.
    if (e.err() != ENOSPC && e.err() != EDQUOT) throw;
    fail(std::current_exception());
  }
}

double SaveJob::since_start() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

// Both wake every wait of the job's threads: the copy threads' work_cv_ and
// any acquire() on the pool (which would otherwise see the flag within 20 ms).
void SaveJob::fail(std::exception_ptr e) {
  ctl_.fail(std::move(e));
  { std::lock_guard<std::mutex> lk(ctl_.mutex()); }
  work_cv_.notify_all();
  pool_->wake();
  wake_frames();
}

void SaveJob::cancel() {
  ctl_.cancel();
  { std::lock_guard<std::mutex> lk(ctl_.mutex()); }
  work_cv_.notify_all();
  pool_->wake();
  wake_frames();
}

bool SaveJob::has_landed() const { return landed_count_.load() > 0; }

// A chunk is done with its slot: kept for the snapshot (hold_slots, once written)
// or back to the pool.
void SaveJob::return_slot(char* buf, bool written) {
  if (hold_ && written) {
    std::lock_guard<std::mutex> lk(held_mu_);
    held_.push_back(buf);
    return;
  }
  pool_->release(buf);
}

// The write or the checksum of a deferred chunk is over; the last one frees the slot.
void SaveJob::slot_done(size_t ci) {
  if (slot_refs_[ci].fetch_sub(1) == 1) return_slot(slot_of(ci), true);
}

void SaveJob::write_chunk(size_t ci) {
  if (!zwidth_.empty() && zwidth_[ci] && !compress_chunk(ci)) return;  // cancelled: nothing to write
  IoRequest& r = requests_[ci];
  const Chunk& c = plan_.chunks[ci];
  const bool framed = !zframe_.empty() && zframe_[ci];
  r.fd = files_[c.file]->fd.load();
  r.len = framed ? round_up(zframe_[ci], kAlign) : c.write_len;
  r.offset = c.file_offset;
  r.write = true;
  r.done = 0;
  r.tag = ci;
  r.cancel = &ctl_.cancel_flag();
  try {
    backend_->submit(&r);
  } catch (...) {
    // Not queued (the backends throw only before they take the request): the
    // write's share of the slot goes back here, as on_io would have given it.
    if (framed)
      frame_written(ci);
    else if (slot_refs_[ci].load())
      slot_done(ci);
    else
      return_slot(r.buf, false);
    throw;
  }
}

void SaveJob::on_io(IoRequest* r, int64_t res) {
  const Chunk& c = plan_.chunks[r->tag];
  bool written = false;
  File& f = *files_[c.file];
  if (res == -EINVAL && (f.direct.load() || r->fd != f.fd.load())) {
    // The file system took O_DIRECT at open but refuses the write: switch this
    // stripe to buffered I/O (fsync'd at the end) and retry the request. Other
    // writes already in flight on the direct fd fail the same way after the
    // switch (r->fd is then the old fd): they are retried too.
    try {
      std::lock_guard<std::mutex> lk(fallback_mu_);
      if (f.direct.load()) {
        const int buffered = opt_.files->reopen_buffered(f.path, /*write=*/true);
        if (buffered < 0) std::rethrow_exception(opt_.files->error(r, res, f.path));  // nothing to fall back to
        f.direct_fd = f.fd.load();
        f.fd = buffered;
        f.direct = false;
      }
      r->fd = f.fd.load();
      r->done = 0;
      backend_->resubmit(r);
      return;
    } catch (...) {
      fail(std::current_exception());
    }
  } else if (res < 0) {
    fail(opt_.files->error(r, res, f.path));
  } else {
    bytes_written_ += c.data_len;
    zstored_ += r->len;
    written = true;
  }
  if (!zframe_.empty() && zframe_[r->tag])
    frame_written(r->tag);  // the slot went back when the frame was made
  else if (slot_refs_[r->tag].load())
    slot_done(r->tag);  // the checksum may still be reading it
  else
    return_slot(r->buf, written);
}

void SaveJob::finish_files() {
  for (auto& f : files_) {
    if (f->fd.load() < 0) continue;  // a held file that was linked, not written
    opt_.files->finish(f->fd, f->path, f->size);
  }
}

void SaveJob::run() {
  // A thread that cannot be started must not escape this one (that would
  // terminate the process): the save fails, or runs with fewer copy threads.
  std::thread d2h;
  if (!device_chunks_.empty()) {
    try {
      d2h = std::thread([this] { stage_device_chunks(); });
    } catch (...) {
      fail(std::current_exception());
      std::lock_guard<std::mutex> lk(ctl_.mutex());
      d2h_done_ = true;
    }
  }
  // The pool's growth for a GPU save: slabs made before pinning was on are
  // pinned, then the new ones grown, each handed out as soon as it is ready.
  std::thread grower;
  if (grow_later_) {
    auto grow = [this] {
      try {
        double p = pool_->pin_existing(&ctl_.cancel_flag());
        p += pool_->grow(grow_slots_, &ctl_.cancel_flag());
        grow_pin_s_ = p;
      } catch (...) {
        fail(std::current_exception());  // no slot will come: the copy threads stop
      }
    };
    try {
      grower = std::thread(grow);
    } catch (...) {
      grow();  // no thread to spare: grown here, before the copies
    }
  }
  std::vector<std::thread> workers;
  try {
    for (unsigned i = 0; i < opt_.copy_threads; ++i) workers.emplace_back([this] { copy_worker(); });
  } catch (...) {
    if (workers.empty()) fail(std::current_exception());
  }
  if (workers.empty()) copy_worker();  // returns at once after a failure
  if (d2h.joinable()) d2h.join();  // every GPU copy has landed or failed
  for (auto& t : workers) t.join();
  if (grower.joinable()) grower.join();
  {
    // Chunks that landed after a failure stopped the workers give their slots back.
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    for (size_t ci : landed_) pool_->release(requests_[ci].buf);
    landed_.clear();
    landed_count_ = 0;
  }
  release_parked();  // held files left undecided by a failure or a cancel
  if (!failed() && !ctl_.cancelled()) {
    // The copy threads computed every checksum before they returned.
    {
      std::lock_guard<std::mutex> lk(ctl_.mutex());
      checksummed_ = true;
    }
    ctl_.notify();
  }
  // Staging is over: nothing of this job acquires again, so trim() may free
  // the slots once the writes in flight have returned theirs.
  pool_->unreserve(plan_.chunks.size());
  mark_staged();  // also when the save failed: nothing reads the sources any more

  backend_->drain();
  backend_.reset();
  if (!failed()) {
    try {
      pool_->check();  // its slots are back: the free list must list each slot once, none handed out
      finish_files();
    } catch (...) {
      fail(std::current_exception());
    }
  }
  for (auto& f : files_) {
    opt_.files->close(f->fd.load());
    opt_.files->close(f->direct_fd);
  }
  ctl_.finish([&] { done_s_ = since_start(); });
}

bool SaveJob::wait_staged(double timeout_s) { return ctl_.wait_until(staged_, timeout_s); }

bool SaveJob::wait_done(double timeout_s) { return ctl_.wait(timeout_s); }

bool SaveJob::failed() const { return ctl_.failed(); }

void SaveJob::rethrow() const { ctl_.rethrow(); }

std::vector<std::vector<uint64_t>> SaveJob::checksums() const {
  std::vector<std::vector<uint64_t>> out(user_segments_);
  for (size_t i = 0; i < user_segments_; ++i)
    out[i].assign(hashes_.begin() + plan_.segment_hash_start[i], hashes_.begin() + plan_.segment_hash_start[i + 1]);
  return out;
}

SaveStats SaveJob::stats() const {
  SaveStats s;
  s.bytes_total = bytes_total_;
  s.bytes_written = bytes_written_.load();
  s.device_bytes = device_bytes_;
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    s.staged_s = staged_s_;
    s.done_s = done_s_;
  }
  s.pin_s = grow_later_ ? grow_pin_s_.load() : pin_s_;  // a GPU save pins on its grower thread only
  s.staging_wait_s = staging_wait_.seconds();
  s.staging_wait_reason = staging_wait_.reason();
  s.unpinned_bytes = pool_->unpinned_bytes();
  s.backend = backend_name_;
  s.rewrites = opt_.files->rewrites();
  s.bytes_sent_uncopied = opt_.files->bytes_sent_uncopied();
  s.bytes_stored = zstored_.load();
  s.compress_s = zns_.load() * 1e-9;
  for (auto& f : files_)
    if (f->fd.load() >= 0) (f->direct.load() ? s.files_direct : s.files_buffered)++;  // not linked ones
  return s;
}

}  // namespace fw
