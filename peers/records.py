"""Peer records: who is in the swarm, published with a time-to-live (heartbeats).

Each peer keeps one record in a shared directory under its run's namespace and refreshes it every
`heartbeat_interval` seconds with an expiration `heartbeat_ttl` ahead; a peer that stops
refreshing (crashed, partitioned) disappears when its record expires. A peer that leaves on
purpose publishes `status="left"` so others drop it at once.

Two directories implement the same two calls (`publish`, `read`):
- `DHTDirectory`: hivemind's Kademlia DHT (`DHTNode`) running on the peer's own libp2p daemon; what
  it reads also tells the daemon where the peers it names can be dialed (`comms/introduce.py`).
- `InProcBoard`: a dict with expirations, for in-process swarms (tests, simulation).

Records read from the network are validated field by field; malformed ones are dropped and
counted, never trusted. In the DHT, each record is signed by its writer, and records that are not
(under another peer's id, re-stored with a forged expiration) are neither stored nor read by anyone
(`peers/signing.py`); with an allowlist, records of unlisted peers are not read.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from diloco.comms import PeerId
from diloco.comms.dataplane import parse_address

if TYPE_CHECKING:
    from diloco.comms.identity import Identity
    from diloco.comms.introduce import Introducer

    from .signing import SignedRecords

STATUSES = ("joining", "training", "standby", "left")
REGION = re.compile(r"[A-Za-z0-9_.-]{1,32}")
"""A region's name (`--region`): letters, digits, `_.-`, at most 32 characters."""


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    peer: PeerId
    status: str
    """joining (fetching state), training (takes part in rounds), standby (holds and serves the state but takes
    no part in rounds: a region's members other than its representative, in the swarm's records;
    `diloco.regions`) or left (gone on purpose)."""
    round: int
    """Committed rounds of the global state this peer holds."""
    attempt: int = 0
    """Failed exchange attempts at this round (see RoundKey)."""
    digest: str = ""
    """Short digest of the peer's global state at `round`."""
    step: int = 0
    """Inner steps taken so far."""
    loss: float | None = None
    """Latest inner training loss."""
    addrs: tuple[str, ...] = ()
    """Multiaddresses others can dial."""
    beat: float = 0.0
    """Unix time of the heartbeat that published this record (the peer's clock)."""
    recent: tuple[tuple[int, str], ...] = ()
    """The last few (round, digest) states this peer held, newest last: a peer catching up can check a
    state that moved on after it read this record (`peers.membership.vouched`)."""
    banned: tuple[PeerId, ...] = ()
    """Peers this peer banned for the run (robust aggregation); a peer a majority bans is left out by
    everyone, including peers that joined after the ban (`peers.membership.banned_by_majority`)."""
    bytes_sent: int = 0
    """Bytes this peer has sent so far, every message included (for `diloco status`: bandwidth)."""
    bytes_received: int = 0
    """Bytes it has received so far."""
    utilization: float | None = None
    """Its compute utilization so far, in [0, 1] (None before its first inner steps)."""
    round_steps: int | None = None
    """Inner steps its last round's Δ covered: H, or with rounds by time what its machine managed, which is the
    weight of its Δ in the round's means (None before its first round)."""
    step_seconds: float | None = None
    """Its inner step's duration, a moving average (with rounds by time; None otherwise or before it timed one):
    adaptive rounds (`DiLoCo(adaptive=True)`) last H steps of the swarm's fastest worker, read from these."""
    region: str = ""
    """The region this peer trains in (`--region`; "" in a flat swarm): a global round's quorum counts regions."""
    data: str = ""
    """host:port of its data port (`diloco.comms.dataplane`), where members call it directly; "" when it has
    none (then it is called through libp2p)."""
    libp2p: tuple[PeerId, ...] = ()
    """Members this peer's last call reached through libp2p instead of their data port (unknown or unreachable):
    `diloco status` shows which pairs do not go direct."""
    relay: bool = False
    """It serves as a relay for members that cannot be dialed (`--relay`, `diloco.comms.relay`)."""
    via: tuple[PeerId, ...] = ()
    """The relays where it keeps connections waiting (its data port cannot be dialed): members call it through
    one of them."""
    relayed: tuple[PeerId, ...] = ()
    """Members this peer's last call reached through a relay (`diloco status`)."""
    ends: int = 0
    """The round the run ends at, once one was announced (0: none): every peer launches no round past the lowest a
    member announces (`diloco.ending`)."""

    def digests_at(self, rnd: int) -> set[str]:
        """The digests this record shows for round `rnd`: its state now, or among its `recent` states."""
        return {d for n, d in ((self.round, self.digest), *self.recent) if n == rnd and d}

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["addrs"] = list(self.addrs)
        out["recent"] = [list(x) for x in self.recent]
        out["banned"] = list(self.banned)
        out["libp2p"] = list(self.libp2p)
        out["via"] = list(self.via)
        out["relayed"] = list(self.relayed)
        return out


