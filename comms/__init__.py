"""Moving bytes: the round collective over a transport (hivemind P2P or in-process), with byte
accounting. Knows nothing of models or optimizers: it reduces flat fp32 tensors."""

from .collective import Collective
from .rounds import CollectiveConfig, RoundOutcome
from .spans import RoundKey, span_bounds, view_id
from .transport import ByteCounter, InProcNetwork, InProcTransport, PeerId, Transport, TransportError

__all__ = [
    "ByteCounter", "Collective", "CollectiveConfig", "InProcNetwork", "InProcTransport", "PeerId",
    "RoundKey", "RoundOutcome", "Transport", "TransportError", "span_bounds", "view_id",
]
