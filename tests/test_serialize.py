"""Tests of the ferry file format (src/ferry/program/format.py, codec.py, validate.py)."""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import mmap
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edits import header_of, json_paths, metadata_of, parent_of, rebuild
from ferry.device import CPU, Device
from ferry.errors import ProgramError
from ferry.program import (
    DEFAULT_ARG,
    Buffer,
    ConstValue,
    Delegate,
    DelegateCall,
    KernelCall,
    Method,
    MutableBuffer,
    PlanEntry,
    Program,
    TensorValue,
    load_program,
    program_to_bytes,
    save_program,
    validate_program,
)
from ferry.program import format as ser
from ferry.program.schema import CONST_KINDS

CUDA0, CUDA1 = Device("cuda", 0), Device("cuda", 1)


# ------------------------------------------------------------------ hand-built programs


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def cpu_program() -> Program:
    """A CPU method: an input, two constants, a scalar, two planned values."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([0.5, -1.0, 2.0])
    values = [
        TensorValue("float32", (2, 3), name="x", storage="input"),
        TensorValue("float32", (2, 3), constant=0, name="weight"),
        TensorValue("float32", (3,), constant=1, name="bias"),
        ConstValue("scalar", 1),
        TensorValue("float32", (2, 3), plan=PlanEntry(1, 0), name="mul"),
        TensorValue("float32", (2, 3), plan=PlanEntry(1, 64), name="out"),
    ]
    m = Method(
        name="forward",
        values=values,
        instructions=[
            KernelCall("aten::mul.out", (0, 1, 4), (4,)),
            KernelCall("aten::add.out", (4, 2, 3, 5), (5,)),
        ],
        inputs=[0],
        outputs=[5],
        buffers=[Buffer(0), Buffer(128)],
        lower_bounds={"cpu:0": 88},
    )
    return Program(methods={"forward": m}, segments=[tensor_bytes(w), tensor_bytes(b)])


def every_const() -> list[ConstValue]:
    """One ConstValue per kind (tensor ids refer to values 1..3 of full_program)."""
    return [
        ConstValue("none", None),
        ConstValue("int", -(2**63)),
        ConstValue("int", 2**63 - 1),
        ConstValue("float", 0.1),
        ConstValue("float", -0.0),
        ConstValue("float", math.inf),
        ConstValue("float", -math.inf),
        ConstValue("float", 1e-310),
        ConstValue("bool", True),
        ConstValue("str", "h\u00e9llo \u2603 \"quoted\" \\ \n"),
        ConstValue("str", ""),
        ConstValue("ints", [1, -2, 2**40]),
        ConstValue("ints", []),
        ConstValue("floats", [1.5, math.inf, -math.inf, 1e300, -2.0]),
        ConstValue("bools", [True, False]),
        ConstValue("dtype", "bfloat16"),
        ConstValue("layout", "strided"),
        ConstValue("memory_format", "channels_last"),
        ConstValue("device", "cuda:1"),
        ConstValue("tensors", [1, 2]),
        ConstValue("opt_tensors", [1, None, 3]),
        ConstValue("scalar", 3),
        ConstValue("scalar", 2.5),
        ConstValue("scalar", False),
        ConstValue("scalar", -math.inf),
        ConstValue("symint", 64),  # value 36 of full_program
        ConstValue("symints", [12, 36]),  # an int constant and the symint above
    ]


def full_program() -> Program:
    """Two GPUs, a custom device, delegates, mutable buffers, dynamic dims, aliases, all kinds."""
    f32 = 4
    values = [
        TensorValue("float32", (4, 8), dynamic=(True, False), name="x", storage="input"),  # 0: caller-owned input
        TensorValue("float32", (4, 8), CUDA0, plan=PlanEntry(1, 0), dynamic=(True, False)),  # 1
        TensorValue("float32", (4, 8), CUDA0, plan=PlanEntry(1, 128)),  # 2
        TensorValue("float32", (4, 8), CUDA1, plan=PlanEntry(2, 0)),  # 3
        TensorValue("float32", (4, 8), CPU, plan=PlanEntry(3, 0), name="out"),  # 4
        TensorValue("float32", (8,), CPU, plan=PlanEntry(3, 128), constant=2, name="running"),  # 5
        TensorValue("float32", (8,), CPU, plan=PlanEntry(3, 160)),  # 6
        TensorValue("float32", (32,), CPU, alias_of=4, name="flat"),  # 7
        TensorValue("bfloat16", (3,), CPU, constant=3, name="w_bf16"),  # 8
        TensorValue("float32", (2,), Device("my_accel", 2), plan=PlanEntry(4, 64)),  # 9
        TensorValue("int64", (0, 5), CPU, plan=PlanEntry(3, 192)),  # 10: empty tensor
    ]
    consts = every_const()
    first_const = len(values)
    values += consts
    shape_id = first_const + [c.kind for c in consts].index("ints")
    m = Method(
        name="forward",
        values=values,
        instructions=[
            KernelCall("et_copy::_h2d_copy.out", (0, 1), (1,)),
            DelegateCall(0, (1,), (2,)),
            KernelCall("et_copy::_d2d_copy.out", (2, 3), (3,)),
            DelegateCall(1, (3,), (4,)),
            KernelCall("aten::view", (4, shape_id), (7,)),
            KernelCall("aten::add.out", (5, 8, DEFAULT_ARG, 6), (6,)),
        ],
        inputs=[0],
        outputs=[4, 7],
        buffers=[
            Buffer(0),
            Buffer(256, CUDA0),
            Buffer(128, CUDA1),
            Buffer(192, CPU),
            Buffer(72, Device("my_accel", 2)),
        ],
        mutable_buffers=[MutableBuffer(5, 6, "running")],
        lower_bounds={"cuda:0": 256, "cuda:1": 128, "cpu:0": 192, "my_accel:2": 8},
        runtime_allocating_ops=["aten::nonzero", "aten::unique"],
    )
    empty = Method("empty", [], [], [], [], [Buffer(0)])
    delegates = [
        Delegate("torch", (("target_device", b"cuda:0"), ("blob", bytes(range(256)))), 0),
        Delegate("torch", (("target_device", b"cuda:1"), ("empty", b"")), 1),
    ]
    segments = [
        b"payload-0" * 11,
        b"",
        tensor_bytes(torch.linspace(0, 1, 8)),
        tensor_bytes(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)),
    ]
    assert len(segments[2]) == 8 * f32
    return Program(methods={"forward": m, "empty": empty}, delegates=delegates, segments=segments)


def assert_same_program(a: Program, b: Program) -> None:
    """Exact equality: repr tells 1 from 1.0, -0.0 from 0.0, list from tuple, and nan is 'nan'."""
    assert repr(a.methods) == repr(b.methods)
    assert repr(a.delegates) == repr(b.delegates)
    assert list(a.methods) == list(b.methods)
    assert [bytes(s) for s in a.segments] == [bytes(s) for s in b.segments]


def load_or_none(data) -> Program | None:
    """Load; a ProgramError is fine (None). Anything loaded must validate. Nothing else may escape."""
    try:
        prog = load_program(data)
    except ProgramError:
        return None
    validate_program(prog)
    return prog


# ------------------------------------------------------------------ round trips


def test_cpu_program_round_trips_through_bytes():
    prog = cpu_program()
    data = program_to_bytes(prog)
    loaded = load_program(data)
    assert loaded.methods == prog.methods
    assert loaded.delegates == prog.delegates
    assert loaded.segments == prog.segments  # memoryview == bytes compares contents
    assert_same_program(loaded, prog)
    assert loaded == prog
    # deterministic, and a loaded program re-serialises to the same bytes
    assert program_to_bytes(loaded) == data
    w = torch.frombuffer(bytearray(loaded.segments[0]), dtype=torch.float32).reshape(2, 3)
    assert torch.equal(w, torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_full_program_round_trips_through_bytes_and_file(tmp_path):
    prog = full_program()
    data = program_to_bytes(prog)
    from_bytes = load_program(data)
    assert_same_program(from_bytes, prog)
    path = tmp_path / "full.ferry"
    save_program(prog, path)
    assert path.read_bytes() == data
    from_file = load_program(path)
    assert_same_program(from_file, prog)
    from_str_path = load_program(str(path))
    assert_same_program(from_str_path, prog)
    assert program_to_bytes(from_file) == data


def test_round_trip_preserves_types_and_special_floats():
    prog = full_program()
    loaded = load_program(program_to_bytes(prog))
    m = loaded.method("forward")
    consts = [v for v in m.values if isinstance(v, ConstValue)]
    assert [c.kind for c in consts] == [c.kind for c in every_const()]
    assert set(CONST_KINDS) <= {c.kind for c in consts}
    by_kind = {}
    for c in consts:
        by_kind.setdefault(c.kind, []).append(c.value)
    assert by_kind["float"][2] == math.inf and by_kind["float"][3] == -math.inf
    assert math.copysign(1.0, by_kind["float"][1]) == -1.0  # -0.0 keeps its sign
    assert by_kind["float"][4] == 1e-310
    assert [type(v) for v in by_kind["scalar"]] == [int, float, bool, float]
    assert by_kind["opt_tensors"] == [[1, None, 3]]
    assert by_kind["int"] == [-(2**63), 2**63 - 1]
    x = m.tensor(0)
    assert x.shape == (4, 8) and isinstance(x.shape, tuple)
    assert x.dynamic == (True, False)
    assert m.tensor(7).alias_of == 4
    assert m.tensor(9).device == Device("my_accel", 2)
    assert m.buffers[2] == Buffer(128, CUDA1)
    assert m.mutable_buffers == [MutableBuffer(5, 6, "running")]
    assert loaded.delegates[0].spec("blob") == bytes(range(256))
    assert loaded.delegates[1].spec("empty") == b""
    assert isinstance(loaded.delegates[0].compile_specs, tuple)
    meta = loaded.method_meta("forward")
    assert meta.num_memory_planned_buffers() == 4
    assert meta.memory_planned_buffer_device(1) == CUDA1


def test_nan_round_trips_as_nan():
    prog = cpu_program()
    m = prog.method("forward")
    m.values += [
        ConstValue("float", math.nan),
        ConstValue("floats", [1.0, math.nan]),
        ConstValue("scalar", math.nan),
    ]
    loaded = load_program(program_to_bytes(prog)).method("forward")
    a, b, c = loaded.values[-3:]
    assert isinstance(a.value, float) and math.isnan(a.value)
    assert b.value[0] == 1.0 and math.isnan(b.value[1])
    assert isinstance(c.value, float) and math.isnan(c.value)
    assert '"nan"' in json.dumps(metadata_of(program_to_bytes(prog)))


def test_file_segments_are_zero_copy_aligned_memoryviews(tmp_path):
    prog = full_program()
    path = tmp_path / "p.ferry"
    save_program(prog, path)
    data = path.read_bytes()
    _, _, _, _, area = header_of(data)
    table = metadata_of(data)["segments"]
    loaded = load_program(path)
    assert len(loaded.segments) == len(table) == 4
    for seg, (off, size), orig in zip(loaded.segments, table, prog.segments):
        assert isinstance(seg, memoryview)
        assert seg.readonly
        assert isinstance(seg.obj, mmap.mmap)  # a view into the mapping, not a copy
        assert (area + off) % ser.SEGMENT_ALIGNMENT == 0
        assert seg.nbytes == size == len(orig)
        assert data[area + off : area + off + size] == orig == seg
        if size:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer warns about read-only memory
                ptr = torch.frombuffer(seg, dtype=torch.uint8).data_ptr()
            assert ptr % ser.SEGMENT_ALIGNMENT == 0


def test_mapping_outlives_program_and_survives_overwrite(tmp_path):
    path = tmp_path / "p.ferry"
    save_program(cpu_program(), path)
    loaded = load_program(path)
    seg = loaded.segments[1]
    expected = bytes(cpu_program().segments[1])
    del loaded
    gc.collect()
    assert bytes(seg) == expected  # the memoryview keeps the mmap alive
    # saving over a mapped file replaces it; the old mapping keeps the old contents
    other = full_program()
    save_program(other, path)
    assert bytes(seg) == expected
    assert_same_program(load_program(path), other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.ferry"]  # no temp file left


def test_program_methods_use_the_format(tmp_path):
    prog = cpu_program()
    assert prog.to_bytes() == program_to_bytes(prog)
    prog.save(tmp_path / "m.ferry")
    assert (tmp_path / "m.ferry").read_bytes() == program_to_bytes(prog)


def test_bytes_like_inputs():
    data = program_to_bytes(cpu_program())
    buf = bytearray(data)
    from_ba = load_program(buf)
    buf[:] = bytes(len(buf))  # the caller's buffer changes; the program does not
    assert_same_program(from_ba, cpu_program())
    assert_same_program(load_program(memoryview(data)), cpu_program())
    assert_same_program(load_program(memoryview(bytearray(data))), cpu_program())
    with pytest.raises(TypeError, match="path or bytes"):
        load_program(12)


def test_layout_matches_the_spec():
    prog = full_program()
    data = program_to_bytes(prog)
    magic, version, flags, meta_len, area = header_of(data)
    assert magic == b"FERRY\x00PG" == ser.MAGIC
    assert (version, flags) == (3, ser.FLAG_CHECKSUMS)
    assert area % 64 == 0 and 32 + meta_len + 32 <= area < 32 + meta_len + 32 + 64
    assert data[32 + meta_len : 64 + meta_len] == hashlib.sha256(data[32 : 32 + meta_len]).digest()
    assert data[64 + meta_len : area] == bytes(area - 64 - meta_len)
    meta = metadata_of(data)
    assert set(meta) == {"methods", "delegates", "segments", "segment_sha256"}
    assert meta["segment_sha256"] == [hashlib.sha256(bytes(s)).hexdigest() for s in prog.segments]
    assert all(off % 64 == 0 for off, _ in meta["segments"])
    last_off, last_size = meta["segments"][-1]
    assert len(data) == area + last_off + last_size
    assert meta["delegates"][0]["compile_specs"][0] == ["target_device", "Y3VkYTow"]
    v = meta["methods"][0]["values"][1]
    assert v["device"] == "cuda:0" and v["plan"] == {"buffer": 1, "offset": 0}
    assert b"pickle" not in data and data[32 : 32 + meta_len].isascii()


def test_empty_program_round_trips():
    prog = Program(methods={})
    data = program_to_bytes(prog)
    assert len(data) == 128  # 32-byte header + 43 bytes of JSON, padded to a multiple of 64
    assert load_program(data) == prog


# ------------------------------------------------------------------ versions and headers


@pytest.mark.parametrize("version", [4, 7, 2**32 - 1])
def test_newer_version_is_refused(version):
    data = bytearray(program_to_bytes(cpu_program()))
    struct.pack_into("<I", data, 8, version)
    with pytest.raises(ProgramError, match=rf"format version {version} is newer than this ferry supports \(3\); upgrade ferry"):
        load_program(bytes(data))


def test_a_version_2_file_reads_as_it_did():
    """Version 3 stores a constant's bytes in the memory order of its strides; version 2 stored
    every constant row-major and recorded none, which reads the same under version 3's rule."""
    data = bytearray(program_to_bytes(cpu_program()))
    struct.pack_into("<I", data, 8, 2)
    assert_same_program(load_program(bytes(data)), cpu_program())


