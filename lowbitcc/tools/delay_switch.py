"""A switch in user space that gives the emulated links delay, jitter and loss.

This machine's kernel has ``tbf`` but no ``netem`` qdisc, so `lowbitcc.tools.netem` emulates a
wide-area link with TUN devices instead of a bridge when a delay, jitter or loss is asked for:
each node's namespace gets a TUN device (``wan0``, an IPv4 point-to-point device, so no ARP),
whose other end is a file descriptor held by `DelaySwitch`, a thread of the process that owns
the network. The switch reads each IPv4 packet a node sends, looks up the node that owns the
destination address (``198.18.0.<node + 1>``), and writes the packet into that node's device
once the link's model says it arrives:

- **rate**: each node's device sends through a kernel ``tbf`` (the node's uplink, as on the
  bridge), and the switch serialises packets onto each destination's downlink at the same rate
  (so that several senders converging on one node share its link, as at a switch port), with
  drop-tail when a packet would wait more than `QUEUE_LIMIT_S` for its downlink;
- **delay and jitter**: each packet arrives ``delay`` plus a jitter drawn uniformly from
  ``[-jitter, +jitter]`` (netem's default distribution) after it left the downlink, but never
  before the packet sent before it to the same node: FIFO per destination, no reordering (netem
  reorders when the jitter exceeds the gap between packets; TCP then sends duplicate ACKs that a
  real path rarely shows);
- **loss**: each packet is dropped independently with probability ``loss`` (netem's ``loss
  random``), before it is queued.

The one-way delay between two nodes is ``delay``: a round trip takes ``2 * delay`` plus the
serialisation. The devices' MTU is `MTU` (jumbo frames: a Python switch forwards some 10^4-10^5
packets a second, and at 1500 bytes that would cap the links near 1 Gbit/s).

`tun_device(name)` opens one device (in the caller's namespace, from where ``ip link set ...
netns`` moves it; the file descriptor stays valid, and the device disappears with the
descriptor or the namespace). Packets not IPv4 or to an unknown address are dropped.
"""

from __future__ import annotations

import dataclasses
import fcntl
import heapq
import logging
import os
import random
import selectors
import struct
import threading
import time

log = logging.getLogger("lowbitcc.tools.netem")

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 9000
QUEUE_LIMIT_S = 0.05
"""Longest a packet waits for its destination's downlink before it is dropped (tbf's
``latency 50ms`` on the bridge's links)."""


def tun_device(name: str) -> int:
    """Create the IPv4 TUN device ``name`` in this process's namespace; returns its
    non-blocking file descriptor (reads and writes are whole IP packets, no header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """What each packet meets: ``rate`` in bits/s (None: unlimited), one-way ``delay`` and
    ``jitter`` in seconds, ``loss`` as a probability."""

    rate: int | None
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0


class DelaySwitch:
    """Forwards packets among the TUN devices ``fds`` (``fds[i]`` is node ``i``'s, whose address
    ends in ``i + 1``) under ``model``; `start` runs it on a daemon thread, `stop` ends it.

    Only its own thread touches the queues; ``fds`` stay owned by the caller (closed by it)."""

    def __init__(self, fds: list[int], model: LinkModel, seed: int = 0) -> None:
        self._fds = fds
        self._model = model
        self._random = random.Random(seed)
        self._free_at = [0.0] * len(fds)  # when each downlink finishes its last packet
        self._last_arrival = [0.0] * len(fds)
        self._due: list[tuple[float, int, int, bytes]] = []  # (arrival, order, node, packet)
        self._order = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lowbitcc-delay-switch",
                                        daemon=True)
        self.forwarded = 0
        self.dropped = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def route(self, packet: bytes, now: float) -> None:
        """Queue ``packet`` (read at ``now``) for its destination, or drop it."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return
        node = packet[19] - 1
        if not 0 <= node < len(self._fds) or packet[16:19] != bytes((198, 18, 0)):
            return
        model = self._model
        if model.loss and self._random.random() < model.loss:
            self.dropped += 1
            return
        start = max(now, self._free_at[node])
        if start - now > QUEUE_LIMIT_S:
            self.dropped += 1
            return
        sent = start + (len(packet) * 8 / model.rate if model.rate else 0.0)
        self._free_at[node] = sent
        jitter = self._random.uniform(-model.jitter, model.jitter) if model.jitter else 0.0
        arrival = max(sent + max(0.0, model.delay + jitter), self._last_arrival[node])
        self._last_arrival[node] = arrival
        self._order += 1
        heapq.heappush(self._due, (arrival, self._order, node, packet))

    def deliver(self, now: float) -> None:
        """Write every packet whose arrival time has come into its node's device."""
        while self._due and self._due[0][0] <= now:
            _, _, node, packet = heapq.heappop(self._due)
            try:
                os.write(self._fds[node], packet)
                self.forwarded += 1
            except OSError:  # the node's queue is full or its namespace is gone: a lost packet
                self.dropped += 1

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            for fd in self._fds:
                sel.register(fd, selectors.EVENT_READ)
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = 0.05 if not self._due else max(0.0, min(0.05, self._due[0][0] - now))
                for key, _ in sel.select(timeout):
                    self._drain(key.fd)
                self.deliver(time.monotonic())
        log.info("delay switch: %d packets forwarded, %d dropped", self.forwarded, self.dropped)

    def _drain(self, fd: int) -> None:
        while True:
            try:
                packet = os.read(fd, MTU + 64)
            except (BlockingIOError, OSError):
                return
            self.route(packet, time.monotonic())
