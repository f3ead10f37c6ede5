"""The format lab: wire formats and feedback tried in training before any codec implements them.

A DDP communication hook (`lab_hook`) reproduces the arithmetic of loco's direct all-reduce with a
pluggable quantizer per stage, over an exact gloo all-reduce of the dequantized values:

1. stage ``rs``: each rank compensates its bucket (``y = g + e``), quantizes it with the stage's
   `Format` and keeps ``e <- beta e + (1 - beta)(y - deQ(Q(y)))``; the ranks sum the
   dequantized values in fp32 (what loco's reduce-scatter computes, shard by shard);
2. stage ``ag``: the reduced values are compensated and quantized again (loco re-quantizes each
   reduced shard before its all-gather). Every rank holds the same sum, so every rank computes
   the owner's codes itself and keeps the same error state. On two ranks loco's all-reduce is
   one all-gather of each rank's codes (docs/algorithms.md), so there the lab skips this stage
   too (the ``ag`` ablations need three ranks or more).

So a format can be judged by the loss it trains to before it is written three times (reference,
C++, CUDA, bit for bit). The lab is faithful to loco where loco has the format: ``lab-int4-g128``
trains bit for bit like the "loco4" study variant (int4 / 128) and ``lab-mxfp4`` like "mxfp4"
(tests/tools/test_formats.py); FP4 codes with an E8M0 scale are the codec's reference MXFP4.
It does not cut rows longer than loco's ``chunk_size`` into pipelined chunks with their own
error states, as loco does (the study's rows are shorter).
Random bits for stochastic rounding come from torch's generator, not loco's counter-based
stream.

Bits per element of a variant are the mean of its two stages (each stage sends the same number
of elements per rank in a direct all-reduce), scales included; an exact stage counts 32.
"""

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc.codec import reference
from lowbitcc.codec.error_state import ErrorState

FP4_E2M1 = torch.tensor(reference.E2M1)
FP3_E2M0 = torch.tensor((0.0, 1.0, 2.0, 4.0))
"""FP3 E2M0 magnitudes by 2-bit index (a sign bit beside): zero and three powers of two."""
GRIDS = {"fp4": FP4_E2M1, "fp3": FP3_E2M0}
"""The minifloat codes' magnitudes (each with a sign bit): their widths are 4 and 3 bits."""
CODES = ("int", "fp4", "fp3", "asym")
SCALE_BITS = {"fp32": 32, "bf16": 16, "e8m0": 8, "e4m3": 8}
"""Bits a stored scale takes, by its kind."""
SCALES = tuple(SCALE_BITS)
E4M3_MAX = 448.0
"""The largest finite FP8 E4M3 value (OCP FP8: 1.75 x 2^8)."""


def round_up_e4m3(s: torch.Tensor) -> torch.Tensor:
    """Non-negative ``s`` rounded up to FP8 E4M3 values (3 mantissa bits; subnormals below
    2^-6 in steps of 2^-9); at most `E4M3_MAX` for ``s <= E4M3_MAX``."""
    e = torch.floor(torch.log2(s.clamp(min=2.0 ** -9))).clamp(min=-6)
    step = torch.exp2(e - 3)
    return torch.where(s > 0, torch.ceil(s / step) * step, s)


def _round_scale(s: torch.Tensor, kind: str) -> torch.Tensor:
    """Scales as stored: fp32 as is, bf16 rounded up (no code overflows), E8M0 the next power
    of two up, E4M3 the next FP8 E4M3 value up after dividing by one fp32 scale for all the
    groups (NVFP4's second level, which brings the largest group scale to `E4M3_MAX`)."""
    if kind == "fp32":
        return s
    if kind == "bf16":  # round the fp32 bits up to the next bf16 (scales are >= 0)
        bits = s.contiguous().view(torch.int32)
        return ((bits + 0xFFFF) & -0x10000).view(torch.float32)
    if kind == "e4m3":
        top = s.max()
        if not bool(torch.isfinite(top)) or float(top) <= 0:
            return s
        tensor_scale = top / E4M3_MAX
        return round_up_e4m3(s / tensor_scale) * tensor_scale
    return torch.where(s > 0, torch.exp2(torch.ceil(torch.log2(s))), s)


def hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """``[n, n]`` fp32: an orthonormal Hadamard matrix (``n`` a power of two) with its rows'
    signs drawn from ``seed``: ``x @ R`` rotates rows of ``x`` block by block, ``@ R.T`` back.
    The same ``seed`` on every rank gives every rank the same rotation."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"format lab: a Hadamard block of {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (n, 1), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs * h / n ** 0.5


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantizer: ``codes`` ("int": symmetric uniform ``bits``-bit codes in
    ``[-(2^(b-1)-1), 2^(b-1)-1]``; "fp4": E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} and a sign;
    "fp3": E2M0 magnitudes {0, 1, 2, 4} and a sign (3 bits; E1M1's {0, .5, 1, 1.5} would be
    "int" at 3 bits, scaled); stochastic rounding on a grid rounds a magnitude between two
    neighbouring grid values up with probability its distance from the lower over theirs
    (unbiased within the grid's top, as NVIDIA's NVFP4 training recipe rounds gradients);
    "asym": uniform codes in ``[0, 2^b - 1]`` from the group's minimum, which is stored in the
    scale's format too), one scale per ``group`` elements stored as ``scale``."""

    codes: str = "int"
    bits: int = 4
    group: int = 128
    scale: str = "fp32"
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.codes not in CODES or self.scale not in SCALES:
            raise ValueError(f"format lab: unknown codes {self.codes!r} or scale {self.scale!r}")
        width = {"fp4": 4, "fp3": 3}.get(self.codes)
        if width is not None and self.bits != width:
            raise ValueError(f"format lab: {self.codes} codes are {width} bits")
        if self.codes == "fp4" and self.scale == "e8m0" and self.stochastic:
            raise ValueError("format lab: MXFP4 (fp4 codes, e8m0 scales) rounds to nearest, "
                             "as the codec's reference does")

    @property
    def bits_per_element(self) -> float:
        return self.bits + SCALE_BITS[self.scale] * (2 if self.codes == "asym" else 1) / self.group

    def roundtrip(self, y: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """``deQ(Q(y))`` of fp32 ``y`` ``[groups, group]``; ``gen`` draws stochastic rounding."""
        def rnd(v: torch.Tensor) -> torch.Tensor:
            if not self.stochastic:
                return torch.round(v)
            return torch.floor(v + torch.rand(v.shape, generator=gen))

        if self.codes == "asym":
            lo = y.amin(dim=1, keepdim=True)
            levels = (1 << self.bits) - 1
            lo = _round_scale(lo.abs(), self.scale) * torch.sign(lo) if self.scale != "fp32" \
                else lo
            lo = torch.minimum(lo, y.amin(dim=1, keepdim=True))
            s = _round_scale((y.amax(dim=1, keepdim=True) - lo) / levels, self.scale)
            inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
            return lo + rnd((y - lo) * inv).clamp(0, levels) * s
        if self.codes == "fp4" and self.scale == "e8m0":  # MXFP4: the codec's own rules
            codes, scales = reference.quantize(y, 4, fmt="mxfp4")
            return reference.dequantize(codes, scales, "mxfp4")
        amax = y.abs().amax(dim=1, keepdim=True)
        grid = GRIDS.get(self.codes)
        top = float(grid[-1]) if grid is not None else float((1 << (self.bits - 1)) - 1)
        s = _round_scale(amax / top, self.scale)
        # loco's reference: inv = qmax / amax as one tensor division (not 1 / scale, and not
        # scalar / tensor, which torch computes as a reciprocal times the scalar)
        inv = torch.full_like(amax, top) / amax if self.scale == "fp32" else 1 / s
        inv = torch.where((s > 0) & torch.isfinite(inv), inv, torch.zeros_like(s))
        v = y * inv
        if self.codes == "int":
            return rnd(v).clamp(-top, top) * s
        grid = grid.to(y.device)
        a = v.abs().clamp(max=top)
        if self.stochastic:  # up to the next grid value with probability the distance's share
            below = (torch.bucketize(a, grid, right=True) - 1).clamp(0, len(grid) - 2)
            lo, hi = grid[below], grid[below + 1]
            up = torch.rand(a.shape, generator=gen) < (a - lo) / (hi - lo)
            return torch.sign(v) * torch.where(up, hi, lo) * s
        mid = (grid[1:] + grid[:-1]) / 2
        return torch.sign(v) * grid[torch.bucketize(a, mid)] * s


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the all-reduce: its format (None: exact) and its feedback (``beta`` None:
    none), the error state stored as ``error_dtype`` in groups of the format's group size;
    ``rotate``: quantize each block of that many elements after a random-sign Hadamard
    rotation (`hadamard`, the same on every rank) and rotate the dequantized values back
    (THC, QuaRot: the rotation spreads a block's outliers; being linear, a codec could sum
    rotated values and rotate once). The error state stays in the unrotated domain."""

    fmt: Format | None = Format()
    beta: float | None = 0.8
    error_dtype: str = "int8"
    rotate: int | None = None

    def roundtrip(self, y: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """``deQ(Q(y))`` of flat fp32 ``y`` (whole groups, and whole rotation blocks)."""
        if self.rotate is None:
            return self.fmt.roundtrip(y.view(-1, self.fmt.group), gen).reshape(-1)
        r = hadamard(self.rotate)
        turned = (y.view(-1, self.rotate) @ r).reshape(-1)
        d = self.fmt.roundtrip(turned.view(-1, self.fmt.group), gen).reshape(-1)
        return (d.view(-1, self.rotate) @ r.T).reshape(-1)

    @property
    def bits_per_element(self) -> float:
        return 32.0 if self.fmt is None else self.fmt.bits_per_element


@dataclasses.dataclass(frozen=True)
class LabSpec:
    """What a lab variant sends: stage ``rs`` then stage ``ag``; buckets of fewer than
    ``min_size`` elements travel exact (loco's default ``min_size``)."""

    rs: Stage = Stage()
    ag: Stage = Stage()
    min_size: int = 65536

    @property
    def bits_per_element(self) -> float:
        return (self.rs.bits_per_element + self.ag.bits_per_element) / 2


class LabState:
    """The hook's state on one rank: the spec, the error state per (bucket, stage), the random
    generators (stage ``rs``: per rank; stage ``ag``: shared, so that every rank draws the owner's
    bits)."""

    def __init__(self, spec: LabSpec, seed: int) -> None:
        self.spec = spec
        self.errors: dict[tuple[int, str], ErrorState] = {}
        self.buffers: dict[int, StorageWeakRef] = {}
        rank = dist.get_rank()
        self.gens = {"rs": torch.Generator().manual_seed(seed * 1000 + rank + 1),
                     "ag": torch.Generator().manual_seed(seed * 1000 + 999)}

    def apply(self, bucket: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat fp32) as stage ``name`` delivers it: compensated, quantized, dequantized;
        updates that stage's error state. As in loco, ``x`` is cut into one row per rank
        (``ceil(n / world)`` elements) and each row into groups from its start."""
        stage: Stage = getattr(self.spec, name)
        if stage.fmt is None:
            return x
        group = max(stage.fmt.group, stage.rotate or 0)  # whole groups and rotation blocks
        n, rows = x.numel(), dist.get_world_size()
        m = -(-n // rows)
        width = -(-m // group) * group
        y = torch.zeros(rows, width)
        y[:, :m] = torch.nn.functional.pad(x, (0, rows * m - n)).view(rows, m)
        y = y.reshape(-1)
        padded = y.numel()
        key = (bucket, name)
        if stage.beta is not None:
            state = self.errors.get(key)
            if state is None or state.numel != padded:
                state = ErrorState.zeros(padded, stage.error_dtype, stage.fmt.group)
            e = state.decode()
            y = y + e
        d = stage.roundtrip(y, self.gens[name])
        if stage.beta is not None:
            e = stage.beta * e + (1 - stage.beta) * (y - d)
            self.errors[key] = ErrorState.encode(e, stage.error_dtype, stage.fmt.group)
        return d.view(rows, width)[:, :m].reshape(-1)[:n]


def lab_hook(state: LabState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean gradient through `LabState`'s two stages."""
    buf = bucket.buffer().div_(dist.get_world_size())
    if buf.numel() < state.spec.min_size:
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    storage = StorageWeakRef(buf.untyped_storage())
    known = state.buffers.get(bucket.index())
    if known is None or known != storage:
        # as loco: a bucket in a new buffer (DDP rebuilds its buckets after the first step)
        # starts from zero error. A weak reference, not the address: the rebuilt bucket may
        # be allocated where the old one was
        state.buffers[bucket.index()] = storage
        state.errors = {k: v for k, v in state.errors.items() if k[0] != bucket.index()}
    sent = state.apply(bucket.index(), "rs", buf.to(torch.float32))
    fut = dist.all_reduce(sent, async_op=True).get_future()
    if dist.get_world_size() == 2:  # loco's two-rank all-reduce: one stage
        return fut.then(lambda f: buf.copy_(f.value()[0]))

    def gather(f: torch.futures.Future[Any]) -> torch.Tensor:
        buf.copy_(state.apply(bucket.index(), "ag", f.value()[0]))
        return buf

    return fut.then(gather)


def _spec(rs: Stage, ag: Stage | None = None) -> LabSpec:
    return LabSpec(rs, rs if ag is None else ag)


MXFP4 = Format("fp4", group=32, scale="e8m0")
"""The codec's default: FP4 E2M1 codes, a power-of-two scale per 32 (4.25 bits)."""
NVFP4 = Format("fp4", group=16, scale="e4m3")
"""NVIDIA's NVFP4 layout: FP4 E2M1 codes, an FP8 E4M3 scale per 16 under one fp32 scale for
the whole call (4.5 bits)."""
NVFP4_SR = dataclasses.replace(NVFP4, stochastic=True)
"""NVFP4 with stochastic rounding, as NVIDIA's NVFP4 pretraining recipe rounds gradients:
unbiased, unlike nearest rounding, whose error of a value is the same every time it recurs."""

INT3 = Format("int", bits=3, group=16, scale="e4m3")
"""Symmetric 3-bit integer codes (-3 to 3) under NVFP4's scales (3.5 bits)."""
FP3 = Format("fp3", bits=3, group=16, scale="e4m3")
"""FP3 E2M0 codes (0, 1, 2, 4 and a sign) under NVFP4's scales (3.5 bits)."""
INT3_MX = Format("int", bits=3, group=32, scale="e8m0")
"""Symmetric 3-bit integer codes under MXFP4's power-of-two scale per 32 (3.25 bits)."""
INT6 = Format("int", bits=6, group=16, scale="e4m3")
"""Symmetric 6-bit integer codes (-31 to 31) under NVFP4's scales (6.5 bits): between the
default's 4.5 bits and int8's 8.25."""


LAB_VARIANTS: dict[str, LabSpec] = {
    # loco's default, for fidelity, and the stage ablations
    "lab-int4-g128": _spec(Stage()),
    "lab-int4-g128-nofb": _spec(Stage(beta=None)),
    "lab-rs-only": _spec(Stage(), Stage(fmt=None)),
    "lab-ag-only": _spec(Stage(fmt=None), Stage()),
    "lab-ag-nofb": _spec(Stage(), Stage(beta=None)),
    "lab-ag8": _spec(Stage(), Stage(Format(bits=8))),
    # formats at 4.25 bits per element
    "lab-int4-g64-bf16": _spec(Stage(Format(group=64, scale="bf16"))),
    "lab-int4-g32-e8m0": _spec(Stage(Format(group=32, scale="e8m0"))),
    "lab-mxfp4": _spec(Stage(MXFP4)),
    "lab-mxfp4-nofb": _spec(Stage(MXFP4, beta=None)),
    "lab-fp4-g64-bf16": _spec(Stage(Format("fp4", group=64, scale="bf16"))),
    "lab-fp4-g64-bf16-nofb": _spec(Stage(Format("fp4", group=64, scale="bf16"), beta=None)),
    # 4.5 bits per element
    "lab-int4-g64": _spec(Stage(Format(group=64))),
    "lab-asym4-g64-bf16": _spec(Stage(Format("asym", group=64, scale="bf16"))),
    # rounding and feedback
    "lab-int4-g128-sr": _spec(Stage(Format(stochastic=True))),
    "lab-int4-g128-sr-nofb": _spec(Stage(Format(stochastic=True), beta=None)),
    "lab-int4-g128-ef": _spec(Stage(beta=0.0)),
    "lab-int4-g128-b5": _spec(Stage(beta=0.5)),
    "lab-int4-g128-b95": _spec(Stage(beta=0.95)),
    "lab-int4-g128-fp32e": _spec(Stage(error_dtype="fp32")),
    # where feedback matters
    "lab-int2-g128": _spec(Stage(Format(bits=2))),
    "lab-int2-g128-nofb": _spec(Stage(Format(bits=2), beta=None)),
    "lab-int4-g1024": _spec(Stage(Format(group=1024))),
    "lab-int4-g1024-nofb": _spec(Stage(Format(group=1024), beta=None)),
    # the wide study's candidates at <= 4.5 bits per element, around MXFP4 (lab-mxfp4 above)
    "lab-nvfp4": _spec(Stage(NVFP4)),
    "lab-nvfp4-nofb": _spec(Stage(NVFP4, beta=None)),
    "lab-mxfp4-had32": _spec(Stage(MXFP4, rotate=32)),
    "lab-mxfp4-had32-nofb": _spec(Stage(MXFP4, beta=None, rotate=32)),
    "lab-nvfp4-had32": _spec(Stage(NVFP4, rotate=32)),
    "lab-mxfp4-bf16e": _spec(Stage(MXFP4, error_dtype="bf16")),
    "lab-mxfp4-b5": _spec(Stage(MXFP4, beta=0.5)),
    "lab-mxfp4-b9": _spec(Stage(MXFP4, beta=0.9)),
    "lab-mxfp4-ag8": _spec(Stage(MXFP4), Stage(Format(bits=8))),
    # the default's second quantization on three ranks or more (each reduced row again, for its
    # all-gather): left out (the rows sent exact), or with error feedback kept by the row's owner
    # (LoCo's beta 0.8, classic error feedback's 0) while the first stage stays without
    "lab-nvfp4-nofb-rs-only": _spec(Stage(NVFP4, beta=None), Stage(fmt=None)),
    "lab-nvfp4-nofb-agfb": _spec(Stage(NVFP4, beta=None), Stage(NVFP4)),
    "lab-nvfp4-nofb-agef": _spec(Stage(NVFP4, beta=None), Stage(NVFP4, beta=0.0)),
    # the default's rounding made unbiased (both quantizations), without feedback
    "lab-nvfp4-sr-nofb": _spec(Stage(NVFP4_SR, beta=None)),
    # more bits under the default's scales, without feedback
    "lab-int6-nofb": _spec(Stage(INT6, beta=None)),
    # the 3-bit family, under NVFP4's scales (an E4M3 per 16: 3.5 bits) or MXFP4's (3.25)
    **{f"lab-{name}{twin}": _spec(Stage(fmt, beta=None if twin else 0.8))
       for name, fmt in (("int3", INT3), ("fp3", FP3), ("int3-mx", INT3_MX))
       for twin in ("", "-nofb")},
}