def test_newer_version_is_refused_from_file(tmp_path):
    data = bytearray(program_to_bytes(cpu_program()))
    struct.pack_into("<I", data, 8, 4)
    (tmp_path / "new.ferry").write_bytes(data)
    with pytest.raises(ProgramError, match=r"new\.ferry.*format version 4 is newer .*\(3\); upgrade ferry"):
        load_program(tmp_path / "new.ferry")


@pytest.mark.parametrize(
    "offset, fmt, value, message",
    [
        (0, "8s", b"PK\x03\x04xxxx", "not a ferry program"),
        (8, "<I", 0, "format version 0 is not valid"),
        (8, "<I", 1, "format version 1 is no longer read: it predates storage kinds .* compile the model again"),
        (12, "<I", 0, "flags 0x0 are not valid"),
        (12, "<I", 3, "flags 0x3 are not valid"),
        (16, "<Q", 2**64 - 1, "metadata length 18446744073709551615 exceeds the file"),
        (24, "<Q", 2**63, "segment-area offset 9223372036854775808 is invalid"),
        (24, "<Q", 65, "segment-area offset 65 is invalid"),
        (24, "<Q", 0, "segment-area offset 0 is invalid"),
    ],
)
def test_bad_headers(offset, fmt, value, message):
    data = bytearray(program_to_bytes(cpu_program()))
    struct.pack_into(fmt, data, offset, value)
    with pytest.raises(ProgramError, match=message):
        load_program(bytes(data))


