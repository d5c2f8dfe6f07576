"""The swarm handle: one peer's connection to a DiLoCo swarm, for synchronous training code.

    swarm = Swarm.start(SwarmConfig(run_id="my-run"))               # the first peer (creates a secret)
    print(swarm.join_command())                                     # what to run elsewhere
    cfg = SwarmConfig(run_id="my-run", secret=swarm.cfg.secret)     # elsewhere: the same secret
    swarm = Swarm.join(["/ip4/1.2.3.4/tcp/4000/p2p/Qm…"], cfg)      # any later peer

A `Swarm` owns: a transport (hivemind's libp2p daemon, or an in-process network for tests), a
directory of peer records (hivemind's DHT, or an in-process board) refreshed by a heartbeat, the
round collective, and a handler that serves our global state to peers that need to catch up.
All asynchronous work runs on a background event loop; every public method is synchronous and
bounded by the configured timeouts.

Credentials (`diloco.comms.auth`): every call is sealed with keys derived from `SwarmConfig.secret`
(`start` creates one when none is given; `join` requires it) and the DHT answers only peers that
hold it. Joining begins with a handshake (`diloco.comms.hello`) with the peer dialed: a wrong secret,
run id or protocol version raises `HandshakeError` naming the field within one call timeout, and
`handshake(schema)` repeats it with the model's schema digest once the model is known.

Failure semantics: the peer that ran `start` is only the first address others dial; once others
joined, it may leave or crash and the swarm goes on. A bootstrap address that does not answer
is skipped for the next one given; when none answers, `join` raises `SwarmError` listing them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Collection, Coroutine, Iterator, Sequence

import torch

from diloco.comms import Collective, PeerId, RoundKey, RoundOutcome, Transport
from diloco.comms.faults import NO_FAULTS, Faults
from diloco.comms.rounds import Handoff, PiecewiseHandoff, Value
from diloco.comms.auth import HELLO
from diloco.comms.dataplane import DirectTransport, data_paths
from diloco.comms.loop import LoopThread
from diloco.comms.transport import InProcNetwork, ScopedTransport
from diloco.peers import (Directory, PeerRecord, banned_by_majority, plan_round, quorum, started_without,
                          voted_out)
from diloco.peers.membership import GroupPlan, Voters, serving
from diloco.peers.records import MAX_BANNED

from . import connect
from .config import SwarmConfig
from .connect import Connection
from .connect import SwarmError as SwarmError  # raised here too, and caught from here
from .presence import Presence
from .statesync import SnapshotProvider, StateServer

log = logging.getLogger(__name__)

class StateNotHeld(SwarmError):
    """No peer serves the state asked for right now (`diloco.statesync.NotHeld`): ask again later."""


class Banned(SwarmError):
    """A majority of the other peers banned us for this run (robust aggregation struck our contributions
    `ban_after` times): nobody takes our rounds or serves us state any more, so training on is useless."""


class Swarm:
    def __init__(self, loop: LoopThread, transport: Transport, directory: Directory, collective: Collective,
                 cfg: SwarmConfig, *, owns_loop: bool, addresses: list[str],
                 on_close: Callable[[], None] | None = None,
                 bootstrapped: bool = False, addresses_dialed: Collection[str] = ()) -> None:
        self.bootstrapped = bootstrapped
        """True when this peer joined through another peer's address (so a swarm should be visible)."""
        self.bootstrap_peers: list[PeerId] = [connect.peer_of(a) for a in addresses_dialed]
        """The peers we dialed to join: the handshake compares settings with them."""
        self.unverified = False
        """None of the peers we dialed answered the schema handshake (`handshake`): our rounds ask their own peers
        the same questions before they send them anything, until one answers (`_verify`)."""
        self.loop, self.transport, self.directory, self.collective = loop, transport, directory, collective
        self.cfg = cfg
        self.addresses = addresses
        self._owns_loop = owns_loop
        self._on_close = on_close
        self.presence = Presence(directory, cfg, PeerRecord(
            peer=self.peer_id, status="joining", round=0, addrs=tuple(addresses),
            data=transport.address if isinstance(transport, DirectTransport) else "",
            relay=cfg.relay and isinstance(transport, DirectTransport)), transport.counter)
        """Our record and the others' as we last read them (`diloco.presence`)."""
        if isinstance(transport, DirectTransport):
            transport.address_of = self.presence.data_address_of
            transport.via_of = self.presence.via_of
        self._server = StateServer(cfg.run_id, self.peer_id, collective, cfg.round.call_timeout)
        self._closed = False
        self._exchanges: set[concurrent.futures.Future[RoundOutcome]] = set()  # rounds in flight (`crash`)
        self._scopes: list[Swarm] = []  # namespaces on our connections (`scope`): they die with us
        loop.run(transport.register("diloco.manifest", self._server.on_manifest))
        loop.run(transport.register("diloco.chunk", self._server.on_chunk))
        loop.run(transport.register(HELLO, partial(connect.on_hello, cfg.run_id, collective)))
        self._heartbeat = loop.submit(self._heartbeat_loop())

    # ------------------------------------------------------------------ construction

    @classmethod
    def start(cls, cfg: SwarmConfig, *, host: str = "127.0.0.1", port: int = 0,
              announce: list[str] | None = None, faults: Faults = NO_FAULTS) -> Swarm:
        """Start a new swarm (or a peer no one has dialed yet) listening on host:port. `faults`: fault
        hooks for tests and chaos runs (`diloco.comms.faults`; by default none)."""
        return cls._over(connect.start(cfg, host=host, port=port, announce=announce, faults=faults))

    @classmethod
    def join(cls, initial_peers: list[str], cfg: SwarmConfig, *, host: str = "127.0.0.1", port: int = 0,
             announce: list[str] | None = None, faults: Faults = NO_FAULTS) -> Swarm:
        """Join the swarm reachable at any of `initial_peers`, tried in order (`faults` as in `start`).

        Raises:
            SwarmError: no address given, no secret in `cfg`, an address that is not a swarm multiaddress, or
                none of them answered after a few tries each (the message lists each address and why).
            HandshakeError: the swarm answered and refused us (another run id or protocol version)."""
        return cls._over(connect.join(initial_peers, cfg, host=host, port=port, announce=announce, faults=faults))

    @classmethod
    def _over(cls, c: Connection) -> Swarm:
        """The swarm handle of a peer brought up on the network (`diloco.connect`)."""
        return cls(c.loop, c.transport, c.directory, c.collective, c.cfg, owns_loop=True, addresses=c.addresses,
                   on_close=c.finish, bootstrapped=bool(c.initial), addresses_dialed=c.initial)

    @classmethod
    def in_process(cls, network: InProcNetwork, board: Directory, peer_id: str, cfg: SwarmConfig,
                   loop: LoopThread, *, bootstrapped: bool = False,
                   drop: Callable[[PeerId, str], bool] | None = None, faults: Faults = NO_FAULTS) -> Swarm:
        """A peer on an in-process network (tests, simulation); many peers share one `loop`. `drop(target,
        handler)` True loses that outgoing call (fault injection: a partition); `faults` as in `start`."""
        transport = network.transport(peer_id, drop)
        transport.guard = cfg.guard(peer_id)
        collective = loop.run(Collective.create(transport, cfg.run_id, cfg.round, faults))
        return cls(loop, transport, board, collective, cfg, owns_loop=False, addresses=[f"inproc:{peer_id}"],
                   bootstrapped=bootstrapped)

    def scope(self, name: str) -> Swarm:
        """Another swarm on this peer's connections: its own records (`diloco/<run_id>/<name>/peers`), rounds,
        state serving and heartbeat, under the run id `<run_id>/<name>` (frames of one are refused by the other)
        and the same credentials. A region's rounds run in one (`diloco.regions`). Closing it announces that we
        left it and closes nothing underneath."""
        scoped_dir = getattr(self.directory, "scoped", None)
        if scoped_dir is None:
            raise SwarmError(f"this swarm's directory ({type(self.directory).__name__}) has no scopes")
        cfg = replace(self.cfg, run_id=f"{self.cfg.run_id}/{name}")
        transport = ScopedTransport(self.transport, name)
        collective = self.loop.run(Collective.create(transport, cfg.run_id, cfg.round, self.collective.faults))
        inner = Swarm(self.loop, transport, scoped_dir(name), collective, cfg, owns_loop=False,
                      addresses=self.addresses, on_close=lambda: None)
        self._scopes.append(inner)
        return inner

    # ------------------------------------------------------------------ identity and records

    @property
    def peer_id(self) -> PeerId:
        return self.transport.peer_id

    def join_command(self) -> str:
        """What another machine runs to join (the secret travels separately: see the CLI's `start`)."""
        addr = next((a for a in self.addresses if "/127.0.0.1/" not in a), self.addresses[0])
        return f"diloco join {addr} --run-id {self.cfg.run_id}"

    def handshake(self, schema: str) -> None:
        """Our model's schema digest is `schema` from now on (frames with another are rejected). Compare
        protocol, run id and `schema` with the peers we dialed to join; raises `HandshakeError` naming the
        first differing field. Peers that do not answer are skipped once one answered (`connect.handshake`: a few
        passes while none has; then our first round asks its peers, `unverified`)."""
        self.collective.schema = schema
        answered = self.loop.run(connect.handshake(self.transport, self.bootstrap_peers, self.cfg, schema),
                                 timeout=connect.handshake_seconds(self.cfg) + 5)
        self.unverified = not answered

    async def _verify(self, peers: Sequence[PeerId]) -> None:
        """Our join handshake went unanswered (`unverified`): compare settings with the round's `peers` now, one pass;
        a mismatch raises `HandshakeError` out of the round (the CLI exits 1 naming the field), instead of our rounds
        going on alone, refused by every member's frame checks."""
        if self.unverified and peers and await connect.handshake(self.transport, list(peers), self.cfg,
                                                                 self.collective.schema, tries=1):
            self.unverified = False

    def update(self, *, now: bool = True, **fields: Any) -> None:
        """Change our record (status, round, attempt, digest, step, loss); publish it at once when
        `now`, else with the next heartbeat (progress between rounds needs no extra DHT traffic)."""
        record = self.presence.change(**fields)
        self.collective.abstaining = record.status == "standby"
        if now and not self._closed:  # (a digest hashed beside training may arrive after we left)
            self.loop.submit(self._publish())

    def settle_votes(self) -> None:
        """Let the votes we still have on their way arrive (at most `call_timeout`): a member may need ours to commit
        our last round (`Collective.settle`). Before leaving, and when a wrapper detaches."""
        if self._closed:
            return
        try:
            self.loop.run(self.collective.settle(self.cfg.round.call_timeout), timeout=self.cfg.round.call_timeout + 1)
        except Exception:  # noqa: BLE001 - leaving must never fail
            pass

    def others_seen(self) -> list[PeerRecord]:
        """The other peers' records as the heartbeat last read them (no network I/O; none before its first read)."""
        return self.presence.others_seen()

    def gathering(self, peer: PeerId, rnd: int) -> bool:
        """Whether `peer` asked us to take part in an attempt at round `rnd` (its `ready` is here)."""
        async def ask() -> bool:
            return self.collective.gathering(peer, rnd)
        try:
            return self.loop.run(ask(), timeout=self.cfg.round.call_timeout + 1)
        except TimeoutError:  # our own loop starved that long: we cannot tell, so we do not wait on it
            return False

    def records(self, *, cached: bool = False) -> list[PeerRecord]:
        """Everyone's current record (ours included), as the directory shows them now; with `cached`,
        as the last heartbeat read them (at most `heartbeat_interval` old, no network I/O)."""
        if not cached or self.presence.seen is None:
            try:
                return self.loop.run(self.presence.read(), timeout=self.cfg.round.call_timeout + 1)
            except TimeoutError:  # a read bounds its own lookup: a loop this late is starved, not an error to raise
                log.warning("event=directory_read_failed reason=no answer within %.0f s; using the view read before",
                            self.cfg.round.call_timeout + 1)
        return [self.presence.record, *self.others_seen()]

    def check_standing(self, members: Sequence[PeerId] | None) -> None:
        """Raise `Banned` if most of `members` (the view of our last committed round) refused us as
        banned in their own authenticated replies (no network I/O)."""
        against, voters = voted_out(self.collective.banned_by, members, self.peer_id)
        if against:
            raise Banned(f"peer {self.peer_id} was banned from run {self.cfg.run_id!r} by {against} of the {voters} "
                         "other peers of its last round: robust aggregation rejected its contributions repeatedly "
                         "(too large or not finite; their logs say which: event=peer_banned), so none of its "
                         "rounds will be taken. Check this peer's data, learning rate and compression settings "
                         "against the others', then restart it (it joins under a new peer id)")

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """Block until `count` peers (self included) are training in the swarm, the swarm has visibly
        started without us (`started_without`: waiting longer would only make us late for its first round),
        or `timeout` passes; returns how many training peers were seen."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.records()
            training = serving(records)
            if len(training) >= count or started_without(records, self.peer_id) or time.monotonic() >= deadline:
                return len(training)
            time.sleep(0.25)

    async def _publish(self) -> None:
        if self.collective.crashed:  # a crashed peer says nothing more
            return
        paths = data_paths(self.transport)
        reach = self.transport.reach if isinstance(self.transport, DirectTransport) else None
        await self.presence.publish(banned=tuple(sorted(self.collective.banned)[:MAX_BANNED]),
                                    libp2p=tuple(paths.get("libp2p", ())[:MAX_BANNED]),
                                    relayed=tuple(paths.get("relay", ())[:MAX_BANNED]),
                                    via=reach.via if reach is not None else ())

    def look_for(self, peers: Sequence[PeerId]) -> None:
        """Ping `peers` back into our directory when a read misses them, as the members of our last round are
        (`Presence._reach_unseen`): a peer the swarm is ahead of that sees none of it (`CatchUp.stranded`) looks for
        the peers it last saw, whose DHT nodes may be across an island from ours."""
        self.presence.members = tuple(dict.fromkeys([*self.presence.members, *peers]))

    def keep_addresses(self, path: str) -> None:
        """Keep the addresses of the other members in `path` (one a line, refreshed with the heartbeat), so
        that a restarted process of this site can rejoin through them (the launcher reads the file)."""
        self.presence.keep_addresses(path)

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            await self._publish()
            records = await self.presence.read()  # also keeps records(cached=True) fresh
            self.presence.write_addresses(records)
            if isinstance(self.transport, DirectTransport) and self.transport.reach is not None:
                self.transport.reach.update(sorted(r.peer for r in records if r.relay and r.status != "left"))
            # a peer our round waits for may have gone on standby or left since it began: it is asked again
            self.collective.recheck([r.peer for r in records if r.status in ("standby", "left")])
            await asyncio.sleep(self.cfg.heartbeat_interval)

    # ------------------------------------------------------------------ rounds and state

    def exchange_async(self, rnd: int, attempt: int, digest: str, delta: torch.Tensor | list[torch.Tensor] | Handoff,
                       fragment: int = 0,
                       previous: tuple[PeerId, ...] | None = None,
                       skip: Collection[PeerId] = (), weight: int = 1,
                       voters: Voters | None = None,
                       ) -> concurrent.futures.Future[RoundOutcome]:
        """Start our next round in the background (training goes on) and return at once: which attempt
        to run and whom to wait for are decided there from fresh records, so the training thread does
        no network I/O. With `majority` on, the round commits only with a majority of `previous` (the
        members of the last round we committed); peers in `skip` are not waited for; `weight`: what our Δ counts
        in the round's means (the inner steps it covers, for rounds by time); `voters(peers)`: what the quorum counts
        of those peers (the topology's: a merge of regions counts their regions, `diloco.regions`; by default the
        peers themselves). A list `delta` is a lone peer's Δ in pieces (`PiecewiseHandoff`): its outcome holds Δ̄ as
        the result frames, not decoded. `finish_exchange` collects the outcome."""
        if isinstance(delta, Handoff):
            handoff = delta
        elif isinstance(delta, list):  # Δ in pieces (`pseudo_gradient_pieces`), freed as the round encodes them
            handoff = PiecewiseHandoff(delta)
        else:
            handoff = Handoff(delta)
        del delta  # the round lets go of Δ once encoded: nothing here may keep it
        if previous:
            self.presence.members = tuple(previous)

        async def go() -> RoundOutcome:
            self.check_standing(previous)
            began = time.monotonic()
            records = await self.presence.for_round()
            self.collective.adopt_bans(banned_by_majority(records, self.peer_id), "banned by a majority of the "
                                       "peers' records")
            plan = plan_round(records, self.peer_id, rnd, attempt, skip=skip, previous=previous,
                              goodbyes=list(self.presence.left.values()),
                              fetching=self._server.catching_up(records))
            await self._verify(plan.ask)
            prev = previous if self.cfg.majority else None

            def admit(view: tuple[PeerId, ...]) -> tuple[bool, str]:
                count = voters or list
                return quorum(count(view), prev and count(prev), count(plan.left), self.cfg.round.min_peers)

            planned = time.monotonic()
            outcome = await self.collective.run_round(plan.key, digest, plan.ask, handoff, fragment=fragment,
                                                      admit=admit, wait_for=plan.wait_for, weight=weight)
            outcome.phases = {"plan": planned - began, **outcome.phases}  # reading the records, the round's plan
            if not outcome.committed:
                self.check_standing(previous)  # refused as banned by most of them: stop now, not next slot
            return outcome

        return self._track(go())

    def group_round_async(self, plan: Callable[[Sequence[PeerRecord], Collection[PeerId]], GroupPlan],
                          data: torch.Tensor) -> concurrent.futures.Future[RoundOutcome]:
        """Start a round among a group in the background: from fresh records and the peers we banned, `plan` (the
        topology's: `membership.gossip_plan`) picks the round, what the group's members say they hold and who they
        are; one round of the protocol, whose view can only be members that say the same, averages `data` (fp32,
        1-D). It commits with two members or more (its `aggregate` is the group's mean, its key the round it ran);
        nothing is retried; a plan that skips says why in the outcome. `finish_exchange` collects the outcome. The
        peers a read last showed are the ones our heartbeat pings back when its reads lose them (a DHT island: a
        partition healed while no round of ours named them)."""
        handoff = Handoff(data)
        del data

        async def go() -> RoundOutcome:
            records = await self.presence.read()
            banned = self.collective.banned
            seen = tuple(r.peer for r in serving(records) if r.peer != self.peer_id and r.peer not in banned)
            if seen:  # the peers we gossip among: a read that misses them all (an island) pings them (`_reach_unseen`)
                self.presence.members = seen
            p = plan(records, banned)
            if p.skip:
                return RoundOutcome(p.key, False, p.skip)
            await self._verify(p.others)
            group = ",".join(sorted([*p.others, self.peer_id]))

            def admit(view: tuple[PeerId, ...]) -> tuple[bool, str]:
                return len(view) >= 2, f"nobody of our group ({group}) met us in time"

            return await self.collective.run_round(p.key, p.tag, list(p.others), handoff, admit=admit)

        return self._track(go())

    def _track(self, round_: Coroutine[Any, Any, RoundOutcome]) -> concurrent.futures.Future[RoundOutcome]:
        """Run a round on our loop, kept in `_exchanges` while it runs (`crash` cancels it)."""
        future = self.loop.submit(round_)
        self._exchanges.add(future)
        future.add_done_callback(self._exchanges.discard)
        return future

    def finish_exchange(self, future: concurrent.futures.Future[RoundOutcome], key: RoundKey) -> RoundOutcome:
        """The outcome of a round started with `exchange_async`, waiting (bounded by the round's own
        deadlines) if it is still running; a round that overruns them is cancelled and reported failed.
        Raises `Banned` if the round found most of the last round's members had banned us."""
        # gather (and the stragglers' two graces), results, sends, votes, and a call to spare
        limit = 1.2 * self.cfg.round.gather_timeout + self.cfg.round.result_timeout + 4 * self.cfg.round.call_timeout
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return RoundOutcome(key, False, f"round did not finish within {limit:.0f}s")
        except concurrent.futures.CancelledError:
            return RoundOutcome(key, False, "crashed")

    def serve_state(self, snapshot: SnapshotProvider, wait_unserved: bool = True) -> None:
        """Let peers that are behind download our global state (`diloco.statesync`): `snapshot(digest)` is
        the `Snapshot` of the state named `digest` when we hold it, else None. A peer that asked is waited
        for in our next round (`StateServer.catching_up`), also one we could not serve, unless `wait_unserved` is
        off: an FSDP2 site takes its snapshot only at a synchronization slot, so its round would wait for a
        peer that cannot download anything until that round is over. Such a site reads `unserved()` at
        its slot, takes a snapshot, and then waits for them (`wait_for_unserved`)."""
        self._server.snapshot, self._server.wait_unserved = snapshot, wait_unserved

    def unserved(self) -> set[PeerId]:
        """Peers that asked us for a state we did not hold within the last `call_timeout` (`serve_state` with
        `wait_unserved` off)."""
        return self._server.unserved()

    def wait_for_unserved(self) -> None:
        """We now hold the state those peers want (a snapshot just taken): our next round waits for them, so
        the state stays current while they download it."""
        self._server.wait_for_unserved()

    def may_apply(self, rnd: int) -> bool:
        """A committed round `rnd` is about to be applied (the outer step): its `apply` fault hook runs,
        and False means this peer crashed meanwhile (an in-process kill), so the step must not happen."""
        self.collective.faults.hit("apply", rnd)
        return not self.collective.crashed

    def applied(self, rnd: int) -> None:
        """Our outer step of round `rnd` is applied (the new state's digest is being hashed): its `applied` fault
        hook runs."""
        self.collective.faults.hit("applied", rnd)

    def value_spans(self, value: Value, into: torch.Tensor | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """A lean round's value (`RoundOutcome.value`) decoded span by span: (lo, hi, values), decoded into
        `into[lo:hi]` when `into` is given."""
        return self.collective.value_spans(value, into)

    def moved_to(self, rnd: int) -> None:
        """Our state jumped to round `rnd` (downloaded, or resumed from a checkpoint): frames of earlier
        rounds are stale from now on."""
        self.collective.advance_to(RoundKey(rnd))

    def bytes_on_wire(self) -> tuple[int, int]:
        """(sent, received) bytes of this peer so far, every message included."""
        return self.transport.counter.snapshot()

    # ------------------------------------------------------------------ leaving

    def crash(self) -> None:
        """Vanish as a SIGKILLed process would, for in-process tests and simulation: no goodbye, no more
        heartbeats (our record lives until `heartbeat_ttl`), our rounds in flight end ("crashed"), and
        calls to or from us fail from now on. Safe from any thread.
        `close()` still releases what is left."""
        for inner in self._scopes:
            inner.crash()
        self.collective.crashed = True
        self._heartbeat.cancel()
        for future in list(self._exchanges):  # a dead process has no rounds in flight
            future.cancel()
        self.loop.submit(self.transport.close())

    def close(self, *, announce: bool = True) -> None:
        """Leave: tell the swarm at once (status=left), stop the heartbeat, shut the daemon down."""
        if self._closed:
            return
        for inner in self._scopes:  # our namespaces first: the region hears we left
            inner.close(announce=announce)
        if announce:
            self.presence.change(status="left")
            try:
                self.loop.run(self._publish(), timeout=5)
            except Exception:  # noqa: BLE001 - leaving must never fail
                pass
        self.settle_votes()
        self._closed = True
        self._heartbeat.cancel()
        if self._on_close is not None:
            self._on_close()
        else:
            self.loop.run(self.transport.close(), timeout=5)
        if self._owns_loop:
            self.loop.stop()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_DEFENCES: dict[str, Any] = dict(auth_refused={}, auth_held=0, rejections={}, records_dropped={}, robust={},
                                   banned=[])
"""`defences(None)`: a run without a swarm refused nothing."""


def defences(swarm: Swarm | None) -> dict[str, Any]:
    """What `swarm`'s peer refused and why: calls refused by the credential check (`auth_refused`, by reason)
    and how many of those the tarpit held (`auth_held`), frames rejected by reason (`rejections`),
    directory records dropped by reason (`records_dropped`: unsigned, signed by another key,
    malformed, off the allowlist), robust-aggregation events (`robust`), peers banned (`banned`)."""
    if swarm is None:
        return dict(NO_DEFENCES)
    c, guard = swarm.collective, swarm.transport.guard
    return dict(auth_refused=dict(sorted(guard.refused.items())) if guard is not None else {},
                auth_held=guard.tarpit.held_total if guard is not None else 0,
                rejections=dict(sorted(c.rejections.items())),
                records_dropped=dict(sorted(swarm.directory.dropped.items())),
                robust=dict(sorted(c.robust_events.items())), banned=sorted(c.banned))
