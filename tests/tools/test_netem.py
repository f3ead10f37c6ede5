"""`lowbitcc netem`: command construction (anywhere) and a real emulated network (root only)."""

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lowbitcc.tools import cli, delay_switch, link_spec, netem

NEEDS_ROOT = pytest.mark.skipif(
    bool(netem.missing_requirements()),
    reason="needs " + "; ".join(netem.missing_requirements()) if netem.missing_requirements() else "",
)


def test_parse_rate_and_burst():
    assert netem.parse_rate("1gbit") == 10**9
    assert netem.parse_rate("10Gbit") == 10**10
    assert netem.parse_rate("500mbit") == 5 * 10**8
    assert netem.parse_rate("125mbps") == 10**9  # tc's bps is bytes per second
    for bad in ("fast", "1 gigabit", "", "10kbit"):
        with pytest.raises(ValueError, match="rate"):
            netem.parse_rate(bad)
    assert netem.tbf_burst_bytes(10**9) == 256 << 10
    assert netem.tbf_burst_bytes(10**10) == 10**10 // 8 // 500


def test_setup_commands_build_a_switch_with_shaped_links():
    net = netem.EmulatedNetwork(3, "1gbit", prefix="lbcctest")
    cmds = net.setup_commands()
    flat = [" ".join(c) for c in cmds]
    assert flat[0] == "ip netns add lbcctest-sw"
    for r in range(3):
        ns = f"lbcctest-r{r}"
        assert f"ip netns add {ns}" in flat
        assert (f"ip link add veth0 netns {ns} type veth peer name p{r} netns lbcctest-sw") in flat
        assert f"ip -n lbcctest-sw link set p{r} master sw0" in flat
        # both directions shaped: the rank's egress and the switch port's egress
        assert any(f.startswith(f"ip netns exec {ns} tc qdisc add dev veth0 root tbf rate 1gbit")
                   for f in flat)
        assert any(f.startswith(f"ip netns exec lbcctest-sw tc qdisc add dev p{r} root tbf rate 1gbit")
                   for f in flat)
        addr = ipaddress.ip_address(net.address(r))
        assert addr in ipaddress.ip_network("198.18.0.0/15")
        assert f"ip -n {ns} addr add {addr}/24 dev veth0" in flat
    # every command runs inside a namespace this network made, never in the caller's
    for c in cmds:
        assert c[:3] == ["ip", "netns", "add"] or "-n" in c[:2] or c[:3] == ["ip", "netns", "exec"] \
            or c[-2:] == ["netns", "lbcctest-sw"]
    assert net.teardown_commands() == [["ip", "netns", "del", f"lbcctest-r{r}"] for r in range(3)] + [
        ["ip", "netns", "del", "lbcctest-sw"]]
    unshaped = netem.EmulatedNetwork(2, None, prefix="lbcctest").setup_commands()
    assert not any("tbf" in c for c in unshaped)


def test_environment_of_a_rank():
    net = netem.EmulatedNetwork(4, "10gbit", prefix="lbcctest")
    env = netem.rank_environment(net, 2)
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "2"
    assert env["MASTER_ADDR"] == net.address(0) and env["GLOO_SOCKET_IFNAME"] == "veth0"
    # NCCL's ranks: each a host of its own, on the emulated link's device
    assert env["NCCL_SOCKET_IFNAME"] == "veth0" and env["NCCL_HOSTID"] == "lbcctest-rank2"
    assert netem.rank_environment(net, 1)["NCCL_HOSTID"] != env["NCCL_HOSTID"]
    assert net.exec_prefix(2) == ["ip", "netns", "exec", "lbcctest-r2"]


def test_nodes_of_several_ranks_share_a_namespace_and_its_link():
    net = netem.EmulatedNetwork(4, "1gbit", prefix="lbcctest", ranks_per_node=2)
    assert net.nodes == 2
    assert [net.exec_prefix(r)[-1] for r in range(4)] == ["lbcctest-r0", "lbcctest-r0",
                                                          "lbcctest-r1", "lbcctest-r1"]
    cmds = [" ".join(c) for c in net.setup_commands()]
    assert sum("tbf" in c for c in cmds) == 4  # both ends of 2 links
    assert not any("lbcctest-r2" in c for c in cmds + [" ".join(c) for c in net.teardown_commands()])
    with pytest.raises(ValueError, match="nodes of 2"):
        netem.EmulatedNetwork(3, "1gbit", ranks_per_node=2)


