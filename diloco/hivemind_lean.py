"""Import hivemind's peer-to-peer and DHT layers without the rest of hivemind.

hivemind's package ``__init__`` imports its averager, mixture-of-experts and optimizer, and with them scipy: about
1 CPU-second of every process that imports any hivemind module (5.4 against 4.4 CPU-s for diloco's imports on the
2-core CI machine, docs/BENCHMARKS.md "The test suite"). diloco uses only ``hivemind.p2p``, ``hivemind.dht`` and ``hivemind.utils``.

``register()`` puts the package in ``sys.modules`` without running its ``__init__``, so importing those submodules
imports only what they need. The first attribute read from the package itself (``hivemind.DHT``,
``from hivemind import Optimizer``, ``hivemind.__version__``) runs the ``__init__`` then, so code beside diloco that
wants all of hivemind still gets all of it. Nothing changes if hivemind was imported before diloco.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

_lock = threading.RLock()


def register() -> None:
    """Make ``import hivemind.<submodule>`` skip the package's ``__init__`` until the package's own names are read."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed (an import of it fails as it would have) or not a package
    package = importlib.util.module_from_spec(spec)
    running: list[int] = []  # the thread running the package's __init__ (while it runs)

    def complete(name: str) -> object:
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:  # `import hivemind.p2p.x as y` inside hivemind.p2p, before p2p is bound to the package
            return submodule
        with _lock:  # other threads wait here while one runs the __init__
            if running and running[0] == threading.get_ident():
                raise AttributeError(name)  # a read inside the __init__: the name is not there yet, as in any import
            if package.__dict__.get("__getattr__") is complete:
                running.append(threading.get_ident())
                try:
                    spec.loader.exec_module(package)  # type: ignore[union-attr]
                finally:
                    running.clear()
                del package.__dict__["__getattr__"]  # only once it ran: one that failed runs again at the next read
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'hivemind' has no attribute {name!r}") from None

    package.__getattr__ = complete  # type: ignore[method-assign]
    sys.modules["hivemind"] = package
