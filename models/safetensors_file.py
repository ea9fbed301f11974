"""`.safetensors` files read through the `safetensors` library's numpy path (no torch).

`read_header` opens a file with `safetensors.safe_open`, which refuses a truncated file, a
malformed header and tensors whose byte ranges do not tile the data exactly, and lists the
tensors, refusing dtypes outside `ITEMSIZE`. `read_tensor` reopens the file and copies one tensor,
or rows [start, stop) of its leading axis (`get_slice`: only those bytes of the memory map are
touched), into a fresh array; the map is closed before it returns, so host memory holds only what
was asked for. bfloat16 arrives as `ml_dtypes.bfloat16`. Every refusal is a one-line
`SafetensorsError` naming the file, and the tensor where one is at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes  # noqa: F401  registers "bfloat16" with numpy, which the library's numpy path needs
import numpy as np
from safetensors import SafetensorError, safe_open

# Bytes per element of the stored dtypes the loader accepts (the library's numpy path fails on
# its float8/float4 ones).
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# The end of the library's message for a tensor whose byte range does not match its shape; it
# does not say which tensor.
_UNNAMED_MISMATCH = "invalid shape, data type, or offset for tensor"


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, malformed or uses an unsupported dtype."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of `file`, by name."""
    file = Path(file)
    tensors = {}
    with _open(file) as f:
        for name in f.keys():
            view = f.get_slice(name)
            if view.get_dtype() not in ITEMSIZE:
                raise SafetensorsError(f"{file}: tensor {name} has unsupported dtype {view.get_dtype()}")
            tensors[name] = TensorInfo(file, name, tuple(view.get_shape()))
    return tensors


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """Read one tensor (or rows [start, stop) of its leading axis) into a fresh array."""
    with _open(info.file) as f:
        return f.get_tensor(info.name) if rows is None else f.get_slice(info.name)[rows[0]:rows[1]]


@contextlib.contextmanager
def _open(file: Path) -> Iterator:
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        reason = str(e)
        if reason.endswith(_UNNAMED_MISMATCH):
            reason += f" {_mismatched_tensor(file)}"
        raise SafetensorsError(f"{file}: corrupted or truncated safetensors file: {reason}") from None


def _mismatched_tensor(file: Path) -> str:
    """The tensor of `file` whose byte range does not match its shape and dtype.

    Only called once the library has parsed the header (and found such a tensor), so the header
    is well-formed here.
    """
    with open(file, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    for name, t in header.items():
        begin, end = t["data_offsets"]
        if t["dtype"] in ITEMSIZE and end - begin != math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]:
            return name
    return "of a dtype the loader does not read"