def test_bad_networks_are_refused():
    with pytest.raises(ValueError, match="ranks"):
        netem.EmulatedNetwork(0, "1gbit")
    with pytest.raises(ValueError, match="rate"):
        netem.EmulatedNetwork(2, "lots")
    with pytest.raises(ValueError, match="prefix"):
        netem.EmulatedNetwork(2, "1gbit", prefix="bad name; rm -rf")


PROBE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.full((4 << 20,), float(dist.get_rank() + 1))
dist.barrier(); t = time.perf_counter(); dist.all_reduce(x); dt = time.perf_counter() - t
assert torch.all(x == dist.get_world_size() * (dist.get_world_size() + 1) / 2)
if dist.get_rank() == 0:
    print(f"RATE {16 * 2**20 / dt * 8 / 1e9:.3f}", flush=True)
dist.destroy_process_group()
"""


@NEEDS_ROOT
def test_ranks_talk_through_a_shaped_link_and_nothing_is_left():
    before = set(netem.leftover_namespaces())
    done = subprocess.run([sys.executable, "-m", "lowbitcc", "netem", "--np", "2", "--link",
                           "200mbit", "--", sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rate = float(done.stdout.split("RATE")[1].split()[0])
    # a 2-rank ring all-reduce of 16 MiB sends 16 MiB per rank: about the link rate
    assert 0.05 < rate < 0.25, done.stdout
    assert set(netem.leftover_namespaces()) == before


def _default_sigint() -> None:
    # a runner started in the background of a shell without job control inherits SIGINT
    # ignored, and so would the command, which then never sees the interrupt sent below
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@NEEDS_ROOT
def test_interrupt_removes_the_network():
    before = set(netem.leftover_namespaces())
    proc = subprocess.Popen([sys.executable, "-m", "lowbitcc", "netem", "--np", "2", "--link",
                             "1gbit", "--", "sleep", "60"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 30
    while len(set(netem.leftover_namespaces()) - before) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(set(netem.leftover_namespaces()) - before) == 3  # switch + 2 ranks
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert set(netem.leftover_namespaces()) == before


def test_missing_requirements_are_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    missing = " ".join(netem.missing_requirements())
    assert "root" in missing and "`ip`" in missing and "`tc`" in missing
    with pytest.raises(RuntimeError, match="root"), netem.EmulatedNetwork(2, "1gbit", prefix="lbcctest"):
        pass


def test_links_parse_and_refuse_in_tc_units():
    link = netem.Link("100mbit", "40ms", "2ms", "0.1%")
    model = link.model()
    assert model.rate == 10**8 and model.delay == pytest.approx(0.04)
    assert model.jitter == pytest.approx(0.002) and model.loss == pytest.approx(0.001)
    assert link.wide_area and not netem.Link("1gbit").wide_area
    assert link.describe() == "100mbit, 40ms +-2ms one way, 0.1% loss"
    for bad, word in ((dict(delay="40"), "delay"), (dict(delay="1 week"), "delay"),
                      (dict(delay="11s"), "delay"), (dict(loss="0.1"), "loss"),
                      (dict(loss="60%"), "loss"), (dict(delay="1ms", jitter="2ms"), "jitter"),
                      (dict(rate="slow"), "rate")):
        with pytest.raises(ValueError, match=word):
            netem.Link(**{"rate": "1gbit", **bad})


def test_link_flags_and_presets():
    import argparse

    parser = argparse.ArgumentParser()
    link_spec.add_arguments(parser)
    parse = lambda *argv, **kw: link_spec.from_arguments(parser.parse_args(argv), **kw)  # noqa: E731
    assert parse() is None
    assert parse(default_rate="1gbit") == netem.Link("1gbit")
    assert parse("--link", "none") == netem.Link(None)
    assert parse("--wan", "cross-continent") == link_spec.PRESETS["cross-continent"]
    assert parse("--wan", "cross-continent", "--link", "1gbit", "--loss", "0%") == netem.Link(
        "1gbit", "40ms", "2ms", "0%")
    assert parse("--link", "100mbit", "--delay", "40ms") == netem.Link("100mbit", "40ms")
    with pytest.raises(ValueError, match="--delay"):
        parse("--delay", "40ms")
    for link in link_spec.PRESETS.values():
        assert link.wide_area and link.model().rate


def test_wide_area_networks_use_moved_tun_devices_and_no_bridge():
    net = netem.EmulatedNetwork(2, netem.Link("100mbit", "40ms"), prefix="lbcctest")
    flat = [" ".join(c) for c in net.setup_commands()]
    assert not any("bridge" in c or "lbcctest-sw" in c for c in flat)
    for r in range(2):
        ns = f"lbcctest-r{r}"
        assert f"ip link set dev {net.tun_name(r)} netns {ns}" in flat
        assert f"ip -n {ns} link set dev {net.tun_name(r)} name wan0" in flat
        assert f"ip -n {ns} link set wan0 mtu {delay_switch.MTU} up" in flat
        assert any(c.startswith(f"ip netns exec {ns} tc qdisc add dev wan0 root tbf rate 100mbit")
                   for c in flat)
    assert len({net.tun_name(r) for r in range(2)}) == 2
    assert all(len(net.tun_name(r)) < 16 for r in range(2))  # IFNAMSIZ
    assert net.teardown_commands() == [["ip", "netns", "del", f"lbcctest-r{r}"] for r in range(2)]
    assert netem.rank_environment(net, 1)["GLOO_SOCKET_IFNAME"] == "wan0"


def _ipv4_to(node: int, size: int = 100) -> bytes:
    header = bytes([0x45]) + bytes(11) + bytes((198, 18, 0, 1)) + bytes((198, 18, 0, node + 1))
    return header + bytes(size - len(header))


class _Pipes:
    """The switch's node devices as pipes: what it writes for node i is read from ``read(i)``."""

    def __init__(self, nodes: int) -> None:
        self.pairs = [os.pipe() for _ in range(nodes)]
        for r, _ in self.pairs:
            os.set_blocking(r, False)

    @property
    def fds(self) -> list[int]:
        return [w for _, w in self.pairs]

    def read(self, node: int) -> bytes:
        try:
            return os.read(self.pairs[node][0], 1 << 20)
        except BlockingIOError:
            return b""


