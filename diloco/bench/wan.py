"""Emulated wide-area links between real processes: every host is a Linux network namespace, joined to
the others by a link with a rate limit and a one-way delay. Benchmarks start real peers inside the
hosts and see what a slow link does to the protocol. Standard library only (so the forwarder and the
measurement helpers start in a few milliseconds); needs root, `ip` and `tc` (iproute2).

    import subprocess, sys
    from diloco.bench.wan import WanLab

    with WanLab(hosts=3, rate_mbit=100.0, delay_ms=50.0) as lab:
        print(lab.describe())
        # 3 hosts in network namespaces, 100 Mbit/s per host link (tbf), 50 ms one way (tun backend:
        # userspace delay line over TUN; kernel has no netem), MTU 1500, TCP buffers up to 32 MiB
        print(lab.measure(0, 1))
        # host 0 -> host 1: RTT 100.8 ms (min 100.7), goodput 84.0 Mbit/s (25.0 MB in 2.38 s)
        server = lab.popen(0, [sys.executable, "-m", "http.server", "8000"], stdout=subprocess.DEVNULL)
        client = lab.popen(1, [sys.executable, "-c", "import urllib.request as u, time; time.sleep(1); "
                               f"print(u.urlopen('http://{lab.address(0)}:8000/').status)"])
        client.wait()
    # here every process started with popen is gone (SIGTERM, then SIGKILL after `grace_s`), so is
    # anything else still running inside the namespaces, the forwarder, and every namespace/device.

Host `i` has the address `10.77.0.{i+1}` on its interface `wan0` (`lab.address(i)`); all hosts share one
/24, so any host reaches any other directly. "Per host link" means each host's *uplink*: what a host
sends is shaped to `rate_mbit` and delayed by `delay_ms`, so a round trip takes 2 × `delay_ms` and a
host receiving from several senders at once can receive more than `rate_mbit`.

Backends (`backend="auto"` probes the kernel once and picks the first that works):

- ``netem``: each host's `wan0` is one end of a veth pair whose other end sits on a bridge in a hub
  namespace; `tc qdisc ... netem delay D rate R` on `wan0` (tbf alone when `delay_ms` is 0).
- ``tun``: for kernels without sch_netem. Each host's `wan0` is a TUN device (IFF_TUN | IFF_NO_PI); one
  forwarding process (`python -I wan.py _switch`, its own interpreter so the benchmark's GIL never slows
  it) holds every TUN file descriptor, reads IPv4 packets, looks up the destination address and writes
  each packet to the destination's TUN after `delay_ms` (a FIFO delay line: one delay for every packet, so
  nothing is reordered). The rate is a kernel `tbf` qdisc on each `wan0` egress, queueing before the
  delay line like a bottleneck router would.

The MTU (default 1500, as on real internet paths) sets the forwarder's packet rate: on a 2-core machine
three hosts sending 100 Mbit/s each at once (50 ms) cost it about half a core at MTU 1500 (much of it
the receivers' kernel TCP work, done inside its writes) and about 0.1 core at 9000 or 16000; TCP works
at all three. Each direction gets `delay_ms` plus up to ~1 ms (poll() has millisecond timeouts). A larger MTU also changes TCP itself: 6x fewer packets per
window, so slow start reaches a given window in fewer round trips; keep 1500 when transfer times matter.

Starting a lab raises each namespace's `net.ipv4.tcp_rmem`/`tcp_wmem` maximum (per-namespace sysctls) to
at least 4 × the bandwidth-delay product and 16 MiB, so one TCP flow can fill a long fat link.

Namespaces are named ``dlcwan-<owner pid>-<lab>-<host>``; `cleanup_stale()` (run on every lab start)
kills what runs in, and deletes, those whose owner is dead. The lab cleans up on normal exit, on an
exception, on SIGTERM to the owner (while a lab started in the main thread runs, SIGTERM raises
SystemExit(143) there, so the with-block unwinds; the previous handler comes back on close) and at
interpreter exit; if the owner is SIGKILLed, the forwarder exits by itself (its stdin closes) and
the next lab start removes the namespaces.

Manual check: ``python -m diloco.bench.wan --hosts 2 --rate 100 --delay 50`` builds a lab, prints describe()
and a measurement between hosts 0 and 1, and tears down.
"""

from __future__ import annotations

import argparse
from heapq import heappop, heappush
import atexit
import fcntl
import json
import os
import random
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["LinkMeasurement", "PREFIX", "WanError", "WanLab", "check_privileges", "cleanup_stale", "netem_available"]

PREFIX = "dlcwan-"
"""Every namespace a lab creates is named PREFIX + '<owner pid>-<lab number>-<host or role>'."""
SUBNET = "10.77.0"
"""Host i has SUBNET.(i+1)/24."""
IFNAME = "wan0"
"""The host's WAN interface inside its namespace."""
MAX_HOSTS = 250
NETNS_DIR = "/run/netns"

ROOT_MESSAGE = "WAN emulation needs root (network namespaces, TUN devices): run as root"

# linux/if_tun.h
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000

_THIS_FILE = os.path.abspath(__file__)
_lab_counter = 0
_lab_counter_lock = threading.Lock()
_netem_probe: bool | None = None


if __name__ == "diloco.bench.wan":  # beneath diloco.DiLoCoError, as every error of the package
    from diloco.compression.errors import DiLoCoError
