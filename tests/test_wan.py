"""diloco.bench.wan: emulated WAN links between network namespaces. These tests build real labs (root, `ip`, `tc`,
/dev/net/tun), measure real RTT and goodput through them, and check that nothing survives a lab: not its
namespaces, not its processes, not its forwarder, whether the body returns, raises, or the owner is
SIGTERMed or SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diloco.bench import wan
from diloco.bench.wan import PREFIX, WanError, WanLab, check_privileges, cleanup_stale

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

WAN_PY = Path(wan.__file__).resolve()
STALE = "dlcwanstale-"
"""The prefix of the namespaces the tests leave stale on purpose: every lab's start cleans up stale namespaces of
the usual prefix (`cleanup_stale`), and a lab started meanwhile by another test (parallel workers) must not
clean up these before the test looks at them."""
# A child script that builds a lab without importing the diloco package (torch takes seconds to import).
CHILD = textwrap.dedent(f"""
    import importlib.util, json, sys, time
    spec = importlib.util.spec_from_file_location("wan_child", {str(WAN_PY)!r})
    wan = importlib.util.module_from_spec(spec); sys.modules["wan_child"] = wan; spec.loader.exec_module(wan)
    wan.PREFIX = sys.argv[1]
    with wan.WanLab(2, rate_mbit=40.0, delay_ms=10.0, backend="tun") as lab:
        p = lab.popen(1, ["sleep", "600"])
        print(json.dumps({{"ns": [lab.namespace(0), lab.namespace(1)], "pids": [p.pid],
                          "forwarder": lab.forwarder_pid}}), flush=True)
        time.sleep(600)
