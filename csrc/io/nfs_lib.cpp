// libnfs loaded with dlopen and the status maps (see nfs_lib.hpp).
#include <dlfcn.h>

#include <cerrno>
#include <cstdlib>
#include <vector>

#include "core/error.hpp"
#include "io/nfs_client.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
#include "io/nfs_lib.hpp"

namespace fw::nfs {

namespace detail {

const Lib& lib() {
  static const Lib l = [] {
    Lib out;
    // The Debian/Ubuntu runtime package is libnfs13 (libnfs.so.13); a plain
    // libnfs.so comes with the -dev package.
    // FLASHWRITE_LIBNFS names the library instead (a path or a soname).
    std::vector<std::string> names;
    const char* env = std::getenv("FLASHWRITE_LIBNFS");
    if (env && *env) names.emplace_back(env);
    else names = {"libnfs.so.13", "libnfs.so.14", "libnfs.so.16", "libnfs.so"};
    std::string first_error;  // the loader's words for the first name tried
    for (const auto& name : names) {
      out.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (out.handle) {
        out.name = name;
        break;
      }
      if (first_error.empty()) {
        const char* e = dlerror();
        first_error = e ? e : name + ": not found";
      }
    }
    if (!out.handle) {
      out.error = "libnfs could not be loaded (" + first_error + "): install it (apt-get install libnfs13; dnf install "
                  "libnfs), or name it with FLASHWRITE_LIBNFS";
      return out;
    }
#define X(f)                                                                         \
  out.f = reinterpret_cast<decltype(&::f)>(dlsym(out.handle, #f));                   \
  if (!out.f && out.error.empty())                                                    \
    out.error = out.name + " lacks " #f " (libnfs 4 or 5 is needed: libnfs 6 renamed its RPC calls)";
    FW_NFS_FUNCS(X)
#undef X
    return out;
  }();
  return l;
}

const Lib& L() {
  const Lib& l = lib();
  if (!l.error.empty()) throw IoError(ENOSYS, "load libnfs: " + l.error, "");
  return l;
}

int errno_of_status(int st) {
  switch (st) {
    case NFS3ERR_PERM: return EPERM;
    case NFS3ERR_NOENT: return ENOENT;
    case NFS3ERR_ACCES: return EACCES;
    case NFS3ERR_EXIST: return EEXIST;
    case NFS3ERR_NOTDIR: return ENOTDIR;
    case NFS3ERR_ISDIR: return EISDIR;
    case NFS3ERR_INVAL: return EINVAL;
    case NFS3ERR_FBIG: return EFBIG;
    case NFS3ERR_NOSPC: return ENOSPC;
    case NFS3ERR_ROFS: return EROFS;
    case NFS3ERR_NAMETOOLONG: return ENAMETOOLONG;
    case NFS3ERR_NOTEMPTY: return ENOTEMPTY;
    case NFS3ERR_DQUOT: return EDQUOT;
    case NFS3ERR_STALE: return ESTALE;
    case NFS3ERR_JUKEBOX: return EAGAIN;
    default: return EIO;
  }
}

const char* rpc_status_name(int status) {
  switch (status) {
    case RPC_STATUS_TIMEOUT: return "timed out";
    case RPC_STATUS_CANCEL: return "cancelled (connection lost)";
    default: return "failed";
  }
}

int errno_of_rpc(int status) { return status == RPC_STATUS_TIMEOUT ? ETIMEDOUT : status == RPC_STATUS_CANCEL ? ECONNABORTED : EIO; }

}  // namespace detail

bool compiled() { return true; }
bool available() { return detail::lib().error.empty(); }
std::string library() { return available() ? detail::lib().name : std::string(); }
#ifndef FLASHWRITE_LIBNFS_HEADERS_VERSION
#define FLASHWRITE_LIBNFS_HEADERS_VERSION "unknown"
#endif
const char* headers_version() { return FLASHWRITE_LIBNFS_HEADERS_VERSION; }
std::string unavailable_reason() { return detail::lib().error; }

}  // namespace fw::nfs

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS
