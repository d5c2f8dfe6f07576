"""One exception root: every exception class the package defines derives from `diloco.DiLoCoError`, and the
classes keep the standard bases users caught before (a `ConfigError` is still a `ValueError`)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import diloco
from diloco.compression.errors import DiLoCoError

from test_layering import modules

pytestmark = pytest.mark.unit

OUTSIDE = {
    "diloco.sim.faults.Killed": "a simulated SIGKILL: a BaseException, so that no `except Exception` survives it",
    "diloco.ending.RunEnded": "the whole run's end, not an error: a SystemExit with status 0 that no `except "
                              "DiLoCoError` (nor `except Exception`) may swallow",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found = {}
    for name in modules():
        if name == "diloco.__main__" or name == "diloco.hf" and importlib.util.find_spec("transformers") is None:
            continue
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return found


def test_every_exception_class_of_the_package_derives_from_the_root():
    found = _exception_classes()
    assert len(found) >= 20 and set(OUTSIDE) <= set(found)  # the walk sees the package's classes
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, DiLoCoError) and name not in OUTSIDE)
    assert not strays, f"exception classes outside diloco.DiLoCoError: {strays}"


@pytest.mark.parametrize("cls, base", [
    (diloco.ConfigError, ValueError), (diloco.SpecError, ValueError), (diloco.FragmentError, ValueError),
    (diloco.SwarmError, RuntimeError), (diloco.Banned, RuntimeError), (diloco.HandshakeError, RuntimeError),
    (diloco.UsageError, RuntimeError),
])
def test_the_old_bases_stay(cls, base):
    assert issubclass(cls, DiLoCoError) and issubclass(cls, base)


def test_one_clause_catches_what_the_wrapper_raises():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in ({"inner_steps": 0}, {"compression": "q8:3"}, {"compression": "nonsense"}):
        with pytest.raises(diloco.DiLoCoError) as info:
            diloco.DiLoCo(model, opt, swarm=None, **bad)
        assert str(info.value)  # says what was wrong
    d = diloco.DiLoCo(model, opt, swarm=None, inner_steps=2,
                      streaming=diloco.StreamingConfig(outer_overlap="delayed"))
    with pytest.raises(diloco.UsageError, match="flush"):
        d.sync()


def test_a_cpu_model_without_flushing_subnormals_is_told_once_how_to(monkeypatch, caplog):
    import logging

    import torch

    import diloco.wrapper as wrapper_module
    from diloco import DiLoCo

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    monkeypatch.setattr(wrapper_module, "_TOLD", set())
    caplog.set_level(logging.WARNING, logger="diloco.wrapper")
    try:
        torch.set_flush_denormal(True)
        DiLoCo(*build(), swarm=None, inner_steps=2)
        assert "subnormals_not_flushed" not in caplog.text  # flushing: nothing to say
        torch.set_flush_denormal(False)
        for _ in range(2):
            DiLoCo(*build(), swarm=None, inner_steps=2)
        assert caplog.text.count("event=subnormals_not_flushed fix=torch.set_flush_denormal(True)") == 1
    finally:
        torch.set_flush_denormal(False)  # torch's default (the setting is this thread's)


def test_a_swarm_whose_event_loop_started_before_the_script_flushed_is_told_once(monkeypatch, caplog):
    """A script that flushes subnormals only after `Swarm.start/join` started the swarm's event loop is told to do it
    before (its training thread flushes, the loop does not); one that flushes first is told nothing."""
    import logging

    import torch

    import diloco.wrapper as wrapper_module
    from diloco import DiLoCo, Swarm, SwarmConfig
    from diloco.comms import InProcNetwork
    from diloco.comms.loop import LoopThread
    from diloco.peers import InProcBoard

    monkeypatch.setattr(wrapper_module, "_TOLD", set())
    caplog.set_level(logging.WARNING, logger="diloco.wrapper")
    network, board = InProcNetwork(), InProcBoard()
    loops, swarms = [], []

    def swarm(name: str) -> Swarm:
        loops.append(LoopThread())
        swarms.append(Swarm.in_process(network, board, name, SwarmConfig(run_id="loop"), loops[-1]))
        return swarms[-1]

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        torch.set_flush_denormal(True)
        DiLoCo(*build(), swarm=swarm("first"), inner_steps=2)  # flushed before the swarm: its loop flushes too
        assert "subnormals_not_flushed" not in caplog.text
        torch.set_flush_denormal(False)
        late = swarm("late")
        torch.set_flush_denormal(True)
        for _ in range(2):
            DiLoCo(*build(), swarm=late, inner_steps=2)
        assert caplog.text.count("event=subnormals_not_flushed_in_swarm fix=torch.set_flush_denormal(True) before "
                                 "Swarm.start/join") == 1
    finally:
        torch.set_flush_denormal(False)
        for s in swarms:
            s.close()
        for loop in loops:
            loop.stop()


def test_the_bundled_peer_and_the_simulator_flush_subnormals_in_their_swarms_event_loop_too(monkeypatch, tmp_path):
    """The setting is a thread's own, taken at a thread's start from its starter: `diloco start` and `diloco
    simulate` flush before their swarm starts its event loop (which decodes and averages), so that thread flushes too,
    as a script's does when it sets it first (docs/USAGE.md); the calling thread's setting is restored after. Both
    run here, in this process: the real command (`cli_util.invoke`, with its own daemon) and the simulator."""
    import signal

    from cli_util import invoke

    import diloco.connect as connect_module
    import diloco.sim.simulate as simulate_module
    from diloco.comms.loop import LoopThread
    from diloco.config import SwarmConfig
    from diloco.job.train import JobConfig
    from diloco.wrapper import flushes_subnormals

    seen: list[bool] = []

    async def flushes() -> bool:
        return flushes_subnormals()

    class Recorded(LoopThread):  # what its thread's arithmetic does, read on that thread once it runs
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            seen.append(self.run(flushes(), timeout=10))

    assert not flushes_subnormals()
    monkeypatch.setattr(simulate_module, "LoopThread", Recorded)
    job = JobConfig(rounds=1, inner_steps=2, d_model=16, n_layer=1, batch_size=2, eval_batches=1, corpus_bytes=1 << 20)
    simulate_module.simulate(job, 2, swarm=SwarmConfig(run_id="flush"), timeout=120)
    assert seen == [True] and not flushes_subnormals()

    monkeypatch.setattr(connect_module, "LoopThread", Recorded)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the peer's handlers are not this test process's
    monkeypatch.chdir(tmp_path)  # its new secret file goes here
    out = invoke(["start", "--run-id", "flush", "--rounds", "1", "-H", "2", "--d-model", "16", "--layers", "1",
                  "--batch-size", "2", "--host", "127.0.0.1"], env={"DILOCO_SECRET": "s" * 32})
    assert out.exit_code == 0, (out.stderr[-2000:], out.exception)
    assert seen == [True, True] and not flushes_subnormals()
