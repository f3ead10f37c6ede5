"""Per-collective adapters of `lowbitcc perf`, in the manner of nccl-tests' one file per collective.

An adapter says only what differs between collectives: how ``count`` (the size column, in
elements) splits into input and output, the bus-bandwidth factor, where the buffers are in the
in-place variant, the exact expected result, and which backend method to call. The harness
(`lowbitcc.tools.perf.harness`) owns the timing and the check, `lowbitcc.tools.perf.table` the
printed table.

Sizes follow nccl-tests: for all-reduce, count is the tensor; for reduce-scatter, count is the
whole input (each rank receives count/n); for all-gather, count is the whole output. Bus
factors come from the library's table (`lowbitcc.collectives`): all-reduce 2(n-1)/n,
reduce-scatter and all-gather (n-1)/n.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lowbitcc.collectives import COLLECTIVES as TABLE
from lowbitcc.tools.perf.targets import Backend

OPS = ("sum", "avg", "max", "min")


def fill(rank: int, count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: uniform in [-8, 8] on a grid of ``VALUE_BITS[dtype]`` bits, drawn
    from a generator seeded by rank.

    The grid leaves 4 spare mantissa bits, so every partial sum of up to 16 ranks is exact in
    ``dtype`` and an exact backend matches the expected result bit for bit whatever its
    summation order. fp32 data has 12 significant bits, so a bf16 cast (8) loses some: the
    error column of ``gloo-bf16`` shows it.
    """
    bits = VALUE_BITS[dtype]
    half = 1 << (bits - 1)
    gen = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 17)
    k = torch.randint(-half, half + 1, (count,), generator=gen, dtype=torch.int32)
    return (k.to(torch.float64) * (8 / half)).to(dtype)


VALUE_BITS = {torch.float32: 12, torch.float16: 7, torch.bfloat16: 4}


def reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The exact reduction of ``inputs`` (one per rank), in their dtype, rounded once."""
    acc = torch.stack([t.double() for t in inputs])
    if op == "sum":
        out = acc.sum(0)
    elif op == "avg":
        out = acc.sum(0) / len(inputs)
    elif op == "max":
        out = acc.amax(0)
    elif op == "min":
        out = acc.amin(0)
    else:
        raise ValueError(f"lowbitcc perf: unknown reduction {op!r}; known: {', '.join(OPS)}")
    return out.to(inputs[0].dtype)


@dataclasses.dataclass(frozen=True)
class Buffers:
    """``inp`` is filled with this rank's data, the collective writes ``out`` (they may alias)."""

    inp: torch.Tensor
    out: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    reduces: bool
    bus_factor: Callable[[int], float]
    #: (count, n) -> (input elements, output elements) per rank
    shape: Callable[[int, int], tuple[int, int]]
    #: (count, n, rank, dtype, in_place, device) -> buffers
    buffers: Callable[[int, int, int, torch.dtype, bool, torch.device], Buffers]
    #: (inputs of every rank, rank, op) -> this rank's expected output
    expected: Callable[[list[torch.Tensor], int, str], torch.Tensor]
    #: (backend, out, inp, op) -> None
    launch: Callable[[Backend, torch.Tensor, torch.Tensor, str], None]

    def usable_count(self, count: int, n: int) -> int:
        """``count`` rounded down to what the collective accepts (a multiple of n if it splits)."""
        return count if self.name == "all_reduce" else count // n * n


def _ar_buffers(count: int, n: int, rank: int, dtype: torch.dtype, in_place: bool,
                device: torch.device) -> Buffers:
    out = torch.empty(count, dtype=dtype, device=device)
    return Buffers(out if in_place else torch.empty(count, dtype=dtype, device=device), out)


def _rs_buffers(count: int, n: int, rank: int, dtype: torch.dtype, in_place: bool,
                device: torch.device) -> Buffers:
    inp = torch.empty(count, dtype=dtype, device=device)
    m = count // n
    own = inp[rank * m:(rank + 1) * m]
    return Buffers(inp, own if in_place else torch.empty(m, dtype=dtype, device=device))


def _ag_buffers(count: int, n: int, rank: int, dtype: torch.dtype, in_place: bool,
                device: torch.device) -> Buffers:
    out = torch.empty(count, dtype=dtype, device=device)
    m = count // n
    own = out[rank * m:(rank + 1) * m]
    return Buffers(own if in_place else torch.empty(m, dtype=dtype, device=device), out)


def _rs_expected(inputs: list[torch.Tensor], rank: int, op: str) -> torch.Tensor:
    m = inputs[0].numel() // len(inputs)
    return reduce(inputs, op)[rank * m:(rank + 1) * m]


COLLECTIVES: dict[str, Collective] = {
    "all_reduce": Collective(
        name="all_reduce", reduces=True,
        bus_factor=TABLE["all_reduce"].bus_factor,
        shape=lambda count, n: (count, count),
        buffers=_ar_buffers,
        expected=lambda inputs, rank, op: reduce(inputs, op),
        launch=lambda b, out, inp, op: b.all_reduce(out, inp, op),
    ),
    "reduce_scatter": Collective(
        name="reduce_scatter", reduces=True,
        bus_factor=TABLE["reduce_scatter"].bus_factor,
        shape=lambda count, n: (count, count // n),
        buffers=_rs_buffers,
        expected=_rs_expected,
        launch=lambda b, out, inp, op: b.reduce_scatter(out, inp, op),
    ),
    "all_gather": Collective(
        name="all_gather", reduces=False,
        bus_factor=TABLE["all_gather"].bus_factor,
        shape=lambda count, n: (count // n, count),
        buffers=_ag_buffers,
        expected=lambda inputs, rank, op: torch.cat(inputs),
        launch=lambda b, out, inp, op: b.all_gather(out, inp),
    ),
}