def test_empty_and_tiny_inputs(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ProgramError, match="empty"):
        load_program(tmp_path / "empty")
    with pytest.raises(ProgramError, match="truncated"):
        load_program(b"FERRY\x00PG\x01")
    with pytest.raises(ProgramError, match="not a ferry program"):
        load_program(b"\x80\x04\x95" + bytes(40))  # a pickle is not a program
    with pytest.raises(FileNotFoundError):
        load_program(tmp_path / "missing.ferry")


def test_every_truncation_is_refused(tmp_path):
    data = program_to_bytes(full_program())
    for n in range(len(data)):
        with pytest.raises(ProgramError):
            load_program(data[:n])
    (tmp_path / "t.ferry").write_bytes(data[:-1])
    with pytest.raises(ProgramError, match=r"t\.ferry.*segment 3 .* exceeds the segment area.*truncated"):
        load_program(tmp_path / "t.ferry")


def test_trailing_bytes_are_refused():
    data = program_to_bytes(cpu_program())
    with pytest.raises(ProgramError, match="does not match its layout"):
        load_program(data + b"\x00")


# ------------------------------------------------------------------ malformed metadata


def test_metadata_json_errors():
    data = program_to_bytes(cpu_program())
    meta = metadata_of(data)
    cases = {
        b"\xff\xfe": "not valid UTF-8",
        b"{": "not valid JSON",
        b"[" * 100_000 + b"]" * 100_000: "nests 100000 levels",
        b'{"methods": [], "methods": [], "delegates": [], "segments": []}': "duplicate key 'methods'",
        b'{"methods": [], "delegates": [], "segments": [], "x": NaN}': "NaN is not valid JSON",
        b'{"methods": [], "delegates": [], "segments": [], "x": 1e999}': "overflows a float",
        b'{"methods": [], "delegates": [], "segments": [], "x": 1' + b"0" * 5000 + b"}": "more than 24 digits",
        b'{"methods": [], "delegates": [], "segments": [], "segment_sha256": [], "x": "' + b"1" * 5000 + b'"}': r"unknown key\(s\) 'x'",
        b"[]": "expected an object, got array",
        json.dumps({**meta, "pickle": "cos\nsystem"}).encode(): "unknown key",
    }
    for raw, message in cases.items():
        with pytest.raises(ProgramError, match=message):
            load_program(rebuild(data, None, raw=raw))


