"""Counting a process's descriptor exchanges (`CallAgreement.exchange`), in a rank process."""

from __future__ import annotations

import threading

from lowbitcc.backend.call_agreement import CallAgreement
from lowbitcc.backend.renewal import PlaceRenewal

_renewing = threading.local()


def counting_exchanges() -> list[int]:
    """Count this process's descriptor exchanges made for a call from now on (a place's
    renewal's, `counting_renewals`, are not): the returned list gains each exchanged call's
    element count. Patches `CallAgreement` for the rest of the process (the worker calls
    ``exchange`` directly, so both issuers are counted)."""
    seen: list[int] = []
    exchange = CallAgreement.exchange
    renewal_exchange = PlaceRenewal._exchange

    def counted(self, call, own=None):
        if not getattr(_renewing, "on", False):
            seen.append(call.numel)
        return exchange(self, call, own)

    def renewing(self):
        _renewing.on = True
        try:
            return renewal_exchange(self)
        finally:
            _renewing.on = False

    CallAgreement.exchange = counted
    PlaceRenewal._exchange = renewing
    return seen


def counting_renewals() -> list[int]:
    """Count this process's place renewals (`lowbitcc.backend.renewal`) from now on, as the
    calling thread starts them: the returned list gains each renewed call's element count."""
    seen: list[int] = []
    init = PlaceRenewal.__init__

    def counted(self, group, device_type, entry, deviated):
        seen.append(entry.desc.numel)
        init(self, group, device_type, entry, deviated)

    PlaceRenewal.__init__ = counted
    return seen