MAX_RECENT = 8  # longest `recent` accepted from the network
MAX_BANNED = 64  # longest `banned` accepted from the network
MAX_BYTES = 1 << 62  # largest byte counter accepted from the network (msgpack packs it in 9 bytes)
MAX_STEP_SECONDS = 86400.0  # longest inner step accepted from the network
MAX_VIA = 4  # relays read from a record at most
MAX_ROUND = 1 << 53  # largest announced end accepted from the network


def _display_fields(value: dict[str, Any]) -> dict[str, Any]:
    """The fields `diloco status` shows (bandwidth, utilization, steps and step time): a value that is missing (a
    peer of an older version) or malformed is taken as unknown; the record itself stays valid, since no state the
    swarm commits depends on these (an adaptive round's length reads `step_seconds` within a bound, `diloco.pace`)."""
    out: dict[str, Any] = {}
    for name in ("bytes_sent", "bytes_received"):
        v = value.get(name, 0)
        out[name] = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BYTES else 0
    n = value.get("round_steps")
    out["round_steps"] = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 10**12 else None
    t = value.get("step_seconds")
    out["step_seconds"] = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and \
        0 < t <= MAX_STEP_SECONDS else None
    u = value.get("utilization")
    if isinstance(u, (int, float)) and not isinstance(u, bool) and math.isfinite(u) and 0.0 <= u <= 1.0:
        out["utilization"] = float(u)
    else:
        out["utilization"] = None
    return out


def _parse_peers(value: Any) -> tuple[PeerId, ...] | None:
    """A list of peer ids from the network (a ban list, the members reached through libp2p), or None if malformed."""
    if not isinstance(value, list) or len(value) > MAX_BANNED:
        return None
    if not all(isinstance(p, str) and 0 < len(p) <= 128 for p in value):
        return None
    return tuple(PeerId(p) for p in value)


def _parse_recent(value: Any) -> tuple[tuple[int, str], ...] | None:
    if not isinstance(value, list) or len(value) > MAX_RECENT:
        return None
    out = []
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            return None
        rnd, digest = item
        if not (isinstance(rnd, int) and not isinstance(rnd, bool) and rnd >= 0 and isinstance(digest, str)
                and 0 < len(digest) <= 64):
            return None
        out.append((rnd, digest))
    return tuple(out)