def edited(data: bytes, edit) -> bytes:
    meta = metadata_of(data)
    edit(meta)
    return rebuild(data, meta)


def _value(meta, i):
    return meta["methods"][0]["values"][i]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: _value(m, 5)["plan"].update(offset=112), r"method 'forward' value 5: plan offset 112 \+ 24 bytes exceeds buffer 1 size 128"),
        (lambda m: _value(m, 5)["plan"].update(buffer=2), "plan buffer 2 is out of range"),
        (lambda m: _value(m, 5).update(device="cuda:0"), "tensor on cuda:0 is planned in buffer 1 on cpu:0"),
        (lambda m: _value(m, 1).update(shape=[2, 4]), r"constant segment 0 has 24 bytes but the tensor \(float32\[2, 4\]\) needs 32"),
        (lambda m: _value(m, 1).update(constant=9), "constant segment 9 is out of range"),
        (lambda m: _value(m, 1).update(dtype="float128"), "unknown dtype 'float128'"),
        (lambda m: _value(m, 1).update(device="CUDA:0"), "is not '\\[rankN:\\]type:index'"),
        (lambda m: _value(m, 1).update(device="cuda:-1"), "is not '\\[rankN:\\]type:index'"),
        (lambda m: _value(m, 1).update(shape=[2, -3]), r"shape\[1\]: integer -3 is out of range"),
        (lambda m: _value(m, 1).update(shape=[1] * 65), "65 dimensions"),
        (lambda m: _value(m, 1).update(dynamic=[True]), "dynamic has 1 flags for a shape of 2"),
        (lambda m: _value(m, 4).update(alias_of=4), "value 4 is an alias of itself"),
        (lambda m: (_value(m, 4).update(alias_of=5), _value(m, 5).update(alias_of=4)), "does not own memory"),
        (lambda m: _value(m, 4).update(alias_of=3), "alias of value 3, which is not a tensor"),
        (lambda m: _value(m, 3).update(kind="complex"), "unknown constant kind 'complex'"),
        (lambda m: _value(m, 3).update(kind="tensors", value=[0, 3]), r"value 3 \(tensors\)\[1\]: value 3 is not a tensor"),
        (lambda m: _value(m, 3).update(kind="bool", value=1), "expected a bool, got number 1"),
        (lambda m: _value(m, 3).update(kind="int", value=2**63), "expected an int64"),
        (lambda m: _value(m, 3).update(kind="float", value="Infinity"), "expected a number or 'inf'"),
        (lambda m: _value(m, 3).update(kind="dtype", value="floaty"), "expected a dtype name, got string 'floaty'"),
        (lambda m: _value(m, 3).update(type="pickle"), "expected 'tensor' or 'const'"),
        (lambda m: _value(m, 0).pop("name"), "missing key"),
        (lambda m: m["methods"][0]["instructions"][1].update(args=[4, 2, 3, 6]), r"instruction 1 \(aten::add.out\) argument 3: value id 6 is out of range \(method has 6 values\)"),
        (lambda m: m["methods"][0]["instructions"][1].update(args=[4, 2, -2, 5]), r"integer -2 is out of range"),
        (lambda m: m["methods"][0]["instructions"].append({"type": "delegate", "delegate": 0, "args": [], "outputs": [], "scratch": []}), "delegate 0 is out of range"),
        (lambda m: m["methods"][0].update(outputs=[17]), "output 0: value id 17 is out of range"),
        (lambda m: m["methods"][0].update(inputs="0"), "expected an array, got string"),
        (lambda m: m["methods"][0].update(buffers=[]), "buffer 0 .* must exist"),
        (lambda m: m["methods"][0]["buffers"][1].update(size=-1), "integer -1 is out of range"),
        (lambda m: m["methods"][0].update(mutable_buffers=[{"value": 3, "update": 5, "name": ""}]), "mutable buffer 0 value: value 3 is not a tensor"),
        (lambda m: m["methods"][0].update(lower_bounds={"cpu:0": "big"}), "expected an integer, got string"),
        (lambda m: m["methods"].append(copy.deepcopy(m["methods"][0])), "duplicate method name 'forward'"),
        (lambda m: m["methods"][0].update(name=""), r"methods\[0\].name: must be a non-empty string"),
        (lambda m: m["segments"][1].__setitem__(0, 32), "segment 1 offset 32 is not a multiple of 64"),
        (lambda m: m["segments"][1].__setitem__(0, 0), "overlaps"),
        (lambda m: m["segments"][1].__setitem__(1, 2**62), "exceeds the segment area"),
        (lambda m: m["segments"].pop(), "does not match its layout"),
        (lambda m: m["delegates"].append({"backend_id": "torch", "compile_specs": [["k", "not base64!"]], "payload": 0}), "not valid base64"),
        (lambda m: m["delegates"].append({"backend_id": "torch", "compile_specs": [], "payload": 5}), "payload segment 5 is out of range"),
        (lambda m: m["delegates"].append({"backend_id": "", "compile_specs": [], "payload": 0}), r"delegates\[0\].backend_id: must be a non-empty string"),
    ],
)
def test_edited_metadata_is_refused_with_a_clear_message(edit, message):
    with pytest.raises(ProgramError, match=message):
        load_program(edited(program_to_bytes(cpu_program()), edit))


