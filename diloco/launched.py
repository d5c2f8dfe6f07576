"""A script's run under the launcher (`diloco start/join -- CMD`): what `DiLoCo` does only for such a run.

The launcher hands the script its swarm, checkpoints and metrics through the environment
(`diloco.environment.Launch`). For that run the worker joins the launcher's swarm when it attaches (from its last
checkpoint, when the launcher restarted it), holds its first step for `--wait-for N`, writes a metrics line per round
and a final one, leaves at the next inner step on SIGTERM/SIGINT, and ends the run as the bundled job does
(`diloco.lifecycle.end_run`). A `DiLoCo` given its own swarm, or none, never meets this module.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from .environment import WAIT_TIMEOUT, Launch
from .lifecycle import end_run, errors_as_lines, final_fields
from .metrics import close_launched
from .report import RoundReport

if TYPE_CHECKING:
    from .swarm import Swarm
    from .wrapper import DiLoCo

log = logging.getLogger(__name__)


class StopOnSignal:
    """SIGTERM / SIGINT for a worker the launcher started: leave at the next inner step (a site: at the
    next synchronization slot, every rank at the same one), applying the exchange in flight and telling
    the swarm, instead of dying mid-step. A second signal stops at once. SIGUSR2, sent to this process itself:
    end the whole swarm's run (`ended`; the launcher's SIGUSR2 says so through `DILOCO_END_FILE`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.ended = False
        self._saved: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._saved:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._saved[sig] = signal.signal(sig, self._on_signal)
        self._saved[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._on_end)

    def _on_end(self, _signum: int, _frame: object) -> None:
        self.ended = True

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("event=stop_requested signal=%s reason=leaving the swarm at the next inner step",
                    signal.Signals(signum).name)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved.clear()


class LaunchedRun:
    """The launched run of one worker: its launch, its stop signal, and the swarm it joined (and leaves)."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.stop = StopOnSignal()
        self._swarm: Swarm | None = None
        """The swarm we joined for the run: ours to close at its end."""

    @classmethod
    def from_env(cls) -> LaunchedRun | None:
        """The run this process belongs to (None when the launcher did not start it); from now on one of diloco's
        errors ends the process as one line, as from the bundled job."""
        launch = Launch.from_env()
        if launch is None:
            return None
        errors_as_lines()  # a wrong secret, run id or model: one line, not a traceback
        return cls(launch)

    def connect(self, d: DiLoCo) -> Swarm:
        """Join the launcher's swarm, after reading our last checkpoint when there is one (the launcher restarted
        us: we start from it, then catch up)."""
        if d.checkpoints.root is not None:
            d.checkpoints.read()
        self._swarm = self.launch.connect()
        return self._swarm

    def end_requested(self) -> bool:
        """Whether we were asked to end the whole swarm's run: SIGUSR2 to us, or to the launcher (its end file)."""
        return self.stop.ended or bool(self.launch.end_file and os.path.exists(self.launch.end_file))

    def hold_first_step(self, swarm: Swarm) -> None:
        """`--wait-for N`: wait until N peers (us included) are in the swarm, up to `WAIT_TIMEOUT`."""
        if self.launch.wait_for > 1:
            seen = swarm.wait_for_peers(self.launch.wait_for, WAIT_TIMEOUT)
            log.info("event=peers_present count=%d wanted=%d", seen, self.launch.wait_for)

    def round_line(self, d: DiLoCo, report: RoundReport) -> None:
        """The round's metrics line (the site's leader writes it)."""
        if not (self.launch.records_metrics and d.link.talks):
            return
        member = d.member
        peer = member.swarm.peer_id if member.swarm else ""
        self.launch.metrics_writer(peer).write("round", peer=peer, loss=d.loss, restart=self.launch.restart,
                                               round_steps=member.standing.covered,
                                               **{**report.as_dict(), "digest": member.report_digest(report)})

    def end(self, d: DiLoCo, completed: bool) -> None:
        """The run's end (`diloco.lifecycle`, as the bundled job's): linger, the final checkpoint and metrics line;
        then leave the swarm we joined."""
        self.stop.restore()
        end_run(d, completed=completed)
        if self.launch.records_metrics:
            fields = final_fields(d)
            self.launch.metrics_writer(str(fields["peer"]), sinks=d.link.talks).write(
                "final", rank=d.site.rank if d.site else 0, site_size=d.site.size if d.site else 1,
                restart=self.launch.restart, **fields)
            close_launched()
        if self._swarm is not None and d.member.swarm is not None:
            d.topology.close()
            d.topology.whole(d.member.swarm).close()
            d.member.swarm = self._swarm = None