def test_delay_switch_delays_paces_and_drops_as_its_model_says():
    pipes = _Pipes(2)
    rate = 8 * 10**6  # 1 MB/s: a 1000-byte packet takes 1 ms
    switch = delay_switch.DelaySwitch(pipes.fds, delay_switch.LinkModel(rate, delay=0.010))
    for _ in range(3):
        switch.route(_ipv4_to(1, 1000), now=0.0)
    switch.route(b"\x60" + bytes(99), now=0.0)  # IPv6: dropped
    switch.route(_ipv4_to(7), now=0.0)  # no such node: dropped
    switch.deliver(now=0.0109)
    assert pipes.read(1) == b""
    switch.deliver(now=0.0111)  # first packet: 1 ms on the downlink + 10 ms
    assert len(pipes.read(1)) == 1000
    switch.deliver(now=0.0131)  # the next two, 1 ms apart
    assert len(pipes.read(1)) == 2000 and pipes.read(0) == b""
    # more than QUEUE_LIMIT_S of backlog: drop-tail
    backlog = int(delay_switch.QUEUE_LIMIT_S * rate / 8 / 1000) + 5
    for _ in range(backlog):
        switch.route(_ipv4_to(0, 1000), now=1.0)
    assert switch.dropped >= 4
    lossy = delay_switch.DelaySwitch(_Pipes(2).fds, delay_switch.LinkModel(None, loss=0.2), seed=1)
    for _ in range(5000):
        lossy.route(_ipv4_to(0), now=0.0)
    assert 800 < lossy.dropped < 1200


def test_delay_switch_jitter_never_reorders():
    pipes = _Pipes(1)
    switch = delay_switch.DelaySwitch(
        pipes.fds, delay_switch.LinkModel(None, delay=0.010, jitter=0.009), seed=3)
    for i in range(200):
        packet = bytearray(_ipv4_to(0, 30))
        packet[20:24] = i.to_bytes(4, "big")
        switch.route(bytes(packet), now=i * 1e-4)
    arrivals = [entry[0] for entry in sorted(switch._due)]
    assert min(arrivals) >= 0.001 and max(arrivals) <= 0.0199 + 0.02
    switch.deliver(now=1.0)
    data = pipes.read(0)
    order = [int.from_bytes(data[k + 20:k + 24], "big") for k in range(0, len(data), 30)]
    assert order == list(range(200))


