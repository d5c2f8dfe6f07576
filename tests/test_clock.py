"""The swarm's clock (comms/clock.py): a peer whose wall clock steps, or that joins with its clock off, reads the
swarm's time in its directory and keeps training with the others."""

from __future__ import annotations

import json
import os
import re
import secrets
import time

import pytest

from diloco.comms.clock import SwarmClock
from diloco.comms.faults import CLOCK_STEP_FILE
from fresh import fresh_python
from multiproc_util import TINY, Peers


@pytest.mark.unit
def test_a_step_of_the_wall_clock_is_taken_back_at_the_next_read():
    wall, boot = [1000.0], [50.0]
    clock = SwarmClock(raw=lambda: wall[0], boot=lambda: boot[0])
    assert clock.now() == 1000.0
    wall[0], boot[0] = 1031.0, 51.0  # one second later the wall clock reads 30 s ahead
    assert clock.now() == 1001.0 and clock.offset == -30.0
    wall[0], boot[0] = 1002.5, 52.5  # and it steps back
    assert clock.now() == 1002.5 and clock.offset == 0.0
    wall[0], boot[0] = 1004.0, 53.5  # half a second of drift: within the deadband, left alone
    assert clock.now() == 1004.0
    wall[0], boot[0] = 5000.0, 54.0  # a VM resumed from an old snapshot: any size
    assert clock.now() == pytest.approx(1004.5)


@pytest.mark.unit
def test_a_joiner_adopts_the_median_of_the_swarm_clocks_it_shook_hands_with():
    wall, boot = [1000.0], [50.0]
    clock = SwarmClock(raw=lambda: wall[0], boot=lambda: boot[0])
    clock.adopt([1.0, -0.5])  # an NTP-synchronized machine: nothing to take
    assert clock.offset == 0.0
    clock.adopt([120.2, 119.8, 119.9])  # joined with its clock 120 s slow
    assert clock.offset == 119.9 and clock.now() == 1119.9
    wall[0], boot[0] = 1151.0, 51.0  # then its clock steps to 30 s fast: taken back, the swarm's time kept
    assert clock.now() == pytest.approx(1120.9)
    clock.adopt([])
    assert clock.offset == pytest.approx(-30.1)


@pytest.mark.unit
def test_hivemind_reads_the_clock_it_is_given_in_every_module_loaded_now_or_later():
    done = fresh_python(
        "import diloco\n"
        "from diloco.comms.clock import use_in_hivemind\n"
        "import hivemind.utils.timed_storage as ts, hivemind.dht.routing as routing, hivemind.dht.protocol as proto\n"
        "use_in_hivemind(lambda: 12345.0)\n"
        "import hivemind.dht.node as node\n"  # loaded after: it takes the name from routing
        "print(ts.get_dht_time(), routing.get_dht_time(), proto.get_dht_time(), node.get_dht_time())\n")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["12345.0"] * 4


@pytest.mark.unit
def test_a_stepped_clock_reads_the_file_and_leaves_the_monotonic_clock_alone(tmp_path):
    step = tmp_path / "step"
    done = fresh_python(
        "import time\n"
        "from diloco.comms.faults import FaultPlan\n"
        "import hivemind.utils.timed_storage as ts\n"
        "real, mono = time.time(), time.monotonic()\n"
        "FaultPlan.from_env()\n"
        "off = lambda: round(time.time() - real - (time.monotonic() - mono))\n"
        "first = off()\n"
        f"open({str(step)!r}, 'w').write('-30')\n"
        "time.sleep(0.3)\n"
        "print(first, off(), round(ts.get_dht_time() - time.time()), time.monotonic() - mono < 5)\n",
        env={**os.environ, CLOCK_STEP_FILE: str(step)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "-30", "0", "True"]  # missing file: 0; then 30 s behind, the DHT's too


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_peer_that_joins_with_its_clock_off_and_whose_clock_steps_trains_on_with_the_swarm(tmp_path):
    """Peer 2 joins with its wall clock 120 s slow (it adopts the swarm's time from the handshake); once it commits
    rounds with the others, its clock steps to 30 s fast (150 s forward at once). The rounds go on with all three
    (from 5 s after the step every one), the three end on one state, and peer 2 said twice that its clock is off
    the swarm's. Without the swarm's clock the join is refused (a clock 120 s off), and a clock that steps 30 s ahead
    reads every other record expired: the stepped peer sees nobody ("no quorum") while the others, who still read
    its last record, wait for it: the swarm stands still."""
    peers = Peers(tmp_path, f"clock-{secrets.token_hex(3)}")
    step = tmp_path / "peer2.clock"
    step.write_text("-120")
    common = ["--rounds", "30", "-H", "5", "--wait-for", "3", *TINY]
    try:
        procs = [peers.spawn(0, ["start", *common])]
        addr = peers.address(0)
        procs += [peers.spawn(1, ["join", addr, *common]),
                  peers.spawn(2, ["join", addr, *common], env={CLOCK_STEP_FILE: str(step)})]
        deadline = time.monotonic() + 150
        while not any(r["committed"] and r["peers"] == 3 for r in peers.lines(0, "round")):
            assert time.monotonic() < deadline and procs[2].poll() is None, peers.log(2)
            time.sleep(0.2)
        (tmp_path / "peer2.clock.tmp").write_text("30")  # whole or not at all: the peer reads it any moment
        os.replace(tmp_path / "peer2.clock.tmp", step)
        stepped_at = time.time()
        for i, p in enumerate(procs):
            assert peers.wait(p, 150) == 0, peers.log(i)
        rounds = peers.lines(0, "round")  # peer 0's clock is the machine's
        after = [r for r in rounds if r["time"] > stepped_at + 5]
        assert sum(r["committed"] and r["peers"] == 3 for r in rounds if r["time"] > stepped_at) >= 10 and after and \
            all(r["committed"] and r["peers"] == 3 for r in after), \
            [(r["round"], r["committed"], r["peers"], r.get("reason")) for r in rounds if r["time"] > stepped_at]
        finals = [peers.lines(i, "final")[-1] for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1 and finals[0]["round"] == 30, json.dumps(finals)
        said = [line for line in peers.log(2, whole=True).splitlines() if "event=swarm_clock" in line]
        offsets = [float(re.search(r"offset=(-?[0-9.]+)", line).group(1)) for line in said]  # type: ignore[union-attr]
        # (the offsets as read, within a second: the busy suite's said -29.9)
        assert len(said) >= 2 and abs(offsets[0] - 120) < 1 and abs(offsets[-1] + 30) < 1, said
    finally:
        peers.kill_all()