else:  # run as the lab's forwarder (`python -I wan.py _switch`), it imports nothing of the package
    class DiLoCoError(Exception):  # type: ignore[no-redef]
        """The package's root exception, stood in for."""


class WanError(DiLoCoError, RuntimeError):
    """Building, using or tearing down a WAN lab failed; the message says what and how to fix it."""


# --------------------------------------------------------------------------------------- checks


def check_privileges(euid: int | None = None) -> None:
    """Raise WanError unless `euid` (default: this process's effective uid) is root."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise WanError(ROOT_MESSAGE)


def _check_tools() -> None:
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise WanError(f"WAN emulation needs the `{tool}` command, which is not on PATH: install {package} "
                           f"(e.g. `apt-get install {package}`)")


_DEFAULT_HINT = "WAN emulation needs root and iproute2; `ip netns list` shows the namespaces that exist"


def _run(cmd: Sequence[str], hint: str = _DEFAULT_HINT, check: bool = True,
         timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run an `ip`/`tc`/shell command; on failure raise WanError naming the command, its stderr and `hint`."""
    try:
        res = subprocess.run(list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise WanError(f"`{' '.join(cmd)}` could not start: {e}. Install iproute2 and run as root.") from None
    except subprocess.TimeoutExpired:
        raise WanError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s. {hint}".rstrip()) from None
    if check and res.returncode != 0:
        err = (res.stderr or res.stdout).strip() or "(no output)"
        raise WanError(f"`{' '.join(cmd)}` failed (exit {res.returncode}): {err}. Hint: {hint}")
    return res


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc: tries to add one inside a scratch namespace (once per process)."""
    global _netem_probe
    if _netem_probe is None:
        check_privileges()
        _check_tools()
        name = f"{PREFIX}{os.getpid()}-probe"
        _run(["ip", "netns", "add", name], hint="run as root on a kernel with network namespaces")
        try:
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
            res = _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
            _netem_probe = res.returncode == 0
        finally:
            _run(["ip", "netns", "del", name], check=False)
    return _netem_probe


# ------------------------------------------------------------------------------ stale namespaces


def _owner_pid(name: str, prefix: str = PREFIX) -> int | None:
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _pid_alive(pid: int) -> bool:
    """`diloco.peers.reaper.pid_alive`, repeated: this file also runs alone (`python -I wan.py _switch`, inside
    the namespaces), where it imports nothing of the package."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie owner is dead too
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _netns_pids(name: str) -> list[int]:
    res = _run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in res.stdout.split() if x.isdigit()] if res.returncode == 0 else []


