"""diloco: DiLoCo training across machines joined by slow, unreliable links.

Workers take many local inner steps, then exchange pseudo-gradients (θ_global − θ_local) over a
hivemind peer-to-peer swarm and apply them with an outer Nesterov optimizer. See README.md.

    import diloco
    swarm = diloco.Swarm.join([ADDR], diloco.SwarmConfig(run_id="my-run", secret=SECRET))
    with diloco.DiLoCo(model, optimizer, swarm=swarm, inner_steps=100) as d:
        ...  # your loop, unchanged
"""

from .hivemind_lean import register as _lean_hivemind

_lean_hivemind()  # first: before anything below imports a hivemind module

from . import credentials  # noqa: E402
from .accounting import Usage
from .comms import CollectiveConfig
from .comms.hello import HandshakeError
from .comms.robust import RobustConfig
from .compression.errors import ConfigError, DiLoCoError, SpecError, UsageError
from .config import SwarmConfig
from .fragments import FragmentError, StreamingConfig
from .outer import nesterov
from .swarm import Banned, Swarm, SwarmError
from .wrapper import DiLoCo, RoundReport

__version__ = "0.1.0"

__all__ = ["Banned", "CollectiveConfig", "ConfigError", "DiLoCo", "DiLoCoError", "FragmentError",
           "HandshakeError", "RobustConfig", "RoundReport", "SpecError", "StreamingConfig", "Swarm", "SwarmConfig",
           "SwarmError", "Usage", "UsageError", "credentials", "nesterov", "__version__"]
