// _core.NfsClient: the user-space NFSv3 client (io/nfs_client) for the nfs:// target,
// and what the save and load jobs' remote= turns into. The Python face of the client,
// kept beside it so that nothing outside io/nfs* names NFS; it includes nothing from
// python/ (bindings.hpp declares what it defines). Every call that talks to the
// server runs without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io/nfs_client.hpp"

namespace py = pybind11;

namespace fw {

// Engine.start_save's remote=: an NfsClient sends the stripes to its export;
// start_load's: (NfsClient, directory) reads them from that directory.
std::shared_ptr<JobFiles> remote_job_files(const py::object& remote) {
  if (py::isinstance<py::tuple>(remote)) {
    auto t = remote.cast<py::tuple>();
    return nfs::make_job_files(t[0].cast<std::shared_ptr<nfs::Client>>(), t[1].cast<std::string>());
  }
  return nfs::make_job_files(remote.cast<std::shared_ptr<nfs::Client>>());
}

namespace {

// For backend_info(): whether nfs:// works here, and if not why.
py::dict nfs_support() {
  py::dict d;
  const bool usable = nfs::available();
  d["compiled"] = nfs::compiled();
  d["usable"] = usable;
  d["reason"] = usable ? py::none() : py::object(py::str(nfs::unavailable_reason()));
  d["headers"] = nfs::compiled() ? py::object(py::str(std::string("libnfs ") + nfs::headers_version())) : py::none();
  d["library"] = usable ? py::object(py::str(nfs::library())) : py::none();
  return d;
}

}  // namespace

void register_remote(py::module_& m) {
  m.def("nfs_support", &nfs_support,
        "{'compiled', 'usable', 'reason' (why not, or None), 'headers', 'library' (the libnfs loaded)}.");
  m.def("nfs_available", [] { return nfs::available(); }, "Whether libnfs can be loaded (dlopen).");
  m.def("nfs_unavailable_reason", [] { return nfs::available() ? std::string() : nfs::unavailable_reason(); },
        "Why nfs:// cannot work here (what to install), or ''.");
  m.def("nfs_exports",
        [](const std::string& server, int timeout_ms) {
          py::gil_scoped_release nogil;
          return nfs::list_exports(server, timeout_ms);
        },
        py::arg("server"), py::arg("timeout_ms") = 10000, "The exports SERVER lists (MOUNT EXPORT via the portmapper).");
  py::class_<nfs::Client, std::shared_ptr<nfs::Client>>(m, "NfsClient", "An NFSv3 client over several TCP connections (libnfs, loaded at run time).")
      .def(py::init([](const std::string& server, const std::string& export_path, int nfs_port, int mount_port,
                       unsigned connections, unsigned depth, uint64_t io_bytes, int timeout_ms) {
             nfs::Options o;
             o.server = server;
             o.export_path = export_path;
             o.nfs_port = nfs_port;
             o.mount_port = mount_port;
             o.connections = connections;
             o.depth = depth;
             o.io_bytes = io_bytes;
             o.timeout_ms = timeout_ms;
             py::gil_scoped_release nogil;
             return new nfs::Client(o);
           }),
           py::arg("server"), py::arg("export"), py::arg("nfs_port") = 0, py::arg("mount_port") = 0,
           py::arg("connections") = 4, py::arg("depth") = 16, py::arg("io_bytes") = 1 << 20,
           py::arg("timeout_ms") = 10000)
      .def("url", &nfs::Client::url)
      .def_property_readonly("connections", [](const nfs::Client& c) { return c.options().connections; })
      .def("stat",
           [](nfs::Client& c, const std::string& p) {
             nfs::Stat s;
             {
               py::gil_scoped_release nogil;
               s = c.stat(p);
             }
             return py::make_tuple(s.exists, s.is_dir, s.size);
           },
           "(exists, is_dir, size)")
      .def("listdir", &nfs::Client::listdir, py::call_guard<py::gil_scoped_release>())
      .def("mkdir", &nfs::Client::mkdir, py::call_guard<py::gil_scoped_release>())
      .def("rmdir", &nfs::Client::rmdir, py::call_guard<py::gil_scoped_release>())
      .def("unlink", &nfs::Client::unlink, py::call_guard<py::gil_scoped_release>())
      .def("rename", &nfs::Client::rename, py::call_guard<py::gil_scoped_release>())
      .def("link", &nfs::Client::link, py::arg("src"), py::arg("dst"), py::call_guard<py::gil_scoped_release>(),
           "Make DST a hard link to the file SRC (NFS LINK).")
      .def("write_file",
           [](nfs::Client& c, const std::string& path, py::buffer data, bool exclusive) {
             py::buffer_info info = data.request();  // holds the buffer until we return
             const char* p = static_cast<const char*>(info.ptr);
             uint64_t n = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
             nfs::WriteResult r;
             {
               py::gil_scoped_release nogil;
               r = c.write_file(path, p, n, exclusive);
             }
             py::dict d;
             d["bytes"] = r.bytes;
             d["rewrites"] = r.rewrites;
             d["commit_rounds"] = r.commit_rounds;
             return d;
           },
           py::arg("path"), py::arg("data"), py::arg("exclusive") = true,
           "Create PATH, write DATA with UNSTABLE WRITEs over the connections, COMMIT, check verifiers "
           "(rewriting what a server restart may have lost). Returns {bytes, rewrites, commit_rounds}.")
      .def("read_into",
           [](nfs::Client& c, const std::string& path, py::buffer out, uint64_t offset) {
             py::buffer_info info = out.request(true);
             char* p = static_cast<char*>(info.ptr);
             uint64_t n = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
             py::gil_scoped_release nogil;
             return c.read_file(path, p, offset, n);
           },
           py::arg("path"), py::arg("out"), py::arg("offset") = 0,
           "Read from OFFSET of PATH into the writable buffer OUT; returns the bytes read.");
}

}  // namespace fw
