"""`lowbitcc netem`: command construction (anywhere) and a real emulated network (root only)."""

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lowbitcc.tools import netem

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
