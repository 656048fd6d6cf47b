"""engine/gguf/reader.py reads what gguf-py's own reader reads: every metadata value with its
types, every tensor's name, type, shape, offset and data; and refuses broken files with a
ValueError (the loader's clear error) instead of a crash."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from engine.gguf.reader import GGUFFile


def write_file(path, alignment: int | None = None) -> None:
    """A GGUF file with every kind of value and tensor the loader meets."""
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("t.u32", 7)
    writer.add_int32("t.i32", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_uint8("t.u8", 255)
    writer.add_int8("t.i8", -128)
    writer.add_uint16("t.u16", 65535)
    writer.add_int16("t.i16", -32768)
    writer.add_string("t.str", "héllo ▁wörld 🙂")
    writer.add_string("t.empty", "")
    writer.add_array("t.tokens", ["<s>", "", "▁a", "Ġb", "\n", "日本"] * 50)
    writer.add_key_value("t.scores", [0.25, -1.5, 3.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    writer.add_key_value("t.types", [1, 3, 4, 1], GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_key_value("t.flags", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    writer.add_array("t.nested", [[1, 2], [3]])
    gen = np.random.default_rng(0)
    w = gen.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quants.quantize(w, T.Q4_1), raw_dtype=T.Q4_1)
    writer.add_tensor("blk.0.attn_k.weight", quants.quantize(w, T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", gen.standard_normal(64).astype(np.float32))
    writer.add_tensor("token_embd.weight", gen.standard_normal((5, 64)).astype(np.float16))
    writer.add_tensor("blk.0.ffn_up.weight", gen.standard_normal((3, 4, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64], ids=["default-alignment", "alignment-64"])
def test_reads_what_gguf_py_reads(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write_file(path, alignment)
    ref, ours = GGUFReader(str(path)), GGUFFile(path)
    # gguf-py adds three fields of its own for the header (GGUF.version, ...).
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.types == tuple(ref.fields[key].types), key
        if key != "t.nested":  # gguf-py flattens arrays of arrays (its own FIXME); kept nested here
            assert field.contents() == ref.fields[key].contents(), key
    assert ref.fields["t.nested"].contents() == [1, 2, 3]
    assert ours.fields["t.str"].contents() == "héllo ▁wörld 🙂"
    assert ours.fields["t.nested"].contents() == [[1, 2], [3]]
    assert ours.data_offset == ref.data_offset and ours.data_offset % (alignment or 32) == 0
    assert len(ours.tensors) == len(ref.tensors) == 5
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable


def test_the_bundled_file_reads_as_gguf_py_reads_it(default_model_files):
    """The real file: SmolLM2's 49,152-token vocabulary and merges, 272 Q4_1 / F32 tensors."""
    from engine.default_model import _gguf_path

    ref, ours = GGUFReader(str(_gguf_path())), GGUFFile(_gguf_path())
    for key, field in ours.fields.items():
        assert field.types == tuple(ref.fields[key].types) and field.contents() == ref.fields[key].contents(), key
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert [(t.name, t.tensor_type, t.data_offset, t.data.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.data.shape) for t in ref.tensors]
    for a, b in zip(ours.tensors[:3], ref.tensors[:3]):
        assert np.array_equal(a.data, b.data)


@pytest.mark.parametrize("cut", [3, 20, 40, 500, -10], ids=lambda c: f"cut-{c}")
def test_truncated_files_are_a_value_error(tmp_path, cut):
    path = tmp_path / "t.gguf"
    write_file(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError):
        GGUFFile(path)


def test_other_files_are_a_value_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file at all" * 4)
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(path)
