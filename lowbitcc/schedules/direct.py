"""The direct schedule: one all-to-all of codes, then (all-reduce) one all-gather of codes.

Reduce-scatter of a source of ``n`` rows of ``m`` elements (row ``j`` is owned by rank ``j``):

1. quantize every row once with the error state of stage ``"rs"`` (n messages);
2. all-to-all: row ``j`` goes to rank ``j``;
3. decode the ``n`` messages of the own row and sum them in fp32, in rank order.

All-reduce adds:

4. re-quantize the reduced row with its own error state (stage ``"ag"``);
5. all-gather the ``n`` messages; every rank, the owner included, decodes all of them, so every
   rank ends with bitwise-identical values.

Pipelining: with ``chunk`` > 0 and rows longer than one chunk, the columns are cut into chunks
of ``chunk`` elements (a multiple of the group size) and steps 1-5 run per chunk, each chunk's
transfers in the background while the next chunk is encoded and the previous one decoded.
Chunk ``k`` has its own error-state stages (``"rs.k.row"``, ``"ag.k"``); each row's slice of a
chunk is encoded where it lies, without a copy. Quantization groups never
straddle a chunk edge, so with nearest rounding the codes, and the results, are the same bytes
as without chunks (stochastic rounding draws its random bits per chunk).

Where the codec's kernels fuse steps (CUDA), the all-reduce of one chunk takes fewer launches:
step 4 decodes, sums and re-quantizes in one encode (`CallCompressor.encode_sum`), and on two
ranks every row of the all-gathered codes is decoded in one launch
(`CallCompressor.decode_rows`); the same bytes either way. Every transfer receives into the
compressor's buffer for its stage where it keeps one (`CallCompressor.received`: a call place's
plan), and so does every encode.

Two ranks: the all-reduce is one phase instead. Each rank quantizes its whole input (every
row, stage ``"gather"``), the ranks all-gather these codes, and every rank decodes both ranks'
messages of each row and sums them in fp32 in rank order (its own codes, not its own values),
so both end with bitwise-identical values. With chunks, each row's slice of a chunk is
all-gathered on its own, started as soon as it is encoded. Against steps 1-5 this sends the
same bytes (one message of ``2m`` elements instead of two of ``m``), encodes ``2m`` elements
instead of ``3m``,
decodes as many, waits for the network once instead of twice, and quantizes each element once.
With more ranks it would send ``(n-1) n m`` elements instead of ``2 (n-1) m``, so it is not used.

Traffic per rank: ``(n-1)`` messages of ``m`` elements out and in per phase (two phases for
all-reduce; on two ranks one phase of one message of ``2m``), plus one 32-byte header per
message and chunk. Quantizations on any element's path: 1 (reduce-scatter, and all-reduce on
two ranks) or 2 (all-reduce).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.schedules.chunking import chunks, decode_columns, encode_columns, encode_row, stage
from lowbitcc.transports.base import Pending, Transport
from lowbitcc.transports.links import Links


def _in_pipeline_order(count: int, start: Callable[[int], None], scattering: collections.deque,
                       reduce_oldest: Callable[[], None], gathering: collections.deque,
                       gather_oldest: Callable[[], None]) -> None:
    """`_pipeline`'s order over ``count`` chunks, the one both its run and its replay
    (`decode_two_phases`) keep: ``start(k)`` (which adds chunk ``k`` to ``scattering``), then
    the oldest of ``scattering`` reduced once two are there (which may add to ``gathering``)
    and the oldest of ``gathering`` placed once two are there; at the end the rest of each, in
    order. A call place's C++ core issues its transfers in this order too
    (``backend/csrc/plan_core.h``), so every rank issues them alike whichever path it takes."""
    for k in range(count):
        start(k)
        if len(scattering) > 1:
            reduce_oldest()
        if len(gathering) > 1:
            gather_oldest()
    while scattering:
        reduce_oldest()
    while gathering:
        gather_oldest()


def _pipeline(
    source: Source, comp: CallCompressor, transport: Transport, ranges: list[tuple[int, int]],
    on_reduced: Callable[[int, int, int, torch.Tensor], Pending | None],
    on_gathered: Callable[[int, int, int, torch.Tensor], None] | None, prefix: str = "",
    dest: Callable[[int, int], torch.Tensor] | None = None,
) -> None:
    """Run the reduce-scatter of every chunk (column ``ranges``, from `chunks`), one transfer in
    flight while the next is encoded.

    Chunk ``k``'s reduced own row (fp32 ``[b - a]``) is decoded into ``dest(a, b)`` (default: the
    compressor's scratch, so ``on_reduced`` must consume it before returning); then
    ``on_reduced(k, a, b, reduced)`` gets it and may start a second transfer, whose result goes
    to ``on_gathered(k, a, b, received)``.
    """
    device = source.tensor.device
    dest = dest or (lambda a, b: comp.scratch(b - a, device))
    rank = transport.rank
    scattering: collections.deque = collections.deque()
    gathering: collections.deque = collections.deque()

    def reduce_oldest() -> None:
        k, a, b, pending = scattering.popleft()
        reduced = comp.decode_sum(pending.wait(), b - a, rank, dest(a, b))
        second = on_reduced(k, a, b, reduced)
        if second is not None:
            gathering.append((k, a, b, second))

    def gather_oldest() -> None:
        k, a, b, pending = gathering.popleft()
        assert on_gathered is not None
        on_gathered(k, a, b, pending.wait())

    def start(k: int) -> None:
        a, b = ranges[k]
        name = stage(prefix + "rs", k, len(ranges))
        messages = encode_columns(comp, name, source, a, b)
        scattering.append((k, a, b, transport.all_to_all_async(
            messages, comp.received(name, messages.numel(), device))))

    _in_pipeline_order(len(ranges), start, scattering, reduce_oldest, gathering, gather_oldest)


def reduce_scatter(source: Source, comp: CallCompressor, links: Links,
                   chunk: int = 0, prefix: str = "", out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Sum over ranks of row ``rank`` of ``source``: fp32 ``[m]`` (in ``out`` where given).
    ``prefix`` goes before the stage names (a schedule that runs this one inside names its own
    stages)."""
    transport = links.world
    if out is None:
        out = torch.empty(source.m, dtype=torch.float32, device=source.tensor.device)
    comp.final = True  # the output: nothing sent depends on it (`CallCompressor.final`)
    try:
        _pipeline(source, comp, transport, chunks(source.m, chunk, comp.codec.group_size),
                  lambda k, a, b, reduced: None, None, prefix, dest=lambda a, b: out[a:b])
    finally:
        comp.final = False
    return out


