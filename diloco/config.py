"""Configuration: frozen, keyword-only dataclasses validated at construction.

Every field has a one-line docstring; a bad value raises `ConfigError` (a `ValueError`) saying
what is wrong and how to fix it, before any network I/O happens.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from diloco.comms import CollectiveConfig, PeerId
from diloco.comms.auth import Guard, check_secret
from diloco.comms.dataplane import DataConfig, parse_address
from diloco.comms.identity import public_key_of
from diloco.comms.relay import RelayConfig
from diloco.comms.robust import RobustConfig
from diloco.compression.errors import ConfigError as ConfigError  # re-exported: settings errors are raised here
from diloco.compression.pipeline import parse as parse_compression
from diloco.peers.records import REGION

_DATA = DataConfig()  # the defaults are declared there, once
_RELAY = RelayConfig()

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(/[A-Za-z0-9_.-]{1,40})?$")
"""A run id; `run/scope` names a namespace inside a run (a region's rounds: `Swarm.scope`)."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    run_id: str = "diloco"
    """Namespace of the swarm: peers only see and talk to peers with the same run id."""
    round: CollectiveConfig = field(default_factory=CollectiveConfig)
    """The round protocol: compression, quorum (`min_peers`), deadlines, largest frame, and its `robust`
    aggregation (`CollectiveConfig`, `RobustConfig`: each of those settings is declared there, once)."""
    majority: bool = True
    """A round also needs a strict majority of the last round's members (those that announced leaving
    excepted), so at most one side of a network partition trains on. Off: any min_peers may commit."""
    heartbeat_interval: float = 1.0
    """Seconds between refreshes of this peer's record in the DHT."""
    heartbeat_ttl: float = 30.0
    """Seconds a record lives without refresh: a crashed peer leaves others' view after this long. It must
    outlast a round's saturation of the link (DHT traffic queues behind the round's bytes on one
    connection); a dead peer is not waited for meanwhile, since calls to it fail."""
    secret: str | None = field(default=None, repr=False)
    """The swarm's shared secret (≥ 16 characters); every call is authenticated with keys derived from it
    and the run id. `Swarm.start` creates one when None; `Swarm.join` requires it; in-process swarms
    without one are open. Never logged, never written to metrics."""
    allow_peers: tuple[str, ...] = ()
    """If not empty: the only libp2p peer ids this peer talks to (an allowlist, on top of the secret)."""
    identity_file: str | None = None
    """File holding this peer's libp2p key (created, mode 600, if missing), so that its peer id survives
    restarts: what other sites' `allow_peers` list. None: a new peer id per process."""
    region: str = ""
    """The region this peer trains in ("" : a flat swarm). Peers of a region run their rounds among themselves;
    every `merge_every` of them, one representative per region merges the regions (`diloco.regions`)."""
    merge_every: int = 4
    """With regions: region rounds between two merges of the regions (H_global = merge_every × H)."""
    global_lr: float = 1.0
    """With regions: the outer lr of the merge (SGD on the mean of θ_global − θ_region; 1.0 without momentum
    makes the new global state the mean of the regions' states)."""
    global_momentum: float = 0.0
    """With regions: the merge's Nesterov momentum (0: none), kept across merges in the global state."""
    topology: str = "flat"
    """"flat": every round averages over the whole swarm (one global state). "gossip": every round averages
    within small groups of peers drawn from the round number, no all-reduce; each peer keeps its own state
    (`diloco.gossip`, NoLoCo)."""
    gossip_group: int = 2
    """With gossip: peers per group (a remainder joins the last group)."""
    data_port: int | None = 0
    """The direct data plane (`diloco.comms.dataplane`): the TCP port where members call this peer directly
    (0: any free one; None: no data port, every call goes through libp2p). Calls to a member whose data port
    cannot be reached go through libp2p."""
    data_announce: str = ""
    """host:port to advertise for the data port when others must dial another address than the one it listens
    on (a NAT's forwarded port, a proxy); by default the listening address, or the host of the first
    announced multiaddress."""
    data_streams: int = _DATA.streams
    """Direct connections to one member at most (calls to it in flight at once)."""
    relay: bool = _RELAY.serve
    """Serve as a relay on the data port for the members of this run that cannot be dialed (behind a NAT or a
    firewall that lets connections out only; docs/USAGE.md, "Behind NAT"). Only a member others can dial is of use
    as one."""
    relay_circuits: int = _RELAY.circuits
    """As a relay: circuits one member may have open through it at once as caller."""
    relay_rate: float = _RELAY.rate_mbit
    """As a relay: Mbit/s one member may send through it (0: no cap); a member over it is slowed down."""
    reach: str = _RELAY.reach
    """How members reach this peer's data port: "auto" asks a relay to dial it once one is known and, if it
    cannot, keeps connections waiting at relays (members call through them); "relay" always waits at relays;
    "direct" never does."""

    def relay_config(self) -> RelayConfig:
        """The relay settings of the data plane (`diloco.comms.relay`)."""
        return RelayConfig(serve=self.relay, circuits=self.relay_circuits, rate_mbit=self.relay_rate,
                           reach=self.reach, slots=min(self.data_streams, _RELAY.waiting))

    def __post_init__(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise ConfigError(f"run_id {self.run_id!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        if not isinstance(self.round, CollectiveConfig):
            raise ConfigError(f"round must be a CollectiveConfig (e.g. CollectiveConfig(compression=\"e3m0\", "
                              f"min_peers=2)), got {type(self.round).__name__}")
        if self.heartbeat_interval <= 0 or self.heartbeat_ttl <= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_ttl ({self.heartbeat_ttl}) must exceed twice heartbeat_interval "
                f"({self.heartbeat_interval}) > 0, or live peers would flicker out of the swarm"
            )
        if self.secret is not None:
            try:
                check_secret(self.secret)
            except ValueError as e:
                raise ConfigError(f"secret: {e}") from None
        bad = [p for p in self.allow_peers if not isinstance(p, str) or public_key_of(p) is None]
        if bad:
            raise ConfigError(f"allow_peers must be Ed25519 libp2p peer ids (12D3KooW…, as a peer prints at start; "
                              f"with --identity FILE it stays the same), got {bad[:3]!r}")
        if self.region and not REGION.fullmatch(self.region):
            raise ConfigError(f"region {self.region!r} must be 1-32 letters, digits, '_', '.', '-' (e.g. eu-west)")
        if self.merge_every < 1:
            raise ConfigError(f"merge_every must be >= 1 region round, got {self.merge_every}")
        if not (self.global_lr > 0 and 0 <= self.global_momentum < 1):
            raise ConfigError(f"global_lr must be > 0 and global_momentum in [0, 1), got {self.global_lr} and "
                              f"{self.global_momentum}")
        if self.data_port is not None and not 0 <= self.data_port < 65536:
            raise ConfigError(f"data_port must be a TCP port (0: any free one) or None (no data port), got "
                              f"{self.data_port}")
        if self.data_announce and parse_address(self.data_announce) is None:
            raise ConfigError(f"data_announce must be host:port (an IPv6 host in brackets), got {self.data_announce!r}")
        if self.data_streams < 1:
            raise ConfigError(f"data_streams must be >= 1 connection, got {self.data_streams}")
        try:
            self.relay_config()  # its own checks (reach, circuits, rate), named as these fields are
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.topology not in ("flat", "gossip"):
            raise ConfigError(f"topology must be 'flat' or 'gossip', got {self.topology!r}")
        if self.topology == "gossip":
            if self.gossip_group < 2:
                raise ConfigError(f"gossip_group must be >= 2 peers, got {self.gossip_group}")
            if self.region:
                raise ConfigError("gossip and regions are two topologies: pick --region or --topology gossip")
            if parse_compression(self.round.compression).text != "fp32":
                raise ConfigError(f"gossip averages the peers' parameters, not pseudo-gradients, so a lossy codec "
                                  f"would perturb the weights themselves: use --compression fp32 (got "
                                  f"{self.round.compression!r})")

    def guard(self, me: str) -> Guard | None:
        """The credential of peer `me` in this swarm (None for an open, in-process swarm)."""
        if self.secret is None:
            return None
        return Guard(self.secret, self.run_id, PeerId(me), frozenset(self.allow_peers) or None)

    def with_round(self, **changes: Any) -> SwarmConfig:
        """These settings with some of the round's changed: `cfg.with_round(gather_timeout=20, min_peers=2)`."""
        return replace(self, round=replace(self.round, **changes))

    def settings(self, *, identity: bool = False) -> dict[str, Any]:
        """These settings as plain data (JSON, a run's config in metrics), never the secret; the identity file's
        path only with `identity` (a launched command needs it, a run's config in metrics does not)."""
        leave_out = ("secret",) if identity else ("secret", "identity_file")
        return {k: v for k, v in asdict(self).items() if k not in leave_out}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **more: Any) -> SwarmConfig:
        """`settings()` read back (lists as tuples). Raises ConfigError, or TypeError naming an unknown field."""
        d = {**settings, **more}
        if isinstance(d.get("round"), Mapping):
            rnd = dict(d["round"])
            if isinstance(rnd.get("robust"), Mapping):
                rnd["robust"] = RobustConfig(**rnd["robust"])
            d["round"] = CollectiveConfig(**rnd)
        d["allow_peers"] = tuple(d.get("allow_peers") or ())
        return cls(**d)
