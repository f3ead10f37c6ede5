"""Framing shard messages with torch operations: `interface.Kernels.frame`, ``verify`` and
``check`` for the kernels that do not fuse them (the reference everywhere; the CUDA kernels, whose frame is
these operations on the device, without a host synchronisation). The C++ kernels do the same
in ``csrc/cpu_codec.cpp`` (``frame``, ``verify``), byte for byte (``tests/codec/test_framing.py``).
"""

from __future__ import annotations

import functools

import torch

from lowbitcc.codec import wire
from lowbitcc.codec.interface import Flag, Kernels

VERDICT_FOREIGN, VERDICT_NONFINITE = 0, 1
"""Bytes of a call's *verdict* (uint8 ``[8]`` on its device, zero at first; `new_verdict`) that
the kernels set to 1: a received message did not belong to the call; a row is non-finite."""


def new_verdict(device: torch.device, cleared_by_encode: bool = False) -> torch.Tensor:
    """A call's verdict: uint8 ``[8]``, one word of ``device`` memory: zeros (one fill), or,
    ``cleared_by_encode``, left for the call's first encode to zero (`interface.EncodeArgs`'s
    ``clear``: no fill)."""
    alloc = torch.empty if cleared_by_encode else torch.zeros
    return alloc(1, dtype=torch.int64, device=device).view(torch.uint8)


def verdict_flag(verdict: torch.Tensor, byte: int) -> torch.Tensor:
    """Byte ``byte`` of ``verdict`` as a 0-dim bool view (no copy)."""
    return verdict.view(torch.bool)[byte]


@functools.lru_cache(maxsize=64)  # a call's encode and decodes ask for the same
def call_header(bits: int, dtype_code: int, group_size: int, numel: int, seq: int, world: int,
                signature: int, fmt: str) -> bytes:
    """The header of a call's messages of ``numel`` elements, with shard 0 and flags 0 (the
    kernels write each row's own: `interface.Kernels.frame`)."""
    return wire.ShardHeader(bits=bits, dtype_code=dtype_code, flags=0, group_size=group_size,
                            numel=numel, seq=seq, shard=0, world=world, signature=signature,
                            fmt=fmt).pack()


def header_rows(header: bytes, shards: list[int], device: torch.device) -> torch.Tensor:
    """uint8 ``[len(shards), HEADER_BYTES]`` on ``device``: ``header`` with each row's shard
    (copied without synchronising on CUDA)."""
    rows = bytearray(header * len(shards))
    for r, shard in enumerate(shards):
        at = r * wire.HEADER_BYTES + wire.SHARD_OFFSET
        rows[at:at + 2] = shard.to_bytes(2, "little")
    host = torch.frombuffer(rows, dtype=torch.uint8).view(len(shards), wire.HEADER_BYTES)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def frame_with_torch(kernels: Kernels, messages: torch.Tensor, header: bytes, shards: list[int],
                     nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
                     verdict: torch.Tensor | None = None) -> Flag:
    """`interface.Kernels.frame` with torch operations on the messages' device (no host
    synchronisation), ``kernels.checksum`` for the trailer."""
    rows = messages.shape[0]
    bad = (nonfinite.view(rows, -1) != 0).any(dim=1)
    messages[:, used:] = 0
    messages[:, :wire.HEADER_BYTES] = header_rows(header, shards, messages.device)
    messages[:, wire.FLAGS_OFFSET] = bad.to(torch.uint8) * wire.FLAG_NONFINITE | flags
    if checksum:
        messages[:, -wire.TRAILER_BYTES:] = kernels.checksum(messages).view(torch.uint8).view(
            rows, wire.TRAILER_BYTES)
    if verdict is not None:
        answer = verdict_flag(verdict, VERDICT_NONFINITE)
        return answer.logical_or_(bad.any())
    return bad.any() if messages.device.type != "cpu" else bool(bad.any())


def verify_with_torch(kernels: Kernels, messages: torch.Tensor, header: bytes,
                      shards: list[int], checksum: bool) -> int:
    """`interface.Kernels.verify` with torch operations (reads the verdict on the host)."""
    got = messages[:, :wire.HEADER_BYTES]
    flags = got[:, wire.FLAGS_OFFSET]
    if bool(((flags & (0xFF ^ wire.FLAG_NONFINITE)) != 0).any()):
        return -1
    want = header_rows(header, shards, messages.device).clone()
    want[:, wire.FLAGS_OFFSET] = flags
    if not torch.equal(got, want):
        return -1
    if checksum:
        carried = messages[:, -wire.TRAILER_BYTES:]
        computed = kernels.checksum(messages.contiguous()).view(torch.uint8).view(
            -1, wire.TRAILER_BYTES)
        if not torch.equal(carried, computed):
            return -1
    return int(bool(((flags & wire.FLAG_NONFINITE) != 0).any()))



def check_with_torch(kernels: Kernels, messages: torch.Tensor, header: bytes,
                     shards: list[int], checksum: bool,
                     verdict: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`interface.Kernels.check` with torch operations on the messages' device (no host
    synchronisation), ``kernels.checksum`` for the trailers."""
    got = messages[:, :wire.HEADER_BYTES]
    flags = got[:, wire.FLAGS_OFFSET]
    diff = got != header_rows(header, shards, messages.device)
    diff[:, wire.FLAGS_OFFSET] = (flags & (0xFF ^ wire.FLAG_NONFINITE)) != 0
    foreign = diff.any()
    if checksum:
        carried = messages[:, -wire.TRAILER_BYTES:].contiguous().view(torch.int64).view(-1)
        foreign = foreign | (carried != kernels.checksum(messages)).any()
    nonfinite = ((flags & wire.FLAG_NONFINITE) != 0).any()
    if verdict is not None:
        return (verdict_flag(verdict, VERDICT_NONFINITE).logical_or_(nonfinite),
                verdict_flag(verdict, VERDICT_FOREIGN).logical_or_(foreign))
    return nonfinite, foreign


class TorchFraming:
    """`interface.Kernels.frame`, ``verify`` and ``check`` by the torch forms above: what a
    kernels class takes for those it does not fuse (it provides ``checksum``)."""

    def frame(self, messages: torch.Tensor, header: bytes, shards: list[int],
              nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
              verdict: torch.Tensor | None = None) -> Flag:
        return frame_with_torch(self, messages, header, shards, nonfinite, used, flags, checksum,
                                verdict)

    def verify(self, messages: torch.Tensor, header: bytes, shards: list[int],
               checksum: bool) -> int:
        return verify_with_torch(self, messages, header, shards, checksum)

    def check(self, messages: torch.Tensor, header: bytes, shards: list[int],
              checksum: bool, verdict: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return check_with_torch(self, messages, header, shards, checksum, verdict)