def all_reduce(
    source: Source, out: torch.Tensor, comp: CallCompressor, links: Links, chunk: int = 0,
    prefix: str = "",
) -> None:
    """Sum over ranks of ``source`` into flat ``out`` (any float dtype), identical on every rank."""
    transport = links.world
    rank, rows, m = transport.rank, source.rows, source.m
    ranges = chunks(m, chunk, comp.codec.group_size)
    count = len(ranges)
    if transport.size == 2:
        comp.final = True  # every decode's values are the output's (`CallCompressor.final`)
        try:
            _gather_all_reduce(source, out, comp, transport, ranges, prefix)
        finally:
            comp.final = False
        return
    device = source.tensor.device
    if count == 1:
        _scatter_gather(source, out, comp, transport, prefix)
        return

    def requantize(k: int, a: int, b: int, reduced: torch.Tensor) -> Pending:
        name = stage(prefix + "ag", k, count)
        message = comp.encode(name, Source(reduced, 1, b - a), [rank])
        return transport.all_gather_async(
            message[0], comp.received(name, transport.size * message.numel(), device))

    def place(k: int, a: int, b: int, gathered: torch.Tensor) -> None:
        comp.final = True  # the output: nothing sent depends on it (`CallCompressor.final`)
        try:
            decode_columns(comp, gathered, rows, m, a, b, out)
        finally:
            comp.final = False

    _pipeline(source, comp, transport, ranges, requantize, place, prefix)


def _scatter_gather(source: Source, out: torch.Tensor, comp: CallCompressor,
                    transport: Transport, prefix: str) -> None:
    """Steps 1-5 of one chunk: the own row's messages summed and re-quantized by one
    `CallCompressor.encode_sum` (one launch where the kernels fuse it)."""
    rank, rows, m, device = transport.rank, source.rows, source.m, source.tensor.device
    name = prefix + "rs"
    messages = encode_columns(comp, name, source, 0, m)
    received = transport.all_to_all_async(
        messages, comp.received(name, messages.numel(), device)).wait()
    name = prefix + "ag"
    mine = comp.encode_sum(name, received, m, rank, comp.scratch(m, device))
    gathered = transport.all_gather_async(
        mine[0], comp.received(name, transport.size * mine.numel(), device)).wait()
    comp.final = True  # (`CallCompressor.final`)
    try:
        decode_columns(comp, gathered, rows, m, 0, m, out)
    finally:
        comp.final = False


