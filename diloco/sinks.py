"""Where a peer's metrics go besides its JSON lines: TensorBoard event files (`--tensorboard DIR`,
`pip install "diloco[tensorboard]"`) and Weights & Biases (`--wandb PROJECT`, `pip install
"diloco[wandb]"`). Both take the events the JSON lines carry (`round` after every synchronization,
`final` at the end) through `diloco.metrics.MetricsWriter`.

What they record: every number of an event (nested ones flattened: `usage/utilization`; bools as 0
or 1) as a scalar named `<event>/<field>` (`round/loss`, `round/bytes_sent`, `final/eval_loss`), at
the peer's inner step (`step`).

- TensorBoard: one run per peer, `DIR/<peer id>` (`tensorboard --logdir DIR` shows a swarm's peers
  side by side), through torch's `SummaryWriter`, flushed after every event.
- W&B: one run per peer, named by its peer id, grouped by the swarm's run id, with the swarm's and
  the job's settings as its config (never the secret). It logs online when an API key is there
  (`WANDB_API_KEY`, or `wandb login`) and offline otherwise, into `./wandb` (or `WANDB_DIR`): no
  network is touched, and `wandb sync` uploads the run later. `WANDB_MODE` (online, offline,
  disabled) overrides that choice.
"""

from __future__ import annotations

import logging
import math
import netrc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence
from urllib.parse import urlparse

from .compression.errors import DiLoCoError

log = logging.getLogger(__name__)

INSTALL = {"tensorboard": 'pip install "diloco[tensorboard]"', "wandb": 'pip install "diloco[wandb]"'}


class SinkError(DiLoCoError, RuntimeError):
    """A sink cannot be used; the message says why and what to do."""


class Sink(Protocol):
    name: str

    def log(self, event: str, fields: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(fields: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Pure: the finite numbers of `fields` by name (`prefix/name`), nested mappings flattened with "/",
    bools as 0.0 / 1.0; strings, lists, None and `time` (the line's wall clock) are left out."""
    out: dict[str, float] = {}
    for key, value in fields.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(scalars(value, name))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value) and key != "time":
            out[name] = float(value)
    return out


def step_of(fields: Mapping[str, Any]) -> int | None:
    step = fields.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def wandb_mode(environ: Mapping[str, str], netrc_path: str | None = None) -> tuple[str, str]:
    """Pure but for reading the netrc file: W&B's mode ("online", "offline", "disabled") and why."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], "WANDB_MODE is set"
    if environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc(netrc_path).authenticators(host):
            return "online", f"`wandb login` stored a key for {host}"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline", "no W&B API key (WANDB_API_KEY or `wandb login`); `wandb sync` uploads the run later"


def _require(module: str, extra: str, flag: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        raise SinkError(f"{flag} needs the {extra} package, which is not installed ({e}): {INSTALL[extra]}") from None


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, event: str, fields: Mapping[str, Any]) -> None:
        step = step_of(fields)
        when = fields.get("time")
        for name, value in scalars(fields, event).items():
            self._writer.add_scalar(name, value, global_step=step,
                                    walltime=when if isinstance(when, (int, float)) else None)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, peer: str, group: str, config: Mapping[str, Any]) -> None:
        import wandb

        mode, why = wandb_mode(os.environ)
        log.info("event=wandb_started project=%s mode=%s reason=%s", project, mode, why)
        self._run = wandb.init(project=project, name=peer or None, group=group or None, config=dict(config),
                               mode=mode, reinit="create_new")  # type: ignore[arg-type]  # never ends a run of yours
        self._run.define_metric("round/*", step_metric="round/step")
        self.mode, self.dir = mode, getattr(self._run, "dir", None)

    def log(self, event: str, fields: Mapping[str, Any]) -> None:
        values = scalars(fields, event)
        if values:
            self._run.log(values)

    def close(self) -> None:
        self._run.finish()


@dataclass(frozen=True)
class SinkConfig:
    """What the user asked for: a TensorBoard directory, a W&B project (either, both or none)."""

    tensorboard: str | None = None
    wandb: str | None = None

    def __bool__(self) -> bool:
        return bool(self.tensorboard or self.wandb)

    def require(self) -> None:
        """Raise `SinkError` naming the install line of each requested sink whose package is missing."""
        if self.tensorboard:
            _require("tensorboard", "tensorboard", "--tensorboard")
        if self.wandb:
            _require("wandb", "wandb", "--wandb")

    def open(self, peer: str, run_id: str, config: Mapping[str, Any]) -> list[Sink]:
        """The sinks for peer `peer` of swarm `run_id` (`config`: settings for W&B's run config). Raises
        `SinkError` when one cannot start (its package missing, W&B refusing the project)."""
        self.require()
        sinks: list[Sink] = []
        what = "TensorBoard"
        try:
            if self.tensorboard:
                sinks.append(TensorBoardSink(Path(self.tensorboard) / (peer or "local")))
            what = "W&B"
            if self.wandb:
                sinks.append(WandbSink(self.wandb, peer, run_id, config))
        except Exception as e:  # noqa: BLE001 - the libraries raise many types; the peer must say which sink
            close_all(sinks)
            fix = "--tensorboard" if what == "TensorBoard" else "--wandb (WANDB_MODE=offline logs without a network)"
            raise SinkError(f"cannot start {what} logging: {type(e).__name__}: {e}; fix it, or leave out {fix}") from e
        return sinks


def close_all(sinks: Sequence[Sink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort: the JSON lines hold everything
            log.warning("event=%s_close_failed reason=%s", sink.name, e)
