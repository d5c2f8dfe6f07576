"""The launcher's contract with the training command: what `diloco start/join -- CMD` puts in the
command's environment, and how the wrapper turns it back into a swarm peer.

| variable | what it holds |
|---|---|
| `DILOCO_SWARM` | JSON: the swarm's settings (every `SwarmConfig` field but the secret) and how to connect: `peers` (addresses to join; empty for the first peer), `host`, `port`, `announce`, `wait_for` (peers to wait for before the first step) |
| `DILOCO_SECRET_FILE` | a file (mode 600) holding the swarm secret; the secret itself is never in the environment or on a command line |
| `DILOCO_ADDRESS_FILE` | where the site's peer writes its addresses once it is up (the launcher prints the join line from it) |
| `DILOCO_PEERS_FILE` | where the site's peer keeps the addresses of the swarm's members, so a restarted command can rejoin through them |
| `DILOCO_METRICS` | a JSON-lines file for the wrapper's round and final lines (only with `--metrics`) |
| `DILOCO_TENSORBOARD`, `DILOCO_WANDB` | a TensorBoard directory and a W&B project for the same events (only with `--tensorboard` / `--wandb`; `diloco.sinks`) |
| `DILOCO_CHECKPOINT_DIR`, `DILOCO_CHECKPOINT_EVERY` | checkpoints (only with `--checkpoint-dir`): the wrapper resumes from the newest one when it attaches |
| `DILOCO_SHARD` | the site's data shard when `--shard N` was given (`DiLoCo.data_shard` reads it; otherwise derived from the site's peer id, which the launcher keeps across restarts) |
| `DILOCO_END_FILE` | a file the launcher creates when it is asked to end the whole swarm's run (SIGUSR2): the worker then announces the round the run ends at (`diloco.ending`) |
| `DILOCO_RESTART` | how many times the launcher restarted the command (0 the first time) |
| `DILOCO_LAUNCH_ID` | tags every process of one launch, so that nothing outlives the launcher |

`DiLoCo(model, optimizer, inner_steps=H)` reads this (`Launch.from_env`) when no `swarm=` is given:
without these variables the same script trains as a single worker with no network.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .config import ConfigError, SwarmConfig
from .lines import write_lines
from .sinks import SinkConfig

if TYPE_CHECKING:
    from .metrics import MetricsWriter
    from .swarm import Swarm

log = logging.getLogger(__name__)

SWARM, SECRET_FILE, ADDRESS_FILE, PEERS_FILE = "DILOCO_SWARM", "DILOCO_SECRET_FILE", "DILOCO_ADDRESS_FILE", \
    "DILOCO_PEERS_FILE"
METRICS, CHECKPOINT_DIR, CHECKPOINT_EVERY = "DILOCO_METRICS", "DILOCO_CHECKPOINT_DIR", "DILOCO_CHECKPOINT_EVERY"
TENSORBOARD, WANDB = "DILOCO_TENSORBOARD", "DILOCO_WANDB"
RESTART, LAUNCH_ID, SHARD, END_FILE = "DILOCO_RESTART", "DILOCO_LAUNCH_ID", "DILOCO_SHARD", "DILOCO_END_FILE"
WAIT_TIMEOUT = 120.0  # seconds a launched worker waits for `wait_for` peers, then trains with whoever is there
ALL = (SWARM, SECRET_FILE, ADDRESS_FILE, PEERS_FILE, METRICS, TENSORBOARD, WANDB, CHECKPOINT_DIR, CHECKPOINT_EVERY,
       RESTART, LAUNCH_ID, SHARD, END_FILE)
SHARDS = 100_000
"""Data shards a peer id is spread over when none is given (`data_shard`)."""


def data_shard(peer: str, given: int | None = None) -> int:
    """A worker's data shard: `given` (`--shard N`), else one drawn from its peer id (stable while the id is:
    across a launcher's restarts, or with `--identity`), so that workers read different data without agreeing on
    anything; 0 for a worker with no swarm."""
    if given is not None:
        return given
    return zlib.crc32(peer.encode()) % SHARDS if peer else 0



@dataclass(frozen=True)
class Launch:
    """Everything a launched command needs to be this site's worker (see the module docstring)."""

    swarm: SwarmConfig
    """The swarm's settings, without the secret (`secret_file` holds it)."""
    secret_file: str
    peers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    announce: tuple[str, ...] = ()
    wait_for: int = 1
    """Peers (this site included) to wait for, up to `WAIT_TIMEOUT`, before the first inner step."""
    address_file: str | None = None
    peers_file: str | None = None
    metrics: str | None = None
    sinks: SinkConfig = SinkConfig()
    """TensorBoard and W&B, next to the metrics lines."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    restart: int = 0
    shard: int | None = None
    """The site's data shard, when given (`--shard N`)."""
    end_file: str | None = None
    """Created by the launcher when it is asked to end the whole run (`diloco.ending`)."""
    extra: Mapping[str, str] = field(default_factory=dict)
    """Other variables to set (the launch id)."""

    def to_env(self) -> dict[str, str]:
        settings = self.swarm.settings(identity=True)
        settings.update(peers=list(self.peers), host=self.host, port=self.port, announce=list(self.announce),
                        wait_for=self.wait_for)
        env = {SWARM: json.dumps(settings, sort_keys=True), SECRET_FILE: self.secret_file, RESTART: str(self.restart),
               CHECKPOINT_EVERY: str(self.checkpoint_every), **self.extra}
        for name, value in ((ADDRESS_FILE, self.address_file), (PEERS_FILE, self.peers_file),
                            (METRICS, self.metrics), (TENSORBOARD, self.sinks.tensorboard), (WANDB, self.sinks.wandb),
                            (CHECKPOINT_DIR, self.checkpoint_dir), (END_FILE, self.end_file)):
            if value:
                env[name] = value
        if self.shard is not None:
            env[SHARD] = str(self.shard)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Launch | None:
        """The launch this process belongs to, or None when it was not started by `diloco start/join -- CMD`.
        Raises ConfigError naming the variable when one is malformed."""
        env = os.environ if environ is None else environ
        if SWARM not in env:
            return None
        try:
            settings: dict[str, Any] = json.loads(env[SWARM])
            connect = {k: settings.pop(k) for k in ("peers", "host", "port", "announce", "wait_for")}
            swarm = SwarmConfig.from_settings(settings)
            every = int(env.get(CHECKPOINT_EVERY, "0"))
            restart = int(env.get(RESTART, "0"))
            shard = int(env[SHARD]) if env.get(SHARD) else None
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"{SWARM} (set by `diloco start/join -- CMD`) is malformed: {e}; run the command "
                              "under the launcher of the same diloco version, or unset the variable") from None
        if SECRET_FILE not in env:
            raise ConfigError(f"{SWARM} is set but {SECRET_FILE} is not; run the command under `diloco start/join`")
        return cls(swarm=swarm, secret_file=env[SECRET_FILE], peers=tuple(connect["peers"]), host=connect["host"],
                   port=int(connect["port"]), announce=tuple(connect["announce"] or ()), wait_for=int(connect["wait_for"]),
                   address_file=env.get(ADDRESS_FILE), peers_file=env.get(PEERS_FILE), metrics=env.get(METRICS),
                   sinks=SinkConfig(tensorboard=env.get(TENSORBOARD) or None, wandb=env.get(WANDB) or None),
                   checkpoint_dir=env.get(CHECKPOINT_DIR), checkpoint_every=every, restart=restart, shard=shard,
                   end_file=env.get(END_FILE))

    @property
    def records_metrics(self) -> bool:
        """Round and final events go somewhere: JSON lines, TensorBoard or W&B."""
        return bool(self.metrics or self.sinks)

    def metrics_writer(self, peer: str, *, sinks: bool = True) -> MetricsWriter:
        """The launch's metrics writer for this process (opened once, on first use; `sinks=False`: the JSON
        lines only, as for a site's ranks other than its leader). Closed by `metrics.close_launched`."""
        from .metrics import launched_writer

        return launched_writer(self.metrics, self.sinks if sinks else SinkConfig(), peer, self.swarm.run_id,
                               {**self.swarm.settings(), "restart": self.restart})

    def connect(self) -> Swarm:
        """Start or join the swarm as this launch says (reading the secret from its file), write our
        addresses where the launcher looks for them, and keep the members' addresses for a restart."""
        from diloco.comms.faults import FaultPlan

        from .credentials import read_secret
        from .swarm import Swarm

        cfg = dataclasses.replace(self.swarm, secret=read_secret(Path(self.secret_file)))
        announce = list(self.announce) or None
        try:
            faults = FaultPlan.from_env()  # the entry point of a script under the launcher: tests and chaos runs
        except ValueError as e:
            raise ConfigError(f"DILOCO_FAULTS: {e}") from None
        swarm = Swarm.join(list(self.peers), cfg, host=self.host, port=self.port, announce=announce, faults=faults) \
            if self.peers else Swarm.start(cfg, host=self.host, port=self.port, announce=announce, faults=faults)
        if self.address_file:
            write_lines(self.address_file, swarm.addresses)
        if self.peers_file:
            swarm.keep_addresses(self.peers_file)
        return swarm
