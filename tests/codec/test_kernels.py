"""The fused C++ CPU codec produces the reference's bytes, bit for bit (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import cpu
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.kernels import select
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.tools.selftest import same_bits
from tests.support.numerics import codec_case

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU codec could not be built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _codecs(bits, group, rounding="nearest", seed=0, fmt="int"):
    args = dict(bits=bits, group_size=group, dtype_code=0, seq=3, world=4, signature=11,
                rounding=rounding, seed=seed, fmt=fmt)
    return ShardCodec(kernels=select("reference"), **args), ShardCodec(kernels=select("cpu"), **args)


def _same_state(a: ErrorState | None, b: ErrorState | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    same_scales = (a.scales is None and b.scales is None) or torch.equal(
        a.scales.view(torch.int32), b.scales.view(torch.int32))
    return a.dtype == b.dtype and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) \
        and same_scales


def _assert_same_encoding(a, b) -> None:
    assert torch.equal(a.messages, b.messages)
    assert a.nonfinite == b.nonfinite
    if not any(a.nonfinite):
        assert _same_state(a.error, b.error)
        assert b.residual_sq == pytest.approx(a.residual_sq, rel=1e-6, abs=1e-9)


@given(
    rows=st.integers(1, 4), m=st.integers(1, 2500), bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([8, 32, 128]), dtype=st.sampled_from(DTYPES),
    error_dtype=st.sampled_from([None, "int8", "fp32", "bf16"]),
    with_state=st.booleans(), beta=st.sampled_from([0.0, 0.5, 0.8]),
    factor=st.sampled_from([1.0, 0.25, 1 / 3]), short=st.integers(0, 3),
    poison=st.sampled_from([None, "nan", "inf"]), seed=st.integers(0, 2**31 - 1),
    rounding=st.sampled_from(["nearest", "stochastic"]), stream=st.integers(0, 2**32 - 1),
)
@settings(max_examples=300, deadline=None)
def test_cpu_kernels_match_reference_bitwise(rows, m, bits, group, dtype, error_dtype,
                                             with_state, beta, factor, short, poison, seed,
                                             rounding, stream):
    gen = torch.Generator().manual_seed(seed)
    numel = max(1, rows * m - short * (m // 2))  # the last row may be partly past the end
    ref, ker = _codecs(bits, group, rounding, seed)
    x, state = codec_case(gen, numel, dtype, poison, error_dtype, with_state,
                          rows * ref.padded(m), group)
    shards = list(range(rows))
    a = ref.encode(x, rows, m, factor, None if state is None else state.clone(), beta, shards,
                   error_dtype, stream)
    b = ker.encode(x, rows, m, factor, None if state is None else state.clone(), beta, shards,
                   error_dtype, stream)
    _assert_same_encoding(a, b)

    total_a, nf_a = ref.decode_sum(a.messages[:1].repeat(3, 1), m, 0)
    total_b, nf_b = ker.decode_sum(a.messages[:1].repeat(3, 1), m, 0)
    assert torch.equal(total_a.view(torch.int32), total_b.view(torch.int32)) and nf_a == nf_b
    for codec in (ref, ker):  # into a caller's buffer: the same values, in that buffer
        out = torch.full((m,), 7.0)
        into, _ = codec.decode_sum(a.messages[:1].repeat(3, 1), m, 0, out)
        assert into.data_ptr() == out.data_ptr()
        assert torch.equal(out.view(torch.int32), total_a.view(torch.int32))
    for out_dtype in DTYPES:
        out_a = torch.empty(numel, dtype=out_dtype)
        out_b = torch.empty(numel, dtype=out_dtype)
        ref.decode_into(a.messages, m, shards, out_a)
        ker.decode_into(a.messages, m, shards, out_b)
        # bit-equal, except that NaN payloads may differ (torch's vectorized casts write their own)
        assert same_bits(out_a, out_b)


def test_mix32_matches_known_values_and_int64_tensor_form():
    """The Python-int and int64-tensor forms of the hash agree, and stay below 2**32."""
    from lowbitcc.codec import reference

    xs = [0, 1, 2, 0xDEADBEEF, 2**32 - 1, 123456789]
    as_tensor = reference.mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert as_tensor == [reference.mix32(x) for x in xs]
    assert all(0 <= v < 2**32 for v in as_tensor)
    assert len(set(as_tensor)) == len(xs)


def test_uniform24_is_uniform_and_keyed():
    from lowbitcc.codec import reference

    u = reference.uniform24(1 << 20, *reference.stream_keys(0, 1, 0))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert float(u.mean()) == pytest.approx(0.5, abs=2e-3)
    hist = torch.histc(u, bins=16, min=0.0, max=1.0) / u.numel()
    assert torch.allclose(hist, torch.full_like(hist, 1 / 16), atol=2e-3)
    other_seq = reference.uniform24(1 << 20, *reference.stream_keys(0, 2, 0))
    other_stream = reference.uniform24(1 << 20, *reference.stream_keys(0, 1, 1))
    other_seed = reference.uniform24(1 << 20, *reference.stream_keys(7, 1, 0))
    for v in (other_seq, other_stream, other_seed):
        assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 5e-3


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(impl):
    """A constant between two code levels: nearest always rounds the same way, stochastic
    rounding's mean over many calls (different sequence numbers) converges to the value."""
    G, bits = 128, 4
    x = torch.full((G,), 0.3)
    x[0] = 7.0  # amax 7 -> scale 1, so 0.3 sits between codes 0 and 1
    means = {}
    for rounding in ("nearest", "stochastic"):
        total = torch.zeros(G)
        calls = 200
        for seq in range(calls):
            codec = ShardCodec(bits=bits, group_size=G, dtype_code=0, seq=seq, world=1,
                               signature=0, kernels=select(impl), rounding=rounding, seed=5)
            res = codec.encode(x, 1, G, 1.0, None, 0.0, [0], None)
            out = torch.empty(G)
            codec.decode_into(res.messages, G, [0], out)
            total += out
        means[rounding] = float((total[1:] / calls).mean())
    assert means["nearest"] == 0.0
    assert means["stochastic"] == pytest.approx(0.3, abs=0.01)