def test_custom_device_type_loads_without_registration():
    data = edited(
        program_to_bytes(cpu_program()),
        lambda m: (
            m["methods"][0]["buffers"][1].update(device="weird_npu:3"),
            _value(m, 4).update(device="weird_npu:3"),
            _value(m, 5).update(device="weird_npu:3"),
        ),
    )
    m = load_program(data).method("forward")
    assert m.buffers[1].device == Device("weird_npu", 3)
    assert m.tensor(5).device == Device("weird_npu", 3)


# ------------------------------------------------------------------ validate_program in memory


def test_validate_program_messages():
    prog = cpu_program()
    validate_program(prog)
    m = prog.method("forward")

    def check(mutate, message):
        p = cpu_program()
        mutate(p)
        with pytest.raises(ProgramError, match=message):
            validate_program(p)

    def set_value(i, **kw):
        def f(p):
            v = p.method("forward").values[i]
            p.method("forward").values[i] = type(v)(**{**v.__dict__, **kw})
        return f

    assert m.tensor(5).nbytes == 24
    check(set_value(5, plan=PlanEntry(1, 112)), r"method 'forward' value 5: plan offset 112 \+ 24 bytes exceeds buffer 1 size 128")
    check(set_value(5, shape=(2, "3")), r"values\[5\] shape\[1\] must be an integer, got str")
    check(set_value(5, dtype=torch.float32), "dtype must be a dtype name string")
    check(set_value(3, value=2**64), "must hold an int64, float or bool")
    check(set_value(3, kind="float", value=10**400), "must hold a float")
    check(set_value(3, kind="float", value="1.0"), "must hold a float, got str")
    check(set_value(3, kind="opt_tensors", value=[None, 9]), "value id 9 is out of range")
    check(set_value(0, device=Device("CUDA", 0)), "not a lowercase identifier")
    check(lambda p: p.segments.append("text"), "segment 2 must be bytes-like")
    check(lambda p: p.delegates.append(Delegate("torch", (("k", "str-not-bytes"),), 0)), "value must be bytes")
    check(lambda p: p.delegates.append(Delegate("torch", (), 2)), "payload segment 2 is out of range")
    check(lambda p: setattr(p.method("forward"), "name", "other"), "stored under 'forward' is named 'other'")
    check(lambda p: p.method("forward").instructions.append(DelegateCall(0, (0,), (5,))), "delegate 0 is out of range")
    check(lambda p: p.method("forward").instructions.append("aten::add"), "must be a KernelCall or DelegateCall")
    check(lambda p: p.method("forward").values.append(3), "must be a TensorValue or ConstValue")
    check(lambda p: p.method("forward").lower_bounds.update({"cpu:0": -5}), "lower_bounds for 'cpu:0' must be in")
    with pytest.raises(ProgramError, match="expected a ferry Program"):
        validate_program({"methods": {}})