def _kill_netns_processes(names: Sequence[str], grace_s: float = 1.0) -> list[int]:
    """SIGTERM every process inside the namespaces, SIGKILL what is left after `grace_s`; returns the pids."""
    me = os.getpid()
    pids = [p for n in names for p in _netns_pids(n) if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                live.append(pid)
            except ProcessLookupError:
                pass
        if not live:
            break
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while live and time.monotonic() < deadline:
            time.sleep(0.02)
            live = [p for p in live if _pid_alive(p)]
        pids = live
    return pids


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named `prefix`<pid>-... whose owner pid is dead, killing anything still running in
    them first. Returns the names removed. Namespaces of live owners (other labs running now) are left alone."""
    stale = [n for n in _list_netns() if (pid := _owner_pid(n, prefix)) is not None and not _pid_alive(pid)]
    if stale:
        _kill_netns_processes(stale)
    removed = []
    for name in stale:
        res = _run(["ip", "netns", "del", name], check=False)
        if res.returncode == 0 or not os.path.exists(os.path.join(NETNS_DIR, name)):
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class LinkMeasurement:
    """One measurement from host `src` to host `dst`."""

    src: int
    dst: int
    rtt_ms: float
    """Median round trip of a 64-byte TCP echo (TCP_NODELAY)."""
    rtt_min_ms: float
    goodput_mbit: float
    """Application bytes of a bulk TCP transfer src → dst per second at the receiver, first to last byte
    (slow start included)."""
    nbytes: int
    seconds: float

    def __str__(self) -> str:
        return (f"host {self.src} -> host {self.dst}: RTT {self.rtt_ms:.1f} ms (min {self.rtt_min_ms:.1f}), "
                f"goodput {self.goodput_mbit:.1f} Mbit/s ({self.nbytes / 1e6:.1f} MB in {self.seconds:.2f} s)")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _probe_server(timeout: float) -> int:
    """Accept one connection: echo 64-byte pings ('P'), then receive a bulk transfer ('B' + length) and reply
    with (seconds from first to last byte, bytes after the first read, bytes received)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(1)
    srv.settimeout(timeout)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        kind = _recv_exact(conn, 1)
        if kind == b"P":
            conn.sendall(b"P" + _recv_exact(conn, 63))
        elif kind == b"B":
            (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
            break
        else:
            raise ValueError(f"unexpected probe message {kind!r}")
    buf = bytearray(1 << 20)
    got = first = 0
    t_first = 0.0
    while got < n:
        k = conn.recv_into(buf, min(len(buf), n - got))
        if k == 0:
            raise ConnectionError(f"sender closed after {got} of {n} bytes")
        if got == 0:
            t_first, first = time.monotonic(), k
        got += k
    conn.sendall(struct.pack("!dQQ", time.monotonic() - t_first, got - first, got))
    conn.close()
    return 0


def _probe_client(host: str, port: int, nbytes: int, pings: int, timeout: float) -> int:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    msg = b"P" + bytes(63)
    for _ in range(pings):
        t = time.monotonic()
        sock.sendall(msg)
        _recv_exact(sock, 64)
        rtts.append((time.monotonic() - t) * 1000)
    sock.sendall(b"B" + struct.pack("!Q", nbytes))
    chunk = memoryview(bytes(1 << 18))
    left = nbytes
    while left:
        left -= sock.send(chunk[:min(left, len(chunk))])
    seconds, counted, got = struct.unpack("!dQQ", _recv_exact(sock, 24))
    sock.close()
    print(json.dumps({"rtt_ms": statistics.median(rtts), "rtt_min_ms": min(rtts),
                      "goodput_mbit": counted * 8 / seconds / 1e6 if seconds > 0 else float("inf"),
                      "nbytes": got, "seconds": seconds}), flush=True)
    return 0


# --------------------------------------------------------------------------------- the forwarder


def _switch(delay_ms: float, addresses: list[str], groups: Sequence[int] = (), cross_delay_ms: float = 0.0,
            cross_rate_mbit: float = 0.0, cross_queue_ms: float = 0.0) -> int:
    """The TUN backend's forwarder: create one TUN device per host (the owner moves each into its host's
    namespace), forward IPv4 packets by destination address through a delay line, exit when stdin
    closes (the owner closed it, or died) and print counters as one JSON line. With `groups` (a group per
    host: regions), a packet between two groups leaves its sender through that sender's own link between
    regions, `cross_rate_mbit` (a token bucket in here, dropping what would queue longer than
    `cross_queue_ms`), and takes `cross_delay_ms` instead of `delay_ms`.

    Faults, from the owner as lines on stdin (`_control`; each applies from the next packet on): `sides A,B,..`
    (a partition: one label per host, packets between hosts of different labels are dropped; all equal: none),
    `loss I P` (drop each packet from or to host I with probability P; 0 ends it), `slow I MS` (host I's
    packets take MS more milliseconds one way; 0 ends it) and `inbound I 0|1` (0: host I takes no new TCP
    connection, as behind a NAT or a firewall that only lets connections out: every SYN to it is dropped, while
    the connections it opens work both ways; 1: it takes them again)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the owner, which stops us in order
    try:
        os.nice(-10)  # like the kernel's own packet processing, forwarding preempts the benchmark's compute
    except OSError:
        pass
    delay = delay_ms / 1000.0
    pid = os.getpid()
    fds, names = [], []
    for i in range(len(addresses)):
        name = f"dw{pid}.{i}"
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
        fds.append(fd)
        names.append(name)
    route = {socket.inet_aton(a): fd for a, fd in zip(addresses, fds)}
    group = {socket.inet_aton(a): g for a, g in zip(addresses, groups)} if groups else {}
    cross_delay, cross_queue = cross_delay_ms / 1000.0, cross_queue_ms / 1000.0
    byte_s = 8.0 / (cross_rate_mbit * 1e6) if cross_rate_mbit > 0 else 0.0
    free_at: dict[bytes, float] = {}  # per sender: when its link between regions is free again
    print("ready " + ",".join(names), flush=True)
    index = {socket.inet_aton(a): i for i, a in enumerate(addresses)}
    ctl = _Faults(len(addresses))
    pending = b""
    rnd = random.random

    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.register(0, select.POLLIN)
    line: list[tuple[float, int, int, bytes]] = []  # a heap by due time (two delays: not FIFO)
    seq = 0
    forwarded = fwd_bytes = dropped = max_queue = wakeups = cut = lost = 0
    read, write, monotonic = os.read, os.write, time.monotonic
    get = route.get
    while True:
        timeout = None if not line else max(0.0, (line[0][0] - monotonic()) * 1000.0)
        events = poller.poll(timeout)
        wakeups += 1
        now = monotonic()
        due = now + delay
        for fd, ev in events:
            if fd == 0:
                data = read(0, 4096)
                if not data:
                    try:
                        print(json.dumps({"packets": forwarded, "bytes": fwd_bytes, "dropped": dropped,
                                          "max_queue": max_queue, "wakeups": wakeups, "cut": cut, "lost": lost}),
                              flush=True)
                    except OSError:  # the owner is gone
                        pass
                    return 0
                pending += data
                *cmds, pending = pending.split(b"\n")
                for cmd in cmds:
                    ctl.apply(cmd.decode(errors="replace"))
                continue
            if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                poller.unregister(fd)  # its device is gone (namespace deleted under us): stop polling it
                continue
            for _ in range(256):
                try:
                    pkt = read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    dropped += 1
                    continue
                out = get(pkt[16:20])
                if out is None:
                    dropped += 1
                    continue
                when = due
                src = pkt[12:16]
                if ctl.active:
                    a, b = index.get(src, -1), index.get(pkt[16:20], -1)
                    if ctl.side[a] != ctl.side[b] or (ctl.closed[b] and _opens_tcp(pkt)):
                        cut += 1
                        continue
                    p = max(ctl.loss[a], ctl.loss[b])
                    if p and rnd() < p:
                        lost += 1
                        continue
                    when += ctl.extra[a]
                if group and group.get(src) != group.get(pkt[16:20]):  # between regions
                    start = max(now, free_at.get(src, 0.0))
                    if byte_s and start - now > cross_queue:
                        dropped += 1  # the sender's link between regions has a full queue: tail drop
                        continue
                    free_at[src] = start + len(pkt) * byte_s
                    when = free_at[src] + cross_delay
                seq += 1
                heappush(line, (when, seq, out, pkt))
        if len(line) > max_queue:
            max_queue = len(line)
        now = monotonic()
        while line and line[0][0] <= now:
            _, _, out, pkt = heappop(line)
            try:
                write(out, pkt)
                forwarded += 1
                fwd_bytes += len(pkt)
            except OSError:
                dropped += 1


def _opens_tcp(pkt: bytes) -> bool:
    """An IPv4 packet that opens a TCP connection: SYN set, ACK not (the first packet of a handshake)."""
    head = (pkt[0] & 0x0F) * 4
    return pkt[9] == 6 and len(pkt) > head + 13 and pkt[head + 13] & 0x12 == 0x02


class _Faults:
    """The forwarder's injected faults by host index (index -1, the last entry: a sender outside the lab)."""

    def __init__(self, hosts: int) -> None:
        self.side = [0] * (hosts + 1)
        self.loss = [0.0] * (hosts + 1)
        self.extra = [0.0] * (hosts + 1)
        self.closed = [False] * (hosts + 1)
        """Hosts that take no new TCP connection (`inbound I 0`)."""
        self.active = False

    def apply(self, line: str) -> None:
        """One command (see `_switch`); a malformed one is reported on stderr and ignored."""
        words = line.split()
        try:
            if not words:
                return
            n = len(self.side) - 1
            if words[0] == "sides" and len(words) == 2:
                side = [int(x) for x in words[1].split(",")]
                if len(side) != n:
                    raise ValueError(f"{len(side)} labels for {n} hosts")
                self.side = side + [0]
            elif words[0] == "inbound" and len(words) == 3 and words[2] in ("0", "1"):
                i = int(words[1])
                if not 0 <= i < n:
                    raise ValueError("host out of range")
                self.closed[i] = words[2] == "0"
            elif words[0] in ("loss", "slow") and len(words) == 3:
                i, x = int(words[1]), float(words[2])
                if not 0 <= i < n or x < 0 or (words[0] == "loss" and x > 1):
                    raise ValueError("host out of range or value out of range")
                if words[0] == "loss":
                    self.loss[i] = x
                else:
                    self.extra[i] = x / 1000.0  # ms
            else:
                raise ValueError("unknown command")
        except ValueError as e:
            print(f"wan forwarder: ignored command {line!r}: {e}", file=sys.stderr, flush=True)
            return
        self.active = any(self.side) or any(self.loss) or any(self.extra) or any(self.closed)


# ---------------------------------------------------------------------------------------- the lab


def _check_lab(hosts: int, rate_mbit: float | None, delay_ms: float, backend: str, mtu: int,
               regions: Sequence[int]) -> None:
    """`WanLab`'s arguments, each in its range; raises ValueError naming the one that is not."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    if rate_mbit is not None and rate_mbit < 0:
        raise ValueError(f"rate_mbit must be positive (or None for unlimited), got {rate_mbit}")
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    if backend not in ("auto", "netem", "tun"):
        raise ValueError(f"backend must be 'auto', 'netem' or 'tun', got {backend!r}")
    if not 576 <= mtu <= 65535:
        raise ValueError(f"mtu must be between 576 and 65535, got {mtu}")
    if regions and (len(regions) != hosts or backend == "netem"):
        raise ValueError(f"regions needs one region per host ({hosts}) and the tun backend, got {list(regions)}"
                         f" with backend {backend!r}")


def _region_args(regions: Sequence[int], cross_rate_mbit: float | None, cross_delay_ms: float) -> list[str]:
    """The forwarder's arguments for links between regions (none for a lab of one region)."""
    if not regions:
        return []
    queue = max(20.0, cross_delay_ms)  # as the host links' shaper: the larger of 20 ms and the delay
    return ["--groups", ",".join(str(g) for g in regions), "--cross-delay-ms", repr(cross_delay_ms),
            "--cross-rate-mbit", repr(cross_rate_mbit or 0.0), "--cross-queue-ms", repr(queue)]


class WanLab:
    """Hosts (network namespaces) joined by emulated WAN links; a context manager (see module docstring).

    hosts: number of hosts (2..250). rate_mbit: each host's uplink rate (None or 0: unlimited).
    delay_ms: one-way delay added to every packet. backend: "auto", "netem" or "tun". mtu: of every host
    interface. queue_ms: how much the shaper may queue before dropping, in ms at `rate_mbit` (None: the
    larger of 20 ms and `delay_ms`). grace_s: how long popen'd processes get after SIGTERM before SIGKILL.
    """

    def __init__(self, hosts: int, rate_mbit: float | None = 100.0, delay_ms: float = 50.0, *,
                 backend: str = "auto", mtu: int = 1500, queue_ms: float | None = None,
                 grace_s: float = 5.0, regions: Sequence[int] = (), cross_rate_mbit: float | None = None,
                 cross_delay_ms: float | None = None) -> None:
        _check_lab(hosts, rate_mbit, delay_ms, backend, mtu, regions)
        self.regions = tuple(regions)
        """A region per host (empty: one region). Between two regions a host sends through its own link
        of `cross_rate_mbit` with `cross_delay_ms` one way; inside one, `rate_mbit` and `delay_ms`."""
        self.cross_rate_mbit = cross_rate_mbit
        self.cross_delay_ms = cross_delay_ms if cross_delay_ms is not None else delay_ms
        self.hosts = hosts
        self.rate_mbit = rate_mbit or None
        self.delay_ms = float(delay_ms)
        self.mtu = mtu
        self.queue_ms = float(queue_ms) if queue_ms is not None else max(20.0, self.delay_ms)
        self.grace_s = grace_s
        self.requested_backend = backend
        self.backend: str | None = None
        """The backend that runs ("netem" or "tun"), once started."""
        self.tcp_buffer_max = 0
        """The tcp_rmem/tcp_wmem maximum set in every namespace, in bytes, once started."""
        self._netem_in_kernel: bool | None = None
        self._names: list[str] = []
        self._hub: str | None = None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._switch: subprocess.Popen[str] | None = None
        self.switch_stats: dict[str, Any] | None = None
        """The forwarder's counters (packets, bytes, dropped, max_queue, wakeups; cut and lost: the
        packets the injected faults dropped) after close(), TUN backend."""
        self._started = self._closed = self._closing = False
        self._prev_sigterm: Any = None
        self._sigterm_installed = False
        self._lock = threading.Lock()

    # ---- lifecycle

    def __enter__(self) -> WanLab:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(raise_errors=exc_type is None)

    def start(self) -> WanLab:
        """Create the namespaces, links and shaping (idempotent; the with-statement calls it)."""
        global _lab_counter
        if self._started:
            return self
        if self._closed:
            raise WanError("this WanLab was closed; create a new one")
        check_privileges()
        _check_tools()
        self._started = True
        self._install_sigterm()
        atexit.register(self._atexit)
        try:
            cleanup_stale()
            with _lab_counter_lock:
                _lab_counter += 1
                n = _lab_counter
            base = f"{PREFIX}{os.getpid()}-{n}"
            self._names = [f"{base}-{i}" for i in range(self.hosts)]
            self._netem_in_kernel = netem_available()
            if self.requested_backend == "auto":
                self.backend = "netem" if self._netem_in_kernel else "tun"
            else:
                self.backend = self.requested_backend
            if self.regions:
                self.backend = "tun"  # links between regions are the forwarder's
            if self.backend == "netem" and self.delay_ms > 0 and not self._netem_in_kernel:
                raise WanError("backend='netem' with a delay needs the netem qdisc (sch_netem), which this kernel "
                               "does not have (`tc qdisc add ... netem` fails with 'Specified qdisc kind is "
                               "unknown'). Hint: use backend='tun' or 'auto', or load the module: modprobe sch_netem")
            if self.backend == "tun" and not os.path.exists("/dev/net/tun"):
                raise WanError("the tun backend needs /dev/net/tun. Hint: modprobe tun; in a container, pass "
                               "--device /dev/net/tun (and --cap-add NET_ADMIN)")
            for name in self._names:
                self._add_netns(name)
            if self.backend == "netem":
                self._build_netem(base)
            else:
                self._build_tun()
            for name in self._names:
                self._tune_tcp(name)
        except BaseException:
            self.close(raise_errors=False)
            raise
        return self

    def close(self, raise_errors: bool = True) -> None:
        """Stop every popen'd process (SIGTERM, SIGKILL after grace_s) and whatever else runs in the hosts, stop
        the forwarder, delete the namespaces. Safe to call twice; raises WanError if something could not be
        removed (unless raise_errors is False)."""
        with self._lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closing = True
        errors: list[str] = []
        try:
            self._stop_procs()
            all_ns = self._created
            left = _kill_netns_processes(all_ns)
            if left:
                errors.append(f"processes {left} inside the lab's namespaces survived SIGKILL")
            self._stop_switch()
            for name in reversed(self._created):
                res = _run(["ip", "netns", "del", name], check=False)
                if res.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, name)):
                    errors.append(f"`ip netns del {name}` failed: {res.stderr.strip()}")
        finally:
            self._closed = True
            self._closing = False
            self._restore_sigterm()
            atexit.unregister(self._atexit)
        if errors and raise_errors:
            raise WanError("WAN lab teardown incomplete: " + "; ".join(errors)
                           + ". Hint: `ip netns list` and `ip netns pids NAME` show what is left; "
                           "diloco.bench.wan.cleanup_stale() removes it once this process has exited")

    def _atexit(self) -> None:
        self.close(raise_errors=False)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            if self._closing:
                return
            raise SystemExit(128 + signum)

        self._prev_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL)
            self._sigterm_installed = False

    def _stop_procs(self) -> None:
        from diloco.launcher import terminate  # here: this file also runs alone, as the forwarder and the probes

        terminate(self._procs, self.grace_s)
        for p in self._procs:
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass

    def _stop_switch(self) -> None:
        sw = self._switch
        if sw is None:
            return
        try:
            out, _ = sw.communicate(timeout=5)  # closes its stdin: the forwarder prints its counters and exits
            lines = [x for x in (out or "").splitlines() if x.startswith("{")]
            if lines:
                self.switch_stats = json.loads(lines[-1])
        except subprocess.TimeoutExpired:
            sw.kill()
            sw.wait()
        except (OSError, ValueError):
            if sw.poll() is None:
                sw.kill()
            sw.wait()

    # ---- building

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name], hint="run as root on a kernel with network namespaces "
             "(CONFIG_NET_NS); a leftover of the same name is removed by diloco.bench.wan.cleanup_stale()")
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shaping(self, name: str) -> None:
        """tbf (rate only) on wan0 egress; the netem backend adds the delay itself."""
        if self.rate_mbit is None:
            return
        rate_bps = self.rate_mbit * 1e6 / 8
        burst = max(2 * self.mtu, int(rate_bps * 0.001))
        limit = burst + int(rate_bps * self.queue_ms / 1000)
        _run(["tc", "-n", name, "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", f"{self.rate_mbit * 1000:.0f}kbit",
              "burst", str(burst), "limit", str(limit)],
             hint="the tbf qdisc (sch_tbf) must be available: modprobe sch_tbf")

    def _host_if_up(self, name: str, i: int) -> None:
        _run(["ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME])
        _run(["ip", "-n", name, "link", "set", IFNAME, "mtu", str(self.mtu), "txqueuelen", "1000", "up"],
             hint="is the MTU valid for this device?")

    def _build_netem(self, base: str) -> None:
        hub = f"{base}-hub"
        self._add_netns(hub)
        self._hub = hub
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"], hint="needs bridge support (CONFIG_BRIDGE)")
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for i, name in enumerate(self._names):
            port = f"h{i}"
            _run(["ip", "-n", name, "link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", hub],
                 hint="needs veth support (CONFIG_VETH)")
            _run(["ip", "-n", hub, "link", "set", port, "mtu", str(self.mtu), "master", "br0", "up"])
            self._host_if_up(name, i)
            if self.delay_ms > 0:
                cmd = ["tc", "-n", name, "qdisc", "replace", "dev", IFNAME, "root", "netem", "delay", f"{self.delay_ms}ms"]
                in_flight = (self.delay_ms + self.queue_ms) / 1000 * (self.rate_mbit or 10_000) * 1e6 / 8
                if self.rate_mbit is not None:
                    cmd += ["rate", f"{self.rate_mbit * 1000:.0f}kbit"]
                cmd += ["limit", str(max(1000, int(2 * in_flight / min(self.mtu, 1500))))]
                _run(cmd, hint="the netem qdisc (sch_netem) must be available: modprobe sch_netem, or use backend='tun'")
            else:
                self._shaping(name)

    def _build_tun(self) -> None:
        addresses = [self.address(i) for i in range(self.hosts)]
        self._switch = subprocess.Popen(
            [sys.executable, "-I", _THIS_FILE, "_switch", "--delay-ms", repr(self.delay_ms), "--addresses",
             ",".join(addresses), *_region_args(self.regions, self.cross_rate_mbit, self.cross_delay_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, close_fds=True)
        ready = self._switch.stdout.readline() if self._switch.stdout else ""
        if not ready.startswith("ready "):
            try:
                _, err = self._switch.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self._switch.kill()
                _, err = self._switch.communicate()
            raise WanError(f"the TUN forwarder did not start: {(err or ready).strip()[-2000:]}. Hint: it needs "
                           "/dev/net/tun (modprobe tun) and root")
        devices = ready.split()[1].split(",")
        for i, (name, dev) in enumerate(zip(self._names, devices)):
            _run(["ip", "link", "set", "dev", dev, "netns", name],
                 hint="could not move the TUN device into the host namespace")
            _run(["ip", "-n", name, "link", "set", "dev", dev, "name", IFNAME])
            # the delay line carries IPv4 only: no IPv6 link-local chatter on wan0
            _run(["ip", "netns", "exec", name, "sh", "-c",
                  f"echo 1 > /proc/sys/net/ipv6/conf/{IFNAME}/disable_ipv6"], check=False)
            self._host_if_up(name, i)
            self._shaping(name)

    def _tune_tcp(self, name: str) -> None:
        rate = (self.rate_mbit or 1000.0) * 1e6 / 8
        bdp = rate * (2 * self.delay_ms + self.queue_ms) / 1000
        want = max(16 << 20, int(4 * bdp))
        res = _run(["ip", "netns", "exec", name, "cat", "/proc/sys/net/ipv4/tcp_rmem", "/proc/sys/net/ipv4/tcp_wmem"])
        rmem, wmem = (line.split() for line in res.stdout.strip().splitlines())
        top = max(want, int(rmem[2]), int(wmem[2]))
        self.tcp_buffer_max = top
        script = (f"echo '{rmem[0]} {rmem[1]} {max(top, int(rmem[2]))}' > /proc/sys/net/ipv4/tcp_rmem && "
                  f"echo '{wmem[0]} {wmem[1]} {max(top, int(wmem[2]))}' > /proc/sys/net/ipv4/tcp_wmem")
        _run(["ip", "netns", "exec", name, "sh", "-c", script],
             hint="tcp_rmem/tcp_wmem are per-namespace since Linux 4.15; an older kernel cannot raise them here")

    # ---- use

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.hosts:
            raise IndexError(f"host {i} out of range: this lab has hosts 0..{self.hosts - 1}")

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise WanError("the WanLab is not running: use it inside `with WanLab(...) as lab:`")

    def address(self, i: int) -> str:
        """Host i's IPv4 address inside its namespace."""
        self._check_host(i)
        return f"{SUBNET}.{i + 1}"

    def namespace(self, i: int) -> str:
        """Host i's network namespace name (for `ip netns exec`)."""
        self._check_host(i)
        self._check_running()
        return self._names[i]

    def popen(self, i: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """subprocess.Popen(cmd, **kwargs) inside host i's namespace (through `ip netns exec`, which execs
        `cmd` in place: the returned process is the command itself). Stopped when the lab closes."""
        if isinstance(cmd, (str, bytes)):
            raise TypeError("popen takes the command as a list of arguments, e.g. [sys.executable, '-m', 'x']")
        ns = self.namespace(i)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kwargs)
        self._procs.append(proc)
        return proc

    def measure(self, src: int, dst: int, nbytes: int | None = None, pings: int = 10,
                timeout: float = 60.0) -> LinkMeasurement:
        """Measure src → dst: RTT of 64-byte TCP echoes and the goodput of an `nbytes` bulk TCP transfer
        (default: about 2 s at the link rate, at least 4 MB)."""
        return self.measure_concurrent([(src, dst)], nbytes=nbytes, pings=pings, timeout=timeout)[0]

    def measure_concurrent(self, pairs: Sequence[tuple[int, int]], nbytes: int | None = None, pings: int = 10,
                           timeout: float = 60.0) -> list[LinkMeasurement]:
        """measure() for several (src, dst) pairs at the same time (e.g. every host sending at once)."""
        self._check_running()
        for a, b in pairs:
            self._check_host(a)
            self._check_host(b)
        return _measure(self, pairs, nbytes, pings, timeout)

    # ---- faults (tun backend: the forwarder applies them from its next packet on)

    def _control(self, line: str) -> None:
        self._check_running()
        sw = self._switch
        if sw is None or sw.stdin is None:
            raise WanError("partitions, loss and extra delay are the forwarder's: build the lab with "
                           "backend='tun' (or 'auto' on a kernel without netem)")
        with self._lock:
            sw.stdin.write(line + "\n")
            sw.stdin.flush()

    def cut(self, hosts: Sequence[int]) -> None:
        """A partition: `hosts` reach each other, the others reach each other, nothing crosses between the two
        sides (packets dropped, as on a dead path: TCP sees silence, not a reset) until `heal()`. Replaces the
        cut in force; an empty `hosts` heals."""
        for i in hosts:
            self._check_host(i)
        self.sides([int(i in hosts) for i in range(self.hosts)])

    def heal(self) -> None:
        """End the partition in force (if any)."""
        self.sides([0] * self.hosts)

    def sides(self, labels: Sequence[int]) -> None:
        """The general partition: one label per host; hosts of one label reach each other, nothing crosses
        between labels (all labels equal: no partition). Replaces the partition in force."""
        if len(labels) != self.hosts:
            raise ValueError(f"sides needs one label per host ({self.hosts}), got {len(labels)}")
        self._control("sides " + ",".join(str(int(x)) for x in labels))

    def loss(self, host: int, p: float) -> None:
        """Drop each packet from or to `host` with probability `p` (0 ends it)."""
        self._check_host(host)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be between 0 and 1, got {p}")
        self._control(f"loss {host} {p!r}")

    def inbound(self, host: int, allowed: bool) -> None:
        """Whether `host` takes new TCP connections: not allowed, it is as behind a NAT or a firewall that only lets
        connections out (the SYNs to it are dropped; those it opens work both ways)."""
        self._check_host(host)
        self._control(f"inbound {host} {int(allowed)}")

    def slow(self, host: int, extra_ms: float) -> None:
        """`host`'s packets take `extra_ms` more one way (0 ends it): a congested or rerouted path."""
        self._check_host(host)
        if extra_ms < 0:
            raise ValueError(f"extra_ms must be >= 0, got {extra_ms}")
        self._control(f"slow {host} {extra_ms!r}")

    @property
    def forwarder_pid(self) -> int | None:
        """The TUN forwarder's pid (None for the netem backend, or when not running)."""
        sw = self._switch
        return sw.pid if sw is not None and sw.poll() is None else None

    def forwarder_cpu_s(self) -> float | None:
        """CPU seconds (user + system) the TUN forwarder has used so far (None without one)."""
        pid = self.forwarder_pid
        if pid is None:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def describe(self) -> str:
        """One line: the backend that runs and the link settings."""
        self._check_running()
        rate = "unlimited rate" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s per host link (tbf)"
        if self.backend == "netem":
            if self.delay_ms > 0:
                rate = rate.replace("(tbf)", "(netem)")
                delay = f"{self.delay_ms:g} ms one way (netem backend: netem on veth, hosts bridged in a hub namespace)"
            else:
                delay = "no added delay (netem backend: veth, hosts bridged in a hub namespace)"
        else:
            why = "kernel has no netem" if not self._netem_in_kernel else "tun backend requested"
            delay = f"{self.delay_ms:g} ms one way (tun backend: userspace delay line over TUN; {why})"
        mib = self.tcp_buffer_max / (1 << 20)
        regions = ""
        if self.regions:
            cross = "unlimited" if not self.cross_rate_mbit else f"{self.cross_rate_mbit:g} Mbit/s"
            regions = (f"; {len(set(self.regions))} regions (hosts {list(self.regions)}): between regions each host "
                       f"sends at {cross}, {self.cross_delay_ms:g} ms one way")
        return (f"{self.hosts} hosts in network namespaces, {rate}, {delay}, MTU {self.mtu}, "
                f"TCP buffers up to {mib:g} MiB{regions}")


def _measure(lab: WanLab, pairs: Sequence[tuple[int, int]], nbytes: int | None, pings: int,
             timeout: float) -> list[LinkMeasurement]:
    """`WanLab.measure_concurrent`: a probe server on each pair's destination, its client on the source, all at once."""
    if nbytes is None:
        nbytes = max(4_000_000, int((lab.rate_mbit or 400.0) * 1e6 / 8 * 2.0))
    helper = [sys.executable, "-I", _THIS_FILE]
    servers: list[subprocess.Popen[Any]] = []
    clients: list[subprocess.Popen[Any]] = []
    try:
        for a, b in pairs:
            srv = lab.popen(b, [*helper, "_probe_server", "--timeout", str(timeout)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            servers.append(srv)
        ports = []
        for srv in servers:
            line = srv.stdout.readline() if srv.stdout else ""
            if not line.strip().isdigit():
                err = srv.communicate(timeout=5)[1] if srv.poll() is not None else ""
                raise WanError(f"measurement server did not start: {(err or line).strip()[-2000:]}")
            ports.append(int(line))
        for (a, b), port in zip(pairs, ports):
            clients.append(lab.popen(a, [*helper, "_probe_client", lab.address(b), str(port), str(nbytes),
                                         str(pings), "--timeout", str(timeout)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True))
        results = []
        for (a, b), cli in zip(pairs, clients):
            try:
                out, err = cli.communicate(timeout=timeout + 10)
            except subprocess.TimeoutExpired:
                cli.kill()
                out, err = cli.communicate()
            if cli.returncode != 0:
                raise WanError(f"measurement {a} -> {b} failed (exit {cli.returncode}): {err.strip()[-2000:]}")
            d = json.loads(out.strip().splitlines()[-1])
            results.append(LinkMeasurement(src=a, dst=b, **d))
        for srv in servers:
            try:
                srv.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.communicate()
        return results
    finally:
        for p in servers + clients:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p in lab._procs:
                lab._procs.remove(p)


# -------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_switch":
        p = argparse.ArgumentParser(prog="wan _switch")
        p.add_argument("--delay-ms", type=float, required=True)
        p.add_argument("--addresses", required=True)
        p.add_argument("--groups", default="")
        p.add_argument("--cross-delay-ms", type=float, default=0.0)
        p.add_argument("--cross-rate-mbit", type=float, default=0.0)
        p.add_argument("--cross-queue-ms", type=float, default=0.0)
        a = p.parse_args(argv[1:])
        groups = [int(g) for g in a.groups.split(",")] if a.groups else []
        return _switch(a.delay_ms, a.addresses.split(","), groups, a.cross_delay_ms, a.cross_rate_mbit,
                       a.cross_queue_ms)
    if argv and argv[0] == "_probe_server":
        p = argparse.ArgumentParser(prog="wan _probe_server")
        p.add_argument("--timeout", type=float, default=60.0)
        return _probe_server(p.parse_args(argv[1:]).timeout)
    if argv and argv[0] == "_probe_client":
        p = argparse.ArgumentParser(prog="wan _probe_client")
        p.add_argument("host")
        p.add_argument("port", type=int)
        p.add_argument("nbytes", type=int)
        p.add_argument("pings", type=int)
        p.add_argument("--timeout", type=float, default=60.0)
        a = p.parse_args(argv[1:])
        return _probe_client(a.host, a.port, a.nbytes, a.pings, a.timeout)

    p = argparse.ArgumentParser(prog="python -m diloco.bench.wan",
                                description="Build an emulated WAN lab, measure it, tear it down.")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", type=float, default=100.0, help="per-host uplink rate, Mbit/s (0: unlimited)")
    p.add_argument("--delay", type=float, default=50.0, help="one-way delay, ms")
    p.add_argument("--backend", choices=["auto", "netem", "tun"], default="auto")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--queue-ms", type=float, default=None)
    p.add_argument("--bytes", type=int, default=None, help="bulk transfer size (default: ~2 s at the link rate)")
    p.add_argument("--all", action="store_true", help="also measure every host sending to the next one at once")
    a = p.parse_args(argv)
    try:
        with WanLab(a.hosts, a.rate or None, a.delay, backend=a.backend, mtu=a.mtu, queue_ms=a.queue_ms) as lab:
            print(lab.describe(), flush=True)
            cpu0, t0 = lab.forwarder_cpu_s(), time.monotonic()
            print(lab.measure(0, min(1, a.hosts - 1), nbytes=a.bytes), flush=True)
            if a.all and a.hosts > 1:
                ring = [(i, (i + 1) % a.hosts) for i in range(a.hosts)]
                for m in lab.measure_concurrent(ring, nbytes=a.bytes):
                    print("  at once:", m, flush=True)
            cpu1 = lab.forwarder_cpu_s()
            if cpu0 is not None and cpu1 is not None:
                print(f"forwarder CPU: {cpu1 - cpu0:.2f} s over {time.monotonic() - t0:.2f} s of measurement "
                      f"({100 * (cpu1 - cpu0) / (time.monotonic() - t0):.0f}% of one core)", flush=True)
        if lab.switch_stats:
            print("forwarder:", json.dumps(lab.switch_stats), flush=True)
    except WanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
