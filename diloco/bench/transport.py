"""Benchmark: a round's goodput over the swarm's transport, against plain TCP and a link's rate
(`diloco bench transport`).

1. **Loopback.** N real peers (`diloco start/join -- python -m diloco.bench.size worker`, each process
   with its own libp2p daemon) on 127.0.0.1 hold a model of P fp32 parameters and take rounds with no
   compression. A round's goodput is the bytes a peer sent in it over the round's time, from its start to
   its outcome: the Δ, the two phases of the all-reduce through the daemons, and the outer step. The
   baseline moves the same bytes per peer over plain TCP sockets on the same loopback, in the same
   pattern (every peer to every other at once, an equal share to each, N·(N−1) connections), by threads
   of one process (`sendall` and `recv_into` run without the GIL): what the kernel gives that traffic
   with no protocol, encoding or copies in the way. A second baseline sends the same bytes in one call
   between two of the swarm's daemons (`diloco.comms.p2p`, no authentication, no round): what libp2p and
   the daemons cost on their own, the rest being the round's. Reported: the times and their ratios.
2. **WAN.** N peers in network namespaces whose uplinks are limited to `rate_mbit` with `delay_ms` each
   way (`diloco.bench.wan.WanLab`, root): the round's goodput against the uplink's rate (a peer's bytes
   leave through its own uplink, so the rate bounds its goodput), and against plain TCP moving the same
   bytes across the same links in the same pattern (`WanLab.measure_concurrent`): what one TCP flow per
   pair gets from the emulated link (its queue, its delay, slow start) before any protocol; and against the
   swarm's daemons moving the same bytes in the same pattern with no round (`daemons_across`, one call per
   pair, all at once): what libp2p's transport gets from the link.

The machine's cores are shared by every peer and daemon: at N=8 on a small machine what is measured is
as much CPU as transport (the report says how many cores there were).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..comms.dataplane import DataConfig
from ..launcher import terminate
from ..lines import write_lines
from .size import launch_peer, wait_file

RECV_CHUNK = 1 << 20
PHASES = ("plan", "gather", "encode", "exchange", "decide")


@dataclass(frozen=True)
class TransportSetup:
    peers: tuple[int, ...] = (2, 4, 8)
    payload_mb: tuple[float, ...] = (1.0, 10.0, 100.0)
    """The model's fp32 size, MB (1e6 bytes): P = payload_mb·1e6/4 parameters."""
    rounds: int = 3
    """Rounds of all N peers together that are timed (after those a peer took before everyone was in)."""
    inner_steps: int = 2
    wan: bool = True
    wan_peers: tuple[int, ...] = (2,)
    wan_payload_mb: float = 20.0
    rate_mbit: float = 50.0
    delay_ms: float = 25.0
    loopback: bool = True
    direct: bool = True
    """Peers use the direct data plane (`--direct`); False: every byte through libp2p, as before it."""
    data_streams: int = DataConfig().streams
    """Direct connections a peer opens to one member at most (`--data-streams`: its calls in flight at once)."""
    relay: bool = False
    """Each point again through a relay: peer 0 serves as one (`--relay`), every other peer waits there
    (`--reach relay`), so every call between two of them crosses peer 0 (3 peers at least)."""


