"""Fault plans for `diloco simulate`: what goes wrong, to whom, and at which round.

    {"faults": [
      {"round": 3, "action": "kill", "peer": 2},
      {"round": 5, "action": "restart", "peer": 2},
      {"round": 2, "action": "slow", "peer": 1, "factor": 4},
      {"round": 4, "action": "degrade", "peer": 0, "bandwidth_mbit": 10, "latency_ms": 200},
      {"round": 6, "action": "partition", "peers": [3], "rounds": 2},
      {"round": 1, "action": "poison", "peer": 7, "factor": 1e4}
    ]}

| action      | fires when                              | what happens                                            |
|-------------|-----------------------------------------|---------------------------------------------------------|
| `kill`      | worker `peer` reaches round `round`      | it vanishes as a SIGKILLed process would (no goodbye)   |
| `restart`   | the swarm reaches round `round`          | worker `peer` (killed earlier) starts again under a new peer id and catches up by download |
| `slow`      | worker `peer` reaches round `round`      | its inner steps take `factor` times as long (projection) |
| `degrade`   | worker `peer` reaches round `round`      | its link becomes `bandwidth_mbit` / `latency_ms` / `loss` (projection) |
| `partition` | the swarm reaches round `round`          | `peers` are cut off (calls and records) from the others until those committed `rounds` more rounds |
| `poison`    | worker `peer` reaches round `round`      | from then on it contributes its pseudo-gradient times `factor` (an authorized peer gone bad: robust aggregation clips it, then bans it) |

A round is the number of outer rounds a worker holds (`rounds` × fragments with streaming). Every
fault fires exactly once. Kill, restart and partition act on the real in-process swarm at a round
boundary: every worker pauses there until the fault is in place, so a plan gives the same global
state on every run. `slow` and `degrade` change the projection only (the simulated workers all run
on this machine). A cut-off side trains up to its first refused round, then waits for the heal (its
local steps there would be lost at the resync anyway). The cut-off side must be fewer than half of
the live workers: a larger one would leave no side that can commit (tests/test_partitions.py shows
a 2|2 split stall both halves).

`random_plan(seed, ...)` draws a valid plan from a seed (`--faults random:N` on the CLI); it never
draws `poison` (a ban changes the swarm for good; put it in a plan on purpose).
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from diloco.comms.faults import FaultPlan

from ..config import ConfigError

if TYPE_CHECKING:
    from ..wrapper import DiLoCo

log = logging.getLogger(__name__)

ACTIONS = ("kill", "restart", "slow", "degrade", "partition", "poison")
_RANDOM_ACTIONS = ACTIONS[:5]
_ON_ONE_WORKER = ("slow", "degrade", "poison")  # fire when that worker gets there; nobody waits
_FIELDS = {
    "kill": {"round", "action", "peer"},
    "restart": {"round", "action", "peer"},
    "slow": {"round", "action", "peer", "factor"},
    "degrade": {"round", "action", "peer", "bandwidth_mbit", "latency_ms", "loss"},
    "partition": {"round", "action", "peers", "rounds"},
    "poison": {"round", "action", "peer", "factor"},
}


@dataclass(frozen=True)
class Fault:
    round: int
    action: str
    peer: int = -1
    """The worker acted on (kill, restart, slow, degrade)."""
    peers: tuple[int, ...] = ()
    """partition: the workers cut off from the rest."""
    factor: float = 1.0
    """slow: step time multiplier (> 1 is slower); poison: what the pseudo-gradient is multiplied by."""
    bandwidth_mbit: float | None = None
    latency_ms: float | None = None
    loss: float | None = None
    """degrade: the link's new values (None keeps the old one)."""
    rounds: int = 2
    """partition: heals once the others committed this many rounds after the split."""

    def as_dict(self) -> dict[str, Any]:
        keep = _FIELDS[self.action]
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if k in keep and v is not None}

    def __str__(self) -> str:
        who = f"workers {list(self.peers)}" if self.action == "partition" else f"worker {self.peer}"
        return f"{self.action} {who} at round {self.round}"


