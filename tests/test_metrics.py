"""Metrics and status files (diloco/metrics.py): a write that fails never stops the peer."""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading

import pytest

from diloco import metrics
from diloco.metrics import MetricsWriter, read_jsonl, write_status


@pytest.mark.unit
def test_a_failed_write_is_counted_logged_once_and_training_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(metrics, "write_failures", metrics.write_failures.__class__())
    monkeypatch.setattr(metrics, "_logged", set())
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    writer.write("round", round=1)
    path.unlink()
    path.mkdir()  # the metrics file is now a directory: every append fails
    writer.write("round", round=2)
    writer.write("round", round=3)
    write_status(tmp_path / "gone" / "status.json", step=1)  # its directory does not exist
    assert dict(metrics.write_failures) == {"metrics": 2, "status": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "event=metrics_write_failed" in warnings[0] and "training goes on" in warnings[0]
    assert "event=status_write_failed" in warnings[1]


@pytest.mark.unit
def test_out_of_file_descriptors_is_a_counted_failure_not_a_crash(tmp_path, monkeypatch):
    """What killed a peer under a flood of stalled streams: EMFILE when it opened its metrics file."""
    monkeypatch.setattr(metrics, "write_failures", metrics.write_failures.__class__())
    monkeypatch.setattr(metrics, "_logged", set())
    writer = MetricsWriter(tmp_path / "m.jsonl")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # a new descriptor takes the lowest free number: forbid it and every higher one
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        with pytest.raises(OSError) as e:  # no descriptor left, as under the flood
            open(tmp_path / "probe", "w")
        assert e.value.errno == errno.EMFILE
        writer.write("round", round=1)
        write_status(tmp_path / "status.json", step=1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert dict(metrics.write_failures) == {"metrics": 1, "status": 1}
    writer.write("round", round=2)  # descriptors back: writes resume
    assert [r["round"] for r in read_jsonl(tmp_path / "m.jsonl")] == [2]


@pytest.mark.unit
def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    from diloco.comms.fdlimit import UNLIMITED_TARGET, soft_target

    inf = -1
    assert soft_target(1024, 524288, inf) == 524288
    assert soft_target(1024, 1024, inf) is None  # nothing to raise
    assert soft_target(4096, 2048, inf) is None  # never lowered
    assert soft_target(1024, inf, inf) == UNLIMITED_TARGET
    assert soft_target(inf, inf, inf) is None


@pytest.mark.unit
def test_a_line_waits_for_a_value_hashed_beside_training_and_the_lines_keep_their_order(tmp_path):
    """A round's digest is hashed on a thread of its own (diloco.holding): its line is written once the digest is
    there, the lines after it wait behind it, nothing waits on the writing thread, and close() writes the rest."""
    from diloco.holding import Later

    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    first, second = Later(), Later()
    writer.write("round", round=1, digest=first)
    writer.write("round", round=2, digest=first)  # a failed round: the same state
    assert not path.exists()  # not yet: nothing waited for the digest either
    first.set("aa")
    assert [(r["round"], r["digest"]) for r in read_jsonl(path)] == [(1, "aa"), (2, "aa")]
    writer.write("round", round=3, digest=second)
    writer.write("final", round=3, digest="bb")
    assert len(read_jsonl(path)) == 2
    threading.Timer(0.2, second.set, ("bb",)).start()
    writer.close()  # waits for what is still being computed (here: by another thread)
    assert [(r["event"], r["digest"]) for r in read_jsonl(path)][2:] == [("round", "bb"), ("final", "bb")]
