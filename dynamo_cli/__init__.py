"""dyn: a distributed LLM inference framework after NVIDIA Dynamo."""

from dynamo_cli.engine import Engine, EngineArgs, EngineInfo, Role
from dynamo_cli.errors import DynError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.wire import GenerateChunk, GenerateRequest, LoadMetrics

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
