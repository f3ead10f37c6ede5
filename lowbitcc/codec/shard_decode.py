"""`ShardDecodes`: how a `shard_codec.ShardCodec` decodes the messages it receives: checked
against its call first (`message_checks.MessageChecks`: on the host for CPU messages, on the
device, fused into the decode where the kernels can, for CUDA ones), then summed or decoded
into their places by its kernels."""

from __future__ import annotations

import torch

from lowbitcc.codec import framing
from lowbitcc.codec.interface import CallCount, Flag, unfused
from lowbitcc.codec.message_checks import MessageChecks


class ShardDecodes(MessageChecks):
    """The decodes of a codec's call (`MessageChecks`' fields, and ``count``: the call place's
    counter on the device, `interface.CallCount`, or None)."""

    count: CallCount | None

    def decode_sum(self, messages: torch.Tensor, m: int, shard: int,
                   out: torch.Tensor | None = None,
                   verdict: torch.Tensor | None = None) -> tuple[torch.Tensor, Flag]:
        """Sum in fp32, in row order, of ``k`` messages of the same shard: ``([m], nonfinite)``.

        ``out`` (fp32 ``[m]``, contiguous, on the messages' device), when given, receives the
        sum and is returned; otherwise a new tensor is allocated. ``nonfinite`` is a bool for
        CPU messages and a 0-dim bool tensor for CUDA ones (see `check_on_device`, where a
        message that does not belong to the call turns the sum into NaN and counts as
        non-finite). ``verdict``: the call's (`framing.new_verdict`), which CUDA checks set:
        ``nonfinite`` is then its non-finite byte only (a foreign message shows in its foreign
        byte, which the caller reads with it), and the NaN follows any foreign message of the
        call so far."""
        shards = [shard] * messages.shape[0]
        cpu = messages.device.type == "cpu"  # checked on the host before: nothing fused
        fused = None if cpu else self._fused_check(messages, m, shards, verdict)
        nonfinite = fused[1] if fused else (self.check_on_host(messages, m, shards) if cpu else
                                            self._check_before(messages, m, shards, verdict))
        if out is None:
            out = torch.empty(m, dtype=torch.float32, device=messages.device)
        elif (out.numel() != m or out.dtype != torch.float32 or not out.is_contiguous()
              or out.device != messages.device):
            raise ValueError(f"decode_sum: out must be a contiguous float32 tensor of {m} elements "
                             f"on {messages.device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        if cpu:
            self.kernels.decode_sum(messages, m, self.bits, self.group_size, self.fmt,
                                    out.view(-1), None)
            return out, nonfinite
        if fused:
            self.kernels.decode_sum(messages, m, self.bits, self.group_size, self.fmt,
                                    out.view(-1), verdict, check=fused[0], count=self.count)
            return out, nonfinite
        if self.count is not None:
            unfused(self.count, "decode")
        self.kernels.decode_sum(messages, m, self.bits, self.group_size, self.fmt, out.view(-1),
                                self._first(messages, verdict))
        return out, self._check_after(messages, m, shards, out, nonfinite, verdict)

    def decode_rows(self, messages: torch.Tensor, senders: int, m: int, out: torch.Tensor,
                    verdict: torch.Tensor | None) -> Flag | None:
        """Where the kernels decode every row of gathered ``messages`` at once (``fuses_rows``;
        a device, the call's ``verdict``, checksums off, no host check: `_fused_check`, which
        checks their sizes, raising `wire.WireFormatError`; ``out`` not empty): row ``r`` of
        flat ``out`` (fp32, bf16 or fp16, contiguous, at most ``n * m`` elements) becomes the sum
        in sender order of the ``senders``' messages of row ``r`` (``messages``: uint8
        ``[senders * n, P]``, contiguous, sender by sender, row ``q`` of shard ``q % n``),
        cast, as `decode_sum` and a cast would write it, but NaN everywhere where any row is
        foreign (as `decode_into`; every row is checked, also one past ``out``, which row by
        row no decode read); returns the non-finite answer (a view of the verdict). None:
        nothing done (decode row by row with `decode_sum`)."""
        if (out.numel() == 0 or not messages.is_contiguous()
                or not getattr(self.kernels, "fuses_rows", False)):
            if self.count is not None:
                unfused(self.count, "decode")
            return None
        n = messages.shape[0] // senders
        fused = self._fused_check(messages, m, list(range(n)) * senders, verdict)
        if fused is None or verdict is None:
            if self.count is not None:
                unfused(self.count, "decode")
            return None
        if out.numel() > n * m or not out.is_contiguous() or out.device != messages.device:
            raise ValueError(f"decode_rows: out must be contiguous, on {messages.device}, with at "
                             f"most {n * m} elements; got {out.numel()} on {out.device}")
        self.kernels.decode_rows(messages, senders, m, self.bits, self.group_size, self.fmt,
                                 out.view(-1), verdict, fused[0][0], self.count)
        return fused[1]

    def decode_into(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                    out: torch.Tensor, verdict: torch.Tensor | None = None) -> Flag:
        """Decode rows into flat ``out`` (row ``r`` -> ``out[r*m ...]``, cast); returns nonfinite
        (as `decode_sum`, and ``verdict`` likewise)."""
        fused = self._fused_check(messages, m, shard_ids, verdict)
        nonfinite = fused[1] if fused else self._check_before(messages, m, shard_ids, verdict)
        if out.numel() > messages.shape[0] * m or not out.is_contiguous():
            raise ValueError("decode_into: out must be contiguous and hold at most rows * m elements")
        if out.device != messages.device:
            raise ValueError(f"decode_into: out is on {out.device}, the messages on {messages.device}")
        if fused:
            self.kernels.decode_into(messages, m, self.bits, self.group_size, self.fmt, out,
                                     verdict, check=fused[0], count=self.count)
            return nonfinite
        if self.count is not None:
            unfused(self.count, "decode")
        self.kernels.decode_into(messages, m, self.bits, self.group_size, self.fmt, out,
                                 self._first(messages, verdict))
        return self._check_after(messages, m, shard_ids, out, nonfinite, verdict)

    def _fused_check(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                     verdict: torch.Tensor | None
                     ) -> tuple[tuple[bytes, list[int]], torch.Tensor] | None:
        """Where the kernels check the rows in the decode itself (``fuses_check``: a device,
        the call's ``verdict``, checksums off, no host check): the sizes checked, the decode's
        ``check`` argument and the non-finite answer (a view of the verdict); else None."""
        if (verdict is None or self.checksum or self.host_check
                or messages.device.type == "cpu" or not getattr(self.kernels, "fuses_check", False)):
            return None
        self.check_size(messages, m, shard_ids)
        return (self.header(m), shard_ids), framing.verdict_flag(verdict, framing.VERDICT_NONFINITE)

    def _first(self, messages: torch.Tensor, verdict: torch.Tensor | None) -> torch.Tensor | None:
        """The call's ``verdict`` where the device check runs before the decode (which then
        writes NaN itself where a message was foreign), else None."""
        if verdict is None or messages.device.type == "cpu" or self.host_check:
            return None
        return verdict

    def _check_before(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                      verdict: torch.Tensor | None = None) -> Flag:
        """CPU (or ``host_check``): the whole check, before any kernel reads the messages;
        CUDA: sizes, and with the call's ``verdict`` the device check (`_first`)."""
        if messages.device.type == "cpu" or self.host_check:
            return self.check_on_host(messages, m, shard_ids)
        self.check_size(messages, m, shard_ids)
        if verdict is not None:
            return self.check_on_device(messages, m, shard_ids, verdict)[0]
        return False

    def _check_after(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                     out: torch.Tensor, nonfinite: bool,
                     verdict: torch.Tensor | None = None) -> Flag:
        """CUDA without the call's verdict: the header check on the device after the decode; a
        foreign message's values become NaN."""
        if messages.device.type == "cpu" or self.host_check or verdict is not None:
            return nonfinite
        flagged, foreign = self.check_on_device(messages, m, shard_ids)
        out.masked_fill_(foreign, float("nan"))
        return flagged | foreign
