"""A small reader for `.safetensors` files that needs neither torch nor memory maps.

Format: 8-byte little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}`), then the raw little-endian data.
Tensors are read one at a time (optionally only a range of leading-axis rows, which is a
contiguous byte range) with plain `readinto`, so host memory holds only what was asked for.
bfloat16 arrives as `ml_dtypes.bfloat16`. A truncated or malformed file is reported by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, malformed or uses an unsupported dtype."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse the header of `file` and check every tensor's bytes lie inside the file."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{file}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise SafetensorsError(
                f"{file}: truncated safetensors file (header of {n} bytes, file has {size})"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{file}: malformed safetensors header: {e}") from None
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta.get("dtype") not in DTYPES:
            raise SafetensorsError(f"{file}: tensor {name} has unsupported dtype {meta.get('dtype')}")
        dtype = np.dtype(DTYPES[meta["dtype"]])
        shape = tuple(int(s) for s in meta["shape"])
        begin, end = meta["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise SafetensorsError(f"{file}: tensor {name}: byte range does not match its shape")
        if 8 + n + end > size:
            raise SafetensorsError(
                f"{file}: truncated safetensors file: tensor {name} ends at byte {8 + n + end}, "
                f"file has {size}"
            )
        tensors[name] = TensorInfo(file, name, dtype, shape, 8 + n + begin, end - begin)
    return tensors


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Read one tensor (or rows [start, stop) of its leading axis) into a fresh array."""
    shape, offset = info.shape, info.offset
    if rows is not None:
        start, stop = rows
        row_bytes = math.prod(shape[1:]) * info.dtype.itemsize
        shape, offset = (stop - start, *shape[1:]), offset + start * row_bytes
    out = np.empty(shape, info.dtype)
    with open(info.file, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != out.nbytes:
        raise SafetensorsError(f"{info.file}: truncated safetensors file while reading {info.name}")
    return out
