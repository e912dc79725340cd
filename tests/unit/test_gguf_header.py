"""ember's GGUF header reader against the gguf package's own reader on the same bytes: every value
type, plain and block-quantized tensors, and the files it refuses."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ember.loaders.gguf_header import GGUFFormatError, read_header


def _file_of_every_kind(path):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo ⟨ember⟩")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.texts", ["a", "", "Ġthe", "日本"])
    writer.add_array("t.empty", [])
    generator = np.random.default_rng(0)
    writer.add_tensor("plain32", generator.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("plain16", generator.standard_normal((2, 32)).astype(np.float16))
    weights = generator.standard_normal((4, 64), dtype=np.float32)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        blocks = gguf.quants.quantize(weights, kind)
        writer.add_tensor(f"blocks_{kind.name}", blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _package_reading(path):
    reader = gguf.GGUFReader(path, "r")
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return metadata, {tensor.name: tensor for tensor in reader.tensors}


def test_values_and_tensors_are_the_packages_own(tmp_path):
    path = _file_of_every_kind(tmp_path / "kinds.gguf")
    header = read_header(path)
    metadata, tensors = _package_reading(path)
    assert header.metadata == metadata
    assert {key: type(value) for key, value in header.metadata.items()} == {
        key: type(value) for key, value in metadata.items()}
    assert header.metadata["t.texts"] == ["a", "", "Ġthe", "日本"] and header.metadata["t.u64"] == 2**63 + 5
    assert list(header.tensors) == list(tensors)
    for name, theirs in tensors.items():
        ours = header.tensors[name]
        assert ours.tensor_type == theirs.tensor_type and ours.shape.tolist() == theirs.shape.tolist()
        assert (ours.n_elements, ours.n_bytes, ours.data_offset) == (theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data))
        assert np.array_equal(gguf.quants.dequantize(ours.data, ours.tensor_type),
                              gguf.quants.dequantize(theirs.data, theirs.tensor_type))


def test_a_value_that_is_not_utf8_is_left_out_and_the_rest_is_read(tmp_path):
    path = _file_of_every_kind(tmp_path / "kinds.gguf")
    data = bytearray(path.read_bytes())
    at = data.index("héllo".encode())
    data[at:at + 2] = b"\xff\xfe"  # the text's first two bytes, same length
    path.write_bytes(bytes(data))
    header = read_header(path)
    assert "t.text" not in header.metadata
    assert header.metadata["t.texts"] == ["a", "", "Ġthe", "日本"] and len(header.tensors) == 4


@pytest.mark.parametrize("keep", [3, 30, 0.5, 0.99])
def test_a_cut_off_file_is_refused(tmp_path, keep):
    path = _file_of_every_kind(tmp_path / "kinds.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(GGUFFormatError):
        read_header(path)


def test_an_unknown_value_type_and_version_are_refused(tmp_path):
    path = _file_of_every_kind(tmp_path / "kinds.gguf")
    data = bytearray(path.read_bytes())
    key = data.index(b"t.u8") + len(b"t.u8")
    data[key:key + 4] = (77).to_bytes(4, "little")  # the first value's type
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="unknown type 77"):
        read_header(path)
    data[4:8] = (9).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="version 9"):
        read_header(path)
