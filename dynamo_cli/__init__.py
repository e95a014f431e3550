"""dyn: a distributed LLM inference framework after NVIDIA Dynamo."""

from dynamo_cli.engine import Engine, EngineArgs, EngineInfo, GenerateChunk, GenerateRequest, LoadMetrics, Role
from dynamo_cli.errors import DynError
from dynamo_cli.kv.events import KvEventBatch

__version__ = "0.1.0"

__all__ = [
    "DynError",
    "Engine",
    "EngineArgs",
    "EngineInfo",
    "GenerateChunk",
    "GenerateRequest",
    "KvEventBatch",
    "LoadMetrics",
    "Role",
    "__version__",
]
