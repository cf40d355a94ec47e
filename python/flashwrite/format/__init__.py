"""On-disk format, version 4: the manifest (``flashwrite.json``), the Hugging Face style
index, and the checks that make a checkpoint safe to open. One module a job:

- ``manifest``: the format's constants and entry types, and building a manifest;
- ``encoding``: the bytes of flashwrite.json (the packed table, the seal);
- ``validate``: reading a manifest as hostile input (``table`` checks its tensor table);
- ``merge``: the per-rank manifests merged on save, one rank's part selected on load;
- ``safetensors_header``: the one parser of safetensors headers, with their bounds;
- ``stripe_header``: a stripe's own header checked against the manifest on load;
- ``tree``: the manifest's tree of the saved structure, walked as hostile input;
- ``dtypes``: torch dtype <-> name <-> safetensors code;
- ``hints``: what a path that is not a checkpoint is, and what to do with it.

The ground floor: it owns its constants and imports only ``errors``, ``system`` and
``_core``, never the planner, the targets or the I/O above it.

Version 3 added to version 2 a SHA-256 of the manifest's own content
(``manifest_checksum``), so an edited manifest cannot load as a different state; version 4
stores the tensor table packed (see ``encoding``). Manifests of versions 1 to 3 still
load; for every version, each tensor's dtype, shape and byte range is cross-checked
against its stripe's own safetensors header.

This package re-exports the names the rest of flashwrite uses.
"""

from .encoding import content_digest, decode_manifest_json, encode_manifest, pack_table, unpack_table
from .manifest import (
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PACKED_FIELD,
    PACKED_SINCE,
    READABLE_VERSIONS,
    SEAL_FIELD,
    SEALED_SINCE,
    FileEntry,
    Manifest,
    TensorEntry,
    assemble,
    build_index,
    build_manifest,
    piece_count,
    piece_ranges,
)
from .merge import combine, merge_manifests, rank_section, select_rank
from .stripe_header import check_stripe_header
from .validate import check_manifest_seal, check_member_name, parse_manifest, read_manifest

__all__ = [
    "FORMAT_VERSION", "INDEX_NAME", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "PACKED_FIELD", "PACKED_SINCE",
    "READABLE_VERSIONS", "SEAL_FIELD", "SEALED_SINCE", "FileEntry", "Manifest", "TensorEntry", "assemble",
    "build_index", "build_manifest", "check_manifest_seal", "check_member_name", "check_stripe_header", "combine",
    "content_digest", "decode_manifest_json", "encode_manifest", "merge_manifests", "pack_table", "parse_manifest",
    "piece_count", "piece_ranges", "rank_section", "read_manifest", "select_rank", "unpack_table",
]