PING = """
import os, socket, time
rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], 29600
if rank == 0:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(1); c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(1 << 20)):
        if d == b"p":
            c.sendall(b"p")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port)); break
        except OSError:
            time.sleep(0.1)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(9):
        t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtts.append(time.perf_counter() - t)
    c.sendall(b"x" * (4 << 20)); c.shutdown(socket.SHUT_WR); c.recv(1)
    print(f"RTT_MS {sorted(rtts)[4] * 1e3:.2f}", flush=True)
"""


@NEEDS_ROOT
def test_a_wide_area_link_delays_and_loses_packets_and_nothing_is_left():
    before = set(netem.leftover_namespaces())
    done = subprocess.run([sys.executable, "-m", "lowbitcc", "netem", "--np", "2", "--link",
                           "200mbit", "--delay", "15ms", "--jitter", "1ms", "--loss", "0.5%",
                           "--", sys.executable, "-c", PING],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rtt = float(done.stdout.split("RTT_MS")[1].split()[0])
    assert 29 < rtt < 45, done.stdout  # two one-way delays of 15 ms +- 1 ms
    dropped = int(done.stderr.split("forwarded, ")[1].split()[0])
    assert dropped > 0, done.stderr  # the 4 MiB crossed a lossy link all the same
    assert set(netem.leftover_namespaces()) == before


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``lowbitcc ARGV`` in this process, for what argparse ends with an exit (``--help``): its
    exit status, standard output and error."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("command", ["netem", "perf", "bench-train", "study"])
def test_commands_with_link_flags_explain_them(command, capsys):
    status, out, err = _cli(capsys, command, "--help")
    assert status == 0, err[-2000:]
    assert "--delay" in out and "cross-continent" in out


def test_the_convergence_study_refuses_link_flags_it_would_ignore():
    done = subprocess.run([sys.executable, "-m", "lowbitcc", "study", "--wan", "cross-continent"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--diloco only" in done.stderr


def test_wide_area_links_use_the_kernels_netem_where_it_exists():
    link = netem.Link("100mbit", "40ms", "2ms", "0.01%")
    net = netem.EmulatedNetwork(2, link, prefix="lbcctest", kernel_netem=True)
    flat = [" ".join(c) for c in net.setup_commands()]
    assert not net.delay_switch and net.interface == "veth0"
    assert not any("tun" in c or "wan0" in c for c in flat)
    assert "ip -n lbcctest-sw link add sw0 type bridge" in flat
    for r in range(2):
        ns = net.namespace(r)
        netem_at = flat.index(f"ip netns exec {ns} tc qdisc add dev veth0 root handle 1: netem "
                              f"limit {netem.NETEM_LIMIT} delay 40ms 2ms loss 0.01%")
        tbf = [i for i, c in enumerate(flat) if c.startswith(
            f"ip netns exec {ns} tc qdisc add dev veth0 parent 1:1 handle 10: tbf rate 100mbit")]
        assert tbf and tbf[0] > netem_at  # the rate limit under the delay, on the uplink
        assert any(c.startswith(f"ip netns exec lbcctest-sw tc qdisc add dev p{r} root tbf")
                   for c in flat)  # the downlink: its rate only
    assert ["ip", "netns", "del", "lbcctest-sw"] in net.teardown_commands()
    switch = netem.EmulatedNetwork(2, link, prefix="lbcctest", kernel_netem=False)
    assert switch.delay_switch and switch.interface == "wan0"


def test_the_netem_probe_asks_the_kernel_once(monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        unknown = "netem" in cmd
        return subprocess.CompletedProcess(cmd, 2 if unknown else 0, "",
                                           "Error: Specified qdisc kind is unknown." * unknown)

    monkeypatch.setattr(netem, "missing_requirements", lambda: [])
    monkeypatch.setattr(netem.subprocess, "run", run)
    netem.kernel_netem_available.cache_clear()
    try:
        assert netem.kernel_netem_available() is False
        assert netem.kernel_netem_available() is False and len(calls) == 3  # add, try, del
        assert calls[-1][:3] == ["ip", "netns", "del"]
    finally:
        netem.kernel_netem_available.cache_clear()
