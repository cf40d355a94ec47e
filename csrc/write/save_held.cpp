// Held files of an incremental save: a stripe of the base checkpoint whose
// tensors could not be compared before staging (they are on a GPU) is planned
// as a file that mirrors it byte for byte. Its chunks are staged and
// checksummed like any other, but parked in their slots; once the last one is,
// the checksums decide: all as expected -> the base stripe is hard-linked to
// the file's path (nothing written, the slots go back, or stay for the local
// snapshot of a save that keeps its slots), else -> written.
//
// Holding is safe only when no staging waits for a held slot: the job holds
// only when the pool has a slot for every chunk of the save (its reservation
// says so, SaveJob::start); otherwise every held file is written from the
// start (PoolTooSmall). The links are made on the copy threads, before the job
// is done, so the directory fsync that precedes the manifest covers them.
#include <algorithm>
#include <cerrno>
#include <stdexcept>

#include "write/save_job.hpp"

namespace fw {

void SaveJob::init_held() {
  held_files_.resize(specs_.size());
  for (size_t f = 0; f < specs_.size(); ++f) {
    FileSpec& s = specs_[f];
    if (s.link_from.empty()) continue;
    if (!opt_.files->can_link())
      throw std::invalid_argument("held files need a target that can hard-link its files: " + s.path);
    auto h = std::make_unique<Held>();
    h->expected = std::move(s.expected);
    std::sort(h->expected.begin(), h->expected.end(),
              [](const ExpectedPiece& a, const ExpectedPiece& b) { return a.offset < b.offset; });
    held_files_[f] = std::move(h);
  }
  for (size_t ci = 0; ci < plan_.chunks.size(); ++ci)
    if (Held* h = held_files_[plan_.chunks[ci].file].get()) h->chunks.push_back(ci);
  for (auto& h : held_files_)
    if (h) h->unstaged = h->chunks.size();
}

bool SaveJob::is_held(size_t ci) const { return holding_ && held_files_[plan_.chunks[ci].file] != nullptr; }

// On a copy thread, once chunk ci is in its slot and checksummed.
void SaveJob::chunk_ready(size_t ci) {
  if (!is_held(ci)) {
    write_chunk(ci);
    return;
  }
  const uint32_t f = plan_.chunks[ci].file;
  Held& h = *held_files_[f];
  {
    std::lock_guard<std::mutex> lk(park_mu_);
    h.parked.push_back(ci);
  }
  if (h.unstaged.fetch_sub(1) == 1) decide(f);
}

// Every piece of file f's tensors has the checksum the base stripe has there.
bool SaveJob::matches(uint32_t f) const {
  const Held& h = *held_files_[f];
  size_t seen = 0;
  for (size_t ci : h.chunks) {
    const Chunk& c = plan_.chunks[ci];
    for (uint32_t i = 0; i < c.piece_count; ++i) {
      const Piece& p = plan_.pieces[c.first_piece + i];
      if (p.segment >= user_segments_) continue;  // the header: the base's own bytes
      const uint64_t at = c.file_offset + p.chunk_offset;
      auto it = std::lower_bound(h.expected.begin(), h.expected.end(), at,
                                 [](const ExpectedPiece& e, uint64_t off) { return e.offset < off; });
      if (it == h.expected.end() || it->offset != at || it->len != p.len || it->checksum != hashes_[p.hash_index])
        return false;
      ++seen;
    }
  }
  return seen == h.expected.size();
}

// The last chunk of held file f is staged: link it or write it.
void SaveJob::decide(uint32_t f) {
  Held& h = *held_files_[f];
  std::vector<size_t> chunks;
  {
    std::lock_guard<std::mutex> lk(park_mu_);
    chunks.swap(h.parked);
  }
  if (ctl_.cancelled() || failed()) {  // nothing is linked or written any more
    for (size_t ci : chunks) pool_->release(requests_[ci].buf);
    return;
  }
  HeldResult r{HeldOutcome::Changed, 0};
  if (matches(f)) {
    const int err = opt_.files->link(specs_[f].link_from, specs_[f].path);
    if (err == 0) {
      for (size_t ci : chunks) {
        bytes_linked_ += plan_.chunks[ci].data_len;
        return_slot(requests_[ci].buf, true);  // kept for a local snapshot (hold_slots), else back to the pool
      }
      std::lock_guard<std::mutex> lk(park_mu_);
      h.result = HeldResult{HeldOutcome::Linked, 0};
      return;
    }
    r = HeldResult{HeldOutcome::LinkRefused, err};  // any refusal: the bytes are here, write them
  }
  {
    std::lock_guard<std::mutex> lk(park_mu_);
    h.result = r;
  }
  write_held(f, chunks);
}

// Create file f and queue its parked chunks' writes; on an error, the slots of
// the chunks not queued go back before it propagates (the copy thread fails the job).
void SaveJob::write_held(uint32_t f, std::vector<size_t>& chunks) {
  size_t next = 0;  // the first chunk whose slot is still this function's to give back
  try {
    open_file(f);
    for (size_t k = 0; k < chunks.size(); ++k) {
      next = k + 1;  // write_chunk gives back its own slot if it throws
      write_chunk(chunks[k]);
    }
  } catch (...) {
    for (size_t j = next; j < chunks.size(); ++j) pool_->release(requests_[chunks[j]].buf);
    throw;
  }
}

// At start, when the pool cannot hold every slot of the save: held files are
// written like ordinary ones (created now, on the caller's thread).
void SaveJob::stop_holding() {
  for (size_t f = 0; f < held_files_.size(); ++f) {
    if (!held_files_[f]) continue;
    held_files_[f]->result = HeldResult{HeldOutcome::PoolTooSmall, 0};
    open_file(f);
  }
}

// After the copy threads ended: slots of held files that a failure or a cancel
// left undecided go back to the pool.
void SaveJob::release_parked() {
  std::lock_guard<std::mutex> lk(park_mu_);
  for (auto& h : held_files_) {
    if (!h) continue;
    for (size_t ci : h->parked) pool_->release(requests_[ci].buf);
    h->parked.clear();
  }
}

std::vector<HeldResult> SaveJob::held_results() const {
  std::vector<HeldResult> out(held_files_.size());
  std::lock_guard<std::mutex> lk(park_mu_);
  for (size_t f = 0; f < held_files_.size(); ++f)
    if (held_files_[f]) out[f] = held_files_[f]->result;
  return out;
}

}  // namespace fw
