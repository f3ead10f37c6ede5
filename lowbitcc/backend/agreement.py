"""Every rank of a "loco" group checks, when the group is created, that all share its settings.

Settings decide the wire (bits, group size, schedule, chunking, transport) and which calls are
compressed (policy, min_size, check, cost_model); ranks that differ would issue different
operations for the same call: a hang or an abort inside gloo. So each rank publishes its
`LocoConfig` (or the error it raised reading one) in the group's store under
``lowbitcc/config/<rank>`` and reads every other rank's, then either all go on or all raise a
``ValueError`` that names the setting and each rank's value (or the rank whose configuration was
invalid), within the group's timeout.

Ranks also publish what their settings resolve to (`RESOLVED`: the wire format, group size and
feedback that "auto" and the defaults give), so that two builds whose defaults differ (NVFP4
became the default on 2026-11-27) raise here rather than at the first compressed call.

Two settings are each rank's own: ``codec`` (every implementation gives the same bytes) and
``max_keys`` (a local memory bound).
Each rank also publishes its build's `PROTOCOL` (the wire
format version and the size of a descriptor exchange): ranks running lowbitcc builds that speak
different protocols raise a ``ValueError`` naming them, instead of exchanging frames of
different sizes at the first call (gloo aborts the process there).
"""

from __future__ import annotations

import dataclasses
import datetime
import json

import torch.distributed as dist

from lowbitcc.codec import exchange_frame, wire
from lowbitcc.config import LocoConfig

LOCAL_SETTINGS = ("codec", "max_keys")
"""`LocoConfig` fields that may differ between the ranks of a group."""

RESOLVED = ("wire_format", "wire_group_size", "wire_feedback")
"""`LocoConfig` properties every rank publishes and compares beside its fields."""

_KEY = "lowbitcc/config/{}"

PROTOCOL = {"wire format": wire.VERSION, "descriptor exchange bytes": exchange_frame.EXCHANGE_BYTES}
"""What ranks' builds must share to talk to each other (compared at group creation)."""


def agree(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
          config: LocoConfig | None, error: Exception | None = None,
          protocol: dict[str, int] | None = None) -> LocoConfig:
    """Publish this rank's ``config`` (or ``error``, the exception reading it raised) and
    ``protocol`` (default `PROTOCOL`), and return ``config`` once every rank of the group has
    published the same protocol and shared settings; raise ``error`` itself, or a
    ``ValueError`` naming what differs, on every rank otherwise."""
    mine: dict = {"error": f"{type(error).__name__}: {error}"} if error is not None else {
        "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(LocoConfig)},
        "resolved": {name: getattr(config, name) for name in RESOLVED}}
    mine["protocol"] = PROTOCOL if protocol is None else protocol
    store.set(_KEY.format(rank), json.dumps(mine))
    keys = [_KEY.format(r) for r in range(size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:  # DistStoreError: a rank never came
        missing = [r for r in range(size) if not store.check([_KEY.format(r)])]
        raise dist.DistBackendError(
            f"lowbitcc: ranks {missing} of this 'loco' group did not publish their settings "
            f"within {timeout} ({exc})") from exc
    published = [json.loads(store.get(key)) for key in keys]
    protocols = [p.get("protocol") for p in published]
    if any(p != protocols[0] for p in protocols):
        per_rank = "; ".join(
            f"rank {r}: " + (", ".join(f"{k} {v}" for k, v in p.items()) if p else "unknown")
            for r, p in enumerate(protocols))
        raise ValueError(
            "lowbitcc: the ranks of a 'loco' group run lowbitcc builds that speak different "
            f"protocols ({per_rank}); install the same lowbitcc on every rank")
    if error is not None:
        raise error
    invalid = [(r, p["error"]) for r, p in enumerate(published) if "error" in p]
    if invalid:
        r, message = invalid[0]
        raise ValueError(f"lowbitcc: rank {r}'s 'loco' settings are invalid ({message}); every "
                         "rank of the group raises")
    assert config is not None
    shared = [(f.name, [p["config"][f.name] for p in published])
              for f in dataclasses.fields(LocoConfig) if f.name not in LOCAL_SETTINGS]
    shared += [(f"{name}, what the settings resolve to",  # None: a build that publishes none
                [p.get("resolved", {}).get(name) for p in published]) for name in RESOLVED]
    differing = []
    for label, values in shared:
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differing.append(f"{label} ({per_rank})")
    if differing:
        raise ValueError(
            "lowbitcc: the ranks of a 'loco' group must share their settings (LOCO_* variables "
            "or pg_options); these differ: " + "; ".join(differing))
    return config

