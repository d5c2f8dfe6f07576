"""Open-file limit: a peer raises its soft RLIMIT_NOFILE to the hard limit before it starts its daemon.

Every libp2p stream a peer serves costs one file descriptor in the peer (the daemon hands it over a
unix socket) and one in its p2pd, which inherits our limits. The common soft limit of 1,024 is low
for that: a stranger's stalled streams once took a peer past it, and the peer died on the next file
it opened (docs/BENCHMARKS.md, "Stalled streams"). The stream gate (`streamgate.py`) bounds what
strangers can hold; raising the soft limit to the hard one leaves room for the swarm's own calls.

Failure semantics: never raises. A limit that cannot be raised (no `resource` module, a hard limit
the kernel refuses) is logged once, naming the fix, and the peer runs with what it has.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

LOW = 4096
"""A hard limit below this gets a warning: a peer under attack may need more descriptors."""
UNLIMITED_TARGET = 1 << 20
"""What to raise the soft limit to when the hard limit is unlimited (Linux's default fs.nr_open)."""


def soft_target(soft: int, hard: int, infinity: int) -> int | None:
    """The soft limit to set, or None to leave it: the hard limit (or `UNLIMITED_TARGET` when the hard
    limit is `infinity`), never lower than the soft limit is now."""
    target = UNLIMITED_TARGET if hard == infinity else hard
    if soft == infinity or soft >= target:
        return None
    return target


@functools.cache
def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft open-files limit to its hard limit (children started later inherit
    it); returns the (soft, hard) in force afterwards, None where the platform has no such limit.
    Acts (and logs) on the first call only."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = soft_target(soft, hard, resource.RLIM_INFINITY)
    if target is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("event=open_files_limit_raised soft=%d new_soft=%d hard=%s", soft, target, hard)
            soft = target
        except (ValueError, OSError) as e:
            log.warning("event=open_files_limit_unchanged soft=%d hard=%s reason=%s", soft, hard, e)
    if soft < LOW:
        log.warning("event=open_files_limit_low soft=%d hard=%s: a peer may run out of file descriptors under "
                    "load; raise the hard limit (`ulimit -Hn`, or nofile in /etc/security/limits.conf, or "
                    "LimitNOFILE= in a systemd unit) to at least %d", soft, hard, LOW)
    return soft, hard
