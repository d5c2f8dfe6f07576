"""The launcher (`diloco start/join -- CMD`) with real processes: the user's own script
(examples/ddp_train.py) as a site's worker, alone or as a torchrun group of ranks (CPU, gloo), on
127.0.0.1; and, in this process, its refusal of bad input before anything starts.

Each test has a hard timeout; every process a launch starts carries DILOCO_LAUNCH_ID, and the tests
check that none of them outlives its launcher (SIGKILL of the launcher included).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from cli_util import invoke, refuse_to_start

from diloco.environment import LAUNCH_ID
from diloco.hostmem import TUNABLE, VARIABLE
from diloco.launcher import PORTS_FROM, ephemeral_ports, free_port

SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py")
FSDP_SCRIPT = str(Path(SCRIPT).with_name("fsdp_train.py"))  # the same model, sharded by FSDP2 under torchrun
# A site that trains until it is stopped, each step 20 ms longer: the tests wait on events (a join, a crash, a
# round), and the CPU its ranks leave goes to the processes starting beside them.
ENDLESS = ["--rounds", "100000", "--inner-steps", "5", "--step-delay", "0.02"]
FAST = ["--gather-timeout", "20", "--round-timeout", "6"]


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


class Sites:
    """Launchers (`python -m diloco start|join ... -- CMD`) in a temp dir, killed at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.run_id = workdir, f"l-{secrets.token_hex(3)}"
        self.env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
        self.procs: dict[int, subprocess.Popen] = {}

    def launch(self, i: int, verb: list[str], command: list[str], *extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "diloco", *verb, "--run-id", self.run_id, *FAST, *extra,
                "--metrics", str(self.metrics(i)), "--address-file", str(self.workdir / f"site{i}.addr"), "--",
                *command]
        with open(self.workdir / f"site{i}.log", "wb") as log:  # the launcher holds its own copy
            self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env)
        return self.procs[i]

    def metrics(self, i: int) -> Path:
        return self.workdir / f"site{i}.jsonl"

    def lines(self, i: int, event: str) -> list[dict]:
        try:
            text = self.metrics(i).read_text()
        except FileNotFoundError:
            return []
        return [r for r in (json.loads(x) for x in text.splitlines() if x.strip()) if r["event"] == event]

    def address(self, i: int, timeout: float = 90) -> str:
        path = self.workdir / f"site{i}.addr"
        deadline = time.monotonic() + timeout
        while not path.exists() or not path.read_text().strip():
            assert time.monotonic() < deadline, self.log(i)
            assert self.procs[i].poll() is None, self.log(i)
            time.sleep(0.1)
        return path.read_text().split()[0]

    def log(self, i: int, whole: bool = False) -> str:
        """Site i's output: its last 6000 characters (for assertion messages), or all of it."""
        text = (self.workdir / f"site{i}.log").read_text(errors="replace")
        return text if whole else text[-6000:]

    def token(self, i: int) -> str:
        """The launch id every process of site i's launch carries (read from the launcher's command)."""
        for child in psutil.Process(self.procs[i].pid).children():
            token = child.environ().get(LAUNCH_ID)
            if token:
                return token
        raise AssertionError(f"site {i}'s launcher runs no command")

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def _tagged(token: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(LAUNCH_ID) == token and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@pytest.fixture
def sites(tmp_path):
    group = Sites(tmp_path)
    yield group
    group.kill_all()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_sites_of_one_two_and_three_ranks_train_together_on_one_digest(sites):
    """Three sites, one a lone process and two torchrun groups (2 ranks with DDP, 3 ranks with FSDP2, over
    gloo), train one model together: every rank of every site ends on the same global-state digest, and
    each site puts one replica's worth of encoded pseudo-gradient on the WAN, like the lone process. The script's
    `--save` writes the final global model: the same file from the lone process and the DDP site. Each site reads
    the data shard it was given (`--shard 7`) or one drawn from its peer id."""
    rounds = ["--rounds", "4", "--inner-steps", "5"]
    saved = [sites.workdir / f"final{i}.safetensors" for i in range(2)]
    sites.launch(0, ["start", "--wait-for", "3", "--shard", "7"],
                 [sys.executable, SCRIPT, *rounds, "--save", str(saved[0])])
    addr = sites.address(0)
    sites.launch(1, ["join", addr, "--wait-for", "3"], [*_torchrun(2), SCRIPT, *rounds, "--save", str(saved[1])])
    sites.launch(2, ["join", addr, "--wait-for", "3"], [*_torchrun(3), FSDP_SCRIPT, *rounds])
    for i, proc in sites.procs.items():
        assert proc.wait(timeout=240) == 0, sites.log(i)
    finals = {i: sites.lines(i, "final") for i in range(3)}
    assert [len(finals[i]) for i in range(3)] == [1, 2, 3], finals  # one final line per rank
    digests = {f["digest"] for i in range(3) for f in finals[i]}
    assert len(digests) == 1 and {f["round"] for i in range(3) for f in finals[i]} == {4}, finals
    assert sorted(f["rank"] for f in finals[2]) == [0, 1, 2] and {f["site_size"] for f in finals[2]} == {3}
    # one final model, written alike by both sites (bit for bit; safetensors orders its metadata as it likes)
    files = [load_file(str(p)) for p in saved]
    assert files[0].keys() == files[1].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}  # no DDP prefix
    assert all(torch.equal(files[0][k], files[1][k]) for k in files[0])
    shards = [int(re.search(r"data shard (\d+)", sites.log(i)).group(1)) for i in range(2)]
    leader = next(f["peer"] for f in finals[1] if f["rank"] == 0)
    assert shards == [7, zlib.crc32(leader.encode()) % 100_000], shards
    # one replica on the WAN: the 2- and 3-rank sites' leaders send what the lone process sends (the FSDP2
    # site's leader reads Δ from its ranks one span at a time: tests/test_shards.py)
    together = {i: [r for r in sites.lines(i, "round") if r["committed"] and r["peers"] == 3] for i in range(3)}
    assert all(together.values()), together
    numel = 16 * 64 + 64 + 64 + 1
    for i in range(3):
        assert {r["payload_bytes"] for r in together[i]} == {4 * numel}  # fp32: one Δ of the model, encoded
    lone = max(r["bytes_sent"] for r in together[0])
    assert all(r["bytes_sent"] < 1.25 * lone for i in (1, 2) for r in together[i]), together


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_killed_rank_takes_its_site_down_the_launcher_restarts_it_and_it_catches_up(sites):
    """SIGKILL rank 1 of a 2-rank site: torchrun ends the site, the launcher starts it again (--max-restarts),
    it rejoins under the same peer id, downloads the swarm's state if it moved on and commits with the
    others; every rank ends on one digest. Meanwhile the lone site goes on alone if the site's leader said
    goodbye (it does when its gloo group breaks under it), or waits for it: a member of a two-member swarm
    that vanished without a word keeps counting (docs/PROTOCOL.md, quorum), so the lone site's rounds fail
    "no quorum" until the site is back. Which happens is a timing: where rank 0 was when rank 1 died."""
    run = ENDLESS
    sites.launch(0, ["start", "--wait-for", "2"], [sys.executable, SCRIPT, *run])
    addr = sites.address(0)
    sites.launch(1, ["join", addr, "--wait-for", "2", "--max-restarts", "1"], [*_torchrun(2), SCRIPT, *run])
    deadline = time.monotonic() + 180  # two sites start (imports, torchrun, daemons), then a round together
    while not [r for r in sites.lines(1, "round") if r["committed"] and r["peers"] == 2]:
        assert time.monotonic() < deadline and sites.procs[1].poll() is None, sites.log(1)
        time.sleep(0.2)
    token = sites.token(1)
    rank1 = [p for p in _tagged(token) if p.environ().get("RANK") == "1"]
    assert len(rank1) == 1, [p.cmdline() for p in _tagged(token)]
    peer = {r["peer"] for r in sites.lines(1, "round")}
    # Hold the site's launcher (SIGSTOP) so that its restart waits until the lone site has committed a round
    # on its own: how soon the others go on without a dead site (a gather timeout) and how soon a restart
    # is back (seconds) are both timings, and either may win on a loaded machine.
    sites.procs[1].send_signal(signal.SIGSTOP)
    crashed_at = time.time()
    rank1[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 120

    def alone_or_waiting() -> bool:
        after = [r for r in sites.lines(0, "round") if r["time"] > crashed_at]
        return any(r["committed"] and r["peers"] == 1 for r in after) or \
            sum(r["reason"].startswith("no quorum") for r in after) >= 3
    while not alone_or_waiting():
        assert time.monotonic() < deadline and sites.procs[0].poll() is None, sites.log(0)  # went on, or waits
        time.sleep(0.2)
    resumed_at = time.time()
    sites.procs[1].send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 150
    # rank 0 may still finish the round it was in; what counts is a round of the restarted site
    while not [r for r in sites.lines(1, "round") if r["restart"] == 1 and r["committed"] and r["peers"] == 2]:
        assert time.monotonic() < deadline and sites.procs[1].poll() is None, sites.log(1)
        time.sleep(0.2)
    back = min(r["time"] for r in sites.lines(1, "round") if r["restart"] == 1 and r["committed"])
    print(f"launcher resumed -> the restarted site's first committed round: {back - resumed_at:.1f} s")
    assert "restarting it (1 of 1)" in sites.log(1, whole=True)
    assert {r["peer"] for r in sites.lines(1, "round")} == peer  # the same peer id after the restart
    for i in (0, 1):
        sites.procs[i].send_signal(signal.SIGTERM)  # both leave at their next step / slot
    for i in (0, 1):
        sites.procs[i].wait(timeout=90)
    finals = [f for i in (0, 1) for f in sites.lines(i, "final") if f["restart"] == (1 if i == 1 else 0)]
    assert len(finals) == 3, finals
    # every rank that left holds a state the swarm committed, and the ranks of a site agree
    committed = {r["round"]: r["digest"] for i in (0, 1) for r in sites.lines(i, "round") if r["committed"]}
    assert all(committed.get(f["round"], f["digest"]) == f["digest"] for f in finals), (finals, committed)
    assert len({f["digest"] for f in finals if f["site_size"] == 2}) == 1, finals


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_an_fsdp2_site_serves_a_late_joiner_and_catches_up_after_a_rank_dies(sites):
    """A 2-rank FSDP2 site starts the swarm alone, so it is the only holder of the state: a lone process
    that joins later downloads it from the site (whose leader gathers a snapshot from its ranks once asked).
    Then SIGKILL rank 1: the launcher restarts the site, which downloads the swarm's state from the lone
    process into its shards and commits with it again; every rank ends on a state the swarm committed."""
    run = ENDLESS
    sites.launch(0, ["start", "--max-restarts", "1"], [*_torchrun(2), FSDP_SCRIPT, *run])
    addr = sites.address(0)
    deadline = time.monotonic() + 120
    while max((r["round"] for r in sites.lines(0, "round") if r["committed"]), default=0) < 3:
        assert time.monotonic() < deadline and sites.procs[0].poll() is None, sites.log(0)
        time.sleep(0.2)
    sites.launch(1, ["join", addr], [sys.executable, SCRIPT, *run])
    deadline = time.monotonic() + 150
    while not all([r for r in sites.lines(i, "round") if r["committed"] and r["peers"] == 2] for i in (0, 1)):
        assert time.monotonic() < deadline and sites.procs[1].poll() is None, sites.log(1) + sites.log(0)
        time.sleep(0.2)
    # it got the state at its join (the site gathered a snapshot at its next slot; asking again until then is
    # no failure) and committed its first round with the site: it never trained from its own start
    first = sites.lines(1, "round")[0]
    assert first["committed"] and first["round"] > 3 and "resync_failed" not in sites.log(1, whole=True), first
    token = sites.token(0)
    rank1 = [p for p in _tagged(token) if p.environ().get("RANK") == "1"]
    assert len(rank1) == 1, [p.cmdline() for p in _tagged(token)]
    # the site started the swarm: its restart rejoins through the members its leader last wrote down
    kept = Path(rank1[0].environ()["DILOCO_PEERS_FILE"])
    deadline = time.monotonic() + 30
    while sites.address(1) not in (kept.read_text() if kept.exists() else ""):
        assert time.monotonic() < deadline, "the site's leader never wrote down the joiner's address"
        time.sleep(0.2)
    crashed_at = time.time()
    rank1[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 150
    while not [r for r in sites.lines(0, "round") if r["restart"] == 1 and r["committed"] and r["peers"] == 2]:
        assert time.monotonic() < deadline and sites.procs[0].poll() is None, sites.log(0)
        time.sleep(0.2)
    restarted = [r for r in sites.lines(0, "round") if r["restart"] == 1]
    assert restarted[0]["round"] > 3, restarted[:3]  # it downloaded the swarm's state into its shards at its join
    print(f"FSDP2 site crash -> first committed round after its restart: "
          f"{min(r['time'] for r in restarted if r['committed']) - crashed_at:.1f} s")
    for i in (0, 1):
        sites.procs[i].send_signal(signal.SIGTERM)
    for i in (0, 1):
        sites.procs[i].wait(timeout=90)
    finals = [f for i in (0, 1) for f in sites.lines(i, "final") if f["restart"] == (1 if i == 0 else 0)]
    assert len(finals) == 3, finals
    committed = {r["round"]: r["digest"] for i in (0, 1) for r in sites.lines(i, "round") if r["committed"]}
    assert all(committed.get(f["round"], f["digest"]) == f["digest"] for f in finals), (finals, committed)
    assert len({f["digest"] for f in finals if f["site_size"] == 2}) == 1, finals


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_a_refused_script_says_why_and_a_sigkilled_launcher_leaves_no_process_behind(sites):
    """`diloco join ADDR --run-id other -- python train.py`: the script's `DiLoCo(...)` is refused (another run id);
    it says so in one `error:` line, as the bundled job does, and the launcher exits with its status, 1, while the
    swarm's site trains on. Then that site's launcher is SIGKILLed, and its command (torchrun, its ranks, their
    p2pd daemons) dies with it although it could not clean up. (One site for both: a 2-rank site costs ~11 CPU-s
    to start.)"""
    sites.launch(0, ["start"], [*_torchrun(2), SCRIPT, *ENDLESS])
    addr = sites.address(0)
    joiner = sites.launch(1, ["join", addr], [sys.executable, SCRIPT, "--rounds", "2", "--inner-steps", "5"],
                          "--run-id", f"{sites.run_id}-other")
    assert joiner.wait(timeout=120) == 1, sites.log(1)
    said = sites.log(1, whole=True)
    assert "error: handshake with" in said and "run_id differs" in said, said
    assert "Traceback" not in said, said
    assert sites.procs[0].poll() is None  # the swarm's site trains on
    token = sites.token(0)
    before = _tagged(token)
    assert any(p.name() == "p2pd" for p in before) and len(before) >= 4, [p.name() for p in before]
    secret = sites.env["DILOCO_SECRET"]
    for proc in before:  # the secret is in no process's command line or environment, only in a 600 file
        assert secret not in " ".join(proc.cmdline()) and secret not in "".join(proc.environ().values())
    secret_file = Path(before[0].environ()["DILOCO_SECRET_FILE"])
    for proc in before:  # glibc's malloc asks for huge pages in every process of the launch (diloco/hostmem.py)
        assert f"{TUNABLE}=1" in proc.environ().get(VARIABLE, "").split(":"), (proc.name(), proc.environ().get(VARIABLE))
    assert secret_file.stat().st_mode & 0o077 == 0 and secret_file.read_text().strip() == secret
    sites.procs[0].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while _tagged(token):
        assert time.monotonic() < deadline, [(p.pid, p.name()) for p in _tagged(token)]
        time.sleep(0.2)


@pytest.mark.multiproc
def test_the_same_script_trains_alone_without_the_launcher():
    """`python train.py`: single-worker DiLoCo, no network, the same one line."""
    proc = subprocess.run([sys.executable, SCRIPT, "--rounds", "3", "--inner-steps", "5"], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")
                                                       or k == "DILOCO_TEST_SESSION"})
    assert proc.returncode == 0, proc.stderr
    assert "done: round 3" in proc.stdout


@pytest.mark.unit
@pytest.mark.parametrize("args, needle", [
    (["start", "--"], "`--` must be followed by the command to run"),
    (["start", "--", "no-such-program-xyz"], "command not found: 'no-such-program-xyz'"),
    (["start", "--max-restarts", "-1", "--", sys.executable, "-c", "pass"], "--max-restarts must be >= 0"),
    (["start", "--max-restarts", "2"], "--max-restarts applies to a command of yours"),
    (["join", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRQPiyGWQQdn3DaPhb84P9MBDWaM43QfaVX9YR9qxStbP", "--run-id", "nosecret",
      "--", sys.executable, "-c", "pass"], "DILOCO_SECRET"),
])
def test_bad_launcher_input_exits_2_naming_the_fix_before_anything_starts(tmp_path, monkeypatch, args, needle):
    """In this process (past its checks the command would launch: here that fails the test at once)."""
    refuse_to_start(monkeypatch, "diloco.cli.main._run_peer", "diloco.cli.main._launch")
    monkeypatch.chdir(tmp_path)
    out = invoke(args, env={"DILOCO_SECRET": None, "COLUMNS": "200"})
    assert out.exit_code == 2, (out.stdout, out.stderr, out.exception)
    assert needle in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written (no secret file either)


@pytest.mark.multiproc
def test_a_sites_port_is_drawn_below_the_ephemeral_range_so_no_other_socket_is_handed_it():
    """The launcher picks the port the site's daemon listens on seconds before it binds it; outgoing connections and
    port-0 binds take theirs from the kernel's ephemeral range, so a port below it cannot be handed to one of them
    meanwhile (a full-suite run failed once: "bind: address already in use")."""
    low, _ = ephemeral_ports()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(PORTS_FROM <= p < low for p in ports) and len(ports) > 1, (ports, low)


def test_a_command_after_another_verb_is_refused_by_the_entry_point(tmp_path):
    """`main()`'s own check, before the app parses anything: a real `python -m diloco`."""
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_SECRET"}
    proc = subprocess.run([sys.executable, "-m", "diloco", "demo", "--", sys.executable], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env={**env, "COLUMNS": "200"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "only `diloco start` and `diloco join` run a command" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written (no secret file either)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_a_restarted_lone_site_resumes_from_its_checkpoint(sites, tmp_path):
    """A site alone in its swarm, with --checkpoint-dir: its command is SIGKILLed, the launcher starts it
    again, and it continues from its last checkpoint rather than from round 0 (nobody else holds the
    state)."""
    ckpt = tmp_path / "ckpt"
    sites.launch(0, ["start", "--max-restarts", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"],
                 [sys.executable, SCRIPT, *ENDLESS])
    deadline = time.monotonic() + 90
    while max((r["round"] for r in sites.lines(0, "round") if r["committed"]), default=0) < 4:
        assert time.monotonic() < deadline and sites.procs[0].poll() is None, sites.log(0)
        time.sleep(0.1)
    worker = next(p for p in _tagged(sites.token(0)) if "ddp_train.py" in " ".join(p.cmdline()))
    crashed = time.time()
    worker.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not [r for r in sites.lines(0, "round") if r["time"] > crashed and r["committed"]]:
        assert time.monotonic() < deadline and sites.procs[0].poll() is None, sites.log(0)
        time.sleep(0.1)
    before = max(r["round"] for r in sites.lines(0, "round") if r["time"] < crashed and r["committed"])
    after = min(r["round"] for r in sites.lines(0, "round") if r["time"] > crashed and r["committed"])
    assert after >= before, (before, after)  # resumed at its last checkpoint (every round), not at round 1
    sites.procs[0].send_signal(signal.SIGTERM)
    assert sites.procs[0].wait(timeout=60) == 128 + signal.SIGTERM, sites.log(0)  # the command's status


def _logs_to_sinks(sites: Sites, tmp_path: Path) -> list[str]:
    """The launcher options that make a site log to TensorBoard and (offline: no API key) to W&B under `tmp_path`."""
    sites.env = {k: v for k, v in sites.env.items() if not k.startswith("WANDB_")}
    sites.env.update(WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wbconfig"), HOME=str(tmp_path),
                     WANDB_SILENT="true")
    return ["--tensorboard", str(tmp_path / "tb"), "--wandb", "diloco-site"]


def _check_sinks(sites: Sites, i: int, tmp_path: Path, last_round: int) -> None:
    """Site `i` (`_logs_to_sinks`) logged every round and its final line to one TensorBoard run and one W&B run,
    its leader's, and no other rank's."""
    from test_sinks import tensorboard_scalars
    from wandb_offline import history, run_info

    rounds = sites.lines(i, "round")
    (peer,) = {r["peer"] for r in rounds}
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [peer]  # the leader's run, no other rank's
    tb = tensorboard_scalars(tmp_path / "tb" / peer)
    assert [step for step, _ in tb["round/round"]] == [r["step"] for r in rounds]
    assert [value for _, value in tb["round/bytes_sent"]] == [float(r["bytes_sent"]) for r in rounds]
    assert [value for _, value in tb["final/round"]] == [float(last_round)]
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert [row["round/round"] for row in history(run) if "round/round" in row] == [r["round"] for r in rounds]
    info = run_info(run)
    assert (info.display_name, info.run_group, info.project) == (peer, sites.run_id, "diloco-site")
    assert "secret" not in {item.key for item in info.config.update}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_two_rank_site_and_a_lone_process_of_unequal_speed_sync_by_time_on_one_digest(sites, tmp_path):
    """Rounds by time across a 2-rank torchrun site and a lone process whose steps are about three times as fast
    (`--round-seconds 1`): the site's leader plans each span's length for both its ranks, every round commits with
    both workers, each one's pseudo-gradient counts by the steps it covered (the lone process's several times the
    site's), and every rank of both ends on one digest. The site was launched with `--tensorboard DIR --wandb
    PROJECT`, which reach the user's command through its environment: its voice (rank 0) logs every round and its
    final line to one TensorBoard run and one W&B run; the other rank writes only its final JSON line. (One swarm
    for both: a 2-rank site costs ~11 CPU-s to start.)"""
    rounds = ["--rounds", "4", "--round-seconds", "1"]
    sites.launch(0, ["start", "--wait-for", "2"], [sys.executable, SCRIPT, *rounds, "--step-delay", "0.01"])
    sites.launch(1, ["join", sites.address(0), "--wait-for", "2", *_logs_to_sinks(sites, tmp_path)],
                 [*_torchrun(2), SCRIPT, *rounds, "--step-delay", "0.03"])
    for i, proc in sites.procs.items():
        assert proc.wait(timeout=240) == 0, sites.log(i)
    finals = {i: sites.lines(i, "final") for i in range(2)}
    assert [len(finals[i]) for i in range(2)] == [1, 2], finals
    assert len({f["digest"] for i in range(2) for f in finals[i]}) == 1, finals
    assert {f["round"] for i in range(2) for f in finals[i]} == {4}, finals
    steps = {i: [r["round_steps"] for r in sites.lines(i, "round") if r["committed"] and r["peers"] == 2]
             for i in range(2)}
    assert all(steps.values()), steps
    assert statistics.median(steps[0]) > 1.5 * statistics.median(steps[1]) >= 3, steps
    _check_sinks(sites, 1, tmp_path, last_round=4)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_your_script_under_the_launcher_trains_in_regions_one_region_a_two_rank_site(sites):
    """`diloco start/join --region R -- CMD`: the script's one line (`DiLoCo(model, opt)`) finds its region in the
    launcher's environment; region "eu" is a lone process, region "us" a 2-rank torchrun site (DDP) whose leader
    merges for it while its other rank takes each merge's state. The regions merge into one global state, each
    merge is a row of the metrics (docs/REGIONS.md), and the run ends on one model in every rank (`final_digest`)."""
    rounds = ["--rounds", "6", "--inner-steps", "5"]
    sites.launch(0, ["start", "--wait-for", "2", "--region", "eu", "--merge-every", "2"], [sys.executable, SCRIPT, *rounds])
    addr = sites.address(0)
    sites.launch(1, ["join", addr, "--wait-for", "2", "--region", "us", "--merge-every", "2"],
                 [*_torchrun(2), SCRIPT, *rounds])
    for i, proc in sites.procs.items():
        assert proc.wait(timeout=240) == 0, sites.log(i)
    finals = {i: sites.lines(i, "final") for i in range(2)}
    assert [sorted(f["rank"] for f in finals[i]) for i in range(2)] == [[0], [0, 1]], finals
    leaders = [next(f for f in finals[i] if f["rank"] == 0) for i in range(2)]
    assert [f["region"] for f in leaders] == ["eu", "us"]
    assert leaders[0]["global_digest"] == leaders[1]["global_digest"] and leaders[0]["global_round"] >= 1, leaders
    assert len({f["final_digest"] for i in range(2) for f in finals[i]}) == 1, finals  # θ_G′'s parameters, everywhere
    assert finals[1][0]["digest"] == finals[1][1]["digest"], finals[1]  # the site's ranks hold one state
    merges = [r for i in range(2) for r in sites.lines(i, "round") if r["merge"]]
    assert merges and all(r["committed"] and r["peers"] == 2 for r in merges), merges


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_your_script_under_the_launcher_gossips_with_a_two_rank_site(sites):
    """`diloco start/join --topology gossip -- CMD`: the script's one line finds the topology in the launcher's
    environment and its rounds average with its partner (docs/GOSSIP.md): a lone process and a 2-rank torchrun
    site (DDP), whose leader gossips for it while its other rank takes the leader's state after each round. Two
    peers are one group every round, so each round that met gives both the same mean; the run ends on one model,
    their average, in every rank."""
    rounds = ["--rounds", "6", "--inner-steps", "5"]
    flags = ["--wait-for", "2", "--topology", "gossip", "--compression", "fp32"]
    sites.launch(0, ["start", *flags], [sys.executable, SCRIPT, *rounds])
    sites.launch(1, ["join", sites.address(0), *flags], [*_torchrun(2), SCRIPT, *rounds])
    for i, proc in sites.procs.items():
        assert proc.wait(timeout=240) == 0, sites.log(i)
    finals = {i: sites.lines(i, "final") for i in range(2)}
    assert [sorted(f["rank"] for f in finals[i]) for i in range(2)] == [[0], [0, 1]], finals
    leaders = [next(f for f in finals[i] if f["rank"] == 0) for i in range(2)]
    assert all(f["topology"] == "gossip" and f["round"] >= 6 and f["gossip_met"] >= 4 for f in leaders), leaders
    assert all(f["gossip_final"] == 2 for f in leaders), leaders
    assert len({f["final_digest"] for i in range(2) for f in finals[i]}) == 1, finals  # the average, everywhere
    assert finals[1][0]["digest"] == finals[1][1]["digest"], finals[1]  # the site's ranks hold one state
    rows = [r for i in range(2) for r in sites.lines(i, "round")]
    assert all(r["peers"] == 2 for r in rows if r["committed"]), rows
