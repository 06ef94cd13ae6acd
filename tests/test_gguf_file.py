"""taps.models.gguf_file.GGUFFile against gguf-py's GGUFReader (every metadata value, every tensor's type, shape and
bytes), and its errors on files cut short or damaged: always GGUFFormatError naming the file or tensor."""
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_models import write_tiny_gguf  # noqa: E402

gguf = pytest.importorskip("gguf")

from taps.models.gguf_file import GGUFFile, GGUFFormatError  # noqa: E402


def _reference_value(field):
    """A gguf-py ReaderField as plain Python / numpy."""
    kinds = [t.name for t in field.types]
    if kinds[0] == "ARRAY":
        if kinds[1] == "STRING":
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.array([field.parts[i][0] for i in field.data])
    if kinds[0] == "STRING":
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def assert_same_as_gguf_py(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # gguf-py's own header entries
    assert sorted(keys) == sorted(ours.fields)
    for k in keys:
        want, got = _reference_value(ref.fields[k]), ours.field(k)
        if isinstance(want, np.ndarray):
            assert np.array_equal(want, np.asarray(got)) and want.dtype == np.asarray(got).dtype, k
        else:
            assert want == got and type(want) is type(got), k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert (o.ggml_type, o.shape) == (int(t.tensor_type), tuple(int(d) for d in t.shape)), t.name
        assert o.type_name == t.tensor_type.name
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), o.data), t.name
    return ours


def _with_every_metadata_kind(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 2 ** 32 - 1)
    w.add_int32("t.i32", -2 ** 31)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -2 ** 40)
    w.add_float64("t.f64", 1 / 3)
    w.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.empty", [])
    w.add_tensor("v", np.arange(5, dtype=np.float32))
    w.add_tensor("m", np.ones((3, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_gguf_py_reads(tmp_path):
    assert_same_as_gguf_py(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert_same_as_gguf_py(write_tiny_gguf(tmp_path / "qwen3.gguf", arch="qwen3", tied=True))
    f = assert_same_as_gguf_py(_with_every_metadata_kind(tmp_path / "kinds.gguf"))
    assert f.field("t.strings") == ["a", "", "ünï", "x" * 300] and f.field("t.u64") == 2 ** 63 + 5
    assert f.field("absent", 3) == 3
    assert np.array_equal(f.tensors["v"].data.view("<f4"), np.arange(5, dtype=np.float32))


def test_reads_the_shipped_target_file():
    from taps.models.target import find_smollm2_gguf

    f = assert_same_as_gguf_py(find_smollm2_gguf())
    assert len(f.field("tokenizer.ggml.tokens")) == 49152


def test_damaged_files_raise_format_errors(tmp_path):
    for whole in (write_tiny_gguf(tmp_path / "good.gguf"), _with_every_metadata_kind(tmp_path / "kinds.gguf")):
        data = whole.read_bytes()
        f = GGUFFile(whole)
        table_end = min(t.offset for t in f.tensors.values()) - f.alignment  # before the padding to the data
        for cut in sorted({0, 3, 4, 8, 16, 23, 24, 31, 40} | set(range(41, table_end, 13))):
            p = tmp_path / "cut.gguf"
            p.write_bytes(data[:cut])
            with pytest.raises(GGUFFormatError, match="cut.gguf"):
                GGUFFile(p)
    good = (tmp_path / "good.gguf").read_bytes()
    p = tmp_path / "short.gguf"  # the header whole, the last tensor's data cut
    p.write_bytes(good[:-100])
    f = GGUFFile(p)
    last = max(f.tensors.values(), key=lambda t: t.offset)
    with pytest.raises(GGUFFormatError, match=rf"{last.name}: .*short.gguf.*truncated"):
        last.data
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGUX" + good[4:])
    with pytest.raises(GGUFFormatError, match="magic.gguf: not a GGUF file"):
        GGUFFile(p)
    p = tmp_path / "v1.gguf"
    p.write_bytes(good[:4] + struct.pack("<I", 1) + good[8:])
    with pytest.raises(GGUFFormatError, match="version 1 is not supported"):
        GGUFFile(p)
    # the first metadata entry: key length u64 at 24, key, then its value type u32
    (key_len,) = struct.unpack_from("<Q", good, 24)
    at = 32 + key_len
    p = tmp_path / "vtype.gguf"
    p.write_bytes(good[:at] + struct.pack("<I", 99) + good[at + 4:])
    with pytest.raises(GGUFFormatError, match="unknown value type 99"):
        GGUFFile(p)


def test_unknown_tensor_type_errors_only_when_read(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf")
    f = GGUFFile(good)
    t = f.tensors["token_embd.weight"]
    data = bytearray(good.read_bytes())
    # the tensor's type u32 sits right after its name and dims in the tensor table
    name = t.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8 * len(t.shape)
    data[at:at + 4] = struct.pack("<I", 77)
    p = tmp_path / "type77.gguf"
    p.write_bytes(bytes(data))
    f = GGUFFile(p)
    assert f.tensors["token_embd.weight"].type_name == "77"
    with pytest.raises(GGUFFormatError, match="token_embd.weight: GGML type 77 is unknown"):
        f.tensors["token_embd.weight"].data
    # dims whose product overflows 64 bits: still "past the end", not a short view
    dims_at = at - 8 * len(t.shape)
    data[at:at + 4] = struct.pack("<I", t.ggml_type)
    data[dims_at:dims_at + 16] = struct.pack("<QQ", 2 ** 62, 2 ** 6)
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="token_embd.weight: its data ends at byte .* truncated"):
        GGUFFile(p).tensors["token_embd.weight"].data


def test_type_table_matches_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from taps.models.gguf_file import GGML_TYPES

    for ggml_type, (name, per_block, block_bytes) in GGML_TYPES.items():
        t = GGMLQuantizationType(ggml_type)
        assert (t.name, GGML_QUANT_SIZES[t]) == (name, (per_block, block_bytes)), ggml_type


def test_random_header_damage_raises_only_format_errors(tmp_path):
    """Single bytes of the header overwritten at random: the file opens or raises GGUFFormatError, and each
    tensor's data is returned or raises GGUFFormatError (never another exception, never a wrong-sized view)."""
    good = _with_every_metadata_kind(tmp_path / "kinds.gguf").read_bytes()
    f = GGUFFile(tmp_path / "kinds.gguf")
    table_end = min(t.offset for t in f.tensors.values()) - f.alignment
    rng = np.random.default_rng(0)
    p = tmp_path / "flip.gguf"
    for _ in range(300):
        data = bytearray(good)
        at = int(rng.integers(0, table_end))
        data[at] = int(rng.integers(0, 256))
        p.write_bytes(bytes(data))
        try:
            damaged = GGUFFile(p)
        except GGUFFormatError:
            continue
        for t in damaged.tensors.values():
            try:
                assert t.data.size == t.nbytes
            except GGUFFormatError:
                pass
