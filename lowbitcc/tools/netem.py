"""Network emulation on one machine: each local rank in its own network namespace, behind an
emulated link (rate, and for wide-area links delay, jitter and loss).

`EmulatedNetwork(nranks, link)` builds, as root, this topology (names from ``prefix``)::

    {prefix}-r0: veth0 198.18.0.1/24 ─┐
    {prefix}-r1: veth0 198.18.0.2/24 ─┼── {prefix}-sw: bridge sw0 (ports p0, p1, ...)
    ...                              ─┘

Every veth end, the node's side and the switch's side, gets a ``tc tbf`` rate limit, so each
node has a full-duplex link of ``link.rate`` to a switch, as a NIC on a top-of-rack switch does.
A node is one namespace and holds ``ranks_per_node`` consecutive ranks (default 1): ranks of one
node reach each other through the namespace's own address, which the kernel routes over its
loopback device (unshaped, counted on ``lo``), as the GPUs of one server talk over NVLink.

A `Link` with a delay, jitter or loss is a wide-area link. Where the kernel has the ``netem``
qdisc (`kernel_netem_available`) it is the bridge above with ``netem`` (delay one way, jitter,
loss) at the root of each node's uplink, the tbf its child. Where it has not (as on this
development machine), the links are TUN devices (``wan0``, MTU 9000) joined by
`lowbitcc.tools.delay_switch.DelaySwitch`, a thread of the process that owns the network: tbf
shapes each uplink; the switch shapes the downlinks, delays each packet one way (jitter
without reordering) and drops it with probability ``loss``. The log says which ran; what
neither models is in docs/wan.md.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544) and exist only inside the
namespaces this module creates; nothing stays in the caller's namespace (a wide-area link's TUN
device is created there and moved at once). Leaving the context (normally, on an exception, on
Ctrl-C or SIGTERM) deletes the namespaces, which deletes their links and qdiscs with them;
`cleanup(prefix)` removes what a killed run left behind.

`run_ranks(command, nranks, link)` starts ``command`` once per rank inside the network, with
the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) plus GLOO_SOCKET_IFNAME, and returns the first non-zero exit code.

Command construction (`EmulatedNetwork.setup_commands` / `teardown_commands`) is pure, so it is
unit-tested without root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

from lowbitcc.tools.delay_switch import MTU, DelaySwitch, tun_device
from lowbitcc.tools.link_spec import Link, parse_rate

log = logging.getLogger("lowbitcc.tools.netem")

SUBNET = "198.18.0"
RANK_IFNAME = "veth0"
WAN_IFNAME = "wan0"
DEFAULT_PORT = 29517
NETEM_LIMIT = 100_000
"""Packets netem holds (its default, 1000, drops what a 1 Gbit/s link with 40 ms holds)."""
def tbf_burst_bytes(rate_bits: int) -> int:
    """Bucket size for ``rate_bits``: 2 ms of traffic, at least 256 KiB (a GSO super-packet of
    64 KiB must fit, and a small bucket makes tbf undershoot its rate at 10 Gbit/s)."""
    return max(256 << 10, rate_bits // 8 // 500)


def missing_requirements() -> list[str]:
    """What this machine lacks to emulate a network (empty when everything is there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_NET_ADMIN; run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (Debian package iproute2)")
    return missing


@dataclasses.dataclass(frozen=True)
class EmulatedNetwork:
    """A switch and ``nranks`` namespaces with links ``link`` (a `Link`, a tc rate, or None:
    unshaped).

    Use as a context manager: entering runs `setup_commands` (and, for a wide-area link, opens
    the TUN devices and starts the `DelaySwitch`), leaving undoes it.
    """

    nranks: int
    link: Link | str | None = "1gbit"
    prefix: str = dataclasses.field(default_factory=lambda: f"lbcc{os.getpid()}")
    ranks_per_node: int = 1
    kernel_netem: bool | None = None
    """A wide-area link by the kernel's netem qdisc (True) or the user-space switch (False);
    None: netem where `kernel_netem_available` (decided on entering; the switch until then)."""
    _devices: list[int] = dataclasses.field(default_factory=list, repr=False, compare=False)
    _switch: list[DelaySwitch] = dataclasses.field(default_factory=list, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.nranks <= 250:
            raise ValueError(f"lowbitcc netem: need 1..250 ranks, got {self.nranks}")
        if self.ranks_per_node < 1 or self.nranks % self.ranks_per_node:
            raise ValueError(f"lowbitcc netem: {self.nranks} ranks do not fill nodes of "
                             f"{self.ranks_per_node}")
        object.__setattr__(self, "link", Link.of(self.link))
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", self.prefix):
            raise ValueError(f"lowbitcc netem: invalid namespace prefix {self.prefix!r}")

    # -- names --------------------------------------------------------------------------------
    @property
    def spec(self) -> Link:
        assert isinstance(self.link, Link)
        return self.link

    @property
    def rate(self) -> str | None:
        return self.spec.rate

    @property
    def delay_switch(self) -> bool:
        """Whether the links are TUN devices joined by the user-space `DelaySwitch`."""
        return self.spec.wide_area and not self.kernel_netem

    @property
    def interface(self) -> str:
        """Each node's device on the emulated link (``GLOO_SOCKET_IFNAME``)."""
        return WAN_IFNAME if self.delay_switch else RANK_IFNAME

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def nodes(self) -> int:
        return self.nranks // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-r{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def tun_name(self, node: int) -> str:
        """The name node ``node``'s TUN device has in the caller's namespace before it moves."""
        return f"lt{os.getpid()}_{node}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Argv prefix that runs a command inside the namespace of rank ``rank``'s node."""
        return ["ip", "netns", "exec", self.namespace(self.node_of(rank))]

    # -- commands -----------------------------------------------------------------------------
    def setup_commands(self) -> list[list[str]]:
        """The commands that build the network (a wide-area link's TUN devices must exist,
        named `tun_name`, before the commands that move them run)."""
        if self.delay_switch:
            return self._wide_area_commands()
        cmds = [["ip", "netns", "add", self.switch],
                ["ip", "-n", self.switch, "link", "add", "sw0", "type", "bridge"],
                ["ip", "-n", self.switch, "link", "set", "sw0", "up"]]
        for r in range(self.nodes):
            ns, port = self.namespace(r), f"p{r}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", RANK_IFNAME, "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", self.switch],
                ["ip", "-n", self.switch, "link", "set", port, "master", "sw0"],
                ["ip", "-n", self.switch, "link", "set", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", RANK_IFNAME],
                ["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
            if self.spec.wide_area:
                cmds += self._netem(ns, RANK_IFNAME)
            if self.rate is not None:
                cmds += [self._tbf(ns, RANK_IFNAME, self.spec.wide_area),
                         self._tbf(self.switch, port)]
        return cmds

    def _netem(self, ns: str, dev: str) -> list[list[str]]:
        """The kernel's netem on ``dev``'s egress (the root; the link's tbf its child)."""
        spec = self.spec
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle",
               "1:", "netem", "limit", str(NETEM_LIMIT)]
        if spec.delay or spec.jitter:
            cmd += ["delay", spec.delay or "0ms"] + ([spec.jitter] if spec.jitter else [])
        if spec.loss:
            cmd += ["loss", spec.loss]
        return [cmd]

    def _wide_area_commands(self) -> list[list[str]]:
        cmds = []
        for r in range(self.nodes):
            ns = self.namespace(r)
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "set", "dev", self.tun_name(r), "netns", ns],
                ["ip", "-n", ns, "link", "set", "dev", self.tun_name(r), "name", WAN_IFNAME],
                ["ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", WAN_IFNAME],
                ["ip", "-n", ns, "link", "set", WAN_IFNAME, "mtu", str(MTU), "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
            if self.rate is not None:
                cmds.append(self._tbf(ns, WAN_IFNAME))
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        switch = [] if self.delay_switch else [["ip", "netns", "del", self.switch]]
        return [["ip", "netns", "del", self.namespace(r)] for r in range(self.nodes)] + switch

    def _tbf(self, ns: str, dev: str, under_netem: bool = False) -> list[str]:
        burst = tbf_burst_bytes(parse_rate(self.rate or ""))
        where = ["parent", "1:1", "handle", "10:"] if under_netem else ["root"]
        return ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *where, "tbf",
                "rate", self.rate or "", "burst", str(burst), "latency", "50ms"]

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        missing = missing_requirements()
        if missing:
            raise RuntimeError("lowbitcc netem needs " + "; ".join(missing))
        if self.spec.wide_area and self.kernel_netem is None:
            object.__setattr__(self, "kernel_netem", kernel_netem_available())
        try:
            if self.delay_switch:
                self._devices.extend(tun_device(self.tun_name(r)) for r in range(self.nodes))
            for cmd in self.setup_commands():
                _check_call(cmd)
            if self.delay_switch:
                self._switch.append(DelaySwitch(self._devices, self.spec.model()))
                self._switch[0].start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        how = ("" if not self.spec.wide_area else " by the user-space delay switch (the kernel has "
               "no netem qdisc)" if self.delay_switch else " by the kernel's netem qdisc")
        log.info("emulated network %s: %d ranks on %d nodes, links %s%s", self.prefix,
                 self.nranks, self.nodes, self.spec.describe(), how)
        return self

    def __exit__(self, *exc: object) -> None:
        for switch in self._switch:
            switch.stop()
        self._switch.clear()
        for cmd in self.teardown_commands():
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        for fd in self._devices:
            os.close(fd)
        self._devices.clear()


@functools.cache
def kernel_netem_available() -> bool:
    """Whether this kernel has the netem qdisc: one is added to the loopback device of a
    scratch namespace (root; False without it, or without ``ip`` and ``tc``)."""
    if missing_requirements():
        return False
    probe = f"lbccprobe{os.getpid()}"
    try:
        _check_call(["ip", "netns", "add", probe])
    except RuntimeError:
        return False
    try:
        done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                               "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True, check=False)
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def _check_call(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"lowbitcc netem: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def leftover_namespaces(prefix: str = "lbcc") -> list[str]:
    """Namespaces whose name starts with ``prefix`` (what killed runs left behind)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def cleanup(prefix: str = "lbcc") -> list[str]:
    """Delete every namespace starting with ``prefix``; returns their names."""
    names = leftover_namespaces(prefix)
    for name in names:
        subprocess.run(["ip", "netns", "del", name], check=False)
    return names


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while inside, so that cleanup runs."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sent_bytes() -> dict[str, int] | None:
    """Bytes sent so far in this process's network namespace: ``link`` on gloo's interface
    (``GLOO_SOCKET_IFNAME``, which `run_ranks` sets: the emulated link) and ``lo`` (traffic
    between the ranks of one node); None where ``GLOO_SOCKET_IFNAME`` is not set or either
    interface is not found."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not interface:
        return None
    found = {}
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() in (interface, "lo"):
                    found["lo" if name.strip() == "lo" else "link"] = int(counters.split()[8])
    except OSError:
        return None
    return found if len(found) == 2 else None


def rank_environment(net: EmulatedNetwork, rank: int, port: int = DEFAULT_PORT) -> dict[str, str]:
    """The variables a rank started by `run_ranks` sees (torchrun's names; LOCAL_* count every
    rank on this machine, whose cores they share, whatever its emulated node). For NCCL (GPU
    ranks), each rank is a host of its own (``NCCL_HOSTID``: ranks may share a GPU, as
    `spawn.gpu_rank_env` lets them, and NCCL then reaches every peer over its socket transport)
    on the emulated link's device (``NCCL_SOCKET_IFNAME``), so NCCL's bytes cross the link."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(net.nranks), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(net.nranks), "MASTER_ADDR": net.address(0),
        "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": net.interface,
        "NCCL_HOSTID": f"{net.prefix}-rank{rank}", "NCCL_SOCKET_IFNAME": net.interface,
    }


def run_ranks(command: Sequence[str], nranks: int, link: Link | str | None,
              env: dict[str, str] | None = None, timeout_s: float | None = None,
              ranks_per_node: int = 1) -> int:
    """Run ``command`` on ``nranks`` ranks in the namespaces of an `EmulatedNetwork` (one per
    node of ``ranks_per_node`` ranks).

    Rank 0's output passes through; the others' too (prefix your own logging by RANK). When a
    rank fails, the others are terminated. Returns 0 or the first failing rank's exit code.
    """
    if not command:
        raise ValueError("lowbitcc netem: no command to run")
    with _terminate_as_exit(), EmulatedNetwork(nranks, link,
                                               ranks_per_node=ranks_per_node) as net:
        procs: list[subprocess.Popen] = []
        try:
            for r in range(nranks):
                child_env = {**os.environ, **(env or {}), **rank_environment(net, r)}
                procs.append(subprocess.Popen(net.exec_prefix(r) + list(command), env=child_env))
            return _wait_all(procs, timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _wait_all(procs: list[subprocess.Popen], timeout_s: float | None) -> int:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            log.error("a rank exited with code %d; stopping the others", failed[0])
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            log.error("ranks still running after %.0f s; stopping them", timeout_s)
            return 124
        time.sleep(0.05)


def main_run(link: Link | str | None, nranks: int, command: Sequence[str]) -> int:
    """`lowbitcc netem --np N --link RATE [--delay ...] -- command ...`."""
    try:
        return run_ranks(command, nranks, link)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted; emulated network removed")
        return 130