def test_save_refuses_an_invalid_program_and_writes_nothing(tmp_path):
    prog = cpu_program()
    prog.method("forward").outputs.append(99)
    with pytest.raises(ProgramError, match="output 1: value id 99 is out of range"):
        save_program(prog, tmp_path / "bad.ferry")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProgramError):
        program_to_bytes(prog)


# ------------------------------------------------------------------ fuzzing

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
SMALL = program_to_bytes(cpu_program())
FULL = program_to_bytes(full_program())


@FUZZ
@given(data=st.sampled_from([SMALL, FULL]), cut=st.floats(0, 1, exclude_max=True))
def test_fuzz_random_truncations_raise(data, cut):
    n = int(len(data) * cut)
    with pytest.raises(ProgramError):
        load_program(data[:n])


@settings(FUZZ, max_examples=1500)
@given(base=st.sampled_from([SMALL, FULL]), flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 7)), min_size=1, max_size=4))
def test_fuzz_bit_flips(base, flips):
    data = bytearray(base)
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    prog = load_or_none(bytes(data))
    if prog is not None:  # whatever loads re-serialises and loads back the same
        assert_same_program(load_program(program_to_bytes(prog)), prog)


INTERESTING_U64 = [0, 1, 31, 32, 33, 63, 64, 65, 4096, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 64, 2**64 - 1]


