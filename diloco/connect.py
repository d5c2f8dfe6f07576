"""Bringing one peer up on the network: its libp2p daemon under its identity, the swarm's directory (hivemind's
DHT, signed records), the credential on every call, the data plane (`diloco.comms.dataplane`), and the round
collective, then the join handshake with the peer dialed (`diloco.comms.hello`). `start` brings up a first peer;
`join` dials the bootstrap addresses given, each a few times, and says why each failed. Both return a `Connection`,
which `Swarm.start` / `Swarm.join` wrap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from diloco.comms import Collective, PeerId, Transport
from diloco.comms import hello as hs
from diloco.comms.auth import HELLO, AuthRefused, new_secret
from diloco.comms.clock import SWARM_CLOCK, use_in_hivemind
from diloco.comms.dataplane import DataConfig, DirectTransport
from diloco.comms.faults import NO_FAULTS, Faults
from diloco.comms.relay import attach as attach_relays
from diloco.comms.hello import HandshakeError
from diloco.comms.identity import Identity, IdentityError
from diloco.comms.loop import LoopThread
from diloco.compression.errors import DiLoCoError
from diloco.peers import Directory

from .config import SwarmConfig

log = logging.getLogger(__name__)

JOIN_PASSES, JOIN_PAUSE = 3, 2.0  # tries of every bootstrap address, and the growing pause between passes
HELLO_SECONDS = 10.0  # a `hello` waits for its answer at most this long (or the round's call timeout, if shorter)
HANDSHAKE_TRIES = 3
"""Passes of the schema handshake (`handshake`) while none of the peers we dialed answers: they answered our join
moments before, so a pass with no answer is a loaded machine's. After the last, our first round asks its own peers
before it sends them anything (a wrong model that skipped the comparison once trained alone, refused by every
member's frame checks, and exited 0)."""


def handshake_seconds(cfg: SwarmConfig) -> float:
    """The longest `handshake` can take: every pass's `hello` waiting out its answer."""
    return HANDSHAKE_TRIES * (min(cfg.round.call_timeout, HELLO_SECONDS) + 1)


class SwarmError(DiLoCoError, RuntimeError):
    """The swarm could not be started or joined, or could not do what was asked; the message says what was tried
    and what to do."""


@dataclass
class Connection:
    """A peer up on the network: what a `Swarm` runs on."""

    loop: LoopThread
    transport: Transport
    directory: Directory
    collective: Collective
    cfg: SwarmConfig
    """The configuration as used (with the secret `start` created, if none was given)."""
    addresses: list[str]
    """Our addresses as the others can dial them."""
    finish: Callable[[], None]
    """Shuts the directory, the transport and the daemon down (bounded, never raises) and releases the identity."""
    initial: list[str]
    """The bootstrap address that worked (none for `start`)."""


def start(cfg: SwarmConfig, *, host: str = "127.0.0.1", port: int = 0,
          announce: list[str] | None = None, faults: Faults = NO_FAULTS) -> Connection:
    """Start a new swarm (or a peer no one has dialed yet) listening on host:port. `faults`: fault
    hooks for tests and chaos runs (`diloco.comms.faults`; by default none)."""
    identity = identity_of(cfg)
    try:
        return _open(cfg, [], host, port, announce, identity, faults)
    except BaseException:
        identity.release()
        raise


def join(initial_peers: list[str], cfg: SwarmConfig, *, host: str = "127.0.0.1", port: int = 0,
         announce: list[str] | None = None, faults: Faults = NO_FAULTS) -> Connection:
    """Join the swarm reachable at any of `initial_peers`, tried in order (`faults` as in `start`).

    Raises:
        SwarmError: no address given, no secret in `cfg`, an address that is not a swarm multiaddress, or
            none of them answered after a few tries each (the message lists each address and why).
        HandshakeError: the swarm answered and refused us (another run id or protocol version)."""
    if not initial_peers:
        raise SwarmError("join needs at least one address, e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo…")
    if cfg.secret is None:
        raise SwarmError("joining needs the swarm's secret: SwarmConfig(secret=...); on the command line "
                         "--secret-file PATH (the file `diloco start` wrote) or the DILOCO_SECRET variable")
    tried, refused, identity = [], False, identity_of(cfg)
    try:
        # A dial can fail for a moment (a peer busy with a round, a loaded machine, a lost SYN): every
        # address gets JOIN_PASSES tries, a few seconds apart, before the join gives up.
        for attempt in range(JOIN_PASSES):
            if attempt:
                time.sleep(JOIN_PAUSE * attempt)
            for addr in initial_peers:
                try:
                    return _open(cfg, [addr], host, port, announce, identity, faults)
                except HandshakeError:
                    raise  # the swarm answered and said no: another address would say the same
                except Exception as e:  # noqa: BLE001 - any failure to bootstrap means "try the next address"
                    refused = refused or isinstance(e, AuthRefused)  # answered, but not a setting (REFUSED_FIELD)
                    tried.append(f"{addr} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                    log.warning("event=bootstrap_failed addr=%s attempt=%d reason=%s", addr, attempt + 1, e)
        if refused:
            raise SwarmError(f"could not join the swarm; no bootstrap address let us in ({JOIN_PASSES} tries each):"
                             "\n  " + "\n  ".join(tried) + "\nA peer that refused our calls gave its reason above "
                             "(docs/TROUBLESHOOTING.md lists each); it was not our secret or the allowlist.")
        raise SwarmError(f"could not join the swarm; no bootstrap address answered ({JOIN_PASSES} tries each):\n  "
                         + "\n  ".join(tried) +
                         "\nCheck the address (copy it from the `diloco start` output) and that the peer is up: a "
                         "swarm whose peers all finished their run (a short one, started without --wait-for N) "
                         "is gone, and its address answers nothing.")
    except BaseException:
        identity.release()  # only a swarm that started owns it (and releases it when it closes)
        raise


def _open(cfg: SwarmConfig, initial: list[str], host: str, port: int,
          announce: list[str] | None, identity: Identity, faults: Faults) -> Connection:
    """A peer whose daemon runs under `identity` (its key also signs our directory records)."""
    from diloco.comms.auth import HmacAuthorizer
    from diloco.comms.p2p import P2PTransport
    from diloco.peers import DHTDirectory
    from diloco.peers.reaper import Reaper

    validate_addrs(initial)
    if cfg.secret is None:
        cfg = replace(cfg, secret=new_secret())
    loop = LoopThread()
    reaper = Reaper()
    proto = "ip6" if ":" in host else "ip4"

    async def build() -> tuple[Transport, DHTDirectory, Collective, list[str]]:
        p2p = await P2PTransport.create(initial_peers=initial, host_maddrs=[f"/{proto}/{host}/tcp/{port}"],
                                        announce_maddrs=announce, max_message=cfg.round.max_payload + (1 << 20),
                                        identity=identity)
        p2p.watched_by(reaper)
        p2p.guard = cfg.guard(p2p.peer_id)
        transport: Transport = p2p
        use_in_hivemind(SWARM_CLOCK.now)  # the directory reads the swarm's time (comms.clock)
        try:
            offsets = []
            for addr in initial:  # before the DHT: a peer that must not join learns why at once
                offset = await hello(p2p, peer_of(addr), cfg, "")
                offsets += [] if offset is None else [offset]
            SWARM_CLOCK.adopt(offsets)  # a joiner whose clock is off takes the swarm's time
            directory = await asyncio.wait_for(DHTDirectory.create(
                p2p.p2p, cfg.run_id, initial, authorizer=HmacAuthorizer(cfg.secret or "", cfg.run_id),
                identity=identity, allow=frozenset(cfg.allow_peers) or None), 30)
            addresses = await p2p.visible_addresses()
            if cfg.data_port is not None:
                direct = DirectTransport(p2p, identity, DataConfig(
                    host=host, port=cfg.data_port, announce=cfg.data_announce,
                    announce_host=_announce_host(host, announce, addresses), streams=cfg.data_streams),
                    p2p.max_message, inner_only=frozenset({HELLO}))
                transport = direct
                await direct.start()
                attach_relays(direct, cfg.relay_config())
            collective = await Collective.create(transport, cfg.run_id, cfg.round, faults)
        except BaseException:
            await transport.close()
            raise
        return transport, directory, collective, addresses

    try:
        transport, directory, collective, addresses = loop.run(build(), timeout=60)
    except BaseException:
        loop.stop()
        reaper.close()
        raise

    def finish() -> None:  # leaving must never fail: bound every step, log what did not finish
        for name, step, limit in (("dht", directory.close, 5), ("p2p", transport.close, 15)):
            try:
                loop.run(step(), timeout=limit)
            except Exception as e:  # noqa: BLE001
                log.warning("event=shutdown_step_failed step=%s reason=%s", name, e)
        try:
            reaper.close()  # kills the daemon if it is still there
        finally:
            identity.release()

    return Connection(loop, transport, directory, collective, cfg, addresses, finish, initial)


REFUSED_FIELD = {"unauthorized": "secret", "not_allowed": "allowlist"}
"""The setting a peer's refusal of our handshake points at (`comms.auth.REASONS`); any other refusal (a replay, a
malformed call) says nothing about our settings and is raised as the `AuthRefused` it is."""


async def hello(transport: Transport, peer: PeerId, cfg: SwarmConfig, schema: str) -> float | None:
    """One handshake with `peer`: how far its swarm clock reads ahead of this machine's wall clock (None when it did
    not say); raises HandshakeError on a mismatch, a refusal of our credential or a clock more than
    `MAX_CLOCK_SKEW` off, TransportError when the peer cannot be reached or refused the call for a reason that is not
    a setting (`REFUSED_FIELD`)."""
    ours = hs.hello(cfg.run_id, schema, SWARM_CLOCK.now())
    sent = SWARM_CLOCK.raw()
    try:
        reply = await transport.call(peer, HELLO, hs.pack(ours), min(cfg.round.call_timeout, HELLO_SECONDS))
    except AuthRefused as e:
        field = REFUSED_FIELD.get(e.reason)
        if field is None:  # a replay or a malformed call: not a setting of ours to fix, the call failed
            raise
        raise HandshakeError(field, "(hidden)", "(hidden)", peer) from None
    received = SWARM_CLOCK.raw()
    try:
        theirs = hs.unpack(reply)
    except ValueError as e:
        raise HandshakeError("protocol", ours["protocol"], f"unreadable ({e})", peer) from None
    field = theirs.get("field") or hs.mismatch(ours, theirs)
    if field:
        field = field if field in hs.FIELDS else "protocol"
        raise HandshakeError(field, ours[field], theirs[field], peer)
    if theirs.get("time") is None:
        return None
    offset, bound = hs.clock_offset(sent, received, float(theirs["time"]))  # their swarm time against our clock
    if abs(offset) - bound > hs.MAX_CLOCK_SKEW:
        raise hs.ClockSkew(offset, bound, hs.MAX_CLOCK_SKEW, peer)
    return offset


async def handshake(transport: Transport, peers: list[PeerId], cfg: SwarmConfig, schema: str,
                    tries: int = HANDSHAKE_TRIES) -> bool:
    """`hello` with each of `peers` at once; raises the first `HandshakeError`. Peers that do not answer are skipped
    once one of them answered; while none has, the pass is tried again, `tries` passes in all. Returns whether one
    answered (or there was nobody to ask): False leaves the comparison to our first round (`Swarm`'s `unverified`)."""
    for attempt in range(tries):
        results = await asyncio.gather(*(hello(transport, p, cfg, schema) for p in peers), return_exceptions=True)
        for r in results:
            if isinstance(r, HandshakeError):
                raise r
        if not results or any(not isinstance(r, BaseException) for r in results):
            return True
        log.warning("event=handshake_unanswered attempt=%d of=%d peers=%s", attempt + 1, tries,
                    ",".join(str(p) for p in peers))
    return False


async def on_hello(run_id: str, collective: Collective, caller: PeerId, data: bytes) -> bytes:
    """Answer a peer's `hello`: ours, and the first field that differs from its (counted and logged as a refusal)."""
    ours = hs.hello(run_id, collective.schema, SWARM_CLOCK.now())
    try:
        field = hs.mismatch(ours, hs.unpack(data))
    except ValueError as e:
        collective.rejections["bad_header"] += 1
        log.warning("event=handshake_refused peer=%s reason=%s", caller, e)
        field = "protocol"
    if field is not None:
        collective.rejections[hs.REASON[field]] += 1
        log.warning("event=handshake_refused peer=%s field=%s", caller, field)
    return hs.pack({**ours, "field": field or ""})


def identity_of(cfg: SwarmConfig) -> Identity:
    """This process's libp2p identity: kept in `cfg.identity_file` (so its peer id survives restarts),
    or a new one."""
    if cfg.identity_file is None:
        return Identity.generate()
    try:
        return Identity.load(cfg.identity_file)
    except IdentityError as e:
        raise SwarmError(str(e)) from None


def _announce_host(host: str, announce: list[str] | None, visible: list[str]) -> str:
    """The host our data address names (its port is the data port's): the first announced multiaddress's host
    (`--announce`: others dial that), else for a wildcard listening host the first visible address's that is not
    loopback, else "" (the listening host itself)."""
    def host_of(maddr: str) -> str:
        parts = maddr.split("/")
        return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else ""

    for maddr in announce or ():
        if host_of(maddr):
            return host_of(maddr)
    if host in ("0.0.0.0", "::"):
        return next((h for h in map(host_of, visible) if h and not h.startswith("127.") and h != "::1"), "")
    return ""


def peer_of(addr: str) -> PeerId:
    """The peer id at the end of a validated swarm address (…/p2p/12D3KooW…)."""
    return PeerId(addr.rsplit("/p2p/", 1)[1])


def validate_addrs(addrs: list[str]) -> None:
    """Raises `SwarmError` naming the first of `addrs` that is not a swarm multiaddress (…/p2p/<peer id>)."""
    for a in addrs:
        if not a.startswith("/") or "/p2p/" not in a:
            raise SwarmError(
                f"{a!r} is not a swarm address; it looks like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW… "
                "(copy it from the output of `diloco start`)"
            )
