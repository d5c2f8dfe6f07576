"""The test suite's child processes (peers, launchers, torchrun ranks) start without importing TorchDynamo.

torch imports `torch._dynamo` the first time an optimizer is built or stepped (`torch._disable_dynamo` around
`add_param_group`, `zero_grad`, `state_dict`, the functional Adam/AdamW/SGD; `_use_grad_for_differentiable` around
every `step`), to tell the compiler to leave those frames alone or to break its graph there. That import is ~1.3 of
the ~3 CPU-seconds a `diloco start/join` peer or an example's rank spends starting on the 2-core CI machine
(`python -X importtime -c "import torch._dynamo"`), and the suite starts some 150 such processes. None of them
compiles anything, and no frame can be under the compiler before `torch._dynamo` is imported (`torch.compile`
imports it first).

tests/conftest.py puts this directory first on `PYTHONPATH`, so every Python process the suite starts runs this
file at start-up (`site` imports `sitecustomize`). It wraps those two torch decorators as torch defines them: while
`torch._dynamo` is not imported, the decorated function runs directly (`step` in the grad mode torch's wrapper sets:
`defaults["differentiable"]`); once it is, torch's own wrapper runs, so a process that compiles gets exactly torch's
behaviour from then on (tests/test_leanstart.py). The product does not do this: a user's process is untouched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

DYNAMO = "torch._dynamo"


def lean_disable_dynamo(original):
    """`torch._compile._disable_dynamo` that calls the function itself while TorchDynamo is not imported."""
    def _disable_dynamo(fn=None, recursive=True):
        if fn is None:  # `@torch._disable_dynamo(recursive=False)`
            return functools.partial(_disable_dynamo, recursive=recursive)
        disabled = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if DYNAMO not in sys.modules:
                return fn(*args, **kwargs)
            return disabled(*args, **kwargs)
        return inner
    return _disable_dynamo


def lean_use_grad(original):
    """`torch.optim.optimizer._use_grad_for_differentiable` that only sets the grad mode while TorchDynamo is not
    imported (its graph breaks are for the compiler)."""
    def _use_grad_for_differentiable(func):
        with_breaks = original(func)

        @functools.wraps(func)
        def _use_grad(*args, **kwargs):
            if DYNAMO in sys.modules:
                return with_breaks(*args, **kwargs)
            import torch
            before = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(before)
        return _use_grad
    return _use_grad_for_differentiable


PATCHES = {"torch._compile": ("_disable_dynamo", lean_disable_dynamo),
           "torch.optim.optimizer": ("_use_grad_for_differentiable", lean_use_grad)}
"""Module -> (its decorator, what wraps it): applied as the module finishes loading, before anything imports it."""


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        attr, wrap = PATCHES[self.name]
        original = getattr(module, attr, None)
        if callable(original):  # a torch without it (another version) is left as it is
            setattr(module, attr, wrap(original))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.left = set(PATCHES)

    def find_spec(self, name, path, target=None):
        if name not in self.left:
            return None
        self.left.discard(name)
        if not self.left:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, name)
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _Finder())