@FUZZ
@given(
    base=st.sampled_from([SMALL, FULL]),
    field=st.sampled_from([16, 24]),
    value=st.one_of(st.sampled_from(INTERESTING_U64), st.integers(0, 2**64 - 1), st.integers(-128, 128)),
)
def test_fuzz_header_size_fields(base, field, value):
    data = bytearray(base)
    old = struct.unpack_from("<Q", data, field)[0]
    new = value if value >= 0 else max(0, min(2**64 - 1, old + value))
    struct.pack_into("<Q", data, field, new)
    prog = load_or_none(bytes(data))
    # any other metadata length cuts the JSON or pulls padding into it; any other segment-area
    # offset is unaligned, out of the file or leaves the layout inconsistent with the file size
    assert (prog is None) == (new != old)


REPLACEMENTS = [
    -1, -(2**63), -(2**64), 2**63, 2**64, 10**30, 0, 1, 2, 63, 64, 65, 1.5, -0.0, 1e308, "x", "", "nan", "inf",
    "cuda:0", "float32", None, True, False, [], {}, [0], [[0, 0]], {"type": "tensor"}, {"a": 1},
]


@settings(FUZZ, max_examples=1500)
@given(
    base=st.sampled_from([SMALL, FULL]),
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(["replace", "delete", "add_key", "dup"]), st.sampled_from(REPLACEMENTS)),
        min_size=1,
        max_size=3,
    ),
)
def test_fuzz_json_edits(base, edits):
    meta = metadata_of(base)
    for pick, op, new in edits:
        paths = [path for path, _ in json_paths(meta)]
        path = paths[pick % len(paths)]
        if not path:
            meta = copy.deepcopy(new) if op == "replace" else meta
            continue
        parent, key = parent_of(meta, path), path[-1]
        if op == "replace":
            parent[key] = copy.deepcopy(new)
        elif op == "delete":
            del parent[key]
        elif op == "add_key" and isinstance(parent[key], dict):
            parent[key]["extra"] = copy.deepcopy(new)
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
    prog = load_or_none(rebuild(base, meta))
    if prog is not None:
        assert_same_program(load_program(program_to_bytes(prog)), prog)