def _int(item: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    v = item.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ConfigError(f"{where}: {key!r} must be an integer >= {low}, got {v!r}")
    return v


def _num(item: dict[str, Any], key: str, where: str, ok: Any, need: str) -> float | None:
    v = item.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not ok(v):
        raise ConfigError(f"{where}: {key!r} must be {need}, got {v!r}")
    return float(v)


def parse_fault(item: Any, index: int, workers: int) -> Fault:
    """One plan entry, validated; the error names the entry and how to fix it."""
    where = f"fault #{index}"
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object like {{\"round\": 3, \"action\": \"kill\", \"peer\": 1}}")
    action = item.get("action")
    if action not in ACTIONS:
        raise ConfigError(f"{where}: action {action!r} is not one of {', '.join(ACTIONS)}")
    unknown = set(item) - _FIELDS[action]
    if unknown:
        raise ConfigError(f"{where}: {action} takes {sorted(_FIELDS[action])}, not {sorted(unknown)}")
    rnd = _int(item, "round", where)
    if action == "partition":
        peers = item.get("peers")
        if not isinstance(peers, list) or not peers or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 <= p < workers for p in peers) \
                or len(set(peers)) != len(peers):
            raise ConfigError(f"{where}: 'peers' must list distinct worker indices in 0..{workers - 1}, got {peers!r}")
        rounds = _int(item, "rounds", where, low=1) if "rounds" in item else 2
        return Fault(rnd, action, peers=tuple(sorted(peers)), rounds=rounds)
    peer = _int(item, "peer", where)
    if peer >= workers:
        raise ConfigError(f"{where}: peer {peer} does not exist (workers are 0..{workers - 1})")
    if action == "slow":
        factor = _num(item, "factor", where, lambda v: v > 0, "a number > 0")
        return Fault(rnd, action, peer, factor=factor if factor is not None else 2.0)
    if action == "poison":
        factor = _num(item, "factor", where, lambda v: v != 1, "a finite number other than 1")
        return Fault(rnd, action, peer, factor=factor if factor is not None else 1e4)
    if action == "degrade":
        bw = _num(item, "bandwidth_mbit", where, lambda v: v > 0, "> 0")
        lat = _num(item, "latency_ms", where, lambda v: v >= 0, ">= 0")
        loss = _num(item, "loss", where, lambda v: 0 <= v < 1, "in [0, 1)")
        if bw is None and lat is None and loss is None:
            raise ConfigError(f"{where}: degrade needs bandwidth_mbit, latency_ms or loss")
        return Fault(rnd, action, peer, bandwidth_mbit=bw, latency_ms=lat, loss=loss)
    return Fault(rnd, action, peer)


def check_plan(faults: Sequence[Fault], workers: int) -> None:
    """Reject plans that cannot play out: killing a dead worker, restarting a live one, cutting off
    a dead one or half the swarm, acting on a worker that is dead at that round, or on a poisoner
    after it poisons (it stops once banned; a restarted worker comes back honest)."""
    alive = set(range(workers))
    split: Fault | None = None
    poisoned: dict[int, Fault] = {}
    for f in sorted(faults, key=lambda f: f.round):  # stable: plan order within a round
        if f.action != "partition" and f.peer in poisoned:
            raise ConfigError(f"{f}: worker {f.peer} poisons from round {poisoned[f.peer].round} and stops once "
                              "the others ban it, at a round the plan cannot know; plan nothing later for it")
        if split is not None and f.round < split.round + split.rounds and f.action in ("kill", "restart", "partition"):
            raise ConfigError(f"{f}: falls within {split} (until round {split.round + split.rounds}); a worker "
                              "cut off cannot reach it, and the others wait for it: move it after the heal")
        if f.action == "kill":
            if f.peer not in alive:
                raise ConfigError(f"{f}: worker {f.peer} is not running then (killed before, not restarted)")
            alive.discard(f.peer)
            if not alive:
                raise ConfigError(f"{f}: that kills the last running worker; nothing would be left to simulate")
        elif f.action == "restart":
            if f.peer in alive:
                raise ConfigError(f"{f}: worker {f.peer} is running then; kill it first (an earlier round)")
            alive.add(f.peer)
        elif f.action == "partition":
            if set(f.peers) & set(poisoned):
                raise ConfigError(f"{f}: worker(s) {sorted(set(f.peers) & set(poisoned))} poison and stop once banned, "
                                  "at a round the plan cannot know; do not cut them off")
            if not set(f.peers) <= alive:
                raise ConfigError(f"{f}: workers {sorted(set(f.peers) - alive)} are not running then")
            if 2 * len(f.peers) >= len(alive):
                raise ConfigError(f"{f}: cut off fewer than half of the {len(alive)} running workers, or no "
                                  "side could commit and the split would never heal")
            split = f
        elif f.peer not in alive:
            raise ConfigError(f"{f}: worker {f.peer} is not running then")
        elif f.action == "poison":
            poisoned[f.peer] = f


def load_plan(path: str | Path, workers: int) -> list[Fault]:
    """A plan from a JSON file: {"faults": [...]} (or the bare list)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"fault plan {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"fault plan {path} is not readable JSON: {e}") from None
    items = data.get("faults") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"fault plan {path}: expected {{\"faults\": [...]}}")
    faults = [parse_fault(item, i, workers) for i, item in enumerate(items)]
    check_plan(faults, workers)
    return faults


def random_plan(seed: int, workers: int, rounds: int, count: int) -> list[Fault]:
    """`count` faults drawn from `seed`: valid (`check_plan`) and deterministic. Rounds fall in
    1..rounds-2 so every fault plays out before the run ends; a killed worker is restarted later when
    rounds allow; a partition cuts off one worker (when more than two run)."""
    if workers < 1 or rounds < 3:
        raise ConfigError("a random fault plan needs at least 1 worker and 3 rounds")
    rng = random.Random(seed)
    plan: list[Fault] = []
    for _ in range(count * 20):  # draws that do not fit the plan so far are skipped
        if len(plan) >= count:
            break
        action = rng.choice(_RANDOM_ACTIONS)
        rnd = rng.randint(1, rounds - 2)
        peer = rng.randrange(workers)
        candidate = {
            "kill": Fault(rnd, "kill", peer),
            "restart": Fault(rnd, "restart", peer),
            "slow": Fault(rnd, "slow", peer, factor=round(rng.uniform(1.5, 8.0), 2)),
            "degrade": Fault(rnd, "degrade", peer, bandwidth_mbit=round(rng.uniform(1, 50), 1),
                             latency_ms=round(rng.uniform(20, 300), 1)),
            "partition": Fault(rnd, "partition", peers=(peer,), rounds=1),
        }[action]
        try:
            check_plan([*plan, candidate], workers)
        except ConfigError:
            continue
        plan.append(candidate)
    return sorted(plan, key=lambda f: f.round)


# ---------------------------------------------------------------------- playing a plan out


class Killed(BaseException):
    """Raised in a simulated worker's thread by a `kill` fault: it stops as a SIGKILLed process would.
    A BaseException, so no `except Exception` on the way out mistakes it for an error to handle."""


@dataclass
class _Event:
    fault: Fault
    index: int  # position in the plan (-1: a partition's heal)
    fired: bool = False
    done: bool = False


class FaultRunner:
    """Plays a plan out in a running simulation. Every worker calls `after_step(worker, d)` after each
    inner step (its training thread). An event whose round a worker reached pauses that worker until
    the event is in place, so every run of a plan gives the same global state:

    - kill: the victim crashes its swarm handle and raises `Killed`.
    - restart: the first worker to reach the round calls `spawn(peer)`, which starts the worker again
      on a new peer; the others wait until it caught up and published its record.
    - partition: the first worker outside the cut-off set to reach the round cuts it off (`cut`,
      `blocked`); a cut-off worker trains until one round is refused, then waits for the heal; the
      heal comes when a worker outside reaches `rounds` more rounds and every cut-off worker had its
      round refused, and everyone waits there until the cut-off workers resynced.
    - slow, degrade: recorded for the projection; nobody waits.
    - poison: from then on that worker contributes its pseudo-gradient times `factor` (its swarm's
      `FaultPlan.poison`, as `DILOCO_FAULTS=poison@R` does on a real peer); nobody waits.
      Once most others banned it, its own swarm handle sees so and stops it (`Banned`), as on a real peer.

    `fired` lists (plan index, fault) in the order they fired; each fires exactly once.
    """

    def __init__(self, faults: Sequence[Fault], spawn: Callable[[int], None], timeout: float = 600.0) -> None:
        self._events = [_Event(f, i) for i, f in sorted(enumerate(faults), key=lambda x: x[1].round)]
        self._spawn = spawn
        self._timeout = timeout
        self._cond = threading.Condition()
        self._workers: dict[int, DiLoCo] = {}  # worker -> its DiLoCo (the running incarnation)
        self.fired: list[tuple[int, Fault]] = []
        self.cut: frozenset[int] = frozenset()
        """Workers cut off by a partition now."""
        self._cut_reports: dict[int, int] = {}  # cut-off worker -> its report count at the split
        self.peer_worker: dict[str, int] = {}
        """Peer id -> worker index, for every incarnation (set by the simulator)."""
        self.plans: dict[int, FaultPlan] = {}
        """Worker -> the fault hooks its running incarnation's swarm was given (set by the simulator)."""

    # -------------------------------------------------------------- what the network asks

    def blocked(self, me: str, target: str) -> bool:
        """Is a call from peer `me` to peer `target` lost to a partition now?"""
        a, b = self.peer_worker.get(me), self.peer_worker.get(target)
        return bool(self.cut) and a is not None and b is not None and ((a in self.cut) != (b in self.cut))

    def visible(self, me: str, other: str) -> bool:
        """Does peer `me` see `other`'s record now (a partitioned DHT shows each side only its own)?"""
        return not self.blocked(me, other)

    # -------------------------------------------------------------- the training threads

    def after_step(self, worker: int, d: DiLoCo) -> None:
        with self._cond:
            self._workers[worker] = d
            self._cond.notify_all()  # a restarted worker's first step: its restart may be done
            deadline = time.monotonic() + self._timeout
            while True:
                if worker in self.cut and worker not in self._cut_reports:
                    self._cut_reports[worker] = len(d.reports)  # taken here, between steps: exact
                ev = next((e for e in self._events if not e.done and self._applies(e, worker, d)), None)
                if ev is None and not self._held(worker, d):
                    return
                if ev is not None and not ev.fired and self._acts(ev, worker):
                    self._fire(ev, worker, d)  # a kill raises Killed here
                    continue
                if ev is not None and self._finished(ev):
                    ev.done = True
                    self._cond.notify_all()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    what = str(ev.fault) if ev is not None else "the heal of a partition"
                    raise RuntimeError(f"fault plan stuck: worker {worker} waited {self._timeout:.0f}s for {what}")
                self._cond.wait(min(remaining, 0.5))

    def worker_gone(self, worker: int) -> None:
        """A worker's thread ended (killed, or done): nobody waits for it any more."""
        with self._cond:
            self._workers.pop(worker, None)
            self._cond.notify_all()

    # -------------------------------------------------------------- decisions (under the lock)

    def _applies(self, ev: _Event, worker: int, d: DiLoCo) -> bool:
        f = ev.fault
        if f.action in _ON_ONE_WORKER:
            return f.peer == worker and d.round >= f.round
        if worker in self.cut:  # a cut-off worker is held by `_held`, not by what the others do
            return False
        return d.round >= f.round

    def _acts(self, ev: _Event, worker: int) -> bool:
        f = ev.fault
        if f.action == "kill" or f.action in _ON_ONE_WORKER:
            return f.peer == worker
        # The others must be there too: a worker still finishing the round would see the change mid-way.
        if ev.index == -1:  # heal: once every cut-off worker had a round refused (so each took the same steps)
            return self._all_at(f.round, skip=f.peers) and all(
                self._held(w, d) for w, d in self._workers.items() if w in f.peers)
        if f.action == "partition":
            return worker not in f.peers and self._all_at(f.round)
        return self._all_at(f.round)  # restart: the first worker there, once all are

    def _all_at(self, rnd: int, skip: Sequence[int] = ()) -> bool:
        return all(d.round >= rnd for w, d in self._workers.items() if w not in skip)

    def _held(self, worker: int, d: DiLoCo) -> bool:
        """A cut-off worker that had a round refused waits for the heal."""
        return worker in self.cut and worker in self._cut_reports and bool(len(d.reports) > self._cut_reports[worker])

    def _finished(self, ev: _Event) -> bool:
        f = ev.fault
        if not ev.fired:
            return False
        if f.action == "restart":
            d = self._workers.get(f.peer)
            swarm = d.swarm if d is not None else None
            return swarm is not None and any(r.peer == swarm.peer_id and r.status == "training"
                                             for r in swarm.records())
        if ev.index == -1:  # heal: done when every cut-off worker still running holds the heal round
            return all(self._workers[w].round >= f.round for w in f.peers if w in self._workers)
        return True

    def _fire(self, ev: _Event, worker: int, d: DiLoCo) -> None:
        f = ev.fault
        ev.fired = True
        if ev.index >= 0:
            self.fired.append((ev.index, f))
        log.info("event=fault_fired fault=%s by=%d", f, worker)
        if f.action == "kill":
            ev.done = True
            self._workers.pop(worker, None)
            self._cond.notify_all()
            if d.swarm is not None:
                d.swarm.crash()
            raise Killed(str(f))
        if ev.index == -1:  # a partition's heal
            self.cut = frozenset()
            self._cut_reports = {}
        elif f.action == "restart":
            self._workers.pop(f.peer, None)
            self._spawn(f.peer)  # its thread starts; `_finished` sees it once it is training
        elif f.action == "partition":
            self.cut = frozenset(f.peers)
            self._cut_reports = {}
            heal = Fault(d.round + f.rounds, "partition", peers=f.peers, rounds=f.rounds)
            self._events.append(_Event(heal, -1))
            self._events.sort(key=lambda e: e.fault.round)
            ev.done = True
        elif f.action == "poison":  # fires on the poisoner's own thread: `d` is its DiLoCo
            self.plans[f.peer].poison(f.factor)
            ev.done = True
        else:  # slow, degrade: the projection reads them from `fired`
            ev.done = True
        self._cond.notify_all()
