"""Who is in the swarm: peer records with heartbeats in the DHT, membership decisions as pure
functions, and the reaper that takes a peer's child processes down with it."""

from .membership import (RoundPlan, banned_by_majority, departed, expected_peers, holders, plan_round, quorum,
                         resync_source, round_key_for, started_without, stragglers, voted_out, vouched)
from .records import DHTDirectory, Directory, InProcBoard, PeerRecord, parse_record

__all__ = ["DHTDirectory", "Directory", "InProcBoard", "PeerRecord", "expected_peers", "parse_record",
           "banned_by_majority", "departed", "holders", "quorum", "resync_source", "round_key_for",
           "started_without", "stragglers", "voted_out", "vouched", "RoundPlan", "plan_round"]
