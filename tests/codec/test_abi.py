"""The kernels' shared definitions come from the header, once: the error modes, and the
``loco::EncodeArgs`` layout that the CUDA launcher packs with NumPy and g++ lays out itself."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from lowbitcc.codec import abi, cpu, cuda, cuda_build, kernels
from lowbitcc.codec.error_state import STORAGE, ErrorState
from lowbitcc.codec.interface import EncodeArgs

needs_cpu = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU codec could not be built")


def test_error_modes_are_read_from_the_header():
    assert abi.ERROR_MODES == {None: 0, "int8": 1, "fp32": 2, "bf16": 3}
    assert set(STORAGE) == set(abi.ERROR_STORAGES)


@needs_cpu
def test_numpy_layout_of_encode_args_matches_gxx():
    layout = cpu.load().encode_args_layout()
    dtype = abi.encode_args_dtype()
    assert dtype.itemsize == layout.pop("sizeof")
    assert {name: dtype.fields[name][1] for name in dtype.names} == layout


def _args(rows=2, m=300, G=128, state="int8", has_error=True, keys=None) -> EncodeArgs:
    ng = -(-m // G)
    return EncodeArgs(
        source=torch.randn(rows * m), rows=rows, m=m, factor=0.5,
        messages=torch.zeros(rows, 32 + 4 * ng + ng * G // 2 + 4, dtype=torch.uint8),
        state=None if state is None else ErrorState.zeros(rows * ng * G, state, G),
        has_error=has_error, beta=0.8, bits=4, group_size=G, keys=keys,
        nonfinite=torch.zeros(rows * ng, dtype=torch.uint8),
        sums=torch.zeros(2, dtype=torch.float64), threads=1)


def test_cuda_struct_packs_every_field_at_its_offset():
    args = _args(keys=(7, 9))
    packed = cuda.pack_encode_args(args)
    raw = np.frombuffer(packed.tobytes(), dtype=np.uint8)
    assert raw.size == abi.encode_args_dtype().itemsize
    fields = abi.encode_args_dtype().fields
    assert int(packed["msgs"]) == args.messages.data_ptr()
    assert int(packed["ecodes"]) == args.state.data.data_ptr()
    assert int(packed["ef32"]) == 0 and int(packed["ebf16"]) == 0
    assert packed["mode"] == abi.ERROR_MODES["int8"] and packed["stochastic"] == 1
    assert (packed["k0"], packed["k1"]) == (7, 9)
    assert np.frombuffer(raw[fields["m"][1]:fields["m"][1] + 8].tobytes(), np.int64)[0] == 300


@pytest.mark.parametrize("state", [None, "int8", "fp32", "bf16"])
@pytest.mark.parametrize("has_error", [False, True])
def test_cuda_struct_points_at_the_error_state_it_has_and_nothing_else(state, has_error):
    args = _args(state=state, has_error=has_error and state is not None)
    if args.state is not None:
        args.state.poison = torch.zeros(8, dtype=torch.uint8)
    packed = cuda.pack_encode_args(args)
    data = 0 if args.state is None else args.state.data.data_ptr()
    assert int(packed["ecodes"]) == (data if state == "int8" else 0)
    assert int(packed["escales"]) == (args.state.scales.data_ptr() if state == "int8" else 0)
    assert int(packed["ef32"]) == (data if state == "fp32" else 0)
    assert int(packed["ebf16"]) == (data if state == "bf16" else 0)
    assert int(packed["invalid"]) == (args.state.poison.data_ptr() if args.has_error else 0)
    assert packed["mode"] == abi.ERROR_MODES[state] and packed["has_error"] == int(args.has_error)
    assert int(packed["src"]) == args.source.data_ptr() and int(packed["clear"]) == 0


@pytest.mark.parametrize("dtype, values", [
    (cuda_build.ROW_CHECK, (tuple(range(8)), 3, 1, 4, 2, 1, (2**40 + 3, 7, 1, 2, 2**41 + 8))),
    (cuda_build.FRAME_ARGS, (tuple(range(8, 16)), 2, 100, 2**63 + 5, 2**40 + 1, 5, 1, 2**33 + 9,
                             2**34 + 16)),
])
def test_struct_arguments_hold_their_fields_in_order_and_zero_padding(dtype, values):
    packed = cuda_build.struct_value(dtype, values)
    expected = np.zeros((), dtype=dtype)
    for name, value in zip(dtype.names, values):
        expected[name] = value
    assert packed.tobytes() == expected[()].tobytes()
    header = bytes(range(32))
    assert cuda_build.header_words(header) == tuple(
        int.from_bytes(header[i:i + 4], "little") for i in range(0, 32, 4))


@needs_cpu
@pytest.mark.parametrize("state", [None, "int8", "fp32", "bf16"])
def test_cpu_and_reference_agree_through_one_argument_object(state):
    ref, ker = _args(state=state, has_error=False), _args(state=state, has_error=False)
    ker.source.copy_(ref.source)
    kernels.REFERENCE.encode(ref)
    cpu.KERNELS.encode(ker)
    assert torch.equal(ref.messages, ker.messages)
    assert torch.equal(ref.nonfinite, ker.nonfinite)
    if state is not None:
        assert torch.equal(ref.state.data, ker.state.data)


@needs_cpu
@pytest.mark.parametrize("field, bad", [("nonfinite", torch.zeros(1, dtype=torch.uint8)),
                                        ("sums", torch.zeros(2)),
                                        ("messages", torch.zeros(2, 8, dtype=torch.uint8))])
def test_cpu_kernel_checks_every_buffer_before_writing(field, bad):
    args = _args()
    setattr(args, field, bad)
    with pytest.raises(RuntimeError, match=field if field != "messages" else "too short"):
        cpu.KERNELS.encode(args)


@needs_cpu
def test_cpu_kernel_checks_the_error_state_size():
    args = _args()
    args.state = ErrorState.zeros(128, "int8", 128)  # one group; the call has 2 rows of 3
    with pytest.raises(RuntimeError, match="error codes holds 128 elements, expected 768"):
        cpu.KERNELS.encode(args)



CUDA_STRUCTS = {"loco_cuda::Header": cuda_build.HEADER_WORDS,
                "loco_cuda::CallCount": cuda_build.CALL_COUNT,
                "loco_cuda::RowCheck": cuda_build.ROW_CHECK,
                "loco_cuda::FrameArgs": cuda_build.FRAME_ARGS,
                "loco_cuda::SumSource": cuda_build.SUM_SOURCE}
"""The structs the CUDA launcher passes by value, and the NumPy layouts it packs them in."""
HEADER_ARRAY = np.dtype(("<u4", (8,)))
"""``loco_cuda::Header::w``: the header's eight words."""


