"""While a round's exchange runs (`diloco.comms.reduction`): whether the members we wait on still run it.

`watch` probes them (`diloco.probe`) every third of an answer window; a member that cannot be reached, stays silent
through the window, no longer runs the attempt or answers from another process is `gone`, so that every member gives
the attempt up within a probe interval instead of at the result deadline. `on_probe` answers another member's probe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from diloco.compression import PayloadRejected

from . import messages as msg
from .rounds import Exchange
from .transport import CallTimedOut, PeerId, TransportError

if TYPE_CHECKING:
    from .collective import Collective

log = logging.getLogger(__name__)


async def watch(c: Collective, r: Exchange) -> None:
    """While we wait on members of our view (their results, their contributions to our spans), ask them every
    third of an answer window (at least 1 s) whether they still run it (`diloco.probe`). One that cannot be
    reached (killed), stays silent through the window while nothing else came from it (frozen), no longer runs
    this attempt (gave it up), or answers from another process (restarted) is `gone`: its contributions are not
    waited for, and a span it owns gets no result, so every member of the view gives the attempt up within a
    probe interval of each other instead of at the result deadline (with the default timeouts a killed member
    is found ~1 s into the exchange, a frozen one ~4 s). Giving an attempt up is always safe: we accepted nothing in
    it. One that answers that its contribution to us could not be delivered is not waited for as a contributor
    (`owes_nothing`)."""
    window = c.cfg.answer_timeout
    while True:
        await asyncio.sleep(max(1.0, window / 3))
        awaited = r.awaited() - r.rs.gone.keys() - r.rs.elsewhere
        await asyncio.gather(*(_probe(c, r, p, window) for p in awaited))


async def _probe(c: Collective, r: Exchange, peer: PeerId, window: float) -> None:
    rs = r.rs
    heard = c.transport.counter.per_peer.get(peer, [0, 0])[1]
    try:
        reply = await c.transport.call(peer, "diloco.probe", c.frame(msg.PROBE, r.key, view=rs.vid), window)
        meta = msg.read_ack(reply, run=c.run_id, caller=peer)
    except CallTimedOut:
        if c.transport.counter.per_peer.get(peer, [0, 0])[1] != heard:
            return  # its reply is queued behind the bytes it is sending us: busy, not frozen
        why = f"silent for {window:.1f} s"
        c.mark_silent(peer)
    except TransportError as e:
        why = f"unreachable: {e}"
        c.mark_silent(peer)
    except PayloadRejected as e:
        why = f"its reply to our probe was refused: {e.detail}"
    else:
        c.silent.pop(peer, None)
        inc, joined = meta.get("inc"), rs.incarnations.get(peer, 0)
        if meta.get("ok", False) and joined and type(inc) is int and inc != joined:
            why = "restarted since it joined this attempt (another process under its peer id)"
        elif meta.get("ok", False) and meta.get("running") is True:
            if meta.get("undelivered") is True and peer not in rs.owes_nothing:  # our span: reduce without it
                rs.owes_nothing.add(peer)
                rs.changed.set()
                log.info("event=contribution_undeliverable round=%s peer=%s", r.key, peer)
            return
        else:
            why = "no longer runs this attempt" if meta.get("ok", False) else \
                f"refused our probe ({meta.get('reason')})"
    if peer not in rs.gone and rs.vid:
        rs.gone[peer] = why
        rs.changed.set()
        log.info("event=member_gone round=%s peer=%s reason=%s", r.key, peer, why)


async def on_probe(c: Collective, caller: PeerId, data: bytes) -> bytes:
    """A member of a view asks whether we still run it (`watch`): `running` is true while our attempt of that
    key is under way and either still gathering or closed on that view. No side effect."""
    try:
        header, _, key = c.decode_from(caller, data, msg.PROBE, 0)
        rs = c.rounds.get(key)
        running = key == c.floor and rs is not None and rs.expected is not None and \
            (rs.view is None or rs.vid == header.view)
        extra: dict[str, Any] = {"undelivered": True} if running and rs is not None and caller in rs.undeliverable \
            else {}
        return msg.ack(run=c.run_id, sender=c.me, running=running, inc=c.incarnation, **extra)
    except PayloadRejected as e:
        return c.reject(caller, e)
