"""Read-only, memory-mapped tensors of one ``.safetensors`` file, bfloat16 included.

``safetensors.safe_open(..., framework="numpy")`` cannot return bfloat16 tensors (NumPy has no
such dtype), and most released LLM checkpoints (Qwen2.5, Llama 3) are stored in bfloat16. The
format is a little-endian u64 header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` and the raw row-major data; this module maps the data and
hands out NumPy views (bfloat16 through ``ml_dtypes``, which JAX ships), so indexing a view
reads only the pages of the slice asked for.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 << 20          # bytes: the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file (names the file and what is wrong)."""


class SafetensorsFile:
    """The tensors of ``path``: names, shapes, and memory-mapped NumPy views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(f"{self.path}: header length {n} does not fit the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path}: the header is not JSON ({e})") from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype = np.dtype(DTYPES[e["dtype"]])
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except KeyError as missing:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has no usable {missing} "
                                       f"(dtypes read: {', '.join(DTYPES)})") from None
            if end - begin != dtype.itemsize * int(np.prod(shape)) or self._start + end > size:
                raise SafetensorsError(f"{self.path}: tensor {name!r}: data offsets {begin}..{end} do not hold "
                                       f"{e['dtype']}{list(shape)} within the file")
            self._entries[name] = (dtype, shape, begin, end)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._start else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def array(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` (nothing is read until it is indexed or copied)."""
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype)
        return self._map[self._start + begin:self._start + end].view(dtype).reshape(shape)