def parse_record(peer: str, value: Any) -> PeerRecord | None:
    """A record from the network, or None if anything about it is malformed."""
    if not isinstance(value, dict):
        return None
    try:
        status, rnd, attempt = value["status"], value["round"], value.get("attempt", 0)
        digest, step, loss = value.get("digest", ""), value.get("step", 0), value.get("loss")
        addrs, beat = value.get("addrs", []), value.get("beat", 0.0)
        recent = _parse_recent(value.get("recent", []))
        banned = _parse_peers(value.get("banned", []))
        region = value.get("region", "")
        data = value.get("data", "")
        libp2p = _parse_peers(value.get("libp2p", [])) or ()  # peer ids, as a ban list is: malformed means none
        relayed = _parse_peers(value.get("relayed", [])) or ()
        via = _parse_peers(value.get("via", [])) or ()  # malformed: none (it is called on its data port, or libp2p)
        relay = value.get("relay", False) is True
        ends = value.get("ends", 0)
    except (KeyError, TypeError):
        return None
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rnd, attempt, step))
    loss_ok = loss is None or (isinstance(loss, (int, float)) and math.isfinite(loss))
    addrs_ok = isinstance(addrs, list) and len(addrs) <= 16 and all(isinstance(a, str) and len(a) < 512 for a in addrs)
    beat_ok = isinstance(beat, (int, float)) and not isinstance(beat, bool) and math.isfinite(beat) and beat >= 0
    if not (status in STATUSES and ints_ok and loss_ok and addrs_ok and beat_ok and isinstance(digest, str)
            and len(digest) <= 64 and recent is not None and banned is not None
            and (region == "" or isinstance(region, str) and REGION.fullmatch(region))):
        return None
    if value.get("peer", peer) != peer:
        return None
    if not (isinstance(ends, int) and not isinstance(ends, bool) and 0 <= ends <= MAX_ROUND):
        ends = 0  # malformed: no end announced (an end ends everyone's run: only a well-formed one counts)
    if not (isinstance(data, str) and len(data) <= 300 and (data == "" or parse_address(data) is not None)):
        data = ""  # a data address that is not one: the peer is called through libp2p, the record stays valid
    return PeerRecord(peer=PeerId(peer), status=status, round=rnd, attempt=attempt, digest=digest,
                      step=step, loss=None if loss is None else float(loss), addrs=tuple(addrs), beat=float(beat),
                      recent=recent, banned=banned, region=region, data=data, libp2p=libp2p, relay=relay,
                      via=via[:MAX_VIA], relayed=relayed, ends=ends, **_display_fields(value))


class Directory(Protocol):
    dropped: Counter[str]

    async def publish(self, record: PeerRecord, ttl: float) -> None: ...

    async def read(self) -> list[PeerRecord]: ...

    async def reach(self, records: list[PeerRecord]) -> int: ...

    async def close(self) -> None: ...


class InProcBoard:
    """An in-process directory shared by in-process peers. Uses the monotonic clock."""

    def __init__(self) -> None:
        self._records: dict[PeerId, tuple[float, dict[str, Any]]] = {}
        self.dropped: Counter[str] = Counter()
        self._scopes: dict[str, InProcBoard] = {}

    def scoped(self, scope: str) -> InProcBoard:
        """The board of another namespace of the same swarm (a region's records): one per scope, shared by
        every peer that holds this board."""
        return self._scopes.setdefault(scope, InProcBoard())

    async def publish(self, record: PeerRecord, ttl: float) -> None:
        self._records[record.peer] = (time.monotonic() + ttl, record.to_wire())

    async def read(self) -> list[PeerRecord]:
        now = time.monotonic()
        out = []
        for peer, (expires, value) in list(self._records.items()):
            rec = parse_record(peer, value) if expires > now else None
            if rec is not None:
                out.append(rec)
        return out

    async def reach(self, records: list[PeerRecord]) -> int:
        """Nothing to join: every in-process peer reads the one board."""
        return 0

    async def close(self) -> None:
        pass

    def expire(self, peer: str) -> None:
        """Forget a peer's record at once (its heartbeat stopped long ago)."""
        self._records.pop(PeerId(peer), None)


