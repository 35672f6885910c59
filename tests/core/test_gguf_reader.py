"""``FastGGUFReader`` reads what gguf-py's ``GGUFReader`` reads: every field's parts (values,
dtypes and byte order), data indices, types and contents, and every tensor, on the default
model's file and on files holding each metadata type (empty arrays, nested arrays, strings with
multi-byte characters) in both byte orders."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from kiln.models.gguf_reader import FastGGUFReader
from kiln.models.loader import default_model_path


def assert_same_reading(path: str) -> None:
    theirs, ours = GGUFReader(path), FastGGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.name, mine.data, mine.types) == (field.offset, field.name, field.data, field.types)
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert mine.contents() == field.contents(), name
    assert ours.data_offset == theirs.data_offset and len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset
        )  # fmt: skip
        assert a.shape.tolist() == b.shape.tolist() and np.array_equal(a.data, b.data)


def test_the_default_model_reads_the_same():
    assert_same_reading(default_model_path())


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_metadata_type_reads_the_same(tmp_path, endian):
    path = str(tmp_path / "all.gguf")
    writer = GGUFWriter(path, "llama", endianess=endian)
    scalars = [
        (GGUFValueType.UINT8, 7), (GGUFValueType.INT8, -7), (GGUFValueType.UINT16, 700), (GGUFValueType.INT16, -700),
        (GGUFValueType.UINT32, 70000), (GGUFValueType.INT32, -70000), (GGUFValueType.UINT64, 2**40),
        (GGUFValueType.INT64, -(2**40)), (GGUFValueType.FLOAT32, 1.5), (GGUFValueType.FLOAT64, -2.25),
        (GGUFValueType.BOOL, True),
    ]  # fmt: skip
    for kind, value in scalars:
        writer.add_key_value(f"scalar.{kind.name}", value, kind)
        writer.add_key_value(f"array.{kind.name}", [value] * 3, GGUFValueType.ARRAY, sub_type=kind)
    writer.add_key_value("string", "Grüße, 世界", GGUFValueType.STRING)
    writer.add_key_value("array.strings", ["", "a", "Grüße", "世界 " * 40], GGUFValueType.ARRAY)
    writer.add_key_value("array.nested", [[1, 2], [3]], GGUFValueType.ARRAY)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(path)
    assert FastGGUFReader(path).fields["array.strings"].contents() == ["", "a", "Grüße", "世界 " * 40]


def test_an_empty_array_reads_the_same(tmp_path):
    """As llama.cpp's own writer may leave one (gguf-py's refuses to write it): a file of one field."""
    key = b"array.empty"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)  # version, tensors, fields
    field = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.INT32, 0)
    path = tmp_path / "empty.gguf"
    path.write_bytes(header + field)
    assert_same_reading(str(path))
    assert FastGGUFReader(str(path)).fields["array.empty"].contents() == []
