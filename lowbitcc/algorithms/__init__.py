"""Compressed reduce-scatter / all-reduce schedules (see docs/architecture.md)."""

from lowbitcc.algorithms import direct

from lowbitcc.config import SCHEDULES as _NAMES

SCHEDULES = {"direct": direct}
assert tuple(SCHEDULES) == _NAMES, "config.SCHEDULES must name every schedule"

__all__ = ["SCHEDULES", "direct"]