def test_fuzz_json_edit_can_still_load_a_valid_program():
    # the fuzz property is not vacuous: a harmless edit loads and changes what it should
    data = edited(SMALL, lambda m: _value(m, 0).update(name="renamed"))
    prog = load_or_none(data)
    assert prog is not None and prog.method("forward").tensor(0).name == "renamed"


# ------------------------------------------------------------------ checksums


def test_a_changed_byte_of_metadata_fails_its_checksum():
    data = bytearray(program_to_bytes(cpu_program()))
    meta_len = header_of(bytes(data))[3]
    i = 32 + meta_len // 2
    data[i] = ord("7") if data[i] != ord("7") else ord("8")
    with pytest.raises(ProgramError, match="metadata does not match its SHA-256"):
        load_program(bytes(data))
    with pytest.raises(ProgramError, match="metadata does not match its SHA-256"):
        load_program(rebuild(program_to_bytes(cpu_program()), metadata_of(program_to_bytes(cpu_program())),
                             checksum=False))


def test_a_changed_weight_is_found_on_request_and_a_changed_payload_always(tmp_path):
    data = bytearray(program_to_bytes(cpu_program()))
    area = header_of(bytes(data))[4]
    data[area + 3] ^= 0x40  # a bit of the first weight
    load_program(bytes(data))  # weights are checked on request: mapping a file stays free
    with pytest.raises(ProgramError, match="segment 0 does not match its SHA-256"):
        load_program(bytes(data), verify=True)
    full = bytearray(program_to_bytes(full_program()))
    meta = metadata_of(bytes(full))
    area = header_of(bytes(full))[4]
    full[area + meta["segments"][0][0]] ^= 1  # delegate 0's payload
    with pytest.raises(ProgramError, match="segment 0 does not match"):
        load_program(bytes(full))
