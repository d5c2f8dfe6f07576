"""Benchmark: does a flood of unauthorized callers slow a swarm's rounds?

A swarm of `peers` real peers (hivemind daemons on 127.0.0.1, guarded by one secret, the round
collective of `diloco.comms`) runs back-to-back rounds on a fixed pseudo-gradient of `numel` fp32
values. Three phases of `rounds` rounds each: quiet, flooded, quiet again. During the flood,
`flooders` separate processes, each with its own daemon and a wrong secret, keep `concurrency`
calls each in flight against every peer's contribution handler, each call a well-formed envelope
declaring a `body_kib` KiB body. Reported: median round time per phase, the flooded median over
the quiet ones, calls the flooders made and the peers refused, and bytes the peers read from them.

With `target` "data" the swarm's rounds go on the direct data plane (`comms/dataplane.py`) and the flooders
go there too: each call is a TCP connection whose handshake proves another swarm's key (a stranger's), then
`body_kib` KiB of junk, until the peer closes it; with `stalled` N, N connections that send nothing.

With `stalled` N, each flooder instead opens N streams to every peer's contribution handler and sends
nothing on them, holding them until the flooded phase ends (the attack that once took a peer past its
open-files limit: comms/streamgate.py). Reported then: streams opened, streams the peers cut
(`slow_head`, `too_many_streams`), and the most file descriptors held by the swarm's process (all its
peers' handlers) and by one daemon, quiet and attacked, sampled from /proc every 0.2 s.

A real attacker runs on its own machine: its CPU is not ours. With `pin` (the default) the swarm's
process and daemons get the first half of this machine's cores and the flooders the rest, so what
the flooded phase measures is what handling the flood costs the swarm, not the attacker's own work
(without `pin`, on a small machine, the attacker's CPU dominates and the ratio is an upper bound).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from functools import partial
from typing import Any, Awaitable, Callable

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from diloco.comms import Collective, CollectiveConfig, PeerId, RoundKey
from diloco.comms import dataplane as dp
from diloco.comms.auth import Guard, new_secret
from diloco.comms.dataplane import REASONS, DataConfig, DirectTransport, parse_address
from diloco.comms.identity import Identity
from diloco.comms.introduce import connect
from diloco.comms.tarpit import Tarpit, TarpitConfig
from diloco.bench.procmem import open_fds, rss_mib

RUN = "bench-flood"


@dataclass(frozen=True)
class FloodSetup:
    peers: int = 3
    numel: int = 1 << 20
    rounds: int = 20
    flooders: int = 2
    concurrency: int = 16
    body_kib: int = 1024
    patience: float = 5.0
    """Seconds a flooding call waits for its answer before it gives up and opens another."""
    tarpit: bool = True
    """Off: every refusal is answered at once (the control that shows what the tarpit buys)."""
    compression: str = "fp32"
    pin: bool = True
    stalled: int = 0
    """Streams each flooder opens to each peer and leaves silent (0: the flooders make calls instead)."""
    target: str = "libp2p"
    """Where the rounds go and the flood comes: "libp2p" (the daemons) or "data" (the direct data plane's port)."""

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")


TARGETS = ("libp2p", "data")
REFUSALS = ("unauthorized", *REASONS)
"""What the swarm's guards count a refused caller as, at either port."""


def _split_cores() -> tuple[set[int], set[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("pinning needs at least 2 cores; run with pin off (--no-pin)")
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


async def _swarm(setup: FloodSetup, secret: str) -> tuple[list[Any], list[Collective]]:
    from diloco.comms.p2p import P2PTransport

    cfg = CollectiveConfig(gather_timeout=30, reduce_timeout=20, result_timeout=30, call_timeout=15,
                           compression=setup.compression)
    identities = [Identity.generate() for _ in range(setup.peers)]
    first = await P2PTransport.create(identity=identities[0])
    transports: list[Any] = [first] + [await P2PTransport.create(initial_peers=await first.visible_addresses(),
                                                                 identity=identity) for identity in identities[1:]]
    for i, t in enumerate(transports[1:], 1):  # all dialed the first; no directory introduces the rest
        for other in transports[i + 1:]:
            await connect(t.p2p, other.peer_id, await other.visible_addresses(), 10)
    if setup.target == "data":  # the rounds on direct connections; members find each other's data port here
        addresses: dict[PeerId, str] = {}
        direct = [DirectTransport(t, identity, DataConfig(), t.max_message) for t, identity in zip(transports, identities)]
        for d in direct:
            addresses[d.peer_id] = await d.start()
            d.address_of = lambda peer: addresses.get(peer, "")
        transports = direct
    collectives = []
    for t in transports:
        t.guard = Guard(secret, RUN, t.peer_id)
        if not setup.tarpit:
            t.guard.tarpit = Tarpit(TarpitConfig(hold=0.0))
        collectives.append(await Collective.create(t, RUN, cfg))
    return transports, collectives


def _daemon_pid(t: Any) -> int | None:
    pid = getattr(t, "inner", t).daemon_pid
    return int(pid) if pid else None


async def _target(t: Any) -> str:
    """Where a flooder aims at peer `t`: its data port (host:port/peer id) or its libp2p address."""
    if isinstance(t, DirectTransport):
        return f"{t.address}/{t.peer_id}"
    addr = f"{(await t.visible_addresses())[0]}"
    return addr if "/p2p/" in addr else f"{addr}/p2p/{t.peer_id}"


class _Peaks:
    """Samples every 0.2 s the swarm daemons' resident memory together, the file descriptors this process
    holds (every peer's handlers), and the most one daemon holds; `take()` returns the peaks since the last."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids
        self._peak = self._zero()
        self._task = asyncio.create_task(self._sample())

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"rss_mib": 0.0, "swarm_process_fds": 0, "daemon_fds": 0}

    def _now(self) -> dict[str, float]:
        return {"rss_mib": rss_mib(self._pids), "swarm_process_fds": open_fds(os.getpid()),
                "daemon_fds": max((open_fds(p) for p in self._pids), default=0)}

    async def _sample(self) -> None:
        while True:
            self._peak = {k: max(v, self._peak[k]) for k, v in self._now().items()}
            await asyncio.sleep(0.2)

    def take(self) -> dict[str, float]:
        peak = {k: max(v, self._peak[k]) for k, v in self._now().items()}
        self._peak = self._zero()
        return {**peak, "rss_mib": round(peak["rss_mib"], 1)}

    def stop(self) -> None:
        self._task.cancel()


async def _rounds(cs: list[Collective], start: int, count: int, numel: int,
                  failed: list[str] | None = None, done: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds each of `count` rounds took. A round some peer did not commit raises, unless `failed`
    is given: then its reasons are appended there (a flood may make rounds fail, not only slow them)
    and its time, which the swarm lost, still counts."""
    ids = [c.me for c in cs]
    g = torch.Generator().manual_seed(start)
    deltas = [torch.randn(numel, generator=g) for _ in cs]
    seconds = []
    for r in range(start, start + count):
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.run_round(RoundKey(r), "d" * 16, ids, d) for c, d in zip(cs, deltas)))
        seconds.append(time.perf_counter() - t0)
        done()
        if not all(o.committed for o in outs):
            why = f"round {r} did not commit: {[o.reason for o in outs]}"
            if failed is None:
                raise RuntimeError(why)
            failed.append(why)
    return seconds


def run(setup: FloodSetup, progress: Callable[[str], None] = print,
        tick: Callable[[float, float | None, str | None], None] | None = None) -> dict[str, Any]:
    """The benchmark (see the module docstring); `progress` gets a line per phase, `tick(done, total,
    status)` the rounds run so far (warm-up included) and the phase."""
    secret = new_secret()
    total = 3 + 3 * setup.rounds
    ran = [0]

    def phase(name: str) -> Callable[[], None]:
        def one_round() -> None:
            ran[0] += 1
            if tick is not None:
                tick(ran[0], total, name)
        if tick is not None:
            tick(ran[0], total, name)
        return one_round

    ours, theirs = _split_cores() if setup.pin else (set(), set())
    saved = os.sched_getaffinity(0)

    async def main() -> dict[str, Any]:
        transports, cs = await _swarm(setup, secret)
        flooders: list[subprocess.Popen[str]] = []
        try:
            addrs = [await _target(t) for t in transports]
            await _rounds(cs, 1, 3, setup.numel, done=phase("warm-up"))  # connections, allocator
            peaks = _Peaks([pid for t in transports if (pid := _daemon_pid(t))])
            peaks.take()
            quiet = await _rounds(cs, 10, setup.rounds, setup.numel, done=phase("quiet"))
            peaks_quiet = peaks.take()
            progress(f"quiet: median round {statistics.median(quiet):.3f} s")
            read_before = [sum(row[1] for row in t.counter.per_peer.values()) for t in transports]
            kind = ("stalled" if setup.stalled else "calls") + ("-data" if setup.target == "data" else "")
            mode = [kind, str(setup.stalled)] if setup.stalled else \
                [kind, str(setup.concurrency), str(setup.body_kib), str(setup.patience)]
            for _ in range(setup.flooders):
                flooders.append(subprocess.Popen(
                    [sys.executable, "-m", "diloco.bench.flood", *mode, *addrs],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                    preexec_fn=(lambda: os.sched_setaffinity(0, theirs)) if setup.pin else None))
            for p in flooders:  # each prints a line once it floods (its calls started, or its streams open)
                assert p.stdout is not None
                line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
                if not line:
                    raise RuntimeError("a flooder exited before it started (run `python -m diloco.bench.flood` "
                                       "by hand to see why)")
                progress(f"flooder: {line.strip()}")
            if not setup.stalled:
                await asyncio.sleep(2)  # calls flowing, the tarpit holding
            failed: list[str] = []
            flooded = await _rounds(cs, 100, setup.rounds, setup.numel, failed,
                                    done=phase(f"flooded by {setup.flooders} processes"))
            peaks_flooded = peaks.take()
            peaks.stop()
            progress(f"flooded: median round {statistics.median(flooded):.3f} s")
            counts = []
            for p in flooders:
                p.send_signal(signal.SIGTERM)
                out, _ = await asyncio.to_thread(p.communicate, timeout=30)
                counts.append(json.loads(out.strip().splitlines()[-1]))
            await asyncio.sleep(1)  # handlers of the last flooding calls finish
            guards = [t.guard for t in transports if t.guard is not None]
            refused = sum(g.refused["unauthorized" if setup.target == "libp2p" else "data_unauthorized"]
                          for g in guards)
            swarm_ids = {t.peer_id for t in transports}
            from_flooders = sum(row[1] for t in transports for p, row in t.counter.per_peer.items()
                                if p not in swarm_ids)
            after = await _rounds(cs, 200, setup.rounds, setup.numel, done=phase("quiet again"))
            progress(f"quiet again: median round {statistics.median(after):.3f} s")
            baseline = statistics.median(quiet + after)
            return {
                "setup": asdict(setup),
                "median_round_s": {"quiet": statistics.median(quiet), "flooded": statistics.median(flooded),
                                   "quiet_again": statistics.median(after)},
                "flooded_over_quiet": statistics.median(flooded) / baseline,
                "flood_calls": sum(c.get("calls", 0) for c in counts),
                "flood_calls_per_s": sum(c.get("calls", 0) / c["seconds"] for c in counts),
                "stalled_opened": sum(c.get("opened", 0) for c in counts),
                "stalled_cut_seen_by_flooders": sum(c.get("cut", 0) for c in counts),
                "streams_cut": {reason: sum(g.refused[reason] for g in guards)
                                for reason in ("slow_head", "too_many_streams")},
                "refused_unauthorized": refused,
                "refused": {reason: n for reason in REFUSALS if (n := sum(g.refused[reason] for g in guards))},
                "rounds_via_libp2p": sum(sum(t.fallbacks.values()) for t in transports
                                         if isinstance(t, DirectTransport)),
                "refusals_held": sum(g.tarpit.held_total for g in guards),
                "bytes_read_from_flooders": from_flooders,
                "bytes_read_before_flood": sum(read_before),
                "rejections_reaching_collective": sum(sum(c.rejections.values()) for c in cs),
                "daemon_rss_peak_mib": {"quiet": peaks_quiet["rss_mib"], "flooded": peaks_flooded["rss_mib"]},
                "fds_peak": {"quiet": {k: v for k, v in peaks_quiet.items() if k != "rss_mib"},
                             "flooded": {k: v for k, v in peaks_flooded.items() if k != "rss_mib"}},
                "flooded_rounds_failed": failed,
            }
        finally:
            for p in flooders:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for t in transports:
                await t.close()

    if setup.pin:  # this process and the daemons it starts (they inherit it) run on our half only
        os.sched_setaffinity(0, ours)
    try:
        report = asyncio.run(main())
    finally:
        os.sched_setaffinity(0, saved)
    report["cores"] = {"swarm": sorted(ours), "flooders": sorted(theirs)} if setup.pin else None
    return report


def markdown(report: dict[str, Any]) -> str:
    m, s = report["median_round_s"], report["setup"]
    if s.get("stalled"):
        return _markdown_stalled(report)
    data = s.get("target") == "data"
    read = (f"each call a handshake proving another swarm's key, then {s['body_kib']} KiB" if data else
            f"{report['bytes_read_from_flooders']} bytes read from them (their bodies declared {s['body_kib']} KiB "
            f"each)")
    return "\n".join([
        "| phase | median round (s) |", "|---|---|",
        f"| quiet | {m['quiet']:.3f} |", f"| flooded | {m['flooded']:.3f} |", f"| quiet again | {m['quiet_again']:.3f} |",
        "",
        f"flooded / quiet: {report['flooded_over_quiet']:.3f}; {s['flooders']} flooders × {s['concurrency']} calls in "
        f"flight at the {'data' if data else 'libp2p'} port, {report['flood_calls']} calls "
        f"({report['flood_calls_per_s']:.0f}/s), {report['refused_unauthorized']} refused as unauthorized ("
        + f"{report['refusals_held']} of them held by the tarpit{'' if s['tarpit'] else ', off'}"
        + f"; flooders gave up on a call after {s['patience']:g} s), {read}; "
        f"{report['rejections_reaching_collective']} reached the round protocol. Peak resident memory of the "
        f"swarm's {s['peers']} daemons: {report['daemon_rss_peak_mib']['quiet']:.0f} MiB quiet, "
        f"{report['daemon_rss_peak_mib']['flooded']:.0f} MiB flooded."
        + (f" {len(report['flooded_rounds_failed'])} of {s['rounds']} flooded rounds failed: "
           f"{report['flooded_rounds_failed'][0]}" if report["flooded_rounds_failed"] else ""),
    ])


def _markdown_stalled(report: dict[str, Any]) -> str:
    m, s, fds = report["median_round_s"], report["setup"], report["fds_peak"]
    cut = report["streams_cut"]
    return "\n".join([
        "| phase | median round (s) | fds of the swarm's process (peak) | fds of one daemon (peak) |",
        "|---|---|---|---|",
        f"| quiet | {m['quiet']:.3f} | {fds['quiet']['swarm_process_fds']} | {fds['quiet']['daemon_fds']} |",
        f"| stalled streams | {m['flooded']:.3f} | {fds['flooded']['swarm_process_fds']} | "
        f"{fds['flooded']['daemon_fds']} |",
        f"| quiet again | {m['quiet_again']:.3f} | | |",
        "",
        f"attacked / quiet: {report['flooded_over_quiet']:.3f}; {s['flooders']} flooder(s) opened "
        f"{report['stalled_opened']} {'connections to the data port' if s.get('target') == 'data' else 'streams'} "
        f"({s['stalled']} to each of {s['peers']} peers each) and sent nothing; "
        f"the peers cut {cut['too_many_streams']} at once (too_many_streams) and {cut['slow_head']} after the "
        f"head deadline (slow_head); the flooders saw {report['stalled_cut_seen_by_flooders']} of theirs closed."
        + (f" {len(report['flooded_rounds_failed'])} of {s['rounds']} attacked rounds failed: "
           f"{report['flooded_rounds_failed'][0]}" if report["flooded_rounds_failed"] else ""),
    ])


# ---------------------------------------------------------------------- the flooder process


async def _keep_calling(calls: list[Callable[[], Awaitable[Any]]], patience: float,
                        stop: asyncio.Event) -> dict[str, Any]:
    """Each of `calls` made again and again, each given up after `patience` seconds, until `stop`: prints one line
    once they run; returns how many were made."""
    made, started = 0, time.monotonic()

    async def worker(call: Callable[[], Awaitable[Any]]) -> None:
        nonlocal made
        while not stop.is_set():
            try:
                await asyncio.wait_for(call(), patience)
            except Exception:  # noqa: BLE001 - refusals and resets are the point
                pass
            made += 1

    tasks = [asyncio.create_task(worker(call)) for call in calls]
    print(json.dumps({"flooding": len(tasks)}), flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"calls": made, "seconds": time.monotonic() - started}


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _hold_open(opens: list[Callable[[], Awaitable[Stream]]], stop: asyncio.Event) -> dict[str, Any]:
    """Open every one of `opens` (64 at a time), send nothing, hold them until `stop`. Prints one line once they are
    open, then `{"cut": N}` each time the count the peers closed changes; returns how many opened and how many the
    peers closed."""
    held: list[Stream] = []
    failed, started = 0, time.monotonic()
    limit = asyncio.Semaphore(64)

    async def open_one(open_: Callable[[], Awaitable[Stream]]) -> None:
        nonlocal failed
        async with limit:
            try:
                held.append(await asyncio.wait_for(open_(), 30))
            except Exception:  # noqa: BLE001 - a stream the peer (or its daemon) would not open is not held
                failed += 1

    try:
        await asyncio.gather(*(open_one(o) for o in opens))
        print(json.dumps({"opened": len(held), "failed": failed,
                          "seconds_to_open": round(time.monotonic() - started, 2)}), flush=True)
        cut = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            if (now := sum(reader.at_eof() for reader, _ in held)) != cut:
                cut = now
                print(json.dumps({"cut": cut}), flush=True)
        return {"opened": len(held), "failed": failed, "cut": cut, "seconds": time.monotonic() - started}
    finally:
        for _, writer in held:
            writer.close()


async def _flooder_daemon(addrs: list[str]) -> tuple[Any, Any]:
    """A flooder's own libp2p daemon, dialed into the swarm at `addrs`, and the reaper that ends it with us."""
    from diloco.comms.p2p import P2PTransport
    from diloco.peers.reaper import Reaper

    t = await P2PTransport.create(initial_peers=addrs)
    reaper = Reaper()  # our daemon dies with us, however we end
    t.watched_by(reaper)
    return t, reaper


async def _flood(concurrency: int, body_kib: int, patience: float, addrs: list[str],
                 stop: asyncio.Event) -> dict[str, Any]:
    """Calls with a wrong secret to every peer's contribution handler, `concurrency` in flight a peer."""
    t, reaper = await _flooder_daemon(addrs)
    try:
        wrong = Guard(new_secret(), RUN, t.peer_id)
        targets = [PeerId(a.rsplit("/p2p/", 1)[1]) for a in addrs]
        body = os.urandom(body_kib << 10)
        frames = {p: wrong.seal_request("diloco.contrib", p, body).data for p in targets}  # one each, resent
        return await _keep_calling([partial(t.call, p, "diloco.contrib", frames[p], patience)
                                    for p in targets for _ in range(concurrency)], patience, stop)
    finally:
        await t.close()
        reaper.close()


async def _stranger_call(host: str, port: int, peer: str, me: Identity, key: bytes, body: bytes) -> None:
    """One call of a stranger at a data port: a handshake proving `key` (another swarm's), sent whole even though
    the server's own proof already failed for us (so the server does all its work), then `body`, until the server
    closes the connection."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=_source(host))
    try:
        await stranger_handshake(reader, writer, me, key, body=body)
        while await reader.read(1 << 16):
            pass
    finally:
        writer.close()


async def stranger_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: Identity, key: bytes, *,
                             claim: str | None = None, body: bytes = b"") -> None:
    """A client's side of the data port's handshake done by hand, as a stranger would: `me` signs, `claim` is the
    peer id it says it has (default: `me`'s), `key` the run key it derives with (another swarm's, say); it sends
    its finish, then `body`, whatever the server proved (so the server does all its work)."""
    own = X25519PrivateKey.generate()
    hello = dp.client_hello(dp._public(own), os.urandom(16), claim or me.peer_id)
    writer.write(hello)
    head = await reader.readexactly(4 + 32 + 1)
    named = await reader.readexactly(head[-1] + 96)
    t = dp.transcript(hello, head[4:36], named[:head[-1]].decode(errors="replace"))
    keys = dp.Keys.derive(own, head[4:36], key, t)
    writer.write(me.sign(dp._signed("client", t)) + keys.proof(b"C", t) + body)
    await writer.drain()


def _source(host: str) -> tuple[str, int] | None:
    """Where a flooder's connections to `host` come from: on loopback another address than the swarm's own
    (127.0.0.2), as an attacker's machine would have; the data port's caps count callers by address, and the
    swarm's members call each other from 127.0.0.1."""
    return ("127.0.0.2", 0) if host.startswith("127.") else None


def _data_targets(addrs: list[str]) -> list[tuple[str, int, str]]:
    """(host, port, peer id) of each `host:port/peer id`."""
    out = []
    for a in addrs:
        where, peer = a.rsplit("/", 1)
        address = parse_address(where)
        assert address is not None, a
        out.append((address[0], address[1], peer))
    return out


async def _flood_data(concurrency: int, body_kib: int, patience: float, addrs: list[str],
                      stop: asyncio.Event) -> dict[str, Any]:
    """`_flood` at the data ports: strangers' handshakes (`_stranger_call`), `concurrency` in flight a peer."""
    me = Identity.generate()
    key = Guard(new_secret(), RUN, PeerId(me.peer_id)).data_key  # another swarm's
    body = os.urandom(body_kib << 10)
    return await _keep_calling([partial(_stranger_call, host, port, peer, me, key, body)
                                for host, port, peer in _data_targets(addrs) for _ in range(concurrency)],
                               patience, stop)


async def _stall_data(connections: int, addrs: list[str], stop: asyncio.Event) -> dict[str, Any]:
    """`_stall` at the data ports: `connections` TCP connections to each, nothing sent on them."""
    return await _hold_open([partial(asyncio.open_connection, host, port, local_addr=_source(host))
                             for host, port, _ in _data_targets(addrs) for _ in range(connections)], stop)


async def _stall(streams: int, addrs: list[str], stop: asyncio.Event) -> dict[str, Any]:
    """`streams` streams to each peer's contribution handler, nothing sent on them (`_hold_open`)."""
    from hivemind.p2p import PeerID

    t, reaper = await _flooder_daemon(addrs)

    async def stream(peer: str) -> Stream:
        _, reader, writer = await t.p2p.call_binary_stream_handler(PeerID.from_base58(peer), "diloco.contrib")
        return reader, writer

    try:
        return await _hold_open([partial(stream, a.rsplit("/p2p/", 1)[1]) for a in addrs for _ in range(streams)],
                                stop)
    finally:
        await t.close()
        reaper.close()


def _flooder_main(argv: list[str]) -> None:
    """`calls CONCURRENCY BODY_KIB PATIENCE ADDR...` or `stalled STREAMS ADDR...` (libp2p addresses), or
    `calls-data`/`stalled-data` with the same arguments and data ports (`host:port/peer id`); the last line printed
    (on SIGTERM) is a JSON summary."""
    mode, args = argv[0], argv[1:]

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        if mode.startswith("stalled"):
            result = await (_stall_data if mode == "stalled-data" else _stall)(int(args[0]), args[1:], stop)
        else:
            result = await (_flood_data if mode == "calls-data" else _flood)(int(args[0]), int(args[1]),
                                                                             float(args[2]), args[3:], stop)
        print(json.dumps(result), flush=True)

    asyncio.run(main())


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    _flooder_main(sys.argv[1:])