def test_stochastic_rounding_reproducible_from_seed():
    x = torch.randn(1000)
    out = []
    for seed in (1, 1, 2):
        codec = ShardCodec(bits=4, group_size=128, dtype_code=0, seq=9, world=1, signature=0,
                           kernels=select("cpu"), rounding="stochastic", seed=seed)
        out.append(codec.encode(x, 1, 1000, 1.0, None, 0.0, [0], None).messages)
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], out[2])


# Magnitudes that reach every branch of the vector path: ordinary, all-zero groups, groups
# whose maximum is so small that its reciprocal scale overflows (the vector path hands those
# back to the generic one), and values near the top of fp32.
SCALES = [3.0, 0.0, 1e-39, 1e-30, 1e37]


@given(
    rows=st.integers(1, 3), groups=st.integers(1, 24), tail=st.sampled_from([0, 0, 0, 5, 77]),
    wire=st.sampled_from([(2, "int", 128), (4, "int", 128), (8, "int", 128), (4, "mxfp4", 32),
                          (4, "nvfp4", 16), (3, "nvint3", 16), (3, "nvfp3", 16)]),
    error_dtype=st.sampled_from([None, "int8", "fp32"]),
    with_state=st.booleans(), beta=st.sampled_from([0.0, 0.5, 0.8]),
    factor=st.sampled_from([1.0, 1 / 3]), scale=st.sampled_from(SCALES),
    error_scale=st.sampled_from([0.1, 1e-39, 0.0]),
    poison=st.sampled_from([None, None, "nan", "inf"]), seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=300, deadline=None)
