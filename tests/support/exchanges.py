"""Counting a process's descriptor exchanges (`CallAgreement.exchange`), in a rank process."""

from __future__ import annotations

from lowbitcc.backend.call_agreement import CallAgreement


def counting_exchanges() -> list[int]:
    """Count this process's descriptor exchanges from now on: the returned list gains each
    exchanged call's element count. Patches `CallAgreement` for the rest of the process (the
    worker calls ``exchange`` directly, so both issuers are counted)."""
    seen: list[int] = []
    exchange = CallAgreement.exchange

    def counted(self, call, own=None):
        seen.append(call.numel)
        return exchange(self, call, own)

    CallAgreement.exchange = counted
    return seen
