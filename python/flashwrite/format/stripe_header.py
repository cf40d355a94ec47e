"""On load, each stripe's own safetensors header must describe exactly what the
manifest says of that stripe: the same tensors, dtypes, shapes and byte ranges."""

from __future__ import annotations

from . import dtypes
from ..errors import CorruptCheckpointError
from . import safetensors_header
from .manifest import FileEntry, TensorEntry

_FIELD_NAMES = {"dtype": "dtype", "shape": "shape", "data_offsets": "byte range"}


def _written(e: TensorEntry, code: str | None, header_bytes: int) -> dict:
    """What the writer put in the header for manifest entry ``e`` (plan.py): dtypes
    safetensors cannot name are stored as U8 bytes, 1-D."""
    rel = e.offset - header_bytes
    return {"dtype": code or "U8", "shape": list(e.shape) if code else [e.nbytes], "data_offsets": [rel, rel + e.nbytes]}


def check_stripe_header(buf: memoryview, fe: FileEntry, entries: list[TensorEntry]) -> None:
    """The stripe's own safetensors header (``buf``: its ``fe.header_bytes`` bytes) must
    describe exactly ``entries``, the manifest's tensors in that stripe."""
    n = safetensors_header.header_length(buf, fe.size, fe.name)
    if n + 8 != fe.header_bytes:
        raise CorruptCheckpointError(f"{fe.name}: header length {n} does not match the manifest "
                                     f"({fe.header_bytes - 8})", file=fe.name)
    if len(buf) < 8 + n:
        raise CorruptCheckpointError(f"{fe.name}: header was cut short", file=fe.name)
    text = bytes(buf[8:8 + n])
    header, _ = safetensors_header.parse_object(text, fe.name)
    # The whole header at once (C-speed dict comparison); the checks below, one tensor
    # at a time, run only to name what differs (or when JSON booleans could pass as 0/1).
    codes: dict[str, str | None] = {}
    for e in entries:
        if e.dtype not in codes:
            codes[e.dtype] = dtypes.safetensors_code(dtypes.dtype_from_name(e.dtype))
    expected = {e.key: _written(e, codes[e.dtype], fe.header_bytes) for e in entries}
    if header == expected and b"true" not in text and b"false" not in text:
        return
    safetensors_header.check_entries(header, fe.size - fe.header_bytes, fe.name)
    _name_the_difference(header, expected, entries, fe)


def _name_the_difference(header: dict, expected: dict, entries: list[TensorEntry], fe: FileEntry) -> None:
    def bad(msg: str, tensor: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{fe.name}: {msg}", file=fe.name, tensor=tensor)

    want = set(expected)
    if set(header) != want:
        extra = sorted(set(header) - want)[:3]
        missing = sorted(want - set(header))[:3]
        raise bad(f"header tensors differ from the manifest (extra {extra}, missing {missing})")
    for e in entries:
        h = header[e.key]
        for field, want_v in expected[e.key].items():
            got = h.get(field)
            if got != want_v:
                rel = e.offset - fe.header_bytes
                shown = f"{e.dtype} {list(e.shape)} at {rel}..{rel + e.nbytes}"
                raise bad(f"tensor {e.key!r}: {_FIELD_NAMES[field]} disagrees between the manifest ({shown}: header "
                          f"should say {field}={want_v}) and the stripe header ({field}={str(got)[:80]})", e.key)
