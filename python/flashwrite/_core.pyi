"""Type stubs for flashwrite's native engine (csrc/python/*_bindings.cpp, one file per area).

Every tuple that crosses the boundary is named below. Blocking calls release the
GIL; waits wake every 50 ms so Ctrl-C interrupts them. Native errors arrive as
``OSError`` subclasses carrying ``errno``, ``filename``, ``offset`` and ``op``
(I/O), ``flashwrite.errors.CorruptCheckpointError`` (format / size checks),
``ValueError`` / ``TypeError`` (bad arguments) or ``RuntimeError`` (CUDA, cancel).
"""

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import Buffer as _BufferLike

__version__: str
CHECKSUM_ALGORITHM: str  # "xxh3-64"
ALIGN: int  # 4096: every O_DIRECT offset, length and buffer is a multiple of it
HEADER_ALIGN: int  # 4096: a stripe's tensor data starts on this boundary
MAX_HEADER_BYTES: int  # safetensors' own limit on a header
# walk_state's per-tensor flags
WALK_CPU: int  # host memory
WALK_PARAM: int  # an nn.Parameter
WALK_REQUIRES_GRAD: int  # requires_grad
WALK_DENSE: int  # stored as it is: contiguous, not a negative or conjugate view

class _Defaults(TypedDict):
    stripes: int
    chunk_bytes: int
    write_queue_depth: int
    read_queue_depth: int
    read_chunk_bytes: int
    direct_tensor_bytes: int  # owned CPU tensors from this size up are read straight into their memory
    copy_threads: int  # follows the CPU count (defaults::copy_threads()), counted at import
    verify_threads: int  # follows the CPU count (defaults::verify_threads()), counted at import
    d2h_batches_in_flight: int
    bounce_min_slots: int
    bounce_extra_slots: int
    gather_tensor_bytes: int  # GPU tensors up to this size are gathered into one copy
    gather_run_bytes: int  # bytes of one gather buffer at most

DEFAULTS: _Defaults  # csrc/core/defaults.hpp; python/flashwrite/defaults.py names them

# ---------------------------------------------------------------- tuple layouts

# A save's stripe file: (path, header, size). header: the bytes at offset 0 (any
# object with the buffer protocol: the padded safetensors header); size: the
# file's exact final size.
SaveFile = tuple[str, _BufferLike, int]
# A source byte range: (address, nbytes, file, offset) in host memory, or
# (address, nbytes, file, offset, device) where device -1 is host memory and
# >= 0 a GPU. file indexes the files list, offset is within that file.
Segment = tuple[int, int, int, int] | tuple[int, int, int, int, int]
# Host-memory segments of one file as columns: (file, members, offsets, ptrs, nbytes):
# member k is tensor members[k], at offsets[k] in the file, from address
# ptrs[members[k]], nbytes[members[k]] bytes (empty tensors are skipped).
HostFile = tuple[int, list[int], list[int], list[int], list[int]]
# A caller's stream the GPU copies are ordered after: (device, cudaStream_t as int);
# a device without one uses its legacy default stream (0).
Stream = tuple[int, int]
# A load's file: (path, expected exact size).
LoadFile = tuple[str, int]
# A checksummed piece: (file, offset, nbytes, expected xxh3-64). A piece never
# crosses a read chunk boundary.
Piece = tuple[int, int, int, int]
# A byte range of a load that goes to memory the caller owns, not to a whole-file
# buffer: (file, offset, nbytes, device, address); device >= 0 is a GPU, -1 host
# memory (copied there), -2 host memory from owned_tensor (read there, no copy).
# Ranges must not overlap; any byte offset is fine (-2: address = offset mod 4096). A file whose every
# byte is placed is never held whole (its buffers() entry is None).
Placement = tuple[int, int, int, int, int]
# A mismatch found by a load: (index into the pieces list, actual xxh3-64).
Mismatch = tuple[int, int]
# plan_chunks: a piece of a chunk: (segment, src_offset, chunk_offset, nbytes, hash_index)
PlanPiece = tuple[int, int, int, int, int]
# plan_chunks: a chunk: (file, file_offset, data_len, write_len, has_gaps, pieces)
PlanChunk = tuple[int, int, int, int, bool, list[PlanPiece]]