def _row_target(out: torch.Tensor, m: int, r: int, a: int, b: int
                ) -> tuple[torch.Tensor, bool] | None:
    """Where elements ``a .. b`` of row ``r`` (rows of ``m``) go in flat ``out``: the view of
    ``out`` they fill, and whether they are decoded straight into it (fp32 and whole, else
    through the decode buffer); None where none of them lies in ``out`` (the last row's
    padding)."""
    lo, hi = min(r * m + a, out.numel()), min(r * m + b, out.numel())
    if lo == hi:
        return None
    return out[lo:hi], out.dtype == torch.float32 and hi - lo == b - a


def _decode_row(comp: CallCompressor, messages: torch.Tensor, r: int, width: int,
                target: torch.Tensor, straight: bool, device: torch.device) -> None:
    """Decode and sum every rank's ``messages`` of row ``r`` (``width`` elements) into
    ``target``, its `_row_target`."""
    if straight:
        comp.decode_sum(messages, width, r, target)
    else:
        target.copy_(comp.decode_sum(messages, width, r, comp.scratch(width, device))[
            :target.numel()])


def _gather_one_chunk(columns: torch.Tensor, pending: Pending, out: torch.Tensor,
                      comp: CallCompressor, m: int, device: torch.device) -> None:
    """The two-rank all-reduce of one chunk on the CPU, into a buffer the compressor keeps:
    ``columns`` (``[n, rows, P]``) its view, in which every rank's messages of row ``r`` lie
    side by side (``columns[:, r]``); each row decoded and summed into its place of flat
    ``out`` (`_decode_row`) once ``pending`` is done, the places found before."""
    places = []
    for r in range(columns.shape[1]):
        target = _row_target(out, m, r, 0, m)
        if target is not None:
            places.append((r, columns[:, r], *target))
    received = pending.wait()
    if received.data_ptr() != columns.data_ptr():  # a transport that received elsewhere
        columns = received.view(columns.shape)
        places = [(r, columns[:, r], target, straight) for r, _, target, straight in places]
    for r, messages, target, straight in places:
        _decode_row(comp, messages, r, m, target, straight, device)


class _Arrived:
    """A transfer that has completed into ``received``."""

    def __init__(self, received: torch.Tensor) -> None:
        self.received = received

    def wait(self) -> torch.Tensor:
        return self.received


Gathered = list[tuple[int, int, int | None, torch.Tensor]]
"""The two-rank all-reduce's transfers, complete, in the order `_gather_all_reduce` issues them:
each one's columns ``a .. b``, its row (None: every row, one chunk) and the buffer it received
into (`CallCompressor.received`)."""


def decode_gathered(gathered: Gathered, out: torch.Tensor, comp: CallCompressor, m: int,
                    n: int) -> None:
    """The two-rank all-reduce's decodes of ``n`` ranks' rows of ``m`` elements, every transfer
    complete (``gathered``): each row's messages decoded and summed into its place of flat
    ``out``, as `_gather_all_reduce` does (a call place's C++ run hands it a call whose messages
    did not belong to it, `backend.call_plan.CallPlan.finish_received`)."""
    for a, b, row, received in gathered:
        if row is None:
            _gather_one_chunk(received.view(n, n, -1), _Arrived(received), out, comp, m,
                              received.device)
        else:
            _place_row(comp, out, m, row, a, b, received.view(n, -1))


def decode_scattered(received: list[tuple[int, int, int | None, torch.Tensor]],
                     out: torch.Tensor, comp: CallCompressor, rank: int, n: int) -> None:
    """The reduce-scatter's decodes of ``n`` ranks' messages of row ``rank``, every chunk's
    all-to-all complete (``received``: each chunk's columns ``a .. b``, a row that is None and
    the buffer it received into): each chunk's messages decoded and summed into fp32 ``out``'s
    columns, as `_pipeline` does (a call place's C++ run hands it a call whose messages did not
    belong to it, `backend.call_plan.CallPlan.finish_received`)."""
    for a, b, _, messages in received:
        comp.decode_sum(messages.view(n, -1), b - a, rank, out[a:b])