def _layout_checks(structs: dict[str, np.dtype]) -> str:
    """A `static_assert` of each struct's size and of each field's offset as its NumPy dtype
    has them (``Header``'s words are one array ``w``)."""
    checks = ["#include <cstddef>", "#include <type_traits>"]
    for struct, dtype in structs.items():
        checks.append(f'static_assert(sizeof({struct}) == {dtype.itemsize}, "{struct} size");')
        fields = ({"w": (HEADER_ARRAY, 0)} if struct.endswith("Header")
                  else {name: dtype.fields[name][:2] for name in dtype.names})
        for name, (field, offset) in fields.items():
            member = f"decltype({struct}::{name})"
            checks += [f'static_assert(offsetof({struct}, {name}) == {offset}, "{struct}.{name}");',
                       f'static_assert(sizeof({member}) == {field.itemsize}, '
                       f'"{struct}.{name} size");']
            if field.kind in "iu":  # integers and pointers (packed as unsigned words)
                checks.append(f'static_assert(std::is_signed<{member}>::value == '
                              f'{str(field.kind == "i").lower()}, "{struct}.{name} sign");')
    return "\n".join(checks) + "\n"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("wrong", ["", "moved", "unsigned"],
                         ids=["as-packed", "a-field-moved", "a-field-unsigned"])
def test_the_cuda_structs_have_the_layouts_the_launcher_packs(wrong, tmp_path):
    """nvcc compiles the CUDA source (no kernel instance: about 2 s) with the structs' sizes,
    offsets, field widths and signedness asserted as the launcher packs them; a field moved
    on one side only fails (NVRTC has no ``offsetof``)."""
    structs = dict(CUDA_STRUCTS)
    if wrong == "moved":
        fields = {name: cuda_build.SUM_SOURCE.fields[name][0] for name in ("msgs", "stride", "k",
                                                                              "verdict")}
        structs["loco_cuda::SumSource"] = np.dtype(list(fields.items()), align=True)
    elif wrong == "unsigned":
        structs["loco_cuda::SumSource"] = np.dtype(
            [("msgs", "<u8"), ("k", "<u8"), ("stride", "<i8"), ("verdict", "<u8")], align=True)
    source = tmp_path / "layouts.cu"
    source.write_text(cuda_build.SOURCE.read_text() + _layout_checks(structs))
    done = subprocess.run(["nvcc", "-std=c++17", f"-I{cuda_build.CSRC}",
                           "-gencode=arch=compute_80,code=sm_80", "-c", "-o",
                           str(tmp_path / "layouts.o"), str(source)],
                          capture_output=True, text=True, timeout=300)
    if wrong:
        assert done.returncode != 0 and "SumSource.k" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stderr[-4000:]