class _SaveStats(TypedDict):
    bytes_total: int
    bytes_written: int
    staged_s: float  # -1 until staged
    done_s: float  # -1 until done
    backend: str  # "io_uring" or "threads"
    files_direct: int
    files_buffered: int
    device_bytes: int  # bytes copied from GPUs
    pin_s: float  # seconds spent page-locking the staging pool for this save
    staging_wait_s: float  # seconds the save waited for staging memory (wall time of its threads' waits)
    staging_wait_reason: str  # "fault-in", "pin", "pool busy" or "" (never waited)
    unpinned_bytes: int  # bytes of the pool whose registration failed
    bytes_stored: int
    compress_s: float

class _CudaInfo(TypedDict):
    available: bool | None  # None: found, not initialised (cuda_info(initialize=False))
    reason: str | None
    initialized: bool  # cudaGetDeviceCount was called in this process
    skipped: str | None  # runtimes that loaded but could not count devices, and why
    library: str | None
    via: str | None
    device_count: int | None  # None when not initialised
    runtime_version: int
    driver_version: int

# ------------------------------------------------------------------- classes

class Buffer:
    """Page-aligned host memory filled by a load (buffer protocol: 1-D bytes)."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @property
    def address(self) -> int: ...

# A chunk of a held save: (stripe, offset in it, bytes, offset of its slot in the pool file or -1).
ChunkSlot = tuple[int, int, int, int]
# A held file: (index into files, base stripe to link from, [(offset, len, xxh3-64)] its pieces must have).
HeldFile = tuple[int, str, Sequence[tuple[int, int, int]]]

class SaveJob:
    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until every byte is staged (or the job ended). None, inf or any huge
        timeout waits for good; NaN raises ValueError; negative polls. Interrupted
        (Ctrl-C), this and the other waits cancel the job and join it, then raise."""
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until written and fsync'd (or failed); same timeouts as wait_staged."""
    def release_sources(self) -> None:
        """Drop the references that kept the source tensors alive; call once staged."""
    def cancel(self) -> None:
        """Stop the save (it then fails with "save cancelled"); a no-op once done."""
    @property
    def staged(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    def rethrow(self) -> None:
        """Raise the job's first error, if any."""
    def checksums(self) -> list[list[int]]:
        """Per input segment, the xxh3-64 of each chunk_bytes-aligned piece."""
    def progress(self) -> tuple[int, int]:
        """(bytes written or linked (held files), bytes_total)."""
    def stats(self) -> _SaveStats: ...
    def wait_checksummed(self, timeout: float | None = None) -> bool:
        """Wait until every chunk is staged and checksummed, or the job ended."""
    @property
    def checksummed(self) -> bool: ...
    @property
    def holds_slots(self) -> bool:
        """Started with hold_slots=True and the pool can hold the whole save."""
    @property
    def pool_wait_s(self) -> float:
        """Seconds the start waited for the staging pool (a background reserve, or growing it)."""
    def chunk_slots(self) -> list[ChunkSlot]: ...
    def held_results(self) -> list[tuple[int, int]]:
        """(outcome, errno) per file: 0 not held, 1 linked, 2 changed (written), 3 link
        refused (written), 4 pool too small to hold (written), 5 undecided (failed)."""
    def chunk_frames(self) -> list[list[int]]:
        """Per file, per chunk in file order: its frame's length, 0 written as staged."""
    def release_slots(self) -> None:
        """Give a held save's slots back to the pool (after the job is done)."""

class Engine:
    """Owns a staging pool (reused by every save) and, once a save copies from a
    GPU, the pool's pinning and the copy streams."""

    def __init__(self, chunk_bytes: int, max_staging_bytes: int = 0) -> None: ...
    def start_save(self, files: Sequence[SaveFile], segments: Sequence[Segment], keepalive: Any,
                   backend: str = "auto", queue_depth: int = ..., copy_threads: int = ...,
                   direct: bool = True, streams: Sequence[Stream] = ..., hold_slots: bool = False,
                   host_files: Sequence[HostFile] = ..., remote: Any = None,
                   held: Sequence[HeldFile] = ..., planes: Sequence[Sequence[tuple[int, int]]] = ...,
                   compress_level: int = 1, hash_while_copying: bool = False) -> SaveJob:
        """Open the stripes and start staging + writing; keepalive must own every
        segment address until staged. host_files: more host-memory segments as a
        plan's columns (no tuple per tensor). Returns once the GPU copies are ordered after
        `streams`. held: files staged but written only if a checksum differs from the
        base stripe's, else hard-linked from it (local files only).
        Defaults: DEFAULTS["write_queue_depth"], DEFAULTS["copy_threads"]."""
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def pool_bytes(self) -> int: ...
    @property
    def max_staging_bytes(self) -> int: ...  # 0: unbounded
    @property
    def pool_pinned(self) -> bool: ...
    @property
    def pool_unpinned_bytes(self) -> int: ...
    @property
    def pool_numa_node(self) -> int: ...  # -1: the kernel's default
    @property
    def pool_numa_error(self) -> str | None: ...
    @property
    def pool_pages(self) -> str | None: ...
    @property
    def pin_error(self) -> str | None: ...
    def trim(self) -> int:
        """Free the pool (bytes freed); 0 while a save holds or reserves slots."""
    def reserve(self, nbytes: int, device: int = -1) -> None:
        """Allocate and fault in (device >= 0: also page-lock) slots for nbytes now."""
    def set_backing_file(self, path: str) -> None:
        """Map the pool's slabs from this file from now on (e.g. on /dev/shm)."""
    @property
    def file_backed(self) -> bool: ...
    @property
    def backing_error(self) -> str | None:
        """Why the backing file could not grow (the pool then uses private memory)."""

class LoadJob:
    def wait(self, timeout: float | None = None) -> bool: ...
    def cancel(self) -> None:
        """Stop the load (it then fails with "load cancelled"); a no-op once done."""
    def rethrow(self) -> None: ...
    def buffers(self) -> list[Buffer | None]:
        """Per file, in the order of `files`: its whole-file buffer, or None for a file
        wholly placed."""
    def mismatches(self) -> list[Mismatch]: ...
    @property
    def elapsed_s(self) -> float: ...
    @property
    def backend(self) -> str: ...
    @property
    def files_direct(self) -> int: ...
    @property
    def received_uncopied(self) -> int:
        """Bytes received from an NFS server straight into their destinations (no copy)."""

# ----------------------------------------------------------------- functions

def owned_tensor(file_offset: int, nbytes: int) -> object:
    """A DLPack capsule (for torch.from_dlpack) of `nbytes` uint8 of fresh memory that owns
    itself, placed within its page as file byte `file_offset` is, with the file's pages it
    touches mapped: a direct placement (device -2) of those bytes reads them there with
    O_DIRECT. Freed with the tensor torch makes of it."""

def start_load(files: Sequence[LoadFile], pieces: Sequence[Piece], backend: str = "auto",
               queue_depth: int = ..., chunk_bytes: int = ..., verify_threads: int = ...,
               direct: bool = True, placements: Sequence[Placement] = ...,
               streams: Sequence[Stream] = ..., remote: object = None,
               keepalive: object = None, frames: Sequence[Sequence[int]] = ...) -> LoadJob:
    """Read files, verifying pieces as chunks arrive. Placed bytes go through bounce
    buffers (pinned when some go to a GPU): each chunk is verified, then copied out on
    the job's threads; a direct placement (device -2, memory from `owned_tensor`) is read
    straight into its memory; the rest of a file is read whole into an aligned buffer.
    Destinations must stay valid until the job is done: `keepalive` (their owners) is
    released only once the job is joined. A wait that Ctrl-C interrupts cancels and
    joins the job before KeyboardInterrupt leaves it. Defaults:
    DEFAULTS["read_queue_depth"], ["read_chunk_bytes"], ["verify_threads"]."""

def checksum(b: _BufferLike, /) -> int:
    """XXH3-64 of a contiguous buffer (GIL released)."""

def checksum_path() -> str:
    """Which XXH3 the checksums run: "avx2" or "scalar"."""

# A piece of a snapshot restore: (destination address or 0 to check in place,
# source address, nbytes, expected xxh3-64).
CopyPiece = tuple[int, int, int, int]

def copy_verify(pieces: Sequence[CopyPiece], verify: bool = True, threads: int = 1) -> list[Mismatch]:
    """Copy (and check) snapshot pieces on several threads; the mismatches by index (GIL released)."""

def punch_holes(fd: int, keep: Sequence[tuple[int, int]], size: int) -> int:
    """Free the pages of fd in [0, size) outside the (offset, nbytes) ranges of keep; bytes freed."""

class SnapshotMapping:
    """Whole pages of a file, (file offset, nbytes) each, mapped contiguously: copy-on-write, or
    the file's own pages with ``shared=True`` (a file this process has taken for itself); its
    buffer is ``size`` bytes from ``lead`` bytes into the first. It holds the open file, and a
    flock taken on it, while it lives."""
    def __init__(self, fd: int, segments: Sequence[tuple[int, int]], lead: int, size: int,
                 shared: bool = False) -> None: ...
    @property
    def address(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def plan_chunks(sizes: Sequence[int], segments: Sequence[tuple[int, int, int]],
                chunk_bytes: int) -> tuple[list[PlanChunk], list[int]]:
    """The chunk arithmetic of a save, for tests. segments: (nbytes, file, offset).
    Returns (chunks, segment_hash_start)."""

class WalkResult:
    """What walk_state met: the tree, and one entry per tensor met in each column, in
    walk order (aliases included: flatten.py resolves them). The columns are plain
    lists the caller may change."""
    @property
    def tree(self) -> Any:
        """The state with every tensor replaced by its node."""
    @property
    def tensors(self) -> list[Any]: ...
    @property
    def keys(self) -> list[str]: ...
    @property
    def nodes(self) -> list[dict]: ...
    @property
    def dtypes(self) -> list[Any]: ...
    @property
    def shapes(self) -> list[str]:
        """As text: "4096,1024", "" for a scalar."""
    @property
    def ptrs(self) -> list[int]:
        """data_ptr(), 0 for an empty tensor."""
    @property
    def bases(self) -> list[int]:
        """Address of storage element 0 in the tensor's dtype, 0 if empty."""
    @property
    def nbytes(self) -> list[int]:
        """Bytes each tensor shows."""
    @property
    def flags(self) -> list[int]:
        """WALK_* bits."""
    @property
    def used(self) -> set[str]:
        """Every key handed out, for keys made later."""

def walk_state(state: Any, tensor: type, parameter: type, odict: type, other: Any, leaf: Any, check: Any,
               check_all: bool, max_depth: int) -> WalkResult:
    """flatten.py's tree walk, natively (csrc/python/state_walk.hpp): the plain containers
    and tensors here; other(v, prefix) -> node | tensor for everything else, leaf(k, where)
    -> node for dict keys that are not str or tuple, check(t, where) raises for a tensor
    that cannot be stored (called for subclasses, and every tensor when check_all)."""

def layout_stripes(keys: list[str], dtypes: list[Any], shapes: list[str], nbytes: list[int],
                   dtype_codes: dict[Any, tuple[str | None, int]], names: Sequence[str], metadata_json: str,
                   quote: Any) -> list[tuple[bytes, int, list[int], list[int]]]:
    """plan.py's stripe layout, one file per name: [(header, size, members, offsets)].
    dtype_codes: {dtype: (safetensors code or None for bytes, itemsize)}; quote(key)
    spells a key that needs escapes as a JSON string (json.dumps). ValueError names the
    file whose header would pass MAX_HEADER_BYTES."""

def fsync_dir(path: str, /) -> None: ...
def rename_exchange(a: str, b: str, /) -> bool:
    """Atomically swap two paths; False where the file system cannot."""
def probe_direct(dir: str, /) -> bool:
    """Whether O_DIRECT writes work in this directory."""
def io_uring_compiled() -> bool: ...
def io_uring_library() -> dict[str, str] | None:
    """Which liburing the build links: {'source': 'system' | 'vendored', 'version': '2.15'}; None without io_uring."""
def io_uring_probe() -> int:
    """0 when a ring can be set up here, else the errno."""
def bounce_pool_bytes() -> int:
    """Bytes of the pinned bounce pool kept for loads to GPUs (0: none)."""
def release_bounce_pool() -> int:
    """Drop the pinned bounce pool kept for loads to GPUs; returns its bytes."""
def _cuda_pin(addr: int, nbytes: int, device: int = 0) -> str:
    """cudaHostRegister of freshly mapped memory as the staging pool does it: "" or the error."""
class WriteWatch:
    """The kernel's record of which memory was written (Linux 6.7); OSError where it cannot."""
    def __init__(self) -> None: ...
    def arm(self, ranges: Sequence[tuple[int, int]]) -> list[bool]: ...
    def scan(self, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Per range: 0, or | 1 (a page of its own changed), | 2 / | 4 (its first / last page,
        shared with other memory, changed). Protects every page again."""
    @property
    def pid(self) -> int: ...

def cuda_info(initialize: bool = True) -> _CudaInfo:
    """The CUDA runtime flashwrite uses. initialize=False never initialises CUDA
    (dlopen, symbols and versions only), unless it already was."""
# ---- nfs:// (csrc/io/nfs_client, csrc/python/nfs_bindings.cpp): libnfs loaded at run time
def zstd_support() -> dict[str, Any]:
    """{'usable': bool, 'version': str | None, 'error': str | None}: libzstd, loaded at run time."""
def codec_compress(data: _BufferLike, width: int, level: int = 1) -> bytes:
    """One frame (codec.hpp): ``data`` split into ``width``-byte planes, each zstd'd or stored."""
def codec_decompress(data: _BufferLike, raw_len: int) -> bytes:
    """The ``raw_len`` bytes a frame holds; CorruptCheckpointError when malformed or short."""
def codec_rate(data: _BufferLike, width: int, level: int = 1, repeat: int = 1) -> tuple[int, float, float]:
    """(frame bytes, compress s, decompress s) per pass on one thread, round trip checked."""
def nfs_support() -> dict[str, Any]:
    """{'compiled', 'usable', 'reason' (why not, or None), 'headers', 'library' (the libnfs loaded)}."""
def nfs_available() -> bool:
    """Whether libnfs can be loaded (dlopen)."""
def nfs_unavailable_reason() -> str:
    """Why nfs:// cannot work here (what to install), or ''."""
def nfs_exports(server: str, timeout_ms: int = 10000) -> list[str]:
    """The exports SERVER lists (MOUNT EXPORT via the portmapper)."""

class NfsClient:
    """An NFSv3 client over several TCP connections (one more for directory operations).
    Every method that talks to the server releases the GIL; errors are OSError with the
    errno of the NFS status and the object named as nfs://server[:port]/export/path."""
    def __init__(self, server: str, export: str, nfs_port: int = 0, mount_port: int = 0, connections: int = 4,
                 depth: int = 16, io_bytes: int = 1048576, timeout_ms: int = 10000) -> None: ...
    def url(self, path: str, /) -> str: ...
    @property
    def connections(self) -> int: ...
    def stat(self, path: str, /) -> tuple[bool, bool, int]:
        """(exists, is_dir, size)"""
    def listdir(self, path: str, /) -> list[str]: ...
    def mkdir(self, path: str, /) -> None: ...
    def rmdir(self, path: str, /) -> None: ...
    def unlink(self, path: str, /) -> None: ...
    def rename(self, src: str, dst: str, /) -> None: ...
    def link(self, src: str, dst: str) -> None:
        """Make DST a hard link to the file SRC (NFS LINK)."""
    def write_file(self, path: str, data: Any, exclusive: bool = True) -> dict[str, int]:
        """Create PATH, write DATA (a buffer, kept alive and unchanged by the caller until this
        returns) with UNSTABLE WRITEs over the connections, COMMIT, and check the write verifiers,
        rewriting what a server restart may have lost: {bytes, rewrites, commit_rounds}."""
    def read_into(self, path: str, out: Any, offset: int = 0) -> int:
        """Read from OFFSET of PATH into the writable buffer OUT; returns the bytes read."""
