"""torch dtype <-> name <-> safetensors code.

Names in the manifest are torch's own (``"float8_e4m3fn"``). The safetensors code
is what the stripe header says; dtypes without a code every safetensors reader
knows are stored as ``U8`` bytes and keep their true dtype in the manifest.
"""

from __future__ import annotations

import torch

# Codes in the safetensors format since its first releases, so any reader opens them.
_ST_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_CODES[getattr(torch, _name)] = _code

# Every dtype whose tensors have whole-byte elements and can be created.
_EXTRA = ("complex32", "complex64", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
          "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
          # Shell dtypes for sub-byte integers: one element per byte in torch's storage.
          *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8)))

_BY_NAME: dict[str, torch.dtype] = {}
for _dt in list(_ST_CODES) + [getattr(torch, n) for n in _EXTRA if hasattr(torch, n)]:
    _BY_NAME[str(_dt).removeprefix("torch.")] = _dt


_NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in _BY_NAME.items()}
_BY_CODE: dict[str, torch.dtype] = {code: dt for dt, code in _ST_CODES.items()}


def dtype_name(dt: torch.dtype) -> str:
    name = _NAME_OF.get(dt)
    if name is None:
        raise TypeError(f"flashwrite cannot store tensors of dtype {dt}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}") from None


def safetensors_code(dt: torch.dtype) -> str | None:
    """The header code for ``dt``, or None when it is stored as raw bytes."""
    return _ST_CODES.get(dt)


def dtype_from_code(code: str) -> torch.dtype | None:
    """The dtype a safetensors header code names, or None for a code flashwrite does not know."""
    return _BY_CODE.get(code) if isinstance(code, str) else None


def itemsize(dt: torch.dtype) -> int:
    return dt.itemsize


def supported_dtypes() -> list[torch.dtype]:
    return list(_BY_NAME.values())
