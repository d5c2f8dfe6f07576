"""`RoundReport`: what one synchronization did, for logs, metrics, `on_round` and the live view."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RoundReport:
    """What one synchronization did, for logs, metrics and the live view."""

    round: int  # the global round reached after this sync
    committed: bool
    reason: str
    peers: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    step: int
    resynced: bool = False
    payload_bytes: int = 0  # encoded size of our contribution (all spans), without framing
    numel: int = 0  # parameters synchronized
    fragment: int = 0  # which fragment this round synchronized (0 when the model is one fragment)
    blocked: bool = False  # the training loop had to wait for this round's result
    phases: dict[str, float] = field(default_factory=dict)
    """Where the round's time went, in seconds: plan, gather, encode, exchange (or fetch), decide (`RoundOutcome.phases`)."""
    merge: bool = False
    """A merge of the regions (`diloco.regions`): our representative's round of the swarm, or our download of
    the region state it merged into; `round` is the region round it made."""
    digest: str = ""
    """The digest of the state the report names when that is not the state held as it is written (a
    representative's merge, reported once a member holds it: `Regions`); "" otherwise (the state held then)."""

    @property
    def bits_per_param(self) -> float:
        """What our contribution cost on the wire per parameter: the codec's bits/param/sync."""
        return 8 * self.payload_bytes / self.numel if self.numel else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "bits_per_param": round(self.bits_per_param, 5)}
