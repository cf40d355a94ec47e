// libnfs, loaded at run time with dlopen (never linked): the table of its functions,
// the NFS and RPC status -> errno maps, and one connection (libnfs context). Internal
// to the NFS client's files (nfs_client.cpp, nfs_bulk.cpp, nfs_job_*.cpp); include it
// only where FLASHWRITE_HAVE_LIBNFS_HEADERS is set.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "io/nfs_client.hpp"

// Headers for types and prototypes only: nothing here links against libnfs; every
// function is looked up with dlsym (decltype of a declaration does not use it).
#include <nfsc/libnfs.h>
#include <nfsc/libnfs-raw.h>
#include <nfsc/libnfs-raw-mount.h>
#include <nfsc/libnfs-raw-nfs.h>

namespace fw::nfs {

namespace detail {

// libnfs keeps struct nfs_fh private; nfs_get_fh returns one. Its layout has been
// {int len; char* val;} since libnfs 1.x (lib/libnfs-private.h).
struct FhView {
  int len;
  char* val;
};

#define FW_NFS_FUNCS(X)                                                                                   \
  X(nfs_init_context) X(nfs_destroy_context) X(nfs_parse_url_dir) X(nfs_destroy_url) X(nfs_mount)         \
  X(nfs_get_error) X(nfs_get_fd) X(nfs_which_events) X(nfs_service) X(nfs_set_timeout)                    \
  X(nfs_set_autoreconnect) X(nfs_get_rpc_context) X(nfs_get_fh) X(nfs_create) X(nfs_close) X(nfs_stat64)  \
  X(nfs_mkdir) X(nfs_rmdir) X(nfs_unlink) X(nfs_rename) X(nfs_link) X(nfs_opendir) X(nfs_readdir) X(nfs_closedir)     \
  X(nfs_get_readmax) X(nfs_get_writemax) X(rpc_nfs3_write_async) X(rpc_nfs3_commit_async)                 \
  X(rpc_nfs3_read_async) X(mount_getexports) X(mount_free_export_list) X(nfs_open)

struct Lib {
  void* handle = nullptr;
  std::string name;  // the name it was loaded by
  std::string error;
#define X(f) decltype(&::f) f = nullptr;
  FW_NFS_FUNCS(X)
#undef X
};

// The loaded library, or its error (what to install) in .error.
const Lib& lib();
// The loaded library; throws IoError(ENOSYS) naming what to install when it is absent.
const Lib& L();

int errno_of_status(int st);
const char* rpc_status_name(int status);
int errno_of_rpc(int status);

using Clock = std::chrono::steady_clock;

// The arguments of one UNSTABLE WRITE of `len` bytes at `off` of the file whose handle
// is `fh`, sent from `data`. Both are borrowed, not copied: they must stay alive and
// unchanged until the RPC's reply (the bulk loop and the save job keep them in their
// per-request state).
inline void fill_write_args(WRITE3args& a, const std::string& fh, uint64_t off, uint64_t len, const char* data) {
  a.file.data.data_len = static_cast<u_int>(fh.size());
  a.file.data.data_val = const_cast<char*>(fh.data());
  a.offset = off;
  a.count = static_cast<count3>(len);
  a.stable = UNSTABLE;
  a.data.data_len = static_cast<u_int>(len);
  a.data.data_val = const_cast<char*>(data);
}

// The arguments of one READ of `len` bytes at `off` (`fh` borrowed, as above).
inline void fill_read_args(READ3args& a, const std::string& fh, uint64_t off, uint64_t len) {
  a.file.data.data_len = static_cast<u_int>(fh.size());
  a.file.data.data_val = const_cast<char*>(fh.data());
  a.offset = off;
  a.count = static_cast<count3>(len);
}

}  // namespace detail

struct Client::Conn {
  nfs_context* ctx = nullptr;
  ~Conn() {
    if (ctx) detail::L().nfs_destroy_context(ctx);
  }
};

}  // namespace fw::nfs