class DHTDirectory:
    """Records under the DHT key `diloco/<run_id>/peers`, one subkey per peer id. `records` is the
    validator that signs ours and refuses forged ones (`peers/signing.py`); its refusals and ours are
    counted together in `dropped`. `allow`: if given, only these peers' records (and ours) are read."""

    def __init__(self, node: Any, run_id: str, records: SignedRecords | None = None,
                 allow: frozenset[str] | None = None, introducer: Introducer | None = None) -> None:
        from .signing import SignedRecords

        self.node = node
        self.run_id = run_id
        self.introducer = introducer
        """Connects our daemon to the peers we read about (`comms/introduce.py`); None for an observer."""
        self.key = f"diloco/{run_id}/peers"
        self.records = records if records is not None else SignedRecords(None)
        self.dropped: Counter[str] = self.records.rejected
        self._expiration = 0.0
        """Of the last record we published (`publish`)."""
        me = self.records.identity
        self.allow = None if allow is None else allow | ({me.peer_id} if me is not None else set())

    @classmethod
    async def create(cls, p2p: Any, run_id: str, initial_peers: list[str], client_mode: bool = False,
                     authorizer: Any = None, identity: Identity | None = None,
                     allow: frozenset[str] | None = None) -> DHTDirectory:
        """`client_mode`: read and write records without storing others' (an observer, e.g. `diloco status`).
        `authorizer` (`diloco.comms.auth.HmacAuthorizer`): sign our DHT requests and answers, and ignore
        nodes that cannot sign theirs (they lack the swarm secret). `identity`: the key our record is
        signed with (the transport's; a reader needs none). `allow` filters what we read, not what our
        node stores: a node that refused other signed records would make hivemind drop its peers' whole
        answers wherever allowlists differ, e.g. while one is updated."""
        from hivemind.dht.node import DHTNode

        from .signing import SignedRecords

        from diloco.comms.introduce import Introducer

        records = SignedRecords(identity)
        node = await DHTNode.create(p2p=p2p, initial_peers=initial_peers or None, num_workers=4,
                                    cache_locally=False, ensure_bootstrap_success=bool(initial_peers),
                                    client_mode=client_mode, authorizer=authorizer, record_validator=records)
        introducer = None if client_mode else Introducer(p2p, p2p.peer_id.to_base58())
        return cls(node, run_id, records, allow, introducer)

    async def publish(self, record: PeerRecord, ttl: float) -> None:
        """Store our record for `ttl` seconds of the swarm's time. Its expiration is also its version (a node keeps
        the entry that expires last), so it never goes back: after our clock stepped back by less than
        `comms.clock.DEADBAND` (a step that the swarm's clock leaves alone), a record expires just after the last one,
        or it would be ignored until then and the others would read our older state."""
        from hivemind.utils import get_dht_time

        expiration = max(get_dht_time() + ttl, self._expiration + 1e-3)
        self._expiration = expiration
        await self.node.store(self.key, record.to_wire(), expiration, subkey=record.peer)

    async def read(self) -> list[PeerRecord]:
        found = await self.node.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for peer, item in found.value.items():
            if isinstance(peer, str) and self.allow is not None and peer not in self.allow:
                self.records.refuse(peer, "not_allowed")
                continue
            rec = parse_record(peer, getattr(item, "value", None)) if isinstance(peer, str) else None
            if rec is None:
                self.dropped["malformed_record"] += 1
            else:
                out.append(rec)
        if self.introducer is not None:
            self.introducer.meet(out)
        return out

    async def reach(self, records: list[PeerRecord], timeout: float = 5.0) -> int:
        """Ping the DHT nodes of peers we miss in our reads into our node's routing table, and ours into theirs;
        returns how many answered. A record's addresses are dialed first (a record without any: a peer our daemon
        has a connection to, which called us).

        A DHT node only meets the nodes its lookups and callers lead it to. One whose routing table ended up holding
        only peers of its own group (woken from a freeze after the others dropped it, restarted through peers that
        then left, and whoever bootstrapped through it) stores and reads records within that group alone: an
        island that never sees the rest of the swarm, nor they it. One answered ping joins the two tables, and the
        next heartbeat's store and read span both."""
        from hivemind.p2p import PeerID

        from diloco.comms.introduce import connect

        p2p = self.node.protocol.p2p

        async def ping(record: PeerRecord) -> bool:
            if record.addrs:
                try:
                    await connect(p2p, record.peer, record.addrs, timeout)  # our daemon may have forgotten where
                except Exception:  # noqa: BLE001 - the ping says whether it can be reached
                    pass
            try:
                return await asyncio.wait_for(self.node.protocol.call_ping(PeerID.from_base58(record.peer)),
                                              timeout) is not None
            except Exception:  # noqa: BLE001 - an unreachable peer is no error here
                return False

        answered = await asyncio.gather(*(ping(r) for r in records))
        return sum(answered)

    def scoped(self, scope: str) -> DHTDirectory:
        """Records of another namespace of the same run (a region's: key `diloco/<run_id>/<scope>/peers`) on
        this directory's DHT node, signed and filtered alike; closing it leaves the node to this directory."""
        inner = DHTDirectory(self.node, f"{self.run_id}/{scope}", self.records, None, self.introducer)
        inner.allow = self.allow
        inner.owner = False
        return inner

    owner = True
    """Whether `close` shuts the DHT node down (False for a `scoped` view of another directory's node)."""

    async def close(self) -> None:
        if not self.owner:
            return
        if self.introducer is not None:
            await self.introducer.close()
        await self.node.shutdown()
