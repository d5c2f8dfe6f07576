"""Hugging Face: a Trainer with `DiLoCoCallback`, an accelerate loop with the plain wrapper, and a
real 2-peer swarm driven by Trainer processes under the launcher. Tiny GPT-2 and Llama models are
built from configs inside the test: nothing is downloaded."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diloco import DiLoCo
from fresh import fresh_python

# transformers, accelerate and hf_trainer's GPT-2 and Llama (2.3 CPU-s to import) are imported by the tests that
# use them, not by every pytest worker that collects this module
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py")


@pytest.mark.swarm
def test_a_trainer_with_the_callback_is_a_diloco_worker(tmp_path):
    """GPT-2 (tied input and output embeddings), gradient accumulation 2, a cosine schedule: the inner
    steps are the Trainer's optimizer steps, a round every H of them, the tie survives, and the
    training loss falls."""
    from hf_trainer import Counting, build
    from transformers import Trainer, TrainingArguments

    from diloco.hf import DiLoCoCallback

    callback = DiLoCoCallback(inner_steps=5)
    model = build("gpt2")
    trainer = Trainer(model=model, train_dataset=Counting(512, 0), callbacks=[callback],
                      args=TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=8,
                                             gradient_accumulation_steps=2, learning_rate=3e-3, report_to=[],
                                             lr_scheduler_type="cosine", save_strategy="no", use_cpu=True,
                                             logging_steps=5, disable_tqdm=True))
    trainer.train()
    d = callback.diloco
    assert d is not None and d.steps == 20 and d.round == 4
    assert all(r.committed for r in d.reports)
    assert model.lm_head.weight is model.transformer.wte.weight
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses
    assert d._hook is None  # detached when training ended
    # the trained model out: save_pretrained of the global weights, which from_pretrained reads, tie included
    d.save_final(tmp_path / "final")
    again = type(model).from_pretrained(str(tmp_path / "final"))
    with d.global_weights():
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert again.lm_head.weight is again.transformer.wte.weight


@pytest.mark.swarm
def test_a_trainer_that_joins_late_continues_the_swarms_lr_schedule(tmp_path, monkeypatch):
    """A worker whose attach took a state 12 steps into the swarm (as a joiner's download does): the Trainer's
    scheduler starts at the swarm's step 12, where a worker that trained from the start is."""
    from hf_trainer import Counting, build
    from transformers import Trainer, TrainingArguments

    from diloco.hf import DiLoCoCallback

    attach = DiLoCo.attach

    def joined(d: DiLoCo) -> None:
        attach(d)
        d.member.standing.offset = 12  # what a download from a peer 12 steps in sets

    monkeypatch.setattr(DiLoCo, "attach", joined)
    lrs: list[float] = []

    def trainer(callbacks: list) -> Trainer:
        return Trainer(model=build("gpt2"), train_dataset=Counting(256, 0), callbacks=callbacks,
                       args=TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=4,
                                              learning_rate=3e-3, warmup_steps=10, lr_scheduler_type="cosine",
                                              report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True))

    callback = DiLoCoCallback(inner_steps=5)
    t = trainer([callback])
    t.create_optimizer_and_scheduler(num_training_steps=20)
    t.state.max_steps = 20  # as `train()` sets it before training begins
    callback.on_train_begin(t.args, t.state, t.control, model=t.model, optimizer=t.optimizer,
                            lr_scheduler=t.lr_scheduler)
    lrs.append(t.lr_scheduler.get_last_lr()[0])
    reference = trainer([])
    reference.create_optimizer_and_scheduler(num_training_steps=20)
    for _ in range(12):
        reference.optimizer.step()
        reference.lr_scheduler.step()
    assert callback.diloco.swarm_step == 12
    assert lrs == [reference.lr_scheduler.get_last_lr()[0]] and lrs[0] != 3e-3 * 1 / 10
    callback.diloco.detach()


@pytest.mark.swarm
def test_an_accelerate_loop_with_the_wrapper():
    """Llama through accelerate's prepare, with its gradient accumulation: the wrapper hooks the torch
    optimizer inside AcceleratedOptimizer, so a micro-batch without an optimizer step is no inner step."""
    from accelerate import Accelerator
    from hf_trainer import Counting, build

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(Counting(256, 1), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = None
    with DiLoCo(model, optimizer, inner_steps=4) as d:
        for batch in loader:  # 32 micro-batches: 16 optimizer steps
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                first = first if first is not None else loss.item()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    assert d.steps == 16 and d.round == 4
    assert loss.item() < first


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_real_two_peer_swarm_driven_by_trainer(tmp_path):
    """Two Trainer processes, each started by the launcher, train a tiny Llama together and end on one
    global-state digest."""
    env = {**os.environ, "DILOCO_SECRET": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    run_id = f"hf-{secrets.token_hex(3)}"
    common = ["--run-id", run_id, "--wait-for", "2", "--gather-timeout", "20", "--round-timeout", "10"]
    script = [sys.executable, SCRIPT, "--arch", "llama", "--steps", "30", "--inner-steps", "10"]
    procs = []
    try:
        for i in range(2):
            verb = ["start"] if i == 0 else ["join", _address(tmp_path / "p0.addr", procs[0])]
            with open(tmp_path / f"p{i}.log", "wb") as log:  # the launcher holds its own copy
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "diloco", *verb, *common, "--metrics", str(tmp_path / f"p{i}.jsonl"),
                     "--address-file", str(tmp_path / f"p{i}.addr"), "--", *script, "--seed", str(i)],
                    stdout=log, stderr=subprocess.STDOUT, env=env))
        for i, p in enumerate(procs):
            assert p.wait(timeout=240) == 0, (tmp_path / f"p{i}.log").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    finals = [json.loads(line) for i in range(2) for line in (tmp_path / f"p{i}.jsonl").read_text().splitlines()
              if '"final"' in line]
    assert len(finals) == 2 and {f["round"] for f in finals} == {3} and len({f["digest"] for f in finals}) == 1, finals
    together = [json.loads(line) for line in (tmp_path / "p1.jsonl").read_text().splitlines() if '"round"' in line]
    assert any(r["committed"] and r["peers"] == 2 for r in together), together


def _address(path: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, "the first peer never wrote its address"
        time.sleep(0.1)
    return path.read_text().split()[0]


def test_without_transformers_the_import_names_the_extra():
    out = fresh_python("try:\n    import diloco.hf\nexcept ImportError as e:\n    print(e)\n", without=["transformers"],
                       timeout=120)
    assert out.returncode == 0 and 'pip install "diloco[hf]"' in out.stdout, (out.stdout, out.stderr)
