"""engine/safetensors_io.py against the safetensors library (the format's reference): the same
tensors, bit for bit, for every dtype a checkpoint holds; malformed files refused naming the file
and the tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.safetensors_io import SafetensorsFile


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_every_dtype_reads_as_safetensors_reads_it(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, generator=g)
    tensors = {
        "f64": x.double(),
        "f32": x,
        "f16": x.half(),
        "bf16": x.bfloat16(),
        "e4m3": (x * 10).to(torch.float8_e4m3fn),
        "e5m2": x.to(torch.float8_e5m2),
        "e8m0": torch.randint(0, 255, (4, 5), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "i32": torch.randint(-(2**20), 2**20, (2, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**10), 2**10, (5,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (9, 2), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (1, 1, 3), generator=g, dtype=torch.uint8),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with SafetensorsFile(path) as mine, safe_open(path, framework="pt") as ref:
        assert sorted(mine.keys()) == sorted(ref.keys()) == sorted(tensors)
        assert mine.metadata == {"format": "pt"}
        for name in tensors:
            got, want = mine.read(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bits(got), _bits(want)), name
            info = mine.tensors[name]
            assert (info.dtype, list(info.shape)) == (
                ref.get_slice(name).get_dtype(),
                ref.get_slice(name).get_shape(),
            )


def test_read_into_fills_a_matching_destination_and_declines_the_rest(tmp_path) -> None:
    w = torch.randn(6, 8).bfloat16()
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, str(path))
    big = torch.zeros(10, 6, 8, dtype=torch.bfloat16)
    with SafetensorsFile(path) as f:
        assert f.read_into("w", big[3])  # a contiguous region of a larger parameter
        assert torch.equal(big[3], w) and int(big[:3].count_nonzero()) == int(big[4:].count_nonzero()) == 0
        untouched = torch.zeros(8, 6, dtype=torch.bfloat16)
        assert not f.read_into("w", torch.zeros(6, 8))  # another dtype
        assert not f.read_into("w", untouched)  # another shape
        assert not f.read_into("w", untouched.t())  # the shape, not contiguous
        assert int(untouched.count_nonzero()) == 0


def _raw(tmp_path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + data)
    return path


@pytest.mark.parametrize(
    "header, data, header_len, message",
    [
        ({}, b"", 1 << 40, "header length 1099511627776 exceeds"),
        (b"{not json", b"", None, "header is not JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "'w' needs dtype, shape and data_offsets"),
        ({"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "dtype 'Q4_K'"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "malformed shape"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "not its size"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "outside the file"),
    ],
    ids=["huge-header", "not-json", "not-object", "no-offsets", "dtype", "shape", "size", "outside"],
)
def test_a_malformed_file_is_refused_naming_it(tmp_path, header, data, header_len, message) -> None:
    path = _raw(tmp_path, header, data, header_len)
    with pytest.raises(ValueError, match="bad.safetensors") as err:
        SafetensorsFile(path)
    assert message in str(err.value)