def test_cpu_vector_path_matches_reference_bitwise(rows, groups, tail, wire, error_dtype,
                                                   with_state, beta, factor, scale, error_scale,
                                                   poison, seed):
    """The explicit-SIMD encode (fp32, nearest rounding, no/int8/fp32 state; see cpu_encode.h:
    AVX-512, or AVX2 for 4 and 8 bits, on int codes of group 128; AVX2 on MXFP4 blocks of four
    groups of 32 and NVFP4 blocks of 16 groups of 16, whose unit ``groups`` counts here; the
    3-bit formats' whole blocks, which take the portable loops) gives the reference's bytes
    over three chained calls, so the LoCo blend runs on a state the kernel itself wrote."""
    bits, fmt, group = wire
    unit = {"int": 128, "mxfp4": 4 * 32}.get(fmt, 16 * 16)
    gen = torch.Generator().manual_seed(seed)
    m = groups * unit + tail
    x = torch.randn(rows * m, generator=gen) * scale
    if poison is not None:
        x[int(torch.randint(x.numel(), (1,), generator=gen))] = float(poison)
    ref, ker = _codecs(bits, group, fmt=fmt)
    state_a = state_b = None
    if error_dtype and with_state:
        state_a = ErrorState.encode(torch.randn(rows * ref.padded(m), generator=gen) * error_scale,
                                    error_dtype, group)
        state_b = state_a.clone()
    shards = list(range(rows))
    for call in range(3):
        a = ref.encode(x, rows, m, factor, state_a, beta, shards, error_dtype, call)
        b = ker.encode(x, rows, m, factor, state_b, beta, shards, error_dtype, call)
        _assert_same_encoding(a, b)
        if any(a.nonfinite):
            break
        state_a, state_b = a.error, b.error
        x = x * 0.5


FP4_GROUPS = [("mxfp4", 8), ("mxfp4", 32), ("mxfp4", 32), ("mxfp4", 128), ("nvfp4", 16),
              ("nvfp4", 16), ("nvint3", 16), ("nvfp3", 16)]
"""The formats of byte scales and grid fields (the 3-bit ones among them) and their groups."""


@given(
    rows=st.integers(1, 3), m=st.integers(1, 1200), wire=st.sampled_from(FP4_GROUPS),
    dtype=st.sampled_from(DTYPES), error_dtype=st.sampled_from([None, "int8", "fp32", "bf16"]),
    with_state=st.booleans(), beta=st.sampled_from([0.0, 0.5, 0.8]),
    factor=st.sampled_from([1.0, 1 / 3]), scale=st.sampled_from(SCALES + [6.0, 2.0**-126]),
    poison=st.sampled_from([None, None, "nan", "inf"]), ties=st.booleans(),
    spread=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=400, deadline=None)
