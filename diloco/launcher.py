"""`diloco start/join [options] -- CMD [ARGS...]`: the user's own training command as this site's worker.

The launcher resolves the swarm's settings once (secret, identity, run id, compression, timeouts,
addresses), hands them to the command in its environment (`diloco.environment`), and supervises it:

- it prints the line others run to join once the site's peer is up;
- SIGINT and SIGTERM go to the command's process group (the worker leaves the swarm at its next
  step, applying what is in flight), and the launcher exits with the command's exit code;
- SIGUSR2 asks for the end of the whole swarm's run (`diloco.ending`): the launcher creates the file
  `DILOCO_END_FILE` names, and the worker announces the round every peer ends at;
- a command that fails is started again, up to `--max-restarts` times. The new process keeps the
  site's peer id (an identity file) and listening port, rejoins through the members the old one
  last knew, and downloads the swarm's state (or resumes from `--checkpoint-dir`);
- its command's processes get glibc's malloc asking for transparent huge pages for large buffers
  (`diloco.hostmem`), so a round does not fault its buffers in 4 KiB at a time;
- nothing outlives it, even when it is SIGKILLed: every process of the launch (torchrun, its ranks,
  their p2pd daemons) carries `DILOCO_LAUNCH_ID`, and a reaper process that the launcher's death
  wakes takes them all down (`diloco.peers.reaper`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .compression.errors import DiLoCoError
from .environment import LAUNCH_ID, Launch
from .hostmem import with_huge_pages
from .lines import read_lines
from .peers.reaper import Reaper, kill_tagged

SEPARATOR = "--"


class LaunchError(DiLoCoError, ValueError):
    """The command or the launcher's options are unusable; the message names the fix."""


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """(the launcher's own arguments, the command after the first `--`, or None when there is none)."""
    args = list(argv)
    if SEPARATOR not in args:
        return args, None
    at = args.index(SEPARATOR)
    return args[:at], args[at + 1:]


def check_command(command: Sequence[str], max_restarts: int) -> None:
    """Raise LaunchError unless `command` can be started and `max_restarts` makes sense."""
    if not command:
        raise LaunchError("`--` must be followed by the command to run, e.g. "
                          "`diloco start -- torchrun --nproc-per-node 2 train.py` or `-- python train.py`")
    exe = command[0]
    if shutil.which(exe) is None and not (os.sep in exe and os.access(exe, os.X_OK)):
        raise LaunchError(f"command not found: {exe!r}; give a program on PATH or a path to an executable "
                          "(e.g. `python train.py`, `torchrun ...`)")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0 (0: never restart), got {max_restarts}")


def free_port(host: str) -> int:
    """A TCP port free on `host` now, for the site's daemon to listen on: the site keeps it across restarts, so its
    address stays valid. It is drawn below the kernel's ephemeral range (`ephemeral_ports`), which every outgoing
    connection and every socket bound to port 0 takes its port from: a port from that range, free now, could be
    handed to one of them in the seconds before the daemon binds it ("address already in use")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, _ = ephemeral_ports()
    candidates = random.sample(range(PORTS_FROM, low), min(64, low - PORTS_FROM)) if low > PORTS_FROM else []
    for port in [*candidates, 0]:  # 0: the kernel's choice, if nothing below its range is free
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise LaunchError(f"no free TCP port on {host}: give one with --port")


PORTS_FROM = 10000
"""The lowest port `free_port` draws (below it: well-known and registered services)."""


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and port-0 binds (Linux's default where it cannot be
    read)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Supervisor:
    """Runs `command` as the site's worker until it succeeds, is stopped, or runs out of restarts."""

    command: list[str]
    launch: Launch
    max_restarts: int = 0
    on_address: Callable[[list[str]], None] = lambda addrs: None
    """Called once, with the site peer's addresses, when they first appear."""
    say: Callable[[str], None] = lambda text: print(f"diloco: {text}", file=sys.stderr, flush=True)
    poll: float = 0.1

    def __post_init__(self) -> None:
        self.token = secrets.token_hex(8)
        self.stopping: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._announced = False

    def run(self) -> int:
        reaper = Reaper()  # if we die, by any signal, it takes every process of this launch down
        reaper.watch_env(LAUNCH_ID, self.token)
        end_file = Path(self.launch.end_file or Path(tempfile.gettempdir()) / f"diloco-end-{self.token}")
        self.launch = dataclasses.replace(self.launch, end_file=str(end_file))
        saved = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        saved[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._end)
        try:
            peers = self.launch.peers
            for attempt in range(self.max_restarts + 1):
                code = self._run_once(dataclasses.replace(self.launch, restart=attempt, peers=peers))
                if self.stopping is not None or code == 0:
                    return code
                if attempt == self.max_restarts:
                    if self.max_restarts:
                        self.say(f"the command exited with {code} after {attempt} restart(s); giving up")
                    return code
                peers = self._rejoin_through()
                self.say(f"the command exited with {code}; restarting it ({attempt + 1} of {self.max_restarts}), "
                         f"rejoining through {len(peers)} known address(es)")
            return 1  # unreachable: the loop returns
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            end_file.unlink(missing_ok=True)
            reaper.close()  # sweeps whatever of the launch is still running

    def _run_once(self, launch: Launch) -> int:
        env = with_huge_pages({k: v for k, v in os.environ.items() if k != "DILOCO_SECRET"})  # the secret: a file
        env.update(launch.to_env())
        env[LAUNCH_ID] = self.token
        self._proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        try:
            while self._proc.poll() is None:
                self._announce()
                time.sleep(self.poll)
            self._announce()
            return exit_code(self._proc.returncode)
        finally:
            self._proc = None
            kill_tagged(LAUNCH_ID, self.token)  # its leftovers (ranks torchrun did not end, daemons) before a restart

    def _announce(self) -> None:
        if self._announced or not self.launch.address_file:
            return
        addrs = read_lines(self.launch.address_file)
        if addrs:
            self._announced = True
            self.on_address(addrs)

    def _rejoin_through(self) -> tuple[str, ...]:
        """Addresses for a restarted command: the members its predecessor last knew, then the original ones."""
        known = read_lines(self.launch.peers_file) if self.launch.peers_file else []
        ours = set(read_lines(self.launch.address_file)) if self.launch.address_file else set()
        return tuple(dict.fromkeys(a for a in [*known, *self.launch.peers] if a not in ours))

    def _end(self, _signum: int, _frame: object) -> None:
        """SIGUSR2: end the whole swarm's run; the worker reads the file at its next synchronization slot (and a
        restarted one at its first)."""
        if self.launch.end_file:
            Path(self.launch.end_file).touch()
            self.say("asked to end the whole run: the worker announces the round every peer ends at")

    def _forward(self, signum: int, _frame: object) -> None:
        """Ctrl-C or SIGTERM: pass it to the command's process group; the worker leaves gracefully. A second
        one is passed on as well (the worker then stops at once)."""
        self.stopping = signum
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass


def terminate(procs: Sequence[subprocess.Popen[Any]], timeout: float = 60.0) -> None:
    """SIGTERM every process of `procs` still running (each leaves its swarm gracefully), then wait up to
    `timeout` seconds for them all and SIGKILL those still there (their reapers take their daemons down)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_dir() -> Path:
    """A private directory (mode 700) for the launch's files: identity key, address files, a secret copy."""
    return Path(tempfile.mkdtemp(prefix="diloco-launch-"))


def private_copy(directory: Path, name: str, text: str) -> str:
    """Write `text` to a new file readable by its owner only; its path."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return str(path)