def tcp_copy(peers: int, nbytes: int, host: str = "127.0.0.1") -> float:
    """Seconds until each of `peers` endpoints has sent `nbytes`, split evenly among the others, over plain
    TCP on `host`, and received its share from each of them, all at once. Raises RuntimeError if a byte is
    missing."""
    if peers < 2:
        raise ValueError(f"peers must be >= 2, got {peers}")
    share = max(1, nbytes // (peers - 1))
    payload = memoryview(bytes(share))
    listeners = []
    for _ in range(peers):
        s = socket.create_server((host, 0), backlog=peers)
        listeners.append(s)
    received = [0] * (peers * (peers - 1))
    start = threading.Barrier(2 * peers * (peers - 1) + 1)
    errors: list[BaseException] = []

    def read(conn: socket.socket, slot: int) -> None:
        buf = bytearray(RECV_CHUNK)
        try:
            with conn:
                start.wait()
                while n := conn.recv_into(buf):
                    received[slot] += n
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)

    def accept(j: int) -> list[threading.Thread]:
        readers = []
        for k in range(peers - 1):
            conn, _ = listeners[j].accept()
            readers.append(threading.Thread(target=read, args=(conn, j * (peers - 1) + k), daemon=True))
        return readers

    def send(i: int, j: int) -> None:
        try:
            with socket.create_connection(listeners[j].getsockname()[:2]) as c:
                start.wait()
                c.sendall(payload)
                c.shutdown(socket.SHUT_WR)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)

    senders = [threading.Thread(target=send, args=(i, j), daemon=True)
               for i in range(peers) for j in range(peers) if i != j]
    for t in senders:
        t.start()
    readers = [r for j in range(peers) for r in accept(j)]
    for r in readers:
        r.start()
    start.wait()
    began = time.perf_counter()
    for t in senders + readers:
        t.join()
    seconds = time.perf_counter() - began
    for s in listeners:
        s.close()
    if errors or sum(received) != share * peers * (peers - 1):
        raise RuntimeError(f"plain TCP copy lost bytes: {sum(received)} of {share * peers * (peers - 1)} "
                           f"({errors[:1]})")
    return seconds


async def _timed_calls(a: Any, b: Any, nbytes: int, repeats: int) -> float:
    """Median seconds of `b` calling `a` with `nbytes` (a handler answering "ok"), after one small call that
    connects and warms up: the one-call baselines of both transports."""
    async def take(caller: Any, payload: bytes) -> bytes:
        return b"ok"

    await a.register("copy", take)
    data = bytes(nbytes)
    await b.call(a.peer_id, "copy", data[:1024], 60)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        await b.call(a.peer_id, "copy", data, 600)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def daemon_copy(nbytes: int, repeats: int = 3) -> float:
    """Median seconds of one call carrying `nbytes` from one libp2p daemon to another on loopback, through
    the swarm's transport (`diloco.comms.p2p`: encrypted libp2p streams, length-prefixed) with no
    authentication and no round protocol: what the daemons alone cost."""
    import asyncio

    from diloco.comms.p2p import P2PTransport

    async def measure() -> float:
        a = await P2PTransport.create()
        try:
            b = await P2PTransport.create(initial_peers=[str(m) for m in await a.p2p.get_visible_maddrs()])
            try:
                return await _timed_calls(a, b, nbytes, repeats)
            finally:
                await b.close()
        finally:
            await a.close()

    return asyncio.run(measure())


