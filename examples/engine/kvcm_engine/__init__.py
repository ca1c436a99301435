"""An example inference engine on Hugging Face transformers whose KV cache is kvcm's."""

from .cache import CacheMiss, KVCMCache, StepStates, StepTables
from .engine import Backend, Engine, EngineStats, reference_outputs
from .models import FAMILIES, HYBRIDS, BuiltModel, build_model, hybrid_unsupported, kvcm_layers
from .scheduler import Request, Scheduler
from .workload import make_requests

__all__ = [
    "FAMILIES",
    "HYBRIDS",
    "Backend",
    "BuiltModel",
    "CacheMiss",
    "Engine",
    "EngineStats",
    "KVCMCache",
    "Request",
    "Scheduler",
    "StepStates",
    "StepTables",
    "build_model",
    "hybrid_unsupported",
    "kvcm_layers",
    "make_requests",
    "reference_outputs",
]
