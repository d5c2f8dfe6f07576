"""The demo's live view and summary: plain data in, the figures a user looks for out."""

from __future__ import annotations

from rich.console import Console

from diloco.cli.dashboard import HEADERS, PeerView, demo_progress, demo_status, fit_columns, render, summary_table


def _text(renderable, width: int = 200) -> str:
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


def _busy_peer(i: int, **kw) -> PeerView:
    return PeerView(**{**dict(index=i, alive=True, exit_code=None, round=8, step=200, loss=2.345,
                              bytes_sent=123_400_000, bytes_received=123_100_000, utilization=0.956,
                              blocked_seconds=13.4, mean_bps=1_060_000.0, peak_bps=13_000_000.0), **kw})


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


def test_live_view_fits_80_columns_without_cutting_a_header_or_a_cell():
    peers = [_busy_peer(i) for i in range(12)] + [_busy_peer(12, alive=False, exit_code=137)]
    text = _text(render(peers, elapsed=4242.0, target_rounds=100), width=80)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 80 and "…" not in text
    header = next(ln for ln in lines if "peer" in ln and "state" in ln)
    for col in ("peer", "state", "round", "loss", "sent", "util", "Mbit/s avg/max"):
        assert col in header, (col, header)
    assert "exited 137" in text and "peer 12" in text and "8/100" in text
    wide = _text(render(peers, elapsed=42.0, target_rounds=100), width=120)
    assert all(col in wide for col in HEADERS)  # nothing dropped when there is room


def test_columns_are_dropped_least_telling_first():
    rows = [("peer 0", "training", "8/8", "200", "2.345", "12.3 MB", "12.1 MB", "95.6%", "3.4 s", "0.85/10.4")]
    assert len(fit_columns(HEADERS, rows, 200)) == len(HEADERS)
    assert [HEADERS[i] for i in fit_columns(HEADERS, rows, 90)] == [h for h in HEADERS if h != "recv"]
    assert [HEADERS[i] for i in fit_columns(HEADERS, rows, 80)] == [h for h in HEADERS if h not in ("recv", "blocked")]
    assert [HEADERS[i] for i in fit_columns(HEADERS, rows, 10)] == ["peer", "state"]


def test_summary_shows_the_compression_as_given_and_fits_80_columns():
    summary = {"peers_finished": 4, "rounds": 8, "heldout_loss": 2.1339, "initial_loss_reference": 5.545,
               "digests_agree": True, "params": 1853568, "inner_steps_total": 800, "compression": "e3m0:0",
               "compression_spec": "e3m0", "bits_per_param_sync": 4.0, "bytes_sent_total": 44_700_000,
               "data_parallel_bytes": 8_897_100_000, "reduction_vs_data_parallel": 199.0, "wall_seconds": 111.0,
               "utilization_per_peer": [0.956], "blocked_seconds_per_peer": [3.4]}
    text = _text(summary_table(summary), width=80)
    assert "e3m0: 4.000 bits/param/sync" in text and "e3m0:0" not in text
    assert max(len(ln) for ln in text.splitlines()) <= 80 and "…" not in text


def test_demo_progress_and_status_follow_the_slowest_peer():
    peers = [_busy_peer(0, round=3, step=75), _busy_peer(1, round=2, step=50, alive=False, exit_code=0, done=True),
             _busy_peer(2, round=1, step=25, alive=False, exit_code=1)]
    assert demo_progress(peers, target_rounds=8, inner_steps=25) == (8 * (75 / 200 + 1 + 25 / 200) / 3)
    assert demo_status(peers, 8) == "round 1/8 (slowest peer), 1 training, 1 done, 1 failed"
