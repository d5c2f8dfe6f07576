"""The end of a run, one sequence for every way a worker runs: the bundled job (`diloco start/join`, `run_job`)
and a script of yours under the launcher (`diloco start/join -- CMD`, `DiLoCo.detach`).

1. The one final model (`Topology.finish`): a flat swarm holds one state already; regions merge a last time if
   region rounds ran since the last merge, and every peer takes θ_G′; gossip peers average their states once.
2. An FSDP2 site gathers a snapshot of its final state, for a peer still behind to download (its leader cannot
   copy the state alone).
3. `linger`: while a live peer of the swarm holds an older round (it was in doubt, frozen or slow when we
   finished), keep serving our state so it ends on the final one, for at most a gather timeout.
4. The final checkpoint, where checkpoints are written.
5. The final metrics line (`final_fields` is what every run's says, `final_digest` the model every peer ends
   on; the bundled job adds its evaluation).

A run that was stopped (Ctrl-C, SIGTERM) or failed skips the first three: it leaves at once. A script under the
launcher that fails with one of diloco's errors (a wrong secret or run id, a ban) says so in one line, as the
bundled job does, not in a traceback (`errors_as_lines`).
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING

from diloco.comms import PeerId
from diloco.comms.dataplane import data_paths, relay_stats

if TYPE_CHECKING:
    from .member import Member
    from .wrapper import DiLoCo

log = logging.getLogger(__name__)


def end_run(d: DiLoCo, *, completed: bool) -> None:
    """Steps 1–4 for the worker `d` (its loop left the `with`; `completed`: it reached its end, not stopped)."""
    member = d.member
    if completed:
        d.finish()
    if completed and d.shards is not None and member.in_swarm:
        member.take_snapshot()
    if completed and member.swarm is not None and d.topology.one_state:  # nobody downloads a gossip peer's state
        linger(member, member.swarm.cfg.round.gather_timeout)
    if d.checkpoints.root is not None and d.link.writes_checkpoints:
        d.save_checkpoint()


def final_fields(d: DiLoCo) -> dict[str, object]:
    """What every run's final metrics line says of its worker: who, where it ended, and its topology."""
    swarm = d.member.swarm
    return dict(peer=swarm.peer_id if swarm is not None else "", round=d.round, digest=d.digest,
                final_digest=d.topology.final_digest(d.member), steps=d.steps,
                committed_rounds=sum(r.committed for r in d.reports), **d.topology_summary(),
                data_paths=data_paths(swarm.transport) if swarm is not None else {},
                relays=relay_stats(swarm.transport) if swarm is not None else {})


def linger(member: Member, timeout: float) -> int:
    """Keep serving `member`'s state while a peer that is still in its swarm holds an older round, so that it can
    download the final state instead of ending on an older one. Returns after `timeout` seconds at most, with
    the number of peers still behind (0 when everyone caught up)."""
    swarm = member.swarm
    if swarm is None:
        return 0
    started = time.monotonic()
    deadline, quiet = started + timeout, 3 * swarm.cfg.heartbeat_interval + 2
    first_beat: dict[PeerId, float] = {}
    while True:
        now = time.monotonic()
        behind = []
        for r in swarm.records():
            if r.peer == swarm.peer_id or r.status == "left" or r.round >= member.round:
                continue
            # a peer whose heartbeat has not moved for a while is dead or frozen: not worth waiting for
            if first_beat.setdefault(r.peer, r.beat) != r.beat or now - started < quiet:
                behind.append(r.peer)
        if not behind or now >= deadline:
            if behind:
                log.warning("event=left_peers_behind round=%d peers=%s reason=they did not catch up within %.0fs",
                            member.round, ",".join(behind), timeout)
            return len(behind)
        log.info("event=linger round=%d behind=%s", member.round, ",".join(behind))
        time.sleep(0.25)


def errors_as_lines() -> None:
    """From now on, an uncaught `diloco.DiLoCoError` ends this process with its message as one `error:` line on
    stderr (exit status 1, as for any uncaught exception), not a traceback: the message names the fix already. A
    script may still catch them; any other exception keeps its traceback. For a script under the launcher."""
    from .compression.errors import DiLoCoError

    previous = sys.excepthook
    if getattr(previous, "diloco_lines", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, DiLoCoError):
            sys.stderr.write(f"error: {value}\n")
            sys.stderr.flush()
        else:
            previous(kind, value, tb)

    hook.diloco_lines = True  # type: ignore[attr-defined]
    sys.excepthook = hook
