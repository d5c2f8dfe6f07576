"""How the p2p daemon is started (comms/p2p.py): in a session of its own, with `DAEMON_ENV`, and nothing else."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from diloco.comms import p2p

pytestmark = pytest.mark.unit

PROBE = "import os; print(os.getsid(0) == os.getpid(), os.environ.get('LIBP2P_TCP_REUSEPORT'))"


async def _spawn(program: str = sys.executable) -> str:
    """A child started the way hivemind starts p2pd (asyncio's create_subprocess_exec, looked up at call time):
    whether it leads a session of its own, and the daemon's variable it sees."""
    proc = await asyncio.subprocess.create_subprocess_exec(program, "-c", PROBE, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode().strip()


def test_only_the_daemon_started_inside_the_block_gets_its_own_session_and_variable(tmp_path):
    """Inside `_daemon_in_own_session` a p2pd gets its own session and `DAEMON_ENV`, and is listed (here a Python
    under that name); another program started there, or a p2pd started meanwhile by another task that did not enter
    the block, by another thread's loop, or after the block, is started as asyncio would."""
    p2pd = tmp_path / "p2pd"
    p2pd.symlink_to(sys.executable)
    elsewhere: list[str] = []

    def other_thread() -> None:
        elsewhere.append(asyncio.run(_spawn(str(p2pd))))

    async def main() -> tuple[str, str, str, list[str]]:
        gate = asyncio.Event()

        async def bystander() -> str:  # a task of the same loop, started before the block
            await gate.wait()
            return await _spawn(str(p2pd))

        side = asyncio.create_task(bystander())
        with p2p._daemon_in_own_session() as spawned:
            gate.set()
            thread = threading.Thread(target=other_thread)
            thread.start()
            inside = await _spawn(str(p2pd))
            other = await _spawn()
            beside = await side
            thread.join(60)
        after = await _spawn(str(p2pd))
        return inside, other, beside, after, [args[0] for _, args in spawned]

    inside, other, beside, after, listed = asyncio.run(main())
    assert inside == "True false"
    assert other == beside == after == elsewhere[0] == "False None", (other, beside, after, elsewhere)
    assert listed == [str(p2pd)]