""")


def _our_namespaces(pid: int | None = None, prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    mine = f"{prefix}{os.getpid() if pid is None else pid}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """True once `pid` has exited (a zombie not yet reaped by its new parent counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not wan._pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_host_closed_to_inbound_connections_drops_only_the_syns_to_it():
    syn, synack, ack = 0x02, 0x12, 0x10

    def tcp(flags: int, ihl: int = 5) -> bytes:
        return bytes([0x40 | ihl]) + bytes(8) + bytes([6]) + bytes(ihl * 4 - 10) + bytes(13) + bytes([flags]) + bytes(6)

    assert wan._opens_tcp(tcp(syn)) and wan._opens_tcp(tcp(syn, ihl=6))
    assert not wan._opens_tcp(tcp(synack)) and not wan._opens_tcp(tcp(ack))
    assert not wan._opens_tcp(bytes([0x45]) + bytes(8) + bytes([17]) + bytes(30))  # UDP
    faults = wan._Faults(3)
    faults.apply("inbound 1 0")
    assert faults.closed == [False, True, False, False] and faults.active
    faults.apply("inbound 1 1")
    assert not any(faults.closed) and not faults.active
    faults.apply("inbound 7 0")  # out of range: ignored, said on stderr
    assert not any(faults.closed)


def test_privilege_check_is_a_pure_function():
    with pytest.raises(WanError) as e:
        check_privileges(euid=1000)
    assert str(e.value) == "WAN emulation needs root (network namespaces, TUN devices): run as root"
    check_privileges(euid=0)
    check_privileges()  # these tests run as root, here and in CI


def test_failed_command_names_command_stderr_and_hint():
    with pytest.raises(WanError) as e:
        wan._run(["ip", "link", "set", "dlcwan-nosuchdev", "up"], hint="try something else")
    msg = str(e.value)
    assert "`ip link set dlcwan-nosuchdev up` failed (exit" in msg
    assert "dlcwan-nosuchdev" in msg.split("failed", 1)[1]  # ip's own stderr names the device
    assert msg.endswith("Hint: try something else")


def test_bad_arguments_are_rejected_before_touching_the_system():
    for kwargs in ({"hosts": 0}, {"hosts": 2, "delay_ms": -1}, {"hosts": 2, "backend": "carrier-pigeon"},
                   {"hosts": 2, "mtu": 100}):
        with pytest.raises(ValueError):
            WanLab(**kwargs)


def test_rtt_and_goodput_40mbit_30ms():
    with WanLab(hosts=2, rate_mbit=40.0, delay_ms=30.0) as lab:
        desc = lab.describe()
        backend = lab.backend
        m = lab.measure(0, 1, nbytes=12_000_000)
    assert desc.startswith("2 hosts in network namespaces, 40 Mbit/s per host link"), desc
    assert "30 ms one way" in desc and f"{backend} backend" in desc, desc
    assert 55.0 <= m.rtt_min_ms <= m.rtt_ms <= 90.0, m
    assert 0.6 * 40 <= m.goodput_mbit <= 1.05 * 40, m
    assert m.nbytes == 12_000_000
    assert not _our_namespaces()


def test_zero_delay_rtt_is_small_through_the_tun_forwarder():
    with WanLab(hosts=3, rate_mbit=40.0, delay_ms=0.0, backend="tun") as lab:
        assert lab.forwarder_pid is not None
        assert "userspace delay line over TUN" in lab.describe()
        m = lab.measure(2, 0, nbytes=1_000_000, pings=20)
        out = lab.popen(1, ["ip", "-4", "-o", "addr", "show", "dev", "wan0"], stdout=subprocess.PIPE,
                        text=True).communicate(timeout=10)[0]
        stats_before_close = lab.forwarder_cpu_s()
    assert m.rtt_min_ms < 5.0, m  # the fastest ping: the forwarder's delay, not the scheduler's
    assert "10.77.0.2/24" in out
    assert stats_before_close is not None
    assert lab.switch_stats is not None and lab.switch_stats["packets"] > 600  # 1 MB went through the delay line


def test_partitions_loss_and_extra_delay_through_the_forwarder():
    """`cut` splits the hosts in two sides (each side still reaches its own), `heal` ends it; `loss 1.0` silences
    a host, `slow` adds its one-way delay to the RTT; the forwarder counts what it dropped for each."""
    with WanLab(hosts=3, rate_mbit=40.0, delay_ms=5.0, backend="tun") as lab:
        def rtt(a: int, b: int) -> float:  # the fastest of 5 pings: the link's delay, not the scheduler's
            return lab.measure(a, b, nbytes=20_000, pings=5, timeout=3.0).rtt_min_ms

        before = rtt(0, 1)
        lab.cut([0])
        with pytest.raises(WanError):
            rtt(1, 0)  # across the cut: the connection never opens
        inside = rtt(1, 2)  # the other side still talks
        lab.sides([0, 0, 1])  # a new partition replaces the old one
        rejoined = rtt(1, 0)
        with pytest.raises(WanError):
            rtt(0, 2)
        lab.heal()
        healed = rtt(1, 0)
        lab.loss(2, 1.0)
        with pytest.raises(WanError):
            rtt(0, 2)
        lab.loss(2, 0.0)
        lab.slow(1, 100.0)
        slowed = rtt(0, 1)
        lab.slow(1, 0.0)
        with pytest.raises(ValueError):
            lab.loss(0, 1.5)
    assert before < 20 and inside < 20 and rejoined < 20 and healed < 20, (before, inside, rejoined, healed)
    assert 100 <= slowed <= 140, slowed  # 2 × 5 ms plus 100 ms on the way back from host 1
    assert lab.switch_stats is not None and lab.switch_stats["cut"] > 0 and lab.switch_stats["lost"] > 0


def test_veth_backend_plumbing_without_delay():
    """The netem backend's veth + bridge plumbing (tbf alone when there is no delay, so any kernel runs it)."""
    with WanLab(hosts=2, rate_mbit=40.0, delay_ms=0.0, backend="netem") as lab:
        assert lab.forwarder_pid is None
        m = lab.measure(0, 1, nbytes=4_000_000, pings=5)
    assert m.rtt_min_ms < 5.0, m  # the fastest ping: the plumbing's delay, not the scheduler's (a busy run: mean 6.4 ms)
    assert 0.6 * 40 <= m.goodput_mbit <= 1.05 * 40, m
    assert not _our_namespaces()


def test_netem_backend_with_delay():
    if wan.netem_available():
        with WanLab(hosts=2, rate_mbit=40.0, delay_ms=30.0, backend="netem") as lab:
            m = lab.measure(0, 1, nbytes=12_000_000)
        assert 55.0 <= m.rtt_ms <= 90.0 and 0.6 * 40 <= m.goodput_mbit <= 1.05 * 40, m
    else:  # this kernel: the error says what is missing and what to use instead
        with pytest.raises(WanError, match=r"netem qdisc \(sch_netem\).*backend='tun'"):
            WanLab(hosts=2, rate_mbit=40.0, delay_ms=30.0, backend="netem").start()
    assert not _our_namespaces()


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_lab_exit_leaves_nothing_behind(raises):
    pids, namespaces, forwarder = [], [], None
    with pytest.raises(RuntimeError) if raises else _nullcontext():
        with WanLab(hosts=2, rate_mbit=40.0, delay_ms=5.0, grace_s=2.0) as lab:
            namespaces = [lab.namespace(0), lab.namespace(1)]
            forwarder = lab.forwarder_pid
            pids.append(lab.popen(0, ["sleep", "600"]).pid)
            # ignores SIGTERM: must be SIGKILLed after the grace period
            pids.append(lab.popen(1, [sys.executable, "-c", "import signal, time; "
                                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                                      "time.sleep(600)"], stdout=subprocess.PIPE).pid)
            lab._procs[-1].stdout.readline()
            # a grandchild: not ours to wait for, still killed because it runs inside a host namespace
            sh = lab.popen(0, ["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            pids += [sh.pid, int(sh.stdout.readline())]
            if raises:
                raise RuntimeError("benchmark failed")
    assert namespaces and set(namespaces).isdisjoint(wan._list_netns())
    assert not _our_namespaces()
    assert forwarder is not None and _gone(forwarder)
    assert all(_gone(pid) for pid in pids), [p for p in pids if wan._pid_alive(p)]
    with pytest.raises(WanError, match="not running"):
        lab.popen(0, ["true"])


def _start_owner(tmp_path: Path, prefix: str = PREFIX) -> tuple[subprocess.Popen, dict]:
    """A child process that builds a lab (its namespaces named `prefix`…) and runs `sleep` in host 1; returns it
    and what it reported."""
    err = tmp_path / "owner.err"
    with open(err, "w") as errf:
        child = subprocess.Popen([sys.executable, "-I", "-c", CHILD, prefix], stdout=subprocess.PIPE, stderr=errf,
                                 stdin=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    child.stdout.close()  # (what the lab runs inherits this pipe: never wait for its EOF)
    if not line:
        child.wait(timeout=30)
        pytest.fail(f"the lab owner failed: {err.read_text()[-3000:]}")
    return child, json.loads(line)


def test_sigterm_to_the_owner_cleans_up(tmp_path):
    child, info = _start_owner(tmp_path)
    try:
        child.send_signal(signal.SIGTERM)
        # a deadline, not a speed: its cleanup outlasted 30 s in an hour when this machine ran 2.5x as slow
        assert child.wait(timeout=120) == 143, (tmp_path / "owner.err").read_text()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert set(info["ns"]).isdisjoint(wan._list_netns())
    assert not _our_namespaces(child.pid)
    assert _gone(info["forwarder"]) and all(_gone(p) for p in info["pids"])


def test_sigkilled_owner_forwarder_exits_and_cleanup_stale_removes_the_rest(tmp_path):
    child, info = _start_owner(tmp_path, STALE)
    child.kill()
    child.wait(timeout=10)
    assert _gone(info["forwarder"])  # its stdin closed with the owner
    assert set(info["ns"]) <= set(wan._list_netns())  # a SIGKILL leaves the namespaces and what runs in them
    assert not any(_gone(p, timeout=0.2) for p in info["pids"])
    removed = cleanup_stale(STALE)
    assert set(info["ns"]) <= set(removed)
    assert set(info["ns"]).isdisjoint(wan._list_netns())
    assert all(_gone(p) for p in info["pids"])


def test_cleanup_stale_removes_namespaces_of_dead_owners_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{STALE}{dead.pid}-1-0", f"{STALE}{os.getpid()}-999-0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        time.sleep(0.2)
        removed = cleanup_stale(STALE)
        assert stale in removed and live not in removed
        names = wan._list_netns()
        assert stale not in names and live in names
        assert sleeper.wait(timeout=5) != 0  # what ran inside the stale namespace was stopped
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        sleeper.wait()
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert not _our_namespaces(prefix=STALE)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