def test_cpu_fp4_formats_match_reference_bitwise(rows, m, wire, dtype, error_dtype, with_state,
                                                 beta, factor, scale, poison, ties, spread, seed):
    """MXFP4, NVFP4 and the 3-bit nvint3 and nvfp3 encode and decode in C++ give the
    reference's bytes over three chained calls: any (MXFP4) group size, source dtype and error
    storage, magnitudes from zero and subnormal to the top of fp32, groups of magnitudes 2^40
    apart within one block (``spread``: E4M3 subnormal and clamped scales), and inputs on the
    grids' rounding ties (multiples of 1/4 of a power of two: E2M1's, int3's and E2M0's)."""
    fmt, group = wire
    gen = torch.Generator().manual_seed(seed)
    numel = rows * m
    x = torch.randn(numel, generator=gen) * scale
    if ties:
        x = torch.randint(-24, 25, (numel,), generator=gen).float() * 0.25 * max(scale, 1e-30)
    if poison is not None:
        x[int(torch.randint(numel, (1,), generator=gen))] = float(poison)
    if spread:
        x = x * torch.exp2(torch.randint(-40, 1, (numel // 16 + 1,), generator=gen).float()
                           ).repeat_interleave(16)[:numel]
    x = x.to(dtype)
    ref, ker = _codecs(FORMATS[fmt].width, group, fmt=fmt)
    state_a = state_b = None
    if error_dtype and with_state:
        state_a = ErrorState.encode(torch.randn(rows * ref.padded(m), generator=gen) * 0.1,
                                    error_dtype, group)
        state_b = state_a.clone()
    shards = list(range(rows))
    for call in range(3):
        a = ref.encode(x, rows, m, factor, state_a, beta, shards, error_dtype, call)
        b = ker.encode(x, rows, m, factor, state_b, beta, shards, error_dtype, call)
        _assert_same_encoding(a, b)
        total_a, _ = ref.decode_sum(a.messages[:1].repeat(2, 1), m, 0)
        total_b, _ = ker.decode_sum(a.messages[:1].repeat(2, 1), m, 0)
        assert same_bits(total_a, total_b)
        out_a, out_b = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        ref.decode_into(a.messages, m, shards, out_a)
        ker.decode_into(a.messages, m, shards, out_b)
        assert same_bits(out_a, out_b)
        if any(a.nonfinite):
            break
        state_a, state_b = a.error, b.error
        x = x * 0.5


@given(
    k=st.integers(1, 5), m=st.integers(1, 700), wire=st.sampled_from(
        [(2, "int"), (4, "int"), (8, "int"), (4, "mxfp4"), (4, "nvfp4"), (3, "nvint3"),
         (3, "nvfp3")]),
    group=st.sampled_from([8, 32, 128]), poison=st.sampled_from([None, None, "nan", "inf"]),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=150, deadline=None)
def test_cpu_decode_sum_of_distinct_messages_matches_reference_bitwise(k, m, wire, group,
                                                                       poison, seed):
    """decode_sum over k different messages of one shard (each its own data and scales, one
    possibly non-finite) gives the reference's fp32 sum bit for bit: every row is decoded with
    its own scales and the rows are summed in order, tails included."""
    gen = torch.Generator().manual_seed(seed)
    group = 16 if FORMATS[wire[1]].fixed_group else group
    ref, ker = _codecs(wire[0], group, fmt=wire[1])
    rows = []
    for r in range(k):
        x = torch.randn(m, generator=gen) * float(10.0 ** torch.randint(-3, 4, (1,), generator=gen))
        if poison is not None and r == k - 1:
            x[int(torch.randint(m, (1,), generator=gen))] = float(poison)
        rows.append(ref.encode(x, 1, m, 1.0, None, 0.0, [0], None).messages)
    messages = torch.cat(rows)
    total_a, nf_a = ref.decode_sum(messages, m, 0)
    total_b, nf_b = ker.decode_sum(messages, m, 0)
    assert nf_a == nf_b
    assert same_bits(total_a, total_b)


def test_cpu_codec_reports_its_vector_path():
    """On an AVX-512 machine the build takes the AVX-512 encode, on an AVX2 one the AVX2 encode;
    elsewhere the portable loops run (each is checked against the reference above)."""
    import re
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has_avx512 = bool(re.search(r"\bavx512f\b", flags)) and bool(re.search(r"\bavx512vl\b", flags))
    has_avx2 = bool(re.search(r"\bavx2\b", flags))
    expected = "avx512" if has_avx512 else "avx2" if has_avx2 else "none"
    assert cpu.load().vector_path == expected


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("bad", ["size", "dtype", "strided"])
def test_decode_sum_rejects_an_unfit_output(impl, bad):
    codec = ShardCodec(bits=4, group_size=128, dtype_code=0, seq=3, world=4, signature=11,
                       kernels=select(impl))
    messages = codec.encode(torch.randn(1000), 1, 1000, 1.0, None, 0.0, [0], None).messages
    out = {"size": torch.empty(999), "dtype": torch.empty(1000, dtype=torch.float64),
           "strided": torch.empty(2000)[::2]}[bad]
    with pytest.raises(ValueError, match="decode_sum: out must be"):
        codec.decode_sum(messages, 1000, 0, out)


@pytest.mark.parametrize("wire", [(b, f, g) for b, f in [(2, "int"), (4, "int"), (8, "int"),
                                                         (4, "mxfp4")] for g in (8, 32, 128)]
                         + [(4, "nvfp4", 16), (3, "nvint3", 16), (3, "nvfp3", 16)])
@pytest.mark.parametrize("m", [1, 127, 128, 1000, 4100])
def test_encode_writes_every_byte_of_its_output(wire, m):
    """Messages are allocated uninitialised (or given by the caller): a buffer full of a junk
    pattern comes back with the same bytes as a fresh encode, for every implementation."""
    group = wire[2]
    x = torch.randn(3 * m - 1)
    ref, ker = _codecs(wire[0], group, fmt=wire[1])
    fresh = ref.encode(x, 3, m, 1.0, None, 0.8, [0, 1, 2], "int8").messages
    for codec in (ref, ker):
        for junk in (0xAB, 0x55):
            out = torch.full((3, ref.message_bytes(m)), junk, dtype=torch.uint8)
            got = codec.encode(x, 3, m, 1.0, None, 0.8, [0, 1, 2], "int8", out=out).messages
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(got, fresh)
    with pytest.raises(ValueError, match="out must be a contiguous uint8"):
        ker.encode(x, 3, m, 1.0, None, 0.8, [0, 1, 2], "int8",
                   out=torch.empty(3, ref.message_bytes(m) + 1, dtype=torch.uint8))