def daemon_host(argv: list[str]) -> None:
    """One host of `daemons_across` (`python -m diloco.bench.transport daemon-host DIR I N BYTES REPEATS ADDR`):
    a daemon on ADDR that takes calls, dials hosts 0..I-1 (their addresses in DIR), then REPEATS times, at the
    go signal, sends BYTES/(N-1) to every other host at once and writes how long that took."""
    import asyncio
    import json

    from diloco.comms.p2p import P2PTransport
    from diloco.comms.transport import PeerId
    from diloco.peers.reaper import Reaper

    workdir, me, hosts, nbytes, repeats, addr = Path(argv[0]), *map(int, argv[1:5]), argv[5]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("diloco.comms").setLevel(logging.DEBUG)  # a dropped stream says why, should one fail

    async def wait_for(path: Path) -> str:
        while not path.exists():
            await asyncio.sleep(0.05)
        return path.read_text()

    async def main(reaper: Reaper) -> None:
        # the parent ends a failed baseline with SIGTERM: close the daemon as at the end (the reaper, should we be
        # SIGKILLed, takes the daemon and its sockets down too)
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        earlier = [json.loads(await wait_for(workdir / f"h{i}.addr")) for i in range(me)]
        t = await P2PTransport.create(host_maddrs=[f"/ip4/{addr}/tcp/0"],
                                      initial_peers=[m for h in earlier for m in h["maddrs"]])
        t.watched_by(reaper)
        try:
            async def take(caller: Any, payload: bytes) -> bytes:
                return b"ok"

            await t.register("copy", take)
            (workdir / f"h{me}.tmp").write_text(json.dumps(
                {"peer": str(t.peer_id), "maddrs": [str(m) for m in await t.p2p.get_visible_maddrs()]}))
            (workdir / f"h{me}.tmp").rename(workdir / f"h{me}.addr")
            others = [PeerId(json.loads(await wait_for(workdir / f"h{i}.addr"))["peer"])
                      for i in range(hosts) if i != me]
            for p in others:  # as the swarm's members are once their credential passed: no deadline on their heads
                t.gate.passed(p)
            (workdir / f"h{me}.passed").touch()
            for i in range(hosts):  # a host that has not passed us yet would hold our call to a stranger's deadline
                if i != me:
                    await wait_for(workdir / f"h{i}.passed")
            for p in others:  # dial and warm up
                await t.call(p, "copy", b"x", 120)
            share = bytes(max(1, nbytes // len(others)))
            for k in range(repeats):
                await wait_for(workdir / f"go{k}")
                began = time.perf_counter()
                await asyncio.gather(*(t.call(p, "copy", share, 600) for p in others))
                # atomically: the parent reads the file once it exists
                write_lines(workdir / f"h{me}.{k}.s", [str(time.perf_counter() - began)])
            await wait_for(workdir / "done")  # the others may still be sending to us
        finally:
            await t.close()

    reaper = Reaper()
    try:
        asyncio.run(main(reaper))
    except asyncio.CancelledError:
        sys.exit(128 + signal.SIGTERM)
    finally:
        reaper.close()


def daemons_across(lab: Any, nbytes: int, repeats: int = 3) -> float:
    """Median seconds until each of `lab`'s hosts has sent `nbytes`, an equal share to every other at once,
    through the swarm's daemons (`diloco.comms.p2p`, one call per pair, no round): the round's pattern over
    the same links with only the daemons' transport in the way."""
    hosts = lab.hosts
    with tempfile.TemporaryDirectory(prefix="diloco-bench-daemons-") as tmp:
        workdir = Path(tmp)
        procs = [lab.popen(i, [sys.executable, "-m", "diloco.bench.transport", "daemon-host", tmp, str(i), str(hosts),
                               str(nbytes), str(repeats), lab.address(i)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(hosts)]
        try:
            times = []
            for k in range(repeats):
                time.sleep(1.0)  # idle between rounds, as between a swarm's rounds
                (workdir / f"go{k}").touch()
                deadline = time.monotonic() + 600
                while not all((workdir / f"h{i}.{k}.s").exists() for i in range(hosts)):
                    failed = [i for i, p in enumerate(procs) if p.poll() is not None]
                    if failed or time.monotonic() > deadline:
                        terminate(procs)
                        said = [f"host {i}: " + (p.stderr.read().decode(errors="replace")[-1500:] if p.stderr else "")
                                for i, p in enumerate(procs)]
                        raise RuntimeError(f"the daemon-to-daemon baseline failed (repeat {k}; "
                                           f"{'host ' + str(failed[0]) + ' exited' if failed else 'timed out'}):\n"
                                           + "\n".join(said))
                    time.sleep(0.05)
                times.append(max(float((workdir / f"h{i}.{k}.s").read_text()) for i in range(hosts)))
            (workdir / "done").touch()
            for p in procs:
                p.wait(60)
            return statistics.median(times)
        finally:
            terminate(procs)


def peer_flags(peers: int, setup: TransportSetup) -> list[str]:
    """The swarm flags of every peer of a point: fp32, all `peers` waited for, deadlines far beyond a round, and the
    data plane as `setup` says."""
    return ["--compression", "fp32", "--wait-for", str(peers), "--gather-timeout", "120", "--round-timeout", "600",
            "--direct" if setup.direct else "--no-direct", "--data-streams", str(setup.data_streams)]


def _rounds(peers: int, params: int, setup: TransportSetup, lab: Any = None, relayed: bool = False) -> dict[str, Any]:
    """N real peers (in `lab`'s hosts, or on loopback) taking rounds of `params` fp32 parameters: the median
    round time and bytes a peer sent, over the rounds all N took together. `relayed`: peer 0 a relay, the others
    called through it (`TransportSetup.relay`)."""
    import json

    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    run_id = f"transport-{secrets.token_hex(3)}"
    timing = peer_flags(peers, setup)
    # a peer may take a round or two before everyone is in; it trains until N peers took `rounds` together
    args = ["--params", str(params), "--rounds", str(setup.rounds + 2), "--inner-steps", str(setup.inner_steps)]
    with tempfile.TemporaryDirectory(prefix="diloco-bench-transport-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(peers):
                where = ["--host", lab.address(i)] if lab is not None else []
                verb = ["start"] if i == 0 else ["join", wait_file(workdir / "p0.addr", procs, 300)]
                popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen if lab is None else \
                    (lambda cmd, i=i, **kw: lab.popen(i, cmd, **kw))
                relay = (["--relay"] if i == 0 else ["--reach", "relay"]) if relayed else []
                procs.append(launch_peer(verb, run_id, [*timing, *where, *relay], args, workdir, f"p{i}", env,
                                         popen=popen))
            deadline = time.monotonic() + 1800
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{peers} peers at {params:,} parameters did not finish in 30 min")
                time.sleep(0.2)
            failed = [i for i, p in enumerate(procs) if p.returncode]
            if failed:
                raise RuntimeError(f"peer {failed[0]} failed ({peers} peers, {params:,} parameters); its log:\n" +
                                   (workdir / f"p{failed[0]}.log").read_text(errors="replace")[-3000:])
            done = [json.loads((workdir / f"p{i}.json").read_text()) for i in range(peers)]
        finally:
            terminate(procs)
    together = [(s, b, ph) for d in done
                for s, b, n, ph in zip(d["round_seconds"], d["bytes_sent"], d["peers"], d["phases"]) if n == peers]
    if not together:
        raise RuntimeError(f"{peers} peers never took a round all together")
    return {"peers": peers, "params": params, "payload_bytes": 4 * params, "rounds": len(together) // peers,
            "paths": sorted({path for d in done for path in d.get("paths", [])}),
            "round_s": statistics.median(s for s, _, _ in together),
            "bytes_sent": statistics.median(b for _, b, _ in together),
            "phases_s": median_phases([ph for _, _, ph in together])}


def median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per phase (`RoundOutcome.phases`), its median seconds over the rounds that reached it."""
    names = dict.fromkeys(name for ph in rounds for name in ph)
    return {name: statistics.median(ph[name] for ph in rounds if name in ph) for name in names}


def direct_copy(nbytes: int, repeats: int = 3) -> float:
    """Median seconds of one call carrying `nbytes` on the data plane (`diloco.comms.dataplane`: a direct TCP
    connection, its handshake done once, AES-GCM records) between two endpoints of this process on loopback, with no
    round protocol: what the direct connections alone cost (`daemon_copy`'s counterpart)."""
    import asyncio

    from diloco.comms import PeerId
    from diloco.comms.auth import Guard, new_secret
    from diloco.comms.dataplane import DataConfig, DirectTransport
    from diloco.comms.identity import Identity
    from diloco.comms.transport import InProcNetwork

    async def measure() -> float:
        net, secret = InProcNetwork(), new_secret()
        ends = []
        for _ in range(2):
            me = Identity.generate()
            end = DirectTransport(net.transport(me.peer_id), me, DataConfig(), nbytes + (1 << 20))
            end.guard = Guard(secret, "copy", PeerId(me.peer_id))
            ends.append(end)
        a, b = ends
        try:
            address = await a.start()
            b.address_of = lambda peer: address
            seconds = await _timed_calls(a, b, nbytes, repeats)
            if b.paths.get(a.peer_id) != "direct":
                raise RuntimeError("the direct-call baseline went through the fallback, not the data port")
            return seconds
        finally:
            await b.close()
            await a.close()

    return asyncio.run(measure())


def loopback(peers: int, payload_mb: float, setup: TransportSetup, say: Callable[[str], None]) -> dict[str, Any]:
    row = _rounds(peers, max(1, int(payload_mb * 1e6 / 4)), setup)
    row["tcp_s"] = statistics.median(tcp_copy(peers, int(row["bytes_sent"])) for _ in range(3))
    row["daemon_s"] = daemon_copy(int(row["bytes_sent"]))
    row["of_daemon"] = row["daemon_s"] / row["round_s"]
    row["direct_s"] = direct_copy(int(row["bytes_sent"]))
    row["goodput_mb_s"] = row["bytes_sent"] / row["round_s"] / 1e6
    row["tcp_mb_s"] = row["bytes_sent"] / row["tcp_s"] / 1e6
    row["of_tcp"] = row["tcp_s"] / row["round_s"]
    say(f"loopback, {peers} peers, {payload_mb:g} MB: round {row['round_s']:.3f} s, {row['goodput_mb_s']:.1f} MB/s "
        f"a peer; plain TCP {row['tcp_s']:.3f} s ({row['of_tcp']:.1%}); one daemon-to-daemon call {row['daemon_s']:.3f} s "
        f"({row['of_daemon']:.1%})")
    if setup.relay:
        row["relayed"] = relayed_row(row, _rounds(peers, row["params"], setup, relayed=True), say, "loopback")
    return row


def relayed_row(direct: dict[str, Any], relayed: dict[str, Any], say: Callable[[str], None], link: str) -> dict[str, Any]:
    """The same point through a relay, against the direct run of it."""
    relayed["goodput_mb_s"] = relayed["bytes_sent"] / relayed["round_s"] / 1e6
    relayed["of_direct"] = direct["round_s"] / relayed["round_s"]
    say(f"{link}, {direct['peers']} peers through a relay: round {relayed['round_s']:.3f} s, "
        f"{relayed['goodput_mb_s']:.1f} MB/s a peer, {relayed['of_direct']:.1%} of the direct round's speed")
    return relayed


def wan(peers: int, setup: TransportSetup, say: Callable[[str], None]) -> dict[str, Any]:
    from .wan import WanLab

    with WanLab(hosts=peers, rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms) as lab:
        row = _rounds(peers, max(1, int(setup.wan_payload_mb * 1e6 / 4)), setup, lab=lab)
        row["backend"] = lab.backend
        if setup.relay:
            row["relayed"] = relayed_row(row, _rounds(peers, row["params"], setup, lab=lab, relayed=True), say, "WAN")
        # plain TCP across the same links, in the round's pattern: every host sends its share to every other at once
        pairs = [(i, j) for i in range(peers) for j in range(peers) if i != j]
        flows = lab.measure_concurrent(pairs, nbytes=int(row["bytes_sent"] / (peers - 1)), pings=3, timeout=600)
        try:  # a baseline that failed leaves the round's figures standing; the row says why it has none
            row["daemons_s"] = daemons_across(lab, int(row["bytes_sent"]))
        except RuntimeError as e:
            row["daemons_error"] = str(e)
    row["goodput_mbit_s"] = 8 * row["bytes_sent"] / row["round_s"] / 1e6
    row["of_rate"] = row["goodput_mbit_s"] / setup.rate_mbit
    row["tcp_s"] = max(f.seconds for f in flows)
    row["tcp_mbit_s"] = 8 * row["bytes_sent"] / row["tcp_s"] / 1e6
    row["tcp_of_rate"] = row["tcp_mbit_s"] / setup.rate_mbit
    row["rtt_ms"] = statistics.median(f.rtt_ms for f in flows)
    if "daemons_s" in row:
        row["daemons_mbit_s"] = 8 * row["bytes_sent"] / row["daemons_s"] / 1e6
        daemons = f"{row['daemons_mbit_s']:.1f} Mbit/s ({row['daemons_mbit_s'] / setup.rate_mbit:.1%})"
    else:
        daemons = f"failed: {row['daemons_error']}"
    say(f"WAN {setup.rate_mbit:g} Mbit/s, {setup.delay_ms:g} ms, {peers} peers, {setup.wan_payload_mb:g} MB: round "
        f"{row['round_s']:.2f} s, {row['goodput_mbit_s']:.1f} Mbit/s a peer ({row['of_rate']:.1%} of the rate); "
        f"plain TCP {row['tcp_mbit_s']:.1f} Mbit/s ({row['tcp_of_rate']:.1%}); the daemons alone {daemons}")
    return row


def run(setup: TransportSetup, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    rows = [loopback(n, mb, setup, say) for n in setup.peers for mb in setup.payload_mb] if setup.loopback else []
    wans = [wan(n, setup, say) for n in setup.wan_peers] if setup.wan else []
    return {"setup": asdict(setup), "cores": os.cpu_count(), "loopback": rows, "wan": wans}


def markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    if result["loopback"]:
        lines += ["| peers | model (fp32) | path | bytes a peer sends | round | goodput a peer | plain TCP, same bytes | "
                  "round / plain TCP | one daemon call, same bytes | round / daemon call | one direct call, same bytes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["loopback"]:
            direct = f"{r['direct_s']:.3f} s" if "direct_s" in r else "-"
            lines.append(f"| {r['peers']} | {r['payload_bytes'] / 1e6:g} MB | {'+'.join(r.get('paths', [])) or '-'} | "
                         f"{r['bytes_sent'] / 1e6:.2f} MB | "
                         f"{r['round_s']:.3f} s | {r['goodput_mb_s']:.1f} MB/s | {r['tcp_s']:.3f} s "
                         f"({r['tcp_mb_s']:.0f} MB/s) | {r['of_tcp']:.1%} | {r['daemon_s']:.3f} s | {r['of_daemon']:.1%} | "
                         f"{direct} |")
    if result["wan"]:
        s = result["setup"]
        lines += ["", f"Emulated WAN: every uplink {s['rate_mbit']:g} Mbit/s, {s['delay_ms']:g} ms each way:", "",
                  "| peers | model (fp32) | bytes a peer sends | round | goodput a peer | of the rate | "
                  "plain TCP, same bytes and pattern | round / plain TCP | the daemons alone, same bytes and pattern | "
                  "round / daemons |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["wan"]:
            lines.append(f"| {r['peers']} | {r['payload_bytes'] / 1e6:g} MB | {r['bytes_sent'] / 1e6:.2f} MB | "
                         f"{r['round_s']:.2f} s | {r['goodput_mbit_s']:.1f} Mbit/s | {r['of_rate']:.1%} | "
                         f"{r['tcp_s']:.2f} s ({r['tcp_mbit_s']:.1f} Mbit/s, {r['tcp_of_rate']:.1%} of the rate) | "
                         f"{r['tcp_s'] / r['round_s']:.1%} | " + (
                             f"{r['daemons_s']:.2f} s ({r['daemons_mbit_s']:.1f} Mbit/s, {r['daemons_mbit_s'] / s['rate_mbit']:.1%}"
                             f" of the rate) | {r['daemons_s'] / r['round_s']:.1%} |" if "daemons_s" in r else
                             "failed (`daemons_error` in the JSON) | – |"))
    rows = [("loopback", r) for r in result["loopback"]] + [("WAN", r) for r in result["wan"]]
    if any("relayed" in r for _, r in rows):
        lines += ["", "Through a relay (peer 0 `--relay`, the others `--reach relay`: a call between two of them crosses "
                  "peer 0), against the same point direct:", "",
                  "| link | peers | model | round, direct | round, relayed | relayed / direct speed | goodput a peer, "
                  "relayed | paths |", "|---|---|---|---|---|---|---|---|"]
        for link, r in rows:
            if "relayed" in r:
                x = r["relayed"]
                lines.append(f"| {link} | {r['peers']} | {r['payload_bytes'] / 1e6:g} MB | {r['round_s']:.3f} s | "
                             f"{x['round_s']:.3f} s | {x['of_direct']:.1%} | {x['goodput_mb_s']:.1f} MB/s | "
                             f"{'+'.join(x.get('paths', []))} |")
    if any(r.get("phases_s") for _, r in rows):
        lines += ["", "Where a round's time goes (medians, seconds; the rest: Δ, the outer step, the wrapper):", "",
                  "| link | peers | model | round | " + " | ".join(PHASES) + " | rest |",
                  "|---|---|---|---|" + "---|" * (len(PHASES) + 1)]
        for link, r in rows:
            ph = r.get("phases_s", {})
            lines.append(f"| {link} | {r['peers']} | {r['payload_bytes'] / 1e6:g} MB | {r['round_s']:.3f} | " +
                         " | ".join(f"{ph[p]:.3f}" if p in ph else "–" for p in PHASES) +
                         f" | {r['round_s'] - sum(ph.values()):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["daemon-host"]:
        daemon_host(sys.argv[2:])
    else:
        sys.exit("usage: python -m diloco.bench.transport daemon-host DIR I N BYTES REPEATS ADDR (see daemons_across)")
