"""Compressed reduce-scatter / all-reduce schedules (see docs/architecture.md)."""

from lowbitcc.algorithms import direct

SCHEDULES = {"direct": direct}

__all__ = ["SCHEDULES", "direct"]
