#include "read/load_job.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "io/files.hpp"

namespace fw {

LoadJob::LoadJob(std::vector<ReadFileSpec> files, std::vector<VerifyPiece> pieces, LoadOptions opt)
    : specs_(std::move(files)), pieces_(std::move(pieces)), opt_(opt) {
  if (!opt_.files) throw std::invalid_argument("a load job needs the files of its target");
  if (opt_.chunk_bytes == 0 || opt_.chunk_bytes % kAlign) throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  if (opt_.verify_threads == 0) opt_.verify_threads = 1;
  if (const char* d = std::getenv("FLASHWRITE_TEST_LOAD_PLACE_DELAY_MS")) test_place_delay_ms_ = std::atoi(d);
  for (auto& p : pieces_) {
    if (p.file >= specs_.size() || p.offset > specs_[p.file].size || p.len > specs_[p.file].size - p.offset)
      throw FormatError("checksum piece outside its file");
    if (p.len && p.offset / opt_.chunk_bytes != (p.offset + p.len - 1) / opt_.chunk_bytes)
      throw FormatError("checksum piece crosses a read chunk boundary");
  }
}

LoadJob::~LoadJob() {
  // Here, not in ctl_'s destructor: the control thread uses members declared after ctl_.
  if (ctl_.started()) {
    cancel();
    ctl_.wait(-1);
  }
  for (int fd : fds_) opt_.files->close(fd);
  for (int fd : buffered_fds_) opt_.files->close(fd);
}

void LoadJob::fail(std::exception_ptr e) { ctl_.fail(std::move(e)); }

void LoadJob::cancel() { ctl_.cancel(); }

void LoadJob::start() {
  t0_ = std::chrono::steady_clock::now();
  // Open and size-check on the caller's thread: missing or truncated files are
  // reported before any large allocation.
  for (auto& spec : specs_) {
    OpenedFile of = opt_.files->open(spec.path, spec.size);
    fds_.push_back(of.fd);
    buffered_fds_.push_back(-1);
    opened_direct_.push_back(of.direct);
    files_direct_ += of.direct;
  }
  for (uint32_t f = 0; f < specs_.size(); ++f) {
    bool placed = opt_.placer && opt_.placer->covers(f, specs_[f].size);
    buffers_.push_back(placed ? nullptr : std::make_shared<AlignedBuffer>(specs_[f].size));
  }
  for (uint32_t f = 0; f < specs_.size(); ++f) add_requests(f);
  // Interleave files so every one has reads in flight.
  std::stable_sort(requests_.begin(), requests_.end(), [](const IoRequest& a, const IoRequest& b) { return a.offset < b.offset; });
  map_pieces();
  std::vector<uint32_t> file_of(requests_.size());
  std::vector<char> direct(requests_.size());
  for (size_t i = 0; i < requests_.size(); ++i) {
    file_of[i] = file_of_request_[requests_[i].tag];
    direct[i] = direct_[requests_[i].tag];
  }
  file_of_request_.swap(file_of);
  direct_.swap(direct);
  for (size_t i = 0; i < requests_.size(); ++i) requests_[i].tag = i;
  to_placer_.assign(requests_.size(), 0);
  fault_state_ = std::make_unique<std::atomic<uint8_t>[]>(requests_.size());
  for (size_t i = 0; i < requests_.size(); ++i) fault_state_[i].store(0, std::memory_order_relaxed);
  if (opt_.placer)
    for (size_t i = 0; i < requests_.size(); ++i)
      to_placer_[i] = !direct_[i] && (!requests_[i].buf || opt_.placer->wants(file_of_request_[i], requests_[i].offset,
                                                                               requests_[i].want));
  init_frames();  // after to_placer_: it reads each request's destination and raw length
  IoCallback cb = [this](IoRequest* r, int64_t res) { on_io(r, res); };
  backend_ = opt_.files->backend(opt_.queue_depth, cb);
  backend_name_ = backend_->name();
  try {
    ctl_.start([this] { run(); });
  } catch (...) {
    backend_.reset();
    throw;
  }
}

// A file's requests: the chunks of its kDirect placements' page-rounded extents
// go straight into their memory; the rest of the file, each gap widened to
// whole pages (so that no byte outside a direct placement is cut from the
// others of its checksum piece), into the file's buffer or bounce slots. Every
// request is cut at multiples of chunk_bytes, so a piece lies inside one.
void LoadJob::add_requests(uint32_t f) {
  const uint64_t size = specs_[f].size;
  auto add = [&](uint64_t a, uint64_t b, char* mem) {  // mem: where byte a goes (kDirect), or nullptr
    for (uint64_t off = a; off < b;) {
      const uint64_t next = std::min(b, (off / opt_.chunk_bytes + 1) * opt_.chunk_bytes);
      IoRequest r;
      r.fd = fds_[f];
      r.buf = mem ? mem + (off - a) : buffers_[f] ? buffers_[f]->data() + off : nullptr;  // nullptr: a slot, at submit
      r.want = next - off;
      r.len = round_up(r.want, kAlign);
      r.offset = off;
      r.write = false;
      r.tag = requests_.size();
      requests_.push_back(r);
      file_of_request_.push_back(f);
      direct_.push_back(mem != nullptr);
      off = next;
    }
  };
  uint64_t pos = 0;  // the first byte not yet given a request
  for (const Placement& d : opt_.placer && (f >= opt_.frames.size() || opt_.frames[f].empty()) ? opt_.placer->direct(f) : std::vector<Placement>{}) {
    if (d.offset < pos || d.offset + d.len > size) throw std::invalid_argument("a direct placement outside its file");
    const uint64_t a = d.offset / kAlign * kAlign, b = std::min(size, round_up(d.offset + d.len, kAlign));
    if (d.offset > pos) add(pos / kAlign * kAlign, std::min(size, round_up(d.offset, kAlign)), nullptr);
    add(a, b, d.dst - (d.offset - a));
    pos = d.offset + d.len;
  }
  if (pos < size) add(pos / kAlign * kAlign, size, nullptr);
}

// Every piece to the request that holds it (where edge pages are read twice, either).
void LoadJob::map_pieces() {
  std::vector<std::vector<size_t>> by_file(specs_.size());  // request indices, by offset
  for (size_t i = 0; i < requests_.size(); ++i) by_file[file_of_request_[requests_[i].tag]].push_back(i);
  chunk_pieces_.assign(requests_.size(), {});
  for (uint32_t pi = 0; pi < pieces_.size(); ++pi) {
    const auto& p = pieces_[pi];
    if (!p.len) continue;
    const auto& v = by_file[p.file];
    auto it = std::upper_bound(v.begin(), v.end(), p.offset,
                               [&](uint64_t off, size_t i) { return off < requests_[i].offset; });
    bool found = false;
    while (it != v.begin() && !found) {
      const IoRequest& r = requests_[*--it];
      if (r.offset + r.want >= p.offset + p.len) {
        chunk_pieces_[*it].push_back(pi);
        found = true;
      }
    }
    if (!found) throw FormatError("checksum piece outside every read of its file");
  }
}

// The file system took O_DIRECT at open but refuses a read (EINVAL), or a short
// read left the request at an unaligned offset, which O_DIRECT refuses: the file
// is read buffered from here on, this request resumed where it stopped, as the
// save path does for writes. Requests already in flight on the direct fd come
// back the same way and are retried too. Returns false when there is nothing
// left to fall back to (the request was buffered, or the files are never direct).
bool LoadJob::fall_back_to_buffered(IoRequest* r, uint32_t f) {
  std::lock_guard<std::mutex> lk(fallback_mu_);
  if (buffered_fds_[f] < 0) {
    const int fd = opt_.files->reopen_buffered(specs_[f].path, /*write=*/false);
    if (fd < 0) return false;
    buffered_fds_[f] = fd;
    if (opened_direct_[f]) files_direct_ -= 1;
  }
  if (r->fd == buffered_fds_[f]) return false;
  r->fd = buffered_fds_[f];
  backend_->resubmit(r);
  return true;
}

int LoadJob::read_fd(uint32_t f) {
  std::lock_guard<std::mutex> lk(fallback_mu_);
  return buffered_fds_[f] >= 0 ? buffered_fds_[f] : fds_[f];
}

void LoadJob::on_io(IoRequest* r, int64_t res) {
  const uint32_t f = file_of_request_[r->tag];
  if (res == -EINVAL) {
    try {
      if (fall_back_to_buffered(r, f)) return;
    } catch (...) {
      if (to_placer_[r->tag]) opt_.placer->discard(dst_of(r->tag));
      fail(std::current_exception());
      return;
    }
  }
  if ((res < 0 || static_cast<uint64_t>(res) < r->want) && to_placer_[r->tag]) opt_.placer->discard(dst_of(r->tag));
  if (res < 0) {
    fail(opt_.files->error(r, res, specs_[f].path));
    return;
  }
  if (static_cast<uint64_t>(res) < r->want) {
    fail(std::make_exception_ptr(FormatError("'" + specs_[f].path + "' ended at offset " +
                                             std::to_string(r->offset + res) + " while reading (truncated)")));
    return;
  }
  if (!chunk_pieces_[r->tag].empty() || to_placer_[r->tag] || framed(r->tag)) {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    verify_queue_.push_back(static_cast<uint32_t>(r->tag));
    verify_cv_.notify_one();
  }
}

bool LoadJob::claim_fault(size_t i, uint8_t to) {
  uint8_t expected = 0;
  return fault_state_[i].compare_exchange_strong(expected, to);
}

void LoadJob::fault_in(size_t i) {
  const IoRequest& r = requests_[i];
  const uint32_t f = file_of_request_[i];
  if (to_placer_[i])
    opt_.placer->prepare(f, r.offset, raw_len(i));
  else if (direct_[i])
    prefault_pages(r.buf, r.len);
  else
    buffers_[f]->prefault(static_cast<size_t>(r.offset), round_up(raw_len(i), kAlign));
}

void LoadJob::fault_in_once(size_t i) {
  if (!claim_fault(i, 1)) return;
  fault_in(i);
  fault_state_[i].store(2);
}

void LoadJob::fault_ahead_one() {
  size_t i = fault_next_.fetch_add(1);
  if (i < requests_.size()) fault_in_once(i);
}

void LoadJob::verify_worker() {
  for (;;) {
    uint32_t ci;
    {
      std::unique_lock<std::mutex> lk(ctl_.mutex());
      // Chunks that have arrived come first (they free bounce slots for later
      // reads); in between, fault in what later reads will fill. fault_next_
      // only grows, so once this wait sees no fault work it never reappears.
      verify_cv_.wait(lk, [&] {
        return reads_done_ || !verify_queue_.empty() || (fault_next_.load() < requests_.size() && !ctl_.cancelled());
      });
      if (verify_queue_.empty()) {
        if (reads_done_) return;
        lk.unlock();
        fault_ahead_one();
        continue;
      }
      ci = verify_queue_.front();
      verify_queue_.pop_front();
    }
    const IoRequest& r = requests_[ci];
    bool ok = !framed(ci) || decode(ci);
    for (uint32_t pi : ok ? chunk_pieces_[ci] : std::vector<uint32_t>{}) {
      const VerifyPiece& p = pieces_[pi];
      const char* data = to_placer_[ci] ? dst_of(ci) + (p.offset - r.offset)
                         : direct_[ci]  ? r.buf + (p.offset - r.offset)
                                        : buffers_[p.file]->data() + p.offset;
      uint64_t h = checksum(data, p.len);
      if (h != p.expected) {
        ok = false;
        std::lock_guard<std::mutex> lk(ctl_.mutex());
        mismatches_.push_back({pi, h});
      }
    }
    if (to_placer_[ci]) {
      // Not faulted in ahead (the workers were busy with earlier chunks): in
      // one call here, far cheaper than the copy's page-by-page faults.
      fault_in_once(ci);
      // Verified before it is copied: damaged bytes never reach a tensor.
      uint32_t f = file_of_request_[ci];
      char* host_dst = buffers_[f] ? buffers_[f]->data() + r.offset : nullptr;
      // Counted before the cancel flag is read (both sequentially consistent): once
      // wait_quiet has seen no copy under way after a cancel, none starts.
      placing_.fetch_add(1);
      struct Placed {
        std::atomic<unsigned>& n;
        ~Placed() { n.fetch_sub(1); }
      } placed{placing_};
      const bool copy = ok && !ctl_.cancelled();
      if (copy && test_place_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(test_place_delay_ms_));
      opt_.placer->place(f, r.offset, raw_len(ci), dst_of(ci), host_dst, copy);
    }
  }
}

void LoadJob::run() {
  // Workers start even with nothing to verify or place: they fault in the
  // destinations ahead of the reads. A thread that cannot be started must not
  // escape this one (that would terminate the process): the load fails instead.
  std::vector<std::thread> workers;
  try {
    for (unsigned i = 0; i < opt_.verify_threads && !requests_.empty(); ++i)
      workers.emplace_back([this] { verify_worker(); });
  } catch (...) {
    fail(std::current_exception());
  }
  const bool fault_ahead = !workers.empty();
  const bool verify_inline = !fault_ahead && (!pieces_.empty() || opt_.placer || !zframe_.empty());
  if (opt_.placer) {
    try {
      opt_.placer->begin();
    } catch (...) {
      fail(std::current_exception());
    }
  }
  for (auto& r : requests_) {
    if (ctl_.cancelled()) break;
    r.fd = read_fd(file_of_request_[r.tag]);
    if (to_placer_[r.tag]) {
      // A bounce slot: waits here while every slot is being read, verified or
      // copied out, which paces reading to the copies.
      char* slot = nullptr;
      try {
        slot = opt_.placer->acquire(&ctl_.cancel_flag());
      } catch (...) {  // the bounce pool's bookkeeping failed (StagingPool::check)
        fail(std::current_exception());
      }
      if (!slot) break;
      if (framed(r.tag))
        zdst_[r.tag] = slot;  // r.buf is the frame's place in zbuf_
      else
        r.buf = slot;
      const size_t i = r.tag;  // r belongs to the backend once submitted
      backend_->submit(&r);
      // Without workers, here, after the submit: the read goes to the slot, so
      // faulting in the destinations overlaps it (and may race the copy out safely).
      if (!fault_ahead && claim_fault(i, 2)) fault_in(i);
      continue;
    }
    // The read goes straight to the buffer: fault it in before the submit, while
    // earlier reads are in flight, rather than in the kernel's direct-I/O path
    // where it stalls the request; unless a worker has claimed it already (one
    // still at it races the kernel's faults safely: neither writes a byte).
    fault_in_once(r.tag);
    backend_->submit(&r);
  }
  backend_->drain();
  backend_.reset();
  {
    std::lock_guard<std::mutex> lk(ctl_.mutex());
    reads_done_ = true;
  }
  verify_cv_.notify_all();
  if (verify_inline) verify_worker();  // drains what was queued (slots go back to the placer)
  for (auto& t : workers) t.join();
  if (opt_.placer) {
    try {
      opt_.placer->finish();
    } catch (...) {
      fail(std::current_exception());
    }
  }
  for (int fd : fds_) opt_.files->close(fd);
  for (int fd : buffered_fds_) opt_.files->close(fd);
  fds_.clear();
  buffered_fds_.clear();
  ctl_.finish([&] {
    std::sort(mismatches_.begin(), mismatches_.end(), [](const Mismatch& a, const Mismatch& b) { return a.piece < b.piece; });
    done_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  });
}

bool LoadJob::wait(double timeout_s) { return ctl_.wait(timeout_s); }

bool LoadJob::wait_quiet(double timeout_s) {
  if (opt_.placer && opt_.placer->copies_async()) return wait(timeout_s);
  const auto start = std::chrono::steady_clock::now();
  while (placing_.load() != 0) {
    if (ctl_.done()) return true;
    if (timeout_s >= 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= timeout_s)
      return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void LoadJob::rethrow() const { ctl_.rethrow(); }

std::vector<Mismatch> LoadJob::mismatches() const {
  std::lock_guard<std::mutex> lk(ctl_.mutex());
  return mismatches_;
}

}  // namespace fw
