"""Hugging Face: a `transformers.Trainer` as a DiLoCo worker, with one added line.

    from diloco.hf import DiLoCoCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[DiLoCoCallback(inner_steps=100)])      # the one added line
    trainer.train()

When training begins (the Trainer has built its optimizer and scheduler by then) the callback wraps
the Trainer's model and optimizer in `diloco.DiLoCo`; every keyword argument but `inner_steps` goes
to it (`swarm=`, `streaming=`, `outer_optimizer=`, ...). Without `swarm=`, the swarm comes from the
launcher's environment (`diloco start/join -- python train.py` or `-- torchrun ... train.py`), and
without a launcher it is single-worker DiLoCo. Under torchrun the ranks are one site (docs/USAGE.md, "Your
own training script"). The wrapper hooks the torch optimizer inside accelerate's wrapper, so a step
that gradient accumulation or an overflowing fp16 step skips is not counted as an inner step. When
training ends, the exchange in flight is applied and a launched worker leaves the swarm. When the whole swarm's
run ends (`diloco.ending`: a peer was asked to end it), the Trainer stops at that round, as every peer does.

The learning-rate schedule, gradient clipping, mixed precision, logging and the Trainer's own
checkpoints stay the Trainer's; a Trainer that joins a running swarm steps its scheduler to the swarm's step
(`DiLoCo.swarm_step`) when training begins, so its warmup and decay continue the swarm's instead of starting
over. Evaluate the global model with
`with callback.diloco.global_weights(): trainer.evaluate()`.

`accelerate` loops need nothing special: `model, optimizer = accelerator.prepare(model, optimizer)`,
then `with diloco.DiLoCo(model, optimizer, inner_steps=H):` around the loop.

Needs the `hf` extra: `pip install "diloco[hf]"`.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise ImportError(f'diloco.hf needs transformers, which is not installed ({e}): pip install "diloco[hf]"') from e

from .compression.errors import UsageError
from .wrapper import DiLoCo


class DiLoCoCallback(TrainerCallback):
    """Makes the Trainer it is given to a DiLoCo worker (see the module docstring)."""

    def __init__(self, inner_steps: int = 100, **diloco_kwargs: Any) -> None:
        self.inner_steps = inner_steps
        self.kwargs = diloco_kwargs
        self.diloco: DiLoCo | None = None
        """The wrapper, once training began (its `round`, `digest`, `reports`, `global_weights()`)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, *, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **_: Any) -> None:
        if model is None or optimizer is None:
            raise UsageError("DiLoCoCallback needs the Trainer's model and optimizer when training begins; "
                               "pass it in Trainer(callbacks=[...]) rather than calling it yourself")
        self.diloco = DiLoCo(model, optimizer, inner_steps=self.inner_steps, **self.kwargs)
        self.diloco.attach()
        if lr_scheduler is not None:  # no further than the Trainer's own schedule goes
            fast_forward(lr_scheduler, min(self.diloco.swarm_step, state.max_steps or 0) - state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.diloco is not None and self.diloco.ended:  # the whole swarm's run ended (`diloco.ending`)
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.diloco is not None:
            self.diloco.detach()


def fast_forward(scheduler: Any, steps: int) -> None:
    """Step a torch lr `scheduler` `steps` times without optimizer steps: a joiner's schedule continues from the
    swarm's step (torch's warning that the scheduler stepped before the optimizer is beside the point here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
        for _ in range(max(0, steps)):
            scheduler.step()
