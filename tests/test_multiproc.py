"""Real peers: `diloco start` / `diloco join` processes with hivemind daemons on 127.0.0.1; and, in this
process, their refusal of bad input before any peer starts.

Each test has a hard timeout (pytest-timeout) and the autouse `no_orphans` fixture fails it if any
peer process or p2pd daemon survives it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import signal
import subprocess
import sys
import time
from contextlib import suppress
from typing import Callable

import psutil
import pytest

from cli_util import invoke, refuse_to_start
from multiproc_util import TINY, Peers, new_peer_ids

from diloco.comms.faults import PHASES
from diloco.job.train import training_device


@pytest.fixture
def peers(tmp_path):
    group = Peers(tmp_path, f"t-{secrets.token_hex(3)}")
    yield group
    group.kill_all()


def _bit_identical(peers: Peers, rounds: int, bits: Callable[[float], bool]) -> list[dict]:
    """What every clean run of 3 real peers shows, whatever else a test does to it: each ends at `rounds` with the
    same global-state digest (SHA-256 over every parameter and outer-optimizer buffer, i.e. bit-identical global
    parameters) and held-out loss, logs no error, drops no directory record, and every round commits with all
    three, its phases and codec cost (`bits` of its bits per parameter) reported. Returns the final lines."""
    finals = [peers.lines(i, "final")[-1] for i in range(3)]
    assert {f["round"] for f in finals} == {rounds}
    assert {f["device"] for f in finals} == {str(training_device("auto"))}  # the default, --device auto
    for i in range(3):  # a clean run logs no error, not even at shutdown (no task left pending on the loop)
        assert " ERROR " not in peers.log(i, whole=True) and "Traceback" not in peers.log(i, whole=True), peers.log(i)
    # every peer signs its directory records, and every record checks: nothing dropped (frames may be
    # refused in an honest run: a late frame of a round the receiver finished is `wrong_round`)
    assert all(f["records_dropped"] == {} for f in finals), [f["records_dropped"] for f in finals]
    assert len({f["digest"] for f in finals}) == 1, finals
    assert len({f["eval_loss"] for f in finals}) == 1  # same global model, same held-out loss
    committed = [r for i in range(3) for r in peers.lines(i, "round") if r["committed"]]
    assert all(r["peers"] == 3 for r in committed), committed
    assert all(r["bytes_sent"] > 0 for r in committed)
    # where each round's time went, as a metrics reader sees it
    timed = [(r["phases"], r["seconds"]) for r in committed]
    assert all(set(phases) == {"plan", "gather", "encode", "exchange", "decide"} for phases, _ in timed), timed
    assert all(sum(phases.values()) <= seconds + 0.005 for phases, seconds in timed), timed  # both rounded to ms
    assert all(bits(r["bits_per_param"]) for r in committed), committed  # the codec's cost per parameter, as reported
    return finals


@pytest.mark.multiproc
def test_sparse_rounds_go_direct_a_blocked_data_port_is_called_through_libp2p_and_strangers_there_are_refused(peers):
    """3 real peers train with a sparse codec (per-coordinate averaging of bundled payloads, error feedback) and end
    bit-identical (`_bit_identical`), over the data plane (docs/PROTOCOL.md, "The data plane"): the third advertises
    a data port nothing listens on (blocked, as a firewall would), so the others call it through libp2p and
    everything else goes direct. Meanwhile a stranger at peer 0's data port tries a handshake with another secret
    and sends bytes that are no handshake: both are refused and counted in peer 0's final line, and every round
    commits with all three peers. (One swarm for all of it: each real peer costs ~3.5 CPU-s to start. Dense fp32
    rounds of real processes: the launcher's sites, tests/test_launcher.py.)"""
    import asyncio

    from diloco.bench.flood import stranger_handshake
    from diloco.comms.auth import derive
    from diloco.comms.identity import Identity

    ports = []
    for _ in range(2):  # one for peer 0's data port, one that nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, blocked = ports
    common = ["--rounds", "4", "-H", "5", "--wait-for", "3", "--compression", "topk:16/256+s2+ef:0.95", *TINY]
    first = peers.spawn(0, ["start", *common, "--data-port", str(port)])
    addr = peers.address(0)
    others = [peers.spawn(1, ["join", addr, *common]),
              peers.spawn(2, ["join", addr, *common, "--data-announce", f"127.0.0.1:{blocked}"])]

    async def stranger() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await stranger_handshake(reader, writer, Identity.generate(),
                                 derive(b"another secret entirely", f"data/{peers.run_id}"))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # refused: closed
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100))
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()

    asyncio.run(stranger())
    for i, p in enumerate([first, *others]):
        assert peers.wait(p, 90) == 0, peers.log(i)
    finals = _bit_identical(peers, 4, lambda bits: 0 < bits < 2)
    ids = [f["peer"] for f in finals]
    assert finals[0]["data_paths"] == {"direct": [ids[1]], "libp2p": [ids[2]]}, finals[0]["data_paths"]
    assert finals[1]["data_paths"] == {"direct": [ids[0]], "libp2p": [ids[2]]}, finals[1]["data_paths"]
    assert finals[2]["data_paths"] == {"direct": sorted(ids[:2])}, finals[2]["data_paths"]
    assert "event=data_path" in peers.log(0, whole=True) + peers.log(1, whole=True)  # the fallback is logged
    refused = finals[0]["auth_refused"]
    assert refused.get("data_unauthorized") == 1 and refused.get("data_malformed") == 1, refused


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_peer_that_takes_no_inbound_connection_trains_with_the_swarm_through_the_connections_it_opens(tmp_path):
    """A WAN lab of 3 hosts where host 1 takes no new TCP connection (as behind a NAT or a firewall that lets
    connections out only: the lab's forwarder drops every SYN to it). It joins and trains: the others' calls to it go
    through libp2p over the connections it opened (its data port cannot be dialed), its own calls go direct, and all
    three end on one digest. The others give up dialing its data port after `CONNECT_TIMEOUT` (2 s), within the first
    round's deadlines: with the handshake's 5 s instead, the first two rounds went on without it."""
    from diloco.bench.lab import run_swarm
    from diloco.bench.wan import WanLab

    with WanLab(3, rate_mbit=100, delay_ms=5, backend="tun") as lab:
        lab.inbound(1, False)
        lines = run_swarm(lab, 3, ["--rounds", "4", "-H", "5", "--wait-for", "3", *TINY], tmp_path, 240)
    finals = [[ln for ln in w if ln.get("event") == "final"][-1] for w in lines]
    assert {f["round"] for f in finals} == {4} and len({f["digest"] for f in finals}) == 1, finals
    ids = [f["peer"] for f in finals]
    assert finals[0]["data_paths"] == {"direct": [ids[2]], "libp2p": [ids[1]]}, finals[0]["data_paths"]
    assert finals[2]["data_paths"] == {"direct": [ids[0]], "libp2p": [ids[1]]}, finals[2]["data_paths"]
    assert finals[1]["data_paths"] == {"direct": sorted([ids[0], ids[2]])}, finals[1]["data_paths"]
    # it took part in the rounds, not only downloaded their result (2 of 4 before the connect deadline)
    assert finals[1]["committed_rounds"] >= 3, [(ln["round"], ln["committed"], ln.get("reason"))
                                                 for ln in lines[1] if ln.get("event") == "round"]


