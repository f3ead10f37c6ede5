"""Transports: how bytes move between the ranks of a "loco" group (see `base.Transport`)."""

from lowbitcc.backends.base import Transport
from lowbitcc.backends.gloo import GlooTransport

__all__ = ["GlooTransport", "Transport"]
