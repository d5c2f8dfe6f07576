"""The swarm's clock (comms/clock.py): a peer whose wall clock steps, or that joins with its clock off, reads the
swarm's time in its directory and keeps training with the others."""

from __future__ import annotations

import json
import os
import secrets
import time

import pytest

from diloco.comms.clock import SwarmClock, swarm_offset
from diloco.comms.faults import CLOCK_STEP_FILE
from fresh import fresh_python
from multiproc_util import TINY, Peers


@pytest.mark.unit
def test_the_swarm_offset_is_the_lower_median_of_ours_and_the_others():
    assert swarm_offset(0.0, []) == 0.0  # alone: our clock
    assert swarm_offset(0.0, [-30.0, -30.2]) == -30.0  # our clock stepped 30 s ahead: we follow the two others
    assert swarm_offset(0.0, [0.1, 30.0]) == 0.0  # another peer's clock stepped: ours stays
    assert swarm_offset(0.0, [-30.0]) == -30.0  # two peers, ours ahead: we follow the other
    assert swarm_offset(0.0, [30.0]) == 0.0  # two peers, ours behind: the other follows us (one time for both)
    assert swarm_offset(0.0, [1.5, 1.9]) == 0.0  # within the deadband: the delays of a sample, left alone
    assert swarm_offset(0.0, [1.5, 1.9], deadband=1.0) == 1.5
    assert swarm_offset(120.0, [120.3]) == 120.0  # we took the swarm's time: our vote holds it
    assert swarm_offset(120.0, [-30.0, -30.0]) == -30.0  # and a step of ours is followed as before
    assert swarm_offset(0.0, [120.0], joining=True) == 120.0  # a joiner takes the swarm's time, whoever is behind


@pytest.mark.unit
@pytest.mark.unit
def test_the_handshakes_samples_count_until_the_first_dht_request():
    raw = [1000.0]  # the swarm's time is 880
    clock = SwarmClock(raw=lambda: raw[0])
    clock.record(b"hello/a", -120.0, provisional=True)
    clock.record(b"hello/b", -120.0, provisional=True)
    assert clock.offset == -120.0  # joined with a clock 120 s fast: the swarm's time from the start
    raw[0] = 850.0  # then our clock steps back by 150 s, to 30 s slow
    clock.observe(b"node-a", 880.0)  # the first request says so (the handshakes' samples no longer count)
    assert clock.offset == -120.0  # one against one: the lower time holds (node-a would follow it)
    clock.observe(b"node-b", 880.0)
    assert clock.offset == 30.0
    clock.record(b"hello/c", -500.0, provisional=True)  # a handshake's after requests arrived: they tell
    assert clock.offset == 30.0


def test_a_clock_follows_fresh_samples_and_forgets_old_ones():
    raw = [1000.0]
    clock = SwarmClock(raw=lambda: raw[0], window=0.2)
    clock.observe(b"a", 970.0)  # a's swarm time read 970 when it sent what we read at 1000
    clock.observe(b"b", 970.5)
    assert clock.offset == -30.0 and clock.now() == 970.0  # a's sample alone moves it; b's is within the deadband
    time.sleep(0.3)
    clock.observe(b"c", 1000.1)  # a and b not heard from within the window: their samples no longer count
    clock.observe(b"d", 1000.1)
    assert clock.offset == pytest.approx(0.1) and clock.now() == pytest.approx(1000.1)


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
    common = ["--rounds", "60", "-H", "5", "--wait-for", "3", *TINY]
    try:
        procs = [peers.spawn(0, ["start", *common])]
        addr = peers.address(0)
        procs += [peers.spawn(1, ["join", addr, *common]),
                  peers.spawn(2, ["join", addr, *common], env={CLOCK_STEP_FILE: str(step)})]
        deadline = time.monotonic() + 150
        while not any(r["committed"] and r["peers"] == 3 for r in peers.lines(0, "round")):
            assert time.monotonic() < deadline and procs[2].poll() is None, peers.log(2)
            time.sleep(0.2)
        step.write_text("30")
        stepped_at = time.time()
        for i, p in enumerate(procs):
            assert peers.wait(p, 150) == 0, peers.log(i)
        rounds = peers.lines(0, "round")  # peer 0's clock is the machine's
        after = [r for r in rounds if r["time"] > stepped_at + 5]
        assert sum(r["committed"] and r["peers"] == 3 for r in rounds if r["time"] > stepped_at) >= 10 and after and \
            all(r["committed"] and r["peers"] == 3 for r in after), \
            [(r["round"], r["committed"], r["peers"], r.get("reason")) for r in rounds if r["time"] > stepped_at]
        finals = [peers.lines(i, "final")[-1] for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1 and finals[0]["round"] == 60, json.dumps(finals)
        said = [line for line in peers.log(2, whole=True).splitlines() if "event=swarm_clock" in line]
        assert len(said) >= 2 and "offset=120" in said[0] and "offset=-30" in said[-1], said
    finally:
        peers.kill_all()
