"""An example inference engine on Hugging Face transformers whose KV cache is kvcm's."""

from .cache import CacheMiss, KVCMCache, StepStates, StepTables
from .engine import Backend, Engine, EngineStats, reference_outputs
from .models import (
    FAMILIES,
    HYBRIDS,
    STATE_PATHS,
    BuiltModel,
    StatePath,
    UnsupportedFamily,
    build_model,
    hybrid_unsupported,
    kvcm_layers,
    state_path,
)
from .scheduler import Request, Scheduler
from .workload import make_requests

__all__ = [
    "FAMILIES",
    "HYBRIDS",
    "STATE_PATHS",
    "Backend",
    "BuiltModel",
    "CacheMiss",
    "Engine",
    "EngineStats",
    "KVCMCache",
    "Request",
    "Scheduler",
    "StatePath",
    "StepStates",
    "StepTables",
    "UnsupportedFamily",
    "build_model",
    "hybrid_unsupported",
    "kvcm_layers",
    "make_requests",
    "reference_outputs",
    "state_path",
]
