"""`MessageChecks`: how a `shard_codec.ShardCodec` checks the messages it receives against its
call (sizes, headers, checksums), on the host (raising `wire.WireFormatError`) or on the device
(answers as device flags, no synchronisation)."""

from __future__ import annotations

import torch

from lowbitcc.codec import wire
from lowbitcc.codec.interface import Kernels


class MessageChecks:
    """The checks of received messages of a codec's call: the codec's fields (``bits``,
    ``fmt``, ``group_size``, ``dtype_code``, ``seq``, ``world``, ``signature``, ``checksum``),
    its ``kernels``, ``header(m)`` and ``message_bytes(m)`` are the call's."""

    bits: int
    fmt: str
    group_size: int
    dtype_code: int
    seq: int
    world: int
    signature: int
    checksum: bool
    kernels: Kernels

    def header(self, m: int) -> bytes:
        raise NotImplementedError

    def message_bytes(self, m: int) -> int:
        raise NotImplementedError

    def check_on_device(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                        verdict: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nonfinite, foreign)``, 0-dim bool tensors on the messages' device, without a host
        synchronisation: whether a row is flagged non-finite, and whether a header differs
        from this call's or a checksum from the payload's (sizes are checked by `check_size`
        first); views of ``verdict`` where given (`interface.Kernels.check`)."""
        return self.kernels.check(messages, self.header(m), shard_ids, self.checksum, verdict)

    @staticmethod
    def _trailers(messages: torch.Tensor) -> torch.Tensor:
        """int64 ``[rows]``: the checksums the messages carry."""
        return messages[:, -wire.TRAILER_BYTES:].contiguous().view(torch.int64).view(-1)

    def check_size(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> None:
        """Raise `wire.WireFormatError` unless ``messages`` is ``uint8 [len(shard_ids), P]``
        with contiguous rows (rows may lie apart: a column of gathered messages)."""
        expected_bytes = self.message_bytes(m)
        if messages.dtype != torch.uint8 or messages.dim() != 2 or not (
                (messages.shape[1] <= 1 or messages.stride(1) == 1)
                and (messages.shape[0] <= 1 or messages.stride(0) >= messages.shape[1])):
            raise wire.WireFormatError("messages must be a 2-D uint8 tensor of contiguous rows")
        if messages.shape[1] != expected_bytes or messages.shape[0] != len(shard_ids):
            raise wire.WireFormatError(
                f"expected {len(shard_ids)} messages of {expected_bytes} bytes, "
                f"got {tuple(messages.shape)}"
            )

    def check_on_host(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> bool:
        """Validate size, header and checksum of each row against this call; True if any row is
        flagged non-finite. Raises `wire.WireFormatError` naming the first difference (reads the
        headers on the host: a synchronisation for CUDA messages). The kernels' `verify` settles
        messages that belong to the call; the rest are read here, field by field."""
        self.check_size(messages, m, shard_ids)
        verdict = self.kernels.verify(messages, self.header(m), shard_ids, self.checksum)
        if verdict >= 0:
            return bool(verdict)
        nonfinite = False
        raw = messages[:, :wire.HEADER_BYTES].cpu().numpy().tobytes()
        deviated: list[int | None] = [None] * len(shard_ids)
        for i, shard in enumerate(shard_ids):
            h = wire.ShardHeader.unpack(raw[i * wire.HEADER_BYTES:(i + 1) * wire.HEADER_BYTES])
            if h.flags & wire.FLAG_DEVIATED:
                deviated[i] = h.signature
                continue
            problems = [
                f"{name} {got} != {want}"
                for name, got, want in (
                    ("bits", h.bits, self.bits),
                    ("format", h.fmt, self.fmt),
                    ("group size", h.group_size, self.group_size),
                    ("numel", h.numel, m),
                    ("dtype", h.dtype_code, self.dtype_code),
                    ("sequence", h.seq, self.seq & 0xFFFFFFFF),
                    ("shard", h.shard, shard),
                    ("world", h.world, self.world),
                    ("signature", h.signature, self.signature),
                )
                if got != want
            ]
            if problems:
                raise wire.WireFormatError(
                    f"message {i} does not belong to this call: " + ", ".join(problems)
                )
            if h.flags & wire.FLAG_PEER_ERROR:
                raise wire.PeerWireFormatError(
                    f"message {i} (shard {shard}) comes from a rank that received a corrupt or "
                    "foreign message earlier in this call")
            nonfinite |= bool(h.flags & wire.FLAG_NONFINITE)
        if any(s is not None for s in deviated):
            rows = [i for i, s in enumerate(deviated) if s is not None]
            raise wire.DeviatedCallError(
                f"message(s) {rows} come from ranks whose call differs from the one the ranks "
                "agreed on at this point", deviated)
        if self.checksum:
            computed = self.kernels.checksum(messages.contiguous())
            if not torch.equal(messages[:, -wire.TRAILER_BYTES:],
                               computed.view(torch.uint8).view(-1, wire.TRAILER_BYTES)):
                carried = self._trailers(messages)
                i = int((carried != computed).nonzero()[0])
                raise wire.WireFormatError(
                    f"message {i} (shard {shard_ids[i]}) fails its checksum "
                    f"({int(carried[i]) & (2**64 - 1):#018x} carried, "
                    f"{int(computed[i]) & (2**64 - 1):#018x} computed): its scales or codes "
                    "were corrupted in transit")
        return nonfinite