@pytest.mark.multiproc
@pytest.mark.timeout(360)
def test_two_peers_behind_nats_train_through_a_relay_and_through_its_restart(tmp_path):
    """A WAN lab of 4 hosts: 0 starts the swarm, 1 joins with `--relay`, 2 and 3 take no inbound connection (the
    lab's forwarder drops every SYN to them, as a NAT or a firewall that lets connections out only does; addresses
    are not rewritten). Without relays 2 and 3 could not reach each other at all. Here each learns from the relay's
    probe that it cannot be dialed, keeps connections waiting at the relay, and everyone calls them through it. The
    relay is SIGKILLed at round 3: the two log that it is lost, their calls go through libp2p where the caller can
    (to and from the members they dialed themselves), and when the relay is back (the same identity, another data
    port) they wait there again and are called through it. All four end on one digest."""
    from diloco.bench.wan import WanLab
    from diloco.metrics import read_jsonl

    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32)}
    run_id = f"nat-{secrets.token_hex(3)}"
    key = tmp_path / "relay.key"
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(lab: WanLab, i: int, name: str, verb: list[str], extra: list[str]) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = lab.popen(i, [sys.executable, "-m", "diloco", *verb, "--host", lab.address(i), "--run-id",
                                        run_id, "--rounds", "12", "-H", "5", "--wait-for", "4", *TINY, "--shard",
                                        str(i), "--metrics", str(tmp_path / f"{name}.jsonl"), "--address-file",
                                        str(tmp_path / f"{name}.addr"), *extra],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def until(check, what: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not check():
            dead = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0) and n != "relay"}
            assert not dead and time.monotonic() < deadline, (what, dead)
            time.sleep(0.2)

    def text(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    with WanLab(4, rate_mbit=100, delay_ms=5, backend="tun") as lab:
        lab.inbound(2, False)
        lab.inbound(3, False)
        spawn(lab, 0, "first", ["start"], [])
        until(lambda: (tmp_path / "first.addr").exists(), "the first peer's address")
        addr = (tmp_path / "first.addr").read_text().split()[0]
        relay = ["join", addr, "--relay", "--identity", str(key)]
        spawn(lab, 1, "relay", relay, [])
        spawn(lab, 2, "a", ["join", addr], [])
        spawn(lab, 3, "b", ["join", addr], [])
        rounds = lambda: [r for r in read_jsonl(tmp_path / "first.jsonl") if r.get("event") == "round"]  # noqa: E731
        until(lambda: sum(r["committed"] for r in rounds()) >= 3, "3 rounds committed")
        procs["relay"].kill()
        procs["relay"].wait()
        until(lambda: "event=relay_lost" in text("a") and "event=relay_lost" in text("b"), "the relay lost")
        spawn(lab, 1, "relay2", relay, [])
        for name, p in procs.items():
            if name != "relay":
                assert p.wait(timeout=240) == 0, text(name)[-3000:]
    finals = {n: [ln for ln in read_jsonl(tmp_path / f"{n}.jsonl") if ln.get("event") == "final"][-1]
              for n in ("first", "relay2", "a", "b")}
    assert {f["round"] for f in finals.values()} == {12} and len({f["digest"] for f in finals.values()}) == 1, finals
    ids = {n: f["peer"] for n, f in finals.items()}
    for me, other in (("a", "b"), ("b", "a")):
        assert "event=reach path=relay" in text(me) and "event=relay_back" in text(me), text(me)[-3000:]
        # (where it waits when its final line is written depends on whether the relay ended its run first)
        assert finals[me]["relays"]["reachable"] is False and finals[me]["relays"]["served_through"][ids["relay2"]] > 0
        assert ids[other] in finals[me]["data_paths"]["relay"], finals[me]["data_paths"]
        assert finals[me]["committed_rounds"] >= 6, finals[me]
    assert sorted(finals["first"]["data_paths"]["relay"]) == sorted([ids["a"], ids["b"]]), finals["first"]
    served = finals["relay2"]["relays"]
    assert served["circuits"] > 0 and {ids["a"], ids["b"]} <= set(served["moved"]), served


@pytest.mark.multiproc
@pytest.mark.slow  # 30 s; in-process runs are deterministic under their seed too (tests/test_simulate.py)
def test_two_runs_of_the_same_swarm_reach_the_same_state(tmp_path):
    """The global state depends on data and seeds only, not on the random peer ids that order a
    view: two independent 3-peer runs end with the same digest (fp32 on the wire: any change in
    summation order would show in the bits). One code path: `diloco simulate` with the same
    settings (worker i on shard i, as peer i here) ends with that digest too."""
    digests = []
    for run in ("one", "two"):
        group = Peers(tmp_path / run, f"repro-{run}-{secrets.token_hex(2)}")
        (tmp_path / run).mkdir()
        common = ["--rounds", "3", "-H", "5", "--wait-for", "3", "--compression", "fp32", *TINY]
        try:
            procs = [group.spawn(0, ["start", *common])]
            addr = group.address(0)
            procs += [group.spawn(i, ["join", addr, *common]) for i in (1, 2)]
            for i, p in enumerate(procs):
                assert group.wait(p, 90) == 0, group.log(i)
        finally:
            group.kill_all()
        finals = [group.lines(i, "final")[-1] for i in range(3)]
        assert len({f["digest"] for f in finals}) == 1
        digests.append(finals[0]["digest"])
    assert digests[0] == digests[1]
    sim = subprocess.run([sys.executable, "-m", "diloco", "simulate", "--workers", "3", "--rounds", "3", "-H", "5",
                          "--compression", "fp32", *TINY[:6], "--json", str(tmp_path / "sim.json")],
                         capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr
    assert json.loads((tmp_path / "sim.json").read_text())["digests"] == [digests[0]]


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# every phase dies in-process in tests/test_kills.py; with real processes the default run kills at gather (the first
# phase) and decide (two victims of one swarm), `make test-slow` at every other phase
SLOW_PHASES = [("encode", "send"), ("reduce", "apply"), ("applied",)]
PAIRED = [("gather", "decide"), *(pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PHASES)]
assert sorted(p for group in [("gather", "decide"), *SLOW_PHASES] for p in group) == sorted(PHASES)


@pytest.mark.multiproc
@pytest.mark.parametrize("phases", PAIRED, ids="+".join)
def test_sigkill_mid_round_survivors_commit_next_round(peers, phases):
    """Two peers and a victim for each of `phases`: the k-th victim SIGKILLs itself at its phase of round 2 + 2k (at
    `reduce`: after it reduced its span but before it sent the result, so no one can commit that round). After each
    kill the survivors commit without it within the round deadline, agree bit for bit, and the victim's daemon dies
    with it. (One swarm for two phases: the victims die rounds apart, each into a swarm that committed since.)"""
    victims = [(2 + k, phase, 2 + 2 * k) for k, phase in enumerate(phases)]  # (peer, phase, round)
    rounds = 2 + 2 * len(phases) + 1
    common = ["--rounds", str(rounds), "-H", "5", "--wait-for", str(2 + len(phases)), *TINY]
    procs = [peers.spawn(0, ["start", *common])]
    addr = peers.address(0)
    procs.append(peers.spawn(1, ["join", addr, *common]))
    procs += [peers.spawn(i, ["join", addr, *common], env={"DILOCO_FAULTS": f"kill@{phase}:{rnd}"})
              for i, phase, rnd in victims]
    children: dict[int, list[psutil.Process]] = {}  # each victim's children once its p2pd daemon is among them
    deadline = time.monotonic() + 60
    while len(children) < len(victims) and time.monotonic() < deadline:
        for i, _, _ in victims:
            with suppress(psutil.NoSuchProcess):
                found = children.get(i) or psutil.Process(procs[i].pid).children(recursive=True)
                if any(c.name() == "p2pd" for c in found):
                    children[i] = found
        time.sleep(0.1)
    killed_at = {}
    for i, _, _ in victims:
        assert peers.wait(procs[i], 90) == -signal.SIGKILL, peers.log(i)
        killed_at[i] = time.time()
    for i in (0, 1):
        assert peers.wait(procs[i], 90) == 0, peers.log(i)
    committed = [r for r in peers.lines(0, "round") if r["committed"]]
    for k, (i, phase, _) in enumerate(victims):
        alive = 2 + len(victims) - (k + 1)
        after = [r for r in committed if r["time"] > killed_at[i]]
        assert after, f"survivors never committed after victim {i}'s kill"
        if phase in ("gather", "encode", "reduce"):  # the victim's span had no result: that round cannot commit
            assert after[0]["peers"] == alive, (i, after[0])
        # at send or apply the victim's span result may be out already: that round commits with the victim in it
        first_commit = next((r for r in after if r["peers"] == alive), None)
        assert first_commit is not None, (i, after)
        # deadline: the interrupted round is abandoned within --round-timeout (6 s) after it started,
        # then the next round commits at once; 5 H=5 steps of the tiny model take well under a second.
        assert first_commit["time"] - killed_at[i] < 6 + 5, (i, first_commit)
    finals = [peers.lines(i, "final")[-1] for i in (0, 1)]
    assert finals[0]["digest"] == finals[1]["digest"] and finals[0]["round"] == rounds
    # the reaper took each victim's daemon down with it, and exited (it gives p2pd 2 s after SIGTERM)
    for i, _, _ in victims:
        assert children.get(i), f"victim {i}'s p2pd daemon was never seen among its children"
        _, alive_children = psutil.wait_procs(children[i], timeout=5)
        assert all(_gone(child) for child in alive_children), alive_children


@pytest.mark.multiproc
def test_join_with_dead_bootstrap_exits_nonzero_listing_addresses():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRQPiyGWQQdn3DaPhb84P9MBDWaM43QfaVX9YR9qxStbP"
    proc = invoke(["join", dead, "--rounds", "1", *TINY], env={"DILOCO_SECRET": "s" * 32})  # its own daemon, here
    assert proc.exit_code == 1, proc.output
    assert "no bootstrap address answered" in proc.stderr and dead in proc.stderr.replace("\n", "")
    assert "a swarm whose peers all finished their run" in proc.stderr.replace("\n", " ")  # the case it cannot rule out


@pytest.mark.unit
@pytest.mark.parametrize("args, needle", [
    (["start", "--inner-steps", "0"], "inner_steps must be >= 1"),
    (["start", "--compression", "int3"], "unknown stage 'int3'"),
    (["start", "--compression", "topk:64"], "topk needs K/C"),
    (["start", "--run-id", "bad id!"], "run_id"),
    (["join", "not-an-address"], "is not a swarm address"),
    (["demo", "--peers", "0"], "peers must be between 1 and 16"),
    (["start", "--rounds", "2", "python", "train.py"], "put `--` before it: diloco start [OPTIONS] -- python train.py"),
    (["start", "--rounds", "2", "-H", "5", "--", "python", "train.py"],
     "--inner-steps, --rounds: the bundled job's, which your command never sees"),
    (["join", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRQPiyGWQQdn3DaPhb84P9MBDWaM43QfaVX9YR9qxStbP", "python", "train.py"],
     "put `--` before it: diloco join ADDR [OPTIONS] -- python train.py"),
])
def test_bad_cli_input_exits_2_naming_the_fix(args, needle, monkeypatch, tmp_path):
    """In this process, as `main()` runs these (no `--` in them): the app's checks refuse the input before
    any peer starts (past them, a peer would start: here that fails the test at once)."""
    refuse_to_start(monkeypatch, "diloco.cli.main._run_peer", "diloco.cli.main._launch", "diloco.cli.demo.run_demo")
    monkeypatch.chdir(tmp_path)  # `start` writes its secret file in the working directory once past its checks
    started = time.monotonic()
    out = invoke(args, env={"COLUMNS": "200"})
    assert out.exit_code == 2, (out.output, out.exception)
    assert needle in out.stderr
    assert time.monotonic() - started < 30


@pytest.mark.multiproc
@pytest.mark.timeout(240)  # above the sum of its own deadlines (60 + 30 + 120 s): those report
def test_sigterm_and_ctrl_c_leave_cleanly_the_swarm_goes_on_and_a_final_checkpoint_resumes(peers, tmp_path):
    """SIGTERM: the peer finishes its round, announces that it leaves, writes its final line, exits 0; the
    remaining peer keeps committing rounds without waiting for it. Then Ctrl-C, which in a terminal sends SIGINT
    to the peer's whole process group, to the one left: it finishes its round, writes its final checkpoint,
    announces that it leaves (its p2pd, in a session of its own, is still there to carry that), and exits 0; a
    restart with --resume continues from that checkpoint. (One swarm for both: each real peer costs ~3.5 CPU-s to
    start.)"""
    from diloco.checkpoint import list_checkpoints

    ckpt = tmp_path / "ckpt"
    common = ["--rounds", "1000", "-H", "20", "--wait-for", "2", *TINY, "--gather-timeout", "30"]
    first = peers.spawn(0, ["start", *common, "--checkpoint-dir", str(ckpt)], session=True)
    leaver = peers.spawn(1, ["join", peers.address(0), *common])
    deadline = time.monotonic() + 60
    while not any(r["committed"] for r in peers.lines(1, "round")):
        assert time.monotonic() < deadline, peers.log(1)
        time.sleep(0.1)
    leaver.send_signal(signal.SIGTERM)
    assert peers.wait(leaver, 30) == 0, peers.log(1)
    left_at = time.time()
    final = peers.lines(1, "final")[-1]
    assert final["stopped"] is True
    deadline = time.monotonic() + 60
    while not (alone := [r for r in peers.lines(0, "round") if r["time"] > left_at and r["committed"]]):
        assert time.monotonic() < deadline and first.poll() is None, peers.log(0)
        time.sleep(0.1)
    assert alone[0]["peers"] == 1
    # It did not sit out the 30 s gather timeout waiting for the peer that left.
    assert alone[0]["seconds"] < 10, alone[0]
    os.killpg(first.pid, signal.SIGINT)
    assert peers.wait(first, 30) == 0, peers.log(0)
    final = peers.lines(0, "final")[-1]
    assert final["stopped"] is True
    # the first peer said how to join and how to watch the swarm it started (the secret from $DILOCO_SECRET)
    said = peers.log(0, whole=True)
    assert "watch the swarm with:\n  diloco status /ip4/127.0.0.1/" in said and f"--run-id {peers.run_id}\n" in said
    assert "waiting for 2 peers (this one included, up to 120 s) before the first step" in said
    log = peers.log(0)
    assert "heartbeat_failed" not in log and "shutdown_step_failed" not in log, log  # the leave went out
    saved = list_checkpoints(ckpt)
    assert saved and saved[0].name == f"ckpt-{final['fragment_rounds']:012d}"
    again = peers.spawn(2, ["start", "--rounds", str(final["round"] + 1), "-H", "20", *TINY,
                            "--checkpoint-dir", str(ckpt), "--resume"])
    assert peers.wait(again, 60) == 0, peers.log(2)
    assert "event=resumed" in peers.log(2, whole=True)
    assert peers.lines(2, "final")[-1]["round"] == final["round"] + 1  # one more outer step after the resume
    assert len(peers.lines(2, "round")) == 1


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_hung_peer_is_left_out_then_catches_up(peers):
    """One of three peers is frozen (SIGSTOP) for a while. The other two go on
    without it (its calls time out); when it wakes (SIGCONT) its stale round fails instead of
    entering an aggregate, it downloads the swarm's state, and all three end identical."""
    common = ["--rounds", "12", "-H", "5", "--wait-for", "3", *TINY]
    procs = [peers.spawn(0, ["start", *common])]
    procs += [peers.spawn(i, ["join", peers.address(0), *common]) for i in (1, 2)]
    deadline = time.monotonic() + 90
    while not all(any(r["committed"] and r["peers"] == 3 for r in peers.lines(i, "round")) for i in range(3)):
        assert time.monotonic() < deadline, peers.log(2)
        time.sleep(0.1)
    hung = procs[2]
    hung.send_signal(signal.SIGSTOP)
    stopped_at = time.time()
    time.sleep(0.5)  # its metrics are final now: it may have committed one more round than it logged
    held = max(r["round"] for r in peers.lines(2, "round"))
    # Worst case before the others commit without it: it may have said ready for the round in flight
    # (in that view, the attempt fails after its call timeouts: ~35 s), and the next attempt waits one
    # call timeout (15 s) for its ready; from then on it is a straggler (asked, given the grace): ~50 s,
    # plus the inner steps on a loaded machine.
    deadline = time.monotonic() + 90
    # a 2-peer round the frozen peer cannot hold (a 2-peer round *with* it, missing a slow peer1, is no proof)
    while not [r for r in peers.lines(0, "round") if r["round"] >= held + 2 and r["committed"] and r["peers"] == 2]:
        assert time.monotonic() < deadline, "\n\n".join(peers.log(i) for i in range(3))
        time.sleep(0.1)
    hung.send_signal(signal.SIGCONT)
    woke_at = time.time()
    for i, p in enumerate(procs):
        assert peers.wait(p, 120) == 0, peers.log(i)
    finals = [peers.lines(i, "final")[-1] for i in range(3)]
    assert len({f["digest"] for f in finals}) == 1 and {f["round"] for f in finals} == {12}, finals
    woke = peers.lines(2, "round")
    assert any(str(r["reason"]).startswith("resynced") for r in woke), \
        [[(r["round"], r["committed"], r["peers"], str(r["reason"])[:70], round(r["time"] - stopped_at, 2))
          for r in peers.lines(i, "round")] for i in range(3)]
    # while it was frozen, the others' rounds committed with the two of them only: nothing of the hung peer
    frozen = [r for i in (0, 1) for r in peers.lines(i, "round")
              if stopped_at + 1 < r["time"] < woke_at and r["committed"]]
    assert frozen and all(r["peers"] == 2 for r in frozen), frozen


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_killed_peer_restarts_and_catches_up(peers):
    """SIGKILL one of three peers of a streaming swarm (2 fragments) right after its outer step of round 2,
    while the new state's digest is being hashed beside training and its record waits for it; start it
    again (a new process, a new peer id) with a dead bootstrap address given first: it skips that address,
    downloads the swarm's state and schedule position, and holds the swarm's digest from its first round on.
    Nothing committed is lost: the round it died in commits with all three. The swarm runs until the test
    stops it (SIGTERM), so a slow restart cannot find it finished."""
    common = ["--rounds", "1000", "-H", "6", "--fragments", "2", *TINY, "--layers", "2"]
    procs = [peers.spawn(0, ["start", "--wait-for", "3", *common])]
    procs += [peers.spawn(i, ["join", peers.address(0), "--wait-for", "3", *common],
                          env={"DILOCO_FAULTS": "kill@applied:2"} if i == 2 else None) for i in (1, 2)]
    assert peers.wait(procs[2], 90) == -signal.SIGKILL, peers.log(2)
    assert [r["round"] for r in peers.lines(2, "round") if r["committed"]][-1] == 2, peers.log(2)
    deadline = time.monotonic() + 30
    while not [r for r in peers.lines(0, "round") if r["round"] == 3 and r["committed"]]:
        assert time.monotonic() < deadline, peers.log(0)
        time.sleep(0.1)
    assert [r["peers"] for r in peers.lines(0, "round") if r["round"] == 3 and r["committed"]] == [3]
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRQPiyGWQQdn3DaPhb84P9MBDWaM43QfaVX9YR9qxStbP"
    started = time.monotonic()
    restarted = peers.spawn(3, ["join", dead, peers.address(0), *common])
    deadline = time.monotonic() + 90
    while sum(r["committed"] and r["peers"] == 3 for r in peers.lines(3, "round")) < 3:
        assert time.monotonic() < deadline and restarted.poll() is None, peers.log(3)
        time.sleep(0.1)
    joined = time.monotonic() - started
    for p in (procs[0], procs[1], restarted):
        p.send_signal(signal.SIGTERM)
    for i, p in [(0, procs[0]), (1, procs[1]), (3, restarted)]:
        assert peers.wait(p, 60) == 0, peers.log(i)
    assert joined < 30 + 20, joined  # joins within 30 s of a dead first address (plus start-up)
    mine = [r for r in peers.lines(3, "round") if r["committed"]]
    assert any(str(r["reason"]).startswith("resynced") for r in peers.lines(3, "round")) or \
        "event=resync" in peers.log(3, whole=True), peers.log(3)
    # one state per round id across the swarm, and the restarted peer's rounds are the swarm's
    states: dict[int, set[str]] = {}
    for i in (0, 1, 2, 3):
        for r in peers.lines(i, "round"):
            if r["committed"]:
                states.setdefault(r["round"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in states.values()), {k: v for k, v in states.items() if len(v) > 1}
    swarm = {r["round"]: r["digest"] for r in peers.lines(0, "round") if r["committed"]}
    assert mine and all(swarm.get(r["round"], r["digest"]) == r["digest"] for r in mine)
    assert "event=bootstrap_failed" in peers.log(3, whole=True)  # it did try the dead address first


@pytest.mark.multiproc
def test_a_poisoning_peer_is_banned_then_stops_naming_why_and_the_others_go_on(peers):
    """A poisoning peer with real processes: peer 2 contributes its pseudo-gradient x 1e4 from round 1
    (DILOCO_FAULTS=poison@1). The honest two clip it, strike it three times (--ban-after 3) and ban it;
    refused as banned by both in its next round, it exits 1 with a message naming why there instead of
    training on alone; the honest two finish every round on one digest."""
    common = ["--rounds", "8", "-H", "5", "--wait-for", "3", "--compression", "fp32", "--ban-after", "3", *TINY]
    first = peers.spawn(0, ["start", *common])
    addr = peers.address(0)
    honest = [first, peers.spawn(1, ["join", addr, *common])]
    bad = peers.spawn(2, ["join", addr, *common], env={"DILOCO_FAULTS": "poison@1"})
    assert peers.wait(bad, 120) == 1, peers.log(2)
    assert "was banned from run" in peers.log(2) and "by 2 of the 2 other peers" in peers.log(2), peers.log(2)
    assert not peers.lines(2, "final")
    for i, p in enumerate(honest):
        assert peers.wait(p, 120) == 0, peers.log(i)
    finals = [peers.lines(i, "final")[-1] for i in (0, 1)]
    assert finals[0]["digest"] == finals[1]["digest"] and finals[0]["round"] == 8
    # its banner's id (`peer ID in run ...`), from the whole log: its last 4000 characters may no longer hold it
    bad_id = re.search(r"^peer (\S+) in run", peers.log(2, whole=True), re.M).group(1)
    for f in finals:
        assert f["banned"] == [bad_id] and f["robust"]["clipped"] >= 3, f
    # it stops at its next round (its peers refuse it at once) instead of training on alone: its last round is the one
    # in flight when they banned it, or the next (counted in rounds, not seconds: a loaded machine stretches both)
    banned = [line for i in (0, 1) for line in peers.log(i, whole=True).splitlines() if "event=peer_banned" in line]
    banned_round = min(int(re.search(r"last: round (\d+):", line).group(1)) for line in banned)
    assert peers.lines(2, "round")[-1]["round"] <= banned_round + 2, (banned, peers.lines(2, "round")[-1])


@pytest.mark.multiproc
@pytest.mark.timeout(240)  # above its own deadline (the demo's 180 s): that one reports; the suite's 120 s did not
def test_demo_reports_agreement_memory_and_round_time(tmp_path):
    """`diloco demo` (B6's real-swarm half uses it at 8 peers): the summary says the peers agree, and
    carries each peer's peak resident memory (process and daemon) and the median round time. Every peer
    also logs to TensorBoard and to W&B (offline: no API key), and `diloco plot` draws the run."""
    from test_plot import C0, C1, has_colour, pixels
    from test_sinks import tensorboard_scalars
    from wandb_offline import history

    from diloco.metrics import read_jsonl

    out = tmp_path / "demo.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wbconfig"), HOME=str(tmp_path),
               WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-m", "diloco", "demo", "--peers", "2", "--rounds", "2", "-H", "3",
                           "--d-model", "32", "--layers", "1", "--batch-size", "4", "--no-live", "--json", str(out),
                           "--workdir", str(tmp_path / "w"), "--metrics", str(tmp_path / "demo.jsonl"),
                           "--tensorboard", str(tmp_path / "tb"), "--wandb", "diloco-demo"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    peers = {line["peer"] for line in read_jsonl(tmp_path / "demo.jsonl") if line["event"] == "round"}
    assert len(peers) == 2 and {p.name for p in (tmp_path / "tb").iterdir()} == peers  # a TensorBoard run per peer
    for peer in peers:
        losses = tensorboard_scalars(tmp_path / "tb" / peer)["round/loss"]
        assert len(losses) >= 2 and all(step > 0 and value > 0 for step, value in losses)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(any("round/loss" in row for row in history(run)) for run in runs)
    plotted = invoke(["plot", str(tmp_path / "demo.jsonl"), "--out", str(tmp_path / "plots")])  # in this process
    assert plotted.exit_code == 0, (plotted.stderr, plotted.exception)
    for name in ("loss-vs-tokens.png", "loss-vs-bytes.png", "loss-vs-time.png"):
        img = pixels(tmp_path / "plots" / name)
        assert has_colour(img, C0) and has_colour(img, C1), name  # both peers' curves
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["digests_agree"] and summary["rounds"] == 2
    assert (summary["compression_spec"], summary["compression"]) == ("e3m0", "e3m0:0")  # as given; canonical
    assert "e3m0: 4.0" in proc.stdout and "e3m0:0" not in proc.stdout  # the summary table shows it as given
    # --no-live: plain progress lines on stderr, one per round of the slowest peer, and a last one
    assert "demo: round 2/2 (slowest peer)" in proc.stderr and "demo: done in" in proc.stderr, proc.stderr
    assert len(summary["peak_rss_mib_per_peer"]) == 2
    assert all(m > 100 for m in summary["peak_rss_mib_per_peer"])  # python + torch + p2pd, at the least
    assert 0 < summary["round_seconds_median"] < 30


@pytest.mark.multiproc
def test_two_regions_of_real_peers_merge_into_one_global_state(peers):
    """Two regions of two `diloco start/join --region` processes each: region rounds inside each region, a
    merge every 2 of them by one representative per region (docs/REGIONS.md); a merge is a region round of its
    own (rounds 3 and 6), so a run to round 7 ends one region round past a merge: the run's end merges once more
    (round 8). Every peer ends on the same global state, every member of a region on its region's state, and
    all four on one final model (`final_digest`), which they evaluate alike."""
    common = ["--rounds", "7", "-H", "5", "--merge-every", "2", "--wait-for", "4", *TINY]
    first = peers.spawn(0, ["start", "--region", "eu", *common])
    addr = peers.address(0)
    others = [peers.spawn(i, ["join", addr, "--region", region, *common]) for i, region in ((1, "eu"), (2, "us"), (3, "us"))]
    for i, p in enumerate([first, *others]):
        assert peers.wait(p, 120) == 0, peers.log(i)
    finals = [peers.lines(i, "final")[-1] for i in range(4)]
    assert [f["region"] for f in finals] == ["eu", "eu", "us", "us"]
    # one global state per global round, one region state per region round (no fork at either level)
    glob = {(f["global_round"], f["global_digest"]) for f in finals}
    assert len(glob) == len({r for r, _ in glob}), finals
    for a, b in ((0, 1), (2, 3)):
        assert finals[a]["round"] == finals[b]["round"] == 8 and finals[a]["digest"] == finals[b]["digest"], finals
    assert all(f["merges"] >= 1 for f in finals), finals  # the regions merged: every member took a merge
    # the final merge: every peer holds θ_G′ (members downloaded it), its parameters in every model
    assert len({(f["global_round"], f["global_digest"], f["final_digest"]) for f in finals}) == 1, finals
    assert finals[0]["global_round"] >= 2, finals
    assert len({f["eval_loss"] for f in finals}) == 1, finals
    assert all(f["rejections"] == {} and f["records_dropped"] == {} for f in finals), finals
    # the region rounds ran inside each region: two peers each
    rows = [r for i in range(4) for r in peers.lines(i, "round")]
    committed = [r for r in rows if r["committed"] and not r["merge"]]
    assert committed and all(r["peers"] == 2 for r in committed)
    # each merge is a row: the representative's round of the swarm (2 regions), a member's download
    merges = [r for r in rows if r["merge"]]
    assert merges and all(r["committed"] and r["peers"] == 2 if r["committed"] else r["resynced"] for r in merges)


@pytest.mark.multiproc
def test_four_real_peers_gossip_in_pairs_without_an_all_reduce(peers):
    """Four `diloco start/join --topology gossip` processes (docs/GOSSIP.md): each round every peer averages its
    local parameters with the partner the round number draws for it, and steps its own state. Rounds that met
    ran between two peers only; each peer holds its own state (its own digest). A round whose partner drew
    another group (records that disagree while peers start) runs alone: most rounds still meet. The run ends on
    one model: the four states' average, taken by every peer (`gossip_final`, `final_digest`).

    The pairs a round draws come from the run id and the peer ids: with ids drawn at random, two peers met only each
    other in every round about once in 250 runs, and ended on one state. So the peers get their ids from key files
    made here, and the run id is one under which rounds 1-3 and 4-6 (the draws of rounds 0-2 and 3-5: a peer draws its
    group with its round before the round's outer step) each draw all three ways to pair four peers."""
    from diloco.peers.membership import groups

    keys = [peers.workdir / f"peer{i}.key" for i in range(4)]
    ids = new_peer_ids(keys)
    pairings = lambda run, rounds: {frozenset(groups(ids, r, run, 2)) for r in rounds}  # noqa: E731
    run_id = next((run for run in (f"{peers.run_id}-{k}" for k in range(1000))  # about one in twenty does
                   if len(pairings(run, (0, 1, 2))) == len(pairings(run, (3, 4, 5))) == 3), None)
    assert run_id is not None, ids
    peers.run_id = run_id
    common = ["--rounds", "6", "-H", "5", "--topology", "gossip", "--compression", "fp32", "--wait-for", "4", *TINY]
    first = peers.spawn(0, ["start", *common, "--identity", str(keys[0])])
    addr = peers.address(0)
    others = [peers.spawn(i, ["join", addr, *common, "--identity", str(keys[i])]) for i in (1, 2, 3)]
    for i, p in enumerate([first, *others]):
        assert peers.wait(p, 120) == 0, peers.log(i)
    finals = [peers.lines(i, "final")[-1] for i in range(4)]
    assert [f["peer"] for f in finals] == ids  # the keys made above
    assert all(f["topology"] == "gossip" and f["round"] >= 6 for f in finals), finals
    assert len({f["digest"] for f in finals}) == 4  # no global state: one per peer (each its own outer state) ...
    # ... and one final model, the average of the four, evaluated alike
    assert all(f["gossip_final"] == 4 for f in finals) and len({f["final_digest"] for f in finals}) == 1, finals
    assert len({f["eval_loss"] for f in finals}) == 1, finals
    assert all(f["gossip_met"] >= 1 for f in finals) and sum(f["gossip_met"] for f in finals) >= 12, finals
    assert all(f["gossip_clipped"] == 0 for f in finals), finals  # honest rounds are never scaled down
    assert max(f["gossip_partners"] for f in finals) >= 2, finals  # the pairs change from round to round
    # frames from a peer two rounds ahead are refused as such (it will wait for us, or we jump): nothing else
    assert all(set(f["rejections"]) <= {"wrong_round"} and f["records_dropped"] == {} for f in finals), finals
    rows = [r for i in range(4) for r in peers.lines(i, "round")]
    assert all(r["peers"] == 2 for r in rows if r["committed"]), rows
    assert all(f["eval_loss"] < 4.5 for f in finals), finals  # it learned (bytes: ln 256 = 5.5 at the start)