def decode_two_phases(received: list[tuple[int, int, int | None, torch.Tensor]],
                      gathered: list[torch.Tensor], out: torch.Tensor, comp: CallCompressor,
                      m: int, rank: int, n: int) -> None:
    """The all-reduce's decodes on ``n`` > 2 ranks of rows of ``m`` elements, every transfer of
    both phases complete (``received``: each chunk's columns ``a .. b``, a row that is None and
    the buffer its all-to-all received into; ``gathered``: each chunk's all-gather's buffer):
    in `_pipeline`'s order, each chunk's messages of row ``rank`` decoded and summed (into the
    scratch: the sums were sent already) and each rank's reduced row decoded into its place in
    flat ``out`` (a call place's C++ run hands it a call whose messages did not belong to it,
    `backend.call_plan.CallPlan.finish_received`, which then raises what the Python run
    raises)."""
    scattering: collections.deque = collections.deque()
    gathering: collections.deque = collections.deque()

    def reduce_oldest() -> None:
        a, b, messages, second = scattering.popleft()
        comp.decode_sum(messages.view(n, -1), b - a, rank, comp.scratch(b - a, messages.device))
        gathering.append((a, b, second))

    def gather_oldest() -> None:
        a, b, second = gathering.popleft()
        decode_columns(comp, second.view(n, -1), n, m, a, b, out)

    chunks_received = [(a, b, messages, second)
                       for (a, b, _, messages), second in zip(received, gathered, strict=True)]
    _in_pipeline_order(len(chunks_received), lambda k: scattering.append(chunks_received[k]),
                       scattering, reduce_oldest, gathering, gather_oldest)


def _place_row(comp: CallCompressor, out: torch.Tensor, m: int, r: int, a: int, b: int,
               messages: torch.Tensor) -> None:
    """Every rank's messages of columns ``a .. b`` of row ``r`` (rows of ``m``) decoded and
    summed into their place in flat ``out`` (`_row_target`), where any of it lies there."""
    target = _row_target(out, m, r, a, b)
    if target is not None:
        _decode_row(comp, messages, r, b - a, *target, messages.device)


def _gather_all_reduce(source: Source, out: torch.Tensor, comp: CallCompressor,
                       transport: Transport, ranges: list[tuple[int, int]], prefix: str) -> None:
    """The two-rank all-reduce (module docstring): all-gather the codes of every row and
    decode-sum each row's messages of every rank, one chunk in flight while the next is encoded.

    With one chunk, all rows travel in one all-gather. With several, each row's slice of a chunk
    travels in its own, started as soon as it is encoded, so that every rank's messages of a
    row arrive side by side (``[n, P]``) and are decoded where they landed."""
    rows, m, n = source.rows, source.m, transport.size
    device = source.tensor.device
    in_flight: collections.deque = collections.deque()

    def place_oldest() -> None:
        a, b, row, pending = in_flight.popleft()
        gathered = pending.wait()
        if row is not None:
            _place_row(comp, out, m, row, a, b, gathered.view(n, -1))
            return
        if comp.decode_rows(gathered.view(n * rows, -1), n, m, out):
            return
        gathered = gathered.view(n, rows, -1)
        for r in range(rows):
            _place_row(comp, out, m, r, a, b, gathered[:, r])

    if len(ranges) == 1:
        name = prefix + "gather"
        messages = encode_columns(comp, name, source, 0, m)
        received = comp.received(name, n * messages.numel(), device)
        pending = transport.all_gather_async(messages, received)
        if received is None or device.type != "cpu":
            in_flight.append((0, m, None, pending))
        else:  # the decodes' views made while the transfer runs: the first Python after a
            # wait runs several times slower here (caches, a core woken up)
            _gather_one_chunk(received.view(n, rows, -1), pending, out, comp, m, device)
            return
    else:
        for k, (a, b) in enumerate(ranges):
            name = stage(prefix + "gather", k, len(ranges))
            for r in range(rows):
                messages = encode_row(comp, name, source, r, a, b)
                in_flight.append((a, b, r, transport.all_gather_async(
                    messages, comp.received(f"{name}.{r}", n * messages.numel(), device))))
                if len(in_flight) > rows:
                    place_oldest()
    while in_flight:
        place_oldest()
