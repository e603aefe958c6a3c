"""Reading safetensors files a tensor at a time with pread, no mmap.

safetensors' own reader maps the whole file and copies each tensor out of the mapping; every page
it touches stays mapped, and counted in the process's RSS, until the file is closed, so loading a
checkpoint peaks at about twice its weights. Here the header is parsed once and each tensor's
bytes are read (pread) straight into the destination parameter where it takes them as stored, or
into one temporary the size of that tensor: the page cache holds the file, the process only its
weights.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data after the header), and an
optional "__metadata__" entry of strings.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' own bound on the header (its MAX_HEADER_SIZE)
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # as the header names it (BF16, F8_E4M3, ...)
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


class SafetensorsFile:
    """One .safetensors file's header, and its tensors read on demand. ValueError naming the file
    for a header that is not the format (too long, not JSON, an unknown dtype, offsets that do not
    match the shape or fall outside the file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors, self.metadata = self._parse(os.fstat(self._fd).st_size)
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        where = f"safetensors file {str(self.path)!r}"
        if size < 8:
            raise ValueError(f"{where} is {size} bytes, shorter than its header length")
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{where}: header length {header_len} exceeds the file or the limit {MAX_HEADER_BYTES}"
            )
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{where}: header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start, data_len = 8 + header_len, size - 8 - header_len
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            except (TypeError, KeyError, ValueError):
                raise ValueError(f"{where}: tensor {name!r} needs dtype, shape and data_offsets") from None
            if dtype not in DTYPES:
                raise ValueError(f"{where}: tensor {name!r} has dtype {dtype!r}; known: {sorted(DTYPES)}")
            if not (
                isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
            ):
                raise ValueError(f"{where}: tensor {name!r} has a malformed shape or data_offsets")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * DTYPES[dtype].itemsize
            if not (0 <= begin and end - begin == nbytes and end <= data_len):
                raise ValueError(
                    f"{where}: tensor {name!r} ({dtype} {shape}, {nbytes} bytes) has data_offsets "
                    f"[{begin}, {end}] outside the file's {data_len} bytes of data or not its size"
                )
            tensors[name] = TensorInfo(dtype, tuple(shape), data_start + begin, nbytes)
        return tensors, metadata

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in memory of its own (as stored: dtype and shape from the header)."""
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype])
        self._read_bytes(info, out)
        return out

    def read_into(self, name: str, dest: torch.Tensor) -> bool:
        """Read the tensor straight into dest where dest takes its bytes as stored (same dtype,
        shape, contiguous) and return True; else False, nothing read."""
        info = self.tensors[name]
        if dest.dtype != DTYPES[info.dtype] or tuple(dest.shape) != info.shape or not dest.is_contiguous():
            return False
        self._read_bytes(info, dest)
        return True

    def _read_bytes(self, info: TensorInfo, out: torch.Tensor) -> None:
        if not info.nbytes:
            return
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < info.nbytes:
            n = os.preadv(self._fd, [view[done:]], info.offset + done)
            if n <= 0:
                raise ValueError(f"safetensors file {str(self.path)!r} ended inside a tensor")
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
