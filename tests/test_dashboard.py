"""The demo's live view and summary: plain data in, the figures a user looks for out."""

from __future__ import annotations

from rich.console import Console

from diloco.dashboard import PeerView, render, summary_table


def _text(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_live_view_shows_utilization_blocked_time_and_bandwidth():
    peers = [
        PeerView(index=0, alive=True, exit_code=None, round=2, step=55, loss=2.5, bytes_sent=3_000_000,
                 bytes_received=2_000_000, utilization=0.976, blocked_seconds=1.25, mean_bps=125_000.0,
                 peak_bps=1_000_000.0),
        PeerView(index=1, alive=False, exit_code=1, round=1, step=20, loss=None, bytes_sent=0, bytes_received=0),
    ]
    text = _text(render(peers, elapsed=42.0, target_rounds=3))
    assert "1/2 peers alive" in text
    assert "97.6%" in text and "1.2 s" in text and "1.00/8.0" in text  # Mbit/s mean/peak
    assert "exited 1" in text


def test_summary_shows_streaming_settings_and_mean_utilization():
    summary = {"peers_finished": 2, "rounds": 3, "heldout_loss": 2.3, "initial_loss_reference": 5.545,
               "digests_agree": True, "params": 1000, "inner_steps_total": 360, "compression": "e3m0",
               "bits_per_param_sync": 4.0, "bytes_sent_total": 5_000_000, "data_parallel_bytes": 900_000_000,
               "reduction_vs_data_parallel": 180.0, "wall_seconds": 60.0,
               "streaming": {"fragments": 4, "overlap": 10, "alpha": 0.5, "outer_overlap": "none"},
               "utilization_per_peer": [0.97, 0.99], "blocked_seconds_per_peer": [1.0, 0.0]}
    text = _text(summary_table(summary))
    assert "4 fragments, tau=10, alpha=0.5" in text
    assert "98.0%" in text and "0.5 s per peer" in text
    plain = dict(summary, streaming={"fragments": 1, "overlap": 0, "alpha": 0.0, "outer_overlap": "none"})
    assert "fragments" not in _text(summary_table(plain))
